"""A training process stops once its launcher is gone (common.training.launcher): during start-up at once,
during training at the next step boundary, as on a preemption. A process no launcher started goes on."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from common.training.launcher import launched
from tests.recipes.harness import ROOT

# What a training script does: the start-up handlers first; in "training", Preemption deferred and
# polled at each "step" as save_or_preempt polls it.
WORKER = """
import sys, time
from common.config import exit_on_signals_during_start_up
exit_on_signals_during_start_up()
if sys.argv[1] == "training":
    import torch
    from common.training.faults import Preemption
    class Accelerator:
        num_processes, is_main_process, device = 1, True, torch.device("cpu")
    preemption = Preemption(Accelerator())
    preemption.defer()
print("ready", flush=True)
for step in range(600):  # 60 s
    time.sleep(0.1)
    if sys.argv[1] == "training" and preemption.requested():
        print(f"saved step {step}", flush=True)
        sys.exit(75)
print("went on to the end", flush=True)
"""

# A launcher as torch's elastic agent is one: the worker in a session of its own, so that killing
# the launcher's process group leaves it running.
LAUNCHER = """
import subprocess, sys
with open(sys.argv[2], "w") as log:
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[3]], stdout=log, stderr=log,
                              start_new_session=True, env={**__import__("os").environ, **eval(sys.argv[4])})
print(worker.pid, flush=True)
worker.wait()
"""


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # an orphan's new parent may not reap it
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("phase,launcher_env,expected", [
    ("start-up", {"TORCHELASTIC_RUN_ID": "none"},  # torchrun, accelerate launch with several processes
     "the launcher (pid {}) ended during start-up: stopping (nothing to save yet; exit code 75)\n"),
    ("training", {"ACCELERATE_MIXED_PRECISION": "no"},  # accelerate launch with one process
     "[rank 0] the launcher (pid {}) ended: saving a checkpoint at the next step boundary, then exiting "
     "(exit code 75); re-run the same command to resume\nsaved step "),
    ("training", {}, "went on"),  # `nohup python train.py &`, its shell gone: it trains on
])
def test_a_worker_stops_when_its_launcher_is_killed(tmp_path, phase, launcher_env, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION")}
    env["PYTHONPATH"] = str(ROOT)
    log = tmp_path / "worker.log"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER, str(log), phase, repr(launcher_env)],
                                env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = int(launcher.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while "ready" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and not ended(worker), log.read_text()
            time.sleep(0.05)
        os.killpg(launcher.pid, signal.SIGKILL)  # `kill -9 -- -<pgid>`: the launcher alone
        launcher.wait()
        if launcher_env:
            deadline = time.monotonic() + 30  # the watcher looks every 0.5 s; the rest is exiting under load
            while not ended(worker) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ended(worker), log.read_text()
        else:
            time.sleep(2)  # 4 looks of a watcher, had one been started
            assert not ended(worker) and log.read_text() == "ready\n"
    finally:
        if not ended(worker):
            os.kill(worker, signal.SIGKILL)
    text = log.read_text().removeprefix("ready\n")
    if launcher_env:
        assert text.startswith(expected.format(launcher.pid)), text
        assert "Traceback" not in text


def test_only_a_launched_process_is_watched():
    assert launched({"TORCHELASTIC_RUN_ID": "1"}) and launched({"ACCELERATE_MIXED_PRECISION": "no"})
    assert not launched({"LOCAL_RANK": "0", "RANK": "0"})  # srun / mpirun start no launcher of ours
