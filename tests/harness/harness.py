"""Drive recipes through their real command line: `accelerate launch ... recipes/<name>/train.py`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "harness" / "support"  # sitecustomize: write audit, fault injection
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
# Whether run() starts its runs through `accelerate launch` (fresh interpreters, the real launcher):
# set per test by the `accelerate_launch` mark (tests/conftest.py). Every recipe keeps such tests for
# each guarantee, in 1 and 2 processes.
REAL_LAUNCH = [False]
# KILL_LEG: which legs of a cut run go through the real launcher in those tests. A SIGKILL takes every
# process of the tree at once, the launcher's too, so what a kill leaves on disk does not depend on
# who started the processes; what a launcher could change is how a run starts from what is on disk.
# So the leg that resumes and ends the run is the real launcher's, the killed leg too in each
# recipe's 1-process test (the whole cut run under `accelerate launch`), and forked in the others.
# A signal the launcher forwards (SIGTERM or Ctrl-C to its group) or the launcher killed alone keeps
# it in the legs that receive them.
# The other runs are forked from a server that has done the imports (tests/harness/zygote.py): one
# process as `python train.py`, several as cpu_ddp.yaml's DDP ranks. HARNESS_FORK=0 turns that off
# (each run a fresh interpreter: `python train.py`, or `accelerate launch` for several processes).
FORK = os.environ.get("HARNESS_FORK", "1") != "0"


# Under pytest-xdist, the workers' runs share the machine's cores through CPU tokens (lock files,
# RUNS_PER_CORE run slots per core, in a folder all workers see, set by tests/conftest.py): a run of
# n processes holds a slot on n cores (at most all of them) while it runs, and runs on those cores
# only (its CPU affinity), so a recipe's automatic thread count (cores it may use ÷ its processes)
# gives it one thread per core.
# Without tokens, a two-process DDP run sharing the cores with another worker's run waits in its
# collectives spinning; without the affinity, every one-process run took 2 threads on its 1 token
# and two of them at once ran 4 threads on 2 cores, spinning in OpenMP's barriers (measured: a
# 60-step run 10x slower, README "Tests"). Runs started while this process holds tokens (a run
# started from another's callback) take none, and keep the machine's cores.
TOKENS_DIR = "HARNESS_CPU_TOKENS"
# Runs of one thread a process may share a core, RUNS_PER_CORE of them (HARNESS_RUNS_PER_CORE): a
# tiny run waits much of its time (its start-up's file reads, saves, a test's polling), and one
# thread cannot spin in OpenMP barriers. A run of several threads a process takes whole cores.
RUNS_PER_CORE = max(1, int(os.environ.get("HARNESS_RUNS_PER_CORE", "2")))
_held = [0]


@contextlib.contextmanager
def cpu_tokens(n: int, whole_cores: bool = False):
    """Hold a run slot on each of n cores while the block runs (every slot of them with `whole_cores`,
    for runs of several threads a process); yields the cores (None: no tokens, any core)."""
    folder = os.environ.get(TOKENS_DIR)
    if not folder or _held[0]:
        yield None
        return
    import fcntl

    cores = sorted(os.sched_getaffinity(0))  # token i is the i-th core this process may use
    n = min(n, len(cores))
    # slot[i][s]: a lock file per run slot of core i, `core{i}`, then `core{i}.{s}` for its other slots;
    # claim[i]: held by the one run waiting for core i, so that one-slot runs leave its next free slot to it.
    slot = [[open(os.path.join(folder, f"core{i}" + (f".{s}" if s else "")), "w") for s in range(RUNS_PER_CORE)]
            for i in range(len(cores))]
    claim = [open(os.path.join(folder, f"core{i}.claim"), "w") for i in range(len(cores))]

    def take(f, block: bool = False) -> bool:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
            return True
        except BlockingIOError:
            return False

    def claimed(i: int) -> bool:
        if not take(claim[i]):
            return True
        fcntl.flock(claim[i], fcntl.LOCK_UN)
        return False

    try:
        if n == 1 and not whole_cores:  # one slot: slot 0 of every core first, so runs share a core only when all do
            order = [(s, i) for s in range(RUNS_PER_CORE) for i in range(len(cores))]
            while not (held := next(([i] for s, i in order if not claimed(i) and take(slot[i][s])), None)):
                time.sleep(0.02)
        else:  # cores 0..n-1 in order: a run holding core i waits only for cores above it (no deadlock)
            held = []
            for i in range(n):
                take(claim[i], block=True)  # one claimant a core at a time
                if whole_cores:  # every slot of it, in order
                    for f in slot[i]:
                        take(f, block=True)
                else:  # any one of its slots
                    while not any(take(f) for f in slot[i]):
                        time.sleep(0.02)
                fcntl.flock(claim[i], fcntl.LOCK_UN)
                held.append(i)
        _held[0] = n
        yield [cores[i] for i in held]
    finally:
        _held[0] = 0
        for f in (*claim, *(f for core in slot for f in core)):
            f.close()  # releases its lock


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_flag_wins(args) -> list[str]:
    """`--key value` arguments with each key once, at its first place with its last value: a test's
    own flags after its shared ones (TINY) replace them, as the recipes refuse a flag given twice."""
    items, where, i = [], {}, 0
    args = [str(a) for a in args]
    while i < len(args):
        key, has_value, _ = args[i].partition("=")
        takes_next = (args[i].startswith("--") and not has_value and i + 1 < len(args)
                      and not args[i + 1].startswith("--"))
        item = args[i : i + 1 + takes_next]
        i += len(item)
        name = key.replace("-", "_") if key.startswith("--") else None
        if name is not None and name in where:
            items[where[name]] = item
            continue
        if name is not None:
            where[name] = len(items)
        items.append(item)
    return [a for item in items for a in item]


def command(recipe: str, nproc: int, args: list[str], profile: str = "cpu_ddp.yaml",
            launcher: bool = True) -> list[str]:
    """The launch command; `profile` (an accelerate_configs/ file) is used for nproc > 1. `recipe`: a
    folder of recipes/, or a `train.py` path relative to the repository (a test recipe).
    `launcher=False` with one process: `python train.py` itself, as a user may run it too (the
    launcher's own start-up, ~1.5 s of imports, is then spared)."""
    script = ROOT / recipe if recipe.endswith(".py") else ROOT / "recipes" / recipe / "train.py"
    args = last_flag_wins(args)
    if nproc == 1 and not launcher:
        return [sys.executable, str(script), *args]
    if nproc == 1:
        launch = ACCELERATE + ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                               "--dynamo_backend", "no"]
    else:
        launch = ACCELERATE + ["--config_file", str(ROOT / "accelerate_configs" / profile),
                               "--num_processes", str(nproc), "--main_process_port", str(free_port())]
    return launch + [str(script), *args]


