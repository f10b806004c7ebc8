"""benchmarks/gpu_check.py cannot rot: its CPU smoke path runs here (the GPU figures need a GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.harness.harness import ROOT, cpu_tokens, on_cores

pytestmark = pytest.mark.slow

SCRIPT = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")]


def test_gpu_check_smoke_path_on_cpu(tiny_corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():  # the full check refuses in one line, before any work
        proc = subprocess.run(SCRIPT, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines() == [
            "gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False); run it on a machine "
            "with one, or `--device cpu --smoke` for the parts a CPU can run"]

    with cpu_tokens(1) as cpus:  # it trains (in-process and 3 launches, one at a time): one core, one thread
        proc = subprocess.run([*SCRIPT, "--device", "cpu", "--smoke", "--data_dir", str(tiny_corpus / "librispeech"),
                               "--output_dir", str(tmp_path / "check")], capture_output=True, text=True, timeout=600,
                              env=env, preexec_fn=on_cores(cpus))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {m[0]: (m[1], m[2]) for m in re.findall(r"^(\(\w\) [^\n]*?)\s{2,}(PASS|FAIL|SKIP|MEASURED)\s+(.*)$",
                                                    proc.stdout, re.M)}
    status, detail = rows["(a) bf16 used"]
    assert status == "PASS" and re.match(r"(\d+)/\1 Linear/Conv1d outputs bf16", detail), detail
    assert "master weights ['float32']" in detail
    assert rows["(b) DDP vs FSDP, 1 GPU"][0] == "SKIP"
    status, detail = rows["(c) interrupted == continuous"]
    assert status == "PASS" and "bit-identical" in detail and "deterministic kernels" in detail, detail
    audio_per_s = float(re.match(r"([\d.]+) s of audio/s", rows["(d) throughput"][1]).group(1))
    assert audio_per_s > 0
    counted, analytic = map(float, re.match(r"([\d.e+]+) GFLOP/step counted \(6·N·frames: ([\d.e+]+)\)",
                                            rows["(d) FLOPs, MFU"][1]).groups())
    assert analytic > 0 and counted >= analytic  # the count adds attention scores, the convolutions' and the head's
