"""Early stopping: a run ends when validation stops improving, and `final/` holds its best validation's weights.

The field's convention (transformers' `EarlyStoppingCallback` with `load_best_model_at_end`), with its
names (the shared Config fields, common/config.py RunConfig):
- after each validation (every --eval_steps and at --max_steps: `validation_due`), the value of
  --metric_for_best_model is compared with the best so far: an improvement is a value better than the
  best (higher with --greater_is_better, lower without; by default lower for a name ending in
  "loss" or "er": eval_loss, eval_cer, eval_wer) by more than --early_stopping_threshold (absolute);
- --early_stopping_patience validations in a row without one end the run at that step (0 = never);
- with early stopping on, `final/` holds the weights the best validation scored (the weight average,
  where the run keeps one: they are what validation scores), whether the run stopped or reached
  --max_steps; the model card says at which step the run ended, why, and which step's weights it holds.

Kept where the best weights are: a CPU copy on every process (all hold the same weights under DDP),
taken at each improvement, and in every checkpoint (the stopper is registered for checkpointing: its
state_dict is plain data, weights included), so a killed and re-launched run stops at the same step
with the same weights. Under FSDP or DeepSpeed a process holds a shard of the weights: refused there.

    stopper = start_early_stopping(accelerator, cfg, run.ckpt, {"model": model}, data.summary.get("hours"))  # before resume
    ...after a validation, with the validated weights in the model (inside `swapped_in(average, model)`):
        stopper.after_validation(state, row)  # collective
    with swapped_in(average, model), stopper.kept_weights():  # final/ holds the best validation's weights
        export_final(...)

`train_batches` ends the loop and `save_or_preempt` saves at the step where the patience ran out; they
find the stopper registered with the Accelerator (`registered_stopper`), so nothing else is passed. A
re-launch of a run that stopped trains no step and exports again.

Resume: --early_stopping_patience and --early_stopping_threshold may change (ResumeSafe), as
--max_steps may: the same command stops at the same step, and a larger patience continues a run that
stopped, as a larger --max_steps continues one that ended. The metric and its direction may not
(the best value would be another metric's). Early stopping on (patience > 0) and off registers a
different set of checkpointed objects: a run started with one is resumed with the same (refused in
one line otherwise). Off, nothing is registered and nothing changes: the checkpoints of a run without
early stopping are those of before.

`--early_stopping_patience` None (a recipe's "auto") is the recipe's `AUTO_EARLY_STOPPING_PATIENCE`
on training data of your own under builtin_base.AUTO_MAX_HOURS (a voice), else 0: the runs on the
built-in corpus (the bases of the voices), on larger corpora and streams, and under FSDP or DeepSpeed
run their --max_steps as before.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from common.training.builtin_base import AUTO_MAX_HOURS
from common.training.contract import ContractError
from common.training.faults import RunError
from common.training.logs import get_logger

logger = get_logger(__name__)  # main process only

NAME = "EarlyStopping"  # the class name a checkpoint's train_state.json lists under "registered"
SHARDED = ("FSDP", "DEEPSPEED", "MEGATRON_LM")  # distributed types where a process holds a shard of the weights


def lower_is_better(metric: str) -> bool:
    """transformers' default for `greater_is_better` (a loss is lower-is-better), and error rates too."""
    return metric.endswith("loss") or metric.endswith("er")


