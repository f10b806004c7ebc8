"""Try trained models in a browser: a page on localhost that transcribes a recording (ASR) and speaks
a typed sentence (TTS), one section per model given.

    python -m tools.demo outputs/asr outputs/tts
    python -m tools.demo outputs/asr/final outputs/tts --vocoder outputs/vocoder --port 8080
    # then open http://127.0.0.1:7860/ (the address is printed)

Each argument is a training output_dir or its final/: verified against its COMPLETE digests before
it is read (common.training.sealing.resolve_checkpoint, as every tool), its recipe read from the
model card final/ carries ("# asr model (speech-recipes)"). ASR: the recording (a file uploaded, or
the microphone where the browser allows it: recorded as PCM and sent as WAV) is read as
recipes/asr/transcribe.py reads a file and decoded greedily (--decoding beam, --lm as there). TTS:
recipes/tts/synthesize.py's synthesis, through its --vocoder choice (auto: the TTS run's own neural
vocoder if it has one, else Griffin-Lim; griffin_lim; a recipes/vocoder run); the page plays the audio and shows the log-mel and the alignment (which
symbol each frame speaks). Models load once, at start; a folder that cannot be served is refused
then, in one line.

Bounds: an upload of at most --max_upload_mb, a recording of at most --max_audio_seconds, a text of
at most --max_text_chars characters. A request outside them, an unreadable file or a symbol the voice
does not know is answered in the page with what is wrong and what to do, and logged as one line.

The page is our own (stdlib http.server, no dependency): Gradio would serve the same two widgets
with ~60 packages more to install and a front end of its own to keep working offline; here the whole
page is one string below, and the browser test (tests/tools/test_browser.py) drives exactly it.
It binds to 127.0.0.1 by default; --host 0.0.0.0 serves other machines too (a warning says so: there
is no authentication).
"""

from __future__ import annotations

import argparse
import base64
import importlib
import io
import json
import re
import sys
import tempfile
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from tools.recipe_import import recipe_path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("asr", "tts")  # the recipes whose final/ the page can serve
CARD = re.compile(r"# (\w+) model \(speech-recipes\)")  # the model card's first line (common.model.hf_export)


class Refusal(Exception):
    """A request the model cannot serve: its message (what is wrong, what to do) is shown in the page."""


@dataclass
class Model:
    name: str  # what the page calls it: the folder given
    kind: str  # "asr" or "tts"
    serve: Callable[[bytes], dict]  # request body → the JSON answer; raises Refusal
    lock: threading.Lock  # one request at a time per model (torch threads are already parallel)


def recipe_of(path: str) -> tuple[Path, str]:
    """(the verified folder, its recipe) for a command-line argument; a refusal is a UsageError."""
    from common.training.sealing import resolve_checkpoint
    from common.training.faults import UsageError

    folder = resolve_checkpoint(path, flag="model")
    card = folder / "README.md"
    match = CARD.match(card.read_text(encoding="utf-8")) if card.is_file() else None
    if match is None:
        raise UsageError(f"model {path}: {folder} has no model card naming its recipe (final/README.md): give a "
                         f"training output_dir or its final/ (a checkpoints/step_*/ folder has none)")
    if match.group(1) not in KINDS:
        raise UsageError(f"model {path}: a {match.group(1)} model; the demo serves {' and '.join(KINDS)} models")
    return folder, match.group(1)


def load_asr(folder: Path, args) -> Callable[[bytes], dict]:
    """An uploaded recording (any format soundfile reads) → {"text"}: recipes/asr/transcribe.py's model."""
    from common.data.loading import read_audio_file
    from common.training.faults import UsageError

    with recipe_path("asr"):
        transcribe_py = importlib.import_module("transcribe")
        cfg, transcribe = transcribe_py.load_transcriber(transcribe_py.TranscribeConfig(
            checkpoint=str(folder), decoding=args.decoding, lm=args.lm))

    def serve(body: bytes) -> dict:
        with tempfile.NamedTemporaryFile(suffix=".audio") as f:  # soundfile reads a file by its header, not its name
            f.write(body)
            f.flush()
            try:
                wav = read_audio_file(f.name, cfg.sample_rate)
            except UsageError as e:
                raise Refusal(str(e).replace(f.name, "the recording")) from None
        seconds = len(wav) / cfg.sample_rate
        if seconds > args.max_audio_seconds:
            raise Refusal(f"the recording is {seconds:.1f} s long; this page takes at most {args.max_audio_seconds:g} s: "
                          f"cut it (recipes/asr/transcribe.py takes longer files)")
        return {"text": transcribe(wav), "seconds": round(seconds, 2)}

    return serve


