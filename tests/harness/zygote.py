"""A fork server for the suite's runs and tools: `python train.py ...` without the import start-up.

A recipe's process spends ~5 s importing torch, transformers and datasets before its first step, and
the suite starts ~100 of them. This server imports those once (and this checkout's common/), then
forks one child per run: the child becomes the run's process — its own session, the environment,
working directory, argv and sys.path[0] that `python train.py` would have, stdout/stderr onto the
harness's log — and executes the recipe's script as `__main__`. The harness gets a Popen-like handle
on the child's real pid (signals, psutil, kill_tree work as on any run) and the child's exit status
from the server, which is its parent.

What a forked child shares that fresh interpreters would not: the modules imported here (never used
before the fork: no thread pool or RNG has been touched), and the string hash seed. Hash-order
dependence would therefore not show between two forked runs; the tests marked `accelerate_launch`
(every recipe's kill/resume in 1 and 2 processes among them) still start real interpreters, each with
its own seed. The harness
starts one server per environment, with that environment (HF_* caches and switches are read on
import). A run with the test hooks' sitecustomize on its path gets it executed in the child, with
the run's environment, as `site` does at an interpreter's start (only for the hooks that patch
accelerate's classes: harness.FORKABLE_HOOKS); other runs that change the module path start fresh
interpreters.

It also stands for the tools' `python script.py ...` and `python -m module ...` (decode, score,
synthesize, export...): the same child, with stdout and stderr apart when the caller captures them.

Protocol (AF_UNIX, SOCK_SEQPACKET, one connection per run): the harness sends one JSON message
{"argv", "cwd", "env", "sitecustomize", "cpus"} (argv: a script and its arguments, or "-m", a module and its arguments) with
one file descriptor attached (stdout and stderr: the run's log) or two (stdout, stderr); the server answers {"pid"} at once
and {"returncode"} (Popen's convention: -N for signal N) once the child has been reaped.

    python tests/harness/zygote.py <socket path>     # started by tests/harness/harness.py
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import socket
import sys

# What every recipe imports before its first step (measured with `python -X importtime`), then every
# module of this checkout's common/ (found, not listed: a module added or moved is preloaded too).
PRELOAD = ("numpy", "soundfile", "yaml", "psutil", "torch", "torch.nn.functional", "torchaudio", "safetensors.torch",
           "accelerate", "datasets", "transformers", "transformers.models.wav2vec2_bert.modeling_wav2vec2_bert",
           "tools.corpus")


def preload() -> None:
    import pkgutil

    for name in PRELOAD:
        importlib.import_module(name)
    common = importlib.import_module("common")
    for module in pkgutil.walk_packages(common.__path__, "common."):
        importlib.import_module(module.name)


def child(conn_fds: list[int], request: dict, out_fds: list[int]) -> None:
    """Become `python <argv>` (a script, or `-m module`): never returns. `out_fds`: stdout and stderr
    (one descriptor: both)."""
    code = 1
    try:
        for fd in conn_fds:
            os.close(fd)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fds[0], 1)
        os.dup2(out_fds[-1], 2)
        for fd in {devnull, *out_fds}:
            os.close(fd)
        if request.get("cpus") is not None:  # the cores of the harness's CPU tokens, as taskset would
            os.sched_setaffinity(0, request["cpus"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if request.get("sitecustomize"):  # what `site` does at a fresh interpreter's start, with the run's env
            import importlib.util

            sys.path.insert(1, os.path.dirname(request["sitecustomize"]))  # its PYTHONPATH entry, first
            spec = importlib.util.spec_from_file_location("sitecustomize", request["sitecustomize"])
            sys.modules["sitecustomize"] = module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        argv = list(request["argv"])
        if argv[0] == "-m":  # as `python -m module`: sys.path[0] is the working directory
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            code = run_main(lambda runpy: runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` sets it
            code = run_main(lambda runpy: runpy.run_path(argv[0], run_name="__main__"))
    finally:
        os._exit(code)


def run_main(run) -> int:
    """Run the script or module (`run(runpy)`) as __main__ and end as the interpreter would: the exit code of SystemExit (its
    message printed), the traceback and 1 for an exception, death by SIGINT for an uncaught Ctrl-C;
    non-daemon threads joined and atexit handlers run before the streams are flushed."""
    import runpy
    import signal
    import threading

    code, interrupted = 0, False
    try:
        run(runpy)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if interrupted:  # as CPython does: die of SIGINT, so the parent sees -2
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def serve(path: str) -> None:
    parent = os.getppid()  # before the imports: a harness that dies meanwhile is noticed after them
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # the harness connects once the path exists
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}  # child pid -> its run's connection
    while os.getppid() == parent:  # the harness's process ended: so do we
        for key, _ in sel.select(timeout=0.02):
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            request = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                child([sel.fileno(), listener.fileno(), conn.fileno(), *(c.fileno() for c in running.values())], request, fds)
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            running[pid] = conn
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:  # the harness gave up on this run
                    pass
                conn.close()
    for pid in running:  # the harness is gone: so are the runs it was waiting for
        os.kill(pid, 9)


if __name__ == "__main__":
    serve(sys.argv[1])
