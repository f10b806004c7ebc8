"""Resuming: which checkpoint a launch resumes from (`choose_checkpoint`), the global batch it fixes
(`global_batch_plan`) and its threads (`checkpoint_threads`), and loading it into the prepared
objects (`resume_from_checkpoint`).

At resume, the newest checkpoint whose files all match the marker's digests, and whose pickles load
without running code and hold what a save writes (`common.training.checkpoint_checks`), is loaded;
a damaged one is named in a warning and skipped for the one before it. When checkpoints exist but
none is usable the launch stops, naming each: nothing is deleted (`--resume false` starts over with
them moved to `checkpoints.before_<time>/`). A checkpoint made with another global batch, training
data, data-affecting config, models or registered objects is refused before anything is loaded, and
`load_state` runs with weights-only loads forced (`_weights_only_loads`).

Every function that contains a collective says so; all ranks must call those.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import time
from pathlib import Path

from accelerate.utils import broadcast_object_list
from accelerate.utils import load as accelerate_load

from common.data.manifest import data_change
from common.training.checkpoint import load_refusal, named_parts, nonfinite_models, remove_leftovers
from common.training.checkpoint_checks import (nonfinite_weights, rng_state_problem, rng_states_problem,
                                               run_state_problem, unloadable_pickle)
from common.training.faults import RunError
from common.training.prepare import fsync_path
from common.training.sealing import CHECKPOINT_RE, MARKER, list_checkpoints, odd_entry, verify_checkpoint
from common.training.state import (NO_DEFAULT, ContractError, RunState, TrainState, registered_names, run_state_of,
                                   this_launch)

logger = logging.getLogger(__name__)


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
        # odd_entry before any file is opened: a FIFO among the pickles would block the load for ever
        problem = (verify_checkpoint(ckpt) or odd_entry(ckpt) or unloadable_pickle(ckpt)
                   or run_state_problem(ckpt) or rng_states_problem(ckpt) or nonfinite_weights(ckpt))
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
    models, optimizers, schedulers = named_parts(accelerator, models, optimizers, schedulers)
    if accelerator.distributed_type.value == "DEEPSPEED" and len(models) > 1:
        raise RunError(f"DeepSpeed trains one model per Accelerator; this recipe has {len(models)} "
                       f"({', '.join(models)}): use a DDP or FSDP profile (accelerate_configs/)")
    if ckpt is None:
        state.launches = [this_launch(0, accelerator.num_processes)]
        run_state_of(accelerator)  # registered last: save_checkpoint checks that nothing came after it
        state.stage = "boundary"
        return None
    if not (ckpt / MARKER).is_file():
        raise ContractError(f"resume_from_checkpoint: {ckpt} has no {MARKER} marker; pass what "
                            f"choose_checkpoint returned (it verifies the files)")
    saved = _saved_state(ckpt)
    was_data = saved.get("data") or {}  # this launch's summary is kept: the same, or a change allowed below
    data_changed = data_change(was_data, state.data, ckpt.parent.parent / "data")
    _refuse_other_settings(accelerator, ckpt, saved, state, data_changed,
                           {"models": models, "optimizers": optimizers, "schedulers": schedulers})
    if data_changed and accelerator.is_main_process:
        logger.warning(f"RESUMING ON CHANGED DATA (--allow_data_change true): {data_changed}; the run will not "
                       f"match one trained on either data alone; recorded in train_state.json (data_changes)")
    restored = _load(accelerator, ckpt, saved, models)
    holder = run_state_of(accelerator)  # registered now if the checkpoint predates it: the next save writes it
    holder.state, holder.schedulers = state, schedulers
    for name, sd in restored.pop("schedulers").items():
        schedulers[name].load_state_dict(sd)
    changes = restored.pop("data_changes", [])
    state.data_changes = changes + ([{"step": restored["step"], "was": was_data, "now": state.data}]
                                    if data_changed else [])
    _restore_position(accelerator, restored, state)
    if accelerator.is_main_process:
        logger.info(f"resumed from {ckpt}: step {state.step}, epoch {state.epoch}, "
                    f"batch {state.batches_in_epoch} of the epoch")
    return ckpt


def _saved_state(ckpt: Path) -> dict:
    """`ckpt`'s train_state.json, with the names of one model, optimizer and schedule filled in for a
    checkpoint written before names were recorded."""
    saved = json.loads((ckpt / "train_state.json").read_text())
    if "schedulers" not in saved and "scheduler" in saved:  # written before names were recorded: one of each
        saved.update(models=["model"], optimizers=["optimizer"], schedulers={"scheduler": saved.pop("scheduler")})
    if "schedulers" not in saved:
        raise RunError(f"{ckpt} was written by an older version of this repository (no scheduler state "
                       f"in train_state.json); resume it with that version, or use a new --output_dir")
    return saved


def _refuse_other_settings(accelerator, ckpt: Path, saved: dict, state: TrainState, data_changed: str | None,
                           parts: dict[str, dict]) -> None:
    """Raise a RunError listing every way this launch differs from the one that wrote `ckpt` (`saved`:
    its train_state.json) so that the resumed run could not reproduce the uninterrupted one: the
    global batch, the DeepSpeed layout, the names of `parts` ({"models": ..., "optimizers": ...,
    "schedulers": ...}) and of the registered objects, the training data, the config. Before
    anything is loaded."""
    problems = [p for p in [_global_batch_problem(saved, state), _deepspeed_problem(ckpt, saved, accelerator)] if p]
    for kind, now in parts.items():
        if list(saved[kind]) != list(now):  # accelerate loads models and optimizers by prepare order
            problems.append(f"{kind}: checkpoint {list(saved[kind])} != now {list(now)} (names, in prepare order)")
    problems += _registered_problems(accelerator, saved)
    if data_changed and not state.config.get("allow_data_change"):
        problems.append(data_changed)
    problems += _config_problems(saved, state)
    if problems:
        data = any(p.startswith("training data") for p in problems)
        raise RunError(
            f"refusing to resume from {ckpt}: it was made with a different setting\n  "
            + "\n  ".join(problems)
            + "\nUse a new --output_dir, or re-launch with the checkpoint's settings"
            + (" and data (the --data_dir it was trained on, unchanged), or resume on the changed data on "
               "purpose with --allow_data_change true." if data else ".")
        )


def _registered_problems(accelerator, saved: dict) -> list[str]:
    """The objects registered for checkpointing: the recipe's own, then ours (RunState). accelerate
    loads them by position and stops on a different count, after the weights: compared first. A
    checkpoint written before they were registered ("registered" absent) holds none: our state
    comes from its train_state.json, and a recipe object it cannot hold is refused."""
    now_registered = registered_names(accelerator)
    if run_state_of(accelerator, register=False) is None:
        now_registered.append(RunState.__qualname__)  # registered by _load, last
    if "registered" not in saved and now_registered != [RunState.__qualname__]:
        return [f"registered objects: checkpoint none (written before registered objects were saved) != "
                f"now {[n for n in now_registered if n != RunState.__qualname__]} (the recipe's own state: "
                f"resume with the version of the recipe that wrote it)"]
    if "registered" in saved and saved["registered"] != now_registered:
        return [f"registered objects: checkpoint {saved['registered']} != now {now_registered} (names, in "
                f"registration order: register_for_checkpointing before resume_from_checkpoint, as the "
                f"run that wrote it did)"]
    return []


def _config_problems(saved: dict, state: TrainState) -> list[str]:
    """"key: checkpoint X != now Y" for each config key that may not change on a resume."""
    if saved["config_hash"] == state.config_hash:  # the hash is a shortcut; the keys decide
        return []
    # This launch's ResumeSafe keys, and those the checkpoint's run marked that its Config no
    # longer has (a checkpoint written before the marks were stored has none).
    safe = set(state.resume_safe) | (set(saved.get("resume_safe", ())) - set(state.config))
    # A field the checkpoint's config lacks was added to the Config after it was written; the
    # code it was written with behaved as that field's default does (the rule for adding a
    # field), so only another value is a change.
    added = {k for k in set(state.config) - set(saved["config"])
             if state.config[k] == state.config_defaults.get(k, NO_DEFAULT)}
    return [f"{k}: checkpoint {saved['config'].get(k)!r} != now {state.config.get(k)!r}"
            for k in sorted(set(saved["config"]) | set(state.config))
            if k not in safe and k not in added and saved["config"].get(k) != state.config.get(k)]


def _load(accelerator, ckpt: Path, saved: dict, models: dict) -> dict:
    """Load `ckpt` into the prepared models and optimizers, the RNGs and the registered objects
    (collective), refusing in one line a file changed since `choose_checkpoint` checked it. Returns
    the position and the schedules it holds (TrainState's fields and "schedulers"): from the run's
    registered state, or from `saved` (its train_state.json) for a checkpoint that predates it."""
    json_layout = "registered" not in saved
    holder = run_state_of(accelerator, register=not json_layout)  # filled by load_state
    try:
        _refuse_unloadable_states(accelerator, ckpt, saved)
        with _weights_only_loads(accelerator):
            accelerator.load_state(str(ckpt))  # models, optimizers (prepare order), RNG states, registered objects
    except pickle.UnpicklingError as e:  # changed after choose_checkpoint checked it: refused, not run
        raise RunError(f"{ckpt}: a pickled state cannot be loaded safely ({load_refusal(e)}); it changed after "
                       f"the checkpoint was checked at launch: move {ckpt.name} out of {ckpt.parent} to resume "
                       f"from the checkpoint before it") from None
    # choose_checkpoint skipped safetensors files with non-finite weights; FSDP and DeepSpeed weights
    # are read only here: the same verdict, after loading (collective under FSDP, like the load).
    bad = nonfinite_models(accelerator, models)
    if bad:
        raise RunError(f"{ckpt}: non-finite weights in {', '.join(bad)} after loading it (a save never writes "
                       f"them: the checkpoint was damaged or crafted before it was sealed): move {ckpt.name} out of "
                       f"{ckpt.parent} to resume from the checkpoint before it")
    if json_layout:
        return saved  # the position and the schedules as JSON
    restored = {**holder.loaded["train_state"], "schedulers": holder.loaded["schedulers"]}
    holder.loaded = None
    return restored


def _refuse_unloadable_states(accelerator, ckpt: Path, saved: dict) -> None:
    """Before `load_state`: this rank's RNG-state file, and the state of each registered object that can
    check its own (`state_problem(state) -> str | None`: common.training.early_stopping.EarlyStopping),
    read weights-only; a problem is one line (accelerate would skip an RNG file it cannot apply, and a
    registered object would fail inside its load_state_dict after the weights were loaded)."""
    move = f"move {ckpt.name} out of {ckpt.parent} to resume from the checkpoint before it"
    if saved["world_size"] == accelerator.num_processes:
        # (On another number of processes rank r may find no RNG file of its own: nothing is lost, the
        # loop reseeds the global RNG from the position before every micro-batch.)
        rng = ckpt / f"random_states_{accelerator.process_index}.pkl"
        problem = rng_state_problem(accelerate_load(rng))  # weights_only: runs no code
        if problem:
            raise RunError(f"{ckpt}: {rng.name} {problem}; it changed after the checkpoint was checked at launch: {move}")
    for i, obj in enumerate(accelerator._custom_objects):  # the checkpoint's custom_checkpoint_<i> order
        check, path = getattr(obj, "state_problem", None), ckpt / f"custom_checkpoint_{i}.pkl"
        problem = check(accelerate_load(path, map_location="cpu", mmap=True)) if check and path.is_file() else None
        if problem:
            raise RunError(f"{ckpt}: {path.name} (the state of the registered {type(obj).__qualname__}) {problem}: "
                           f"a save never writes that (the checkpoint was damaged or crafted before it was sealed): "
                           f"{move}")


def _restore_position(accelerator, restored: dict, state: TrainState) -> None:
    """Set `state` to the checkpoint's position and counters (`restored`), keeping this launch's
    config, topology and data summary, and record this launch; `state` is then at a step boundary."""
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



@contextlib.contextmanager
def _weights_only_loads(accelerator):
    """Every `torch.load` inside reads weights only, also accelerate's `load_custom_state`, which asks
    for `weights_only=False` (torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD, read at each call): even a file
    swapped after `choose_checkpoint` checked it cannot run code. Under FSDP this covers
    torch.distributed.checkpoint's non-tensor items too (plain data, read with `weights_only=False`
    by its DefaultLoadPlanner: they load forced, tests/guarantees/test_fsdp.py resumes exactly). Not
    under DeepSpeed, whose engine loads its own `.pt` files with `weights_only=False` (see
    common.training.checkpoint_checks; deepspeed is not installed here, so that path is untested with
    these changes)."""
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
