"""prepare_once: one builder across processes, atomic publication, stale locks, failures."""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from common.training.prepare import prepare_once



def _counting_build(tmp: Path, calls_dir: Path, seconds: float) -> None:
    # One file per call, written *outside* the build folder: counts builds across processes.
    (calls_dir / f"{os.getpid()}-{time.monotonic_ns()}").write_text("")
    time.sleep(seconds)
    (tmp / "data.txt").write_text("payload")


def _contender(final_dir: str, calls_dir: str, delay_s: float, results_dir: str) -> None:
    time.sleep(delay_s)
    build = functools.partial(_counting_build, calls_dir=Path(calls_dir), seconds=1.5)
    # stale_after_s far below the build time: only the builder's heartbeat keeps its lock alive.
    out = prepare_once(Path(final_dir), build, timeout_s=30, poll_s=0.05, stale_after_s=0.6)
    assert (out / ".complete").is_file() and (out / "data.txt").read_text() == "payload"
    Path(results_dir, str(os.getpid())).write_text(str(out))


def test_prepare_once_builds_exactly_once_under_concurrency(tmp_path):
    final_dir, calls, results = tmp_path / "shared" / "data", tmp_path / "calls", tmp_path / "results"
    calls.mkdir()
    results.mkdir()
    ctx = multiprocessing.get_context("spawn")
    # Four contenders starting 150 ms apart: the later ones find the lock held and must wait.
    args = [(str(final_dir), str(calls), 0.15 * i, str(results)) for i in range(4)]
    procs = [ctx.Process(target=_contender, args=a) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(list(calls.iterdir())) == 1
    assert {r.read_text() for r in results.iterdir()} == {str(final_dir)}
    assert sorted(p.name for p in final_dir.parent.iterdir()) == ["data"]  # no lock, no temp dirs left


def test_prepare_once_failed_build_leaves_nothing(tmp_path):
    final_dir = tmp_path / "data"

    def failing(tmp: Path) -> None:
        (tmp / "half-written").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        prepare_once(final_dir, failing, poll_s=0.05)
    assert list(tmp_path.iterdir()) == []
    # And the next attempt is not blocked by anything left behind.
    assert prepare_once(final_dir, lambda tmp: (tmp / "ok").write_text("1"), poll_s=0.05) == final_dir
    assert (final_dir / "ok").is_file()


def test_prepare_once_takes_over_a_stale_lock(tmp_path, caplog):
    final_dir = tmp_path / "data"
    lock = tmp_path / "data.lock"
    # A builder on this host was killed: its lock stopped being touched and its temp dir remains.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    lock.write_text(f"{socket.gethostname()} {dead_pid} 0.0 deadbeef\n")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    leftover = tmp_path / f"data.tmp-{socket.gethostname()}-{dead_pid}-0123abcd"
    leftover.mkdir()
    with caplog.at_level("INFO", logger="common.training.prepare"):
        prepare_once(final_dir, lambda tmp: (tmp / "ok").write_text("1"), poll_s=0.05, stale_after_s=0.3)
    assert (final_dir / ".complete").is_file() and not lock.exists() and not leftover.exists()
    assert f"its holder {socket.gethostname()}:{dead_pid} is dead; taking it over" in caplog.text


def test_a_resumable_build_gets_what_a_killed_or_failed_builder_left(tmp_path):
    """resumable=True: a killed builder's folder (dead pid on this host) and a failed build's are
    handed to the next build (as `<final>.partial` in between); never published without `.complete`."""
    final_dir = tmp_path / "data"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / f"data.tmp-{socket.gethostname()}-{int(dead.stdout)}-0123abcd"
    leftover.mkdir()
    (leftover / "first").write_text("1")

    def fails_after_second(tmp: Path) -> None:
        assert (tmp / "first").read_text() == "1"
        (tmp / "second").write_text("2")
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        prepare_once(final_dir, fails_after_second, poll_s=0.05, resumable=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.partial"]
    seen = []
    prepare_once(final_dir, lambda tmp: seen.append(sorted(p.name for p in tmp.iterdir())), poll_s=0.05, resumable=True)
    assert seen == [["first", "second"]] and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_prepare_once_waits_for_a_live_lock_then_times_out(tmp_path):
    final_dir = tmp_path / "data"
    lock = tmp_path / "data.lock"
    lock.write_text("busy-host 1 0.0 cafe\n")
    stop = threading.Event()

    def heartbeat():  # a live builder elsewhere keeps touching its lock
        while not stop.wait(0.05):
            os.utime(lock)

    thread = threading.Thread(target=heartbeat, daemon=True)
    thread.start()
    try:
        with pytest.raises(TimeoutError, match=re.escape(str(lock))):
            prepare_once(final_dir, lambda tmp: None, timeout_s=0.8, poll_s=0.05, stale_after_s=0.3)
    finally:
        stop.set()
        thread.join()
    assert not final_dir.exists() and lock.exists()


def test_prepare_once_never_trusts_a_dir_without_marker(tmp_path):
    final_dir = tmp_path / "data"
    final_dir.mkdir()
    (final_dir / "partial.flac").write_text("truncated")  # an old-style writer crashed here
    out = prepare_once(final_dir, lambda tmp: (tmp / "ok").write_text("1"), poll_s=0.05)
    assert out == final_dir
    assert sorted(p.name for p in final_dir.iterdir()) == [".complete", "ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    # Complete now: a second call returns at once without building.
    assert prepare_once(final_dir, lambda tmp: pytest.fail("rebuilt a complete dir")) == final_dir


def test_a_dead_local_holder_is_taken_over_at_once(tmp_path, caplog):
    """A builder on this host killed mid-way: its lock names a dead pid, so nobody waits the
    stale period (120 s by default) for it."""
    final_dir = tmp_path / "data"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "data.lock").write_text(f"{socket.gethostname()} {int(dead.stdout)} {time.time():.3f} cafe\n")
    with caplog.at_level("INFO", logger="common.training.prepare"):
        prepare_once(final_dir, lambda tmp: (tmp / "ok").write_text("1"), poll_s=0.05)
    assert (final_dir / "ok").is_file() and "is dead; taking it over" in caplog.text
    assert "waiting for" not in caplog.text  # taken over at the first look


def test_a_lock_whose_pid_was_reused_is_taken_over_at_once(tmp_path, caplog):
    """The lock names a live pid of this host, but a process that started at another time (the
    holder died and its pid went to a new process, here this test): the holder is dead."""
    final_dir = tmp_path / "data"
    (tmp_path / "data.lock").write_text(f"{socket.gethostname()} {os.getpid()} started=12345.0 cafe\n")
    with caplog.at_level("INFO", logger="common.training.prepare"):
        prepare_once(final_dir, lambda tmp: (tmp / "ok").write_text("1"), timeout_s=10, poll_s=0.05)
    assert (final_dir / "ok").is_file() and "is dead; taking it over" in caplog.text
    assert "waiting for" not in caplog.text  # taken over at the first look


def test_a_rewritten_lock_keeps_its_heartbeat(tmp_path):
    """`Heartbeat.rewrite` swaps the lock's content atomically and goes on beating for the new content."""
    from common.training.prepare import Heartbeat

    lock = tmp_path / "x.lock"
    lock.write_text("first")
    beat = Heartbeat(lock, "first", interval_s=0.05)
    try:
        beat.rewrite("second")
        assert lock.read_text() == "second" and beat.token == "second"
        os.utime(lock, (0, 0))
        time.sleep(0.5)
        assert lock.stat().st_mtime > 0  # touched again since
        assert sorted(p.name for p in tmp_path.iterdir()) == ["x.lock"]
    finally:
        beat.stop()