def base_env(env: dict | None = None) -> dict:
    """The environment of a run: ours, unbuffered, one OpenMP thread, this checkout first on the path
    (an `env` PYTHONPATH adds to it, never replaces it), then `env`."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (full_env.get("PYTHONPATH"), str(ROOT)) if p)
    return full_env


class Forked:
    """A run forked by the zygote: the part of `subprocess.Popen` the harness and tests use. `pid` is
    the run's own process (signal it, psutil it); its exit status comes from the server, its parent."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self._conn, self.returncode = pid, conn, None

    def _read(self, timeout: float | None) -> None:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                msg = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return
            if not msg:
                raise RuntimeError(f"the fork server died before reporting run {self.pid}'s exit")
            self.returncode = json.loads(msg)["returncode"]
            self._conn.close()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked run {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended and reaped by the server; its status is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedGroup:
    """Several forked ranks of one DDP run, with what torch's elastic agent (`accelerate launch
    --config_file accelerate_configs/cpu_ddp.yaml`) does around them: it reports 0 when every rank
    ended with 0, else 1; once a rank has failed it SIGTERMs the others, and SIGKILLs them 30 s later
    (here preceded by a SIGABRT, whose faulthandler stack dump shows in the log where a rank hung).
    It has no launcher to signal: a test about the launcher itself (SIGTERM or Ctrl-C to it, the
    launcher killed) is marked `accelerate_launch` and gets the real one."""

    STOP_GRACE_S = 30.0  # the agent's wait between SIGTERM and SIGKILL

    def __init__(self, ranks: list[Forked], log=None):
        self.ranks, self.pid, self.returncode, self._stopping = ranks, ranks[0].pid, None, None
        self._log = getattr(log, "name", None)  # the log's path: a rank that had to be SIGKILLed is named there

    def poll(self) -> int | None:
        if self.returncode is None:
            codes = [r.poll() for r in self.ranks]
            if None not in codes:
                self.returncode = 0 if not any(codes) else 1
            elif any(codes) and self._stopping is None:  # a rank failed: stop the others
                self._stopping = time.monotonic()
                for r in self.ranks:
                    r.send_signal(signal.SIGTERM)
            elif self._stopping is not None and time.monotonic() - self._stopping > self.STOP_GRACE_S:
                hung = [i for i, code in enumerate(codes) if code is None]
                if isinstance(self._log, str):
                    with open(self._log, "a") as log:
                        log.write(f"[harness] rank(s) {hung} still running {self.STOP_GRACE_S:.0f} s after SIGTERM "
                                  f"(exit statuses so far {codes}): SIGABRT (the recipe's faulthandler prints each "
                                  f"thread's stack), then SIGKILL, as torch's elastic agent does\n")
                for i in hung:  # where it hangs, for the log: the agent itself sends SIGKILL only
                    self.ranks[i].send_signal(signal.SIGABRT)
                deadline = time.monotonic() + 5.0
                while any(self.ranks[i].poll() is None for i in hung) and time.monotonic() < deadline:
                    time.sleep(0.05)
                for r in self.ranks:
                    r.send_signal(signal.SIGKILL)
                self._stopping = float("inf")  # once
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("forked ranks", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        raise NotImplementedError("forked ranks have no launcher to signal: mark the test "
                                  "@pytest.mark.accelerate_launch to run it under the real launcher")

    terminate = send_signal

    def kill(self) -> None:
        for r in self.ranks:
            r.kill()


def ddp_env(rank: int, world: int, port: int) -> dict:
    """What `accelerate launch --config_file accelerate_configs/cpu_ddp.yaml` adds to a worker's
    environment (tests/harness/test_harness.py compares it with the real launcher's), less the agent's
    own channels: no TORCHELASTIC_USE_AGENT_STORE (rank 0 hosts the rendezvous store itself) and no
    TORCHELASTIC_ERROR_FILE."""
    return {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DYNAMO_MODE": "default",
            "ACCELERATE_DYNAMO_USE_DYNAMIC": "False", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
            "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False", "ACCELERATE_MIXED_PRECISION": "no",
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "WORLD_SIZE": str(world)}


_servers: dict[str, dict] = {}  # environment -> its fork server {"proc", "path", "env"}, last used last
MAX_SERVERS = 3  # each holds torch & co. imported (~0.5 GB)


def _server(env: dict) -> dict:
    """The fork server for `env`, started with it: its imports see what the run's fresh interpreter
    would see (HF_* caches and switches are read on import; an in-process import may have set a
    variable in the suite, e.g. TOKENIZERS_PARALLELISM, that a fresh interpreter would inherit)."""
    key = json.dumps(sorted((k, v) for k, v in env.items() if not k.startswith("PYTEST_")))
    server = _servers.pop(key, None)
    if server is not None and server["proc"].poll() is not None:
        server = None
    if server is None:
        import atexit
        import tempfile

        folder = tempfile.mkdtemp(prefix="zygote")
        atexit.register(shutil.rmtree, folder, True)  # after the kill below (atexit runs last-in first)
        path = os.path.join(folder, "socket")
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "harness" / "zygote.py"), path], cwd=ROOT,
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(path + ".log", "w"), start_new_session=True)
        atexit.register(proc.kill)
        server = {"proc": proc, "path": path, "env": env}
        if os.environ.get("HARNESS_LAUNCH_LOG"):  # suite profiling: which environments cost a server
            with open(os.environ["HARNESS_LAUNCH_LOG"], "a") as f:
                ours = base_env()
                f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "server": {
                    k: env.get(k) for k in sorted(set(env) | set(ours)) if env.get(k) != ours.get(k) and not k.startswith("PYTEST_")}}) + "\n")
    _servers[key] = server
    while len(_servers) > MAX_SERVERS:
        oldest = _servers.pop(next(iter(_servers)))
        oldest["proc"].kill()
        oldest["proc"].wait()
        shutil.rmtree(os.path.dirname(oldest["path"]), ignore_errors=True)
    return server


