"""Step-named, atomically completed checkpoints on top of `accelerator.save_state` / `load_state`.

Layout of `<output_dir>/checkpoints/`:

    step_00001200/            complete checkpoint (the name exists only once everything is written)
        model.safetensors     weights, rank 0      ─┐ accelerate.save_state: every prepared model and
        optimizer.bin         rank 0                │ optimizer in prepare order (a second one:
        random_states_<r>.pkl every rank            │ model_1.safetensors, optimizer_1.bin, ...)
        custom_checkpoint_<i>.pkl                  ─┘ the objects registered for checkpointing, rank 0:
                              a recipe's own (registered before resume_from_checkpoint), then the
                              run's RunState (the position, TrainState, and every LR schedule's state)
        train_state.json      the same position and schedules readable, with what is checked before
                              anything is loaded: config, data summary, global batch, the names of the
                              models and optimizers in prepare order and of the registered objects
                              (`registered`, in registration order) (rank 0)
        config.yaml           the resolved config (rank 0)
        COMPLETE              marker with every file's size and SHA-256 digest: written last,
                              then the folder is renamed into place
    .step_00001300.tmp/       a save in progress (or killed mid-save): never loaded
    .step_00001000.old/       pruned (beyond save_total_limit), being deleted in the background
                              (what a kill leaves of these two: removed at the next launch, `remove_leftovers`)

Under FSDP (accelerate_configs/fsdp.yaml, SHARDED_STATE_DICT) the weights and the optimizer are
sharded instead: `pytorch_model_fsdp_0/` and `optimizer_0/` hold one `__<rank>_0.distcp` file per
rank plus a `.metadata` (torch.distributed.checkpoint); the marker covers them like the rest.
Under DeepSpeed (accelerate_configs/deepspeed_zero2.yaml) the engine writes its own layout:
`pytorch_model/mp_rank_00_model_states.pt` (weights, rank 0), one
`pytorch_model/zero_pp_rank_<r>_mp_rank_00_optim_states.pt` per rank (its optimizer partition),
`latest` and DeepSpeed's `zero_to_fp32.py` / `zero_to_torch.py` (never run by us); sealed the same way.

Why not accelerate's own naming: `automatic_checkpoint_naming` never restores its counter on load
(accelerate #1601, #3306) and `total_limit` deletes the oldest checkpoint *before* writing the new
one, so a crash mid-save can leave nothing. Here pruning happens only after the new checkpoint is
complete, and `find_latest_checkpoint` ignores anything without the marker. At resume, the
newest checkpoint whose files all match the marker's digests, and whose pickles load without
running code and hold what a save writes (the run's state as train_state.json records it, RNG
states that set the generators), is loaded; a damaged one is named in a warning and skipped for the
one before it. When checkpoints exist but none is usable the launch stops, naming each: nothing is
deleted (`--resume false` starts over with them moved to `checkpoints.before_<time>/`). A save
prunes only the checkpoints it supersedes (older than itself), never a newer one skipped as damaged.

Loading executes no code from the checkpoint folder: weights come from safetensors, the optimizer,
RNG states and registered objects through `torch.load(weights_only=True)`. accelerate's
`load_custom_state` asks for `weights_only=False` (accelerate 1.15, checkpointing.py), so two
guards keep registered objects safe: `choose_checkpoint` loads every pickle of a candidate (every
rank's RNG file, every custom_checkpoint_<i>.pkl, optimizer*.bin, scaler.pt) with weights only and
skips the checkpoint as damaged if one fails; and `load_state` runs with torch's
TORCH_FORCE_WEIGHTS_ONLY_LOAD set, so a file swapped after that check is refused, not run. A
registered object's state_dict must therefore be plain data (dicts, lists, numbers, strings,
tensors): `save_checkpoint` says so at the first save otherwise. accelerate saves rank 0's state of
each one: register only state that is the same on every rank. It matches files to objects by
position: a resume whose registered names differ is refused before anything is loaded. A checkpoint
written before the run's state was registered (no `registered` in train_state.json, no
custom_checkpoint files) resumes from its train_state.json, and its next save writes the new layout.
Exception: an FSDP checkpoint's `.metadata` files are read by torch.distributed.checkpoint with a
plain `pickle.load` (torch/distributed/checkpoint/filesystem.py, `FileSystemReader.read_metadata`):
resume FSDP runs only from checkpoints you wrote. The same holds for DeepSpeed checkpoints: its engine
loads its `.pt` files with `torch.load(weights_only=False)` (deepspeed 0.19,
runtime/checkpoint_engine/torch_checkpoint_engine.py), so under DeepSpeed `load_state` runs without
forced weights-only loads (the check before it still covers the registered objects).

Several models (a GAN: `models={"generator": g, "discriminator": d}`, likewise `optimizers=` and
`schedulers=`): accelerate saves and loads them by prepare order, so the checkpoint records their
names in that order and a resume whose names or order differ is refused before anything is loaded.
One model, optimizer and scheduler may be passed bare (named "model", "optimizer", "scheduler"):
the files are those of a one-model checkpoint, and checkpoints written before names were recorded
(one model, `"scheduler"` in train_state.json) still resume.

Every function that contains a collective says so; all ranks must call those.
"""

from __future__ import annotations

import dataclasses
import errno
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import logging
import math
import os
import pickle
import random
import re
import shlex
import shutil
import stat
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml
from accelerate.utils import broadcast_object_list
from accelerate.utils import load as accelerate_load

from common.training.faults import NonFiniteError, RunError, UsageError
from common.data.manifest import data_change
from common.training.prepare import fsync_path

logger = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE"

class ContractError(RuntimeError):
    """A training loop used the helpers out of order (a bug in the recipe, not in its config)."""


def named(objects, kind: str) -> dict[str, Any]:
    """`objects` as a {name: object} dict: a dict as is, a bare object as {kind: object}."""
    return dict(objects) if isinstance(objects, dict) else {kind: objects}


