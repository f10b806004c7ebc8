"""Preemption and failure handling: every way a run can end says so clearly and loses no work.

- `Preemption`: SIGTERM / SIGUSR1 (SLURM `--signal`, Kubernetes, a user's `kill`, the launcher's
  end: `common.training.launcher`) or Ctrl-C to any rank only sets a flag during training. At the next
  optimizer-step boundary all ranks agree (one all-reduce), save the same step, and exit with
  `PREEMPTED_EXIT_CODE`. Re-running the same command resumes exactly. During start-up a signal
  stops the process cleanly (locks and temporary folders removed), with the same exit code.
- `run_main`: an exception on one rank ends that process at once with its traceback; the peers'
  next collective then fails ("connection closed") and they exit with one line instead of a second
  traceback, or the launcher stops them. Nobody is left waiting at a barrier: collectives also
  time out after `ddp_timeout` seconds (see `common.training.distributed.build_accelerator`).
"""

from __future__ import annotations

import errno
import faulthandler
import gc
import os
import signal
import sys
import traceback

import torch

from common.config_rules import ConfigError
from common.training.launcher import stop_reason
from common.training.rundir import mark_stopping

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; the worker processes exit with it


class RunError(RuntimeError):
    """A failure whose message says everything a user needs (what happened, what to do): `run_main`
    prints it as one line, without a traceback, and exits with `exit_code`."""

    exit_code = 1


class UsageError(RunError):
    """A mistake in what the user asked that only the data can reveal (a column or split that is not
    there): one line, exit code 2, like a mistake on the command line."""

    exit_code = 2


class NonFiniteError(RunError, FloatingPointError):
    """The run stopped on non-finite updates: a training outcome with a known fix, so one line too."""


class Preemption:
    """SIGTERM / SIGUSR1 / SIGINT handling, installed at start-up (before any data preparation).

    Before `defer()` (start-up, data preparation) a signal ends the process at once through
    `SystemExit(75)`, so every `finally` runs: locks and temporary folders are removed. After
    `defer()` (the training loop) it only sets a flag that all ranks agree on at the next optimizer
    step (`requested()`): they save that step and exit 75. A second SIGINT (Ctrl-C twice) aborts at
    once; other second signals are ignored, so that a save in progress completes.
    """

    def __init__(self, accelerator, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)):
        self.accelerator = accelerator
        self.signal: int | None = None
        self.deferred = False
        # The per-step agreement goes through a CPU (gloo) group: on GPUs an NCCL all-reduce of a
        # device flag plus `.item()` would stall the host until the step's kernels finish, every
        # step. Collective: every rank builds its Preemption at the same point.
        self.group = None
        if accelerator.num_processes > 1 and accelerator.device.type != "cpu":
            self.group = torch.distributed.new_group(backend="gloo")
        for sig in signals:
            signal.signal(sig, self._handle)

    def defer(self) -> None:
        """From now on a signal is answered at the next optimizer-step boundary."""
        self.deferred = True

    def _handle(self, signum, frame):
        name = stop_reason(signum)  # the signal's name, or "the launcher (pid N) ended" (common.training.launcher)
        if signum == signal.SIGINT and self.signal == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now (run_main ends the process)
        if self.signal is not None:
            return  # a save asked for by the first signal must not be interrupted
        self.signal = signum
        if not self.deferred:
            print(f"{name} during start-up: stopping (nothing to save yet; exit code {PREEMPTED_EXIT_CODE})",
                  file=sys.stderr, flush=True)
            raise SystemExit(PREEMPTED_EXIT_CODE)
        mark_stopping()  # the run lock says so: a re-launch meanwhile waits for this save instead of refusing
        if signum == signal.SIGINT and self.accelerator.is_main_process:
            print("\nCtrl-C: saving a checkpoint at the next step boundary, then exiting "
                  f"(exit code {PREEMPTED_EXIT_CODE}); Ctrl-C again to abort without saving",
                  file=sys.stderr, flush=True)
        elif name != signal.Signals(signum).name:  # each rank sees its launcher go: each says so
            print(f"[rank {os.environ.get('RANK', '0')}] {name}: saving a checkpoint at the next step boundary, "
                  f"then exiting (exit code {PREEMPTED_EXIT_CODE}); re-run the same command to resume",
                  file=sys.stderr, flush=True)

    def requested(self) -> bool:
        """True on every rank if any rank received a signal. Collective: call on every rank."""
        if self.accelerator.num_processes == 1:
            return self.signal is not None
        flag = torch.tensor([0 if self.signal is None else 1])  # on the host: no device sync
        torch.distributed.all_reduce(flag, group=self.group)  # sum; the default group is gloo on CPU
        if flag.item() > 0:
            mark_stopping()  # on the main process, which holds the run lock, also when another rank was signalled
        return bool(flag.item() > 0)


def _is_peer_failure(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, getattr(torch.distributed, "DistError", ())) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def run_main(main) -> None:
    """Run `main()`; on an exception print it once (the rank that failed) and end the process now.

    `os._exit` skips interpreter shutdown, which could block on a dead peer (process-group
    teardown, DataLoader workers, trackers). Exit codes: 0 done, 75 preempted, 1 failed, 2 a
    `UsageError` (a column or split the data does not have).

    A run that ends normally shuts the interpreter down as usual (atexit handlers, files closed),
    without its last garbage collection: with transformers imported (it brings torch's compiler
    stack and sympy) that walk of every object took 2-7 s per process on a 2-core VM and freed
    nothing a dying process needs; `gc.freeze()` first cuts the exit to ~0.5 s.

    A crash in native code (a segfault or abort in a kernel, a communication library or a decoder)
    would end the process without a word; `faulthandler` prints every thread's Python stack first.
    """
    faulthandler.enable(file=sys.stderr, all_threads=True)
    try:
        main()
    except SystemExit:
        gc.freeze()
        raise
    except BaseException as e:  # noqa: BLE001 — KeyboardInterrupt too: stop now, do not hang
        rank = os.environ.get("RANK", "0")
        if isinstance(e, (RunError, ConfigError)):  # ConfigError: a saved config.yaml a tool reads
            print(f"[rank {rank}] error: {e}", file=sys.stderr)
        elif isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" writing {e.filename}" if e.filename else ""
            print(f"[rank {rank}] error: the disk is full{where} ({e.strerror}): free space there, or point "
                  f"--output_dir / --data_cache_dir at a disk with room; re-running resumes from the last "
                  f"complete checkpoint", file=sys.stderr)
        elif isinstance(e, KeyboardInterrupt):
            print(f"[rank {rank}] aborted (Ctrl-C twice): no checkpoint saved since the last one", file=sys.stderr)
        elif _is_peer_failure(e):
            print(f"[rank {rank}] stopping: another process stopped (killed, or failed: its error, if "
                  f"it could print one, is in its own output) ({type(e).__name__})", file=sys.stderr)
        else:
            traceback.print_exc()
            print(f"[rank {rank}] FAILED with {type(e).__name__} (traceback above)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if isinstance(e, KeyboardInterrupt) else getattr(e, "exit_code", 1))
    gc.freeze()
