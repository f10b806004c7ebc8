"""One run per output folder, and only a run of this recipe (common/training/rundir.py)."""

import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from common.training.rundir import LOCK, RUN_MARKER, claim_output_dir

MAIN = SimpleNamespace(is_main_process=True, num_processes=1)


def test_claim_writes_the_marker_and_a_live_lock_refuses_a_second_run(tmp_path):
    out = tmp_path / "run"
    claim_output_dir(MAIN, out, "best_rq")
    assert json.loads((out / RUN_MARKER).read_text())["recipe"] == "best_rq"
    holder = json.loads((out / LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(SystemExit, match=f"is in use by {socket.gethostname()}:{os.getpid()}"):
        claim_output_dir(MAIN, out, "best_rq")


def test_a_dead_local_holder_is_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text(json.dumps({"recipe": "asr"}))
    dead = subprocess.run([sys.executable, "-c", "import os, time; print(os.getpid(), time.time())"],
                          capture_output=True, text=True).stdout.split()
    (out / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead[0]), "started": float(dead[1])}))
    claim_output_dir(MAIN, out, "asr")
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("age_s,refused", [(5, True), (3600, False)])
def test_a_remote_holder_is_judged_by_its_heartbeat(tmp_path, age_s, refused):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text(json.dumps({"recipe": "tts"}))
    (out / LOCK).write_text(json.dumps({"host": "other-node", "pid": 1, "started": 0.0}))
    os.utime(out / LOCK, (time.time() - age_s, time.time() - age_s))
    if refused:
        with pytest.raises(SystemExit, match="in use by other-node:1"):
            claim_output_dir(MAIN, out, "tts")
    else:
        claim_output_dir(MAIN, out, "tts")


