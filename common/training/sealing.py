"""Sealed folders: a `COMPLETE` marker written last, holding every file's size and SHA-256 digest, and
everything that reads or checks one.

- Writing a seal: `seal_files` (fsync and digest every file), `seal_export` (the marker of a `final/`
  or of any folder a tool makes to be read later); `common.training.checkpoint` seals its checkpoints
  the same way.
- Checking one: `read_marker` (a malformed marker is a damaged folder), `verify_checkpoint` (every
  listed file present with its size and digest), `seal_problem` (that, plus no unlisted file and
  nothing but regular files and folders: `odd_entry`), `regular_file_problem`.
- Finding one: `resolve_checkpoint`, the way every tool turns its `--checkpoint` argument into a
  verified folder (a run's `final/`, a `final/`, a `checkpoints/step_*/`), and `run_dir_of` beside
  it; `list_checkpoints` / `find_latest_checkpoint`: a run's complete (sealed) step folders.

No torch here: a tool checks a folder before it imports anything heavy. Importing a sealed folder's
own code is `common.training.sealed_import`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.training.faults import UsageError
from common.training.prepare import fsync_path

CHECKPOINT_RE = re.compile(r"^step_(\d{8})$")  # a checkpoint folder: step_00001200
MARKER = "COMPLETE"  # the seal: written last, with every file's size and digest


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:08d}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if CHECKPOINT_RE.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def find_latest_checkpoint(output_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def resolve_checkpoint(path: str | Path, flag: str = "--checkpoint") -> Path:
    """The sealed folder for a tool's `flag` argument: a training output_dir (its `final/`), a
    `final/`, or a `checkpoints/step_XXXXXXXX/`. Every tool that reads a trained model goes through
    here, before it reads any of the folder's files: a folder is used only when its `COMPLETE`
    marker lists every file in it with the size and digest the file has now (`seal_problem`).
    Anything else is a `UsageError` (one line, exit code 2) naming the folder, what is wrong and
    how to get a good one."""
    path = Path(path)
    unfinished = unfinished_export(path)
    if unfinished:
        raise UsageError(f"{flag} {path}: {unfinished}")
    for folder in (path / "final", path):
        if any((folder / name).exists() for name in (MARKER, "model.safetensors", "encoder")):
            problem = seal_problem(folder)
            if problem:
                raise UsageError(f"{flag} {folder}: {problem}")
            return folder
    if (path / "checkpoints").is_dir():
        raise UsageError(f"{flag} {path}: this run has no final/ yet (training did not finish): give one of its "
                         f"checkpoints/step_*/ folders, or re-run its training command to finish and export")
    raise UsageError(f"{flag} {path}: no trained model in it or in its final/ (expected model.safetensors and a "
                     f"{MARKER} marker): give a training output_dir, its final/, or a checkpoints/step_*/ folder")


def run_dir_of(folder: Path) -> Path:
    """The training output_dir a `resolve_checkpoint` folder belongs to: where tools write beside it
    (never inside: final/ and checkpoints/step_X/ are sealed) and where the run's data lists are."""
    return folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent


# What a folder that fails its seal needs: the run that wrote it can write it again.
RE_EXPORT = ("re-run the training command that made it (same --output_dir: a finished run exports final/ "
             "again from its last checkpoint), or copy the whole folder again from where it was made")


