"""Accelerator construction, process-group sanity checks, and seeding.

Rank discipline: everything here is called by *every* process. Functions that contain a collective
(gather, barrier) say so in their docstring.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import logging
import os
import random

import numpy as np
import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import gather_object


def launcher_world_size() -> int:
    """How many processes the launcher (accelerate launch / torchrun / SLURM via them) started."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_topology(mixed_precision: str | None, *, cuda: bool, bf16_ok: bool, env: dict) -> tuple[str, list[str]]:
    """(precision to use, warnings) from the recipe flag and the launcher's profile, or a RunError.

    The profile (`accelerate launch --config_file ...` / `--mixed_precision`, passed to the processes
    as ACCELERATE_* variables) decides, unless the recipe's `--mixed_precision` is given: then the flag
    wins and a conflict is named. A profile this machine cannot honour is refused, never replaced."""
    from common.training.faults import RunError

    warnings = []
    profile = env.get("ACCELERATE_MIXED_PRECISION")
    if mixed_precision is None:
        precision = profile or "no"
    else:
        precision = mixed_precision
        if profile and profile != mixed_precision:
            warnings.append(f"--mixed_precision {mixed_precision} overrides the launcher's profile ({profile})")
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and importlib.util.find_spec("deepspeed") is None:
        # `accelerate launch` stops first with its own ImportError; this covers torchrun & co.
        raise RunError("the DeepSpeed profile needs the deepspeed package, which is not installed (it is not in "
                       "requirements.txt): `pip install deepspeed`, or use accelerate_configs/fsdp.yaml "
                       "(sharding) or multi_gpu.yaml")
    if precision == "fp16" and not cuda:
        raise RunError("fp16 mixed precision needs a GPU; on CPU use --mixed_precision bf16 (autocast) or no")
    if precision == "bf16" and cuda and not bf16_ok:
        raise RunError("this GPU has no bf16 support; use --mixed_precision fp16 or no "
                       "(or accelerate_configs/multi_gpu.yaml with mixed_precision: 'no')")
    local = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if cuda and local > torch.cuda.device_count():
        raise RunError(f"{local} processes on this machine but {torch.cuda.device_count()} GPU(s): "
                       f"launch with --num_processes {torch.cuda.device_count()} (or fewer)")
    # On a CPU-only machine a GPU profile (multi_gpu.yaml: 8 processes) would start gloo processes
    # sharing a few cores, each slower than one process alone: the cores are the devices here.
    cores = available_cores()
    if not cuda and local > cores:
        raise RunError(f"{local} processes on this machine but no GPU and {cores} CPU core(s): launch with "
                       f"--num_processes {cores} (or fewer), e.g. accelerate_configs/cpu_ddp.yaml")
    return precision, warnings


def check_distributed_type(distributed_type: str, *, env: dict) -> None:
    """Refuse (RunError) when the launcher's profile asked for FSDP or DeepSpeed and accelerate built
    something else.

    Accelerate 1.15 turns ACCELERATE_USE_FSDP into `DistributedType.FSDP` only for accelerator device
    types (accelerate/state.py, AcceleratorState.__init__); with `cpu=True` the same launch is plain
    gloo DDP (MULTI_CPU), which would replicate every parameter while the profile says it shards.
    The check is on what was built, not on the hardware, so it holds wherever accelerate decides."""
    from common.training.faults import RunError

    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and distributed_type != "FSDP":
        raise RunError(f"the FSDP profile needs GPUs: accelerate 1.15 shards only over accelerator devices, "
                       f"and here accelerate built {distributed_type} instead (every parameter replicated). "
                       f"Use accelerate_configs/cpu_ddp.yaml here")
    # The same for DeepSpeed: accelerate 1.15 builds DEEPSPEED only without cpu=True (state.py).
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and distributed_type != "DEEPSPEED":
        raise RunError(f"the DeepSpeed profile needs GPUs: accelerate 1.15 builds DeepSpeed only over accelerator "
                       f"devices, and here accelerate built {distributed_type} instead (no ZeRO sharding). "
                       f"Use accelerate_configs/cpu_ddp.yaml here")


