"""The run's position and what it was made with (`TrainState`), and the object that carries it and the
schedules through `accelerator.save_state` / `load_state` (`RunState`, registered for checkpointing).

`TrainState.stage` is the loop's contract: each helper checks where the loop stands and raises
`ContractError` (a bug in the recipe, not in its config) when it is called out of order.
`this_launch`: a launch as the model card records it.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any, ClassVar

import torch

from common.training.contract import ContractError  # noqa: F401 (where the loop helpers take it from)


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
        from common.config import config_hash, config_to_dict
        from common.config_rules import resume_safe_keys

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


def run_state_of(accelerator, register: bool = True) -> RunState | None:
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


NO_DEFAULT = object()


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


def this_launch(from_step: int, processes: int) -> dict:
    """This launch as `TrainState.launches` records it: the training command as `accelerate launch`
    received it (its own options are not visible here; the process count stands beside it), the
    script relative to the working directory when it lies inside it, as typed from the checkout."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(Path.cwd()):
        script = script.relative_to(Path.cwd())
    return {"from_step": from_step, "command": "accelerate launch " + shlex.join([str(script), *sys.argv[1:]]),
            "cwd": str(Path.cwd()), "processes": processes}