@dataclasses.dataclass
class TrainState:
    """The training position and what it was made with; saved into every checkpoint as JSON.

    `stage` (not saved) is where the loop stands, checked by every helper that needs a predecessor:
    "new" (made by `for_run`) → `resume_from_checkpoint` → "boundary" (a step boundary: the loop may
    start, a checkpoint may be saved) → `train_batches` yields a micro-batch: "window" (inside an
    accumulation window) or "window_end" (its last micro-batch: optimizers may update) →
    `common.training.loop.end_step` → "boundary"."""

    stage: ClassVar[str] = "new"
    updated: ClassVar[tuple] = ()  # the optimizers updated in the current window (common.training.loop)
    skipped_in_step: ClassVar[bool] = False  # an update of the current step was skipped (non-finite)

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch (0-based)
    batches_in_epoch: int = 0  # global micro-batches (all ranks) already consumed in `epoch`
    world_size: int = 1  # processes of the launch that wrote the checkpoint
    gradient_accumulation_steps: int = 1  # ... and their accumulation: world_size × this = global_batch
    global_batch: int = 1  # micro-batches per optimizer step: fixed at the first launch (elastic resume)
    threads_per_process: int = 0  # torch threads of the launch that wrote it (bit-exactness on CPU needs the same)
    skipped_updates: int = 0  # optimizer updates skipped (non-finite gradients)
    applied_updates: int = 0  # optimizer updates applied (a step may make several: a GAN's two optimizers)
    nonfinite_streak: int = 0  # consecutive steps with a skipped update, up to now
    config_hash: str = ""  # config_hash(config, ignore=resume_safe)
    config: dict = dataclasses.field(default_factory=dict)  # the resolved config, for diffs
    # The config keys its Config marks ResumeSafe (where to write, when to stop, how often to log):
    # they may differ on a re-launch; every other key must match.
    resume_safe: list = dataclasses.field(default_factory=list)
    # {key: its default in the Config class}: a key a checkpoint's config lacks (the field was added
    # since) is no change when this launch has its default. This launch's, never restored.
    config_defaults: dict = dataclasses.field(default_factory=dict)
    data: dict = dataclasses.field(default_factory=dict)  # manifest_summary() of the training data
    # resumes on changed data allowed by --allow_data_change: {step, was, now} (manifest summaries)
    data_changes: list = dataclasses.field(default_factory=list)
    # The launches that trained toward this state, oldest first, one per resume: {"from_step" (the
    # step it started at; it ran up to the next one's, the last up to `step`), "command", "cwd",
    # "processes"}, for the model card. A checkpoint written before they were recorded has none: its
    # resume records its own launch from its step.
    launches: list = dataclasses.field(default_factory=list)

    @classmethod
    def for_run(cls, config: Any, world_size: int, accumulation: int, data: dict | None = None) -> "TrainState":
        """The state of a fresh run of `config` (the recipe's Config) on `world_size` processes with
        `accumulation` (see `global_batch_plan`), on the training data summarized by `data`
        (`common.data.manifest.manifest_summary`), with this process's torch thread count."""
        from common.config import config_hash, config_to_dict, resume_safe_keys

        values, safe = config_to_dict(config), resume_safe_keys(config)
        state = cls(world_size=world_size, gradient_accumulation_steps=accumulation,
                    global_batch=world_size * accumulation, threads_per_process=torch.get_num_threads(),
                    config_hash=config_hash(values, ignore=safe), config=values, resume_safe=safe,
                    config_defaults=field_defaults(config), data=data or {})
        return state

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the fields in `state` (what `resume_from_checkpoint` restores: the position and the
        counters). A key that is no field (a class attribute like `stage`, a method) is a bug in the
        caller: `choose_checkpoint` skips a checkpoint whose position holds one (`position_problem`)."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(state) - fields)
        if unknown:
            raise ContractError(f"TrainState.load_state_dict: {unknown} are no TrainState fields")
        for k, v in state.items():
            setattr(self, k, v)



