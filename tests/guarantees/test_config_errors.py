"""A config mistake through the documented entry point, `accelerate launch`: what the user sees.

Our line comes first, once per machine, before anything is created; then accelerate reports the
failed child in its own way (README, "When things go wrong"). Exit code: the script's 2 directly,
1 through accelerate.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness.harness import ROOT, command

pytestmark = pytest.mark.slow

MESSAGE = "error: --max_steps: must be ≥ 1, got 0"


def launch(cmd, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_config_mistake_through_accelerate_launch(tmp_path, nproc):
    out = tmp_path / "out"
    proc = launch(command("best_rq", nproc, ["--output_dir", str(out), "--max_steps", "0"]), tmp_path)
    err = proc.stderr
    assert proc.returncode == 1, err
    assert err.count(MESSAGE) == 1, err  # once, also with 2 processes on this machine
    assert not out.exists()  # refused before anything was created
    if nproc == 1:  # accelerate's simple launcher: a CalledProcessError traceback naming our exit code
        assert err.index(MESSAGE) < err.index("Traceback")
        assert err.rstrip().endswith("returned non-zero exit status 2."), err
    else:  # torchrun's report of the failed workers
        assert "ChildFailedError" in err and "exitcode  : 2" in err


def test_quiet_launch_and_the_script_itself_say_one_line(tmp_path):
    quiet = command("best_rq", 1, ["--max_steps", "0"])
    quiet.insert(quiet.index("--num_processes"), "-q")
    proc = launch(quiet, tmp_path)
    assert proc.returncode == 1 and proc.stderr == MESSAGE + "\n", proc.stderr
    proc = launch([sys.executable, str(ROOT / "recipes" / "best_rq" / "train.py"), "--max_steps", "0"], tmp_path)
    assert proc.returncode == 2 and proc.stderr == MESSAGE + "\n", proc.stderr


def test_a_bad_value_in_a_yaml_file_names_the_file_through_the_script(tmp_path):
    """The vocoder trained with `periods: [2, 0]` until the first adversarial step (ZeroDivisionError);
    now the script's one line names the value, the file and its line, before anything is created."""
    y = tmp_path / "my.yaml"
    y.write_text("max_steps: 10\nperiods: [2, 0]\n")
    out = tmp_path / "out"
    proc = launch([sys.executable, str(ROOT / "recipes" / "vocoder" / "train.py"), "--config", str(y),
                   "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 2 and proc.stderr == (
        f"error: --periods: must be ≥ 1, got 0 (in [2, 0]) (--config {y}, line 2)\n"), proc.stderr
    assert not out.exists()
