"""Accelerator construction, process-group sanity checks, and seeding.

Rank discipline: everything here is called by *every* process. Functions that contain a collective
(gather, barrier) say so in their docstring.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import random

import numpy as np
import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import gather_object


def launcher_world_size() -> int:
    """How many processes the launcher (accelerate launch / torchrun / SLURM via them) started."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def build_accelerator(
    *,
    mixed_precision: str = "no",
    cpu: bool = False,
    project_dir: str | None = None,
    log_with: str | list[str] | None = None,
    timeout_s: float = 1800.0,
) -> Accelerator:
    """An `Accelerator` whose process group is guaranteed to be real.

    On a machine without CUDA, `accelerate launch --multi_gpu` starts N processes but a plain
    `Accelerator()` gives each of them `DistributedType.NO`, `num_processes=1`: N independent runs
    that all write the same files and all read the whole corpus. We pass `cpu=True` whenever CUDA is
    absent (so gloo DDP forms), then verify that the group has exactly the launcher's world size and
    that every rank sees every other (one all-gather). Anything else is a hard error.
    """
    cpu = cpu or not torch.cuda.is_available()
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=mixed_precision,
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
    return accelerator


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
