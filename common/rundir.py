"""The output folder belongs to one run at a time, and only to a run of this recipe.

- `<output_dir>/run.json` names the recipe that created the folder. A folder that holds files but no
  `run.json` (a user's own folder, another tool's output) is refused unless `--overwrite_output_dir`;
  a folder made by another recipe is refused likewise.
- `<output_dir>/.run.lock` (O_CREAT|O_EXCL) holds the running job's host, pid, process start time,
  and a heartbeat (its mtime, touched every 10 s). A second launch into the same folder — a
  double-submitted job, a requeue while the old job still runs, a second node started with the
  wrong `--machine_rank` — is refused at once, naming the holder. A lock left by a dead process on
  this host is taken over at once (a SIGKILLed run re-launches immediately); a lock from another
  host is taken over once its heartbeat is older than `STALE_AFTER_S`.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from pathlib import Path

import psutil
from accelerate.utils import broadcast_object_list

from common.prepare import Heartbeat

RUN_MARKER = "run.json"
LOCK = ".run.lock"
STALE_AFTER_S = 120.0  # a remote holder whose heartbeat is older than this is presumed dead
HEARTBEAT_S = 10.0


class OutputDirError(RuntimeError):
    """The output folder cannot be used by this run; the message says why and what to do."""


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def holder_is_alive(holder: dict, host: str) -> bool:
    """Same host: the process exists and started when the lock says. Other host: fresh heartbeat."""
    if holder.get("host") == host:
        started = _start_time(int(holder.get("pid", -1)))
        return started is not None and abs(started - holder.get("started", started)) < 1.0
    return time.time() - holder.get("heartbeat", 0.0) < STALE_AFTER_S


def _describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"{holder.get('host')}:{holder.get('pid')} (running since {since})"


def _take_lock(out: Path) -> Heartbeat:
    lock = out / LOCK
    host, pid = socket.gethostname(), os.getpid()
    me = {"host": host, "pid": pid, "started": _start_time(pid)}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text())
                holder["heartbeat"] = lock.stat().st_mtime
            except (OSError, ValueError):  # vanished, or half-written by a process killed mid-write
                holder = {}
            if holder and holder_is_alive(holder, host):
                raise OutputDirError(
                    f"{out} is in use by {_describe(holder)}: one run per --output_dir. Wait for it to "
                    f"end, or use another --output_dir (a lock from another host expires "
                    f"{STALE_AFTER_S:.0f} s after its last heartbeat)") from None
            if holder:  # dead: ours now (rename first, so two takers cannot both delete a live lock)
                aside = lock.with_name(f"{LOCK}.dead-{pid}")
                try:
                    os.rename(lock, aside)
                    os.unlink(aside)
                except FileNotFoundError:
                    pass
            else:
                try:
                    lock.unlink()
                except FileNotFoundError:
                    pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        token = lock.read_text()
        heartbeat = Heartbeat(lock, token, HEARTBEAT_S)

        def release():
            heartbeat.stop()
            if lock.is_file() and lock.read_text() == token:
                lock.unlink()

        atexit.register(release)
        return heartbeat
    raise OutputDirError(f"could not take {lock}: other processes keep replacing it")


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
    entries = [p.name for p in out.iterdir()] if out.is_dir() else []
    if (out / "checkpoints").is_dir() and (out / "config.yaml").is_file():
        return  # a run written before run.json existed
    if entries and not overwrite:
        shown = ", ".join(sorted(entries)[:4]) + (", ..." if len(entries) > 4 else "")
        raise OutputDirError(f"{out} already holds files that are not a run of this repository ({shown}): "
                             f"use an empty or new --output_dir, or --overwrite_output_dir true to write "
                             f"into it (files with our names will be replaced)")


def claim_output_dir(accelerator, output_dir: str | Path, recipe: str, overwrite: bool = False) -> None:
    """Make `output_dir` this run's, or stop every rank with a one-line reason. Collective.

    The main process checks the folder and takes the lock; the verdict is broadcast, so every rank
    stops alike (no collective inside the main-only part)."""
    out = Path(output_dir)
    error = None
    if accelerator.is_main_process:
        try:
            check_recipe_folder(out, recipe, overwrite)
            out.mkdir(parents=True, exist_ok=True)
            _take_lock(out)
            if not (out / RUN_MARKER).is_file() or overwrite:
                (out / RUN_MARKER).write_text(json.dumps({"recipe": recipe, "created": time.time()}) + "\n")
        except (OutputDirError, OSError) as e:
            error = str(e)
    if accelerator.num_processes > 1:
        verdict = [error]
        broadcast_object_list(verdict, from_process=0)
        error = verdict[0]
    if error:
        raise SystemExit(f"error: {error}")
