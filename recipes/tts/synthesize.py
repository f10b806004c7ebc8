"""Text → speech with a trained TTS checkpoint and the Griffin-Lim vocoder.

    python recipes/tts/synthesize.py --checkpoint outputs/tts --text "a radio wrote this clever pencil" --output out.wav
    python recipes/tts/synthesize.py --checkpoint outputs/tts/final --text_file lines.txt --output_dir wavs/

--checkpoint is a training output_dir (its final/ is used), a final/ folder, or a
checkpoints/step_XXXXXXXX/ folder (audio comes out of any checkpoint). With --text_file, one wav
per non-empty line: <output_dir>/0001.wav, 0002.wav, ... 22.05 kHz 16-bit PCM (the model's rate).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import soundfile as sf

from common.config import Count, ExistingPath, Positive, parse_config

# recipe-local modules (this folder is on sys.path)
from audio import make_vocoder
from model import load_tts, synthesize


@dataclass
class SynthConfig:
    """Synthesize speech. Every field can be set as --key value."""

    checkpoint: Annotated[str, ExistingPath] = "outputs/tts"  # training output_dir, its final/, or a checkpoints/step_XXXXXXXX/
    text: str | None = None  # one sentence
    output: str = "out.wav"  # wav file for --text
    text_file: Annotated[str | None, ExistingPath] = None  # one sentence per line
    output_dir: str = "synthesized"  # folder for --text_file
    pace: Annotated[float, Positive] = 1.0  # > 1 speaks faster (durations divided by pace)
    griffin_lim_iters: Annotated[int, Count] = 60
    griffin_lim_power: Annotated[float, Positive] = 1.0  # > 1 sharpens magnitudes before phase recovery


def main():
    args = parse_config(SynthConfig)
    if (args.text is None) == (args.text_file is None):
        raise SystemExit("error: give exactly one of --text or --text_file")
    model, cfg, symbols, folder = load_tts(args.checkpoint)
    vocoder = make_vocoder(cfg, args.griffin_lim_iters, args.griffin_lim_power)
    if args.text is not None:
        jobs = [(args.text, Path(args.output))]
    else:
        lines = [line for line in Path(args.text_file).read_text().splitlines() if line.strip()]
        jobs = [(line, Path(args.output_dir) / f"{i:04d}.wav") for i, line in enumerate(lines, 1)]
    for text, path in jobs:
        wav, mel, _ = synthesize(model, symbols, text, vocoder, args.pace)
        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(path, wav.numpy(), cfg.sample_rate, subtype="PCM_16")
        print(f"{path}: {len(wav) / cfg.sample_rate:.2f} s  ← {symbols.normalize(text)!r}", flush=True)


if __name__ == "__main__":
    main()
