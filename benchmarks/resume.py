"""Resume cost: time to the first batch when a run resumes late in an epoch vs early.

    python benchmarks/resume.py [--recipe best_rq|asr] [--repeats 5]

Builds the recipe's training loader exactly as `train.py` does (`make_loader` + `accelerator.prepare`)
and times `common.loop.train_batches` from its call to the first batch it yields, with the state
positioned after 1 batch (early) and before the last batch (late) of epoch 0, interleaved. A resume
skips consumed batches by dropping their index lists (`skip_first_batches`), never by loading them,
so the ratio must stay near 1 (O(1) in the position).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="best_rq", choices=["best_rq", "asr"])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repetitions")
    args = ap.parse_args()

    from benchmarks.recipe import load_recipe
    from common.checkpoint import TrainState
    from common.data import make_loader
    from common.distributed import build_accelerator, set_threads
    from common.loop import train_batches

    set_threads(0)
    r = load_recipe(args.recipe)
    cfg = r.cfg
    accelerator = build_accelerator()
    loader, sampler = make_loader(r.dataset, r.train_set["duration"], r.collator, max_batch_seconds=cfg.max_batch_seconds,
                                  num_buckets=cfg.num_buckets, seed=cfg.seed, multiple_of=1, shuffle=True)
    loader = accelerator.prepare(loader)
    sampler.set_epoch(0)
    n = len(loader)

    def first_batch(done: int) -> float:
        state = TrainState(batches_in_epoch=done)
        t = time.perf_counter()
        next(train_batches(accelerator, loader, state, max_steps=10**9, accumulation=1, seed=cfg.seed,
                           epoch_objects=(sampler,)))
        return time.perf_counter() - t

    early, late = [], []
    for _ in range(args.repeats):
        early.append(first_batch(1))
        late.append(first_batch(n - 1))
    e, l_ = statistics.median(early), statistics.median(late)
    print(f"resume benchmark, recipe {args.recipe}: epoch of {n} batches, {args.repeats} interleaved repetitions, medians")
    print(f"  first batch after resuming at batch {n - 1} / at batch 1 = {l_ / e:.2f}   "
          f"({l_ * 1e3:.0f} ms vs {e * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
