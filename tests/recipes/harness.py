"""Drive recipes through their real command line: `accelerate launch ... recipes/<name>/train.py`."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "recipes" / "support"  # sitecustomize: write audit, fault injection
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
# Whether run() starts a one-process run through `accelerate launch`: set per test by the
# `accelerate_launch` mark (tests/conftest.py). Every recipe keeps one such test per guarantee.
LAUNCH_ONE = [False]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(recipe: str, nproc: int, args: list[str], profile: str = "cpu_ddp.yaml",
            launcher: bool = True) -> list[str]:
    """The launch command; `profile` (an accelerate_configs/ file) is used for nproc > 1. `recipe`: a
    folder of recipes/, or a `train.py` path relative to the repository (a test recipe).
    `launcher=False` with one process: `python train.py` itself, as a user may run it too (the
    launcher's own start-up, ~1.5 s of imports, is then spared)."""
    script = ROOT / recipe if recipe.endswith(".py") else ROOT / "recipes" / recipe / "train.py"
    if nproc == 1 and not launcher:
        return [sys.executable, str(script), *args]
    if nproc == 1:
        launch = ACCELERATE + ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                               "--dynamo_backend", "no"]
    else:
        launch = ACCELERATE + ["--config_file", str(ROOT / "accelerate_configs" / profile),
                               "--num_processes", str(nproc), "--main_process_port", str(free_port())]
    return launch + [str(script), *args]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it at once, as a scheduler killing the job
    would. (torch's elastic agent starts its workers in sessions of their own, so killing the
    launcher's process group alone misses them: they stop on their own once they notice, through a
    save, see common/launcher.py.)"""
    procs = [psutil.Process(proc.pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    proc.wait()


def worker(proc: subprocess.Popen, rank: int) -> psutil.Process:
    """The training process of `rank` under a launcher (or `proc` itself, started without one)."""
    cmd = psutil.Process(proc.pid).cmdline()
    if rank == 0 and len(cmd) > 1 and cmd[1].endswith("train.py"):  # `python train.py ...`, no launcher
        return psutil.Process(proc.pid)
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK", "0") == str(rank) and "train.py" in " ".join(child.cmdline()):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise LookupError(f"no rank {rank} worker under {proc.pid}")


def checkpoint_exists(step: int):
    return lambda out: (out / "checkpoints" / f"step_{step:08d}" / "COMPLETE").exists()


def run(recipe: str, nproc: int, args: list[str], *, env: dict | None = None, timeout: float = 600,
        kill_after_checkpoint: int | None = None, when=None, then=None, expect_rc: int | None = 0,
        profile: str = "cpu_ddp.yaml", launcher: bool | None = None) -> str:
    """Launch a recipe and wait for it; return its log.

    One process runs as `python train.py` unless `launcher` (or the test's `accelerate_launch` mark,
    see tests/conftest.py) asks for `accelerate launch`; several processes always use it.

    `when(output_dir)` is polled every 20 ms; the first time it is true, `then(proc)` runs once
    (e.g. `kill_tree`, or a signal to one rank). `kill_after_checkpoint=k` is short for killing the
    whole tree as soon as checkpoint k is complete (then the exit code is not checked).
    """
    if kill_after_checkpoint is not None:
        when, then, expect_rc = checkpoint_exists(kill_after_checkpoint), kill_tree, None
    out_dir = Path(args[args.index("--output_dir") + 1])
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    # This checkout's common/ always (an `env` PYTHONPATH adds to it, never replaces it).
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (full_env.get("PYTHONPATH"), str(ROOT)) if p)
    log_path = out_dir.parent / f"{out_dir.name}.log"
    start = log_path.stat().st_size if log_path.exists() else 0
    launch_one = LAUNCH_ONE[0] if launcher is None else launcher
    with open(log_path, "a") as log:
        proc = subprocess.Popen(command(recipe, nproc, args, profile, launch_one), cwd=ROOT, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    started = time.monotonic()
    deadline = started + timeout
    fired = False
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{recipe} run timed out; see {log_path}")
            if when is not None and not fired and when(out_dir):
                then(proc)
                fired = True
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    if os.environ.get("HARNESS_LAUNCH_LOG"):  # suite profiling: one JSON line per launch
        with open(os.environ["HARNESS_LAUNCH_LOG"], "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "recipe": recipe,
                                "nproc": nproc, "launcher": nproc > 1 or bool(launch_one),
                                "seconds": round(time.monotonic() - started, 2)}) + "\n")
    with open(log_path, errors="replace") as f:
        f.seek(start)
        text = f.read()
    assert when is None or fired, f"the run ended before the awaited event:\n{text[-3000:]}"
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"exit {proc.returncode} (expected {expect_rc}):\n{text[-4000:]}"
    return text


TIMINGS = ("audio_s_per_s",)  # wall-clock figures: they differ between any two runs, by design


def metrics(out_dir: Path, timings: bool = False) -> list[dict]:
    """Rows of metrics.jsonl; without the wall-clock keys unless `timings` (they never repeat)."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return rows if timings else [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def assert_same_losses(a: Path, b: Path, key: str = "loss") -> None:
    """Same logged steps, each once, with equal `key` (the vocoder logs g_loss and d_loss)."""
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in mb] == [r["step"] for r in ma]
    assert len({r["step"] for r in mb}) == len(mb), "a step was logged twice"
    for ra, rb in zip(ma, mb):
        assert ra[key] == rb[key], f"step {ra['step']}: {ra[key]} != {rb[key]}"


def epoch_lengths(durations, max_batch_seconds: float, world: int, epochs: int, seed: int = 42,
                  accumulation: int = 1) -> list[int]:
    """Batches per rank in each epoch, as a recipe's sampler will make them from `durations`."""
    from common.data import DurationBatchSampler

    s = DurationBatchSampler(durations, max_batch_seconds, seed=seed, multiple_of=world * accumulation)
    lengths = []
    for e in range(epochs):
        s.set_epoch(e)
        lengths.append(len(s) // world)
    return lengths


def resumed_positions(log: Path) -> list[tuple[int, int, int]]:
    """(step, epoch, batch) of every resume a recipe reported in its log."""
    return [tuple(map(int, m)) for m in
            re.findall(r"resumed from .*?: step (\d+), epoch (\d+), batch (\d+)", log.read_text())]