def load_tts(folder: Path, args) -> Callable[[bytes], dict]:
    """{"text"} → {"audio": a WAV data URL, "image": the log-mel and alignment as a PNG data URL}:
    recipes/tts/synthesize.py's model and vocoder."""
    import soundfile as sf
    import torch

    with recipe_path("tts"):
        synth = importlib.import_module("synthesize")
        audio = importlib.import_module("audio")
        model, cfg, symbols, _ = synth.load_tts(folder, synth.load_config(folder, synth.Config),
                                                synth.checkpoint_weights(folder))
        # synthesize.py's choice: --vocoder auto, the run's own vocoder if it has one (else Griffin-Lim, one
        # line); an unfinished one, or one of another mel or other data: refused, one line
        path = synth.pick_vocoder(args.vocoder or synth.AUTO, folder, cfg)
        vocoder = synth.neural_vocoder(path, cfg) if path else synth.make_vocoder(cfg, args.griffin_lim_iters)
    known = "".join(symbols.chars)

    @torch.no_grad()
    def serve(body: bytes) -> dict:
        try:
            text = str(json.loads(body)["text"]).strip()
        except (ValueError, KeyError, TypeError):
            raise Refusal('send JSON {"text": "a sentence"}') from None
        if not text:
            raise Refusal("type a sentence to speak")
        if len(text) > args.max_text_chars:
            raise Refusal(f"the text has {len(text)} characters; this page speaks at most {args.max_text_chars}: "
                          f"shorten it (recipes/tts/synthesize.py --text_file speaks longer texts line by line)")
        try:
            symbols.encode(text)
        except ValueError as e:
            raise Refusal(f"{e}; this voice's symbols: {known!r}") from None
        wav, mel, durations = synth.synthesize(model, symbols, text, vocoder)
        spoken = torch.repeat_interleave(torch.arange(len(durations)), durations.long())[: mel.shape[0]]  # symbol per frame
        hard = torch.zeros(mel.shape[0], len(durations))  # (frames, symbols), one 1 per frame
        hard[torch.arange(len(spoken)), spoken] = 1
        picture = audio.stack_images([audio.to_image(mel), audio.to_image(hard, 0, 1)])
        png, sound = io.BytesIO(), io.BytesIO()
        audio.write_png(png, picture)
        sf.write(sound, wav.numpy(), cfg.sample_rate, format="WAV", subtype="PCM_16")
        return {"audio": "data:audio/wav;base64," + base64.b64encode(sound.getvalue()).decode(),
                "image": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode(),
                "seconds": round(len(wav) / cfg.sample_rate, 2), "text": symbols.normalize(text)}

    return serve


def load_models(args) -> list[Model]:
    """Every model named on the command line, loaded once; a folder that cannot be served: UsageError."""
    models = []
    for path in args.models:
        folder, kind = recipe_of(path)
        serve = (load_asr if kind == "asr" else load_tts)(folder, args)
        models.append(Model(path, kind, serve, threading.Lock()))
    return models


DRAIN_FACTOR = 4  # an oversized body up to this many times --max_upload_mb is read before the refusal


