"""A real-speech corpus from Debian's telephony prompt packages: one professional voice per language.

    apt-get install -y asterisk-core-sounds-fr asterisk-core-sounds-fr-g722
    python -m tools.real_prompts --lang fr --out data/prompts_fr

Without root (or on a machine that is not Debian's), unpack the packages anywhere and point
--sounds_root and --doc_root into the copy (`apt-get download` needs no root; the `.deb` files can
come from any Debian mirror):

    apt-get download asterisk-core-sounds-fr asterisk-core-sounds-fr-g722
    for deb in asterisk-core-sounds-fr*.deb; do dpkg-deb -x "$deb" prompts_pkg; done
    python -m tools.real_prompts --lang fr --out data/prompts_fr \
        --sounds_root prompts_pkg/usr/share/asterisk/sounds --doc_root prompts_pkg/usr/share/doc

Languages: fr (fr_CA, female), es (es_MX, female), it (it_IT, male), ru (ru_RU, female). The English
packages are kept for an outside check of this work: `--lang en` is refused.

What the packages hold: `/usr/share/asterisk/sounds/<lang>/` (a link to e.g. `fr_CA_f_June/`, made
by the package's install script: an unpacked copy has only `fr_CA_f_June/`, which is then used) with
one audio file per prompt, `<prompt id>.g722` (G.722, 16 kHz, 7 kHz bandwidth; from the `-g722`
package), in sub-folders for some (`digits/0`, `letters/a`); and the transcripts, lines
`<prompt id>: <text>`, in `/usr/share/doc/asterisk-core-sounds-<lang>/core-sounds-<lang>.txt.gz`
(from the package without suffix). G.722 is decoded with the `G722` package from PyPI (the ITU
reference decoder, bit-exact; in requirements.txt): neither soundfile nor sox reads G.722.

Text. The transcripts are notes as much as transcripts: `[ascending tones]`, `(beep)`, `<beep
ascending>`, translator remarks in parentheses, typographic quotes. Each kept prompt has
- `original`: the line as written (after the `<prompt id>:` prefix), and
- `text` (what the layouts carry): Unicode NFC; a repeated `<prompt id>:` prefix removed; every
  `[...]`, `(...)`, `<...>` removed (not spoken); quotes (" “ ” « » „) removed; ’ → '; … → ...;
  whitespace collapsed. Digits and sentence punctuation stay as written: the voice reads "1" as
  "un", and the recipes' own normalization decides what a model sees (recipes/asr/text.py).
Prompts whose text is empty after that (tones, beeps) and audio shorter than --min_seconds or longer
than --max_seconds (the recipes' data-check bounds) are left out and counted.

Split, fixed and independent of the package version: a prompt goes to test if
blake2b(prompt id) mod 100 < 10, to validation if < 20, else to train (the same prompt id lands in
the same split in every language). `prompts.tsv` in the output lists every written prompt.

Output (byte-identical for the same package, 16 kHz, 16-bit):
- `librispeech/{train,validation,test}/<spk>/<chap>/<spk>-<chap>-<utt>.flac` + `.trans.txt`:
  speaker = 1 fr, 2 es, 3 it, 4 ru; chapter = 1 train, 2 validation, 3 test; utt = the prompt's
  position in the sorted prompt ids;
- `ljspeech/wavs/<id>.wav` + `metadata.csv` (`id|original|text`), 16 kHz (the recipe resamples to
  its --sample_rate on load), same ids: sorted, the train ids come first, then validation, then
  test, so `recipes/tts/train.py --num_valid V --num_test T` with the counts printed at the end
  (also in `prompts.tsv`) holds out exactly this split;
- `prompts.tsv`: id, split, prompt id, seconds, original, text.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import re
import shutil
import sys
import unicodedata
from pathlib import Path

import numpy as np

LANGUAGES = {"fr": 1, "es": 2, "it": 3, "ru": 4}  # language → LibriSpeech speaker id
SPLITS = {"train": 1, "validation": 2, "test": 3}  # split → LibriSpeech chapter id
SAMPLE_RATE = 16000  # Hz, G.722's
G722_PIN = "G722==1.2.8"
SOUNDS_ROOT = "/usr/share/asterisk/sounds"
DOC_ROOT = "/usr/share/doc"

_MARKUP = re.compile(r"\[[^\]]*\]|\([^)]*\)|<[^>]*>")
_QUOTES = dict.fromkeys(map(ord, "\"“”«»„"), None) | {ord("’"): "'", ord("…"): "..."}


class Refusal(Exception):
    """What the user must do before this tool can run: printed as one line, exit code 2."""


def apt_line(lang: str) -> str:
    return f"apt-get install -y asterisk-core-sounds-{lang} asterisk-core-sounds-{lang}-g722"


def split_of(prompt_id: str) -> str:
    """train / validation / test from the prompt id alone (10 % test, 10 % validation)."""
    bucket = int.from_bytes(hashlib.blake2b(prompt_id.encode(), digest_size=8).digest(), "big") % 100
    return "test" if bucket < 10 else "validation" if bucket < 20 else "train"


def clean_text(prompt_id: str, original: str) -> str:
    """The spoken words of a transcript line (see the module docstring)."""
    text = unicodedata.normalize("NFC", original).strip()
    if text.startswith(f"{prompt_id}:"):  # a line that repeats its id: "conf-adminmenu: conf-adminmenu: ..."
        text = text[len(prompt_id) + 1:]
    text = _MARKUP.sub(" ", text).translate(_QUOTES)
    return " ".join(text.split())


def read_transcripts(path: Path) -> dict[str, str]:
    """prompt id → original text, from `core-sounds-<lang>.txt[.gz]` (`;` comments, a BOM allowed)."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    prompts = {}
    for line in data.decode("utf-8-sig").splitlines():
        prompt_id, sep, text = line.partition(":")
        if line.startswith(";") or not sep or not prompt_id.strip() or " " in prompt_id.strip():
            continue  # comments, blank lines, prose
        prompts.setdefault(prompt_id.strip(), text.strip())  # the first line of an id wins
    return prompts


