"""Two transcriptions of the same utterances, compared as a difference of CER with its uncertainty.

    python benchmarks/paired_cer.py A.jsonl B.jsonl [--resamples 10000] [--seed 0]
    python benchmarks/paired_cer.py A_test.jsonl,A_valid.jsonl B_test.jsonl,B_valid.jsonl   # pooled

A and B are `decode.py`'s (or `score.py`'s judge's) `<split>-greedy.jsonl`: one {"id", "ref", "hyp"}
per line, the same ids and references in both (e.g. a TTS run scored through two vocoders by one
judge). It prints each CER (character edits over reference characters, as `decode.py` counts them),
B − A in CER points, and a 95 % paired bootstrap interval of that difference: the utterances are drawn
with replacement, the same draw for A and B, `--resamples` times. An interval that holds 0 says the
test set cannot tell the two apart; it is not a proof that they are equal. Comma-separated files are
pooled into one set, the k-th of A paired with the k-th of B (two splits of one voice: their ids may
repeat across files, never within one). Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from rapidfuzz.distance import Levenshtein  # jiwer's own edit-distance backend


def read(path: Path) -> dict[str, tuple[str, str]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    pairs = {row["id"]: (row["ref"], row["hyp"]) for row in rows}
    if len(pairs) != len(rows):
        raise SystemExit(f"paired_cer: {path} names an utterance id twice ({len(rows) - len(pairs)} repeats): "
                         f"the ids pair the two files")
    return pairs


def read_all(paths: str) -> list[dict[str, tuple[str, str]]]:
    return [read(Path(p)) for p in paths.split(",")]


def edits(a: dict, b: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(edits of A, edits of B, reference characters), one entry per utterance id, in A's order."""
    if set(a) != set(b):
        raise SystemExit(f"paired_cer: the files hold different utterances ({len(set(a) ^ set(b))} ids in one only)")
    ids = list(a)
    if any(a[i][0] != b[i][0] for i in ids):
        raise SystemExit("paired_cer: the references differ: not transcriptions of the same utterances")
    ea = np.array([Levenshtein.distance(a[i][0], a[i][1]) for i in ids], dtype=float)
    eb = np.array([Levenshtein.distance(b[i][0], b[i][1]) for i in ids], dtype=float)
    return ea, eb, np.array([len(a[i][0]) for i in ids], dtype=float)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="A's jsonl (or several, comma-separated, pooled)")
    ap.add_argument("b", help="B's, in the same order")
    ap.add_argument("--resamples", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    a, b = read_all(args.a), read_all(args.b)
    if len(a) != len(b):
        raise SystemExit(f"paired_cer: {len(a)} files against {len(b)}: give B's files in A's order, one for each")
    ea, eb, chars = (np.concatenate(x) for x in zip(*(edits(fa, fb) for fa, fb in zip(a, b))))
    draw = np.random.default_rng(args.seed).integers(0, len(chars), size=(args.resamples, len(chars)))
    diff = 100 * (eb[draw].sum(1) - ea[draw].sum(1)) / chars[draw].sum(1)  # (resamples,) CER points
    low, high = np.percentile(diff, [2.5, 97.5])
    cer_a, cer_b = 100 * ea.sum() / chars.sum(), 100 * eb.sum() / chars.sum()
    print(f"{len(chars)} utterances, {int(chars.sum())} reference characters")
    print(f"A {cer_a:.2f} %  B {cer_b:.2f} %  B - A {cer_b - cer_a:+.2f} points, 95 % interval "
          f"[{low:+.2f}, {high:+.2f}] ({args.resamples} paired resamples)")


if __name__ == "__main__":
    main()
