"""The training-loop mechanics that carry the exact-resume promise, as four small functions.

A recipe's loop stays visible in its `train.py` and reads like this (about 30 lines):

    for batch, micro in train_batches(accelerator, train_loader, state, ...):   # resumes mid-epoch
        with no_sync_unless(accelerator, model, micro.sync):
            loss = model(...)
            accelerator.backward(loss / micro.window_len)
        if not micro.sync:
            continue
        grad_norm = optimizer_step(accelerator, model, optimizer, scheduler, state, ...)
        ... evaluate / log: the recipe's own business ...
        save_or_preempt(accelerator, model, scheduler, output_dir, state, preemption, ...)

What each function guarantees, and why (docs/resume.md has the full story):
- `train_batches`: every object with an epoch is told the epoch (accelerate does not reach a custom
  batch sampler in DDP, and its own epoch counter is not checkpointed); a resumed epoch skips its
  consumed batches without loading them; the global RNG (dropout) is reseeded from the position
  before each micro-batch, so nothing random is lost on a kill; accumulation windows are explicit,
  the epoch's last one may be short; the position in `state` is always the one a checkpoint taken
  at the next optimizer step must record.
- `optimizer_step`: clipping, the non-finite skip (identical on every rank: gradients were
  all-reduced first; under FSDP the sharded norm is gathered whole first), the schedule stepped once per optimizer step (never a prepared scheduler:
  it would step num_processes times), the step counter. Under DeepSpeed (ZeRO-2) the engine itself
  clips and steps at the window's end, inside `backward`: `no_sync_unless` tells it where windows
  end, `optimizer_step` reads its norm and skip verdict and keeps the same counts.
- `save_or_preempt`: checkpoints only at optimizer-step boundaries; a preemption signal on any rank
  makes every rank save the same step and exit 75.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Iterator, NamedTuple

import torch
from accelerate import skip_first_batches

from common.checkpoint import TrainState, save_checkpoint
from common.distributed import derive_seed
from common.faults import PREEMPTED_EXIT_CODE, RunError
from common.logs import get_logger

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
    `ids_log` (optional) receives one JSON line per micro-batch with its utterance ids.
    Raises `RunError` at the end when no update of the run was applied (every one non-finite).
    """
    rank, world = accelerator.process_index, accelerator.num_processes
    ids_file = open(ids_log, "a") if ids_log else None
    try:
        while state.step < max_steps:
            for obj in (loader, *epoch_objects):
                obj.set_epoch(state.epoch)
            n_batches = len(loader)  # this rank's batches; equal on every rank
            epoch, done = state.epoch, state.batches_in_epoch // world  # this rank's consumed batches
            # A resumed epoch drops its consumed batches' index lists: no audio is loaded for them.
            for i, batch in enumerate(skip_first_batches(loader, done) if done else loader, start=done):
                micro = accumulation_window(i, n_batches, accumulation)
                # Rank r's i-th batch is the global batch i·world + r (accelerate deals batches round-
                # robin): dropout draws from that position alone, never from what ran before.
                torch.manual_seed(derive_seed(seed, "train", epoch, i * world + rank))
                if ids_file:
                    ids_file.write(json.dumps({"epoch": epoch, "batch": i, "global_batch": i * world + rank,
                                               "step": state.step + 1, "ids": batch["ids"]}) + "\n")
                    ids_file.flush()
                # The position a checkpoint taken after this micro-batch's optimizer step must hold.
                state.batches_in_epoch = (i + 1) * world
                if i + 1 == n_batches:
                    state.epoch, state.batches_in_epoch = epoch + 1, 0
                yield batch, micro
                if micro.sync and state.step >= max_steps:
                    break
        if state.step and state.skipped_updates >= state.step:
            # Shorter than max_nonfinite_updates, such a run would end "done" with its initial weights.
            raise RunError(f"all {state.step} optimizer updates were skipped (non-finite gradients: the loss was "
                           f"NaN or Inf at every step), so the weights are the initial ones; stopping before the "
                           f"export. Look for a NaN or extreme setting (--learning_rate, --noise_std, ...) or "
                           f"non-finite audio (--data_check full finds it)")
    finally:
        if ids_file:
            ids_file.close()


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


def no_sync_unless(accelerator, model, sync: bool):
    """DDP all-reduces gradients only on a window's last backward pass.

    DeepSpeed: `accelerator.backward` runs `engine.backward` and, when accelerate's `sync_gradients`
    is set, `engine.step()` too (clip, update, zero the gradients). Accelerate sets it only inside
    its own `accumulate()` (a fixed count, no short last window), so here the window's end is told
    to it directly; ZeRO-2 reduce-scatters gradients on every backward (no no_sync to skip)."""
    if is_deepspeed(accelerator):
        return _deepspeed_boundary(accelerator, sync)
    return contextlib.nullcontext() if sync else accelerator.no_sync(model)


