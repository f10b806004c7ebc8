"""The per-file part of the data check: audio facts read in a process pool and cached on disk.

`common.data.manifest.prepare_manifest` turns these facts into verdicts (too short, wrong rate, ...)
with its `DataPolicy`; this module only answers "what is in this file", which does not depend on
the policy, so one cached answer serves every policy.

Before any decoding, each file must be a regular file (a FIFO, a device, a socket or a folder named
like an audio file is refused: opening a FIFO blocks until someone writes to it), and its content
digest (`content_digest`: size, first and last 4 KiB) is taken; a checkpoint records the digests'
fingerprint, so a file replaced by different audio of the same length is seen on resume.

Two modes (`DataPolicy.data_check`, `--data_check` in the recipes):

- `"header"` (default): opens the file, reads its header (format, channels, sample rate, frame
  count, hence duration) and decodes its last `PROBE_FRAMES` frame(s): the decoder decodes the
  whole block that holds it (a FLAC block is ~4096 frames), which fails when the file was cut
  short. Reads a few kB per file.
  Finds: missing files; files that are not audio or whose header is broken; files cut short
  (a truncated FLAC keeps a valid header that promises the original length: seeking to its end
  fails); zero-frame files; multi-channel audio; the sample rate and the duration used for the
  too-short / too-long / wrong-rate verdicts.
- `"full"`: decodes every sample. Finds everything above, plus: silent files (all samples zero),
  non-finite samples (NaN/inf in float files), and decoding errors anywhere in the stream (a
  damaged frame in the middle of a FLAC whose end still decodes). The duration is the number of
  decoded frames (the same as the header's for every file that decodes).

Header mode misses exactly the last group: a silent or NaN file, or one damaged only in the
middle, is accepted and fails or trains on garbage later. Use `full` once on a corpus you do not
trust; it costs ~25× the CPU per file at LibriSpeech's mean 12.3 s, ~3× on 2 s files (measured
by benchmarks/data_check.py: the decode grows with the duration, the header check does not).

Pool: `check_files` splits the files to check into chunks run by `workers` processes (all the
cores this process may use by default); results are placed by index, so the facts, and the
manifest built from them, do not depend on the pool size or on the order chunks finish in.

Cache: one jsonl file per (manifest name, mode), one line `[path, size, mtime_ns, ctime_ns, facts]`
per file, appended after every chunk. A check killed half-way resumes with the files not yet in the
cache; a corpus with a few new or rewritten files re-checks only those (a rewritten file has
another ctime, so its old line no longer matches). Lines for files that are gone are
dropped when the cache is rewritten at the end of a check. A torn last line (killed mid-write) is
ignored. Only readable files are cached: an unreadable one is read again at every check (a
transient NFS error must not stick; bad files are few).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import multiprocessing
import os
import signal
import stat as stat_mod
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import soundfile as sf

from common.training.faults import RunError

logger = logging.getLogger(__name__)

MODES = ("header", "full")
PROBE_FRAMES = 1  # frames read at the end of each file in header mode (the block holding them is
# decoded: 1 frame finds the same truncations as 4096 did, at 0.8× the CPU per 2-s file, 0.7× at 12 s)
CHUNK_FILES = 256  # files per pool task: large enough that task overhead is small, small enough
# that a killed check loses little work (each finished chunk is appended to the cache)
STAT_THREADS = 32  # concurrent stat/readdir calls while listing: on NFS each is a round trip
DIGEST_BYTES = 4096  # bytes hashed at each end of a file for its content digest
CACHE_VERSION = 2  # bump when the facts computed for a file change meaning (old caches are ignored)


class DataCheckError(RunError):
    """A worker of the data check died; the message names the files it was checking."""


def default_workers() -> int:
    """Cores this process may run on (a job's CPU set, not the machine's core count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------
# One file
# ---------------------------------------------------------------------------------------------


def _unreadable(e: Exception | str) -> dict:
    return {"error": "unreadable audio", "detail": str(e)[:120]}


def _decode_all(path: str) -> dict:
    try:
        audio, sr = sf.read(path, dtype="float32", always_2d=True)  # (frames, channels)
    except Exception as e:  # noqa: BLE001 — libsndfile raises several types for bad files
        return _unreadable(e)
    bad = audio.size > 0 and (not np.isfinite(audio).all() or not audio.any())
    return {"frames": audio.shape[0], "sample_rate": sr, "channels": audio.shape[1], "silent": bool(bad)}


_KINDS = {stat_mod.S_IFIFO: "a FIFO", stat_mod.S_IFDIR: "a directory", stat_mod.S_IFSOCK: "a socket",
          stat_mod.S_IFCHR: "a character device", stat_mod.S_IFBLK: "a block device"}


def regular_file(path: str) -> os.stat_result | dict:
    """`os.stat(path)` of a regular file, or {error, detail} when it is missing, cannot be statted,
    or is something else (checked before any open: a FIFO blocks the opener until someone writes
    to it, a device is read without end)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {"error": "missing file"}
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        return _unreadable(e)
    if not stat_mod.S_ISREG(st.st_mode):
        return {"error": "not a regular file", "detail": _KINDS.get(stat_mod.S_IFMT(st.st_mode), "not a file")}
    return st


def content_digest(path: str) -> str | dict:
    """16 hex digits of blake2b over the size, the first and the last `DIGEST_BYTES` of a regular
    file, or {error, detail} when it is missing, cannot be opened, or is not a regular file (a
    FIFO would block the check forever, a device would be read without end).

    What it covers: a FLAC's first bytes hold its STREAMINFO block with the MD5 of the decoded
    audio (written by libFLAC, hence libsndfile and ffmpeg), so different audio gives a different
    digest; for other formats the header and the last samples (a WAV edited only in its middle, at
    the same size, keeps its digest). The bytes are those the header check reads anyway (header +
    last block): one more open and two reads from the page cache, ~50 µs per file (measured:
    ~25% of a header check's CPU, nothing on a cached re-check)."""
    st = regular_file(path)
    if isinstance(st, dict):
        return st
    h = hashlib.blake2b(str(st.st_size).encode(), digest_size=8)
    try:
        with open(path, "rb") as f:
            h.update(f.read(DIGEST_BYTES))
            if st.st_size > DIGEST_BYTES:
                f.seek(max(DIGEST_BYTES, st.st_size - DIGEST_BYTES))
                h.update(f.read(DIGEST_BYTES))
    except OSError as e:
        return _unreadable(e)
    return h.hexdigest()


def audio_facts(path: str, mode: str) -> dict:
    """What the file holds: {frames, sample_rate, channels, digest (`content_digest`)} (+ {silent}
    in full mode: all samples zero or some non-finite), or {error, detail} when it is missing, not
    a regular file, or cannot be read."""
    digest = content_digest(path)
    if isinstance(digest, dict):
        return digest
    facts = decoded_facts(path, mode)
    return facts if "error" in facts else {**facts, "digest": digest}


def decoded_facts(source, mode: str) -> dict:
    """`audio_facts` without the digest, of a path or a file-like object (a parquet row's audio
    bytes: `common.data.stream_check.check_shards`)."""
    return _decode_all(source) if mode == "full" else _header_facts(source)


def _header_facts(path: str) -> dict:
    try:
        f = sf.SoundFile(path)
    except Exception as e:  # noqa: BLE001 — libsndfile raises several types for bad files
        return _unreadable(e)
    with f:
        frames, sr, channels = f.frames, f.samplerate, f.channels
        if frames > 0:
            # A truncated file keeps its header: decoding its end is what fails.
            block = min(frames, PROBE_FRAMES)
            try:
                f.seek(frames - block)
                got = f.read(block, dtype="float32", always_2d=True).shape[0]
            except Exception as e:  # noqa: BLE001
                return _unreadable(f"truncated? its last {block} frames do not decode: {e}")
            if got != block:
                return _unreadable(f"truncated: {got} of its last {block} frames decode")
    if frames == 0:
        # Zero frames in the header may also mean "length unknown" (a streamed FLAC): decode to be sure.
        return _decode_all(path)
    return {"frames": frames, "sample_rate": sr, "channels": channels}


def _facts_chunk(paths: list[str], mode: str) -> list[dict]:
    return [audio_facts(p, mode) for p in paths]


# ---------------------------------------------------------------------------------------------
# Listing a corpus: every file's (size, mtime_ns, ctime_ns), statted once per launch
# ---------------------------------------------------------------------------------------------

Stamp = tuple[int, int, int]  # (size in bytes, mtime in ns, ctime in ns)


def _stamp(st: os.stat_result) -> Stamp:
    # ctime too: a file replaced by another of the same size with its mtime copied over (cp -p,
    # rsync -t, touch -r) keeps size and mtime, but the kernel sets ctime on every change and no
    # call sets it back. The price: a chmod/chown of the corpus makes the next launch re-read it.
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _scan_dir(folder: str) -> tuple[dict[str, Stamp], list[tuple[str, tuple[int, int]]]]:
    files, dirs = {}, []
    with os.scandir(folder) as it:
        for entry in it:
            if entry.is_dir():  # follows symlinks, like the scans of the layouts
                st = entry.stat()
                dirs.append((entry.path, (st.st_dev, st.st_ino)))
            elif entry.is_file():
                st = entry.stat()
                files[entry.path] = _stamp(st)
    return files, dirs


def list_files(paths: list[Path]) -> dict[str, Stamp]:
    """{path: (size in bytes, mtime in ns, ctime in ns)} of every regular file under `paths`
    (folders, walked recursively, or single files; absent ones are left out), sorted by path.

    Folders are read by `STAT_THREADS` threads: on NFS every readdir and stat is a network round
    trip, and overlapping them is what makes 281 k stats take seconds rather than minutes."""
    files: dict[str, Stamp] = {}
    seen_dirs: set[tuple[int, int]] = set()  # (device, inode): a symlink loop is walked once
    todo = []
    for p in paths:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        if stat_mod.S_ISDIR(st.st_mode):
            seen_dirs.add((st.st_dev, st.st_ino))
            todo.append(str(p))
        elif stat_mod.S_ISREG(st.st_mode):
            files[str(p)] = _stamp(st)
    with ThreadPoolExecutor(STAT_THREADS) as pool:
        running = {pool.submit(_scan_dir, d) for d in todo}
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                found, subdirs = fut.result()
                files.update(found)
                for d, ident in subdirs:
                    if ident not in seen_dirs:
                        seen_dirs.add(ident)
                        running.add(pool.submit(_scan_dir, d))
    return dict(sorted(files.items()))


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------

Key = tuple[str, int, int, int]  # (path, *Stamp)


def read_cache(path: Path) -> dict[Key, dict]:
    """Complete, well-formed lines of a facts cache; torn or foreign lines are ignored."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    entries = {}
    for line in data.split(b"\n")[:-1]:  # the part after the last newline is a torn write
        try:
            p, size, mtime, ctime, facts = json.loads(line)
        except (ValueError, TypeError):
            continue
        if isinstance(p, str) and all(isinstance(n, int) for n in (size, mtime, ctime)) and isinstance(facts, dict):
            entries[(p, size, mtime, ctime)] = facts
    return entries


def _cache_lines(items) -> bytes:
    return "".join(json.dumps([*k, facts]) + "\n" for k, facts in items).encode()


class Appender:
    """Appends chunks of cache lines, one write() each, after mending a torn last line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self.fd).st_size
        self.pending_newline = False
        if size > 0:
            with open(path, "rb") as f:
                f.seek(size - 1)
                self.pending_newline = f.read(1) != b"\n"

    def append(self, items) -> None:
        data = _cache_lines(items)
        if self.pending_newline:
            data, self.pending_newline = b"\n" + data, False
        os.write(self.fd, data)

    def close(self) -> None:
        os.close(self.fd)


def _rewrite_cache(path: Path, items) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(_cache_lines(items))
    os.replace(tmp, path)  # atomic: a reader sees the old or the new cache, never a mix


# ---------------------------------------------------------------------------------------------
# Many files
# ---------------------------------------------------------------------------------------------


def check_files(paths: list[str], mode: str, *, stats: dict[str, Stamp] | None = None,
                cache: Path | None = None, workers: int | None = None) -> tuple[list[dict], int, int]:
    """(facts for each path, in order; number of files read; number answered by `cache`).

    `stats` ({path: Stamp} from `list_files`) saves a second stat per file; a path not
    in it is statted here. `workers` processes read the files (None: `default_workers()`; 1: this
    process). The facts do not depend on `workers`."""
    if mode not in MODES:
        raise ValueError(f"data_check must be one of {', '.join(MODES)}, not {mode!r}")
    stats = dict(stats or {})
    keys: list[Key | None] = []
    for p in paths:
        if p not in stats:
            try:
                st = os.stat(p)
            except OSError:
                keys.append(None)  # missing: decided below, never cached
                continue
            stats[p] = _stamp(st)
        keys.append((p, *stats[p]))
    cached = read_cache(cache) if cache else {}
    results: list[dict | None] = [None] * len(paths)
    todo = []
    for i, k in enumerate(keys):
        if k is None:
            results[i] = {"error": "missing file"}
        elif k in cached:
            results[i] = cached[k]
        else:
            todo.append(i)
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"data-check workers must be ≥ 1, not {workers}")
    appender = Appender(cache) if cache and todo else None
    try:
        for idx, facts in _run(todo, [paths[i] for i in todo], mode, workers):
            for i, f in zip(idx, facts):
                results[i] = f
            if appender:
                # Errors are not cached: a transient one (an NFS timeout) must not condemn a file
                # until it is touched, and bad files are few, so re-reading them costs nothing.
                appender.append((keys[i], f) for i, f in zip(idx, facts) if "error" not in f)
    finally:
        if appender:
            appender.close()
    if cache:
        # Lines of files that are gone or were rewritten are dropped here, so the cache stays the
        # size of the corpus; a check that only added files keeps the appended file as it is.
        current = {k: results[i] for i, k in enumerate(keys) if k is not None and "error" not in results[i]}
        if any(k not in current for k in cached):
            _rewrite_cache(cache, sorted(current.items()))
    return results, len(todo), sum(k in cached for k in keys if k is not None)  # type: ignore[return-value]


