"""Build a directory once across processes and machines: a file lock plus a completion marker.

Data preparation (a generated corpus, manifests, a tokenizer) must happen once, while every other
rank, and every node sharing the folder, waits, also when they start seconds apart or the folder
sits on a slow NFS. A collective barrier cannot give that (it has a timeout, and node-local and
shared caches need different ranks to work), so `prepare_once` uses the file system itself:
`O_CREAT|O_EXCL` lock, build in a temporary sibling, `.complete` written last, atomic rename.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


COMPLETE_MARKER = ".complete"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():  # some file systems (FUSE, ...) cannot fsync folders: best effort
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> int:
    """fsync every file and folder under root (so a crash after rename cannot expose torn files);
    returns the number of files."""
    n_files = 0
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(folder) / name)
            n_files += 1
        _fsync_path(Path(folder))
    return n_files


class Heartbeat:
    """Touches a lock file every `interval_s` while we hold it, so others can tell us from a crash."""

    def __init__(self, lock: Path, token: str, interval_s: float):
        self._lock, self._token, self._interval_s = lock, token, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{lock.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                if _read_text(self._lock) != self._token:
                    return  # our lock was broken as stale: never refresh somebody else's
                os.utime(self._lock)  # times=None: on NFS the server's clock sets the mtime
            except OSError:
                pass  # transient (NFS): try again next beat

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _StaleWatch:
    """Decides staleness from what *this* process observes: the lock is stale once its content and
    mtime have not changed for `stale_after_s` seconds of our monotonic clock. Comparing the mtime
    with our wall clock would break with clock skew between NFS clients (and attribute caching)."""

    def __init__(self, stale_after_s: float):
        self.stale_after_s = stale_after_s
        self._key: tuple[str, int] | None = None
        self._since = 0.0

    def stale_token(self, lock: Path) -> str | None:
        try:
            key = (lock.read_text(), os.stat(lock).st_mtime_ns)
        except FileNotFoundError:
            self._key = None
            return None
        now = time.monotonic()
        if key != self._key:
            self._key, self._since = key, now
            return None
        return key[0] if now - self._since >= self.stale_after_s else None


def _break_stale_lock(lock: Path, token: str) -> None:
    # Rename first (atomic) and verify: another waiter may have broken it and taken a fresh lock
    # between our check and now; plain unlink would then delete a live lock.
    aside = lock.with_name(f"{lock.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return
    if _read_text(aside) != token:
        try:
            os.link(aside, lock)  # put the live lock back, unless a newer one exists already
        except OSError:
            pass
    os.unlink(aside)


def _replace_incomplete(final_dir: Path) -> bool:
    """Move an incomplete `final_dir` (crashed old-style writer) out of the way; False if it turned
    out to be complete (a stale negative lookup cache on NFS), in which case it is left in place."""
    aside = final_dir.with_name(f"{final_dir.name}.incomplete-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(final_dir, aside)
    except FileNotFoundError:
        return True
    if (aside / COMPLETE_MARKER).is_file():  # fresh path: no cached lookup
        os.rename(aside, final_dir)
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def prepare_once(
    final_dir: str | Path,
    build: Callable[[Path], None],
    timeout_s: float = 3600.0,
    poll_s: float = 1.0,
    stale_after_s: float = 120.0,
    info: dict | None = None,
) -> Path:
    """Run `build(tmp_dir)` once across the processes and machines sharing `final_dir`'s file
    system, and return `final_dir` once it is complete.

    `final_dir` is complete iff it contains `.complete` (JSON: `info`, file count, builder), which
    is written last inside a temporary sibling that is then renamed into place: readers can never
    see a partial directory. Exactly one process holds `<final_dir>.lock` (O_CREAT|O_EXCL) and
    builds; the others poll every `poll_s` seconds. The builder touches the lock every
    min(10, stale_after_s/4) s; a lock unchanged for `stale_after_s` s is taken over. If `build`
    raises, its temporary folder and the lock are removed and the exception propagates.
    Raises TimeoutError after `timeout_s` s of waiting (monotonic clock).

    A builder that stalls for longer than `stale_after_s` (but is alive) may be joined by a
    second one; both publish with an atomic rename, the first wins and the other's copy is
    dropped, so readers still only ever see one complete directory.
    """
    final_dir = Path(final_dir)
    marker = final_dir / COMPLETE_MARKER
    if marker.is_file():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = final_dir.with_name(final_dir.name + ".lock")
    host, pid = socket.gethostname(), os.getpid()
    watch = _StaleWatch(stale_after_s)
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        if marker.is_file():
            return final_dir
        token = f"{host} {pid} {time.time():.3f} {uuid.uuid4().hex}\n"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_text(lock) or ""
            fields = holder.split()
            if len(fields) >= 2 and fields[0] == host and fields[1].isdigit() and not _pid_alive(int(fields[1])):
                logger.info(f"{lock}: its holder {fields[0]}:{fields[1]} is dead; taking it over")
                _break_stale_lock(lock, holder)  # a dead process on this host: no need to wait
                continue
            stale = watch.stale_token(lock)  # another host's holder: judged by its heartbeat
            if stale is not None:
                _break_stale_lock(lock, stale)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {timeout_s:.0f} s for {final_dir} to be prepared by the holder of lock file "
                    f"{lock} ({(_read_text(lock) or '').strip()!r}). If no process is preparing it, "
                    f"delete the lock file."
                ) from None
            if not announced:
                who = ":".join((_read_text(lock) or "? ?").split()[:2])
                logger.info(f"waiting for {final_dir}: {who} is preparing it")
                announced = True
            time.sleep(poll_s)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(token)
        heartbeat = Heartbeat(lock, token, interval_s=max(0.05, min(10.0, stale_after_s / 4)))
        try:
            if marker.is_file():  # completed between our check and taking the lock
                return final_dir
            logger.info(f"preparing {final_dir} (this process, {host}:{pid}; others wait for it)")
            return _build_and_publish(final_dir, build, host, pid, info)
        finally:
            heartbeat.stop()
            if _read_text(lock) == token:  # only release our own lock, never a successor's
                try:
                    os.unlink(lock)
                except FileNotFoundError:
                    pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_builders_tmp(final_dir: Path, host: str) -> None:
    """Temporary folders left by killed builders on this host (pid gone) are garbage. Other
    hosts' leftovers are kept: we cannot tell whether their builder is alive."""
    prefix = f"{final_dir.name}.tmp-{host}-"
    for path in final_dir.parent.glob(glob.escape(prefix) + "*"):
        pid = path.name[len(prefix) :].rsplit("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _build_and_publish(
    final_dir: Path, build: Callable[[Path], None], host: str, pid: int, info: dict | None
) -> Path:
    _remove_dead_builders_tmp(final_dir, host)
    # Random suffix: two containers can share a hostname and a pid.
    tmp = final_dir.with_name(f"{final_dir.name}.tmp-{host}-{pid}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        build(tmp)
        n_files = fsync_tree(tmp)
        meta = {**(info or {}), "files": n_files, "built_by": f"{host}:{pid}", "built_at": time.time()}
        with open(tmp / COMPLETE_MARKER, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        if final_dir.exists() and not (final_dir / COMPLETE_MARKER).is_file():
            if not _replace_incomplete(final_dir):
                shutil.rmtree(tmp, ignore_errors=True)
                return final_dir
        try:
            os.rename(tmp, final_dir)  # atomic on POSIX (also NFS): readers see nothing or everything
        except OSError:
            # Someone published first (we were wrongly declared stale): theirs is as good as ours.
            if (final_dir / COMPLETE_MARKER).is_file():
                shutil.rmtree(tmp, ignore_errors=True)
                return final_dir
            raise
        _fsync_path(final_dir.parent)  # make the rename itself durable
        return final_dir
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
