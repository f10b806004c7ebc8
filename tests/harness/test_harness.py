"""The fork server stands for fresh interpreters: what a forked run sees and how it ends is what
`python train.py` (one process) and `accelerate launch --config_file cpu_ddp.yaml` (several) give."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from common.training.launcher import launched
from tests.harness import harness

PROBE = textwrap.dedent("""
    import json, os, sys
    import torch
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": dict(os.environ),
                      "main": __name__, "threads": torch.get_num_threads()}))
    how = sys.argv[1]
    if how == "code":
        sys.exit(3)
    if how == "message":
        sys.exit("a message")
    if how == "raise":
        raise ValueError("boom")
    if how == "ctrl-c":
        raise KeyboardInterrupt
""")


def _fork(tmp_path, how: str, env: dict | None = None):
    script = tmp_path / "probe" / "probe.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(PROBE)
    log_path = tmp_path / f"{how}.log"
    with open(log_path, "w") as log:
        proc = harness.fork([str(script), how], 1, harness.base_env(env), log)
    assert proc is not None, "the fork server refused a run with the suite's own environment"
    proc.wait(timeout=60)
    return proc, log_path.read_text(), script


@pytest.mark.parametrize("how,code", [("ok", 0), ("code", 3), ("message", 1), ("raise", 1),
                                      ("ctrl-c", -signal.SIGINT)])
def test_a_forked_run_sees_and_ends_as_python_script_does(tmp_path, how, code):
    proc, log, script = _fork(tmp_path, how)
    seen = json.loads(log.splitlines()[0])
    assert proc.returncode == code, log
    assert seen["argv"] == [str(script), how] and seen["main"] == "__main__"
    assert seen["path0"] == str(script.parent) and seen["cwd"] == str(harness.ROOT)
    assert {k: v for k, v in seen["env"].items() if not k.startswith("PYTEST_")} == \
        {k: v for k, v in harness.base_env().items() if not k.startswith("PYTEST_")}
    assert seen["threads"] == 1  # OMP_NUM_THREADS=1, as in a fresh interpreter
    if how == "message":
        assert log.rstrip().endswith("a message")
    if how in ("raise", "ctrl-c"):
        assert "Traceback" in log and ("ValueError: boom" in log or "KeyboardInterrupt" in log)


def test_the_accelerate_stand_in_runs_the_script_as_python_does_and_passes_its_exit_status(tmp_path):
    """harness.accelerate_stand_in (a shell script's $ACCELERATE in the transfer.sh tests): `launch SCRIPT
    ARGS` is the script forked with the caller's working directory, environment and cores, its output on
    the caller's stdout/stderr, its failure the caller's (so a stage that fails fails the script); any
    other use is refused."""
    shim = harness.accelerate_stand_in(tmp_path)
    script = tmp_path / "probe" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    env = {**harness.base_env(), "STAGE": "2/2"}
    shell = f'cd {tmp_path} && "{shim}" launch {script} code || echo "exit $?"'
    proc = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True, timeout=60)
    seen = json.loads(proc.stdout.splitlines()[0])
    assert seen["argv"] == [str(script), "code"] and seen["path0"] == str(script.parent) and seen["main"] == "__main__"
    assert seen["cwd"] == str(tmp_path) and seen["env"]["STAGE"] == "2/2"
    assert proc.stdout.splitlines()[-1] == "exit 3", proc.stderr[-2000:]
    raised = subprocess.run([shim, "launch", script, "raise"], env=env, capture_output=True, text=True, timeout=60)
    assert raised.returncode == 1 and "ValueError: boom" in raised.stderr
    other = subprocess.run([shim, "env"], env=env, capture_output=True, text=True, timeout=60)
    assert other.returncode == 1 and "the suite's stand-in takes `launch SCRIPT [ARGS...]` only, not " in other.stderr


def test_the_hooks_sitecustomize_runs_in_the_forked_child_or_the_run_is_not_forked(tmp_path):
    """A sitecustomize on the path runs at each interpreter's start, reading its rank and pid: the
    hooks that patch accelerate's classes run in the forked child, with the run's environment; the
    others (and any other module path) get fresh interpreters."""
    script = tmp_path / "probe.py"
    script.write_text("import os, sys, accelerate\n"
                      "print(sys.modules['sitecustomize'].__file__, accelerate.Accelerator.save_state.__module__, "
                      "sys.path[1], os.environ['SLOW_SAVE'])\n")
    with open(tmp_path / "log", "w") as log:
        env = harness.base_env({"PYTHONPATH": str(harness.SUPPORT), "SLOW_SAVE": "7"})
        proc = harness.fork([str(script)], 1, env, log)
        assert proc is not None and proc.wait(60) == 0
        for other in ({"AUDIT_WRITES_DIR": str(tmp_path)}, {"PYTHONPATH": str(tmp_path)}):
            assert harness.fork([str(script)], 1, harness.base_env({"PYTHONPATH": str(harness.SUPPORT), **other}), log) is None
    assert (tmp_path / "log").read_text().split() == [str(harness.SUPPORT / "sitecustomize.py"), "sitecustomize",
                                                     str(harness.SUPPORT), "7"]


def test_forked_ranks_get_the_real_launchers_environment(tmp_path):
    """The variables `accelerate launch --config_file accelerate_configs/cpu_ddp.yaml` gives its
    workers, rank by rank, are the forked ranks' (less the agent's store and error file)."""
    script = tmp_path / "env.py"
    # each rank writes its own file: two ranks printing to one pipe may interleave their lines
    script.write_text(f"import json, os; open({str(tmp_path)!r} + '/env' + os.environ['RANK'], 'w').write(json.dumps(dict(os.environ)))\n")
    port = harness.free_port()
    out = subprocess.run([*harness.ACCELERATE, "--config_file", str(harness.ROOT / "accelerate_configs" / "cpu_ddp.yaml"),
                          "--num_processes", "2", "--main_process_port", str(port), str(script)],
                         env=harness.base_env(), capture_output=True, text=True, timeout=120, cwd=harness.ROOT)
    assert out.returncode == 0, out.stderr
    base = harness.base_env()
    for rank in (0, 1):
        env = json.loads((tmp_path / f"env{rank}").read_text())
        expected = harness.ddp_env(int(env["RANK"]), 2, port)
        assert {k: env.get(k) for k in expected} == expected
        # nothing else added or changed (a variable the suite already had with that value is fine)
        other = {k for k in env.keys() | base.keys() if k not in expected and env.get(k) != base.get(k)}
        assert other == {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE"}, other
        assert launched(env) and launched(expected)  # common.training.launcher watches both


WHO_LAUNCHED = ("import json, os; from common.training.launcher import launched, launcher_pid\n"
                "print(json.dumps([launched(os.environ), launcher_pid(os.environ), os.getppid()]))\n")


def test_the_launcher_is_found_as_under_the_real_one(tmp_path):
    """common.training.launcher finds the real one-process launcher (`accelerate launch
    --num_processes 1`, harness.command) as the worker's launcher, and the fork server as the forked
    ranks' (as torch's elastic agent is theirs); a forked `python train.py` has none, as a real one."""
    script = tmp_path / "who.py"
    script.write_text(WHO_LAUNCHED)
    real = subprocess.Popen(harness.command(str(script), 1, []),  # an absolute path: ROOT / it is it
                            env=harness.base_env(), stdout=subprocess.PIPE, text=True, cwd=harness.ROOT)
    out, _ = real.communicate(timeout=120)
    assert json.loads(out.splitlines()[-1]) == [True, real.pid, real.pid]
    with open(tmp_path / "ranks.log", "w") as log:
        assert harness.fork([str(script)], 2, harness.base_env(), log).wait(timeout=120) == 0
    with open(tmp_path / "plain.log", "w") as log:
        assert harness.fork([str(script)], 1, harness.base_env(), log).wait(timeout=120) == 0
    ranks = [json.loads(line) for line in (tmp_path / "ranks.log").read_text().splitlines()]
    assert len(ranks) == 2 and all(launched and pid == parent for launched, pid, parent in ranks), ranks
    assert json.loads((tmp_path / "plain.log").read_text())[0] is False


def test_a_failed_rank_stops_the_others_and_the_group_reports_1(tmp_path):
    """As torch's elastic agent: one rank's failure SIGTERMs the rest; the run's code is 1."""
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(2)\n"
                      "time.sleep(60)\n")
    with open(tmp_path / "log", "w") as log:
        group = harness.fork([str(script)], 2, harness.base_env(), log)
    assert group.wait(timeout=120) == 1  # only a hang fails here: rank 0 not stopped would end with 0, below
    assert [r.returncode for r in group.ranks] == [-signal.SIGTERM, 2]
    with pytest.raises(NotImplementedError, match="accelerate_launch"):
        group.send_signal(signal.SIGTERM)


@pytest.mark.parametrize("how", ["run", "suite"])
def test_a_variable_is_seen_on_import_as_in_a_fresh_interpreter(tmp_path, monkeypatch, how):
    """A run's own variable (HF_DATASETS_CACHE...) or one an in-process import set in the suite
    (transformers: TOKENIZERS_PARALLELISM) reaches the run's imports: its server was started with it."""
    import_time = "import os, sys; print(os.environ.get('HARNESS_PROBE_VARIABLE'))"
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "sitelike.py").write_text(import_time)
    (tmp_path / "run.py").write_text(f"import sys; sys.path.insert(0, {str(tmp_path / 'probe')!r}); import sitelike\n")
    if how == "suite":
        monkeypatch.setenv("HARNESS_PROBE_VARIABLE", "set")
    env = harness.base_env({"HARNESS_PROBE_VARIABLE": "set"} if how == "run" else None)
    with open(tmp_path / "log", "w") as log:
        assert harness.fork([str(tmp_path / "run.py")], 1, env, log).wait(timeout=60) == 0
    assert (tmp_path / "log").read_text().strip() == "set"
    assert harness._servers[next(reversed(harness._servers))]["env"]["HARNESS_PROBE_VARIABLE"] == "set"


def test_a_variable_read_when_run_reaches_the_run_from_the_suites_server(tmp_path):
    """harness.READ_WHEN_RUN (the cache root): a run's own value is the one the run reads, and it costs no
    fork server of its own (no import reads it)."""
    _fork(tmp_path, "ok")  # the suite's server, started if none is
    servers = list(harness._servers.values())
    proc, log, _ = _fork(tmp_path, "ok", env={"SPEECH_RECIPES_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0 and json.loads(log.splitlines()[0])["env"]["SPEECH_RECIPES_CACHE"] == str(tmp_path / "cache")
    assert list(harness._servers.values()) == servers


@pytest.mark.parametrize("how", ["code", "raise"])
def test_a_forked_tool_gives_what_a_fresh_interpreter_gives(tmp_path, how, monkeypatch):
    """`harness.python` (the tools: decode, score, synthesize...): stdout, stderr and exit code apart,
    as `subprocess.run([python, ...], capture_output=True)` gives them — for a script and for `-m`."""
    pkg = tmp_path / "probepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(PROBE + "print('to stderr', file=sys.stderr)\n")
    for argv in ([pkg / "probe.py", how], ["-m", "probepkg.probe", how]):
        forked = harness.python(argv, cwd=tmp_path)
        monkeypatch.setattr(harness, "FORK", False)
        fresh = harness.python(argv, cwd=tmp_path)
        monkeypatch.setattr(harness, "FORK", True)
        assert forked.returncode == fresh.returncode == {"ok": 0, "code": 3, "message": 1, "raise": 1}[how]
        seen, fresh_seen = json.loads(forked.stdout.splitlines()[0]), json.loads(fresh.stdout.splitlines()[0])
        assert seen["argv"] == fresh_seen["argv"] and seen["path0"] == fresh_seen["path0"] == \
            str(pkg if argv[0] != "-m" else tmp_path)
        assert seen["cwd"] == str(tmp_path) and seen["main"] == "__main__"
        assert forked.stdout.splitlines()[1:] == fresh.stdout.splitlines()[1:]
        # stderr: the same lines, but for the traceback's frames (runpy's in the forked child)
        last = lambda text: [line for line in text.splitlines() if not line.startswith(" ")][-1:]  # noqa: E731
        assert last(forked.stderr) == last(fresh.stderr) and "{" not in forked.stderr


def _hold(files: list, seconds: float) -> subprocess.Popen:
    """Another worker's runs: a process holding the lock files `files` for `seconds`."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        held = [open(name, "w") for name in {[str(f) for f in files]!r}]
        for f in held:
            fcntl.flock(f, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep({seconds})
        print("giving them back", flush=True)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


@pytest.mark.parametrize("held", ["core0", "core0.1"])
def test_cpu_tokens_a_run_of_every_whole_core_waits_for_the_others_and_nested_runs_take_none(tmp_path, monkeypatch,
                                                                                             held):
    """pytest-xdist workers share the cores: a run of several threads on every core starts only once
    another worker's run has given its slot back (the first, `core0`, or the second, `core0.1`); a
    run started from inside a run takes none (no deadlock)."""
    import select

    monkeypatch.setenv(harness.TOKENS_DIR, str(tmp_path))
    monkeypatch.setattr(harness, "RUNS_PER_CORE", 2)
    holder = _hold([tmp_path / held], 1.0)
    with harness.cpu_tokens(os.cpu_count(), whole_cores=True):
        assert select.select([holder.stdout], [], [], 0)[0], "all tokens taken while another run held one"
        with harness.cpu_tokens(1):  # nested: would wait forever if it asked for one
            pass
    assert holder.wait(10) == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_cpu_tokens_one_thread_runs_share_a_core_only_when_every_core_is_busy(tmp_path, monkeypatch):
    """A one-process run takes a free core first; with every core busy it shares one (its second slot)
    at once, as the ranks of a DDP run (one thread each) share every core, and with RUNS_PER_CORE 1
    a run waits for a core to be given back; a core that a run of several processes waits for is
    left to it."""
    import select

    cores = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv(harness.TOKENS_DIR, str(tmp_path))
    monkeypatch.setattr(harness, "RUNS_PER_CORE", 2)
    holder = _hold([tmp_path / "core0"], 30.0)
    with harness.cpu_tokens(1) as cpus:
        assert cpus == [cores[1]]
    holder.kill()
    holder = _hold([tmp_path / f"core{i}" for i in range(len(cores))], 1.0)
    with harness.cpu_tokens(1) as cpus:
        assert cpus == [cores[0]] and not select.select([holder.stdout], [], [], 0)[0], "waited for a core"
    with harness.cpu_tokens(len(cores)) as cpus:
        assert cpus == cores and not select.select([holder.stdout], [], [], 0)[0], "waited for the cores"
    monkeypatch.setattr(harness, "RUNS_PER_CORE", 1)
    with harness.cpu_tokens(1) as cpus:
        assert select.select([holder.stdout], [], [], 0)[0], "two runs on a core with RUNS_PER_CORE 1"
    assert holder.wait(10) == 0
    # a run of several processes waiting for core 1 (its claim) gets its next free slot: one-slot runs go elsewhere
    monkeypatch.setattr(harness, "RUNS_PER_CORE", 2)
    holder = _hold([tmp_path / "core0", tmp_path / "core1.claim"], 30.0)
    with harness.cpu_tokens(1) as cpus:
        assert cpus == [cores[0]], "took a slot of the core another run waits for"
    holder.kill()


def test_forked_ranks_stop_like_the_elastic_agent_and_a_hung_rank_is_named(tmp_path, monkeypatch):
    """One rank fails: the others get SIGTERM; one still running after the grace gets SIGABRT (its
    faulthandler prints where it hangs) then SIGKILL, and the log says which (it cannot say so itself)."""
    class Rank:  # the part of Forked that ForkedGroup uses
        def __init__(self, code):
            self.returncode, self.signals, self.pid = code, [], 0

        def poll(self):
            return self.returncode

        def send_signal(self, sig):
            self.signals.append(sig)
            if sig in (signal.SIGABRT, signal.SIGKILL):
                self.returncode = -sig

    monkeypatch.setattr(harness.ForkedGroup, "STOP_GRACE_S", 0.0)
    log = tmp_path / "run.log"
    ranks = [Rank(None), Rank(-9)]
    with open(log, "a") as f:
        group = harness.ForkedGroup(ranks, f)
    assert group.poll() is None and ranks[0].signals == [signal.SIGTERM]  # the agent's SIGTERM
    assert group.poll() is None and ranks[0].signals == [signal.SIGTERM, signal.SIGABRT, signal.SIGKILL]  # the grace
    assert group.poll() == 1
    assert log.read_text() == ("[harness] rank(s) [0] still running 0 s after SIGTERM (exit statuses so far "
                               "[None, -9]): SIGABRT (the recipe's faulthandler prints each thread's stack), then "
                               "SIGKILL, as torch's elastic agent does\n")


def test_a_tests_own_flags_replace_its_shared_ones_as_the_recipes_refuse_a_flag_given_twice():
    args = ["-m", "mod", "--a", "1", "--b", "--c", "x", "--a=2", "pos", "--b", "false", "--max-steps", "3",
            "--max_steps", "4"]
    assert harness.last_flag_wins(args) == ["-m", "mod", "--a=2", "--b", "false", "--c", "x", "pos", "--max_steps", "4"]
    assert harness.command("asr", 1, ["--seed", "1", "--seed", "2"], launcher=False)[-2:] == ["--seed", "2"]