def seal_problem(folder: str | Path, remedy: str = RE_EXPORT) -> str | None:
    """None when `folder` is as training wrote it: a `COMPLETE` marker, every file it lists present
    with its size and digest, and no file that it does not list (bar `__pycache__/`, which Python
    writes beside imported code; `import_export` never reads it). Else what is wrong and what to do:
    `remedy`, how to get a good copy (the writer of a folder knows it: a cache, lm.py's folder).

    Only regular files and real folders are accepted (`odd_entry`): a folder that holds a symlinked
    folder, a FIFO, a socket or a device is refused before any file is opened (reading a FIFO blocks
    for ever). A symlink to a regular file is followed (a Hugging Face hub snapshot is made of them)
    and its target must match the marker like any file.

    This proves integrity, not authorship: nothing was cut short or changed since the folder was
    sealed. Anyone can seal a folder of their own making; load only folders you trust."""
    folder = Path(folder)
    if not (folder / MARKER).is_file():
        return (f"no {MARKER} marker, so nothing says its files are whole and unchanged (an export that did not "
                f"finish, a partial copy, or files put there by hand); it is not loaded: {remedy}")
    odd = odd_entry(folder)
    if odd:
        return f"{odd}: a sealed folder holds only regular files and folders; remove it, or {remedy}"
    problem = verify_checkpoint(folder)
    if problem:
        step_folder = ", or use a checkpoints/step_*/ folder" if remedy == RE_EXPORT else ""
        return f"damaged ({problem}): {remedy}{step_folder}"
    listed = set(read_marker(folder)["files"]) | {MARKER}
    extra = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if p.is_file() and "__pycache__" not in p.relative_to(folder).parts
                   and str(p.relative_to(folder)) not in listed)
    if extra:
        return (f"{extra[0]} is not covered by its {MARKER} marker (added after the folder was sealed"
                + (f", with {len(extra) - 1} more" if len(extra) > 1 else "") + f"): remove it, or {remedy}")
    return None


def odd_entry(folder: Path) -> str | None:
    """The first entry under `folder` that is neither a regular file (or a symlink to one) nor a real
    folder, said as "<relative path> is a <kind>"; None when there is none. Only `os.stat`/`lstat`:
    nothing is opened (opening a FIFO blocks until someone writes to it)."""
    for root, dirs, files in os.walk(folder):  # followlinks=False: a symlinked folder is listed, not entered
        for name in sorted(dirs + files):
            path = Path(root) / name
            relative = path.relative_to(folder)
            if name in dirs and path.is_symlink():
                return f"{relative} is a symlink to a folder (nothing checks what it holds)"
            try:
                mode = os.stat(path).st_mode  # follows a symlink to its target
            except OSError:
                return f"{relative} is a broken symlink"
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return f"{relative} is {_kind(mode)}, not a regular file"
    return None


def _kind(mode: int) -> str:
    """What a non-regular file is, in words, from its `st_mode`."""
    for test, kind in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "no regular file"


def regular_file_problem(path: str | Path) -> str | None:
    """None when `path` is a regular file (or a symlink to one); else what it is, in words, found with
    `os.stat` alone: a tool about to open a file the user named (an LM's .arpa) says so in one line
    instead of blocking for ever on a FIFO or reading a device."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    return None if stat.S_ISREG(mode) else f"is {_kind(mode)}, not a regular file"


def unfinished_export(folder: str | Path) -> str | None:
    """What to do when `folder` is (or holds only) an export killed before it finished: it is
    written into `.final.tmp/` and renamed to `final/` with its `COMPLETE` marker inside, so a kill
    leaves `.final.tmp/` and no `final/`. None otherwise (`seal_problem` judges a folder itself)."""
    folder = Path(folder)
    if folder.name == ".final.tmp" or (not (folder / "final").exists() and (folder / ".final.tmp").is_dir()):
        return ("the export of this run did not finish (a kill during it left .final.tmp/, no final/): re-run the "
                "training command (same --output_dir) to finish the export")
    return None


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """SHA-256 (hardware-accelerated on current CPUs: ~12× faster than the blake2b that markers
    written before it hold, which are still verified with their own algorithm)."""
    with open(path, "rb") as f:
        if algorithm == "blake2b":
            return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()
        return hashlib.file_digest(f, algorithm).hexdigest()


def seal_files(folder: Path) -> dict[str, dict]:
    """fsync every file under `folder` and digest it, then fsync the folders. Returns the marker's
    `files` entry. The fsyncs (waiting on the disk) and the digests (CPU, reading the page cache)
    are separate jobs in one thread pool (both release the GIL), so they overlap instead of queueing
    file by file: the seal costs about the larger of the two, not their sum."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file())  # sharded (FSDP) states live in subfolders
    with ThreadPoolExecutor(max_workers=min(8, 2 * len(paths) or 1)) as pool:
        # the biggest files first: the longest digests start at once
        by_size = sorted(paths, key=lambda p: -p.stat().st_size)
        digests = {p: pool.submit(file_digest, p) for p in by_size}
        synced = [pool.submit(fsync_path, p) for p in by_size]
        metas = {p: {"bytes": p.stat().st_size, "sha256": digests[p].result()} for p in paths}
        for f in synced:
            f.result()
    for d in sorted({p.parent for p in paths} | {folder}, key=lambda d: -len(d.parts)):
        fsync_path(d)
    return {str(p.relative_to(folder)): metas[p] for p in paths}


