"""The encoder's self-attention: our position bias per distance against transformers' (T, T, head) table.

    python benchmarks/relative_attention.py [--repeats 7] [--steps 10]

One attention layer of the recipes' Conformer (config.yaml's ASR/BEST-RQ size: hidden 144, 4 heads, relative
positions clamped to ±64 frames), forward + backward of a sum, at batch shapes a training batch of 20 s takes:
many short utterances (the built-in corpus's ~3 s), a few longer ones, one 25 s and one 29 s prompt (a real
voice's longest; 40 ms frames). The two implementations (`common.model.encoder.BandedRelativeKeyAttention`
and transformers' `Wav2Vec2BertSelfAttention`) run in turn on the same module's weights, `--repeats` times
interleaved; prints the medians (ms per layer step) and their ratio, and checks the forward outputs are equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.models.wav2vec2_bert.modeling_wav2vec2_bert import Wav2Vec2BertSelfAttention  # noqa: E402

from common.model.encoder import BandedRelativeKeyAttention, encoder_config  # noqa: E402

SHAPES = [(7, 75), (2, 250), (1, 625), (1, 725)]  # (utterances, 40 ms frames)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="forward + backward per timing")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = encoder_config(input_dim=320, hidden_size=144, num_layers=1, num_heads=4, ffn_dim=576, conv_kernel=15,
                         dropout=0.0)
    cfg._attn_implementation = "sdpa"  # what Wav2Vec2BertModel picks on CPU
    attention = Wav2Vec2BertSelfAttention(cfg)
    kinds = {"transformers": Wav2Vec2BertSelfAttention, "ours": BandedRelativeKeyAttention}

    def step(kind, x):
        attention.__class__ = kinds[kind]
        attention.zero_grad()
        out = attention(x)[0]
        out.sum().backward()
        return out.detach()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| utterances × frames | transformers ms | ours ms | ratio |\n|---|---|---|---|")
    for batch, frames in SHAPES:
        x = torch.randn(batch, frames, 144, requires_grad=True)
        assert torch.equal(step("transformers", x), step("ours", x)), "the forward outputs differ"
        times = {k: [] for k in kinds}
        for _ in range(args.repeats):
            for kind in kinds:
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(kind, x)
                times[kind].append((time.perf_counter() - start) / args.steps * 1e3)
        theirs, ours = statistics.median(times["transformers"]), statistics.median(times["ours"])
        print(f"| {batch} × {frames} | {theirs:.1f} | {ours:.1f} | {theirs / ours:.2f}× |")


if __name__ == "__main__":
    main()
