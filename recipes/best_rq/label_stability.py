"""How much of BEST-RQ's label sequence survives a level change or added noise, for each
`--label_norm` (a results script, not a test: README, "Labels from each utterance's statistics").

The quantizer should label what was said, not how loud it was recorded: a frame whose label
changes when the whole utterance is played 6 dB louder is a label the encoder learns to predict
from the level. For every 20th training utterance of the built-in corpus (150 of them) this
computes the labels of the clean audio and of a modified copy, with the recipe's quantizer
(config.yaml's codebook, quantizer seed) and log-mel front end, and prints the share unchanged.

    python recipes/best_rq/label_stability.py                     # built-in default corpus, ~30 s
    python recipes/best_rq/label_stability.py --data_dir DIR      # a LibriSpeech-layout split folder
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import soundfile as sf
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this recipe's model.py

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repository root: common/, tools/ (not installed)

from common.model.features import LogMel, feature_stats  # noqa: E402
from model import RandomProjectionQuantizer, utterance_normalize  # noqa: E402
from tools.corpus import resolve_data_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", help="a folder of 16 kHz .flac files (default: the built-in corpus' train split)")
    parser.add_argument("--utterances", type=int, default=150)
    args = parser.parse_args()
    cfg = yaml.safe_load(Path(__file__).with_name("config.yaml").read_text())
    root = Path(args.data_dir or Path(resolve_data_dir(None, None, "default", "librispeech")) / "train")
    files = sorted(root.rglob("*.flac"))
    files = files[:: max(1, len(files) // args.utterances)][: args.utterances]
    wavs = []
    for f in files:
        samples, rate = sf.read(f, dtype="float32")
        if rate != 16000 or samples.ndim != 1:
            sys.exit(f"{f}: {rate} Hz, shape {samples.shape}; this check reads 16 kHz mono .flac files")
        wavs.append(torch.from_numpy(samples))
    logmel, stack = LogMel(16000, 80), 4
    mean, std = feature_stats((str(i), logmel(w)) for i, w in enumerate(wavs))  # as training computes them
    quantizer = RandomProjectionQuantizer(80 * stack, 16, cfg["codebook_size"], seed=1234)  # Config.quantizer_seed

    def labels(wave: torch.Tensor, norm: str) -> torch.Tensor:
        x = logmel(wave)
        T = x.shape[0] // stack * stack
        x = x[None, :T]  # (1, T, 80)
        z = (x - mean) / std if norm == "global" else utterance_normalize(x, torch.tensor([T]))
        return quantizer(z.reshape(1, T // stack, stack * 80))[0]

    g = torch.Generator().manual_seed(0)

    def noise(snr_db: float):
        return lambda w: w + torch.randn(w.shape, generator=g) * w.pow(2).mean().sqrt() * 10 ** (-snr_db / 20)

    changes = {"6 dB louder": lambda w: w * 10 ** (6 / 20), "12 dB quieter": lambda w: w * 10 ** (-12 / 20),
               "white noise, 20 dB SNR": noise(20), "white noise, 10 dB SNR": noise(10)}
    print(f"{len(wavs)} utterances of {root}, codebook {cfg['codebook_size']}: share of the 40 ms labels unchanged\n")
    print("| change | label_norm global | label_norm utterance |\n|---|---|---|")
    for name, change in changes.items():
        cells = []
        for norm in ("global", "utterance"):
            same = total = 0
            for w in wavs:
                a, b = labels(w, norm), labels(change(w), norm)
                same, total = same + (a == b).sum().item(), total + a.numel()
            cells.append(f"{same / total:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