def seal_export(folder: Path) -> None:
    """Write `folder`'s `COMPLETE` marker (every file's size and digest, fsynced), last: what
    `resolve_checkpoint` checks before any tool reads the folder."""
    files = seal_files(folder)
    with open(folder / MARKER, "w") as f:
        json.dump({"export": True, "files": files}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(folder)


# The digests a marker may hold, with their length in hex digits: SHA-256, and the blake2b of
# markers written before it (16-byte digests, `file_digest`).
_DIGESTS = {"sha256": 64, "blake2b": 32}


def read_marker(folder: Path) -> dict:
    """`folder`'s `COMPLETE` marker, checked to be what `_write_checkpoint` / `seal_export` write: a JSON
    object whose `files` maps each relative path inside the folder to {"bytes": its size, "sha256"
    (or, in older markers, "blake2b"): its hex digest}, with `step` a count where present. Every
    reader of a marker goes through here, so a malformed one is a `ValueError` saying what is wrong
    (a damaged folder, skipped or refused like a digest mismatch), never a KeyError or TypeError
    later; OSError when it cannot be read (it is not opened unless it is a regular file)."""
    path = folder / MARKER
    problem = regular_file_problem(path)
    if problem:
        raise OSError(f"{MARKER} {problem}")
    try:
        marker = json.loads(path.read_bytes())
    except RecursionError:  # json's parser recurses once per nested [ or {
        raise ValueError("not JSON: nested too deeply") from None
    except ValueError as e:  # UnicodeDecodeError too
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(marker, dict):
        raise ValueError(f"a JSON {type(marker).__name__}, not an object")
    step = marker.get("step", 0)
    if type(step) is not int or step < 0:
        raise ValueError(f"step {step!r} is not a step count")
    files = marker.get("files")
    if not isinstance(files, dict):
        raise ValueError("no files object" if files is None else f"files is a {type(files).__name__}, not an object")
    for name, meta in files.items():
        if name in ("", MARKER) or "\0" in name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"entry {name!r} is not a file inside the folder")
        if not isinstance(meta, dict) or type(meta.get("bytes")) is not int or meta["bytes"] < 0:
            raise ValueError(f"entry {name!r} has no byte count")
        digests = [k for k in _DIGESTS if isinstance(meta.get(k), str)
                   and re.fullmatch(f"[0-9a-f]{{{_DIGESTS[k]}}}", meta[k])]
        if not digests:
            raise ValueError(f"entry {name!r} has no sha256 digest")
    return marker


def verify_checkpoint(ckpt: Path) -> str | None:
    """None if every file listed in the marker is present with its size and digest, else what is wrong
    (a malformed marker included: `read_marker`)."""
    try:
        files = read_marker(ckpt)["files"]
    except OSError as e:
        return f"unreadable {MARKER} marker ({e.strerror or e})"
    except ValueError as e:
        return f"malformed {MARKER} marker ({e})"
    for name, meta in files.items():
        path = ckpt / name
        if not path.exists():
            return f"{name} is missing"
        odd = regular_file_problem(path)
        if odd:
            return f"{name} {odd}"
        if path.stat().st_size != meta["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {meta['bytes']} were written"
        algorithm = "sha256" if "sha256" in meta else "blake2b"
        if file_digest(path, algorithm) != meta[algorithm]:
            return f"{name} is corrupted (digest mismatch)"
    return None