def _ready(server: dict) -> dict:
    """`server` once it listens (it is importing until its socket exists)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(server["path"]):
        if server["proc"].poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the fork server did not start: {open(server['path'] + '.log').read()[-2000:]}")
        time.sleep(0.02)
    return server


def _fork_one(server: dict, argv: list[str], env: dict, outs: list, cwd: Path = ROOT, hook: str | None = None,
              cpus: list[int] | None = None) -> Forked:
    _ready(server)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(server["path"])
    request = {"argv": argv, "cwd": str(cwd), "env": env, "sitecustomize": hook, "cpus": cpus}
    socket.send_fds(conn, [json.dumps(request).encode()], [f.fileno() for f in outs])
    return Forked(json.loads(conn.recv(4096))["pid"], conn)


# tests/harness/support/sitecustomize.py's switches that patch accelerate's classes (Accelerator.backward,
# prepare, save_state, save_model): a patch made after the fork, in the child, acts as one made at the start of
# a fresh interpreter. The others wrap module functions that this checkout's modules, imported by the
# fork server, already hold (the write audit's safetensors wrapper, ENOSPC_AT_SAFETENSORS) or change
# how accelerate decides its state (FORCE_*_ON_CPU, other profiles anyway): fresh interpreters.
FORKABLE_HOOKS = ("SLOW_SAVE", "SLOW_EXPORT", "INJECT_FAULT", "ENOSPC_AT_SAVE", "DUMP_PREPARED")
HOOKS = (*FORKABLE_HOOKS, "AUDIT_WRITES_DIR", "ENOSPC_AT_SAFETENSORS", "FORCE_FSDP_ON_CPU", "FORCE_DEEPSPEED_ON_CPU")
# Variables this checkout reads when a run needs them, never on import (the cache root: common/data/cache.py): a
# run that sets its own is forked by the server of the suite's value (the child has the run's, as every variable)
# instead of costing a server of its own (~5 s of imports).
READ_WHEN_RUN = ("SPEECH_RECIPES_CACHE",)


def fork(argv: list[str], nproc: int, env: dict, log, err=None, cwd: Path = ROOT,
         cpus: list[int] | None = None) -> Forked | ForkedGroup | None:
    """`python <argv>` (one process: a script or `-m module`) or its `nproc` DDP ranks (`env` plus
    `ddp_env`), forked by the fork server for `env`, writing to `log` (and `err` for stderr, if
    given), on the cores `cpus` (None: any). A run with tests/harness/support on its path gets its sitecustomize executed in the child
    (as `site` does at an interpreter's start) when it only uses FORKABLE_HOOKS. None (start fresh
    interpreters) for any other change of the module path."""
    base = base_env()["PYTHONPATH"]
    paths = lambda p: list(dict.fromkeys(p.split(os.pathsep)))  # noqa: E731 (a repeated entry changes nothing)
    hook = None
    if paths(env.get("PYTHONPATH", "")) == [str(SUPPORT), *paths(base)] and all(
            k in FORKABLE_HOOKS for k in env if k in HOOKS):
        hook = str(SUPPORT / "sitecustomize.py")
    if not FORK or (paths(env.get("PYTHONPATH", "")) != paths(base) and hook is None):
        return None
    # The server's own environment: the run's, less the hooks (read by the child's sitecustomize only)
    server = _server({k: v for k, v in env.items() if k not in (*HOOKS, *READ_WHEN_RUN)}
                     | {k: os.environ[k] for k in READ_WHEN_RUN if k in os.environ} | {"PYTHONPATH": base})
    outs = [log] if err is None else [log, err]
    if nproc == 1:
        return _fork_one(server, argv, env, outs, cwd, hook, cpus)
    port = free_port()
    return ForkedGroup([_fork_one(server, argv, {**env, **ddp_env(r, nproc, port)}, outs, cwd, hook, cpus)
                        for r in range(nproc)], log)


# `accelerate launch SCRIPT ARGS...` as `python SCRIPT ARGS...` forked by a fork server (`accelerate_stand_in`):
# started with -S (no site: the standard library is all it imports, ~20 ms instead of a recipe's ~5 s of imports).
_STAND_IN = """#!{python} -S
import json, os, signal, socket, sys
if sys.argv[1:2] != ["launch"]:
    sys.exit(f"{{sys.argv[0]}}: the suite's stand-in takes `launch SCRIPT [ARGS...]` only, not {{sys.argv[1:]}}")
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect({path!r})
request = {{"argv": sys.argv[2:], "cwd": os.getcwd(), "env": dict(os.environ), "sitecustomize": None,
           "cpus": sorted(os.sched_getaffinity(0))}}  # the script's cores (the test's CPU tokens), as taskset would
