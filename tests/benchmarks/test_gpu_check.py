"""benchmarks/gpu_check.py cannot rot: its CPU smoke path runs here (the GPU figures need a GPU)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.harness.harness import ROOT, python

pytestmark = pytest.mark.slow

SCRIPT = [ROOT / "benchmarks" / "gpu_check.py"]


def test_gpu_check_smoke_path_on_cpu(tiny_corpus, tmp_path):
    # `python benchmarks/gpu_check.py`, forked by the harness (its imports spared): one core, one thread for
    # what it trains (in-process, and 3 launches one at a time, which start fresh interpreters of their own)
    if not torch.cuda.is_available():  # the full check refuses in one line, before any work
        proc = python(SCRIPT, timeout=120)
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines() == [
            "gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False); run it on a machine "
            "with one, or `--device cpu --smoke` for the parts a CPU can run"]

    proc = python([*SCRIPT, "--device", "cpu", "--smoke", "--data_dir", str(tiny_corpus / "librispeech"),
                   "--output_dir", str(tmp_path / "check")], timeout=600)
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
