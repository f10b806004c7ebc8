"""common/training/early_stopping.py: when a validation improves (threshold, direction, NaN), when the
patience runs out, the weights kept and put in for the export, the state a checkpoint holds (a
malformed one is refused in one line before anything is loaded), the auto patience and the
refusals at the start. End to end (the loop stops, exact resume in 1 and 2 processes):
tests/guarantees/test_early_stopping.py."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from common.training.resume import choose_checkpoint
from common.training.sealing import file_digest
from common.training.state import TrainState
from common.training.resume import resume_from_checkpoint as resume
from common.training.checkpoint import save_checkpoint as save
from common.training.early_stopping import (EarlyStopping, lower_is_better, registered_stopper,
                                            resolve_patience, start_early_stopping, state_problem)
from common.training.faults import RunError

ONE = SimpleNamespace(num_processes=1, device=torch.device("cpu"))  # what a stopper asks of a 1-process accelerator


def stopper(patience=2, threshold=0.0, greater=False, model=None):
    model = model or torch.nn.Linear(2, 1)
    return EarlyStopping(ONE, {"model": model}, "eval_cer", greater, patience, threshold)


def validate(s: EarlyStopping, values, start=1):
    """Feed validations at steps start, start+1, ...; returns `stopped` after each."""
    out = []
    for i, v in enumerate(values):
        s.after_validation(SimpleNamespace(stage="boundary", step=start + i), {"eval_cer": v, "eval_loss": 9.0})
        out.append(s.stopped)
    return out


def test_patience_counts_validations_without_an_improvement():
    s = stopper(patience=2)
    assert validate(s, [0.5, 0.4, 0.45, 0.4]) == [False, False, False, True]  # 0.4 again is no improvement
    assert (s.best, s.best_step, s.bad_rounds, s.last_step) == (0.4, 2, 2, 4)
    s = stopper(patience=2)
    assert validate(s, [0.5, 0.6, 0.3, 0.7, 0.2]) == [False] * 5  # an improvement resets the count
    assert (s.best, s.best_step, s.bad_rounds) == (0.2, 5, 0)
    off = stopper(patience=0)
    assert validate(off, [0.5, 0.6, 0.7]) == [False] * 3 and off.best is None  # off: nothing counted


def test_the_threshold_and_the_direction():
    s = stopper(patience=1, threshold=0.05)
    assert validate(s, [0.5, 0.46]) == [False, True]  # better by 0.04 ≤ 0.05: not an improvement
    s = stopper(patience=1, threshold=0.05)
    assert validate(s, [0.5, 0.44]) == [False, False] and s.best_step == 2
    s = stopper(patience=1, greater=True)
    assert validate(s, [0.5, 0.6, 0.55]) == [False, False, True] and s.best == 0.6
    assert [lower_is_better(m) for m in ("eval_loss", "eval_mel_loss", "eval_cer", "eval_wer", "eval_acc")] == [
        True, True, True, True, False]  # transformers' rule for losses, and error rates


def test_a_non_finite_validation_never_becomes_the_best():
    s = stopper(patience=2)
    assert validate(s, [float("nan"), float("inf")]) == [False, True]
    assert s.best is None and not s.weights
    s = stopper(patience=3)
    validate(s, [0.3, float("nan")])
    assert (s.best, s.bad_rounds) == (0.3, 1)


def test_a_missing_metric_and_a_second_call_for_one_step_are_refused():
    s = stopper()
    with pytest.raises(RunError, match=r"--metric_for_best_model eval_cer: this recipe's validation reports "
                                       r"eval_loss, eval_wer: name one of them"):
        s.after_validation(SimpleNamespace(stage="boundary", step=1), {"eval_wer": 0.1, "eval_loss": 1.0})
    validate(s, [0.5], start=3)
    with pytest.raises(Exception, match="call it once per validation, after end_step"):
        validate(s, [0.4], start=3)


def test_the_best_weights_are_kept_and_put_in_for_the_export_only():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    s = stopper(patience=3, model=model)
    validate(s, [0.5])
    best = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model[1].running_mean.add_(2.0)
    validate(s, [0.7], start=2)  # worse: the copy is of step 1
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with s.kept_weights():
        assert all(torch.equal(v, best[k]) for k, v in model.state_dict().items())  # buffers too
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())  # restored bit for bit
    with stopper(patience=0, model=model).kept_weights():  # off: the model as it is
        assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())


def test_the_state_round_trips_through_a_weights_only_load():
    s = stopper(patience=3)
    validate(s, [0.5, 0.6])
    buffer = io.BytesIO()
    torch.save(s.state_dict(), buffer)
    buffer.seek(0)
    held = torch.load(buffer, weights_only=True)  # plain data: what a resume reads, no code run
    assert state_problem(held) is None
    back = stopper(patience=3)
    back.load_state_dict(held)
    assert (back.best, back.best_step, back.bad_rounds, back.last_step) == (0.5, 1, 1, 2)
    assert all(torch.equal(back.weights["model"][k], v) for k, v in s.weights["model"].items())
    other = EarlyStopping(ONE, {"model": torch.nn.Linear(2, 1)}, "eval_wer", False, 3, 0.0)
    with pytest.raises(RunError, match=r"early-stopping state cannot be resumed: it is of eval_cer \(lower is better\), "
                                       r"this run's of eval_wer; use a new --output_dir"):
        other.load_state_dict(held)


@pytest.mark.parametrize("change,why", [
    (lambda h: h.pop("bad_rounds"), "not the keys"),
    (lambda h: h.update(bad_rounds=-1), "whole numbers"),
    (lambda h: h.update(bad_rounds=True), "whole numbers"),
    (lambda h: h.update(best_step=9), "best_step ≤ last_step"),
    (lambda h: h.update(best=float("nan")), "not a finite number"),
    (lambda h: h.update(best="0.5"), "not a finite number"),
    (lambda h: h.update(greater_is_better=1), "no metric name and direction"),
    (lambda h: h.update(weights={"model": [1, 2]}), "not {model: {name: tensor}}"),
    (lambda h: h.update(weights={}), "a best value without its weights"),
])
def test_a_malformed_state_is_named(change, why):
    s = stopper(patience=3)
    validate(s, [0.5, 0.6])
    held = s.state_dict()
    change(held)
    assert why in state_problem(held)
    with pytest.raises(RunError, match="early-stopping state cannot be resumed"):
        stopper(patience=3).load_state_dict(held)  # one line, never a traceback from inside load_state
    assert "not the keys" in state_problem([1, 2])


def run_parts(seed=0):
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt = accelerator.prepare(model, opt)
    state = TrainState(world_size=1, gradient_accumulation_steps=1, global_batch=1, config_hash="h",
                       config={"max_steps": 10})
    return accelerator, model, dict(models=model, optimizers=opt, schedulers=sched), state


def config(**kw):
    base = dict(metric_for_best_model="eval_cer", greater_is_better=None, early_stopping_patience=2,
                early_stopping_threshold=0.0, eval_steps=1, data_dir="voice", dataset_name=None)
    return SimpleNamespace(**{**base, **kw})


def test_a_checkpoint_with_a_malformed_early_stopping_state_is_refused_before_anything_is_loaded(tmp_path):
    """The state passes the weights-only load (plain data, re-sealed) but is not a stopper's: the resume
    names the file and the fix in one line before load_state, instead of failing inside it after the
    weights were loaded."""
    accelerator, model, parts, state = run_parts()
    s = start_early_stopping(accelerator, config(), None, {"model": model})
    assert registered_stopper(accelerator) is s
    resume(accelerator, None, state, **parts)
    for step in (1, 2):
        state.step = step
        s.after_validation(state, {"eval_cer": 1.0 / step})
        ckpt = save(accelerator, tmp_path, state, **parts)
    name = f"custom_checkpoint_{json.loads((ckpt / 'train_state.json').read_text())['registered'].index('EarlyStopping')}.pkl"
    held = torch.load(ckpt / name, weights_only=True)
    held["best_step"] = 7  # after last_step
    torch.save(held, ckpt / name)
    marker = json.loads((ckpt / "COMPLETE").read_text())  # re-sealed: the digests match
    marker["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": file_digest(ckpt / name)}
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    accelerator2, model2, parts2, state2 = run_parts(seed=1)
    start_early_stopping(accelerator2, config(), None, {"model": model2})
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(RunError, match=rf"^{ckpt}: {name} \(the state of the registered EarlyStopping\) holds "
                                       rf"counters that are not whole numbers ≥ 0 with best_step ≤ last_step: a save "
                                       rf"never writes that .*: move step_00000002 out of {ckpt.parent} to resume "
                                       rf"from the checkpoint before it$"):
        resume(accelerator2, choose_checkpoint(accelerator2, tmp_path), state2, **parts2)
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())  # nothing loaded


def test_the_start_refuses_what_cannot_work_in_one_line(tmp_path):
    accelerator, model, parts, state = run_parts()
    with pytest.raises(RunError, match=r"^early stopping \(--early_stopping_patience 2\) counts validations, and "
                                       r"--eval_steps 0 makes none: set --eval_steps, or --early_stopping_patience 0$"):
        start_early_stopping(accelerator, config(eval_steps=0), None, {"model": model})
    sharded = SimpleNamespace(distributed_type=SimpleNamespace(value="FSDP"), unwrap_model=lambda m: m)
    with pytest.raises(RunError, match=r"under FSDP each process holds a shard of them: train with DDP or one "
                                       r"process, or set --early_stopping_patience 0$"):
        start_early_stopping(sharded, config(), None, {"model": model})
    # a checkpoint written with early stopping off, resumed with it on (and the other way)
    off = start_early_stopping(accelerator, config(early_stopping_patience=0), None, {"model": model})
    assert registered_stopper(accelerator) is None and off.card_line(5) is None
    resume(accelerator, None, state, **parts)
    state.step = 1
    ckpt = save(accelerator, tmp_path, state, **parts)
    with pytest.raises(RunError, match=r"^early stopping is on \(--early_stopping_patience 2\) but this run's checkpoint "
                                       r"step_00000001 was written without it .*re-launch with --early_stopping_patience "
                                       r"0 to finish the run as it started, or use a new --output_dir$"):
        start_early_stopping(run_parts()[0], config(), ckpt, {"model": model})
    registered = json.loads((ckpt / "train_state.json").read_text())
    (ckpt / "train_state.json").write_text(json.dumps({**registered, "registered": ["EarlyStopping", "RunState"]}))
    with pytest.raises(RunError, match=r"^early stopping is off \(--early_stopping_patience 0\) but .* with it on: "
                                       r"re-launch with an --early_stopping_patience above 0"):
        start_early_stopping(run_parts()[0], config(early_stopping_patience=0), ckpt, {"model": model})


def test_auto_patience_is_the_recipes_on_a_voice_only():
    auto = lambda **kw: resolve_patience(SimpleNamespace(**{**dict(  # noqa: E731
        early_stopping_patience=None, data_dir="voice", dataset_name=None, eval_steps=250,
        AUTO_EARLY_STOPPING_PATIENCE=4), **kw}),
        kw.pop("hours", 0.5) if "hours" in kw else 0.5)[0]
    assert auto() == 4
    assert auto(data_dir=None) == 0  # the built-in corpus: the bases and the quoted runs unchanged
    assert auto(data_dir=None, dataset_name="my/set") == 4
    assert resolve_patience(SimpleNamespace(early_stopping_patience=None, data_dir="v", dataset_name=None, eval_steps=250,
                                            AUTO_EARLY_STOPPING_PATIENCE=4), 12.0)[0] == 0  # a corpus, not a voice
    assert resolve_patience(SimpleNamespace(early_stopping_patience=None, data_dir="v", dataset_name=None, eval_steps=250,
                                            AUTO_EARLY_STOPPING_PATIENCE=4), None)[0] == 0  # a stream: not known
    assert resolve_patience(SimpleNamespace(early_stopping_patience=None, data_dir="v", dataset_name=None, eval_steps=250,
                                            AUTO_EARLY_STOPPING_PATIENCE=4), 0.5, "FSDP")[0] == 0  # no refusal
    assert auto(eval_steps=0) == 0  # no validation asked: auto stops nothing (a patience given is refused)
    assert resolve_patience(SimpleNamespace(early_stopping_patience=7, data_dir=None), None) == (
        7, "--early_stopping_patience 7")


def test_the_card_says_how_the_run_ended_and_which_weights_it_holds():
    s = stopper(patience=2)
    validate(s, [0.5, 0.4, 0.45])
    assert s.card_line(3) == ("ran to step 3 with early stopping on (eval_cer did not improve by more than 0 in 1 "
                              "validation(s) (patience 2; best 0.4 at step 2)); this folder holds the weights "
                              "validated at step 2, the best eval_cer (0.4)")
    validate(s, [0.41], start=4)
    assert s.card_line(4).startswith("stopped early at step 4: eval_cer did not improve by more than 0 in 2 validation(s)")
