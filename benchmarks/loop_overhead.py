"""Loop overhead: the real recipe's step against a bare forward + backward + AdamW on the same batches.

    python benchmarks/loop_overhead.py [--recipe best_rq|asr] [--steps 30] [--repeats 3] [--<recipe flag> value ...]

Each repetition runs, one after the other (interleaved):
1. the recipe as a user runs it (`python recipes/<recipe>/train.py`, its config.yaml, fresh
   output folder, no evaluation, no checkpoint before the end) through epoch 0 and `--steps`
   optimizer steps into epoch 1; its time per step comes from `metrics.jsonl` (`audio_s_per_s` of
   every step, `--logging_steps 1`);
2. in this process, the same model on the same batches (the first `--steps` batches of epoch 0 and
   of epoch 1, which the recipe also trains on), held in memory: forward, backward, AdamW, nothing else.
Both use the same thread count (`common.training.distributed.set_threads` rule, or `--threads`). The first
`--warmup` steps of each window are left out. Printed, for epoch 0 (every utterance read for the
first time) and `--later_epoch` (read again: from RAM, `--memory_cache_mb`; ASR keeps one version
per speed factor, so its reads come from RAM once all three were made): medians over repetitions of the time per step of both, their ratio; and
where the recipe's extra time goes on a first read, measured on the same batches: audio decoding,
features (log-mel, speed perturbation), collation (padding, masks, noise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def recipe_step_times(recipe: str, steps: int, threads: int, extra: list[str], out: Path) -> list[float]:
    """Seconds per optimizer step of a real run (one process), from its metrics.jsonl."""
    cmd = [sys.executable, str(ROOT / "recipes" / recipe / "train.py"), "--output_dir", str(out),
           "--max_steps", str(steps), "--logging_steps", "1", "--eval_steps", "0", "--save_steps", str(10 * steps),
           "--report_to", "none", "--num_threads", str(threads), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the recipe run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    durations = dict(zip(*_ids_and_durations(out)))
    ids = [json.loads(line)["ids"] for line in (out / "batch_ids.rank0.jsonl").read_text().splitlines()]
    # audio of step i / audio-seconds per second of step i = wall seconds of step i
    return [sum(durations[u] for u in ids[i]) / row["audio_s_per_s"] for i, row in enumerate(rows)]


def _ids_and_durations(out: Path):
    rows = [json.loads(line) for d in sorted((out / "data").glob("train-*"))
            for line in (d / "manifest.jsonl").read_text().splitlines()]
    return [r["id"] for r in rows], [r["duration"] for r in rows]


def sampler_epoch(sampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return sampler.batches()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="best_rq", choices=["best_rq", "asr"])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of every run")
    ap.add_argument("--later_epoch", type=int, default=1, help="the epoch compared with epoch 0 (ASR's speed "
                    "perturbation keeps 3 versions of each utterance: from RAM once all were read)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = the recipes' automatic choice")
    # any other --key value pairs are recipe flags for both sides, e.g. --dropout 0.0
    args, overrides = ap.parse_known_args()

    import torch

    from benchmarks.recipe import load_recipe
    from common.data.loading import load_audio
    from common.training.distributed import set_threads

    threads, _ = set_threads(args.threads)
    r = load_recipe(args.recipe, overrides)
    cfg = r.cfg
    sampler = r.data.train_sampler  # the recipe's, 1 process: a multiple of 1 batch per epoch
    sampler.set_epoch(0)
    epoch0 = len(sampler)  # optimizer steps in epoch 0 (1 process, no accumulation)
    if args.steps > epoch0:
        raise SystemExit(f"--steps {args.steps} is more than an epoch ({epoch0} steps)")

    # Where a data step's time goes, on epoch 0's batches (the recipe does this inside its step).
    t_decode = t_features = t_collate = 0.0
    batches = {}  # epoch → its first --steps batches, collated as the recipe collates them
    later = args.later_epoch
    if later < 1:
        raise SystemExit("--later_epoch must be 1 or more")
    for epoch in (0, later):
        r.data.set_epoch(epoch)  # the sampler, and the items and collator that draw per epoch
        batches[epoch] = []
        for idx in list(sampler)[: args.steps]:
            items = []
            for i in idx:
                t = time.perf_counter()
                load_audio(r.train_set[i]["path"], cfg.sample_rate)
                t_decode += time.perf_counter() - t
                t = time.perf_counter()
                items.append(r.dataset[i])  # decodes again: its time minus the decode above is the features'
                t_features += time.perf_counter() - t
            t = time.perf_counter()
            batches[epoch].append(r.collator(items))
            t_collate += time.perf_counter() - t
    t_features -= t_decode
    n = 2 * args.steps

    torch.manual_seed(cfg.seed)
    model = r.build_model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)

    def bare(epoch: int) -> list[float]:
        times = []
        for b in batches[epoch]:
            t = time.perf_counter()
            r.loss(model, b).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
        return times

    start = sum(len(sampler_epoch(sampler, e)) for e in range(later))  # steps before the later epoch
    windows = {0: slice(args.warmup, args.steps), later: slice(start + args.warmup, start + args.steps)}
    recipe_runs, bare_runs = {0: [], later: []}, {0: [], later: []}
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="loop_bench_") as tmp:
            times = recipe_step_times(args.recipe, start + args.steps, threads,
                                      ["--dump_batch_ids", "true", *overrides], Path(tmp) / "run")
        for epoch in (0, later):
            recipe_runs[epoch].append(sum(times[windows[epoch]]))
            bare_runs[epoch].append(sum(bare(epoch)[args.warmup:]))
        print(f"  repetition {rep + 1}: recipe {recipe_runs[0][-1]:.2f} / {recipe_runs[later][-1]:.2f} s, bare "
              f"{bare_runs[0][-1]:.2f} / {bare_runs[later][-1]:.2f} s (epoch 0 / epoch {later})", flush=True)
    measured = args.steps - args.warmup
    print(f"\nloop overhead, recipe {args.recipe}: {args.repeats} interleaved repetitions of {measured} steps "
          f"(steps {args.warmup + 1}..{args.steps} of epoch 0 and of epoch {later}; epoch 0 is {epoch0} steps), "
          f"medians, {threads} thread(s), batch {cfg.max_batch_seconds:g} s of audio")
    for epoch, what in ((0, "first read"), (later, "read again")):
        rec = statistics.median(recipe_runs[epoch]) / measured
        bar = statistics.median(bare_runs[epoch]) / measured
        print(f"  epoch {epoch} ({what}): recipe step / bare step = {rec / bar:.3f}   "
              f"({rec * 1e3:.0f} ms vs {bar * 1e3:.0f} ms per step)")
    bar = statistics.median(bare_runs[0]) / measured
    print("  on a first read (measured on the same batches):")
    for name, t in (("audio decoding", t_decode), ("features", t_features), ("collation", t_collate)):
        print(f"    {name:16s} {t / n * 1e3:6.1f} ms per step = {t / n / bar:.3f} × bare step")


if __name__ == "__main__":
    main()