class Handler(BaseHTTPRequestHandler):
    """GET / → the page; POST /api/<n> → model n's answer as JSON ({"error": ...} for a refusal)."""

    models: list[Model] = []
    max_upload: int = 0  # bytes

    def do_GET(self):  # noqa: N802 — http.server's name
        if self.path.split("?")[0] not in ("/", "/index.html"):
            return self.answer(404, {"error": f"no page {self.path}: the demo is at /"})
        body = page(self.models).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        match = re.fullmatch(r"/api/(\d+)", self.path)
        if not match or int(match.group(1)) >= len(self.models):
            return self.answer(404, {"error": f"no model at {self.path}"})
        model = self.models[int(match.group(1))]
        size = int(self.headers.get("Content-Length") or -1)
        if size < 0 or size > self.max_upload:
            # An answer sent while the client still writes its body (the socket then closed with unread
            # data) reaches it as a reset, not as the refusal: a body up to DRAIN_FACTOR times the limit
            # is read and dropped first; a larger one (or none declared) gets the answer and the close.
            if 0 <= size <= DRAIN_FACTOR * self.max_upload:
                self.drain(size)
            else:
                self.close_connection = True  # the body is not read: this connection serves no other request
            return self.refuse(model, 413, f"the upload is {size / 2**20:.1f} MB; this page takes at most "
                                            f"{self.max_upload / 2**20:g} MB: send a shorter recording")
        body = self.rfile.read(size)
        try:
            with model.lock:
                return self.answer(200, model.serve(body))
        except Refusal as e:
            return self.refuse(model, 400, str(e))
        except Exception as e:  # noqa: BLE001 — the server keeps serving; one line, in the page and the log
            return self.refuse(model, 500, f"the model failed on this input ({type(e).__name__}: "
                                           f"{(str(e).splitlines() or [''])[0][:300]})")

    def drain(self, size: int) -> None:
        """Read and drop `size` bytes of the request body, 1 MB at a time (never held whole)."""
        while size > 0:
            chunk = self.rfile.read(min(size, 2**20))
            if not chunk:
                break
            size -= len(chunk)

    def refuse(self, model: Model, status: int, message: str):
        print(f"refused ({model.name}): {message}", file=sys.stderr, flush=True)
        self.answer(status, {"error": message})

    def answer(self, status: int, content: dict):
        body = json.dumps(content).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 — http.server's signature; refusals are logged above
        pass