class RunState:
    """The run's own state, registered with `accelerator.register_for_checkpointing` so that
    `save_state` writes it (`custom_checkpoint_<i>.pkl`) and `load_state` reads it back: the position
    (`TrainState`) and the state of every schedule. `save_checkpoint` / `resume_from_checkpoint`
    register it (once per Accelerator, after any object the recipe registered itself) and point it
    at the run's state and schedules.

    Loading only keeps what was read (`loaded`): `resume_from_checkpoint` applies it after its checks,
    keeping this launch's config, topology and data summary. Its state_dict is plain data (dicts,
    lists, numbers, strings), which `torch.load(weights_only=True)` reads without running code."""

    def __init__(self) -> None:
        self.state: TrainState | None = None
        self.schedulers: dict[str, Any] = {}
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"train_state": self.state.state_dict(),
                "schedulers": {name: s.state_dict() for name, s in self.schedulers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def registered_names(accelerator) -> list[str]:
    """The class names of the objects registered for checkpointing, in registration order (the order
    in which `save_state` numbers their files, and `load_state` reads them back)."""
    return [type(obj).__qualname__ for obj in accelerator._custom_objects]


def _run_state(accelerator, register: bool = True) -> RunState | None:
    """This Accelerator's `RunState`, registered at the first call (None if `register` is False and
    it is not registered yet)."""
    for obj in accelerator._custom_objects:
        if isinstance(obj, RunState):
            return obj
    if not register:
        return None
    run_state = RunState()
    accelerator.register_for_checkpointing(run_state)
    return run_state

_NO_DEFAULT = object()


def field_defaults(config: Any) -> dict[str, Any]:
    """{field: its default in the Config class} (as `config_to_dict` writes values), for the fields
    that have one."""
    out = {}
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


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

    Only regular files and real folders are accepted (`_odd_entry`): a folder that holds a symlinked
    folder, a FIFO, a socket or a device is refused before any file is opened (reading a FIFO blocks
    for ever). A symlink to a regular file is followed (a Hugging Face hub snapshot is made of them)
    and its target must match the marker like any file.

    This proves integrity, not authorship: nothing was cut short or changed since the folder was
    sealed. Anyone can seal a folder of their own making; load only folders you trust."""
    folder = Path(folder)
    if not (folder / MARKER).is_file():
        return (f"no {MARKER} marker, so nothing says its files are whole and unchanged (an export that did not "
                f"finish, a partial copy, or files put there by hand); it is not loaded: {remedy}")
    odd = _odd_entry(folder)
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


def _odd_entry(folder: Path) -> str | None:
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


class _SealedSource(importlib.machinery.SourceFileLoader):
    """Imports a module from a sealed folder's own source, and only if its bytes are the sealed ones:
    never from bytecode (`__pycache__/` is not sealed, and Python would run a planted .pyc whose
    recorded source size and time match), and writes none."""

    def __init__(self, name: str, path: str, sha256: str):
        super().__init__(name, path)
        self.sha256 = sha256

    def path_stats(self, path):
        # SourceLoader.get_code treats an OSError here as "no source time": it then compiles the
        # source and neither reads nor writes a .pyc (importlib._bootstrap_external, Python 3.9-3.13)
        raise OSError("sealed source: no bytecode cache")

    def get_data(self, path):
        data = super().get_data(path)
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise UsageError(f"{path} changed after its folder was verified: not imported: {RE_EXPORT}")
        return data


class _SealedFinder(importlib.abc.MetaPathFinder):
    """Finds a sealed folder's top-level modules by their own names; in `sys.meta_path` only while
    `import_export` imports one of them."""

    def __init__(self, folder: Path, modules: dict[str, str]):
        self.folder, self.modules = folder, modules

    def find_spec(self, name, path=None, target=None):
        if name not in self.modules:
            return None
        file = str(self.folder / f"{name}.py")
        return importlib.util.spec_from_file_location(name, file, loader=_SealedSource(name, file, self.modules[name]))


def import_export(folder: str | Path, module: str):
    """Import `module` (e.g. "tts_model") from an exported `final/` outside this repository: the
    folder is verified first (`resolve_checkpoint`), and the module and the folder's modules it
    imports come from their sealed source, checked against the marker's digests as they are read.
    (A plain `sys.path.insert(0, folder)` + `import` runs the folder's code before anything checks it.)

    Scope: the folder's modules are found, by their own names, only during this call (the finder
    leaves `sys.meta_path` when it returns): a later import of any other name never reaches the
    folder. They import each other at the top, as the exports' code does (`write_code`); what they
    imported stays in `sys.modules` under those names, as any import does. A sealed module whose name
    is already taken, by the standard library (`json.py`), by a module this process can import from
    elsewhere, or by another export imported before, is refused in one line before anything is
    imported: while the finder is in place it would replace that module for every importer (a
    library importing `json` meanwhile), and one process holds one module per name. Why not import
    them under private names instead (`_export_1.json`), which nothing could shadow: the exports'
    code imports its siblings by plain names (`from tts_frontend import ...`), and their classes
    carry their module's name; `write_code` prefixes every exported module (`tts_`, `vocoder_`), so
    plain names collide with nothing."""
    folder = resolve_checkpoint(folder, flag="import_export")
    files = read_marker(folder)["files"]
    modules = {name[:-3]: meta["sha256"] for name, meta in files.items()
               if name.endswith(".py") and "/" not in name and "sha256" in meta}
    if module not in modules:
        raise UsageError(f"{folder}: no sealed {module}.py in it (sealed modules: {', '.join(sorted(modules)) or 'none'})")
    for name in sorted(modules):
        taken = _name_taken(name, folder)
        if taken:
            # imported from elsewhere (another export, perhaps): a process of its own has not imported it
            imported = name in sys.modules and name not in sys.stdlib_module_names
            raise UsageError(f"{folder}: its sealed {name}.py has the name of {taken}: rename it in the export "
                             f"(and its imports)" + (", or load this export's code in a process of its own"
                                                     if imported else ""))
    finder = _SealedFinder(folder, modules)
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module(module)
    finally:
        sys.meta_path.remove(finder)


def _name_taken(name: str, folder: Path) -> str | None:
    """What else module `name` is in this process, in words (None: only `folder`'s `name`.py)."""
    mine = (folder / f"{name}.py").resolve()
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return f"the standard library's {name} module"
    loaded = sys.modules.get(name)
    if loaded is not None:
        file = getattr(loaded, "__file__", None)
        if file and Path(file).resolve() == mine:
            return None
        return f"another module (this process already imported {name} from {file})"
    for finder in sys.meta_path:  # what `import name` would find without the export
        try:
            spec = finder.find_spec(name, None)
        except Exception:  # noqa: BLE001 — a third-party finder's own failure is no answer
            continue
        if spec is not None:
            origin = spec.origin if spec.has_location else None
            if origin and Path(origin).resolve() == mine:
                return None
            return f"another module ({name} at {origin or spec.name})"
    return None


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


def save_checkpoint(accelerator, output_dir: str | Path, state: TrainState, *, models, optimizers, schedulers,
                    save_total_limit: int | None = None) -> Path:
    """Save everything needed to resume at `state.step`. Collective: call on every rank.

    `models`, `optimizers`, `schedulers`: every prepared model and optimizer, and every schedule, by
    name (a dict) or bare when there is one. Only at a step boundary (after `common.training.loop.end_step`):
    gradients of an unfinished accumulation window are not saved by anyone.
    """
    if state.stage != "boundary":
        raise ContractError(f"save_checkpoint at step {state.step}: not at a step boundary (stage {state.stage!r}); "
                            f"save after end_step, never inside an accumulation window or before "
                            f"resume_from_checkpoint")
    models, optimizers, schedulers = _parts(accelerator, models, optimizers, schedulers)
    run_state = _run_state(accelerator)
    run_state.state, run_state.schedulers = state, schedulers
    # resume_from_checkpoint registers RunState after every object registered before it: an object
    # after RunState was registered later, and was not resumed.
    names = registered_names(accelerator)
    ours = names.index(RunState.__qualname__)
    if ours != len(names) - 1:
        raise ContractError(f"save_checkpoint at step {state.step}: objects registered for checkpointing "
                            f"{names} != {names[:ours + 1]} at resume_from_checkpoint: "
                            f"register every object before resume_from_checkpoint (a later one was not resumed)")
    unplain = _unplain_state(accelerator)  # every rank: the same objects, the same verdict
    if unplain:
        raise ContractError(unplain)
    # The training loop skips non-finite updates; this is the last line of defence.
    bad = _nonfinite_models(accelerator, models)
    if bad:
        raise NonFiniteError(f"refusing to save step {state.step}: non-finite weights in {', '.join(bad)} (the last "
                             f"complete checkpoint is kept): re-run to resume from it; if it recurs, lower "
                             f"--learning_rate")
    final = checkpoint_dir(output_dir, state.step)
    tmp = final.parent / f".{final.name}.tmp"
    if accelerator.is_main_process:
        _wait_for_pruning()  # the space of the checkpoints pruned last time is free before we write
        remove_leftovers(output_dir)  # of saves killed or failed earlier
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        _write_checkpoint(accelerator, tmp, final, state, models, optimizers, schedulers)
    except Exception as e:  # noqa: BLE001 — safetensors' SafetensorError is no OSError
        if not _is_disk_full(e):
            raise
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        need = _checkpoint_bytes(output_dir, models.values(),
                                 master_copy=accelerator.distributed_type.value == "DEEPSPEED")
        raise RunError(_disk_full_message(output_dir, f"saving step {state.step}", need,
                                          "the partial checkpoint was removed", "resume")) from e
    if accelerator.is_main_process and save_total_limit:
        # Only what this save supersedes: a newer checkpoint (one skipped as damaged at resume) is
        # not this run's to delete, and must not push the one just written out of the limit.
        _prune([c for c in list_checkpoints(output_dir) if c.name <= final.name][:-save_total_limit])
    accelerator.wait_for_everyone()
    return final


_pruning: threading.Thread | None = None  # the last save's background deletion, if still running


def _prune(old: list[Path]) -> None:
    """Drop checkpoints beyond the limit without making the training wait for the deletion.

    Each is renamed to `.step_N.old` first: atomic, so from that instant it is no checkpoint (a kill
    can never leave a half-deleted folder that still looks complete). Deleting the files (~0.5 ms
    per MB here) then runs in a thread, joined before the next save writes (and, not being a daemon,
    by Python at exit); a `.old` folder left by a kill is removed by `remove_leftovers`."""
    global _pruning
    moved = []
    for ckpt in old:
        target = ckpt.with_name(f".{ckpt.name}.old")
        os.rename(ckpt, target)
        moved.append(target)
    if moved:
        _pruning = threading.Thread(target=lambda: [shutil.rmtree(m, ignore_errors=True) for m in moved],
                                    name="prune-checkpoints")
        _pruning.start()


def remove_leftovers(output_dir: str | Path) -> None:
    """Delete what kills and failures left in `output_dir`, never the only copy of anything. Main
    process only, while no save runs (before each save, and at launch in `choose_checkpoint`).

    - `checkpoints/.step_N.tmp/`: a save that did not finish (never loaded);
    - `checkpoints/.step_N.old/`: a pruned checkpoint, once a newer complete one exists (`_prune`
      renames only after the newer one is complete, so that one always exists unless a user
      deleted it);
    - `.final.old/`: the previous export, once `final/` exists (`export_final` renames the old
      `final/` aside before the new one is in place: without `final/` it is kept).
    `.final.tmp/` is kept: it says that an export did not finish (`unfinished_export`), and the
    next export replaces it."""
    out = Path(output_dir)
    root = out / "checkpoints"
    ckpts = list_checkpoints(out)
    newest = ckpts[-1].name if ckpts else ""
    doomed = []
    if root.is_dir():
        doomed += root.glob(".step_*.tmp")
        doomed += [p for p in root.glob(".step_*.old") if p.name[1:-len(".old")] < newest]  # zero-padded names
    if (out / "final").is_dir() and (out / ".final.old").exists():
        doomed.append(out / ".final.old")
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)


def _wait_for_pruning() -> None:
    global _pruning
    if _pruning is not None:
        _pruning.join()
        _pruning = None


def _all_weights_finite(accelerator, models) -> bool:
    """True when every weight of `models` (one model, or a {name: model} dict) is finite, with the
    same answer on every rank. Collective under FSDP (see `_nonfinite_models`)."""
    return not _nonfinite_models(accelerator, named(models, "model"))


def _nonfinite_models(accelerator, models: dict[str, Any]) -> list[str]:
    """Names of the models holding a non-finite weight, the same on every rank.

    DDP and DeepSpeed ZeRO-2 (it shards the optimizer state and gradients, not the weights): each rank
    holds all weights, identical, so a local check agrees everywhere. FSDP: each rank
    holds only its shards (DTensor local parts), so the local answers are combined with one gather
    (collective: every rank calls it, and every rank raises or none does)."""
    from torch.distributed.tensor import DTensor

    finite = []
    for model in models.values():
        # One fused max-abs per parameter (NaN propagates through it, and unlike a 2-norm it cannot
        # overflow), stacked: one host sync per model.
        params = [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]
        params = [p for p in params if p.numel()]  # an FSDP rank may hold an empty shard
        finite.append(not params or bool(torch.isfinite(torch.stack(torch._foreach_norm(params, float("inf")))).all()))
    if accelerator.distributed_type.value == "FSDP":
        flags = accelerator.gather(torch.tensor(finite, dtype=torch.int, device=accelerator.device))  # (world × models,)
        finite = flags.view(-1, len(models)).min(0).values.bool().tolist()
    return [name for name, ok in zip(models, finite) if not ok]


def _parts(accelerator, models, optimizers, schedulers) -> tuple[dict, dict, dict]:
    """The named models, optimizers and schedulers; models and optimizers in prepare order (the order
    in which `save_state` / `load_state` write and read them). Every prepared one must be named."""
    ordered = []
    # accelerate lists a DDP model unwrapped (an FSDP one or a DeepSpeed engine as prepare returned it)
    unwrap = accelerator.unwrap_model
    for kind, given, prepared, key in (("model", named(models, "model"), accelerator._models, lambda m: id(unwrap(m))),
                                       ("optimizer", named(optimizers, "optimizer"), accelerator._optimizers, id)):
        index = {key(p): i for i, p in enumerate(prepared)}
        missing = [name for name, obj in given.items() if key(obj) not in index]
        if missing or len(given) != len(prepared):
            raise ContractError(
                f"{len(prepared)} {kind}(s) prepared, {len(given)} named"
                + (f" ({', '.join(missing)}: not what accelerator.prepare returned)" if missing else "")
                + f"; accelerate saves and loads every prepared {kind}: name each one once")
        ordered.append(dict(sorted(given.items(), key=lambda kv: index[key(kv[1])])))
    return ordered[0], ordered[1], named(schedulers, "scheduler")


def _write_checkpoint(accelerator, tmp: Path, final: Path, state: TrainState, models: dict, optimizers: dict,
                      schedulers: dict) -> None:
    # Every rank: its RNG file. DDP: rank 0 writes model.safetensors and optimizer.bin. FSDP
    # (SHARDED_STATE_DICT): every rank writes its shards through torch.distributed.checkpoint into
    # pytorch_model_fsdp_0/ and optimizer_0/ (__<rank>_0.distcp files + .metadata by rank 0).
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # accelerate has no barrier at the end of save_state
    if accelerator.is_main_process:
        (tmp / "train_state.json").write_text(
            json.dumps({**state.state_dict(), "models": list(models), "optimizers": list(optimizers),
                        "schedulers": {name: s.state_dict() for name, s in schedulers.items()},
                        "registered": registered_names(accelerator)}, indent=2))
        with open(tmp / "config.yaml", "w") as f:
            yaml.safe_dump(state.config, f, sort_keys=False)
        files = seal_files(tmp)
        with open(tmp / MARKER, "w") as f:
            json.dump({"step": state.step, "files": files}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if final.exists():  # the same step saved twice (e.g. final save right after a periodic one)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(final.parent)


def _is_disk_full(e: BaseException) -> bool:
    """A full disk or quota, also when the writer wraps the OS error in its own exception (torch's
    zip writer: a RuntimeError "unexpected pos"; safetensors: a SafetensorError "... (os error 28)")."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(e) for s in ("No space left", "os error 28", "Disk quota exceeded", "unexpected pos")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _mount_point(path: Path) -> str:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return str(path)


def _weight_bytes(models) -> int:
    return sum(p.numel() * p.element_size() for m in models for p in m.parameters())


def _checkpoint_bytes(output_dir: str | Path, models, master_copy: bool = False) -> int:
    """The size of a checkpoint: the newest one's, else weights + two AdamW moments (+ DeepSpeed's
    fp32 master copy of the weights, in its optimizer files)."""
    previous = list_checkpoints(output_dir)
    if previous:  # FSDP shards, DeepSpeed's pytorch_model/: subfolders
        return sum(f.stat().st_size for f in previous[-1].rglob("*") if f.is_file())
    return (3 + master_copy) * _weight_bytes(models)


def _disk_full_message(output_dir: str | Path, doing: str, need: int, removed: str, then: str) -> str:
    """One line: what filled up, what was kept, how much to free and which files may go.

    Pruning (--save_total_limit) deletes older checkpoints only after a newer one is complete, so
    on a full disk the space must be freed by hand before the re-run."""
    mb = lambda n: f"{n / 1e6:.1f}" if n < 1e7 else f"{n / 1e6:.0f}"  # noqa: E731 — small runs too
    mount = _mount_point(Path(output_dir))
    free = shutil.disk_usage(output_dir).free
    ckpts = list_checkpoints(output_dir)
    kept = f"step {int(ckpts[-1].name[5:])} is kept" if ckpts else "no earlier checkpoint exists"
    older = ckpts[:-1]  # the newest is the one to resume from
    hint = ""
    if older:
        names = ", ".join(p.name for p in older[:3]) + (f" and {len(older) - 3} more" if len(older) > 3 else "")
        size = sum(f.stat().st_size for c in older for f in c.rglob("*") if f.is_file())
        hint = f" (e.g. the older checkpoints in {ckpts[-1].parent}: {names}, {mb(size)} MB; keep {ckpts[-1].name})"
    amount = f"at least {math.ceil((need - free) / 1e5) / 10:g} MB" if need > free else "some space"  # rounded up
    return (f"no space left on {mount} while {doing} (needs ~{mb(need)} MB, {mb(free)} MB free); {removed} and "
            f"{kept}. Free {amount} on {mount}{hint}, then re-run the same command to {then} "
            f"(--save_total_limit deletes older checkpoints only after a newer one is saved)")


def export_final(accelerator, models, output_dir: str | Path, write_extras) -> Path:
    """Write `<output_dir>/final/`: the weights plus whatever `write_extras(folder)` writes (main
    process only). Collective: call on every rank.

    One model (bare, or a one-entry dict): `final/model.safetensors`. Several (a {name: model}
    dict): `final/<name>/model.safetensors` each.

    Everything goes into `.final.tmp/` first, then a `COMPLETE` marker (every file's size and
    digest), then the folder is renamed into place: a kill during the export never leaves a
    `final/` that looks finished, and `final/COMPLETE` is the sign that a run is done."""
    final = Path(output_dir) / "final"
    tmp = final.with_name(".final.tmp")
    old = final.with_name(".final.old")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    models = named(models, "model")
    try:
        for name, model in models.items():  # every rank (it gathers sharded weights); rank 0 writes
            accelerator.save_model(model, tmp if len(models) == 1 else tmp / name)
        if accelerator.is_main_process:
            write_extras(tmp)
            seal_export(tmp)
    except Exception as e:  # noqa: BLE001 — safetensors' SafetensorError is no OSError
        if not _is_disk_full(e):
            raise
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RunError(_disk_full_message(output_dir, f"exporting the final model to {final}",
                                          2 * _weight_bytes(models.values()), "the partial export was removed",
                                          "finish the export")) from e
    if accelerator.is_main_process:
        # Replace a previous export (a finished run re-run with a larger --max_steps): it is moved
        # aside first, so a kill between the renames leaves it as `.final.old` beside the complete
        # `.final.tmp`, and the next export finishes the swap.
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_path(final.parent)
        shutil.rmtree(old, ignore_errors=True)
        logger.info(f"final model in {final}")
    accelerator.wait_for_everyone()
    return final


def seal_export(folder: Path) -> None:
    """Write `folder`'s `COMPLETE` marker (every file's size and digest, fsynced), last: what
    `resolve_checkpoint` checks before any tool reads the folder."""
    files = seal_files(folder)
    with open(folder / MARKER, "w") as f:
        json.dump({"export": True, "files": files}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(folder)


def choose_checkpoint(accelerator, output_dir: str | Path, resume: bool = True) -> Path | None:
    """The newest complete checkpoint whose files match their digests and whose pickled states load
    without running code and hold what a save writes (checked by the main process, which reads each
    file once; the verdict is broadcast). A damaged one is named in a warning and the one before it
    is tried. The main process first removes what kills left behind (`remove_leftovers`).

    None (a fresh start) when `output_dir` holds no checkpoint, or with `resume` False
    (`--resume false`: start over, its checkpoints moved aside by `set_aside_checkpoints`). When it
    holds checkpoints and none is usable, every rank raises a RunError naming each one and why: a
    fresh start would save over them and prune them. Collective: call on every rank."""
    verdict = [None, None]  # [the chosen checkpoint, or the refusal]
    if accelerator.is_main_process:
        remove_leftovers(output_dir)
        if resume:
            verdict = _choose(Path(output_dir))
        else:
            set_aside_checkpoints(output_dir)
    if accelerator.num_processes > 1:
        broadcast_object_list(verdict, from_process=0)
    if verdict[1]:
        raise RunError(verdict[1])
    return Path(verdict[0]) if verdict[0] else None


def _choose(out: Path) -> list[str | None]:
    """[the newest usable checkpoint of `out`, None] or [None, why there is none although `out` holds
    checkpoints] or [None, None] (none: a fresh start). Main process."""
    refused = []
    for ckpt in reversed(list_checkpoints(out)):
        # _odd_entry before any file is opened: a FIFO among the pickles would block the load for ever
        problem = (verify_checkpoint(ckpt) or _odd_entry(ckpt) or _unloadable_pickle(ckpt)
                   or _run_state_problem(ckpt) or _rng_states_problem(ckpt) or _nonfinite_weights(ckpt))
        if problem is None:
            return [str(ckpt), None]
        logger.warning(f"skipping damaged checkpoint {ckpt}: {problem}")
        refused.append(f"{ckpt.name} ({' '.join(problem.split())})")  # one line, whatever a reader said
    # A step_N folder without its marker is no checkpoint (a save renames its folder into place with
    # the marker inside): a partial copy, or files put there by hand. Ignored beside a usable one;
    # alone, a fresh start would save over it.
    root = out / "checkpoints"
    unsealed = [p for p in root.iterdir() if CHECKPOINT_RE.match(p.name)] if root.is_dir() else []
    refused += [f"{p.name} (no {MARKER} marker: a partial copy, or files put there by hand)"
                for p in sorted(unsealed, reverse=True) if not (p / MARKER).is_file()]
    if not refused:
        return [None, None]
    shown = "; ".join(refused[:4]) + (f"; and {len(refused) - 4} more" if len(refused) > 4 else "")
    return [None, (f"no checkpoint in {root} can be resumed, so nothing was loaded and nothing deleted: "
                   + shown + f". Restore a good copy of one, or start over from step 0: --resume false "
                   f"(this folder's checkpoints are moved to {root.name}.before_<time>/ beside it, not deleted) "
                   f"or a new --output_dir")]


def set_aside_checkpoints(output_dir: str | Path) -> Path | None:
    """`--resume false`: move `<output_dir>/checkpoints/` to `checkpoints.before_<UTC time>/` beside it
    (returned; None when there is nothing to move), so that the fresh run's saves and pruning never
    touch the previous run's checkpoints, and no later resume mixes the two runs. Nothing is
    deleted: the user removes that folder when they no longer need it. Main process, at launch."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir() or not any(root.iterdir()):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = root.with_name(f"{root.name}.before_{stamp}")
    n = 1
    while target.exists():  # two restarts within a second
        target, n = root.with_name(f"{root.name}.before_{stamp}-{n}"), n + 1
    os.rename(root, target)
    fsync_path(root.parent)
    logger.warning(f"--resume false: starting over from step 0; the previous checkpoints were moved to {target} "
                   f"(nothing deleted: remove that folder when you no longer need it)")
    return target


