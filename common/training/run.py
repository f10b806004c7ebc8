"""The start of every training run, before its data: one call, `start_run`, the same in every recipe.

Rank discipline: called by every process at the same point (it holds collectives).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from common.training.resume import checkpoint_threads, choose_checkpoint, global_batch_plan
from common.config import config_to_dict, save_config
from common.data.loading import auto_workers
from common.training.distributed import build_accelerator, describe_run, seed_everything, set_threads
from common.training.faults import Preemption
from common.training.logs import MetricsLog, get_logger, start_trackers, trackers
from common.training.rundir import claim_output_dir

logger = get_logger(__name__)


@dataclass
class Run:
    """What `start_run` set up, for the recipe's `main`."""

    accelerator: Accelerator
    out: Path  # --output_dir, claimed by this run
    preemption: Preemption  # signals: a clean exit (75) now; after preemption.defer(), save then exit 75
    cfg: Any  # the recipe's Config as it runs: mixed_precision is the profile's or the flag's
    cfg_dict: dict  # cfg as plain values (checkpoints, trackers)
    ckpt: Path | None  # the checkpoint to resume from (choose_checkpoint), None: a fresh run
    accumulation: int  # batches per optimizer step on this launch (global_batch_plan)
    global_batch: int  # micro-batches per optimizer step over all processes: the training loader's multiple
    num_workers: int  # DataLoader workers per process


def start_run(cfg, recipe: str) -> Run:
    """Build the accelerator, claim the output folder, install the signal handlers, seed, and plan the
    resume. Collective. The order is the contract:

    1. `build_accelerator` (the launcher's profile, or `cfg.mixed_precision`), then `claim_output_dir`:
       one run per folder, and only a run of `recipe` (a user's own folder is refused);
    2. `Preemption` before any data work: a signal from here on is a clean exit;
    3. `seed_everything(cfg.seed)`: model initialization is identical on every rank;
    4. `choose_checkpoint` (the newest intact one; none with `--resume false`) before the data: its
       global batch sizes the data batches (`global_batch_plan`: a re-launch on another number of
       processes keeps the micro-batches per optimizer step by changing the accumulation, or is
       refused naming what works). The recipe
       then builds its training loader with `multiple_of=run.global_batch`, prepares it, and hands
       `run.ckpt` to `resume_from_checkpoint` before its first batch;
    5. `set_threads` (a resume keeps the checkpoint's count: bit-exact on CPU needs it), `auto_workers`,
       and one log line that says what the run is (`describe_run`).
    """
    out = Path(cfg.output_dir)
    accelerator = build_accelerator(
        mixed_precision=cfg.mixed_precision, project_dir=str(out),
        log_with=trackers(cfg.report_to) or None,  # [] makes accelerate warn that none is installed
        timeout_s=cfg.ddp_timeout,
        deterministic=cfg.deterministic,
    )
    claim_output_dir(accelerator, out, recipe, cfg.overwrite_output_dir)
    preemption = Preemption(accelerator)
    seed_everything(cfg.seed)
    cfg = dataclasses.replace(cfg, mixed_precision=accelerator.mixed_precision)

    ckpt = choose_checkpoint(accelerator, out, resume=cfg.resume)  # collective
    accumulation, global_batch = global_batch_plan(ckpt, accelerator.num_processes, cfg.gradient_accumulation_steps,
                                                   accelerator.is_main_process)
    _, threads_why = set_threads(cfg.num_threads, checkpoint_threads(ckpt))
    num_workers = auto_workers(cfg.num_workers, cuda=accelerator.device.type == "cuda")
    streamed = getattr(cfg, "streaming", False)  # batches of per_device_train_batch_size utterances
    logger.info(describe_run(accelerator, cfg.per_device_train_batch_size if streamed else cfg.max_batch_seconds,
                             accumulation, threads_why, num_workers, batch_unit="utterances" if streamed else "s of audio"))
    return Run(accelerator, out, preemption, cfg, config_to_dict(cfg), ckpt, accumulation, global_batch, num_workers)


def start_logging(run: Run, state) -> MetricsLog:
    """Once the run has resumed or started (`state.step` known): the config as it runs beside the run
    (<output_dir>/config.yaml, main process), metrics.jsonl trimmed to the resumed step, and the
    trackers (TensorBoard drops the events after that step). Returns the metrics log."""
    if run.accelerator.is_main_process:
        save_config(run.cfg, run.out / "config.yaml")
    metrics = MetricsLog(run.accelerator, run.out / "metrics.jsonl", resume_step=state.step)
    start_trackers(run.accelerator, run.cfg_dict, run.cfg.report_to, resume_step=state.step)
    return metrics

