"""A training process stops once its launcher is gone (common.training.launcher): during start-up at once,
during training at the next step boundary, as on a preemption. A process no launcher started goes on."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from common.training.launcher import LAUNCHER_PID_ENV, launched, launcher_pid
from tests.harness.harness import ROOT

# What a training script does: the start-up handlers first; in "training", Preemption deferred and
# polled at each "step" as save_or_preempt polls it. "late": the launcher ends before the start-up
# handlers run (seconds of interpreter start on a loaded machine): the worker waits for its parent to go.
WORKER = """
import os, sys, time
if sys.argv[1] == "late":
    parent = os.getppid()
    print("started", flush=True)
    while os.getppid() == parent:
        time.sleep(0.05)
from common.config import exit_on_signals_during_start_up
exit_on_signals_during_start_up()
if sys.argv[1] == "training":
    import torch
    from common.training.faults import Preemption
    class Accelerator:
        num_processes, is_main_process, device = 1, True, torch.device("cpu")
    preemption = Preemption(Accelerator())
    preemption.defer()
import threading  # whether this process watches its launcher (common.training.launcher.watch_launcher's thread)
print("watching" if any(t.name == "launcher-watch" for t in threading.enumerate()) else "not watching", flush=True)
print("ready", flush=True)
for step in range(600):  # 60 s
    time.sleep(0.1)
    if sys.argv[1] == "training" and preemption.requested():
        print(f"saved step {step}", flush=True)
        sys.exit(75)
print("went on to the end", flush=True)
"""

# A launcher as torch's elastic agent is one: the worker in a session of its own, so that killing
# the launcher's process group leaves it running. "{pid}" in a variable's value: the launcher's pid.
LAUNCHER = """
import os, subprocess, sys
extra = {k: v.format(pid=os.getpid()) for k, v in eval(sys.argv[4]).items()}
with open(sys.argv[2], "w") as log:
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[3]], stdout=log, stderr=log,
                              start_new_session=True, env={**os.environ, **extra})
