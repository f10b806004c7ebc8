"""Fault tolerance through the real command line: preemption, kills mid-save, damaged checkpoints,
non-finite losses, a failing rank. Every scenario ends in a clear message and no lost work."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from common.training.sealing import file_digest, list_checkpoints
from tests.harness.harness import (ROOT, SUPPORT, assert_same_losses, assert_same_weights, checkpoint_exists, kill_tree,
                                   metrics, run, worker)
from tests.recipes.test_best_rq import TINY, args_for

pytestmark = pytest.mark.slow

TINY_ARGS = [*TINY, "--max_batch_seconds", "16", "--max_steps", "3",
             "--max_seconds", "8"]
STEPS = ["--max_batch_seconds", "16", "--max_steps", "8", "--save_steps", "1", "--save_total_limit", "2"]


def continuous_args(corpus: Path, out: Path) -> list[str]:
    """The reference runs' arguments: STEPS, their batches' ids logged (test_elastic.py compares a 2 → 1
    resume with the 2-process one; the ids change no weight and no logged value)."""
    return args_for(corpus, out, *STEPS, "--dump_batch_ids", "true")


@pytest.fixture
def continuous(tiny_corpus, reference):
    """Reference runs that were never interrupted, per process count (trained once per test run)."""
    return lambda nproc: reference("best_rq", nproc, lambda out: continuous_args(tiny_corpus, out))


def newest_step(out: Path) -> int:
    return int(list_checkpoints(out)[-1].name.split("_")[1])


@pytest.mark.accelerate_launch
@pytest.mark.parametrize("nproc", [1, 2])
def test_preemption_saves_the_same_step_on_all_ranks_and_resumes_exactly(tiny_corpus, tmp_path, continuous, nproc):
    """SIGUSR1 to the last rank only, then SIGTERM to every rank while the save is running."""
    out = tmp_path / "run"

    def preempt(proc):
        worker(proc, nproc - 1).send_signal(signal.SIGUSR1)

        def second_signal():  # a second signal, during the save the first one asked for
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not list((out / "checkpoints").glob(".step_*.tmp")):
                time.sleep(0.001)
            for r in range(nproc):
                try:
                    worker(proc, r).send_signal(signal.SIGTERM)
                except Exception:  # already gone
                    pass

        threading.Thread(target=second_signal, daemon=True).start()

    log = run("best_rq", nproc, args_for(tiny_corpus, out, *STEPS), when=checkpoint_exists(2), then=preempt,
              expect_rc=1)  # accelerate launch reports any non-zero worker exit as 1
    assert "preempted at step" in log and "exit code 75" in log
    assert "75" in log.split("preempted at step")[1]  # the workers' own exit status
    stopped = newest_step(out)
    assert 2 <= stopped < 8
    assert not (out / "final").exists()
    rows = metrics(out)
    assert rows[-1]["step"] == stopped
    run("best_rq", nproc, args_for(tiny_corpus, out, *STEPS), launcher=False)  # the resume: forked (the kill legs' resumes are the real launcher's)
    assert_same_weights(continuous(nproc), out)
    assert_same_losses(continuous(nproc), out)


@pytest.mark.accelerate_launch  # the re-launch is `accelerate launch`, as the scenario's user types it
def test_a_killed_launcher_stops_its_workers_and_an_immediate_relaunch_resumes_exactly(tiny_corpus, tmp_path,
                                                                                        continuous):
    """`kill -9 -- -<pgid>` of a setsid'ed 2-process `accelerate launch` kills the launcher only: torch's
    elastic agent starts its workers in sessions of their own. They notice their launcher is gone and
    stop as on a preemption (save at the next step, exit 75, lock released), and the same command
    launched at once waits for them, resumes, and ends bit-identical to a run never interrupted."""
    out = tmp_path / "run"
    args = args_for(tiny_corpus, out, *STEPS)
    workers = []

    def kill_launcher_group(proc):  # what a scheduler killing the job's process group does
        workers.extend(worker(proc, r) for r in range(2))
        os.killpg(proc.pid, signal.SIGKILL)

    # 3 s per save: the orphans, left alone, would still be training when the re-launch starts
    run("best_rq", 2, args, when=checkpoint_exists(2), then=kill_launcher_group, expect_rc=None,
        env={"PYTHONPATH": str(SUPPORT), "SLOW_SAVE": "3"})
    try:
        assert all(running(w) for w in workers)  # survived the group kill ...
        deadline = time.monotonic() + 30  # ... and mark the run lock: a re-launch meanwhile waits, never refused
        while json.loads((out / ".run.lock").read_text())["state"] != "stopping":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        log = run("best_rq", 2, args)
        assert not [w for w in workers if running(w)]
    finally:
        for w in workers:
            if running(w):
                w.kill()
    both = (tmp_path / "run.log").read_text()  # the orphans' lines too (they kept the launcher's stdout)
    assert both.count("the launcher (pid ") == 2 and "preempted at step" in both  # each rank says why
    assert "resumed from" in log and "Traceback" not in both
    assert newest_step(out) == 8
    assert_same_weights(continuous(2), out)
    assert_same_losses(continuous(2), out)


def running(p: psutil.Process) -> bool:
    """Not ended (an orphan's zombie counts as ended: its new parent may never reap it)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_kill_mid_save_and_torn_metrics_line_lose_nothing(tiny_corpus, tmp_path, continuous):
    out = tmp_path / "run"
    args = args_for(tiny_corpus, out, *STEPS[:-1], "1")  # keep a single checkpoint: the riskiest setting
    # SIGKILL while the step-4 checkpoint is being written
    run("best_rq", 1, args, when=lambda o: (o / "checkpoints" / ".step_00000004.tmp" / "model.safetensors").exists(),
        then=kill_tree, expect_rc=None, env={"PYTHONPATH": str(SUPPORT), "SLOW_SAVE": "3"})
    assert [p.name for p in list_checkpoints(out)] == ["step_00000003"]  # the older one is intact
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1.2')  # a line torn by the kill
    log = run("best_rq", 1, args)
    assert "resumed from" in log and "step 3" in log
    assert_same_weights(continuous(1), out)
    assert_same_losses(continuous(1), out)
    assert [r["step"] for r in metrics(out)] == list(range(1, 9))


class _Crafted:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("damage", ["truncated weights", "crafted pickle", "crafted registered state"])
def test_damaged_newest_checkpoint_is_skipped(tiny_corpus, tmp_path, continuous, damage):
    """A truncated file (its marker still there), or a crafted RNG pickle or registered state (the run's
    position, which accelerate would unpickle with weights_only=False) whose digest was re-sealed into
    the marker: the checkpoint is named in a warning and the one before it resumes exactly."""
    out = tmp_path / "run"
    run("best_rq", 1, args_for(tiny_corpus, out, *STEPS), kill_after_checkpoint=5)
    newest = list_checkpoints(out)[-1]
    if damage == "truncated weights":
        weights = newest / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])  # truncated, marker still there
        expected = "model.safetensors has"
    else:
        name = "random_states_0.pkl" if damage == "crafted pickle" else "custom_checkpoint_0.pkl"
        torch.save({"step": _Crafted()}, newest / name)
        marker = json.loads((newest / "COMPLETE").read_text())
        marker["files"][name] = {"bytes": (newest / name).stat().st_size, "sha256": file_digest(newest / name)}
        (newest / "COMPLETE").write_text(json.dumps(marker))
        expected = f"{name} cannot be loaded safely (UnpicklingError: "
    log = run("best_rq", 1, args_for(tiny_corpus, out, *STEPS))
    assert f"skipping damaged checkpoint {newest}: {expected}" in log
    assert "Traceback" not in log and not list(ROOT.glob("pwned"))
    assert_same_weights(continuous(1), out)
    assert_same_losses(continuous(1), out)


