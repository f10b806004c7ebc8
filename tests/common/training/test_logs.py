"""The `--report_to` trackers (common/training/logs.py): every tracker accelerate knows, checked at parse time."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from common.training.logs import TRACKERS, trackers
from tests.harness.recipe_import import RECIPES
from tests.harness.harness import ROOT


def test_the_tracker_list_is_accelerates():
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    assert set(TRACKERS) == set(LOGGER_TYPE_TO_CLASS)


def test_installed_trackers_are_accepted(tmp_path, monkeypatch):
    assert trackers("none") == [] and trackers("tensorboard") == ["tensorboard"]
    assert "tensorboard" in trackers("all")
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "__init__.py").write_text("")  # an installed wandb, as far as finding it goes
    monkeypatch.syspath_prepend(str(tmp_path))
    assert trackers("wandb, tensorboard") == ["wandb", "tensorboard"]
    assert "wandb" in trackers("all")


def installed(name: str) -> bool:
    return any(importlib.util.find_spec(m) for m in TRACKERS[name][0])


@pytest.mark.parametrize("value, missing, says", [
    ("wandb", "wandb", "the wandb tracker is not installed here: pip install wandb (or --report_to none)"),
    ("tensorboard,comet_ml", "comet_ml", "the comet_ml tracker is not installed here: pip install comet-ml"),
    ("tensorbord", None, "'tensorbord' is not a tracker; choose from tensorboard, wandb, mlflow"),
    ("all,tensorboard", None, "'all' and 'none' stand alone"),
])
def test_a_tracker_that_cannot_run_is_refused_in_one_line(value, missing, says):
    if missing and installed(missing):
        pytest.skip(f"{missing} is installed here")
    with pytest.raises(ValueError) as e:
        trackers(value)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_report_to_is_checked_at_parse_time_through_the_real_entry_point():
    """`train.py --report_to mlflow` without mlflow: one line, exit 2, before any heavy import."""
    if installed("mlflow"):
        pytest.skip("mlflow is installed here")
    for recipe in RECIPES:
        proc = subprocess.run([sys.executable, str(ROOT / "recipes" / recipe / "train.py"), "--report_to", "mlflow"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            "error: --report_to: the mlflow tracker is not installed here: pip install mlflow "
            "(or --report_to none)"], proc.stderr


def test_importing_the_logs_module_stays_light():
    code = "import sys, common.training.logs; assert 'accelerate' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
