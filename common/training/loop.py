"""The training-loop mechanics that carry the exact-resume promise.

A recipe's loop stays visible in its `train.py` and reads like this (one model):

    resume_from_checkpoint(accelerator, ckpt, state, models=model, optimizers=optimizer,
                           schedulers=scheduler)                     # before the loop, once
    for batch, micro in train_batches(accelerator, train_loader, state, ...):   # resumes mid-epoch
        with no_sync_unless(accelerator, model, micro.sync):
            loss = model(...)
            accelerator.backward(loss / micro.window_len)
        if not micro.sync:
            continue
        grad_norm = optimizer_update(accelerator, model, optimizer, state, ...)
        end_step(state, scheduler)
        ... evaluate (when validation_due) / log: the recipe's own business ...
        save_or_preempt(accelerator, output_dir, state, preemption, models=model, ...)

Several models (a GAN) take the same calls: `no_sync_unless(accelerator, (generator, discriminator),
micro.sync)`, one `optimizer_update` per optimizer that updates in this step (a discriminator-only
step updates one), one `end_step(state, *schedules)`, and the `models=`/`optimizers=`/`schedulers=`
of checkpoints as {name: object} dicts.

What each function guarantees, and why (docs/resume.md has the full story):
- `train_batches`: every object with an epoch is told the epoch (accelerate does not reach a custom
  batch sampler in DDP, and its own epoch counter is not checkpointed); a resumed epoch skips its
  consumed batches without loading them; the global RNG (dropout) is reseeded from the position
  before each micro-batch, so nothing random is lost on a kill; accumulation windows are explicit,
  the epoch's last one may be short; the position in `state` is always the one a checkpoint taken
  at the next step boundary must record.
- `optimizer_update`: one optimizer's update: clipping of its model's gradients, the non-finite
  skip (identical on every rank: gradients were all-reduced first; under FSDP the sharded norm is
  gathered whole first), the update, zeroed gradients. Under DeepSpeed (ZeRO-2) the engine itself
  clips and steps at the window's end, inside `backward`: `no_sync_unless` tells it where windows
  end, `optimizer_update` reads its norm and skip verdict and keeps the same counts.
- `end_step`: the step counter and the schedules, once per window (never a prepared scheduler: it
  would step num_processes times, accelerate #1382).
- `save_or_preempt`: checkpoints only at step boundaries; a preemption signal on any rank makes
  every rank save the same step and exit 75.
- early stopping (common/training/early_stopping.py: a stopper the recipe registered): `train_batches`
  ends the loop and `save_or_preempt` saves at the step where its patience ran out.

Contracts check themselves: each helper knows its predecessor through `state.stage` (see
`TrainState`) and raises `ContractError`, saying what was out of order, when a loop bypasses one
(an update inside a window, a window without `end_step`, a loop on a state never resumed, a sampler
not sized to the global batch, a save inside a window).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import torch
from accelerate import skip_first_batches

from common.training.checkpoint import save_checkpoint
from common.training.state import ContractError, TrainState
from common.training.distributed import derive_seed
from common.training.early_stopping import registered_stopper
from common.training.faults import PREEMPTED_EXIT_CODE, NonFiniteError, RunError
from common.training.logs import batch_ids, get_logger

logger = get_logger(__name__)  # main process only


class MicroBatch(NamedTuple):
    window_len: int  # micro-batches in this accumulation window (the epoch's last one may be short)
    sync: bool  # the last micro-batch of its window: gradients are all-reduced, the optimizer steps


def accumulation_window(i: int, n_batches: int, accumulation: int) -> MicroBatch:
    """Where micro-batch `i` (0-based, of `n_batches` in the epoch) falls in its window.

    Windows are [0, A), [A, 2A), ... inside each epoch; the last one holds what is left."""
    start = i - i % accumulation
    return MicroBatch(window_len=min(accumulation, n_batches - start),
                      sync=(i + 1) % accumulation == 0 or i + 1 == n_batches)


def train_batches(accelerator, loader, state: TrainState, *, max_steps: int, accumulation: int, seed: int,
                  epoch_objects=(), ids_log: Path | None = None) -> Iterator[tuple[dict, MicroBatch]]:
    """Yield (batch, MicroBatch) from `state`'s position until `state.step` reaches `max_steps`.

    `loader` is the prepared training DataLoader; `epoch_objects` are the other objects with a
    `set_epoch(epoch)` (the batch sampler, a collator or dataset drawing per-epoch randomness).
    `state.batches_in_epoch` counts the global micro-batches consumed (all ranks; always a multiple
    of the global batch at a checkpoint, so a resume may use another number of processes);
    `ids_log` (optional) receives one JSON line per micro-batch with its utterance ids. Every batch must
    be a dict with its utterance ids under "ids" (`common.training.logs.batch_ids`).
    Raises `RunError` at the end when no update of the run was applied (every one non-finite).
    Early stopping (a stopper registered with the Accelerator: common/training/early_stopping.py) ends
    the loop at the step where its patience ran out, and a re-launch of a run that stopped trains no step.

    Checks its contract: `state` was resumed (`resume_from_checkpoint`), `world × accumulation` is
    the state's global batch, a sampler among `epoch_objects` makes its batch count a multiple of it,
    and every window ends with `end_step`.
    """
    rank, world = accelerator.process_index, accelerator.num_processes
    _check_start(state, world, accumulation, (_batch_sampler(loader), *epoch_objects))
    if state.step > max_steps:  # the export would carry these weights under the lower count
        raise RunError(f"--max_steps {max_steps} is below this run's step {state.step} (its newest checkpoint): "
                       f"re-launch with --max_steps {state.step} or more (earlier weights are only in the "
                       f"checkpoints/step_* folders the run kept)")
    finished = _end_rule(accelerator, state, max_steps)
    ids_file = open(ids_log, "a") if ids_log else None
    try:
        while not finished():
            epoch, n_batches, done, batches = _start_epoch(loader, epoch_objects, state, world)
            for i, batch in enumerate(batches, start=done):
                micro = accumulation_window(i, n_batches, accumulation)
                # Rank r's i-th batch is the global batch i·world + r (accelerate deals batches round-
                # robin): dropout draws from that position alone, never from what ran before.
                torch.manual_seed(derive_seed(seed, "train", epoch, i * world + rank))
                ids = batch_ids(batch)  # the batch contract: a dict with "ids" (else a ContractError, here)
                if ids_file:
                    ids_file.write(json.dumps({"epoch": epoch, "batch": i, "global_batch": i * world + rank,
                                               "step": state.step + 1, "ids": ids}) + "\n")
                    ids_file.flush()
                # The position a checkpoint taken after this micro-batch's optimizer step must hold.
                state.batches_in_epoch = (i + 1) * world
                if i + 1 == n_batches:
                    state.epoch, state.batches_in_epoch = epoch + 1, 0
                state.stage = "window_end" if micro.sync else "window"
                state.updated = ()
                yield batch, micro
                if micro.sync and state.stage != "boundary":
                    raise ContractError(f"the window ending at micro-batch {i} of epoch {epoch} was not closed: "
                                        f"call end_step(state, *schedulers) after its optimizer updates")
                if micro.sync and finished():
                    break
        if state.skipped_updates and not state.applied_updates:
            # Shorter than max_nonfinite_updates, such a run would end "done" with its initial weights.
            raise RunError(f"all {state.step} optimizer updates were skipped (non-finite gradients: the loss was "
                           f"NaN or Inf at every step), so the weights are the initial ones; stopping before the "
                           f"export. Look for a NaN or extreme setting (--learning_rate, --noise_std, ...) or "
                           f"non-finite audio (--data_check full finds it)")
    finally:
        if ids_file:
            ids_file.close()


def _end_rule(accelerator, state: TrainState, max_steps: int):
    """A function saying whether the run has ended: `max_steps` reached, or a registered stopper
    (common/training/early_stopping.py) ran out of patience; a re-launch of a stopped run says so."""
    stopper = registered_stopper(accelerator)
    if stopper is not None and stopper.stopped:
        logger.info(f"this run stopped early at step {state.step} ({stopper.reason()}): no step to train")
    return lambda: state.step >= max_steps or (stopper is not None and stopper.stopped)


def _start_epoch(loader, epoch_objects, state: TrainState, world: int) -> tuple[int, int, int, Iterable]:
    """(epoch, this rank's batches in it, how many of them were consumed before, the loader from
    there) at `state`'s position, every object with a `set_epoch` set to the epoch."""
    for obj in (loader, *epoch_objects):
        obj.set_epoch(state.epoch)
    n_batches = len(loader)  # this rank's batches; equal on every rank
    done = state.batches_in_epoch // world  # this rank's consumed batches
    # A resumed epoch drops its consumed batches' index lists: no audio is loaded for them. A
    # stream (common.data.stream.StreamLoader) starts at the position itself, reading no consumed row.
    if done and hasattr(loader, "resume_at"):
        loader.resume_at(done)
    resumed = skip_first_batches(loader, done) if done and not hasattr(loader, "resume_at") else loader
    return state.epoch, n_batches, done, resumed


