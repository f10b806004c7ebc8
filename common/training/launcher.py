"""A training process does not outlive its launcher.

`accelerate launch` with several processes, and `torchrun`, run torch's elastic agent, which starts
every training process in a session of its own. A scheduler or a user that SIGKILLs the launcher's
process group (`kill -9 -- -<pgid>`) therefore kills the launcher alone, and its training processes
would train on to the end, holding the output folder: the re-launch made at once would be refused.
(`accelerate launch` with one process starts the script in its own group: a group kill ends both,
a SIGKILL to the launcher's pid alone does not.)

`watch_launcher` polls, in a daemon thread, whether this process's parent is still the launcher it
found at its first look (below). Once it is not, it sends this process SIGTERM: the one path every stop takes
(`common.config.exit_on_signals_during_start_up` during start-up, `common.training.faults.Preemption` after):
save at the next step boundary, mark the run lock `stopping` so that a re-launch waits for the save,
exit 75. Why not `prctl(PR_SET_PDEATHSIG)`: Linux only, it fires when the parent *thread* that
started us ends (not the process), and it needs the same parent check for a launcher that died
before it was set. A `getppid()` every `POLL_S` costs microseconds.

Only a process started by a launcher is watched (`launched`), decided from what only a launcher
puts in its workers' environment: `python train.py` run under `nohup` from a shell that then exits
must go on training, also with an `ACCELERATE_*` setting or two kept in that shell.

The launcher can end before the watcher first looks (seconds of imports on a loaded machine), and
neither torch's elastic agent nor accelerate names its own pid in a worker's environment (torch
2.14, accelerate 1.15): this process is then already an orphan, and its parent is whoever adopted it
(init, a subreaper). So the parent seen at that first look is the launcher only if it runs this very
Python executable (a launcher starts its workers with its own `sys.executable`) or carries this
process's launch variables (a wrapper the launcher started, e.g. `torchrun --no-python run.sh`);
init, tini or `systemd --user` do neither, and the launcher counts as gone. A launcher of ours
(`common.training.builtin_base`) names its pid in `LAUNCHER_PID_ENV`: no guess at all.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

POLL_S = 0.5  # seconds between two looks at the parent pid: a re-launch starts in several seconds
STOP_SIGNAL = signal.SIGTERM
LAUNCHER_PID_ENV = "SPEECH_RECIPES_LAUNCHER_PID"  # a launcher of ours puts its own pid here

# What torch's elastic agent gives every worker (torchrun, `accelerate launch` with several
# processes): torch/distributed/elastic/agent/server/local_elastic_agent.py, `_start_workers`.
ELASTIC_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What `accelerate launch` with one process writes on every launch, all of it (accelerate/utils/
# launch.py, `prepare_simple_launcher_cmd_env`): a user may keep a setting in a shell
# (ACCELERATE_MIXED_PRECISION), not the launcher's whole set of dynamo switches.
SIMPLE_LAUNCHER_ENV = ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND",
                       "ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_FULLGRAPH", "ACCELERATE_DYNAMO_USE_DYNAMIC",
                       "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION")

_gone: str | None = None  # once the launcher has ended: "the launcher (pid N)", for stop_reason


def launched(env) -> bool:
    """Whether a launcher started this process: torch's elastic agent (`torchrun`, `accelerate launch`
    with several processes), `accelerate launch` with one, or one of ours (LAUNCHER_PID_ENV)."""
    return (LAUNCHER_PID_ENV in env or all(k in env for k in ELASTIC_ENV)
            or all(k in env for k in SIMPLE_LAUNCHER_ENV))


def _is_launcher_side(pid: int, env) -> bool:
    """Whether process `pid` (our parent) is the launcher or a wrapper it started, not a reaper that
    adopted us after the launcher ended (module docstring)."""
    try:
        parent = psutil.Process(pid)
        if os.path.samefile(parent.exe(), psutil.Process().exe()):
            return True
        ours = [k for k in (*ELASTIC_ENV, *SIMPLE_LAUNCHER_ENV) if k in env]
        theirs = parent.environ()  # as it was started: a wrapper's holds the launcher's variables
        return bool(ours) and all(theirs.get(k) == env[k] for k in ours)
    except (psutil.Error, OSError):  # gone, a zombie, or not ours to read (root's init): not a launcher
        return False


def launcher_pid(env) -> int | None:
    """The pid of the launcher that started this (launched) process: the one a launcher of ours
    names, else our parent unless it is a reaper that adopted us (None: the launcher has ended)."""
    if LAUNCHER_PID_ENV in env:
        return int(env[LAUNCHER_PID_ENV]) if env[LAUNCHER_PID_ENV].isdigit() else None
    parent = os.getppid()
    return parent if parent > 0 and _is_launcher_side(parent, env) else None


def watch_launcher(env=None, poll_s: float = POLL_S) -> threading.Thread | None:
    """Under a launcher, start the daemon thread that sends this process `STOP_SIGNAL` once its
    launcher is gone, at once if it already is. Returns the thread (None when not launched)."""
    if env is None:
        env = dict(os.environ)
        os.environ.pop(LAUNCHER_PID_ENV, None)  # ours alone: a process we start is not our launcher's child
    if not launched(env):
        return None
    launcher = launcher_pid(env)

    def watch():
        global _gone
        while launcher is not None and os.getppid() == launcher:
            time.sleep(poll_s)
        # re-parented to init or a subreaper: the launcher has ended
        _gone = (f"the launcher (pid {launcher})" if launcher is not None else
                 f"the launcher (already gone when this process looked: its parent is pid {os.getppid()})")
        os.kill(os.getpid(), STOP_SIGNAL)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def stop_reason(signum: int) -> str:
    """What stopped us, for the one line the signal handlers print: 'the launcher (pid N) ended'
    when the watcher sent the signal, else the signal's name."""
    if _gone is not None and signum == STOP_SIGNAL:
        return f"{_gone} ended"
    return signal.Signals(signum).name
