"""Drive recipes through their real command line: `accelerate launch ... recipes/<name>/train.py`."""

from __future__ import annotations

import json
import os
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
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(recipe: str, nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:
        launch = ACCELERATE + ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                               "--dynamo_backend", "no"]
    else:
        launch = ACCELERATE + ["--config_file", str(ROOT / "accelerate_configs" / "cpu_ddp.yaml"),
                               "--num_processes", str(nproc), "--main_process_port", str(free_port())]
    return launch + [str(ROOT / "recipes" / recipe / "train.py"), *args]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it at once, as a scheduler killing the job
    would. (torch's elastic agent starts its workers in sessions of their own, so killing the
    launcher's process group alone leaves the training processes running.)"""
    procs = [psutil.Process(proc.pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    proc.wait()


def run(recipe: str, nproc: int, args: list[str], *, env: dict | None = None, timeout: float = 600,
        kill_after_checkpoint: int | None = None) -> subprocess.CompletedProcess | None:
    """Run to completion, or SIGKILL the whole process group as soon as checkpoint
    `step_{kill_after_checkpoint:08d}` is complete. Returns the finished process (or None if killed)."""
    out_dir = Path(args[args.index("--output_dir") + 1])
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    log = open(out_dir.parent / f"{out_dir.name}.log", "a")
    proc = subprocess.Popen(command(recipe, nproc, args), cwd=ROOT, env=full_env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{recipe} run timed out; see {log.name}")
            if kill_after_checkpoint is not None:
                marker = out_dir / "checkpoints" / f"step_{kill_after_checkpoint:08d}" / "COMPLETE"
                if marker.exists():
                    kill_tree(proc)
                    return None
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        log.close()
    text = Path(log.name).read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{text[-4000:]}"
    assert kill_after_checkpoint is None, f"finished before checkpoint {kill_after_checkpoint} was seen"
    return proc


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def assert_same_losses(a: Path, b: Path) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in mb] == [r["step"] for r in ma]
    assert len({r["step"] for r in mb}) == len(mb), "a step was logged twice"
    for ra, rb in zip(ma, mb):
        assert ra["loss"] == rb["loss"], f"step {ra['step']}: {ra['loss']} != {rb['loss']}"