socket.send_fds(conn, [json.dumps(request).encode()], [1, 2])
pid = json.loads(conn.recv(4096))["pid"]
for sig in (signal.SIGTERM, signal.SIGINT):  # stopped as a launcher is: the run is told the same way
    signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
code = json.loads(conn.recv(4096))["returncode"]
sys.exit(code if code >= 0 else 128 - code)  # killed by signal N: the shell's 128 + N
"""


def accelerate_stand_in(folder: Path) -> Path:
    """An `accelerate` for a shell script under test (recipes/*/transfer.sh's $ACCELERATE), written into
    `folder`: its `accelerate launch SCRIPT ARGS...` runs `python SCRIPT ARGS...` in one process, forked
    by the fork server (a run's ~5 s of imports spared, as for `run`), with the script's working
    directory, environment (what the server's imports read is the suite's: the script's own variables,
    BASE or OUT, are read by no import), cores and stdout/stderr; its exit status is the run's (a fresh
    interpreter with HARNESS_FORK=0). Such a test tests the script's plumbing, not the launcher: every
    recipe's `accelerate_launch` tests do."""
    shim = folder / "accelerate"
    if FORK:
        server = _ready(_server({k: v for k, v in base_env().items() if k not in HOOKS}))
        shim.write_text(_STAND_IN.format(python=sys.executable, path=server["path"]))
    else:  # HARNESS_FORK=0: a fresh interpreter
        shim.write_text(f'#!/bin/sh\n[ "$1" = launch ] || {{ echo "$0: the suite\'s stand-in takes \\`launch SCRIPT '
                        f'[ARGS...]\\` only, not $*" >&2; exit 1; }}\nshift\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    return shim


def on_cores(cpus: list[int] | None):
    """Popen's preexec_fn that runs the new process (and whatever it starts) on the cores `cpus`."""
    return None if cpus is None else lambda: os.sched_setaffinity(0, cpus)


def python(argv: list, *, nproc: int = 1, env: dict | None = None, cwd: Path = ROOT, timeout: float = 300,
           stderr_to_stdout: bool = False) -> subprocess.CompletedProcess:
    """`python <argv>` (a script and its arguments, or "-m", a module and its) with `base_env(env)`,
    waited for, its stdout and stderr captured as text (stderr in stdout if `stderr_to_stdout`).
    With `nproc` > 1 its DDP ranks, as `accelerate launch --config_file cpu_ddp.yaml` starts them.
    Forked from the fork server (the tools — decode, score, synthesize, export — spared their ~5 s
    of imports), or run in a fresh interpreter when a fork cannot stand for one (see `fork`)."""
    import tempfile

    argv, full_env = [str(a) for a in argv], base_env(env)
    with tempfile.TemporaryFile("w+", errors="replace") as out, tempfile.TemporaryFile("w+", errors="replace") as err, \
            cpu_tokens(nproc) as cpus:
        proc = fork(argv, nproc, full_env, out, None if stderr_to_stdout else err, cwd, cpus)
        if proc is None:
            cmd = [sys.executable, *argv] if nproc == 1 else command(argv[0], nproc, argv[1:])  # a script's ranks
            proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=out, stderr=out if stderr_to_stdout else err,
                                    start_new_session=True, preexec_fn=on_cores(cpus))
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, proc.returncode, out.read(), err.read())


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it at once, as a scheduler killing the job
    would. (torch's elastic agent starts its workers in sessions of their own, so killing the
    launcher's process group alone misses them: they stop on their own once they notice, through a
    save, see common/training/launcher.py.)"""
    procs = []
    for pid in [r.pid for r in proc.ranks] if isinstance(proc, ForkedGroup) else [proc.pid]:
        try:
            procs.append(psutil.Process(pid))
            procs += procs[-1].children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    proc.wait()


def worker(proc: subprocess.Popen, rank: int) -> psutil.Process:
    """The training process of `rank` under a launcher (or `proc` itself, started without one)."""
    if isinstance(proc, ForkedGroup):
        return psutil.Process(proc.ranks[rank].pid)
    cmd = psutil.Process(proc.pid).cmdline()
    if rank == 0 and (isinstance(proc, Forked) or len(cmd) > 1 and cmd[1].endswith("train.py")):
        return psutil.Process(proc.pid)  # `python train.py ...` (or its fork), no launcher
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK", "0") == str(rank) and "train.py" in " ".join(child.cmdline()):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise LookupError(f"no rank {rank} worker under {proc.pid}")


def checkpoint_exists(step: int):
    return lambda out: (out / "checkpoints" / f"step_{step:08d}" / "COMPLETE").exists()


def run(recipe: str, nproc: int, args: list[str], *, env: dict | None = None, timeout: float = 600,
        kill_after_checkpoint: int | None = None, when=None, then=None, expect_rc: int | None = 0,
        profile: str = "cpu_ddp.yaml", launcher: bool | None = None) -> str:
    """Launch a recipe and wait for it; return its log.

    `launcher` (default: the test's `accelerate_launch` mark, see tests/conftest.py): True starts
    `accelerate launch` (fresh interpreters under the real launcher); False forks the run from the
    fork server for the run's environment — `python train.py` in one process, cpu_ddp.yaml's ranks in
    several — or, where a fork cannot stand for it (an `env` that changes the module path: a
    sitecustomize; another profile), starts `python train.py` (one process) or `accelerate launch`.

    `when(output_dir)` is polled every 20 ms; the first time it is true, `then(proc)` runs once
    (e.g. `kill_tree`, or a signal to one rank). `kill_after_checkpoint=k` is short for killing the
    whole tree as soon as checkpoint k is complete (then the exit code is not checked).
    """
    if kill_after_checkpoint is not None:
        when, then, expect_rc = checkpoint_exists(kill_after_checkpoint), kill_tree, None
    out_dir = Path(args[args.index("--output_dir") + 1])
    full_env = base_env(env)
    log_path = out_dir.parent / f"{out_dir.name}.log"
    start = log_path.stat().st_size if log_path.exists() else 0
    real = REAL_LAUNCH[0] if launcher is None else launcher
    cmd = command(recipe, nproc, args, profile, launcher=real)
    # A run that asks for N threads per process (--num_threads) holds N tokens per process.
    threads = int(args[args.index("--num_threads") + 1]) if "--num_threads" in args else 0
    with cpu_tokens(nproc * max(1, threads), whole_cores=threads > 1) as cpus:
        with open(log_path, "a") as log:
            proc = None
            if not real and (nproc == 1 or profile == "cpu_ddp.yaml"):
                proc = fork(command(recipe, 1, args, launcher=False)[1:], nproc, full_env, log, cpus=cpus)
            if proc is None:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=on_cores(cpus))
        started = time.monotonic()
        deadline = started + timeout
        fired = False
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{recipe} run timed out; see {log_path}")
                if when is not None and not fired and when(out_dir):
                    then(proc)
                    fired = True
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                kill_tree(proc)
    if os.environ.get("HARNESS_LAUNCH_LOG"):  # suite profiling: one JSON line per launch
        with open(os.environ["HARNESS_LAUNCH_LOG"], "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "recipe": recipe,
                                "nproc": nproc, "forked": isinstance(proc, (Forked, ForkedGroup)),
                                "args": [a for a in args if a != str(out_dir)], "env": sorted(env or {}),
                                "seconds": round(time.monotonic() - started, 2)}) + "\n")
    with open(log_path, errors="replace") as f:
        f.seek(start)
        text = f.read()
    assert when is None or fired, f"the run ended before the awaited event:\n{text[-3000:]}"
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"exit {proc.returncode} (expected {expect_rc}):\n{text[-4000:]}"
    return text


TIMINGS = ("audio_s_per_s",)  # wall-clock figures: they differ between any two runs, by design


def metrics(out_dir: Path, timings: bool = False) -> list[dict]:
    """Rows of metrics.jsonl; without the wall-clock keys unless `timings` (they never repeat)."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return rows if timings else [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def assert_same_losses(a: Path, b: Path, key: str = "loss") -> None:
    """Same logged steps, each once, with equal `key` (the vocoder logs g_loss and d_loss)."""
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in mb] == [r["step"] for r in ma]
    assert len({r["step"] for r in mb}) == len(mb), "a step was logged twice"
    for ra, rb in zip(ma, mb):
        assert ra[key] == rb[key], f"step {ra['step']}: {ra[key]} != {rb[key]}"


def epoch_lengths(durations, max_batch_seconds: float, world: int, epochs: int, seed: int = 42,
                  accumulation: int = 1) -> list[int]:
    """Batches per rank in each epoch, as a recipe's sampler will make them from `durations`."""
    from common.data.loading import DurationBatchSampler

    s = DurationBatchSampler(durations, max_batch_seconds, seed=seed, multiple_of=world * accumulation)
    lengths = []
    for e in range(epochs):
        s.set_epoch(e)
        lengths.append(len(s) // world)
    return lengths


def resumed_positions(log: Path) -> list[tuple[int, int, int]]:
    """(step, epoch, batch) of every resume a recipe reported in its log."""
    return [tuple(map(int, m)) for m in
            re.findall(r"resumed from .*?: step (\d+), epoch (\d+), batch (\d+)", log.read_text())]