def decode_g722(path: Path) -> np.ndarray:
    """int16 samples at 16 kHz of a raw G.722 file at 64 kbit/s (what the packages ship)."""
    from G722 import G722

    return np.asarray(G722(SAMPLE_RATE, 64000).decode(path.read_bytes()), dtype=np.int16)


def locate(lang: str, sounds_root: Path, doc_root: Path) -> tuple[Path, Path]:
    """(audio folder, transcript file) of an installed language, or a Refusal naming the apt-get line."""
    if lang == "en" or lang.startswith("en_"):
        raise Refusal("the English prompt packages are kept for an outside check of this work: "
                      f"choose one of {', '.join(LANGUAGES)}")
    if lang not in LANGUAGES:
        raise Refusal(f"--lang {lang!r}: choose one of {', '.join(LANGUAGES)}")
    sounds = sounds_root / lang
    voices = sorted(sounds_root.glob(f"{lang}_*/")) if not sounds.is_dir() else []
    if len(voices) == 1:  # an unpacked package: no alternatives link <lang> → <lang>_<region>_<voice>
        sounds = voices[0]
    doc = doc_root / f"asterisk-core-sounds-{lang}"
    transcripts = [p for p in (doc / f"core-sounds-{lang}.txt.gz", doc / f"core-sounds-{lang}.txt") if p.is_file()]
    if not transcripts or not sounds.is_dir() or not any(sounds.rglob("*.g722")):
        missing = "its transcripts" if not transcripts else "its G.722 audio"
        raise Refusal(f"the {lang} prompts are not installed ({missing} not found under "
                      f"{doc if not transcripts else sounds}): {apt_line(lang)}, or without root unpack "
                      f"the two packages (apt-get download; dpkg-deb -x) and give --sounds_root and --doc_root")
    try:
        import G722  # noqa: F401
    except ImportError:
        raise Refusal(f"decoding G.722 needs the G722 package: pip install {G722_PIN}") from None
    return sounds.resolve(), transcripts[0]