def _batch_sampler(loader):
    """The loader's own batch sampler (in DDP accelerate wraps it in a `BatchSamplerShard`)."""
    sampler = getattr(loader, "batch_sampler", None)
    return getattr(sampler, "batch_sampler", sampler)


def _check_start(state: TrainState, world: int, accumulation: int, samplers) -> None:
    if state.stage != "boundary":
        raise ContractError(f"train_batches: the TrainState is at stage {state.stage!r}, not at a step boundary: "
                            f"call resume_from_checkpoint(accelerator, ckpt, state, ...) once before the loop "
                            f"(ckpt from choose_checkpoint; None starts fresh)")
    if world * accumulation != state.global_batch:
        raise ContractError(f"train_batches: {world} process(es) × accumulation {accumulation} != the state's global "
                            f"batch {state.global_batch}: pass the accumulation global_batch_plan returned")
    for obj in samplers:
        multiple_of = getattr(obj, "multiple_of", None)
        if multiple_of is not None and multiple_of != state.global_batch:
            raise ContractError(f"train_batches: the training sampler makes its batch count a multiple of "
                                f"{multiple_of}, not of the global batch {state.global_batch}: build it with "
                                f"multiple_of=global batch (from global_batch_plan), or windows would be short")


def global_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor with the same value on every rank.

    Under FSDP2 gradients are sharded DTensors and the norm torch's clip_grad_norm_ returns is a
    DTensor too (measured with torch 2.14: placement Replicate, the same value on every rank: the
    shard norms were already combined). `full_tensor()` makes it a plain tensor for `isfinite`,
    `bool()`, `.item()` and logging; it costs nothing when Replicate, and would be the all-reduce a
    Partial placement needs (every rank calls it). Plain tensors (DDP, 1 process) pass unchanged."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def is_deepspeed(accelerator) -> bool:
    return accelerator.distributed_type.value == "DEEPSPEED"