def make_server(models: list[Model], host: str, port: int, max_upload_mb: float) -> ThreadingHTTPServer:
    """The server (not yet serving: `serve_forever()`); port 0 takes a free one (server.server_port)."""
    handler = type("DemoHandler", (Handler,), {"models": models, "max_upload": int(max_upload_mb * 2**20)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True  # a browser's open connection never holds up the end
    return server


def page(models: list[Model]) -> str:
    """The page: one section per model, the script that talks to /api/<n> (no network beyond this server)."""
    import html

    sections = []
    for n, m in enumerate(models):
        name = html.escape(m.name)
        if m.kind == "asr":
            sections.append(
                f'<section class=asr data-n={n}><h2>ASR: {name}</h2><p>A recording (any format soundfile reads, '
                f'WAV, FLAC, OGG...) or the microphone:</p><input type=file accept="audio/*,.flac,.wav,.ogg"> '
                f'<button class=send>Transcribe</button> <button class=rec hidden>Record</button> '
                f'<audio controls class=heard hidden></audio><p class=out></p><p class=err role=alert></p></section>')
        else:
            sections.append(
                f'<section class=tts data-n={n}><h2>TTS: {name}</h2><textarea rows=3 cols=80 '
                f'placeholder="a sentence to speak"></textarea><br><button class=send>Speak</button>'
                f'<p class=out></p><audio controls class=spoken hidden></audio><br><img class=picture hidden '
                f'alt="log-mel (top) and alignment (bottom: the symbol each frame speaks)"><p class=err role=alert></p></section>')
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>speech-recipes demo</title><style>{CSS}"
            f"</style></head><body><h1>speech-recipes demo</h1>{''.join(sections)}<script>{JS}</script></body></html>")


CSS = """body{font:15px system-ui,sans-serif;margin:1.5em;max-width:1000px}section{border:1px solid #ccc;
padding:.5em 1em;margin:1em 0;border-radius:6px}.err{color:#b00}.out{font-size:1.2em}
img.picture{height:180px;max-width:100%;image-rendering:pixelated}"""

# The microphone: MediaRecorder would give webm/opus, which soundfile cannot read, so the page takes
# PCM from the Web Audio API and encodes a 16-bit WAV itself (wav(), below).
JS = r"""
async function post(section, body, type){
  const out=section.querySelector('.out'), err=section.querySelector('.err');
  out.textContent='…'; err.textContent='';
  try{
    const r=await fetch('/api/'+section.dataset.n,{method:'POST',headers:{'Content-Type':type},body});
    const j=await r.json(); out.textContent='';
    if(j.error){err.textContent=j.error;return null;}
    return j;
  }catch(e){out.textContent='';err.textContent='no answer from the server: '+e;return null;}
}
function wav(chunks, rate){
  const n=chunks.reduce((a,c)=>a+c.length,0), b=new DataView(new ArrayBuffer(44+2*n));
  const s=(o,t)=>{for(let i=0;i<t.length;i++)b.setUint8(o+i,t.charCodeAt(i));};
  s(0,'RIFF');b.setUint32(4,36+2*n,true);s(8,'WAVEfmt ');b.setUint32(16,16,true);b.setUint16(20,1,true);
  b.setUint16(22,1,true);b.setUint32(24,rate,true);b.setUint32(28,2*rate,true);b.setUint16(32,2,true);
  b.setUint16(34,16,true);s(36,'data');b.setUint32(40,2*n,true);
  let o=44;for(const c of chunks)for(const v of c){b.setInt16(o,Math.max(-1,Math.min(1,v))*32767,true);o+=2;}
  return new Blob([b],{type:'audio/wav'});
}
async function transcribe(section, blob){
  const heard=section.querySelector('.heard'); heard.src=URL.createObjectURL(blob); heard.hidden=false;
  const j=await post(section, blob, 'application/octet-stream');
  if(j)section.querySelector('.out').textContent=j.text;
}
for(const section of document.querySelectorAll('section.asr')){
  const file=section.querySelector('input'), rec=section.querySelector('.rec');
  section.querySelector('.send').onclick=()=>{
    if(!file.files.length){section.querySelector('.err').textContent='choose a recording first';return;}
    transcribe(section, file.files[0]);};
  if(!(navigator.mediaDevices&&window.AudioContext))continue;  // no microphone here (the page is not a secure context)
  rec.hidden=false; let stop=null;
  rec.onclick=async()=>{
    if(stop){stop();stop=null;rec.textContent='Record';return;}
    let stream;
    try{stream=await navigator.mediaDevices.getUserMedia({audio:true});}
    catch(e){section.querySelector('.err').textContent='the microphone is not available: '+e.message;return;}
    const ctx=new AudioContext(), src=ctx.createMediaStreamSource(stream), node=ctx.createScriptProcessor(4096,1,1);
    const chunks=[]; node.onaudioprocess=e=>chunks.push(new Float32Array(e.inputBuffer.getChannelData(0)));
    src.connect(node); node.connect(ctx.destination); rec.textContent='Stop';
    stop=()=>{node.disconnect();src.disconnect();stream.getTracks().forEach(t=>t.stop());ctx.close();
              transcribe(section, wav(chunks, ctx.sampleRate));};
  };
}
for(const section of document.querySelectorAll('section.tts')){
  section.querySelector('.send').onclick=async()=>{
    const j=await post(section, JSON.stringify({text:section.querySelector('textarea').value}), 'application/json');
    const spoken=section.querySelector('.spoken'), picture=section.querySelector('.picture');
    if(!j){spoken.hidden=picture.hidden=true;return;}
    section.querySelector('.out').textContent=`${j.seconds} s: ${j.text}`;
    spoken.src=j.audio; spoken.hidden=false; picture.src=j.image; picture.hidden=false;
  };
}
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a page to try trained ASR and TTS models.")
    parser.add_argument("models", nargs="+", help="training output_dirs or their final/ folders (asr, tts)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=7860, help="0: any free port (printed)")
    parser.add_argument("--vocoder", default="auto", help="auto (default): each TTS run's own vocoder, <its output_dir>/vocoder, "
                        "if it has one, else Griffin-Lim; griffin_lim; or a recipes/vocoder output_dir or final/ for the TTS models")
    parser.add_argument("--griffin_lim_iters", type=int, default=60, help="Griffin-Lim iterations, where Griffin-Lim vocodes")
    parser.add_argument("--decoding", choices=("greedy", "beam"), default="greedy", help="the ASR models' decoding")
    parser.add_argument("--lm", help="a word n-gram LM for the ASR models (recipes/asr/lm.py's folder)")
    parser.add_argument("--max_upload_mb", type=float, default=20.0, help="largest upload, MB")
    parser.add_argument("--max_audio_seconds", type=float, default=60.0, help="longest recording, seconds")
    parser.add_argument("--max_text_chars", type=int, default=500, help="longest text, characters")
    args = parser.parse_args(argv)
    from common.training.faults import UsageError

    try:
        models = load_models(args)
        server = make_server(models, args.host, args.port, args.max_upload_mb)
    except (UsageError, OSError) as e:  # a folder that cannot be served, a port taken
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host}: anyone who reaches this machine can use these models "
              f"(there is no authentication)", file=sys.stderr)
    print(f"serving {len(models)} model(s) on http://{args.host}:{server.server_port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    sys.path.insert(1, str(ROOT))  # common/ (not installed), as the recipes' scripts do
    main()
