"""Build a directory once across processes and machines: a file lock plus a completion marker.

Data preparation (a generated corpus, manifests, a tokenizer) must happen once, while every other
rank, and every node sharing the folder, waits, also when they start seconds apart or the folder
sits on a slow NFS. A collective barrier cannot give that (it has a timeout, and node-local and
shared caches need different ranks to work), so `prepare_once` uses the file system itself:
an exclusive lock file (`create_lock`), build in a temporary sibling, `.complete` written last,
atomic rename.

Why not the `filelock` package: its locks are `flock`/`fcntl` locks, which hold between processes
of one host but are not dependable between NFS clients, and it cannot tell a lock whose holder died
on another node from a live one. A lock *file* created in one step with `link()` (atomic on NFS
too) that names its holder (host, pid, start time) and carries a heartbeat gives both.

The file-system primitives that the run folder's lock (`common/training/rundir.py`) and the checkpoints
(`common/training/checkpoint.py`, `sealing.py`) share live here too: `fsync_path`, `process_alive`, `create_lock`,
`break_lock`, `Heartbeat`.
"""

from __future__ import annotations

import errno
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

import psutil

logger = logging.getLogger(__name__)


COMPLETE_MARKER = ".complete"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (its entries: a rename into it then survives a crash). Some file
    systems (FUSE, ...) cannot fsync folders: there a folder's fsync is skipped, a file's never."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> int:
    """fsync every file and folder under root (so a crash after rename cannot expose torn files);
    returns the number of files."""
    n_files = 0
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(folder) / name)
            n_files += 1
        fsync_path(Path(folder))
    return n_files