def no_sync_unless(accelerator, models, sync: bool):
    """DDP all-reduces gradients only on a window's last backward pass. `models`: one model or a
    tuple of them (every model whose backward runs in the block).

    DeepSpeed: `accelerator.backward` runs `engine.backward` and, when accelerate's `sync_gradients`
    is set, `engine.step()` too (clip, update, zero the gradients). Accelerate sets it only inside
    its own `accumulate()` (a fixed count, no short last window), so here the window's end is told
    to it directly; ZeRO-2 reduce-scatters gradients on every backward (no no_sync to skip)."""
    if is_deepspeed(accelerator):
        return _deepspeed_boundary(accelerator, sync)
    if sync:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for model in models if isinstance(models, (tuple, list)) else (models,):
        stack.enter_context(accelerator.no_sync(model))
    return stack


@contextlib.contextmanager
def _deepspeed_boundary(accelerator, sync: bool):
    accelerator.gradient_state._set_sync_gradients(sync)
    try:
        yield
    finally:
        accelerator.gradient_state._set_sync_gradients(True)  # accelerate's default outside accumulate()


def optimizer_update(accelerator, model, optimizer, state: TrainState, *, max_grad_norm: float,
                     max_nonfinite_updates: int) -> torch.Tensor:
    """Clip `model`'s gradients, update `optimizer` (or skip a non-finite update), zero its
    gradients; returns the gradient norm. Only at a window's end (`micro.sync`), once per optimizer.

    Gradients were all-reduced (DDP) or reduce-scattered (FSDP: the norm is made whole on every
    rank first), so every rank sees the same norm and takes the same branch. A skipped update still
    ends its step (`end_step`: the schedule and the position move on); `max_nonfinite_updates`
    steps in a row with a skipped update stop the run. Collective under FSDP.

    DeepSpeed: the engine already stepped inside the window's last `backward` (see `no_sync_unless`);
    here its outcome is read and counted the same way (`_deepspeed_outcome`)."""
    if state.stage != "window_end":
        where = {"window": "inside an accumulation window (micro.sync is False): `if not micro.sync: continue` first",
                 "boundary": "after end_step: update before ending the step"}.get(state.stage, "outside the loop")
        raise ContractError(f"optimizer_update at step {state.step + 1}: {where}")
    if any(o is optimizer for o in state.updated):
        raise ContractError(f"optimizer_update at step {state.step + 1}: this optimizer was already updated in this window")
    state.updated = (*state.updated, optimizer)
    if is_deepspeed(accelerator):
        grad_norm = _deepspeed_outcome(model, optimizer, max_grad_norm)
    else:
        grad_norm = global_tensor(accelerator.clip_grad_norm_(model.parameters(), max_grad_norm))
    if torch.isfinite(grad_norm):
        optimizer.step()  # DeepSpeed: a no-op (accelerate's wrapper; the engine has stepped)
        state.applied_updates += 1
    else:
        state.skipped_updates += 1
        if not state.skipped_in_step:  # a step counts once in the streak, whatever its optimizers
            state.skipped_in_step = True
            state.nonfinite_streak += 1
        logger.warning(f"step {state.step + 1}: non-finite gradient norm, update skipped "
                       f"({state.nonfinite_streak} in a row, {state.skipped_updates} in total)")
        if state.nonfinite_streak >= max_nonfinite_updates:
            raise NonFiniteError(f"{state.nonfinite_streak} consecutive non-finite updates; "
                                     f"stopping (last good checkpoint kept). Lower --learning_rate?")
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def end_step(state: TrainState, *schedulers) -> None:
    """End the optimizer step of this window: count it, step each of `schedulers` once. Once per
    window, after its `optimizer_update`s (none is fine: a step may update nothing)."""
    if state.stage != "window_end":
        where = {"window": "inside an accumulation window (micro.sync is False)",
                 "boundary": "twice for one window"}.get(state.stage, "outside the loop")
        raise ContractError(f"end_step at step {state.step + 1}: {where}; call it once, at a window's end")
    with warnings.catch_warnings():
        # A skipped (non-finite) first update still advances the schedule, so that the LR stays a
        # function of the step: torch's "lr_scheduler.step() before optimizer.step()" warning is
        # then by design (the order itself is enforced above: ContractError).
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        for scheduler in schedulers:
            scheduler.step()
    if not state.skipped_in_step:
        state.nonfinite_streak = 0
    state.skipped_in_step = False
    state.step += 1
    state.stage = "boundary"


