"""Resume cost: time to the first batch when a run resumes late in an epoch vs early.

    python benchmarks/resume.py [--recipe best_rq|asr|tts] [--repeats 5]

Builds the recipe's training loader with its own `build_data` (as `train.py` does, RAM cache off, so
that every read decodes) and `accelerator.prepare`,
and times `common.training.loop.train_batches` from its call to the first batch it yields, with the state
positioned after 1 batch (early) and before the last batch (late) of epoch 0; and, for each, reading
that same batch directly (the batches differ in size, so their reading time differs). Interleaved.
A resume skips consumed batches by dropping their index lists (`skip_first_batches`), never by
loading them: the cost beyond the read must stay the same early and late (O(1) in the position).
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
    ap.add_argument("--recipe", default="best_rq", choices=["best_rq", "asr", "tts"])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repetitions")
    args = ap.parse_args()

    from benchmarks.recipe import load_recipe
    from common.training.state import TrainState
    from common.training.distributed import set_threads
    from common.training.loop import train_batches

    set_threads(0)
    r = load_recipe(args.recipe, ["--memory_cache_mb", "0"])
    cfg, accelerator, sampler = r.cfg, r.accelerator, r.data.train_sampler
    loader = accelerator.prepare(r.data.train_loader)
    r.data.set_epoch(0)
    n = len(loader)

    batches = list(sampler)  # epoch 0's index lists, as the loader will draw them

    def first_batch(done: int) -> float:
        """Seconds from resuming after `done` batches to holding batch `done`."""
        state = TrainState(batches_in_epoch=done)
        state.stage = "boundary"  # as resume_from_checkpoint leaves it (no model here to load)
        t = time.perf_counter()
        next(train_batches(accelerator, loader, state, max_steps=10**9, accumulation=1, seed=cfg.seed,
                           epoch_objects=r.data.epoch_objects))
        return time.perf_counter() - t

    def read(done: int) -> float:
        """Seconds to read that same batch directly (its decoding, features, collation)."""
        t = time.perf_counter()
        r.collator([r.dataset[i] for i in batches[done]])
        return time.perf_counter() - t

    times = {k: [] for k in ("resume early", "read early", "resume late", "read late")}
    order = [("resume early", first_batch, 1), ("read early", read, 1),
             ("resume late", first_batch, n - 1), ("read late", read, n - 1)]
    for rep in range(args.repeats):
        for name, f, done in order if rep % 2 else order[::-1]:  # no variant always first
            times[name].append(f(done))
    med = {k: statistics.median(v) for k, v in times.items()}
    early, late = med["resume early"] - med["read early"], med["resume late"] - med["read late"]
    print(f"resume benchmark, recipe {args.recipe}: epoch of {n} batches, {args.repeats} interleaved repetitions, medians")
    print(f"  resume cost beyond reading the batch itself: at batch {n - 1} {late * 1e3:.1f} ms, at batch 1 "
          f"{early * 1e3:.1f} ms")
    print(f"  first batch after resuming / reading that batch directly: at batch {n - 1} "
          f"{med['resume late'] / med['read late']:.2f}, at batch 1 {med['resume early'] / med['read early']:.2f}")

if __name__ == "__main__":
    main()
