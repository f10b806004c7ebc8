"""Text → speech with a trained TTS checkpoint and the Griffin-Lim vocoder, or a trained neural
vocoder (recipes/vocoder) with --vocoder.

    python recipes/tts/synthesize.py --checkpoint outputs/tts --text "a radio wrote this clever pencil" --output out.wav
    python recipes/tts/synthesize.py --checkpoint outputs/tts/final --text_file lines.txt --output_dir wavs/
    python recipes/tts/synthesize.py --checkpoint outputs/tts --vocoder outputs/vocoder --text "..." --output out.wav

--checkpoint is a training output_dir (its final/ is used), a final/ folder, or a
checkpoints/step_XXXXXXXX/ folder (audio comes out of any checkpoint). With --text_file, one wav
per non-empty line: <output_dir>/0001.wav, 0002.wav, ... 22.05 kHz 16-bit PCM (the model's rate).
--vocoder is a vocoder training output_dir or its final/: its code comes from the folder itself
(vocoder_model.py), and a vocoder trained on another mel (sample rate, n_mels, window, hop) is refused.
"""

from __future__ import annotations

import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import soundfile as sf
import yaml

from common.checkpoint import resolve_checkpoint
from common.config import Count, ExistingPath, Positive, parse_config
from common.faults import RunError

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
    vocoder: Annotated[str | None, ExistingPath] = None  # a neural vocoder (recipes/vocoder output_dir or its final/) instead of Griffin-Lim


def refuse(message: str) -> typing.NoReturn:
    """A mistake in the command: one line on stderr, exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def neural_vocoder(path: str, tts_cfg):
    """mel → waveform with the generator in `path` (its final/), loaded through the code it carries.
    Refuses, with one line, a vocoder whose mel is not the TTS model's."""
    import importlib.util

    try:
        folder = resolve_checkpoint(path)
    except (RunError, FileNotFoundError) as e:
        refuse(f"--vocoder {path}: {str(e).split(': ', 1)[-1]}")
    if not (folder / "vocoder_model.py").is_file():
        refuse(f"--vocoder {path}: no vocoder_model.py in {folder} (not a recipes/vocoder final/)")
    spec = importlib.util.spec_from_file_location("vocoder_model", folder / "vocoder_model.py")
    code = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code)
    mismatch = code.mel_mismatch(SimpleNamespace(**yaml.safe_load((folder / "config.yaml").read_text())), tts_cfg)
    if mismatch:  # before the weights: another n_mels would not even load
        refuse(f"--vocoder {path} was trained on another mel than this TTS model ({mismatch}): "
               f"train the vocoder with the TTS model's --sample_rate/--n_mels/--win_length/--hop_length")
    generator, _ = code.load_vocoder(folder)
    return lambda mel: code.vocode(generator, mel)


def main():
    args = parse_config(SynthConfig)
    if (args.text is None) == (args.text_file is None):
        raise SystemExit("error: give exactly one of --text or --text_file")
    model, cfg, symbols, folder = load_tts(args.checkpoint)
    if args.vocoder is not None:
        vocoder = neural_vocoder(args.vocoder, cfg)
    else:
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