@contextlib.contextmanager
def _deepspeed_boundary(accelerator, sync: bool):
    accelerator.gradient_state._set_sync_gradients(sync)
    try:
        yield
    finally:
        accelerator.gradient_state._set_sync_gradients(True)  # accelerate's default outside accumulate()


def optimizer_step(accelerator, model, optimizer, scheduler, state: TrainState, *, max_grad_norm: float,
                   max_nonfinite_updates: int) -> torch.Tensor:
    """Clip, update (or skip a non-finite update), step the schedule; returns the gradient norm.

    Gradients were all-reduced (DDP) or reduce-scattered (FSDP: the norm is made whole on every
    rank first), so every rank sees the same norm and takes the same branch. A skipped update still
    counts as a step (the schedule and the position move on). Collective under FSDP.

    DeepSpeed: the engine already stepped inside the window's last `backward` (see `no_sync_unless`);
    here its outcome is read and counted the same way (`_deepspeed_outcome`)."""
    if is_deepspeed(accelerator):
        grad_norm = _deepspeed_outcome(model, optimizer, max_grad_norm)
    else:
        grad_norm = global_tensor(accelerator.clip_grad_norm_(model.parameters(), max_grad_norm))
    if torch.isfinite(grad_norm):
        optimizer.step()  # DeepSpeed: a no-op (accelerate's wrapper; the engine has stepped)
        state.nonfinite_streak = 0
    else:
        state.skipped_updates += 1
        state.nonfinite_streak += 1
        logger.warning(f"step {state.step + 1}: non-finite gradient norm, update skipped "
                       f"({state.nonfinite_streak} in a row, {state.skipped_updates} in total)")
        if state.nonfinite_streak >= max_nonfinite_updates:
            raise FloatingPointError(f"{state.nonfinite_streak} consecutive non-finite updates; "
                                     f"stopping (last good checkpoint kept). Lower --learning_rate?")
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    state.step += 1
    return grad_norm


def _deepspeed_outcome(engine, optimizer, max_grad_norm: float) -> torch.Tensor:
    """The gradient norm of the update DeepSpeed has just made (or skipped), as a tensor.

    The engine clipped with its config's `gradient_clipping` and scaled the loss by its own
    `gradient_accumulation_steps`: the recipe's --max_grad_norm and its windows (the loss is already
    divided by the window length) hold only if those are equal to it and 1; otherwise stop, before
    the first checkpoint. The norm and the skip verdict are global (all-reduced by ZeRO), so every
    rank agrees. DeepSpeed (0.19: fp32 always, bf16 with its default `check_grad_overflow`) skips a
    non-finite update itself and reports the norm as inf: counted here as a skipped update. One it
    applied anyway (bf16 with `check_grad_overflow: false`, older versions) cannot be undone: stop."""
    from common.faults import RunError

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
        raise FloatingPointError("DeepSpeed applied an update with a non-finite gradient norm (the weights "
                                 "are no longer finite); stopping (last good checkpoint kept). Enable "
                                 "bf16.check_grad_overflow in the DeepSpeed config, or lower --learning_rate")
    return grad_norm


def save_or_preempt(accelerator, model, scheduler, output_dir: str | Path, state: TrainState, preemption, *,
                    save_steps: int, max_steps: int, save_total_limit: int | None) -> None:
    """Save every `save_steps`, at `max_steps`, and when any rank was signalled (then exit 75).

    Collective: call on every rank after each optimizer step."""
    stop = preemption.requested()  # all ranks agree on the same step
    if stop or state.step % save_steps == 0 or state.step == max_steps:
        save_checkpoint(accelerator, model, output_dir, state, scheduler, save_total_limit)
    if stop:
        logger.warning(f"preempted at step {state.step}: checkpoint saved; re-run the same command to "
                       f"resume (exit code {PREEMPTED_EXIT_CODE})")
        accelerator.end_training()
        sys.exit(PREEMPTED_EXIT_CODE)


def inverse_sqrt_schedule(warmup_steps: int):
    """LR multiplier: linear warm-up to 1, then 1/sqrt decay (the Transformer/Conformer schedule).

    It does not depend on max_steps, so extending a run on resume changes nothing before it."""
    def f(step: int) -> float:
        step = max(step, 1)
        return min(step / warmup_steps, math.sqrt(warmup_steps / step))
    return f


def decay_groups(module: torch.nn.Module, weight_decay: float, **options) -> list[dict]:
    """Two optimizer parameter groups of `module`: matrices with `weight_decay`, biases and norm gains
    (fewer than 2 dimensions) without; `options` (e.g. lr) go into both."""
    params = list(module.parameters())
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, **options},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, **options}]

