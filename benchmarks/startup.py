"""Start-up cost: `--help`, the imports, and launch → first optimizer step.

    python benchmarks/startup.py [--recipe best_rq|asr|tts] [--repeats 3]

Interleaved, `--repeats` times: (1) `train.py --help` (answered before torch is imported);
(2) a Python process importing the recipe's `train` module, i.e. every import the run makes;
(3) `accelerate launch recipes/<recipe>/train.py` into a fresh output folder until the first line
of metrics.jsonl (step 1) exists — imports, accelerator, data check, statistics, model, one step.
Printed: medians, and the imports' share of (3). The built-in corpus must already exist (it is
generated once per machine; run the recipe once first).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], until: Path | None = None) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    # its own process group: the launcher's child (train.py) is signalled with it, not orphaned
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    if until is None:
        _, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{err[-2000:]}")
        return time.perf_counter() - t
    while not (until.exists() and until.stat().st_size > 0):
        if proc.poll() is not None:
            raise SystemExit(f"ended before its first step: {' '.join(cmd)}\n{proc.stderr.read()[-2000:]}")
        time.sleep(0.01)
    elapsed = time.perf_counter() - t
    os.killpg(proc.pid, signal.SIGTERM)  # a preemption signal to launcher and train.py: save, exit 75
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="best_rq", choices=["best_rq", "asr", "tts"])
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions")
    args = ap.parse_args()
    train = ROOT / "recipes" / args.recipe / "train.py"
    importer = (f"import sys; sys.path.insert(0, {str(train.parent)!r}); sys.argv = ['train.py']; import train")
    times = {"--help": [], "imports": [], "launch → first step": []}
    for _ in range(args.repeats):
        times["--help"].append(timed([sys.executable, str(train), "--help"]))
        times["imports"].append(timed([sys.executable, "-c", importer]))
        with tempfile.TemporaryDirectory(prefix="startup_bench_") as tmp:
            times["launch → first step"].append(timed(
                [sys.executable, "-m", "accelerate.commands.launch", str(train), "--output_dir", f"{tmp}/run",
                 "--logging_steps", "1", "--eval_steps", "0", "--report_to", "none"],
                until=Path(tmp) / "run" / "metrics.jsonl"))
    med = {k: statistics.median(v) for k, v in times.items()}
    first = med["launch → first step"]
    print(f"start-up, recipe {args.recipe}: {args.repeats} interleaved repetitions, medians")
    for k, v in med.items():
        print(f"  {k:22s} {v:6.2f} s = {v / first:.2f} × launch → first step")


if __name__ == "__main__":
    main()
