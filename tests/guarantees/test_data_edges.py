"""Data that changes or cannot be learned from, through the real command line (BEST-RQ, tiny
corpus): a resume on other audio is refused unless asked for, and a run that learned nothing or
met non-finite audio fails with one line instead of exporting."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import soundfile as sf

from common.training.sealing import list_checkpoints
from tests.common.data.test_manifest import replace_keeping_size
from tests.harness.harness import SUPPORT, run
from tests.recipes.test_best_rq import TINY

pytestmark = pytest.mark.slow

STEPS = ["--max_batch_seconds", "16", "--save_steps", "2", "--save_total_limit", "2"]


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("[rank 0] error:")]


def test_other_audio_of_the_same_length_is_refused_on_resume_unless_allowed(tiny_corpus, tmp_path):
    data = tmp_path / "librispeech"
    shutil.copytree(tiny_corpus / "librispeech", data)
    out = tmp_path / "run"
    base = ["--data_dir", str(data), "--output_dir", str(out), *TINY, *STEPS]
    run("best_rq", 1, [*base, "--max_steps", "2"])
    victim = sorted((data / "train").glob("*/*/*.flac"))[7]
    replace_keeping_size(victim)  # same size, duration and mtime; other samples

    log = run("best_rq", 1, [*base, "--max_steps", "4"], expect_rc=1)
    assert f"training data changed: 1 files' contents changed, e.g. {victim}" in log
    assert "--allow_data_change true" in log and "(traceback above)" not in log
    assert [c.name for c in list_checkpoints(out)] == ["step_00000002"]

    log = run("best_rq", 1, [*base, "--max_steps", "4", "--allow_data_change", "true"])
    assert "RESUMING ON CHANGED DATA (--allow_data_change true): training data changed: 1 files'" in log
    state = json.loads((out / "checkpoints" / "step_00000004" / "train_state.json").read_text())
    (change,) = state["data_changes"]
    assert change["step"] == 2 and change["was"]["contents"] != change["now"]["contents"] == state["data"]["contents"]
    # the checkpoint now holds the new data: a plain re-launch resumes without the flag
    log = run("best_rq", 1, [*base, "--max_steps", "6"])
    assert "RESUMING ON CHANGED DATA" not in log and "resumed from" in log


def test_a_run_whose_every_update_was_skipped_exports_nothing(tiny_corpus, tmp_path):
    """Every loss NaN (injected at each backward; a NaN setting such as `--noise_std nan` is now refused
    at parse time), every update skipped: in fewer steps than --max_nonfinite_updates the run used to
    export its initial weights as `final/`, exit 0."""
    out = tmp_path / "run"
    log = run("best_rq", 1, ["--data_dir", str(tiny_corpus / "librispeech"), "--output_dir", str(out), *TINY,
                             *STEPS, "--max_steps", "3"], expect_rc=1,
              env={"PYTHONPATH": str(SUPPORT), "INJECT_FAULT": "nan:*:1,2,3"})
    assert error_lines(log) == ["[rank 0] error: all 3 optimizer updates were skipped (non-finite gradients: the "
                                "loss was NaN or Inf at every step), so the weights are the initial ones; stopping "
                                "before the export. Look for a NaN or extreme setting (--learning_rate, "
                                "--noise_std, ...) or non-finite audio (--data_check full finds it)"]
    assert "(traceback above)" not in log and not (out / "final").exists()


def test_nan_audio_is_named_by_the_feature_statistics(tiny_corpus, tmp_path):
    """A float file with one NaN sample passes the default header check; the statistics name it."""
    data = tmp_path / "librispeech"
    shutil.copytree(tiny_corpus / "librispeech", data)
    victim = sorted((data / "train").glob("*/*/*.flac"))[5]
    audio, sr = sf.read(victim, dtype="float32")
    audio[len(audio) // 2] = np.nan
    sf.write(victim, audio, sr, format="WAV", subtype="FLOAT")  # libsndfile reads the format, not the name
    # --stats_utterances 500 (the recipe's default; TINY reads 8): the statistics read every file, the NaN one too
    base = ["--data_dir", str(data), "--output_dir", str(tmp_path / "run"), *TINY, *STEPS, "--max_steps", "2",
            "--stats_utterances", "500"]
    log = run("best_rq", 1, base, expect_rc=1)
    (line,) = error_lines(log)
    assert f"e.g. {victim.stem}: find every such file with --data_check full" in line and "(traceback above)" not in log
    log = run("best_rq", 1, [*base, "--data_check", "full", "--on_bad_data", "skip"])  # the fix the line gives
    assert "skipping 1 of 48 entries" in log
