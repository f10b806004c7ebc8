"""Elastic resume: a run started on N processes continues on M with the same global batches.

Per optimizer step the same utterances are used (from the --dump_batch_ids logs) as in a run that
never stopped; losses and weights are close, not bit-identical (the gradient sum is reduced in
another order across a different number of processes). Same-world-size resume stays bit-exact
(test_best_rq.py, test_asr.py, test_tts.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.harness.harness import metrics, resumed_positions, run
from tests.recipes.test_asr import args_for as asr_args_for
from tests.recipes.test_best_rq import args_for
from tests.recipes.test_tts import args_for as tts_args_for

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-4  # relative, per logged step (measured: see the closing note / README "Resume")


def ids_per_step(out: Path) -> dict[int, list[str]]:
    """Optimizer step → the sorted utterance ids of all its micro-batches, over all ranks and launches
    (a micro-batch redone after a kill logs the same ids again: the sampler is deterministic)."""
    by_batch = {}
    for f in sorted(out.glob("batch_ids.rank*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            by_batch[(row["epoch"], row["global_batch"])] = (row["step"], row["ids"])
    steps: dict[int, list[str]] = {}
    for step, ids in by_batch.values():
        steps.setdefault(step, []).extend(ids)
    return {s: sorted(ids) for s, ids in sorted(steps.items())}


def compare(cont: Path, cut: Path, key: str = "loss") -> tuple[float, float]:
    """Same ids per step; (max relative difference of the logged `key`, max absolute weight difference)."""
    assert ids_per_step(cont) == ids_per_step(cut)
    ma, mb = metrics(cont), metrics(cut)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    loss_rel = max(abs(a[key] - b[key]) / abs(a[key]) for a, b in zip(ma, mb))
    wa, wb = load_file(cont / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    weight_abs = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    return loss_rel, weight_abs


@pytest.mark.parametrize("before,after", [pytest.param(2, 1, marks=pytest.mark.accelerate_launch), (1, 2)])
def test_best_rq_continues_on_another_number_of_processes(tiny_corpus, tmp_path, reference, before, after):
    # 1 → 2 needs an even global batch: 1 process × accumulation 2 continues as 2 processes × 1.
    from tests.guarantees.test_faults import STEPS, continuous_args

    accum = 2 if before == 1 else 1
    extra = [*STEPS, "--dump_batch_ids", "true", "--gradient_accumulation_steps", str(accum)]  # 8 steps, across an epoch
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    if before == 2:  # the 2-process reference of test_faults.py (the same run: accumulation 1 is the default)
        cont = reference("best_rq", 2, lambda out: continuous_args(tiny_corpus, out))
    else:
        run("best_rq", before, args_for(tiny_corpus, cont, *extra), launcher=False)  # the reference: forked (the guarantee is the cut run's)
    run("best_rq", before, args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=4, launcher=False)  # harness.KILL_LEG
    log = run("best_rq", after, args_for(tiny_corpus, cut, *extra))
    assert f"checkpoint: {before} process(es) × accumulation {accum}; now: {after} × {accum * before // after}" in log
    [(step, epoch, batch)] = resumed_positions(tmp_path / "interrupted.log")
    assert step >= 4 and batch > 0  # resumed mid-epoch
    loss_rel, weight_abs = compare(cont, cut)
    print(f"best_rq {before}→{after}: max relative loss difference {loss_rel:.2e}, "
          f"max absolute weight difference {weight_abs:.2e}")
    assert loss_rel < LOSS_RTOL and weight_abs < 1e-3


def test_tts_continues_on_fewer_processes(tiny_corpus, tmp_path):
    extra = ["--max_steps", "6", "--save_steps", "1", "--dump_batch_ids", "true"]
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    run("tts", 2, tts_args_for(tiny_corpus, cont, *extra))
    run("tts", 2, tts_args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=3)
    run("tts", 1, tts_args_for(tiny_corpus, cut, *extra))
    loss_rel, weight_abs = compare(cont, cut)
    print(f"tts 2→1: max relative loss difference {loss_rel:.2e}, max absolute weight difference {weight_abs:.2e}")
    assert loss_rel < LOSS_RTOL and weight_abs < 1e-3


def test_asr_continues_on_fewer_processes(tiny_corpus, tmp_path):
    """Speed perturbation on (per-utterance RNG): the same utterances per step after 2 → 1."""
    extra = ["--max_steps", "6", "--save_steps", "1", "--eval_steps", "0", "--speed_perturb", "0.1",
             "--dump_batch_ids", "true"]
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    run("asr", 2, asr_args_for(tiny_corpus, cont, *extra))
    run("asr", 2, asr_args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=3)
    log = run("asr", 1, asr_args_for(tiny_corpus, cut, *extra))
    assert "checkpoint: 2 process(es) × accumulation 1; now: 1 × 2" in log
    [(step, epoch, batch)] = resumed_positions(tmp_path / "interrupted.log")
    print(f"asr 2→1: resumed at step {step}, epoch {epoch}, global micro-batch {batch}")
    assert step >= 3 and batch > 0  # resumed mid-epoch
    loss_rel, weight_abs = compare(cont, cut)
    print(f"asr 2→1: max relative loss difference {loss_rel:.2e}, max absolute weight difference {weight_abs:.2e}")
    assert loss_rel < LOSS_RTOL and weight_abs < 1e-3


def test_a_world_size_that_cannot_keep_the_global_batch_is_refused(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    extra = ["--max_batch_seconds", "16", "--max_steps", "4", "--save_steps", "2"]
    run("best_rq", 1, args_for(tiny_corpus, out, *extra), kill_after_checkpoint=2)
    log = run("best_rq", 2, args_for(tiny_corpus, out, *extra), expect_rc=1)
    assert ("global batch: checkpoint 1 micro-batches per step (1 process(es) × accumulation 1) != now 2 "
            "(2 × 1); processes × accumulation that keep it: 1 × 1") in log
    assert "Traceback" not in log.split("refusing to resume")[0]