def _unloadable_pickle(ckpt: Path) -> str | None:
    """None if every pickled state beside the weights loads the way a safe load reads it
    (`torch.load(weights_only=True)`: no code runs), else which one does not and why: every file
    `load_state` unpickles, whichever rank reads it (`optimizer*.bin`, `random_states_<r>.pkl` of
    every rank, `custom_checkpoint_<i>.pkl` of the registered objects, `scaler.pt`, a scheduler's or
    sampler's `.bin`). A file can match its digest and still fail: written damaged, or crafted and
    re-sealed. Memory-mapped: the pickle is parsed, the tensors' bytes are not read. (The FSDP and
    DeepSpeed subfolders are not checked: see the module docstring.)"""
    problem = _registered_files_problem(ckpt)
    if problem:
        return problem
    for path in sorted([*ckpt.glob("*.bin"), *ckpt.glob("*.pkl"), *ckpt.glob("*.pt")]):
        if not zipfile.is_zipfile(path):  # torch.save writes zip archives
            return f"{path.name} is not a torch.save archive"
        try:
            accelerate_load(path, map_location="cpu", mmap=True)
        except Exception as e:  # noqa: BLE001 — UnpicklingError, a zip reader's RuntimeError, ...
            return f"{path.name} cannot be loaded safely ({_load_refusal(e)})"
    return None


