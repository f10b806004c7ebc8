"""What a checkpoint must hold to be resumed, checked by `common.training.resume.choose_checkpoint` on
each candidate before anything is loaded: every pickle loads without running code, the registered
objects' files are those the checkpoint records, the run's state is at the marker's step and agrees
with train_state.json, every rank's RNG states set the generators, and the weights are finite. Each
check returns None or what is wrong, in words: the checkpoint is then skipped as damaged.

Loading executes no code from the checkpoint folder: weights come from safetensors, the optimizer,
RNG states and registered objects through `torch.load(weights_only=True)`. accelerate's
`load_custom_state` asks for `weights_only=False` (accelerate 1.15, checkpointing.py), so two
guards keep registered objects safe: `choose_checkpoint` loads every pickle of a candidate (every
rank's RNG file, every custom_checkpoint_<i>.pkl, optimizer*.bin, scaler.pt) with weights only and
skips the checkpoint as damaged if one fails (`unloadable_pickle`); and `load_state` runs with
torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD set (`common.training.resume`), so a file swapped after that
check is refused, not run. accelerate matches registered objects' files to objects by position: a
resume whose registered names differ is refused before anything is loaded. A checkpoint written
before the run's state was registered (no `registered` in train_state.json, no custom_checkpoint
files) resumes from its train_state.json, and its next save writes the new layout.
Exception: an FSDP checkpoint's `.metadata` files are read by torch.distributed.checkpoint with a
plain `pickle.load` (torch/distributed/checkpoint/filesystem.py, `FileSystemReader.read_metadata`):
resume FSDP runs only from checkpoints you wrote. The same holds for DeepSpeed checkpoints: its engine
loads its `.pt` files with `torch.load(weights_only=False)` (deepspeed 0.19,
runtime/checkpoint_engine/torch_checkpoint_engine.py), so under DeepSpeed `load_state` runs without
forced weights-only loads (the check before it still covers the registered objects).
"""

from __future__ import annotations

import dataclasses
import json
import random
import zipfile
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import load as accelerate_load

from common.training.checkpoint import load_refusal, model_weights_files
from common.training.sealing import MARKER, read_marker
from common.training.state import NO_DEFAULT, RunState, TrainState

def unloadable_pickle(ckpt: Path) -> str | None:
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
            return f"{path.name} cannot be loaded safely ({load_refusal(e)})"
    return None


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


def run_state_problem(ckpt: Path) -> str | None:
    """None if the checkpoint's `RunState` file (after `unloadable_pickle` passed it) holds a run's
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
    pairs = [(f"the position's {k}", held["train_state"].get(k, NO_DEFAULT), recorded.get(k, NO_DEFAULT))
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


def rng_states_problem(ckpt: Path) -> str | None:
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
        return f"holds RNG states that cannot be set ({load_refusal(e)})"
    step = states.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"holds step = {repr(step)[:60]}, not the accelerator's micro-step count"
    for key, value in states.items():
        if key != "torch_manual_seed" and str(key).endswith("_manual_seed") and not (
                isinstance(value, (list, tuple)) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                                                         for t in value)):
            return f"holds {key} that is no list of device generator states (byte tensors)"
    return None


def nonfinite_weights(ckpt: Path) -> str | None:
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
