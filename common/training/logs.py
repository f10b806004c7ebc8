"""Main-process-only logging: a text logger, `metrics.jsonl`, a tqdm bar (or, when the output
goes to a file, a plain line per logged step), and the experiment trackers of `--report_to`.

`metrics.jsonl` holds one JSON object per logged optimizer step. A re-launched run first trims
the lines written after its checkpoint (and any line a kill cut in half), so every step appears
exactly once, with the same values an uninterrupted run would have written.

Importing this module is light (accelerate and tqdm are imported where used): `--report_to`
is checked (`trackers`) while the command line is parsed, before any heavy import.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

from common.training.contract import ContractError

# The trackers accelerate 1.15 knows (`accelerate.tracking.LOGGER_TYPE_TO_CLASS`; a test keeps this
# list equal to it): the module(s) whose presence makes one usable, and the pip package to install.
TRACKERS = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "aim": (("aim",), "aim"),
    "clearml": (("clearml",), "clearml"),
    "dvclive": (("dvclive",), "dvclive"),
    "swanlab": (("swanlab",), "swanlab"),
    "trackio": (("trackio",), "trackio"),
}


def _installed(name: str) -> bool:
    return any(importlib.util.find_spec(m) is not None for m in TRACKERS[name][0])  # no import: fast


def trackers(report_to: str) -> list[str]:
    """`--report_to` as Hugging Face takes it: one tracker, a comma-separated list, `all` (every
    installed one) or `none` → the names for `Accelerator(log_with=...)`. Raises ValueError (one
    line, naming the pip package) for an unknown or uninstalled tracker."""
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    if names in (["none"], ["all"]):
        return [] if names == ["none"] else [n for n in TRACKERS if _installed(n)]
    choices = ", ".join([*TRACKERS, "all", "none"])
    if len(names) > 1 and {"all", "none"} & set(names):
        raise ValueError(f"--report_to {report_to}: 'all' and 'none' stand alone, not in a list")
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"--report_to {report_to}: {name!r} is not a tracker; choose from {choices} "
                             f"(several: comma-separated)")
        if not _installed(name):
            raise ValueError(f"--report_to {report_to}: the {name} tracker is not installed here: "
                             f"pip install {TRACKERS[name][1]} (or --report_to none)")
    if not names:
        raise ValueError(f"--report_to: empty; choose from {choices}")
    return names


class _TqdmHandler(logging.StreamHandler):
    """Writes log records through `tqdm.write`, so they never land in the middle of a live bar."""

    def emit(self, record):
        try:
            from tqdm.auto import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 — logging must never raise
            self.handleError(record)


class _MainProcessLogger(logging.LoggerAdapter):
    """Emits on the main process only; every rank may call it (no rank prefix is added)."""

    def log(self, level, msg, *args, **kwargs):
        from accelerate import PartialState

        state = PartialState._shared_state
        if not state or state.get("process_index", 0) == 0:
            self.logger.log(level, msg, *args, **kwargs)


def get_logger(name: str) -> logging.LoggerAdapter:
    """A logger that emits on the main process only, through the progress bar when one is live."""
    if not any(isinstance(h, _TqdmHandler) for h in logging.getLogger().handlers):
        handler = _TqdmHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    # accelerate logs every file of every save at INFO; keep the console for the training story.
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    return _MainProcessLogger(logging.getLogger(name), {})


class PlainProgress:
    """What replaces the bar when stderr is not a terminal (SLURM, nohup): one log line per logged
    step with the step, the values shown, steps/s and the time left."""

    def __init__(self, total: int, initial: int):
        self.total, self.n = total, initial
        self.start_n, self.start_t = initial, time.monotonic()
        self.logger = get_logger("progress")

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **values) -> None:
        rate = (self.n - self.start_n) / max(time.monotonic() - self.start_t, 1e-9)
        left = (self.total - self.n) / rate if rate > 0 else float("inf")
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left != float("inf") else "?"
        shown = " ".join(f"{k} {v}" for k, v in values.items())
        self.logger.info(f"step {self.n}/{self.total} {shown} | {rate:.2f} steps/s, {eta} left")

    def close(self) -> None:
        pass


def progress_bar(accelerator, total: int, initial: int = 0):
    """A tqdm bar on a terminal; plain log lines when stderr goes to a file. Main process only."""
    from tqdm.auto import tqdm

    if accelerator.is_main_process and not sys.stderr.isatty():
        return PlainProgress(total, initial)
    return tqdm(total=total, initial=initial, disable=not accelerator.is_main_process,
                dynamic_ncols=True, unit="step")


class Throughput:
    """Audio seconds of training data per wall-clock second, all processes together, over the
    interval since the previous `rate()` (evaluation and checkpoints in it included).

    `add(ids)` costs a dict lookup per utterance on the host: no device synchronization."""

    def __init__(self, accelerator, durations: dict[str, float]):
        self.accelerator, self.durations = accelerator, durations  # utterance id → seconds
        self.seconds, self.start = 0.0, time.perf_counter()

    def add(self, batch) -> None:
        """`batch`: its utterance ids, or the batch (a streamed one carries its `durations`, in s)."""
        if isinstance(batch, dict):
            if "durations" in batch:
                self.seconds += sum(batch["durations"])
                return
            batch = batch_ids(batch)
        self.seconds += sum(self.durations[i] for i in batch)

    def rate(self) -> float:
        """Collective (one all-reduce): call on every rank."""
        import torch

        total = self.accelerator.reduce(torch.tensor([self.seconds], dtype=torch.float64,
                                                     device=self.accelerator.device), "sum").item()
        now = time.perf_counter()
        rate, self.seconds, self.start = total / max(now - self.start, 1e-9), 0.0, now
        return rate


def batch_ids(batch) -> list:
    """The utterance ids of a training batch. The batch contract: a collator returns a dict that holds
    them under "ids", one per item (Throughput counts their seconds, --dump_batch_ids writes them);
    anything else is a ContractError of one line, at the first batch."""
    if isinstance(batch, dict) and "ids" in batch:
        return batch["ids"]
    got = f"a dict with keys {sorted(map(str, batch))}" if isinstance(batch, dict) else f"a {type(batch).__name__}"
    raise ContractError(f"a training batch must be a dict with its utterance ids under \"ids\" (one per item: what "
                        f"Throughput and --dump_batch_ids read), got {got}: return dict(ids=[...], ...) from the "
                        f"collator")


class WindowMeans:
    """The values a recipe's `compute_loss` reports (name → scalar tensor), each averaged over the
    batches of one accumulation window on this process; `zero()` after every optimizer step."""

    def __init__(self):
        self.sums: dict = {}  # name → float32 scalar on the batch's device

    def add(self, stats: dict, window_len: int) -> None:
        import torch

        for name, value in stats.items():
            if name not in self.sums:
                self.sums[name] = torch.zeros((), device=value.device)
            self.sums[name] += value.detach() / window_len

    def zero(self) -> None:
        for total in self.sums.values():
            total.zero_()


class MetricsLog:
    """Append-only `metrics.jsonl`; writes happen on the main process only."""

    def __init__(self, accelerator, path: str | Path, resume_step: int = 0):
        self.accelerator = accelerator
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

    def log_step(self, state, window: WindowMeans, throughput: Throughput, *, lr: float, grad_norm,
                 extra: dict) -> dict:
        """Collective (two all-reduces): call on every rank. The row of the optimizer step just taken:
        step, epoch, the window's means over all processes, `lr`, `grad_norm` (a tensor), skipped
        updates, audio seconds per second, then `extra` (evaluation results); written to metrics.jsonl
        and the trackers by the main process, and returned (for the progress bar)."""
        import torch

        means = self.accelerator.reduce(torch.stack(list(window.sums.values())), "mean").tolist()
        row = {"step": state.step, "epoch": state.epoch, **dict(zip(window.sums, means)), "lr": lr,
               "grad_norm": grad_norm.item(), "skipped_updates": state.skipped_updates,
               "audio_s_per_s": throughput.rate(), **extra}
        self.log(row)
        self.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=state.step)
        return row


def start_trackers(accelerator, config: dict, report_to: str, resume_step: int) -> None:
    """`accelerator.init_trackers` with the config as hyper-parameters (main process only inside).
    The accelerator was built with `log_with=trackers(report_to)`.

    The project (wandb, mlflow, ... ) is named after the output folder (`outputs/asr` → `asr`);
    TensorBoard writes into `<output_dir>/tensorboard/<that name>/`. After a resume, TensorBoard
    purges the events of the steps after the checkpoint (`purge_step`: written by the interrupted
    run, about to be written again), so every step appears once."""
    names = trackers(report_to)
    if not names:
        return
    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}
    init_kwargs = {"tensorboard": {"purge_step": resume_step + 1}} if resume_step and "tensorboard" in names else {}
    # TensorBoard's folder is <logging_dir>/<project>: the project name must mean something to every
    # tracker, so TensorBoard's events go one level down, all under <output_dir>/tensorboard.
    accelerator.project_configuration.logging_dir = os.path.join(accelerator.project_dir, "tensorboard")
    accelerator.init_trackers(Path(config["output_dir"]).name, config=hparams, init_kwargs=init_kwargs)