def test_foreign_or_other_recipe_folders_are_refused_unless_overwrite(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"not a run of this repository \(notes.txt\).*--overwrite_output_dir"):
        claim_output_dir(MAIN, out, "asr")
    assert not (out / LOCK).exists() and not (out / RUN_MARKER).exists()
    claim_output_dir(MAIN, out, "asr", overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    (out / LOCK).unlink()
    with pytest.raises(SystemExit, match="holds a run of the 'asr' recipe, not 'tts'"):
        claim_output_dir(MAIN, out, "tts")
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_output_dir(MAIN, empty, "tts")  # an empty folder is fine


def _racer(root: str, rounds: int, name: str) -> None:
    """One launch per round into `root/<round>`, released at once with the others at the instant
    written in `root/go-<round>` (unless `root/skip-<round>-<name>` exists); writes `won` or the refusal. Won locks stay held
    (this process is alive) until `root/exit` appears."""
    from pathlib import Path

    root = Path(root)
    for r in range(rounds):
        (root / f"ready-{r}-{name}").touch()
        while not (root / f"go-{r}").exists():
            time.sleep(0.002)
        if (root / f"skip-{r}-{name}").exists():
            continue
        start = float((root / f"go-{r}").read_text())  # the wall-clock instant every racer starts at
        time.sleep(max(0.0, start - time.time() - 0.005))
        while time.time() < start:
            pass  # spin the last few ms: the claims start within microseconds of each other
        try:
            claim_output_dir(MAIN, root / str(r), "asr")
            result = "won"
        except SystemExit as e:
            result = str(e)
        (root / f"{name}.tmp").write_text(result)
        os.rename(root / f"{name}.tmp", root / f"result-{r}-{name}")  # complete when it appears
    while not (root / "exit").exists():
        time.sleep(0.01)


def _dead_holder() -> dict:
    pid, started = subprocess.run([sys.executable, "-c", "import os, psutil; p = psutil.Process(); "
                                   "print(p.pid, p.create_time())"], capture_output=True, text=True).stdout.split()
    return {"host": socket.gethostname(), "pid": int(pid), "started": float(started)}


@pytest.mark.slow
def test_launches_released_at_once_never_both_take_the_lock(tmp_path):
    """20 rounds of 2-4 launches released at once by a file; in odd rounds the folder holds a dead
    process's lock that they all judge dead at the same moment. Exactly one wins every round, and
    the others are refused naming it."""
    import multiprocessing

    rounds, racers = 20, 4
    dead = _dead_holder()
    for r in range(rounds):
        (tmp_path / str(r)).mkdir()
        (tmp_path / str(r) / RUN_MARKER).write_text(json.dumps({"recipe": "asr"}))
        if r % 2:
            (tmp_path / str(r) / LOCK).write_text(json.dumps(dead))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_racer, args=(str(tmp_path), rounds, str(i)), daemon=True) for i in range(racers)]
    for p in procs:
        p.start()
    try:
        for r in range(rounds):
            n = 2 + (r // 2) % (racers - 1)  # 2, 3 or 4 racers, with and without a dead holder
            deadline = time.monotonic() + 60
            while len(list(tmp_path.glob(f"ready-{r}-*"))) < racers:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            for i in range(n, racers):
                (tmp_path / f"skip-{r}-{i}").touch()
            (tmp_path / f"go-{r}.tmp").write_text(str(time.time() + 0.1))
            os.rename(tmp_path / f"go-{r}.tmp", tmp_path / f"go-{r}")
            while len(list(tmp_path.glob(f"result-{r}-*"))) < n:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            results = [(tmp_path / f"result-{r}-{i}").read_text() for i in range(n)]
            assert results.count("won") == 1, (r, results)
            winner = json.loads((tmp_path / str(r) / LOCK).read_text())
            assert winner["pid"] != dead["pid"] and winner["state"] == "running"
            for res in results:
                assert res == "won" or f"is in use by {socket.gethostname()}:{winner['pid']}" in res
    finally:
        (tmp_path / "exit").touch()
        for p in procs:
            p.join(30)
            p.terminate()
    assert all(p.exitcode == 0 for p in procs)


@pytest.mark.slow
def test_a_launch_examines_the_lock_only_while_no_other_does(tmp_path):
    """The guard that makes a takeover race-free: while another launch holds `.run.lock.guard`
    (here: this test, with the folder holding a dead process's lock), a launch does not touch the
    lock; it takes it over as soon as the guard is released."""
    import fcntl

    from common.training.rundir import GUARD

    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text(json.dumps({"recipe": "asr"}))
    (out / LOCK).write_text(json.dumps(_dead_holder()))
    code = ("import sys; from types import SimpleNamespace; from common.training.rundir import claim_output_dir; "
            "print('ready', flush=True); "
            "claim_output_dir(SimpleNamespace(is_main_process=True, num_processes=1), sys.argv[1], 'asr')")
    with open(out / GUARD, "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "ready\n"
            time.sleep(1.0)
            assert proc.poll() is None  # waiting for the guard
            assert json.loads((out / LOCK).read_text())["pid"] != proc.pid
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
    assert proc.wait(30) == 0


def _holder(out, stopping: bool, seconds: float) -> subprocess.Popen:
    """A run that holds `out` for `seconds`, after a signal (`stopping`) or not, then ends."""
    code = ("import sys, time; from types import SimpleNamespace; from common.training.rundir import claim_output_dir, "
            "mark_stopping; claim_output_dir(SimpleNamespace(is_main_process=True, num_processes=1), sys.argv[1], "
            f"'asr'); {'mark_stopping(); ' if stopping else ''}print('holding', flush=True); time.sleep({seconds})")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "holding\n"
    return proc


@pytest.mark.slow
def test_a_launch_waits_for_a_stopping_run_and_refuses_a_running_one(tmp_path, caplog):
    """A run that was signalled and is saving its last checkpoint marks its lock `stopping`: a new
    launch says so and waits for it to end, then takes the folder. A running one is refused at
    once, and a stopping one that does not end within the wait is refused too."""
    out = tmp_path / "run"
    running = _holder(out, stopping=False, seconds=30)
    try:
        with caplog.at_level("INFO"), pytest.raises(
                SystemExit, match=f"is in use by {socket.gethostname()}:{running.pid} .*one run per"):
            claim_output_dir(MAIN, out, "asr")
        assert "waiting" not in caplog.text  # refused at the first look, never waited for
    finally:
        running.kill()
        running.wait()

    stuck = _holder(out, stopping=True, seconds=30)
    try:
        assert json.loads((out / LOCK).read_text())["state"] == "stopping"
        with pytest.raises(SystemExit, match="which was stopping .* but has not ended in 2 s"):
            claim_output_dir(MAIN, out, "asr", wait_s=2.0)
    finally:
        stuck.kill()
        stuck.wait()

    caplog.clear()
    ending = _holder(out, stopping=True, seconds=2)
    with caplog.at_level("INFO"):
        claim_output_dir(MAIN, out, "asr")
    assert ending.wait(60) == 0  # it has released the lock: only a hung exit fails here
    assert (f"the previous run is still saving (pid {ending.pid} on {socket.gethostname()}), waiting up to 300 s"
            in caplog.text)
    assert "the previous run ended; continuing" in caplog.text
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()


def test_a_folder_holding_only_a_failed_launchs_lock_is_ours(tmp_path):
    """A launch that stopped before writing run.json (e.g. on a full disk) leaves its lock's files;
    the next launch is not refused as if the folder were someone else's."""
    out = tmp_path / "run"
    out.mkdir()
    (out / f"{LOCK}.guard").touch()
    (out / LOCK).write_text(json.dumps(_dead_holder()))
    claim_output_dir(MAIN, out, "asr")
    assert json.loads((out / RUN_MARKER).read_text())["recipe"] == "asr"


def test_a_full_disk_at_the_claim_names_the_folder(tmp_path, monkeypatch):
    import errno

    import common.training.rundir

    def full(lock, content):  # a write error carries no file name
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(common.training.rundir, "create_lock", full)
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=f"^error: cannot write into {out}: No space left on device: free some space"):
        claim_output_dir(MAIN, out, "asr")