print(worker.pid, flush=True)
worker.wait()
"""

# torch's elastic agent's (`torchrun`, `accelerate launch` with several processes), accelerate's
# one-process launcher's: every variable each puts in its workers' environment (launcher.py)
ELASTIC = {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SIMPLE = {"ACCELERATE_USE_CPU": "False", "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO",
          "ACCELERATE_DYNAMO_MODE": "default", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
          "ACCELERATE_DYNAMO_USE_DYNAMIC": "False", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False"}
START_UP = "during start-up: stopping (nothing to save yet; exit code 75)\n"
GONE_BEFORE = "the launcher (already gone when this process looked: its parent is pid {reaper}) ended " + START_UP


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # an orphan's new parent may not reap it
    except psutil.NoSuchProcess:
        return True


def _log_has(log, line: str) -> bool:
    return line in (log.read_text() if log.exists() else "")


@pytest.mark.parametrize("phase,launcher_env,expected", [
    ("start-up", ELASTIC, "the launcher (pid {launcher}) ended " + START_UP),
    ("training", SIMPLE,
     "[rank 0] the launcher (pid {launcher}) ended: saving a checkpoint at the next step boundary, then exiting "
     "(exit code 75); re-run the same command to resume\nsaved step "),
    # the launcher ended before the worker's first look: its parent is already the reaper
    ("late", ELASTIC, GONE_BEFORE), ("late", SIMPLE, GONE_BEFORE),
    ("late", {LAUNCHER_PID_ENV: "{pid}"}, "the launcher (pid {launcher}) ended " + START_UP),  # builtin_base's
    # `nohup python train.py &`, its shell gone, with settings a user keeps in a shell: it trains on
    ("training", {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "true", "MASTER_PORT": "29500"}, "went on"),
])
def test_a_worker_stops_when_its_launcher_is_killed(tmp_path, phase, launcher_env, expected):
    env = {k: v for k, v in os.environ.items() if k not in (*ELASTIC, *SIMPLE, LAUNCHER_PID_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    log = tmp_path / "worker.log"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER, str(log), phase, repr(launcher_env)],
                                env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = int(launcher.stdout.readline())
    try:
        deadline = time.monotonic() + 60  # only a hung start fails here
        while not _log_has(log, "started\n" if phase == "late" else "ready\n"):
            assert time.monotonic() < deadline and not ended(worker), log.read_text()
            time.sleep(0.05)
        os.killpg(launcher.pid, signal.SIGKILL)  # `kill -9 -- -<pgid>`: the launcher alone
        launcher.wait()
        reaper = psutil.Process(worker).ppid()
        if expected != "went on":
            deadline = time.monotonic() + 30  # the watcher looks every 0.5 s; the rest is exiting under load
            while not ended(worker) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ended(worker), log.read_text()
        else:  # no watcher was started, so nothing can stop it: it runs on after its launcher's end
            assert not ended(worker) and log.read_text() == "not watching\nready\n"
    finally:
        if not ended(worker):
            os.kill(worker, signal.SIGKILL)
    text = "".join(line for line in log.read_text().splitlines(keepends=True)
                   if line not in ("started\n", "ready\n", "watching\n", "not watching\n"))
    if expected != "went on":
        assert text.startswith(expected.format(launcher=launcher.pid, reaper=reaper)), text
        assert "Traceback" not in text


def test_only_a_launched_process_is_watched():
    """Decided from what only a launcher puts in the environment, all of it: not from a setting a
    user keeps in a shell (`export ACCELERATE_MIXED_PRECISION=no`), nor srun's / mpirun's ranks."""
    assert launched(ELASTIC) and launched(SIMPLE) and launched({LAUNCHER_PID_ENV: "1"})
    assert not launched({"ACCELERATE_MIXED_PRECISION": "no"})
    assert not launched({k: v for k, v in SIMPLE.items() if k != "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"})
    assert not launched({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_a_reaper_is_not_taken_for_the_launcher(monkeypatch):
    """The parent seen at the first look is the launcher when it runs this Python (a launcher
    starts its workers with its own), or holds this process's launch variables (a wrapper it
    started); a reaper that adopted an orphan (init, tini, `systemd --user`) does neither."""
    sleeper = subprocess.Popen(["sh", "-c", "echo started; sleep 30"], env={**os.environ, **ELASTIC},
                               stdout=subprocess.PIPE, text=True, start_new_session=True)  # a wrapper: not Python
    try:
        assert sleeper.stdout.readline() == "started\n"  # its environment is readable once it runs
        monkeypatch.setattr(os, "getppid", lambda: sleeper.pid)
        assert launcher_pid(ELASTIC) == sleeper.pid
        assert launcher_pid({**ELASTIC, "TORCHELASTIC_RUN_ID": "another run"}) is None
        monkeypatch.setattr(os, "getppid", lambda: os.getpid())  # this very Python
        assert launcher_pid(SIMPLE) == os.getpid()
        monkeypatch.setattr(os, "getppid", lambda: 1)
        assert launcher_pid(ELASTIC) is None or psutil.Process(1).exe() == psutil.Process().exe()
    finally:
        os.killpg(sleeper.pid, signal.SIGKILL)  # its sleep too
        sleeper.communicate()


def test_the_built_in_base_names_its_launcher(tmp_path, monkeypatch):
    """common.training.builtin_base starts its child with our pid in LAUNCHER_PID_ENV and none of
    this run's launch variables: the child watches us, exactly, from its first look."""
    from common.training import builtin_base

    seen = {}

    class Child:  # the child's Popen: records its environment, fails at once
        def __init__(self, command, env):
            seen.update(env)

        def wait(self):
            return 1

    monkeypatch.setattr(builtin_base.subprocess, "Popen", Child)
    for k, v in {**ELASTIC, **SIMPLE}.items():  # this run was launched
        monkeypatch.setenv(k, v)
    script = tmp_path / "recipe" / "train.py"
    script.parent.mkdir()
    script.write_text("")
    with pytest.raises(Exception, match="the built-in base's training failed"):
        builtin_base.builtin_base(script, [], str(tmp_path / "cache"), log=lambda *_: None)
    assert seen[LAUNCHER_PID_ENV] == str(os.getpid()) and launched(seen)
    assert not {*ELASTIC, *SIMPLE} & set(seen)