def check_fsdp_wrap(accelerator, model: torch.nn.Module) -> None:
    """Refuse (RunError) an FSDP run whose profile names block classes to shard that `model` lacks.

    accelerate_configs/fsdp.yaml shards one unit per Conformer block (`Wav2Vec2BertEncoderLayer`);
    a model without it (the TTS recipe's, a new one) would stop inside `prepare` with accelerate's
    traceback. Here: one line, the model's repeated blocks, and the launcher flag that picks them.
    Call it on every rank before `accelerator.prepare`; it does nothing outside FSDP."""
    from common.training.faults import RunError

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type.value != "FSDP" or plugin is None:
        return
    wanted = plugin.transformer_cls_names_to_wrap or []
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in wanted if name not in present]
    if missing:
        # Repeated blocks: the non-torch classes held in a ModuleList (encoder layers and the like).
        blocks = sorted({type(c).__name__ for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                         for c in m.children() if not type(c).__module__.startswith("torch.")})
        hint = (f"--fsdp_transformer_layer_cls_to_wrap {','.join(blocks)}" if blocks
                else "--fsdp_transformer_layer_cls_to_wrap <the model's block class>")
        raise RunError(f"the FSDP profile shards at {', '.join(missing)}, which this model does not have "
                       f"(its repeated blocks: {', '.join(blocks) or 'none found'}); launch with "
                       f"`accelerate launch --config_file accelerate_configs/fsdp.yaml {hint} ...`")


def build_accelerator(
    *,
    mixed_precision: str | None = None,
    project_dir: str | None = None,
    log_with: str | list[str] | None = None,
    timeout_s: float = 1800.0,
    deterministic: bool = False,
) -> Accelerator:
    """An `Accelerator` that is what the launcher's profile says, or a clear refusal.

    - precision: see `resolve_topology` (profile unless `mixed_precision` is given);
    - on a machine without CUDA, `accelerate launch --multi_gpu` starts N processes but a plain
      `Accelerator()` gives each of them `DistributedType.NO`, `num_processes=1`: N independent runs
      that all write the same files and all read the whole corpus. We pass `cpu=True` whenever CUDA
      is absent (so gloo DDP forms), then verify that the group has exactly the launcher's world
      size and that every rank sees every other (one all-gather). Anything else is a hard error;
    - `deterministic`: deterministic kernels (bit-exact resume on GPUs too; slower).
    """
    cuda = torch.cuda.is_available()
    precision, warnings = resolve_topology(mixed_precision, cuda=cuda, env=dict(os.environ),
                                           bf16_ok=cuda and torch.cuda.is_bf16_supported())
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for deterministic GEMMs
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    accelerator = Accelerator(
        cpu=not cuda,
        mixed_precision=precision,
        project_dir=project_dir,
        log_with=log_with,
        # We size LR schedules in optimizer steps and step the scheduler ourselves on sync steps;
        # a prepared scheduler would step num_processes times per optimizer step (accelerate #1382).
        step_scheduler_with_optimizer=False,
        # Our batch sampler already yields a multiple of world_size batches (no padding needed);
        # even_batches stays on as a guard, it never has to duplicate anything.
        dataloader_config=DataLoaderConfiguration(even_batches=True, non_blocking=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))],
    )
    check_distributed_type(accelerator.distributed_type.value, env=dict(os.environ))
    _one_batch_per_deepspeed_micro_batch(accelerator)
    expected = launcher_world_size()
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"The launcher started {expected} processes but this one joined a process group of "
            f"{accelerator.num_processes} ({accelerator.distributed_type}). Every process would train "
            f"alone on the full data and overwrite the others' checkpoints. Launch with "
            f"`accelerate launch --config_file accelerate_configs/<profile>.yaml` or torchrun."
        )
    if accelerator.num_processes > 1:  # collective: all ranks reach it
        ranks = gather_object([accelerator.process_index])
        if sorted(ranks) != list(range(expected)):
            raise RuntimeError(f"process group is broken: ranks seen by all-gather = {ranks}")
    if accelerator.is_main_process:
        for w in warnings:
            logging.getLogger(__name__).warning(w)
    return accelerator


