"""Text → speech with a trained TTS checkpoint and the Griffin-Lim vocoder.

    python recipes/tts/synthesize.py --checkpoint outputs/tts --text "a radio wrote this clever pencil" --output out.wav
    python recipes/tts/synthesize.py --checkpoint outputs/tts/final --text_file lines.txt --output_dir wavs/

--checkpoint is a training output_dir (its final/ is used), a final/ folder, or a
checkpoints/step_XXXXXXXX/ folder (audio comes out of any checkpoint). With --text_file, one wav
per non-empty line: <output_dir>/0001.wav, 0002.wav, ... 22.05 kHz 16-bit PCM (the model's rate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import soundfile as sf
import torch
from safetensors.torch import load_file

from common.checkpoint import resolve_checkpoint
from common.config import parse_config

# recipe-local modules (this folder is on sys.path)
from audio import GriffinLim, mel_frontend
from model import Symbols
from train import Config, build_model


@dataclass
class SynthConfig:
    """Synthesize speech. Every field can be set as --key value."""

    checkpoint: str = "outputs/tts"  # training output_dir, its final/, or a checkpoints/step_XXXXXXXX/
    text: str | None = None  # one sentence
    output: str = "out.wav"  # wav file for --text
    text_file: str | None = None  # one sentence per line
    output_dir: str = "synthesized"  # folder for --text_file
    pace: float = 1.0  # > 1 speaks faster (durations divided by pace)
    griffin_lim_iters: int = 60
    griffin_lim_power: float = 1.0  # > 1 sharpens magnitudes before phase recovery


def load_tts(checkpoint: str | Path):
    """(model in eval mode, its Config, Symbols, folder)."""
    folder = resolve_checkpoint(checkpoint)
    cfg = parse_config(Config, argv=[], default_yaml=folder / "config.yaml")
    if (folder / "symbols.json").is_file():  # final/ carries it; step folders have it in config.yaml
        cfg.symbols = json.loads((folder / "symbols.json").read_text())["symbols"]
    model = build_model(cfg)
    model.load_state_dict(load_file(folder / "model.safetensors"))  # weights and feature statistics
    return model.eval(), cfg, Symbols(cfg.symbols), folder


def make_vocoder(cfg: Config, n_iter: int, power: float = 1.0) -> GriffinLim:
    return GriffinLim(mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length), n_iter, power)


@torch.no_grad()
def synthesize(model, symbols: Symbols, text: str, vocoder=None, pace: float = 1.0):
    """→ (waveform (samples,) or None without a vocoder, log-mel (frames, n_mels), durations (N,))."""
    tokens = torch.tensor([symbols.encode(text)])
    mel, lens, durations = model.infer(tokens, torch.tensor([tokens.shape[1]]), pace)
    mel = mel[0, : int(lens[0])]
    return (vocoder(mel) if vocoder is not None else None), mel, durations[0]


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