def build(lang: str, out: Path, sounds_root: Path = Path(SOUNDS_ROOT), doc_root: Path = Path(DOC_ROOT),
          min_seconds: float = 0.5, max_seconds: float = 30.0) -> dict:
    """Write both layouts of `lang` into `out` (which must not exist); returns the counts."""
    import soundfile as sf

    sounds, transcript_file = locate(lang, sounds_root, doc_root)
    if out.exists():
        raise Refusal(f"{out} exists: give a new --out (the corpus is written once, completely or not at all)")
    transcripts = read_transcripts(transcript_file)
    audio = {p.relative_to(sounds).with_suffix("").as_posix(): p for p in sounds.rglob("*.g722")}
    counts = dict.fromkeys(("no audio", "no transcript", "no spoken text", "too short", "too long"), 0)
    counts["no transcript"] = len(set(audio) - set(transcripts))
    spk = LANGUAGES[lang]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # before the first prompt is decoded: a --out that cannot be written is said at once
        tmp.mkdir(parents=True)
    except OSError as e:
        raise Refusal(f"--out {out}: cannot create {e.filename or tmp} ({e.strerror or e}): give a --out in a folder "
                      f"you can write") from None
    rows = []
    for position, prompt_id in enumerate(sorted(transcripts)):
        text = clean_text(prompt_id, transcripts[prompt_id])
        if prompt_id not in audio:
            counts["no audio"] += 1
            continue
        if not text:
            counts["no spoken text"] += 1
            continue
        samples = decode_g722(audio[prompt_id])
        seconds = len(samples) / SAMPLE_RATE
        if seconds < min_seconds or seconds > max_seconds:
            counts["too short" if seconds < min_seconds else "too long"] += 1
            continue
        split = split_of(prompt_id)
        utt_id = f"{spk}-{SPLITS[split]}-{position:04d}"
        folder = tmp / "librispeech" / split / str(spk) / str(SPLITS[split])
        folder.mkdir(parents=True, exist_ok=True)
        sf.write(folder / f"{utt_id}.flac", samples, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
        (tmp / "ljspeech" / "wavs").mkdir(parents=True, exist_ok=True)
        sf.write(tmp / "ljspeech" / "wavs" / f"{utt_id}.wav", samples, SAMPLE_RATE, subtype="PCM_16")
        rows.append(dict(id=utt_id, split=split, prompt=prompt_id, seconds=seconds,
                         original=" ".join(transcripts[prompt_id].split()), text=text))
    if not rows:
        raise Refusal(f"no usable prompt in {sounds} and {transcript_file}")
    rows.sort(key=lambda r: r["id"])  # chapter order: train, validation, test
    for split, chapter in SPLITS.items():
        lines = [f"{r['id']} {r['text']}\n" for r in rows if r["split"] == split]
        if lines:
            (tmp / "librispeech" / split / str(spk) / str(chapter) / f"{spk}-{chapter}.trans.txt").write_text(
                "".join(lines), encoding="utf-8")
    (tmp / "ljspeech" / "metadata.csv").write_text(
        "".join(f"{r['id']}|{r['original'].replace('|', ' ')}|{r['text'].replace('|', ' ')}\n" for r in rows),
        encoding="utf-8")
    (tmp / "prompts.tsv").write_text("id\tsplit\tprompt\tseconds\toriginal\ttext\n" + "".join(
        f"{r['id']}\t{r['split']}\t{r['prompt']}\t{r['seconds']:.3f}\t{r['original']}\t{r['text']}\n"
        for r in rows), encoding="utf-8")
    os.rename(tmp, out)
    per_split = {s: sum(r["split"] == s for r in rows) for s in SPLITS}
    hours = {s: sum(r["seconds"] for r in rows if r["split"] == s) / 3600 for s in SPLITS}
    return {"written": per_split, "hours": hours, "left out": counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.real_prompts", description=__doc__.split("\n\n")[0],
        epilog="Without root: apt-get download asterisk-core-sounds-LANG asterisk-core-sounds-LANG-g722, "
               "dpkg-deb -x each .deb into DIR, then give --sounds_root DIR/usr/share/asterisk/sounds "
               "--doc_root DIR/usr/share/doc.")
    parser.add_argument("--lang", required=True, help=f"one of {', '.join(LANGUAGES)}")
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not exist)")
    parser.add_argument("--min_seconds", type=float, default=0.5, help="shorter prompts are left out (s)")
    parser.add_argument("--max_seconds", type=float, default=30.0, help="longer prompts are left out (s)")
    parser.add_argument("--sounds_root", type=Path, default=Path(SOUNDS_ROOT),
                        help="the packages' audio root: <root>/<lang>/ or <root>/<lang>_*/ (default: where apt-get "
                             "installs it; give <dir>/usr/share/asterisk/sounds for packages unpacked with "
                             "dpkg-deb -x into <dir>, no root needed)")
    parser.add_argument("--doc_root", type=Path, default=Path(DOC_ROOT),
                        help="the packages' documentation root, which holds the transcripts (default: where "
                             "apt-get installs it; <dir>/usr/share/doc for unpacked packages)")
    args = parser.parse_args(argv)
    try:
        summary = build(args.lang, args.out, args.sounds_root, args.doc_root, args.min_seconds, args.max_seconds)
    except Refusal as e:
        print(f"real_prompts: {e}", file=sys.stderr)
        return 2
    n, h = summary["written"], summary["hours"]
    print(f"{args.out}: " + ", ".join(f"{s} {n[s]} ({h[s] * 60:.1f} min)" for s in SPLITS)
          + "; left out: " + ", ".join(f"{v} {k}" for k, v in summary["left out"].items() if v)
          + f"\nTTS held-out split: --data_dir {args.out / 'ljspeech'} --num_valid {n['validation']} --num_test {n['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