def process_start_time(pid: int) -> float | None:
    """When process `pid` of this host started (seconds since the epoch), None if it does not exist."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:  # a zombie too: it has ended
        return None


def process_alive(pid: int, started: float | None = None) -> bool:
    """Whether process `pid` of this host is running; given `started` (its `process_start_time` when
    it took a lock), whether it is still that process and not a later one that reused the pid.
    The one test of "is a lock holder on this host alive" (run lock, preparation lock)."""
    try:
        now = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # exists, owned by someone else
    return started is None or abs(now - started) < 1.0


def create_lock(lock: Path, content: str) -> bool:
    """Create `lock` holding `content` unless it exists (then False). Atomic: the content goes into
    a private temp file that is then hard-linked to the lock's name (a link fails if the name
    exists, also on NFS), so nobody can read a lock that is still empty. On file systems without
    hard links (some FUSE and SMB mounts): O_CREAT|O_EXCL, then the write."""
    tmp = lock.with_name(f"{lock.name}.new-{uuid.uuid4().hex}")
    try:
        with open(tmp, "x") as f:
            f.write(content)
        try:
            os.link(tmp, lock)
            return True
        except FileExistsError:
            return os.stat(tmp).st_nlink == 2  # NFS: a retried link can report EEXIST for its own success
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                raise
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            f.write(content)
    except BaseException:
        os.unlink(lock)
        raise
    return True


def break_lock(lock: Path, content: str) -> None:
    """Remove `lock` if it still holds `content` (a holder judged dead or stale). Rename first
    (atomic) and verify: another process may have broken it and taken a fresh lock between our
    judgement and now, and a plain unlink would then delete a live lock (it is put back)."""
    aside = lock.with_name(f"{lock.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return
    if _read_text(aside) != content:
        try:
            os.link(aside, lock)  # put the live lock back, unless a newer one exists already
        except OSError:
            pass
    os.unlink(aside)


class Heartbeat:
    """Touches a lock file every `interval_s` while we hold it, so others can tell us from a crash."""

    def __init__(self, lock: Path, token: str, interval_s: float):
        self._lock, self._token, self._interval_s = lock, token, interval_s
        self._mutex = threading.Lock()  # a beat and a `rewrite` never interleave
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{lock.name}", daemon=True)
        self._thread.start()

    @property
    def token(self) -> str:
        """The lock's content while it is ours."""
        return self._token

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            with self._mutex:
                try:
                    if _read_text(self._lock) != self._token:
                        return  # our lock was broken as stale: never refresh somebody else's
                    os.utime(self._lock)  # times=None: on NFS the server's clock sets the mtime
                except OSError:
                    pass  # transient (NFS): try again next beat

    def rewrite(self, content: str) -> None:
        """Replace the lock's content (a complete temp file renamed over it: readers see the old or
        the new content, never a mix) and beat for the new content from now on. Nothing happens
        if the lock is no longer ours."""
        with self._mutex:
            if _read_text(self._lock) != self._token:
                return
            tmp = self._lock.with_name(f"{self._lock.name}.new-{uuid.uuid4().hex}")
            tmp.write_text(content)
            os.replace(tmp, self._lock)
            self._token = content

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
    resumable: bool = False,
) -> Path:
    """Run `build(tmp_dir)` once across the processes and machines sharing `final_dir`'s file
    system, and return `final_dir` once it is complete.

    `final_dir` is complete iff it contains `.complete` (JSON: `info`, file count, builder), which
    is written last inside a temporary sibling that is then renamed into place: readers can never
    see a partial directory. Exactly one process holds `<final_dir>.lock` (`create_lock`) and
    builds; the others poll every `poll_s` seconds. The builder touches the lock every
    min(10, stale_after_s/4) s; a lock unchanged for `stale_after_s` s is taken over, and one whose
    holder is a dead process of this host at once. If `build`
    raises, its temporary folder and the lock are removed and the exception propagates.
    Raises TimeoutError after `timeout_s` s of waiting (monotonic clock).

    A builder that stalls for longer than `stale_after_s` (but is alive) may be joined by a
    second one; both publish with an atomic rename, the first wins and the other's copy is
    dropped, so readers still only ever see one complete directory.

    `resumable`: `build` can finish a folder an interrupted build left (it keeps what it can verify
    there and writes the rest). The folder of a build that raised, or whose process died on this
    host, is then kept as `<final_dir>.partial` and handed to the next builder instead of an empty
    one (`_build_and_publish`). It is never published without its `.complete`, as any build.
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
        # host, pid, the process's start time (a reused pid is not the holder), a nonce
        token = f"{host} {pid} started={process_start_time(pid)} {uuid.uuid4().hex}\n"
        if create_lock(lock, token):
            heartbeat_s = max(0.05, min(10.0, stale_after_s / 4))
            return _build_holding_lock(final_dir, build, (lock, token, heartbeat_s), host, pid, info, resumable)
        if _broke_lock_of_gone_holder(lock, host, watch):
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


def _broke_lock_of_gone_holder(lock: Path, host: str, watch: _StaleWatch) -> bool:
    """Break `lock` and return True when its holder is gone: a dead process of this host (at once),
    or any holder whose heartbeat stopped for `watch.stale_after_s` seconds; False: wait for it."""
    holder = _read_text(lock) or ""
    fields = holder.split()
    if len(fields) >= 2 and fields[0] == host and fields[1].isdigit() and not process_alive(
            int(fields[1]), _started(fields)):
        logger.info(f"{lock}: its holder {fields[0]}:{fields[1]} is dead; taking it over")
        break_lock(lock, holder)  # a dead process on this host: no need to wait
        return True
    stale = watch.stale_token(lock)  # another host's holder: judged by its heartbeat
    if stale is not None:
        break_lock(lock, stale)
        return True
    return False


def _build_holding_lock(final_dir: Path, build: Callable[[Path], None], held: tuple[Path, str, float], host: str,
                        pid: int, info: dict | None, resumable: bool) -> Path:
    """`prepare_once`'s build, by the holder of the lock: `held` = (the lock, its content, seconds
    between heartbeats); the lock is touched meanwhile and removed afterwards, unless a successor
    took it over."""
    lock, token, heartbeat_s = held
    heartbeat = Heartbeat(lock, token, interval_s=heartbeat_s)
    try:
        if (final_dir / COMPLETE_MARKER).is_file():  # completed between our check and taking the lock
            return final_dir
        logger.info(f"preparing {final_dir} (this process, {host}:{pid}; others wait for it)")
        return _build_and_publish(final_dir, build, host, pid, info, resumable)
    finally:
        heartbeat.stop()
        if _read_text(lock) == token:  # only release our own lock, never a successor's
            try:
                os.unlink(lock)
            except FileNotFoundError:
                pass


def _started(fields: list[str]) -> float | None:
    """The holder's start time from a lock's fields (None: not recorded)."""
    for f in fields[2:3]:
        if f.startswith("started="):
            try:
                return float(f[len("started="):])
            except ValueError:
                return None
    return None


def _remove_dead_builders_tmp(final_dir: Path, host: str, keep: Path | None = None) -> None:
    """Temporary folders left by killed builders on this host (pid gone) are garbage; with `keep`
    (a resumable build's `.partial` name), one of them becomes `keep` when it does not exist yet.
    Other hosts' leftovers are kept: we cannot tell whether their builder is alive."""
    prefix = f"{final_dir.name}.tmp-{host}-"
    for path in sorted(final_dir.parent.glob(glob.escape(prefix) + "*")):
        pid = path.name[len(prefix) :].rsplit("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            if keep is not None and not keep.exists():
                os.rename(path, keep)
            else:
                shutil.rmtree(path, ignore_errors=True)


def _build_and_publish(
    final_dir: Path, build: Callable[[Path], None], host: str, pid: int, info: dict | None, resumable: bool = False
) -> Path:
    partial = final_dir.with_name(f"{final_dir.name}.partial") if resumable else None  # we hold the lock: no writer
    _remove_dead_builders_tmp(final_dir, host, keep=partial)
    # Random suffix: two containers can share a hostname and a pid.
    tmp = final_dir.with_name(f"{final_dir.name}.tmp-{host}-{pid}-{uuid.uuid4().hex[:8]}")
    try:
        if partial is not None and partial.is_dir():
            os.rename(partial, tmp)  # an interrupted build's files: `build` finishes them
        else:
            tmp.mkdir()
        build(tmp)
        n_files = fsync_tree(tmp)
        meta = {**(info or {}), "files": n_files, "built_by": f"{host}:{pid}", "built_at": time.time()}
        with open(tmp / COMPLETE_MARKER, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
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
        fsync_path(final_dir.parent)  # make the rename itself durable
        return final_dir
    except BaseException:
        if partial is not None and tmp.is_dir() and not partial.exists() and not (tmp / COMPLETE_MARKER).exists():
            os.rename(tmp, partial)  # kept for the next builder (a Ctrl-C, a failed utterance, ...)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
