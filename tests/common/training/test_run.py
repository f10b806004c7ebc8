import pytest

import common.training.run
from common.config import RunConfig


class Built(Exception):
    pass


def test_start_run_hands_every_accelerator_setting_to_build_accelerator(monkeypatch, tmp_path):
    """--ddp_timeout, --deterministic, --mixed_precision and --report_to reach the Accelerator (a
    misplaced comment once swallowed timeout_s: a dead rank then hung the others for 30 min, not 60 s)."""
    seen = {}

    def build(**kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(common.training.run, "build_accelerator", build)
    cfg = RunConfig(output_dir=str(tmp_path / "run"), ddp_timeout=7.0, deterministic=True, mixed_precision="no",
                    report_to="none")
    with pytest.raises(Built):
        common.training.run.start_run(cfg, "best_rq")
    assert seen == {"mixed_precision": "no", "project_dir": str(tmp_path / "run"), "log_with": None,
                    "timeout_s": 7.0, "deterministic": True}