def _load_refusal(e: BaseException) -> str:
    """The one line of a refused or failed `torch.load`."""
    lines = [line for line in str(e).splitlines() if line.strip()] or [""]
    # torch's weights-only refusal says what it refused in its second paragraph
    reason = lines[1] if lines[0].startswith("Weights only load failed") and len(lines) > 1 else lines[0]
    return f"{type(e).__name__}: {reason[:200]}"


def _registered_files_problem(ckpt: Path) -> str | None:
    """None if the checkpoint holds one `custom_checkpoint_<i>.pkl` per registered object it records
    (`registered` in train_state.json; a checkpoint written before objects were registered records
    none and holds none), else the file that is missing or not recorded: `load_state` would stop
    on either with accelerate's own error, after loading the weights."""
    try:
        registered = json.loads((ckpt / "train_state.json").read_text()).get("registered") or []
    except (OSError, ValueError, AttributeError):
        return "train_state.json cannot be read"
    if not (isinstance(registered, list) and all(isinstance(name, str) for name in registered)):
        return f"train_state.json holds registered = {repr(registered)[:60]}, not a list of class names"
    for i, name in enumerate(registered):
        if not (ckpt / f"custom_checkpoint_{i}.pkl").is_file():
            return f"custom_checkpoint_{i}.pkl is missing (the state of the registered {name})"
    extra = sorted({p.name for p in ckpt.glob("custom_checkpoint_*.pkl")}
                   - {f"custom_checkpoint_{i}.pkl" for i in range(len(registered))})
    if extra:
        return f"{extra[0]} is not the state of any object it records ({len(registered)} registered)"
    return None


