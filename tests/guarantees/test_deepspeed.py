"""BEST-RQ under accelerate's own DeepSpeed ZeRO-2 code path, on CPU/gloo in 2 processes, with the
settings of accelerate_configs/deepspeed_zero2.yaml (zero_stage 2, gradient_clipping 5.0 = the recipe's
--max_grad_norm, DeepSpeed's gradient_accumulation_steps 1: the loop accumulates).

Needs `deepspeed` (optional, not in requirements.txt): skipped without it. Measured with deepspeed
0.19.8, torch 2.14.1, accelerate 1.15.0: DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu) communicates
over gloo. Accelerate 1.15 makes a CPU launch of the profile plain DDP (state.py builds DEEPSPEED only
without cpu=True), so these tests set FORCE_DEEPSPEED_ON_CPU=1: the test-only hook in
support/sitecustomize.py takes that one decision as accelerate does on GPUs. From there on everything is
accelerate's and DeepSpeed's code: prepare → deepspeed.initialize (ZeRO-2 optimizer), backward →
engine.backward + engine.step at the window's end (clipping, overflow skip), save_state/load_state →
engine.save_checkpoint/load_checkpoint. Without the hook the profile is refused on CPU.

Precision: fp32 (`--mixed_precision no` overrides the profile's bf16); bf16 + DeepSpeed is a GPU check.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.harness.harness import (SUPPORT, assert_same_losses, assert_same_weights, epoch_lengths, metrics,
                                   resumed_positions, run)
from tests.recipes.test_best_rq import args_for, train_durations

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                                    reason="deepspeed is not installed (optional: pip install deepspeed)")]

DEEPSPEED = {"FORCE_DEEPSPEED_ON_CPU": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(SUPPORT)}
MBS = 8.0  # seconds of audio per batch per process
ACCUMULATION = 2


def zero2(corpus: Path, out: Path, max_steps: int, **kwargs) -> str:
    args = args_for(corpus, out, "--max_batch_seconds", str(MBS), "--max_steps", str(max_steps), "--save_steps", "1",
                    "--save_total_limit", "2", "--mixed_precision", "no",
                    "--gradient_accumulation_steps", str(ACCUMULATION))
    return run("best_rq", 2, args, profile="deepspeed_zero2.yaml", **{"env": DEEPSPEED, **kwargs})


def test_deepspeed_zero2_interrupted_equals_continuous_with_a_skipped_update(tiny_corpus, tmp_path):
    """One SIGKILL inside epoch 0, a NaN loss on rank 1 in the first micro-batch of step 2's window
    (before the kill) in both runs: DeepSpeed skips that update on every rank and the loop counts it;
    bit-identical final weights and per-step losses; DeepSpeed's checkpoint layout, sealed whole."""
    e0, _ = epoch_lengths(train_durations(tiny_corpus), MBS, 2, 2, accumulation=ACCUMULATION)
    steps_e0 = e0 // ACCUMULATION
    assert steps_e0 >= 4
    kill, max_steps = 3, steps_e0 + 2  # the cut is inside epoch 0, the run ends inside epoch 1
    nan = {**DEEPSPEED, "INJECT_FAULT": "nan:1:3"}  # rank 1's 3rd backward: step 2's first micro-batch

    cont = tmp_path / "continuous"
    log = zero2(tiny_corpus, cont, max_steps, env=nan)
    assert "run: DeepSpeed, 2 process(es) on cpu" in log
    assert "step 2: non-finite gradient norm, update skipped (1 in a row, 1 in total)" in log

    cut = tmp_path / "interrupted"
    zero2(tiny_corpus, cut, max_steps, env=nan, kill_after_checkpoint=kill)
    zero2(tiny_corpus, cut, max_steps)
    [(step, epoch, batch)] = resumed_positions(tmp_path / "interrupted.log")
    assert step >= kill and epoch == 0 and batch > 0
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)
    for out in (cont, cut):
        rows = metrics(out)
        assert [r["step"] for r in rows] == list(range(1, max_steps + 1))
        assert [r["skipped_updates"] for r in rows] == [0] + [1] * (max_steps - 1)
        assert rows[1]["grad_norm"] == float("inf")  # DeepSpeed's report of a skipped update
        assert all(0 < r["grad_norm"] < float("inf") for r in rows[:1] + rows[2:])

    # DeepSpeed's own layout: the weights once, one optimizer partition per rank; all under the marker.
    ckpt = cont / "checkpoints" / f"step_{max_steps:08d}"
    names = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}
    assert not {"model.safetensors", "optimizer.bin"} & names, names
    assert {"latest", "pytorch_model/mp_rank_00_model_states.pt", "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= names, names
    marked = json.loads((ckpt / "COMPLETE").read_text())["files"]
    assert set(marked) == names - {"COMPLETE"}