def _run(todo: list[int], paths: list[str], mode: str, workers: int):
    """Yields (indices, facts) per chunk as chunks finish (serially when workers == 1)."""
    if not todo:
        return
    size = max(1, min(CHUNK_FILES, math.ceil(len(todo) / (workers * 4))))  # ≥ 4 chunks per worker
    chunks = [(todo[i:i + size], paths[i:i + size]) for i in range(0, len(todo), size)]
    progress = _Progress(len(todo), workers, mode)
    if workers == 1:
        for idx, chunk in chunks:
            yield idx, _facts_chunk(chunk, mode)
            progress.add(len(idx))
        return
    # fork: the children only run libsndfile and numpy on paths they are given (no CUDA, no torch),
    # and start in milliseconds; spawn/forkserver would re-import the recipe's train.py in each.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(min(workers, len(chunks)), mp_context=multiprocessing.get_context(method),
                               initializer=worker_init)
    with pool:
        running = {pool.submit(_facts_chunk, chunk, mode): (idx, chunk) for idx, chunk in chunks}
        try:
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    idx, chunk = running.pop(fut)
                    try:
                        facts = fut.result()
                    except BrokenProcessPool:
                        raise DataCheckError(
                            f"a data-check worker died while reading one of {chunk[0]} … {chunk[-1]} "
                            f"({len(chunk)} files; out of memory, or a crash in libsndfile on one of them): "
                            f"remove or re-encode the offending file, or run with fewer workers; the files "
                            f"already checked are cached and will not be read again"
                        ) from None
                    yield idx, facts
                    progress.add(len(idx))
        finally:
            for fut in running:
                fut.cancel()


def worker_init() -> None:
    # The recipe's signal handlers (common.training.faults.Preemption) are for the parent: a worker hit by
    # Ctrl-C or SIGTERM just ends, and the parent reports the signal once.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    try:  # Linux: die with the parent (a SIGKILLed launch must not leave workers behind)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Progress:
    """An info line every 30 s during a long check (281 k files take minutes)."""

    def __init__(self, total: int, workers: int, mode: str):
        self.total, self.done, self.workers, self.mode = total, 0, workers, mode
        self.start = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= 30.0 and self.done < self.total:
            self.last = now
            rate = self.done / (now - self.start)
            logger.info(f"data check ({self.mode}, {self.workers} processes): {self.done}/{self.total} files, "
                        f"{rate:.0f} files/s, ~{(self.total - self.done) / rate / 60:.1f} min left")
