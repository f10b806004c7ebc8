"""Main-process-only logging: a text logger, `metrics.jsonl`, and a tqdm bar.

`metrics.jsonl` holds one JSON object per logged optimizer step. A re-launched run first trims
the lines written after its checkpoint (and any line a kill cut in half), so every step appears
exactly once, with the same values an uninterrupted run would have written.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from accelerate.logging import get_logger as _accelerate_get_logger
from tqdm.auto import tqdm


def get_logger(name: str):
    """A logger that emits on the main process only (accelerate's `MultiProcessAdapter`)."""
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO,
    )
    # accelerate logs every file of every save at INFO; keep the console for the training story.
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    return _accelerate_get_logger(name, log_level="INFO")


def progress_bar(accelerator, total: int, initial: int = 0):
    return tqdm(total=total, initial=initial, disable=not accelerator.is_main_process,
                dynamic_ncols=True, unit="step")


class MetricsLog:
    """Append-only `metrics.jsonl`; writes happen on the main process only."""

    def __init__(self, accelerator, path: str | Path, resume_step: int = 0):
        self.path = Path(path)
        self.enabled = accelerator.is_main_process
        if self.enabled and self.path.exists():
            self._trim(resume_step)

    def _trim(self, last_step: int) -> None:
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # half-written by a killed process
                continue
            if row.get("step", 0) <= last_step:
                kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)  # atomic: the old file stays whole until the new one is

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def start_trackers(accelerator, config: dict, report_to: str, resume_step: int) -> None:
    """`accelerator.init_trackers` with the config as hyper-parameters (main process only inside).

    After a resume, TensorBoard purges the events of the steps after the checkpoint (`purge_step`:
    written by the interrupted run, about to be written again), so every step appears once."""
    if report_to == "none":
        return
    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}
    init_kwargs = {"tensorboard": {"purge_step": resume_step + 1}} if resume_step and "tensorboard" in report_to else {}
    accelerator.init_trackers("tensorboard", config=hparams, init_kwargs=init_kwargs)