def _run_state_problem(ckpt: Path) -> str | None:
    """None if the checkpoint's `RunState` file (after `_unloadable_pickle` passed it) holds a run's
    state at the marker's step, as `save_checkpoint` writes it, else what it holds instead: a resume
    would fail on it after loading the weights, or train on from a position nobody saved. The
    position must be a `TrainState`'s (`position_problem`), and the file must hold the position and
    the schedules that train_state.json records (`_unlike_train_state_json`)."""
    try:
        saved = json.loads((ckpt / "train_state.json").read_text())
        registered = saved.get("registered") or []
        step = read_marker(ckpt)["step"]
    except (OSError, ValueError, AttributeError, KeyError):
        return f"train_state.json or {MARKER} cannot be read"
    if RunState.__qualname__ not in registered:  # written before the run's state was registered: the JSON holds it
        return position_problem({k: v for k, v in saved.items() if k not in _BESIDE_POSITION}, "train_state.json")
    name = f"custom_checkpoint_{registered.index(RunState.__qualname__)}.pkl"
    held = accelerate_load(ckpt / name, map_location="cpu", mmap=True)
    position = held.get("train_state") if isinstance(held, dict) else None
    if not (isinstance(position, dict) and position.get("step") == step and isinstance(held.get("schedulers"), dict)):
        return f"{name} does not hold the run's state at step {step} (a position and the schedules)"
    return position_problem(position, name) or _unlike_train_state_json(held, saved, name)


# What train_state.json holds beside the position (TrainState's fields): the names checked at resume,
# the schedules' states ("scheduler": one schedule, as written before names were recorded).
_BESIDE_POSITION = ("models", "optimizers", "schedulers", "scheduler", "registered")
_KINDS = {"int": int, "str": str, "dict": dict, "list": list}  # TrainState's field types, as annotated


def position_problem(position: dict, name: str) -> str | None:
    """None if `position` (a saved `TrainState`, from the file `name`) holds only TrainState fields,
    each of its type (the counters whole numbers ≥ 0), else the first that is not: a resume would set
    it (`TrainState.load_state_dict`), and the loop fail on it later, or run differently."""
    kinds = {f.name: _KINDS.get(f.type) for f in dataclasses.fields(TrainState)}
    for key, value in position.items():
        if key not in kinds:
            return f"{name} holds {str(key)[:60]!r}, which is no field of the run's position (TrainState)"
        kind = kinds[key]
        if kind is not None and (not isinstance(value, kind) or isinstance(value, bool)
                                 or (kind is int and value < 0)):
            return (f"{name} holds {key} = {repr(value)[:60]}, not "
                    + ("a whole number ≥ 0" if kind is int else f"a {kind.__name__}"))
    return None


def _unlike_train_state_json(held: dict, saved: dict, name: str) -> str | None:
    """None if the RunState file `name` (`held`) holds the position and the schedules that
    train_state.json (`saved`) records, else the first difference. A save writes both from the same
    objects, one after the other; the launch plans from the JSON (global batch, threads, the names
    it checks) and `load_state` restores the pickle, so a difference would resume a state nobody
    saved (a schedule the run lacks: a KeyError after the weights were loaded). Compared as JSON
    text, the form the JSON file has (tuples as lists, keys as strings)."""
    schedules = saved.get("schedulers")
    if not isinstance(schedules, dict) or list(held["schedulers"]) != list(schedules):
        return (f"{name} holds the schedules {list(held['schedulers'])[:8]}, train_state.json "
                f"{list(schedules)[:8] if isinstance(schedules, dict) else 'none'}")
    recorded = {k: v for k, v in saved.items() if k not in _BESIDE_POSITION}
    pairs = [(f"the position's {k}", held["train_state"].get(k, _NO_DEFAULT), recorded.get(k, _NO_DEFAULT))
             for k in sorted(set(held["train_state"]) | set(recorded), key=str)]
    pairs += [(f"the state of the schedule {k!r}", v, schedules[k]) for k, v in held["schedulers"].items()]
    for what, ours, theirs in pairs:
        try:
            same = json.dumps(ours, sort_keys=True) == json.dumps(theirs, sort_keys=True)
        except (TypeError, ValueError):  # not JSON data (a save could not have written it), or missing
            same = False
        if not same:
            return f"{name} differs from train_state.json in {what} (a save writes both from the same state)"
    return None


def _rng_states_problem(ckpt: Path) -> str | None:
    """None if the checkpoint holds an RNG-state file of every process that wrote it
    (`random_states_<r>.pkl`, r < its world_size) and each one sets the generators
    (`rng_state_problem`), else the first that does not: accelerate's `load_state` skips an RNG file
    it cannot apply with an info line in the log, and the resumed run would silently differ."""
    try:
        world = json.loads((ckpt / "train_state.json").read_text())["world_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return "train_state.json cannot be read"
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        return f"train_state.json holds world_size = {repr(world)[:60]}, not a number of processes"
    for rank in range(world):
        path = ckpt / f"random_states_{rank}.pkl"
        if not path.is_file():
            return f"{path.name} is missing (the RNG states of rank {rank})"
        problem = rng_state_problem(accelerate_load(path, map_location="cpu"))
        if problem:
            return f"{path.name} {problem}"
    return None


def rng_state_problem(states: Any) -> str | None:
    """None if `states` (one rank's `random_states_<r>.pkl`, as accelerate's `save_state` writes it)
    sets what accelerate's `load_state` sets from it: the python, numpy and torch generators (tried
    on scratch generators: this process's own are untouched), the accelerator's micro-step counter
    (`step`), and any device generators (`torch_cuda_manual_seed`, ...: a list of byte tensors),
    else what it holds instead."""
    import numpy as np

    if not isinstance(states, dict):
        return f"holds no RNG states (a {type(states).__name__}, not a dict)"
    try:
        random.Random().setstate(states["random_state"])
        np.random.RandomState().set_state(states["numpy_random_seed"])
        torch.Generator().set_state(states["torch_manual_seed"])
    except KeyError as e:
        return f"holds no {e.args[0]} (python, numpy and torch RNG states are saved for every rank)"
    except Exception as e:  # noqa: BLE001 — TypeError, ValueError, RuntimeError: a state of another shape
        return f"holds RNG states that cannot be set ({_load_refusal(e)})"
    step = states.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"holds step = {repr(step)[:60]}, not the accelerator's micro-step count"
    for key, value in states.items():
        if key != "torch_manual_seed" and str(key).endswith("_manual_seed") and not (
                isinstance(value, (list, tuple)) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                                                         for t in value)):
            return f"holds {key} that is no list of device generator states (byte tensors)"
    return None


def _unplain_state(accelerator) -> str | None:
    """None if the state_dict() of every registered object is data that `torch.load(weights_only=True)`
    reads back, else which object's is not: its checkpoints would be refused at every resume, so
    the first save says so instead."""
    for obj in accelerator._custom_objects:
        buffer = io.BytesIO()
        try:
            torch.save(obj.state_dict(), buffer)
            buffer.seek(0)
            accelerate_load(buffer, map_location="cpu")
        except Exception as e:  # noqa: BLE001 — PicklingError (a lambda), UnpicklingError (a class), ...
            return (f"accelerator.register_for_checkpointing({type(obj).__qualname__}): its state_dict() is not plain "
                    f"data ({_load_refusal(e)}): return dicts, lists, numbers, strings and tensors, which a resume "
                    f"reads without running code")
    return None


def model_weights_files(ckpt: Path) -> dict[str, Path]:
    """Each prepared model's weights file in a checkpoint, by the name `train_state.json` gives it
    (its "models": the recipe's names in prepare order). accelerate names the files by prepare order
    only: model.safetensors, model_1.safetensors, ... Raises OSError/ValueError if the checkpoint
    has no readable train_state.json."""
    names = json.loads((ckpt / "train_state.json").read_text()).get("models") or []
    return {name: ckpt / ("model.safetensors" if i == 0 else f"model_{i}.safetensors") for i, name in enumerate(names)}