def _deepspeed_outcome(engine, optimizer, max_grad_norm: float) -> torch.Tensor:
    """The gradient norm of the update DeepSpeed has just made (or skipped), as a tensor.

    The engine clipped with its config's `gradient_clipping` and scaled the loss by its own
    `gradient_accumulation_steps`: the recipe's --max_grad_norm and its windows (the loss is already
    divided by the window length) hold only if those are equal to it and 1; otherwise stop, before
    the first checkpoint. The norm and the skip verdict are global (all-reduced by ZeRO), so every
    rank agrees. DeepSpeed (0.19: fp32 always, bf16 with its default `check_grad_overflow`) skips a
    non-finite update itself and reports the norm as inf: counted here as a skipped update. One it
    applied anyway (bf16 with `check_grad_overflow: false`, older versions) cannot be undone: stop."""
    if engine.gradient_accumulation_steps() != 1 or engine.gradient_clipping() != max_grad_norm:
        raise RunError(f"the DeepSpeed profile has gradient_accumulation_steps {engine.gradient_accumulation_steps()} "
                       f"and gradient_clipping {engine.gradient_clipping()}; these recipes need 1 (the loop "
                       f"accumulates: --gradient_accumulation_steps) and --max_grad_norm ({max_grad_norm:g}): "
                       f"set them in the profile's deepspeed_config (or `accelerate launch --gradient_clipping "
                       f"{max_grad_norm:g} --gradient_accumulation_steps 1`)")
    norm = engine.get_global_grad_norm()
    if norm is None:  # ZeRO-1/2 without norm computation: the guard would be blind
        raise RunError("DeepSpeed computed no gradient norm (this profile's ZeRO settings); the non-finite "
                       "guard needs it: use accelerate_configs/deepspeed_zero2.yaml as shipped")
    grad_norm = torch.as_tensor(norm, dtype=torch.float32).detach().cpu()
    if not torch.isfinite(grad_norm) and not optimizer.step_was_skipped:
        raise NonFiniteError("DeepSpeed applied an update with a non-finite gradient norm (the weights "
                                 "are no longer finite); stopping (last good checkpoint kept). Enable "
                                 "bf16.check_grad_overflow in the DeepSpeed config, or lower --learning_rate")
    return grad_norm