def _one_batch_per_deepspeed_micro_batch(accelerator: Accelerator) -> None:
    """DeepSpeed wants a number of samples per micro-batch; ours are seconds of audio (a batch sampler,
    so `prepare` finds no batch size and stops). DeepSpeed only reports it (its own data loader is
    unused), so 1 says "one batch": the loss scaling and the steps come from the loop. A profile
    that sets it keeps its own."""
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config if accelerator.state.deepspeed_plugin else {}
    if ds_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds_config["train_micro_batch_size_per_gpu"] = 1


def available_cores() -> int:
    """CPU cores this process may use: its affinity mask (taskset, SLURM --cpus-per-task), capped by
    a cgroup v2 CPU quota (containers) when one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def plan_threads(requested: int, saved: int | None, env: dict) -> tuple[int, str]:
    """(torch threads per process, why) — see `set_threads`."""
    local = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if requested > 0:
        return requested, "--num_threads"
    if saved:
        return saved, "kept from the checkpoint"
    omp = int(env.get("OMP_NUM_THREADS", "0") or 0)
    if omp > 1:  # the user's (or `accelerate launch --cpu`'s) choice; 1 is the launcher's default
        return omp, "OMP_NUM_THREADS"
    return max(1, available_cores() // local), f"{available_cores()} cores ÷ {local} process(es) on this machine"


def set_threads(requested: int, saved: int | None = None) -> tuple[int, str]:
    """Set torch's intra-op threads for this process; returns (threads, why).

    `accelerate launch` exports OMP_NUM_THREADS=1 unless told otherwise, which leaves all but one
    core idle in a 1-process run (the README's quickstart). `requested` 0 means automatic: the
    checkpoint's count on a resume (`saved`), else OMP_NUM_THREADS when it is above 1, else the
    cores of this machine divided by its processes. Bit-exact resume needs the same count: on CPU
    float reductions are split by thread, so 1 and 2 threads give different (equally valid) weights.
    """
    threads, why = plan_threads(requested, saved, dict(os.environ))
    torch.set_num_threads(threads)
    return threads, why


def describe_run(accelerator, max_batch_seconds: float, accumulation: int, threads_why: str = "",
                 num_workers: int | None = None, batch_unit: str = "s of audio") -> str:
    """One line saying what the run really is (logged at start-up by the main process). The batch is
    `max_batch_seconds` of `batch_unit` (a stream's: utterances)."""
    kind = {"NO": "single process", "MULTI_CPU": "DDP (gloo)", "MULTI_GPU": "DDP (nccl)",
            "FSDP": "FSDP2", "DEEPSPEED": "DeepSpeed"}.get(accelerator.distributed_type.value,
                                                           accelerator.distributed_type.value)
    device = accelerator.device.type
    count = torch.cuda.device_count() if device == "cuda" else os.cpu_count()
    unit = "GPU(s)" if device == "cuda" else "CPU cores"
    n = accelerator.num_processes
    return (f"run: {kind}, {n} process(es) on {device} ({count} {unit} on this machine), precision "
            f"{accelerator.mixed_precision}, batch {max_batch_seconds:g} {batch_unit} per process × "
            f"accumulation {accumulation} → {n * max_batch_seconds * accumulation:g} {batch_unit.split()[0]} per optimizer step"
            + f", {torch.get_num_threads()} thread(s) per process" + (f" ({threads_why})" if threads_why else "")
            + (f", {num_workers} data worker(s) per process" if num_workers is not None else "")
            + (", deterministic kernels" if torch.are_deterministic_algorithms_enabled() else ""))


def derive_seed(*keys: object) -> int:
    """A 63-bit seed that is a pure function of `keys` (stable across processes and Python runs;
    Python's `hash()` is salted per process, so it must never be used for this)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_everything(seed: int) -> None:
    """Seed the global RNGs of python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
