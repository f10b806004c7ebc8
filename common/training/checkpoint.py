"""Saving: step-named, atomically completed checkpoints on top of `accelerator.save_state`, pruned
after the next one is complete; `export_final` writes `final/` the same way.


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
complete, and `list_checkpoints` (common.training.sealing) ignores anything without the marker. A
save prunes only the checkpoints it supersedes (older than itself), never a newer one skipped as
damaged. Which checkpoint a launch resumes from, and how: `common.training.resume`; the checks of
a candidate before anything is loaded: `common.training.checkpoint_checks`; a full disk during a
save or an export: `common.training.disk_full`.

A registered object's state_dict must be plain data (dicts, lists, numbers, strings, tensors), which
a resume reads without running code: `save_checkpoint` says so at the first save otherwise.
accelerate saves rank 0's state of each one: register only state that is the same on every rank.

Several models (a GAN: `models={"generator": g, "discriminator": d}`, likewise `optimizers=` and
`schedulers=`): accelerate saves and loads them by prepare order, so the checkpoint records their
names in that order and a resume whose names or order differ is refused before anything is loaded.
One model, optimizer and scheduler may be passed bare (named "model", "optimizer", "scheduler"):
the files are those of a one-model checkpoint, and checkpoints written before names were recorded
(one model, `"scheduler"` in train_state.json) still resume.

Every function that contains a collective says so; all ranks must call those.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate.utils import load as accelerate_load

from common.training.disk_full import checkpoint_bytes, disk_full_message, is_disk_full, weight_bytes
from common.training.faults import NonFiniteError, RunError
from common.training.prepare import fsync_path
from common.training.sealing import MARKER, checkpoint_dir, list_checkpoints, seal_export, seal_files
from common.training.state import ContractError, RunState, TrainState, named, registered_names, run_state_of

logger = logging.getLogger(__name__)


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
    models, optimizers, schedulers = named_parts(accelerator, models, optimizers, schedulers)
    run_state = run_state_of(accelerator)
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
    bad = nonfinite_models(accelerator, models)
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
        if not is_disk_full(e):
            raise
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        need = checkpoint_bytes(output_dir, models.values(),
                                 master_copy=accelerator.distributed_type.value == "DEEPSPEED")
        raise RunError(disk_full_message(output_dir, f"saving step {state.step}", need,
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
    same answer on every rank. Collective under FSDP (see `nonfinite_models`)."""
    return not nonfinite_models(accelerator, named(models, "model"))


def nonfinite_models(accelerator, models: dict[str, Any]) -> list[str]:
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


def named_parts(accelerator, models, optimizers, schedulers) -> tuple[dict, dict, dict]:
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
                    f"data ({load_refusal(e)}): return dicts, lists, numbers, strings and tensors, which a resume "
                    f"reads without running code")
    return None


def load_refusal(e: BaseException) -> str:
    """The one line of a refused or failed `torch.load`."""
    lines = [line for line in str(e).splitlines() if line.strip()] or [""]
    # torch's weights-only refusal says what it refused in its second paragraph
    reason = lines[1] if lines[0].startswith("Weights only load failed") and len(lines) > 1 else lines[0]
    return f"{type(e).__name__}: {reason[:200]}"


def model_weights_files(ckpt: Path) -> dict[str, Path]:
    """Each prepared model's weights file in a checkpoint, by the name `train_state.json` gives it
    (its "models": the recipe's names in prepare order). accelerate names the files by prepare order
    only: model.safetensors, model_1.safetensors, ... Raises OSError/ValueError if the checkpoint
    has no readable train_state.json."""
    names = json.loads((ckpt / "train_state.json").read_text()).get("models") or []
    return {name: ckpt / ("model.safetensors" if i == 0 else f"model_{i}.safetensors") for i, name in enumerate(names)}


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
        if not is_disk_full(e):
            raise
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RunError(disk_full_message(output_dir, f"exporting the final model to {final}",
                                          2 * weight_bytes(models.values()), "the partial export was removed",
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