def test_a_checkpoint_in_the_json_layout_resumes_exactly(tiny_corpus, tmp_path, continuous):
    """A checkpoint as written before the run's state was registered for checkpointing (the position
    and the schedule in train_state.json only, no custom_checkpoint_0.pkl) resumes bit-exactly."""
    out = tmp_path / "run"
    run("best_rq", 1, args_for(tiny_corpus, out, *STEPS), kill_after_checkpoint=4)
    newest = list_checkpoints(out)[-1]
    saved = json.loads((newest / "train_state.json").read_text())
    assert saved.pop("registered") == ["RunState"]
    (newest / "train_state.json").write_text(json.dumps(saved, indent=2))
    (newest / "custom_checkpoint_0.pkl").unlink()
    marker = json.loads((newest / "COMPLETE").read_text())
    del marker["files"]["custom_checkpoint_0.pkl"]
    marker["files"]["train_state.json"] = {"bytes": (newest / "train_state.json").stat().st_size,
                                           "sha256": file_digest(newest / "train_state.json")}
    (newest / "COMPLETE").write_text(json.dumps(marker))
    log = run("best_rq", 1, args_for(tiny_corpus, out, *STEPS))
    assert f"resumed from {newest}" in log and "skipping" not in log
    assert_same_weights(continuous(1), out)
    assert_same_losses(continuous(1), out)