def _nonfinite_weights(ckpt: Path) -> str | None:
    """None if every floating-point tensor in the checkpoint's safetensors files is finite, else the
    file and tensor that is not. `save_checkpoint` never writes non-finite weights, so such a file
    was damaged before it was sealed or crafted and re-sealed: it is skipped like any damaged
    checkpoint, instead of training on from NaN and failing at the next save. (FSDP and DeepSpeed
    weights are not in safetensors files: not checked, see the module docstring.)"""
    from safetensors import safe_open

    try:
        files = {path.name: name for name, path in model_weights_files(ckpt).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        files = {}
    for path in sorted(ckpt.rglob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                        model = f" (the {files[path.name]})" if path.parent == ckpt and path.name in files else ""
                        return f"{path.relative_to(ckpt)}{model} holds non-finite weights ({key})"
        except Exception as e:  # noqa: BLE001 — SafetensorError: a file that matches its digest but is no safetensors
            return f"{path.relative_to(ckpt)} cannot be read ({type(e).__name__}: {str(e)[:200]})"
    return None


def global_batch_plan(ckpt: Path | None, world: int, accumulation: int,
                      is_main_process: bool = True) -> tuple[int, int]:
    """(accumulation steps for this launch, global batch G in micro-batches per optimizer step).

    A fresh run: G = world × accumulation. A resumed run keeps its checkpoint's G, on any number of
    processes M that divides it: the accumulation becomes G / M, unless `accumulation` was changed
    from the checkpoint's (then M × accumulation must be G). When neither works, the plan is this
    launch's own G, and `resume_from_checkpoint` refuses it with the other differences."""
    if ckpt is None:
        return accumulation, world * accumulation
    saved = json.loads((ckpt / "train_state.json").read_text())
    was_world, was_accum = saved["world_size"], saved["gradient_accumulation_steps"]
    g = saved.get("global_batch", was_world * was_accum)
    if world * accumulation == g:
        plan = accumulation
    elif accumulation == was_accum and g % world == 0:
        plan = g // world
    else:
        return accumulation, world * accumulation
    if (world, plan) != (was_world, was_accum) and is_main_process:
        logger.warning(f"checkpoint: {was_world} process(es) × accumulation {was_accum}; now: {world} × {plan} "
                       f"— the same global batches of {g} micro-batches (weights not bit-identical to an "
                       f"uninterrupted run in general: gradients are summed in another order; docs/resume.md)")
    return plan, g


def checkpoint_threads(ckpt: Path | None) -> int | None:
    """Torch threads per process of the run that wrote `ckpt` (None: no checkpoint, or not recorded).
    `common.training.distributed.set_threads` keeps them on an automatic resume."""
    if ckpt is None:
        return None
    return json.loads((ckpt / "train_state.json").read_text()).get("threads_per_process") or None


def _global_batch_problem(saved: dict, state: TrainState) -> str | None:
    g = saved.get("global_batch", saved["world_size"] * saved["gradient_accumulation_steps"])
    if g == state.global_batch:
        return None
    valid = ", ".join(f"{m} × {g // m}" for m in range(1, g + 1) if g % m == 0)
    return (f"global batch: checkpoint {g} micro-batches per step ({saved['world_size']} process(es) × accumulation "
            f"{saved['gradient_accumulation_steps']}) != now {state.global_batch} ({state.world_size} × "
            f"{state.gradient_accumulation_steps}); processes × accumulation that keep it: {valid} (leave "
            f"--gradient_accumulation_steps as it was and it is derived)")


def _deepspeed_problem(ckpt: Path, saved: dict, accelerator) -> str | None:
    """Why a DeepSpeed run cannot load `ckpt`, or a DeepSpeed checkpoint this run (None: it can).

    DeepSpeed writes its own layout (`pytorch_model/`), which accelerate's other paths do not read
    and vice versa; and ZeRO's optimizer partitions cannot be re-cut for another number of
    processes (deepspeed 0.19: "Automatic adjustment of ZeRO's optimizer state partitioning with a
    new world size is not currently supported"): said here, before anything is loaded."""
    deepspeed_now = accelerator.distributed_type.value == "DEEPSPEED"
    deepspeed_then = (ckpt / "pytorch_model").is_dir()
    if deepspeed_now != deepspeed_then:
        return (f"profile: the checkpoint was written {'with' if deepspeed_then else 'without'} DeepSpeed, this "
                f"launch runs {'with' if deepspeed_now else 'without'} it (their checkpoint layouts differ)")
    if deepspeed_now and saved["world_size"] != accelerator.num_processes:
        return (f"processes: the DeepSpeed checkpoint holds its optimizer state in {saved['world_size']} "
                f"partitions, one per process, and DeepSpeed cannot re-partition it for {accelerator.num_processes}: "
                f"launch with --num_processes {saved['world_size']}")
    return None


def this_launch(from_step: int, processes: int) -> dict:
    """This launch as `TrainState.launches` records it: the training command as `accelerate launch`
    received it (its own options are not visible here; the process count stands beside it), the
    script relative to the working directory when it lies inside it, as typed from the checkout."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(Path.cwd()):
        script = script.relative_to(Path.cwd())
    return {"from_step": from_step, "command": "accelerate launch " + shlex.join([str(script), *sys.argv[1:]]),
            "cwd": str(Path.cwd()), "processes": processes}


def resume_from_checkpoint(accelerator, ckpt: Path | None, state: TrainState, *, models, optimizers,
                           schedulers) -> Path | None:
    """Load checkpoint `ckpt` (from `choose_checkpoint`; None: a fresh start) into the prepared
    `models` and `optimizers`, the `schedulers` and `state` (named as for `save_checkpoint`).

    The last step before the loop, and part of its contract: `choose_checkpoint` → `global_batch_plan`
    (the accumulation and global batch given to `TrainState.for_run` and the training sampler) →
    `accelerator.prepare` → this, once, which marks `state` ready for `train_batches`.
    Collective: call on every rank.
    Refuses a checkpoint whose global batch, training data, data-affecting config or models differ:
    the resumed run could not reproduce the uninterrupted one.
    """
    if state.stage != "new":
        raise ContractError(f"resume_from_checkpoint: this TrainState is past its start (stage {state.stage!r}); "
                            f"resume a fresh TrainState.for_run(...) once, before the loop")
    models, optimizers, schedulers = _parts(accelerator, models, optimizers, schedulers)
    if accelerator.distributed_type.value == "DEEPSPEED" and len(models) > 1:
        raise RunError(f"DeepSpeed trains one model per Accelerator; this recipe has {len(models)} "
                       f"({', '.join(models)}): use a DDP or FSDP profile (accelerate_configs/)")
    if ckpt is None:
        state.launches = [this_launch(0, accelerator.num_processes)]
        _run_state(accelerator)  # registered last: save_checkpoint checks that nothing came after it
        state.stage = "boundary"
        return None
    if not (ckpt / MARKER).is_file():
        raise ContractError(f"resume_from_checkpoint: {ckpt} has no {MARKER} marker; pass what "
                            f"choose_checkpoint returned (it verifies the files)")
    saved = json.loads((ckpt / "train_state.json").read_text())
    if "schedulers" not in saved and "scheduler" in saved:  # written before names were recorded: one of each
        saved.update(models=["model"], optimizers=["optimizer"], schedulers={"scheduler": saved.pop("scheduler")})
    if "schedulers" not in saved:
        raise RunError(f"{ckpt} was written by an older version of this repository (no scheduler state "
                       f"in train_state.json); resume it with that version, or use a new --output_dir")
    problems = [p for p in [_global_batch_problem(saved, state), _deepspeed_problem(ckpt, saved, accelerator)] if p]
    for kind, now in (("models", models), ("optimizers", optimizers), ("schedulers", schedulers)):
        if list(saved[kind]) != list(now):  # accelerate loads models and optimizers by prepare order
            problems.append(f"{kind}: checkpoint {list(saved[kind])} != now {list(now)} (names, in prepare order)")
    # The objects registered for checkpointing: the recipe's own, then ours (RunState). accelerate
    # loads them by position and stops on a different count, after the weights: compared first.
    # A checkpoint written before they were registered ("registered" absent) holds none: our state
    # comes from its train_state.json, and a recipe object it cannot hold is refused.
    json_layout = "registered" not in saved
    now_registered = registered_names(accelerator)
    if _run_state(accelerator, register=False) is None:
        now_registered.append(RunState.__qualname__)  # registered below, last
    if json_layout and now_registered != [RunState.__qualname__]:
        problems.append(f"registered objects: checkpoint none (written before registered objects were saved) != "
                        f"now {[n for n in now_registered if n != RunState.__qualname__]} (the recipe's own state: "
                        f"resume with the version of the recipe that wrote it)")
    elif not json_layout and saved["registered"] != now_registered:
        problems.append(f"registered objects: checkpoint {saved['registered']} != now {now_registered} (names, in "
                        f"registration order: register_for_checkpointing before resume_from_checkpoint, as the "
                        f"run that wrote it did)")
    was_data = saved.get("data") or {}  # this launch's summary is kept: the same, or a change allowed below
    data_changed = data_change(was_data, state.data, ckpt.parent.parent / "data")
    if data_changed and not state.config.get("allow_data_change"):
        problems.append(data_changed)
    if saved["config_hash"] != state.config_hash:  # the hash is a shortcut; the keys decide
        # This launch's ResumeSafe keys, and those the checkpoint's run marked that its Config no
        # longer has (a checkpoint written before the marks were stored has none).
        safe = set(state.resume_safe) | (set(saved.get("resume_safe", ())) - set(state.config))
        # A field the checkpoint's config lacks was added to the Config after it was written; the
        # code it was written with behaved as that field's default does (the rule for adding a
        # field), so only another value is a change.
        added = {k for k in set(state.config) - set(saved["config"])
                 if state.config[k] == state.config_defaults.get(k, _NO_DEFAULT)}
        for k in sorted(set(saved["config"]) | set(state.config)):
            if k not in safe and k not in added and saved["config"].get(k) != state.config.get(k):
                problems.append(f"{k}: checkpoint {saved['config'].get(k)!r} != now {state.config.get(k)!r}")
    if problems:
        data = any(p.startswith("training data") for p in problems)
        raise RunError(
            f"refusing to resume from {ckpt}: it was made with a different setting\n  "
            + "\n  ".join(problems)
            + "\nUse a new --output_dir, or re-launch with the checkpoint's settings"
            + (" and data (the --data_dir it was trained on, unchanged), or resume on the changed data on "
               "purpose with --allow_data_change true." if data else ".")
        )
    if data_changed and accelerator.is_main_process:
        logger.warning(f"RESUMING ON CHANGED DATA (--allow_data_change true): {data_changed}; the run will not "
                       f"match one trained on either data alone; recorded in train_state.json (data_changes)")
    run_state = _run_state(accelerator, register=not json_layout)  # filled by load_state
    try:
        if saved["world_size"] == accelerator.num_processes:
            # accelerate skips an RNG-state file it cannot load or apply (it logs and goes on); we refuse
            # instead. (On another number of processes rank r may find no RNG file of its own: nothing
            # is lost, the loop reseeds the global RNG from the position before every micro-batch.)
            rng = ckpt / f"random_states_{accelerator.process_index}.pkl"
            problem = rng_state_problem(accelerate_load(rng))  # weights_only: runs no code
            if problem:
                raise RunError(f"{ckpt}: {rng.name} {problem}; it changed after the checkpoint was checked at "
                               f"launch: move {ckpt.name} out of {ckpt.parent} to resume from the checkpoint before it")
        with _weights_only_loads(accelerator):
            accelerator.load_state(str(ckpt))  # models, optimizers (prepare order), RNG states, registered objects
    except pickle.UnpicklingError as e:  # changed after choose_checkpoint checked it: refused, not run
        raise RunError(f"{ckpt}: a pickled state cannot be loaded safely ({_load_refusal(e)}); it changed after "
                       f"the checkpoint was checked at launch: move {ckpt.name} out of {ckpt.parent} to resume "
                       f"from the checkpoint before it") from None
    # choose_checkpoint skipped safetensors files with non-finite weights; FSDP and DeepSpeed weights
    # are read only here: the same verdict, after loading (collective under FSDP, like the load).
    bad = _nonfinite_models(accelerator, models)
    if bad:
        raise RunError(f"{ckpt}: non-finite weights in {', '.join(bad)} after loading it (a save never writes "
                       f"them: the checkpoint was damaged or crafted before it was sealed): move {ckpt.name} out of "
                       f"{ckpt.parent} to resume from the checkpoint before it")
    if json_layout:
        restored = saved  # the position and the schedules as JSON
        run_state = _run_state(accelerator)  # registered now: the next save writes it
    else:
        restored = {**run_state.loaded["train_state"], "schedulers": run_state.loaded["schedulers"]}
        run_state.loaded = None
    run_state.state, run_state.schedulers = state, schedulers
    for name, sd in restored.pop("schedulers").items():
        schedulers[name].load_state_dict(sd)
    changes = restored.pop("data_changes", [])
    state.data_changes = changes + ([{"step": restored["step"], "was": was_data, "now": state.data}]
                                    if data_changed else [])
    was_threads = restored.pop("threads_per_process", 0)
    if was_threads and was_threads != state.threads_per_process and accelerator.is_main_process:
        logger.warning(f"checkpoint trained with {was_threads} thread(s) per process, now {state.threads_per_process} "
                       f"(--num_threads): the result will not be bit-identical to an uninterrupted run "
                       f"(on CPU, float sums are split by thread); --num_threads 0 keeps the checkpoint's")
    for key in ("config", "config_hash", "resume_safe", "config_defaults", "world_size", "gradient_accumulation_steps", "data",
                "models", "optimizers", "registered"):
        restored.pop(key, None)  # this launch's: resume-safe keys (max_steps, ...), its own topology and data
        # summary (the same, or a change allowed above), the names checked above
    state.load_state_dict(restored)  # launches: those that made the checkpoint (none if it predates them)
    state.launches = [*state.launches, this_launch(state.step, accelerator.num_processes)]
    state.stage = "boundary"
    if accelerator.is_main_process:
        logger.info(f"resumed from {ckpt}: step {state.step}, epoch {state.epoch}, "
                    f"batch {state.batches_in_epoch} of the epoch")
    return ckpt


@contextlib.contextmanager
def _weights_only_loads(accelerator):
    """Every `torch.load` inside reads weights only, also accelerate's `load_custom_state`, which asks
    for `weights_only=False` (torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD, read at each call): even a file
    swapped after `choose_checkpoint` checked it cannot run code. Under FSDP this covers
    torch.distributed.checkpoint's non-tensor items too (plain data, read with `weights_only=False`
    by its DefaultLoadPlanner: they load forced, tests/guarantees/test_fsdp.py resumes exactly). Not
    under DeepSpeed, whose engine loads its own `.pt` files with `weights_only=False` (see the module
    docstring; deepspeed is not installed here, so that path is untested with these changes)."""
    if accelerator.distributed_type.value == "DEEPSPEED":
        yield
        return
    saved = {k: os.environ.pop(k, None) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
