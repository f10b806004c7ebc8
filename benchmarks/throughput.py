"""Training throughput in audio-seconds per second: 1 process vs 2, and today's defaults vs the old ones.

    python benchmarks/throughput.py [--recipe best_rq|asr] [--steps 120] [--repeats 2]

Runs the recipe through `accelerate launch`, as a user does, on the built-in corpus with its
config.yaml, interleaved, `--repeats` times each:
- `quickstart`: `accelerate launch recipes/<recipe>/train.py` (threads and workers automatic);
- `old defaults`: the same with the settings this repository used before they were tuned
  (`--num_threads 1`: what `accelerate launch`'s OMP_NUM_THREADS=1 gave; BEST-RQ also
  `--attention_dropout 0.1 --activation_dropout 0.1`; no features kept in RAM, `--memory_cache_mb 0`);
- `no memory cache`: the quickstart with `--memory_cache_mb 0` (every epoch decodes its audio again);
- `2 processes`: `--config_file accelerate_configs/cpu_ddp.yaml` (real DDP, gloo; automatic threads).
Throughput is steady state: the median of `audio_s_per_s` over the logged steps after `--warmup`
(no evaluation, no checkpoint in between); the default 120 steps span two epochs of the built-in
corpus (57 steps each for BEST-RQ), so the first read and the reads from RAM are both in it.
Printed: the medians over repetitions and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_CACHE = ["--memory_cache_mb", "0"]
OLD = {"best_rq": ["--num_threads", "1", "--attention_dropout", "0.1", "--activation_dropout", "0.1", *NO_CACHE],
       "asr": ["--num_threads", "1", *NO_CACHE]}


def run(recipe: str, launch: list[str], extra: list[str], steps: int, warmup: int, logging: int) -> float:
    with tempfile.TemporaryDirectory(prefix="tput_bench_") as tmp:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, str(ROOT / "recipes" / recipe / "train.py"),
               "--output_dir", f"{tmp}/run", "--max_steps", str(steps), "--logging_steps", str(logging),
               "--eval_steps", "0", "--save_steps", str(10 * steps), "--report_to", "none", *extra]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as in a fresh shell
        env["PYTHONPATH"] = str(ROOT)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"run failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["audio_s_per_s"] for r in rows if r["step"] > warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="best_rq", choices=["best_rq", "asr"])
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=10, help="first steps left out")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repetitions")
    args = ap.parse_args()

    port = str(29600 + os.getpid() % 300)
    setups = {
        "quickstart (1 process)": ([], []),
        "no memory cache (1 process)": ([], NO_CACHE),
        "old defaults (1 process)": ([], OLD[args.recipe]),
        "2 processes (cpu_ddp.yaml)": (["--config_file", str(ROOT / "accelerate_configs" / "cpu_ddp.yaml"),
                                        "--main_process_port", port], []),
    }
    rates = {name: [] for name in setups}
    for rep in range(args.repeats):
        for name, (launch, extra) in setups.items():
            rates[name].append(run(args.recipe, launch, extra, args.steps, args.warmup, logging=5))
            print(f"  repetition {rep + 1}: {name}: {rates[name][-1]:.1f} audio-s/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    base = med["old defaults (1 process)"]
    print(f"\nthroughput, recipe {args.recipe}: {args.repeats} interleaved repetitions, steps {args.warmup + 1}.."
          f"{args.steps}, median audio-seconds per second, {os.cpu_count()} CPU cores")
    for name, v in med.items():
        print(f"  {name:28s} {v:8.1f} audio-s/s = {v / base:.2f} × old defaults")
    print(f"  2 processes / quickstart = {med['2 processes (cpu_ddp.yaml)'] / med['quickstart (1 process)']:.2f}")
    print(f"  quickstart / no memory cache = {med['quickstart (1 process)'] / med['no memory cache (1 process)']:.2f}")


if __name__ == "__main__":
    main()
