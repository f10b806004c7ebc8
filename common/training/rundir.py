"""The output folder belongs to one run at a time, and only to a run of this recipe.

- `<output_dir>/run.json` names the recipe that created the folder. A folder that holds files but no
  `run.json` (a user's own folder, another tool's output) is refused unless `--overwrite_output_dir`;
  a folder made by another recipe is refused likewise.
- `<output_dir>/.run.lock` holds the running job's host, pid, process start time, state
  (`running`, or `stopping` once it was signalled and saves its last checkpoint) and a heartbeat
  (its mtime, touched every 10 s). It is created complete in one step (`common.training.prepare.create_lock`)
  and examined, taken and broken only under an exclusive `flock` of `.run.lock.guard` (never
  deleted), so two launches released at once cannot both take it. A second launch into the same
  folder — a double-submitted job, a requeue while the old job still runs, a second node started
  with the wrong `--machine_rank` — is refused at once, naming the holder, unless the holder is
  `stopping`: then it waits up to `STOPPING_WAIT_S` for it to end (Ctrl-C on `accelerate launch`
  returns to the shell while the training process still saves). A lock left by a dead process on
  this host is taken over at once (a SIGKILLed run re-launches immediately); a lock from another
  host is taken over once its heartbeat is older than `STALE_AFTER_S`. (Not the `filelock`
  package: see common/training/prepare.py; the `flock` guard only orders launches on one host, the linked
  lock file decides between hosts.)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from accelerate.utils import broadcast_object_list

from common.training.prepare import Heartbeat, break_lock, create_lock, process_alive, process_start_time

logger = logging.getLogger(__name__)

RUN_MARKER = "run.json"
LOCK = ".run.lock"
GUARD = ".run.lock.guard"  # flock'ed while the lock is examined and taken (an empty file, kept)
STALE_AFTER_S = 120.0  # a remote holder whose heartbeat is older than this is presumed dead
HEARTBEAT_S = 10.0
STOPPING_WAIT_S = 300.0  # how long a launch waits for a `stopping` holder to finish its last save
POLL_S = 1.0  # ... checking every this many seconds
_WAIT = "wait"  # claim verdict: poll again


class OutputDirError(RuntimeError):
    """The output folder cannot be used by this run; the message says why and what to do."""


def holder_is_alive(holder: dict, host: str) -> bool:
    """Same host: the process exists and started when the lock says. Other host: fresh heartbeat."""
    if holder.get("host") == host:
        return process_alive(int(holder.get("pid", -1)), holder.get("started"))
    return time.time() - holder.get("heartbeat", 0.0) < STALE_AFTER_S


def _describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"{holder.get('host')}:{holder.get('pid')} (running since {since})"


@dataclasses.dataclass
class _Held:
    lock: Path
    me: dict
    heartbeat: Heartbeat
    stopping: bool = False


_held: _Held | None = None  # the run lock this process holds


@contextlib.contextmanager
def _one_at_a_time(out: Path):
    """An exclusive flock on `out/GUARD` (released by the kernel if we die): launches examine,
    break and take the lock one after the other, so two of them can never both judge a dead
    holder dead and both take over. On a file system without locks this is skipped: taking a
    free lock stays atomic, two simultaneous takeovers of a dead holder's lock are then possible."""
    fd = os.open(out / GUARD, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the flock


def _read_holder(lock: Path) -> tuple[str | None, dict]:
    """The lock's text (None: no lock) and its record with the heartbeat ({}: unreadable)."""
    try:
        text = lock.read_text()
        mtime = lock.stat().st_mtime
    except FileNotFoundError:
        return None, {}
    try:
        holder = json.loads(text)
    except ValueError:  # a lock written in two steps by an older version and killed between them
        return text, {}
    return text, {**holder, "heartbeat": mtime} if isinstance(holder, dict) else {}


def _take_lock(out: Path) -> dict | None:
    """Take `out/LOCK`: None when it is ours now, else the live holder's record."""
    global _held
    lock = out / LOCK
    host, pid = socket.gethostname(), os.getpid()
    me = {"host": host, "pid": pid, "started": process_start_time(pid), "state": "running"}
    with _one_at_a_time(out):
        for _ in range(3):
            if create_lock(lock, json.dumps(me)):
                break
            text, holder = _read_holder(lock)
            if holder and holder_is_alive(holder, host):
                return holder
            if text is not None:  # dead, or unreadable: ours now
                break_lock(lock, text)
        else:
            raise OutputDirError(f"could not take {lock}: other processes keep replacing it")
    held = _Held(lock, me, Heartbeat(lock, json.dumps(me), HEARTBEAT_S))
    _held = held

    def release():
        global _held
        _held = None
        held.heartbeat.stop()
        try:
            with _one_at_a_time(out):
                text, _ = _read_holder(lock)
                if text == held.heartbeat.token:  # ours (never a successor's)
                    lock.unlink()
        except OSError:
            pass  # the folder is gone

    atexit.register(release)
    return None


def mark_stopping() -> None:
    """Say in this process's run lock, if it holds one, that the run is stopping: it received a
    signal and saves its last checkpoint. A launch into the same folder then waits for it instead
    of refusing. Called from signal handlers: does nothing a second time."""
    held = _held
    if held is None or held.stopping:
        return
    held.stopping = True
    try:
        held.heartbeat.rewrite(json.dumps({**held.me, "state": "stopping"}))
    except OSError:
        pass  # a full disk: a launch meanwhile is refused, as for a running holder


def _ours(name: str) -> bool:
    return name == LOCK or name.startswith(f"{LOCK}.")  # the lock, its guard, its temp files


def check_recipe_folder(out: Path, recipe: str, overwrite: bool) -> None:
    """Refuse a folder that holds files but is not a run of `recipe` (unless `overwrite`)."""
    marker = out / RUN_MARKER
    if marker.is_file():
        try:
            owner = json.loads(marker.read_text()).get("recipe")
        except ValueError:
            owner = None
        if owner == recipe or overwrite:
            return
        raise OutputDirError(f"{out} holds a run of the {owner!r} recipe, not {recipe!r}: use another "
                             f"--output_dir, or --overwrite_output_dir true to write into it anyway")
    # a launch that stopped before writing run.json leaves only its lock's files
    entries = [p.name for p in out.iterdir() if not _ours(p.name)] if out.is_dir() else []
    if (out / "checkpoints").is_dir() and (out / "config.yaml").is_file():
        return  # a run written before run.json existed
    if entries and not overwrite:
        shown = ", ".join(sorted(entries)[:4]) + (", ..." if len(entries) > 4 else "")
        raise OutputDirError(f"{out} already holds files that are not a run of this repository ({shown}): "
                             f"use an empty or new --output_dir, or --overwrite_output_dir true to write "
                             f"into it (files with our names will be replaced)")


def _claim(out: Path, recipe: str, overwrite: bool, wait_s: float, deadline: float, announced: bool) -> str | None:
    """Main process: None if `out` is this run's now, `_WAIT` to poll again, else the error line."""
    try:
        check_recipe_folder(out, recipe, overwrite)
        out.mkdir(parents=True, exist_ok=True)
        holder = _take_lock(out)
        if holder is None:
            if not (out / RUN_MARKER).is_file() or overwrite:
                (out / RUN_MARKER).write_text(json.dumps({"recipe": recipe, "created": time.time()}) + "\n")
            return None
    except OutputDirError as e:
        return str(e)
    except OSError as e:  # e.g. a full disk: a write error names no file
        fix = ("free some space there and re-run" if e.errno in (errno.ENOSPC, errno.EDQUOT)
               else "fix that, or use another --output_dir")
        return f"cannot write into {out}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "") + f": {fix}"
    left_s = deadline - time.monotonic()
    if holder.get("state") != "stopping":
        return (f"{out} is in use by {_describe(holder)}: one run per --output_dir. Wait for it to end, or use "
                f"another --output_dir (a lock from another host expires {STALE_AFTER_S:.0f} s after its last "
                f"heartbeat)")
    if left_s <= 0:
        return (f"{out} is in use by {_describe(holder)}, which was stopping (saving its last checkpoint) but "
                f"has not ended in {wait_s:.0f} s: wait for it to end, or use another --output_dir")
    if not announced:
        logger.warning(f"{out}: the previous run is still saving (pid {holder.get('pid')} on {holder.get('host')}), "
                       f"waiting up to {left_s:.0f} s for it to end")
    time.sleep(POLL_S)
    return _WAIT


def claim_output_dir(accelerator, output_dir: str | Path, recipe: str, overwrite: bool = False,
                     wait_s: float = STOPPING_WAIT_S) -> None:
    """Make `output_dir` this run's, or stop every rank with a one-line reason. Collective.

    The main process checks the folder and takes the lock; the verdict is broadcast, so every rank
    stops alike (no collective inside the main-only part). While a `stopping` holder finishes
    (up to `wait_s` s), the main process polls and broadcasts every `POLL_S` s, so the other ranks
    never wait in one collective for longer than that (collectives time out after --ddp_timeout)."""
    out = Path(output_dir)
    deadline = time.monotonic() + wait_s
    polls = 0
    while True:
        verdict = None
        if accelerator.is_main_process:
            verdict = _claim(out, recipe, overwrite, wait_s, deadline, announced=polls > 0)
        if accelerator.num_processes > 1:
            message = [verdict]
            broadcast_object_list(message, from_process=0)
            verdict = message[0]
        if verdict != _WAIT:
            break
        polls += 1
    if verdict:
        raise SystemExit(f"error: {verdict}")
    if polls and accelerator.is_main_process:
        logger.info(f"{out}: the previous run ended; continuing")