def validation_due(state: TrainState, eval_steps: int, max_steps: int) -> bool:
    """Validate after this step: every `eval_steps` (0 = never) and at `max_steps` too, so a run whose
    length is not a multiple of `eval_steps` (one shorter than it) still ends with a validation.

    Validation changes nothing a resume must reproduce: the loop reseeds the global RNG from the
    position before every training micro-batch (`train_batches`), and the model is back in train
    mode after it; this is also why --eval_steps may change on resume (ResumeSafe)."""
    return bool(eval_steps) and (state.step % eval_steps == 0 or state.step == max_steps)


def save_or_preempt(accelerator, output_dir: str | Path, state: TrainState, preemption, *, models, optimizers,
                    schedulers, save_steps: int, max_steps: int, save_total_limit: int | None) -> None:
    """Save every `save_steps`, at `max_steps`, at the step where early stopping ended the run (its
    stopper registered: common/training/early_stopping.py; a re-launch then knows the run ended), and
    when any rank was signalled (then exit 75).
    `models`, `optimizers`, `schedulers`: as for `common.training.checkpoint.save_checkpoint`.

    Collective: call on every rank after each `end_step`."""
    stop = preemption.requested()  # all ranks agree on the same step
    stopper = registered_stopper(accelerator)  # it decided on rank 0's metric: the same on every rank
    if stop or state.step % save_steps == 0 or state.step == max_steps or (stopper is not None and stopper.stopped):
        save_checkpoint(accelerator, output_dir, state, models=models, optimizers=optimizers, schedulers=schedulers,
                        save_total_limit=save_total_limit)
    if stop:
        logger.warning(f"preempted at step {state.step}: checkpoint saved; re-run the same command to "
                       f"resume (exit code {PREEMPTED_EXIT_CODE})")
        accelerator.end_training()
        sys.exit(PREEMPTED_EXIT_CODE)


def lr_schedule(warmup_steps: int, kind: str = "inverse_sqrt"):
    """LR multiplier: linear warm-up to 1, then 1/sqrt decay (kind "inverse_sqrt", the
    Transformer/Conformer schedule) or 1 from then on ("constant_with_warmup").

    Neither depends on max_steps, so extending a run on resume changes nothing before it."""
    if kind not in ("inverse_sqrt", "constant_with_warmup"):
        raise ValueError(f"unknown LR schedule {kind!r}")

    def f(step: int) -> float:
        step = max(step, 1)
        if step < warmup_steps or kind == "constant_with_warmup":
            return min(step / warmup_steps, 1.0)
        return math.sqrt(warmup_steps / step)
    return f


def decay_groups(module: torch.nn.Module, weight_decay: float, **options) -> list[dict]:
    """Two optimizer parameter groups of `module`: matrices with `weight_decay`, biases and norm gains
    (fewer than 2 dimensions) without; `options` (e.g. lr) go into both."""
    params = list(module.parameters())
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, **options},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, **options}]



def adamw_scheduled(cfg, groups) -> tuple[dict, dict]:
    """({"model": AdamW over `groups`}, {"model": its `lr_schedule`}): a one-model recipe's
    `build_optimizers`, from the shared Config fields learning_rate, adam_beta1, adam_beta2,
    warmup_steps and lr_scheduler_type (the groups carry their weight decay: `decay_groups`)."""
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2))
    schedule = lr_schedule(cfg.warmup_steps, cfg.lr_scheduler_type)
    return {"model": optimizer}, {"model": torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)}
