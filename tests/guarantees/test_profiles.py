"""Accelerate profiles do what they say or refuse (CPU paths; GPU ones are in README "Run on N devices")."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess

import pytest
import yaml

from tests.harness.harness import ACCELERATE, ROOT, cpu_tokens, free_port, on_cores
from tests.recipes.test_best_rq import args_for

pytestmark = pytest.mark.slow


def launch(launcher: list[str], args: list[str], tokens: int = 0) -> subprocess.CompletedProcess:
    """`accelerate launch` the BEST-RQ recipe; with `tokens`, on that many of the harness's CPU tokens'
    cores (a run that trains: one thread per token, tests/harness/harness.py)."""
    with cpu_tokens(tokens) if tokens else contextlib.nullcontext() as cpus:
        return subprocess.run([*ACCELERATE, *launcher, str(ROOT / "recipes" / "best_rq" / "train.py"), *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=on_cores(cpus))


def test_fsdp_profile_on_cpu_is_refused(tiny_corpus, tmp_path):
    proc = launch(["--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "2",
                   "--main_process_port", str(free_port())], args_for(tiny_corpus, tmp_path / "run", "--max_steps", "2"))
    assert proc.returncode != 0
    assert "[rank 0] error: the FSDP profile needs GPUs" in proc.stderr + proc.stdout
    assert "here accelerate built MULTI_CPU instead" in proc.stderr + proc.stdout  # what it would have been
    assert "accelerate_configs/cpu_ddp.yaml" in proc.stderr + proc.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_deepspeed_profile_on_cpu_is_refused(tiny_corpus, tmp_path):
    """Without deepspeed installed, `accelerate launch` stops first (its ImportError); with it, the
    recipe refuses what accelerate 1.15 built on CPU (plain DDP: nothing sharded)."""
    proc = launch(["--config_file", str(ROOT / "accelerate_configs" / "deepspeed_zero2.yaml"), "--num_processes", "2",
                   "--main_process_port", str(free_port())], args_for(tiny_corpus, tmp_path / "run", "--max_steps", "2"))
    assert proc.returncode != 0
    if importlib.util.find_spec("deepspeed") is None:
        assert "DeepSpeed is not installed" in proc.stderr + proc.stdout
    else:
        assert "[rank 0] error: the DeepSpeed profile needs GPUs" in proc.stderr + proc.stdout
        assert "here accelerate built MULTI_CPU instead" in proc.stderr + proc.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_precision_comes_from_the_profile_unless_the_flag_says_otherwise(tiny_corpus, tmp_path):
    one = ["--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no"]
    args = args_for(tiny_corpus, tmp_path / "profile", "--max_steps", "2", "--max_batch_seconds", "16")
    proc = launch([*one, "--mixed_precision", "bf16"], args, tokens=1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "run: single process, 1 process(es) on cpu" in proc.stderr and "precision bf16" in proc.stderr
    saved = yaml.safe_load((tmp_path / "profile" / "final" / "config.yaml").read_text())
    assert saved["mixed_precision"] == "bf16"  # what ran is what the checkpoint says

    args = args_for(tiny_corpus, tmp_path / "flag", "--max_steps", "2", "--max_batch_seconds", "16",
                    "--mixed_precision", "no")
    proc = launch([*one, "--mixed_precision", "bf16"], args, tokens=1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--mixed_precision no overrides the launcher's profile (bf16)" in proc.stderr
    assert "precision no" in proc.stderr


def test_a_gpu_profile_on_a_cpu_machine_with_more_processes_than_cores_is_refused(tiny_corpus, tmp_path):
    """multi_gpu.yaml as shipped asks for 8 processes; on a CPU-only machine accelerate would start 8
    gloo processes sharing its cores. Refused, naming the core count and the CPU profile. Launched on
    one core (its affinity, as taskset or SLURM --cpus-per-task would give it), so 2 processes are one
    too many, whatever the machine's core count."""
    core = sorted(os.sched_getaffinity(0))[:1]
    n = 2
    proc = subprocess.run([*ACCELERATE, "--config_file", str(ROOT / "accelerate_configs" / "multi_gpu.yaml"),
                           "--num_processes", str(n), "--main_process_port", str(free_port()),
                           str(ROOT / "recipes" / "best_rq" / "train.py"),
                           *args_for(tiny_corpus, tmp_path / "run", "--max_steps", "2")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=on_cores(core))
    assert proc.returncode != 0
    out = proc.stderr + proc.stdout
    assert f"error: {n} processes on this machine but no GPU and {n - 1} CPU core(s)" in out, out[-3000:]
    assert "accelerate_configs/cpu_ddp.yaml" in out and "Traceback" not in out.split("error:")[0]
    assert not (tmp_path / "run").exists() or not (tmp_path / "run" / "checkpoints").exists()
