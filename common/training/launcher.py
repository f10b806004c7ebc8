"""A training process does not outlive its launcher.

`accelerate launch` with several processes, and `torchrun`, run torch's elastic agent, which starts
every training process in a session of its own. A scheduler or a user that SIGKILLs the launcher's
process group (`kill -9 -- -<pgid>`) therefore kills the launcher alone, and its training processes
would train on to the end, holding the output folder: the re-launch made at once would be refused.
(`accelerate launch` with one process starts the script in its own group: a group kill ends both,
a SIGKILL to the launcher's pid alone does not.)

`watch_launcher` polls, in a daemon thread, whether this process's parent is still the launcher it
started under. Once it is not, it sends this process SIGTERM: the one path every stop takes
(`common.config.exit_on_signals_during_start_up` during start-up, `common.training.faults.Preemption` after):
save at the next step boundary, mark the run lock `stopping` so that a re-launch waits for the save,
exit 75. Why not `prctl(PR_SET_PDEATHSIG)`: Linux only, it fires when the parent *thread* that
started us ends (not the process), and it needs the same parent check for a launcher that died
before it was set. A `getppid()` every `POLL_S` costs microseconds.

Only a process started by a launcher is watched: `python train.py` run under `nohup` from a shell
that then exits must go on training.
"""

from __future__ import annotations

import os
import signal
import threading
import time

POLL_S = 0.5  # seconds between two looks at the parent pid: a re-launch starts in several seconds
STOP_SIGNAL = signal.SIGTERM

_gone: int | None = None  # the launcher's pid, once it has gone


def launched(env) -> bool:
    """Whether the launcher that started this process is our parent: torch's elastic agent
    (`torchrun`, `accelerate launch` with several processes) or `accelerate launch` with one."""
    return "TORCHELASTIC_RUN_ID" in env or "ACCELERATE_MIXED_PRECISION" in env


def watch_launcher(env=None, poll_s: float = POLL_S) -> threading.Thread | None:
    """Under a launcher, start the daemon thread that sends this process `STOP_SIGNAL` once its
    parent (the launcher) is gone. Returns the thread (None when not launched)."""
    if not launched(os.environ if env is None else env):
        return None
    parent = os.getppid()

    def watch():
        global _gone
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:  # re-parented to init or a subreaper: the launcher has ended
                _gone = parent
                os.kill(os.getpid(), STOP_SIGNAL)
                return

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def stop_reason(signum: int) -> str:
    """What stopped us, for the one line the signal handlers print: 'the launcher (pid N) ended'
    when the watcher sent the signal, else the signal's name."""
    if _gone is not None and signum == STOP_SIGNAL:
        return f"the launcher (pid {_gone}) ended"
    return signal.Signals(signum).name