def test_changed_settings_are_refused_on_resume(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    run("best_rq", 1, args_for(tiny_corpus, out, *STEPS), kill_after_checkpoint=2)
    log = run("best_rq", 1, args_for(tiny_corpus, out, *STEPS, "--gradient_accumulation_steps", "2",
                                     "--learning_rate", "0.1"), expect_rc=1)
    assert "refusing to resume" in log
    assert "global batch: checkpoint 1 micro-batches per step (1 process(es) × accumulation 1) != now 2" in log
    assert "learning_rate: checkpoint" in log


def test_non_finite_loss_on_one_rank_skips_the_update_everywhere(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    log = run("best_rq", 2, args_for(tiny_corpus, out, *STEPS),
              env={"PYTHONPATH": str(SUPPORT), "INJECT_FAULT": "nan:1:3"})
    assert "step 3: non-finite gradient norm, update skipped (1 in a row, 1 in total)" in log
    rows = metrics(out)
    assert [r["skipped_updates"] for r in rows] == [0, 0] + [1] * 6
    assert all(torch.isfinite(t).all() for t in load_file(out / "final" / "model.safetensors").values())


def test_consecutive_non_finite_losses_stop_the_run(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    log = run("best_rq", 1, args_for(tiny_corpus, out, *STEPS, "--max_nonfinite_updates", "3"),
              env={"PYTHONPATH": str(SUPPORT), "INJECT_FAULT": "nan:*:4,5,6"}, expect_rc=1)
    assert ("[rank 0] error: 3 consecutive non-finite updates; stopping (last good checkpoint kept). Lower "
            "--learning_rate?") in log and "(traceback above)" not in log  # a known fix: one line, no traceback
    assert newest_step(out) == 5  # skipped updates leave the weights as they were: still saved
    for ckpt in list_checkpoints(out):
        assert all(torch.isfinite(t).all() for t in load_file(ckpt / "model.safetensors").values())


def test_an_exception_on_one_rank_stops_every_rank_quickly(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    log = run("best_rq", 2, args_for(tiny_corpus, out, *STEPS),
              env={"PYTHONPATH": str(SUPPORT), "INJECT_FAULT": "raise:1:3"}, expect_rc=1, timeout=120)
    assert "[harness] rank(s)" not in log  # rank 0 ended on its own, not SIGKILLed after the launcher's grace
    assert log.count("RuntimeError: injected failure") == 1 and "[rank 1] FAILED" in log
    assert log.count("Traceback") <= 2  # the failing rank's (+ the launcher's summary), none from rank 0


def test_bad_data_stops_with_a_report_or_is_skipped(bad_corpus, tmp_path):
    out = tmp_path / "strict"
    log = run("best_rq", 2, ["--data_dir", str(bad_corpus), "--output_dir", str(out), *TINY_ARGS,
                             "--data_check", "full"], expect_rc=1)
    assert log.count("9 unusable entries in") == 1  # one report, from the main process
    for n in range(1, 12):
        if n not in (7, 9):  # 8 kHz is resampled; the duplicate's first copy is fine
            assert f"999-9990.trans.txt:{n}:" in log
    assert not list(out.glob("checkpoints/step_*"))
    out = tmp_path / "lenient"
    log = run("best_rq", 2, ["--data_dir", str(bad_corpus), "--output_dir", str(out), *TINY_ARGS,
                             "--on_bad_data", "skip"])
    # the default header check: the silent file (line 4) is not decoded, so it is kept
    assert "skipping 8 of 61 entries" in log and (out / "final" / "model.safetensors").exists()


def test_when_every_checkpoint_is_damaged_the_relaunch_stops_and_resume_false_starts_over(tiny_corpus, tmp_path,
                                                                                          continuous):
    """Crafted pickles in both checkpoints of a run (re-sealed): the re-launch stops in one line naming
    each, with both still on disk (not a fresh start that saves over them and prunes them); with
    --resume false it starts over from step 0, the damaged ones moved aside, not deleted."""
    out = tmp_path / "run"
    shutil.copytree(continuous(1), out)  # a finished run: its last two checkpoints and final/
    damaged = list_checkpoints(out)
    assert [p.name for p in damaged] == ["step_00000007", "step_00000008"]
    for ckpt in damaged:
        torch.save({"step": _Crafted()}, ckpt / "random_states_0.pkl")
        marker = json.loads((ckpt / "COMPLETE").read_text())
        marker["files"]["random_states_0.pkl"] = {"bytes": (ckpt / "random_states_0.pkl").stat().st_size,
                                                  "sha256": file_digest(ckpt / "random_states_0.pkl")}
        (ckpt / "COMPLETE").write_text(json.dumps(marker))
    log = run("best_rq", 1, args_for(tiny_corpus, out, *STEPS), expect_rc=1)
    assert (f"error: no checkpoint in {out / 'checkpoints'} can be resumed, so nothing was loaded and nothing "
            f"deleted: step_00000008 (random_states_0.pkl cannot be loaded safely (UnpicklingError: ") in log
    assert "; step_00000007 (random_states_0.pkl cannot be loaded safely" in log and "--resume false" in log
    assert "Traceback" not in log and not list(ROOT.glob("pwned"))
    assert list_checkpoints(out) == damaged

    log = run("best_rq", 1, args_for(tiny_corpus, out, *STEPS, "--max_steps", "1", "--resume", "false"))
    aside, = out.glob("checkpoints.before_*")
    assert f"the previous checkpoints were moved to {aside}" in log and "resumed from" not in log
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000007", "step_00000008"]
    assert [p.name for p in list_checkpoints(out)] == ["step_00000001"]
    assert [r["step"] for r in metrics(out)] == [1]