class EarlyStopping:
    """The stopper's state: the best value of `metric` so far and the step that gave it, the
    validations since without an improvement (`bad_rounds`), the step of the last validation, and
    a copy of `models`' weights (state_dict, on the CPU) as that validation scored them. Off
    (`patience` 0) it does nothing and is not registered."""

    def __init__(self, accelerator, models: dict[str, torch.nn.Module], metric: str, greater_is_better: bool,
                 patience: int, threshold: float):
        self.accelerator = accelerator
        self.models, self.metric, self.greater_is_better = models, metric, greater_is_better
        self.patience, self.threshold = patience, threshold
        self.best: float | None = None  # None: no validation yet (or none gave a finite value)
        self.best_step = 0
        self.bad_rounds = 0
        self.last_step = 0
        self.weights: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def stopped(self) -> bool:
        """The patience ran out (the same on every rank: the metric is rank 0's, `after_validation`)."""
        return self.patience > 0 and self.bad_rounds >= self.patience

    def improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False  # a NaN or Inf validation never becomes the best
        if self.best is None:
            return True
        better = value > self.best if self.greater_is_better else value < self.best
        return better and abs(value - self.best) > self.threshold

    def after_validation(self, state, row: dict) -> None:
        """Count the validation `row` of step `state.step`; at an improvement, copy the models' weights
        (call it where they are the validated ones). Collective: call on every rank."""
        if not self.patience:
            return
        if self.metric not in row:
            raise RunError(f"--metric_for_best_model {self.metric}: this recipe's validation reports "
                           f"{', '.join(sorted(row))}: name one of them")
        if state.stage != "boundary" or state.step <= self.last_step:
            raise ContractError(f"after_validation at step {state.step}: call it once per validation, after "
                                f"end_step (last validation counted: step {self.last_step})")
        value = float(row[self.metric])
        if self.accelerator.num_processes > 1:  # every rank decides on rank 0's value: they stop at the same step
            from accelerate.utils import broadcast

            value = broadcast(torch.tensor([value], dtype=torch.float64, device=self.accelerator.device)).item()
        self.last_step = state.step
        if self.improves(value):
            self.best, self.best_step, self.bad_rounds = value, state.step, 0
            self.weights = {name: {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()}
                            for name, model in self.models.items()}
        else:
            self.bad_rounds += 1
        if self.stopped:
            logger.info(f"early stopping at step {state.step}: {self.reason()}; saving this step, then exporting "
                        f"the weights of step {self.best_step}" if self.best is not None else
                        f"early stopping at step {state.step}: {self.reason()}")

    def reason(self) -> str:
        best = f"best {self.best:.6g} at step {self.best_step}" if self.best is not None else "none finite"
        return (f"{self.metric} did not improve by more than {self.threshold:g} in {self.bad_rounds} "
                f"validation(s) (patience {self.patience}; {best})")

    @contextlib.contextmanager
    def kept_weights(self):
        """The best validation's weights in the models for the block (the export), the current ones
        restored after it. Off, or before any finite validation: the models as they are."""
        if not self.patience or not self.weights:
            yield
            return
        current = {name: {k: t.detach().clone() for k, t in m.state_dict().items()} for name, m in self.models.items()}
        with torch.no_grad():
            for name, model in self.models.items():
                model.load_state_dict(self.weights[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, model in self.models.items():
                    model.load_state_dict(current[name])

    def card_line(self, step: int) -> str | None:
        """How the run ended and which weights final/ holds, for the model card (None when off)."""
        if not self.patience:
            return None
        ended = (f"stopped early at step {step}: {self.reason()}" if self.stopped else
                 f"ran to step {step} with early stopping on ({self.reason()})")
        held = ("no validation gave a finite value, so this folder holds the last step's weights"
                if self.best is None else f"this folder holds the weights validated at step {self.best_step}, "
                f"the best {self.metric} ({self.best:.6g})")
        return f"{ended}; {held}"

    def state_dict(self) -> dict[str, Any]:  # plain data: read back with torch.load(weights_only=True)
        return {"metric": self.metric, "greater_is_better": self.greater_is_better, "best": self.best,
                "best_step": self.best_step, "bad_rounds": self.bad_rounds, "last_step": self.last_step,
                "weights": self.weights}

    def state_problem(self, held: Any) -> str | None:
        """What resume_from_checkpoint asks before load_state (`state_problem` below): a malformed state
        is refused in one line with the weights not yet loaded."""
        return state_problem(held)

    def load_state_dict(self, held: dict[str, Any]) -> None:
        problem = state_problem(held)  # resume_from_checkpoint refused such a state already: the file changed since
        if problem is None and (held["metric"], held["greater_is_better"]) != (self.metric, self.greater_is_better):
            problem = (f"it is of {held['metric']} ({'higher' if held['greater_is_better'] else 'lower'} is better), "
                       f"this run's of {self.metric}")
        if problem is None and held["weights"] and set(held["weights"]) != set(self.models):
            problem = f"it keeps the weights of {sorted(held['weights'])}, this run exports {sorted(self.models)}"
        if problem:
            raise RunError(f"the checkpoint's early-stopping state cannot be resumed: {problem}; use a new --output_dir")
        self.best, self.best_step, self.bad_rounds, self.last_step, self.weights = (
            held["best"], held["best_step"], held["bad_rounds"], held["last_step"], held["weights"])


def _count(x) -> bool:
    return type(x) is int and x >= 0


def state_problem(held: Any) -> str | None:
    """None if `held` is an `EarlyStopping.state_dict()` as a save writes it, else what is wrong."""
    keys = {"metric", "greater_is_better", "best", "best_step", "bad_rounds", "last_step", "weights"}
    if not isinstance(held, dict) or set(held) != keys:
        return f"holds {sorted(held) if isinstance(held, dict) else type(held).__name__}, not the keys {sorted(keys)}"
    if not isinstance(held["metric"], str) or type(held["greater_is_better"]) is not bool:
        return "holds no metric name and direction"
    if not all(_count(held[k]) for k in ("best_step", "bad_rounds", "last_step")) or held["best_step"] > held["last_step"]:
        return "holds counters that are not whole numbers ≥ 0 with best_step ≤ last_step"
    best, weights = held["best"], held["weights"]
    if best is not None and not (type(best) is float and math.isfinite(best)):
        return f"holds best = {repr(best)[:40]}, not a finite number"
    if not (isinstance(weights, dict) and all(isinstance(w, dict) and all(
            isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in w.items()) for w in weights.values())):
        return "holds weights that are not {model: {name: tensor}}"
    if (best is None) != (not weights):
        return "holds a best value without its weights, or weights without a best value"
    return None


def registered_stopper(accelerator) -> EarlyStopping | None:
    """The EarlyStopping registered with this Accelerator (None: early stopping is off)."""
    return next((obj for obj in getattr(accelerator, "_custom_objects", ()) if isinstance(obj, EarlyStopping)), None)


def resolve_patience(cfg, hours: float | None, sharded: str | None = None) -> tuple[int, str]:
    """(the patience of this run, where it comes from: the flag, or the auto rule and why). `sharded`:
    the distributed type when a process holds a shard of the weights (auto then says 0: no refusal)."""
    if cfg.early_stopping_patience is not None:
        return cfg.early_stopping_patience, f"--early_stopping_patience {cfg.early_stopping_patience}"
    auto = "--early_stopping_patience None (auto)"
    if cfg.data_dir is None and getattr(cfg, "dataset_name", None) is None:
        return 0, f"{auto}: 0 on the built-in corpus"
    if sharded:
        return 0, f"{auto}: 0 under {sharded}, where a process holds a shard of the weights"
    if not cfg.eval_steps:  # asked for no validation: auto stops nothing (a patience given is refused instead)
        return 0, f"{auto}: 0 with --eval_steps 0 (no validation)"
    if hours is None or hours >= AUTO_MAX_HOURS:
        return 0, f"{auto}: 0 on {'a stream' if hours is None else f'{hours:.1f} h'} of training data"
    patience = getattr(cfg, "AUTO_EARLY_STOPPING_PATIENCE", 0)
    return patience, f"{auto}: {patience} on {hours:.2f} h of your own training data, under {AUTO_MAX_HOURS:g} h"


def start_early_stopping(accelerator, cfg, ckpt: Path | None, models: dict[str, torch.nn.Module],
                         hours: float | None = None) -> EarlyStopping:
    """The run's stopper from cfg's metric_for_best_model, greater_is_better, early_stopping_patience and
    early_stopping_threshold, over the prepared `models` that final/ exports ({name: model}); `hours` of
    training data (the auto rule: `resolve_patience`). On (patience > 0) it is registered for
    checkpointing: call it before resume_from_checkpoint, which restores it. Refused in one line where
    it cannot work: no validation (--eval_steps 0), sharded weights, a checkpoint written with early
    stopping the other way (on/off). Every rank."""
    kind = accelerator.distributed_type.value
    patience, why = resolve_patience(cfg, hours, kind if kind in SHARDED else None)
    gib = cfg.greater_is_better if cfg.greater_is_better is not None else not lower_is_better(cfg.metric_for_best_model)
    stopper = EarlyStopping(accelerator, {name: accelerator.unwrap_model(m) for name, m in models.items()},
                            cfg.metric_for_best_model, gib, patience, cfg.early_stopping_threshold)
    if ckpt is not None:
        registered = json.loads((ckpt / "train_state.json").read_text()).get("registered") or []
        if patience and NAME not in registered:
            raise RunError(f"early stopping is on ({why}) but this run's checkpoint {ckpt.name} "
                           f"was written without it (it kept no best weights): re-launch with --early_stopping_patience "
                           f"0 to finish the run as it started, or use a new --output_dir")
        if not patience and NAME in registered:
            raise RunError(f"early stopping is off ({why}) but this run's checkpoint {ckpt.name} was written with it "
                           f"on: re-launch with an --early_stopping_patience above 0 (the run's own is in "
                           f"{ckpt / 'config.yaml'}), or use a new --output_dir")
    if not patience:
        if cfg.early_stopping_patience is None:  # what auto chose, once
            logger.info(f"early stopping: off ({why})")
        return stopper
    if not cfg.eval_steps:
        raise RunError(f"early stopping ({why}) counts validations, and --eval_steps 0 makes none: set "
                       f"--eval_steps, or --early_stopping_patience 0")
    if kind in SHARDED:
        raise RunError(f"early stopping ({why}) keeps a copy of the best validation's whole "
                       f"weights, and under {kind} each process holds a shard of them: train with DDP or one "
                       f"process, or set --early_stopping_patience 0")
    accelerator.register_for_checkpointing(stopper)
    logger.info(f"early stopping: after {patience} validation(s) without an improvement of {stopper.metric} "
                f"({'higher' if gib else 'lower'} is better, by more than {stopper.threshold:g}) ({why}); "
                f"final/ holds the best validation's weights")
    return stopper
