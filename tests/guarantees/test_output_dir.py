"""The output folder is a transaction, through the real command line (BEST-RQ, tiny corpus): one run
at a time, nothing half-written, nothing silently changed. Each test names the case it covers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.training.sealing import list_checkpoints
from tests.harness.harness import (ROOT, SUPPORT, base_env, checkpoint_exists, command, fork, kill_tree, metrics, run,
                                   worker)
from tests.recipes.test_best_rq import TINY, args_for

pytestmark = pytest.mark.slow

STEPS = ["--max_batch_seconds", "16", "--save_steps", "2", "--save_total_limit", "2"]


def test_second_launch_into_a_busy_output_dir_is_refused(tiny_corpus, tmp_path):
    """A double-submitted job: the second launch stops at once, naming the first; the first is
    undisturbed. After the first is SIGKILLed, a re-launch takes its lock over at once."""
    out = tmp_path / "run"
    # --num_threads 1: started outside the harness's CPU tokens, it would take both cores' threads, and so
    # would the re-launch that resumes its checkpoint (tests/harness/harness.py, cpu_tokens).
    # `python train.py`, forked from the fork server (its imports spared) unless HARNESS_FORK=0: what is
    # tested is the run lock, not the launcher (test_a_relaunch_right_after_ctrl_c_waits_for_the_save has it).
    argv = command("best_rq", 1, args_for(tiny_corpus, out, *STEPS, "--max_steps", "400", "--num_threads", "1"),
                   launcher=False)[1:]
    with open(tmp_path / "first.log", "w") as log:
        first = fork(argv, 1, base_env(None), log) or subprocess.Popen(
            [sys.executable, *argv], env=base_env(None), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / ".run.lock").is_file():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        log = run("best_rq", 2, args_for(tiny_corpus, out, *STEPS, "--max_steps", "4"), expect_rc=1)
        assert "is in use by" in log and "one run per --output_dir" in log
        assert first.poll() is None  # still training
        refused_after = time.monotonic() - t0
    finally:
        kill_tree(first)
    assert (out / ".run.lock").is_file()  # left behind by the SIGKILL
    # Finish at once: at the killed run's newest step (a lower --max_steps is refused), or 4.
    done = max([4] + [int(p.name[5:]) for p in (out / "checkpoints").glob("step_*")])
    t0 = time.monotonic()
    run("best_rq", 1, args_for(tiny_corpus, out, *STEPS, "--max_steps", str(done)))
    assert not (out / ".run.lock").exists() and (out / "final" / "model.safetensors").is_file()
    print(f"refused in {refused_after:.1f} s; re-launch after SIGKILL finished in {time.monotonic() - t0:.1f} s")


def test_a_kill_during_the_export_leaves_no_final(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    args = args_for(tiny_corpus, out, *STEPS, "--max_steps", "4")
    run("best_rq", 1, args, env={"PYTHONPATH": str(SUPPORT), "SLOW_EXPORT": "5"},
        when=lambda o: (o / ".final.tmp" / "model.safetensors").is_file(), then=kill_tree, expect_rc=None)
    assert not (out / "final").exists()
    log = run("asr", 1, ["--data_dir", str(tiny_corpus / "librispeech"), "--output_dir", str(tmp_path / "asr"),
                         "--init_from", str(out)], expect_rc=2)  # a usage error (1 through accelerate launch)
    assert f"[rank 0] error: --init_from {out}: the export of this run did not finish" in log
    run("best_rq", 1, args)  # the same command finishes the export
    assert sorted(p.name for p in (out / "final").iterdir()) == ["COMPLETE", "README.md", "config.yaml", "encoder",
                                                                 "model.safetensors"]
    assert not (out / ".final.tmp").exists()


def test_changed_data_is_refused_on_resume(tiny_corpus, tmp_path):
    data = tmp_path / "librispeech"
    shutil.copytree(tiny_corpus / "librispeech", data)
    out = tmp_path / "run"
    base = ["--data_dir", str(data), "--output_dir", str(out), *TINY, *STEPS]
    run("best_rq", 1, [*base, "--max_steps", "2"])
    victim = sorted((data / "train").glob("*/*/*.flac"))[0]
    trans = next(victim.parent.glob("*.trans.txt"))
    trans.write_text("".join(line + "\n" for line in trans.read_text().splitlines()
                             if not line.startswith(victim.stem + " ")))
    victim.unlink()
    log = run("best_rq", 1, [*base, "--max_steps", "4"], expect_rc=1)
    assert "training data changed: checkpoint 48 utterances" in log and "!= now 47" in log
    assert "re-launch with the checkpoint's settings and data" in log
    assert [c.name for c in list_checkpoints(out)] == ["step_00000002"]


def test_disk_full_during_a_save_or_the_export(tiny_corpus, tmp_path):
    """The disk fills up while a checkpoint is saved (an OSError), then while the export writes its
    safetensors file (safetensors' own SafetensorError): each time one line says how much to free
    and which checkpoints may go, the partial folder is removed, and the same command continues."""
    out = tmp_path / "run"
    args = args_for(tiny_corpus, out, *STEPS, "--max_steps", "6")
    log = run("best_rq", 1, args, env={"PYTHONPATH": str(SUPPORT), "ENOSPC_AT_SAVE": "2"}, expect_rc=1)
    assert "[rank 0] error: no space left on" in log and "while saving step 4" in log and "step 2 is kept" in log
    assert "re-run the same command to resume" in log
    assert "Traceback" not in log.split("[rank 0] error")[0]  # one line, no traceback (the launcher's comes after)
    assert [c.name for c in list_checkpoints(out)] == ["step_00000002"]
    assert not list((out / "checkpoints").glob(".step_*.tmp"))
    # space again for the checkpoints (steps 4, 6), not for the export: the third safetensors file
    log = run("best_rq", 1, args, env={"PYTHONPATH": str(SUPPORT), "ENOSPC_AT_SAFETENSORS": "3"}, expect_rc=1)
    error = log.split("[rank 0] error: ")[1].splitlines()[0]
    assert error.startswith("no space left on ") and f"while exporting the final model to {out / 'final'}" in error
    assert "the partial export was removed and step 6 is kept" in error
    assert f"the older checkpoints in {out / 'checkpoints'}: step_00000004" in error and "keep step_00000006" in error
    assert "re-run the same command to finish the export" in error
    assert "Traceback" not in log.split("[rank 0] error")[0]
    assert not (out / "final").exists() and not (out / ".final.tmp").exists()
    log = run("best_rq", 1, args)  # space again: the same command finishes
    assert "resumed from" in log and (out / "final" / "COMPLETE").is_file()


def test_kill_and_sigterm_during_data_preparation(tmp_path):
    """The built-in corpus is being generated when the run is SIGKILLed: its lock names a dead local
    process, so the re-launch takes it over at once (no 120 s wait). That one gets SIGTERM while
    generating: exit 75, no lock, no temp folder."""
    cache, out = tmp_path / "cache", tmp_path / "run"
    args = ["--builtin_corpus", "tiny", "--data_cache_dir", str(cache), "--output_dir", str(out), *TINY,
            "--max_steps", "2"]
    preparing = lambda o: any(cache.glob("*.tmp-*"))  # noqa: E731

    run("best_rq", 1, args, when=preparing, then=kill_tree, expect_rc=None)
    assert list(cache.glob("*.lock"))  # left behind by the SIGKILL

    def sigterm(proc):
        worker(proc, 0).send_signal(signal.SIGTERM)

    dead = set(cache.glob("*.tmp-*"))  # the killed builder's: removed by the next one before it builds
    log = run("best_rq", 1, args, when=lambda o: bool(set(cache.glob("*.tmp-*")) - dead), then=sigterm,
              expect_rc=None)
    assert "is dead; taking it over" in log and "is preparing it" not in log  # not waited for (stale period)
    assert "SIGTERM during start-up: stopping" in log
    assert not list(cache.glob("*.lock")) and not list(cache.glob("*.tmp-*"))
    assert not (out / ".run.lock").exists()
    run("best_rq", 1, args)  # and the next launch prepares the corpus and trains


def test_foreign_output_dir_is_refused(tiny_corpus, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my: own file\n")
    log = run("best_rq", 1, args_for(tiny_corpus, out, *STEPS, "--max_steps", "2"), expect_rc=1)
    assert "already holds files that are not a run of this repository (config.yaml)" in log
    assert (out / "config.yaml").read_text() == "my: own file\n"
    run("best_rq", 1, args_for(tiny_corpus, out, *STEPS, "--max_steps", "2", "--overwrite_output_dir", "true"))
    assert json.loads((out / "run.json").read_text())["recipe"] == "best_rq"
    log = run("asr", 1, ["--data_dir", str(tiny_corpus / "librispeech"), "--output_dir", str(out)], expect_rc=1)
    assert "holds a run of the 'best_rq' recipe, not 'asr'" in log


@pytest.mark.accelerate_launch
def test_ctrl_c_saves_at_the_next_step_then_exits(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    args = args_for(tiny_corpus, out, "--max_batch_seconds", "16", "--save_steps", "100", "--max_steps", "200")

    def ctrl_c(proc):  # what a terminal does: SIGINT to the launcher's process group (it forwards it)
        os.killpg(proc.pid, signal.SIGINT)

    log = run("best_rq", 2, args, when=lambda o: (o / "metrics.jsonl").is_file(), then=ctrl_c, expect_rc=1)
    assert log.count("Ctrl-C: saving a checkpoint at the next step boundary") == 1 and "preempted at step" in log
    [ckpt] = list_checkpoints(out)
    assert 0 < int(ckpt.name[5:]) < 100

    def ctrl_c_twice(proc):  # the second one while the checkpoint asked for by the first is written
        w = worker(proc, 0)
        w.send_signal(signal.SIGINT)
        time.sleep(1.0)
        w.send_signal(signal.SIGINT)

    out2 = tmp_path / "run2"
    log = run("best_rq", 1, args_for(tiny_corpus, out2, *args[4:]), when=lambda o: (o / "metrics.jsonl").is_file(),
              then=ctrl_c_twice, expect_rc=130, env={"PYTHONPATH": str(SUPPORT), "SLOW_SAVE": "5"},
              launcher=False)  # the signals go to the training process itself: forked (its own exit code)
    assert "aborted (Ctrl-C twice)" in log and "Traceback (most recent call last)" not in log.split("aborted")[0][-300:]
    assert not list_checkpoints(out2)


def test_tensorboard_holds_every_step_once_after_a_resume(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    args = args_for(tiny_corpus, out, "--max_batch_seconds", "16", "--save_steps", "3", "--max_steps", "9",
                    "--report_to", "tensorboard")
    run("best_rq", 1, args, when=lambda o: checkpoint_exists(3)(o) and any(r["step"] >= 5 for r in metrics(o)),
        then=kill_tree, expect_rc=None)
    run("best_rq", 1, args)
    events = out / "tensorboard" / "run"  # <output_dir>/tensorboard/<project: the output folder's name>
    assert len(list(events.glob("events.out.tfevents.*"))) == 2  # one file per launch
    acc = EventAccumulator(str(events))
    acc.Reload()  # reads both files in order, applying the resumed run's purge
    steps = [e.step for e in acc.Scalars("loss")]
    assert steps == list(range(1, 10)), steps
    assert [r["step"] for r in metrics(out)] == list(range(1, 10))


def test_input_that_used_to_slip_through_is_named(tiny_corpus, tmp_path):
    """Invalid UTF-8 in a transcript and audio beside a 0-byte trans.txt stop the run (2 processes)
    with one report naming each entry, instead of training on mangled or fewer utterances."""
    data = tmp_path / "librispeech"
    shutil.copytree(tiny_corpus / "librispeech", data)
    first, second = sorted((data / "train").glob("*/*/*.trans.txt"))[:2]
    lines = first.read_bytes().splitlines()
    first.write_bytes(b"\n".join([lines[0] + b" CAF\xe9", *lines[1:]]) + b"\n")
    second.write_bytes(b"")
    log = run("best_rq", 2, ["--data_dir", str(data), "--output_dir", str(tmp_path / "run"), *TINY], expect_rc=1)
    assert f"{first}:1: invalid UTF-8 in transcript" in log
    assert log.count(".flac: audio without a transcript line") == len(list(second.parent.glob("*.flac")))
    assert log.count("unusable entries in") == 1 and "Traceback" not in log.split("unusable entries")[0]


def test_a_killed_peer_is_reported_as_such(tiny_corpus, tmp_path):
    """Rank 1 SIGKILLed mid-training prints nothing; rank 0 says so instead of pointing at an error
    that was never printed."""
    out = tmp_path / "run"
    log = run("best_rq", 2, args_for(tiny_corpus, out, *STEPS, "--max_steps", "200"),
              when=lambda o: (o / "metrics.jsonl").is_file(), then=lambda p: worker(p, 1).send_signal(signal.SIGKILL),
              expect_rc=1, timeout=120)
    assert "[rank 0] stopping: another process stopped (killed, or failed: its error, if it could print one" in log
    assert "printed above" not in log


def test_a_relaunch_right_after_ctrl_c_waits_for_the_save(tiny_corpus, tmp_path):
    """Ctrl-C on `accelerate launch` returns to the shell at once while the training process still
    saves (here a 20 s save). The same command, run at once, says so and waits for that save to
    end instead of refusing the folder, then resumes from it."""
    out = tmp_path / "run"
    args = args_for(tiny_corpus, out, "--max_batch_seconds", "16", "--save_steps", "100", "--max_steps", "60",
                    "--num_threads", "1")  # started outside the CPU tokens: see the test above
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "SLOW_SAVE": "20",
           "PYTHONPATH": os.pathsep.join([str(SUPPORT), str(ROOT)])}
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command("best_rq", 1, args), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    training = None  # the training process under the launcher
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        training = worker(first, 0)
        os.killpg(first.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        first.wait(15)  # the launcher is gone at once ...
        holder = json.loads((out / ".run.lock").read_text())
        assert holder["pid"] == training.pid and training.is_running()  # ... while its training process saves
        log = run("best_rq", 1, args)
    finally:
        if first.poll() is None:
            kill_tree(first)
        if training is not None and training.is_running():
            training.kill()
    assert (f"the previous run is still saving (pid {holder['pid']} on {socket.gethostname()}), waiting up to "
            f"300 s" in log)
    assert "the previous run ended; continuing" in log and "resumed from" in log
    assert "preempted at step" in (tmp_path / "first.log").read_text()
    assert (out / "final" / "COMPLETE").is_file()
