"""An exponential moving average of a model's weights (a recipe's `--ema_decay`): what validation
scores, what `final/` exports and what a tool reads from a checkpoint, while the optimizer goes on
training the raw weights.

Why: on a few minutes to hours of audio the weights of the last few hundred updates scatter around a
better point than any one of them (ESPnet and SpeechBrain average their last checkpoints, icefall
keeps a running average); the average follows that point as training goes. The decay warms up:
after n updates it is min(ema_decay, (1 + n) / (10 + n)), so the average spans about n / 9 updates
(the first updates' weights are soon forgotten) and at most about 1 / (1 - ema_decay).

    average = start_average(accelerator, model, cfg.ema_decay)   # before resume_from_checkpoint; None at 0
    ...after each optimizer step:  average.update(accelerator.unwrap_model(model))
    with swapped_in(average, model): evaluate / export_final

It is registered for checkpointing (an accelerate custom object: rank 0's state, which is every
rank's under DDP, where all ranks hold the same parameters), so a resumed run continues the same
average bit for bit. Parameters only: buffers (feature statistics) stay the model's own. Under FSDP or
DeepSpeed a rank holds a shard of the parameters: recipes refuse `--ema_decay` there.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

NAME = "WeightAverage"  # the class name a checkpoint's train_state.json lists under "registered"


class WeightAverage:
    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay {decay}: must be in (0, 1)")
        self.decay = decay
        self.updates = 0
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """After an optimizer step: shadow ← shadow + (1 − decay) · (parameter − shadow)."""
        self.updates += 1
        weight = 1.0 - self.current_decay()
        names = list(self.shadow)
        params = dict(model.named_parameters())
        torch._foreach_lerp_([self.shadow[n] for n in names], [params[n].detach() for n in names], weight)

    def state_dict(self) -> dict:  # plain data: loaded back with torch.load(weights_only=True)
        return {"decay": self.decay, "updates": self.updates,
                "shadow": {name: t.detach().cpu().clone() for name, t in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        if set(state["shadow"]) != set(self.shadow):
            raise ValueError("the checkpoint's weight average is of another model (other parameter names)")
        self.decay, self.updates = float(state["decay"]), int(state["updates"])
        for name, t in state["shadow"].items():
            self.shadow[name].copy_(t)


def start_average(accelerator, model: torch.nn.Module, decay: float) -> WeightAverage | None:
    """A recipe's `--ema_decay`: None at 0, else the average of the prepared `model`'s weights,
    registered for checkpointing (call it before resume_from_checkpoint, which then restores it).
    Refused (RunError, one line with the fix) where a process holds a shard of each parameter."""
    if not decay:
        return None
    kind = accelerator.distributed_type.value
    if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        from common.training.faults import RunError

        raise RunError(f"--ema_decay averages whole parameters, and under {kind} each process holds a shard of "
                       f"them: train with DDP or one process, or set --ema_decay 0")
    average = WeightAverage(accelerator.unwrap_model(model), decay)
    accelerator.register_for_checkpointing(average)
    return average


@contextlib.contextmanager
def swapped_in(average: WeightAverage | None, model: torch.nn.Module):
    """The averaged parameters in `model` (DDP-wrapped or not) for the `with` block, the trained ones
    restored exactly after it. With no average (None): the model as it is."""
    if average is None:
        yield
        return
    params = dict(getattr(model, "module", model).named_parameters())
    trained = {name: p.detach().clone() for name, p in params.items()}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(average.shadow[name])
    try:
        yield
    finally:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(trained[name])


def averaged_parameters(folder: str | Path) -> dict[str, torch.Tensor] | None:
    """The averaged parameters a checkpoint folder holds (its registered `WeightAverage`), or None
    (an export, or a run without `--ema_decay`). Loaded with weights only: no code from the folder."""
    folder = Path(folder)
    try:
        names = json.loads((folder / "train_state.json").read_text()).get("registered") or []
    except (OSError, ValueError):
        return None
    if NAME not in names:
        return None
    state = torch.load(folder / f"custom_checkpoint_{names.index(NAME)}.pkl", map_location="cpu", weights_only=True)
    return state["shadow"]


def checkpoint_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's or export's `model.safetensors`, with a checkpoint's averaged parameters in
    place of the trained ones when its run kept an average: the model a tool should use."""
    from safetensors.torch import load_file

    weights = load_file(Path(folder) / "model.safetensors")
    averaged = averaged_parameters(folder)
    if averaged is not None:
        unknown = sorted(set(averaged) - set(weights))
        if unknown:
            raise ValueError(f"{folder}: its weight average names parameters its model.safetensors lacks ({unknown[0]})")
        weights.update(averaged)
    return weights
