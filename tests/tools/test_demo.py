"""tools/demo.py in this process: the suite's shared tiny ASR and TTS runs served on a free port of
127.0.0.1; a recording is transcribed as transcribe.py transcribes it, a sentence comes back as
audio and a picture; every bad input is answered with one line (in the page's JSON and in the log),
never a traceback; only sealed folders of the recipes it serves are loaded. (In a real browser:
tests/tools/test_browser.py.)"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import soundfile as sf

from common.data.manifest import read_librispeech
from common.training.faults import UsageError
from tests.harness.recipe_import import recipe_modules
from tools import demo

slow = pytest.mark.slow


def trained_asr(reference, corpus: Path) -> Path:
    """The suite's shared 30-step ASR run (tests/recipes/test_asr.py's), read only."""
    from tests.recipes import test_asr

    return reference("asr", 1, lambda out: test_asr.args_for(corpus, out, *test_asr.SHORT_RUN))


def trained_tts(reference, corpus: Path) -> Path:
    """The suite's shared 2-step TTS run (tests/recipes/test_tts.py's judge test trains the same), read only."""
    from tests.recipes import test_tts

    return reference("tts", 1, lambda out: test_tts.args_for(corpus, out, "--max_steps", "2", "--save_steps", "2",
                                                             "--eval_steps", "0"))


def options(*models, **limits) -> argparse.Namespace:
    defaults = dict(vocoder=None, griffin_lim_iters=4, decoding="greedy", lm=None, max_upload_mb=20.0,
                    max_audio_seconds=60.0, max_text_chars=500)
    return argparse.Namespace(models=[str(m) for m in models], **{**defaults, **limits})


@contextlib.contextmanager
def serving(args: argparse.Namespace):
    """The demo for `args`, serving from a thread; yields its base URL."""
    server = demo.make_server(demo.load_models(args), "127.0.0.1", 0, args.max_upload_mb)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def post(url: str, body: bytes) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@slow
def test_the_demo_transcribes_speaks_and_refuses_bad_input_in_one_line(tiny_corpus, reference, tmp_path, capfd):
    asr, tts = trained_asr(reference, tiny_corpus), trained_tts(reference, tiny_corpus)
    test = read_librispeech(tiny_corpus / "librispeech", "test")
    transcribe_py = recipe_modules("asr", "transcribe").transcribe
    with serving(options(asr, tts / "final", max_upload_mb=1.0, max_audio_seconds=6.0, max_text_chars=40)) as url:
        with urllib.request.urlopen(url + "/", timeout=30) as r:
            page = r.read().decode()
        assert page.count("<section") == 2 and f"ASR: {asr}" in page and f"TTS: {tts / 'final'}" in page
        assert "http" not in page  # nothing from the network: the page talks to /api/<n> only

        # ASR: an uploaded FLAC, read and decoded as transcribe.py does
        cfg, transcribe = transcribe_py.load_transcriber(transcribe_py.TranscribeConfig(checkpoint=str(asr)))
        status, answer = post(url + "/api/0", Path(test[0]["path"]).read_bytes())
        assert status == 200 and answer["text"] == transcribe(transcribe_py.read_audio_file(test[0]["path"], 16000))

        # TTS: a sentence → a WAV at the voice's rate with samples, and a PNG
        status, answer = post(url + "/api/1", json.dumps({"text": "A cat, said she."}).encode())
        assert status == 200 and answer["text"] == "a cat, said she."
        wav, rate = sf.read(io.BytesIO(base64.b64decode(answer["audio"].split(",", 1)[1])))
        assert rate == 22050 and len(wav) > 256 and answer["seconds"] == pytest.approx(len(wav) / rate, abs=0.01)
        assert base64.b64decode(answer["image"].split(",", 1)[1])[:4] == b"\x89PNG"

        capfd.readouterr()
        sf.write(tmp_path / "long.wav", [0.1, -0.1] * 28000, 8000)  # 7 s
        refused = {  # what is sent → what the page shows
            ("/api/0", b"not audio at all" * 10): "the recording: soundfile cannot read it as audio",
            ("/api/0", (tmp_path / "long.wav").read_bytes()): "the recording is 7.0 s long; this page takes at most 6 s",
            ("/api/0", b"\0" * (2**20 + 1)): "the upload is 1.0 MB; this page takes at most 1 MB",
            ("/api/1", json.dumps({"text": "ж"}).encode()): "this voice's symbols",
            ("/api/1", json.dumps({"text": "a" * 41}).encode()): "the text has 41 characters; this page speaks at most 40",
            ("/api/1", json.dumps({"text": "  "}).encode()): "type a sentence to speak",
            ("/api/1", b"{not json"): 'send JSON {"text": "a sentence"}',
        }
        for (path, body), message in refused.items():
            status, answer = post(url + path, body)
            assert status in (400, 413) and message in answer["error"] and "\n" not in answer["error"], answer
        log = capfd.readouterr().err.splitlines()
        assert len(log) == len(refused) and all(line.startswith("refused (") for line in log)
        assert "Traceback" not in "".join(log)


@slow
def test_the_demo_serves_only_sealed_folders_of_asr_and_tts(tiny_corpus, reference, tmp_path, capsys):
    tts = trained_tts(reference, tiny_corpus)
    with pytest.raises(UsageError, match="no model card naming its recipe"):
        demo.recipe_of(tts / "checkpoints" / "step_00000002")  # sealed, but a step folder
    import shutil

    copy = tmp_path / "tts"
    shutil.copytree(tts / "final", copy / "final")
    (copy / "final" / "config.yaml").write_text((copy / "final" / "config.yaml").read_text() + "\n")
    with pytest.raises(SystemExit) as stop:
        demo.main([str(copy), "--port", "0"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: model {copy / 'final'}:")
