"""Preemption and failure handling: every way a run can end says so clearly and loses no work.

- `Preemption`: SIGTERM / SIGUSR1 (SLURM `--signal`, Kubernetes, a user's `kill`) to any rank only
  sets a flag. At the next optimizer-step boundary all ranks agree (one all-reduce), save the same
  step, and exit with `PREEMPTED_EXIT_CODE`. Re-running the same command resumes exactly.
- `run_main`: an exception on one rank ends that process at once with its traceback; the peers'
  next collective then fails ("connection closed") and they exit with one line instead of a second
  traceback, or the launcher stops them. Nobody is left waiting at a barrier: collectives also
  time out after `ddp_timeout` seconds (see `common.distributed.build_accelerator`).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

import torch

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; the worker processes exit with it


class Preemption:
    """Turns SIGTERM/SIGUSR1 into a flag that all ranks agree on at step boundaries."""

    def __init__(self, accelerator, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.accelerator = accelerator
        self.signal: int | None = None
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        # Only a flag: the handler may run in the middle of anything (a save included), and a
        # second signal must not interrupt the save the first one asked for.
        if self.signal is None:
            self.signal = signum

    def requested(self) -> bool:
        """True on every rank if any rank received a signal. Collective: call on every rank."""
        flag = torch.tensor([0 if self.signal is None else 1], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, "sum")
        return bool(flag.item() > 0)


def _is_peer_failure(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, getattr(torch.distributed, "DistError", ())) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def run_main(main) -> None:
    """Run `main()`; on an exception print it once (the rank that failed) and end the process now.

    `os._exit` skips interpreter shutdown, which could block on a dead peer (process-group
    teardown, DataLoader workers, trackers). Exit codes: 0 done, 75 preempted, 1 failed.
    """
    try:
        main()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 — KeyboardInterrupt too: stop now, do not hang
        rank = os.environ.get("RANK", "0")
        if _is_peer_failure(e):
            print(f"[rank {rank}] stopping: another process failed ({type(e).__name__}); "
                  f"its error is printed above", file=sys.stderr)
        else:
            traceback.print_exc()
            print(f"[rank {rank}] FAILED with {type(e).__name__} (traceback above)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
