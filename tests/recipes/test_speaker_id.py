"""Speaker identification (recipes/speaker_id, a copy of best_rq adapted to another task: docs/adapt.md):
its held-out utterances, its new fields' help and refusals, and interrupted == continuous in 1 and 2
processes (forked runs, as the other recipes' fast resume tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.data.manifest import read_librispeech
from tests.recipe_import import recipe_modules
from tests.recipes.harness import (ROOT, assert_same_losses, assert_same_weights, epoch_lengths, last_flag_wins,
                                   metrics, resumed_positions, run)

SEED = 42
HELD_OUT = 0.25  # of the tiny corpus's 48 training utterances: enough to validate on
TINY = ["--hidden_size", "32", "--num_layers", "1", "--num_heads", "2", "--ffn_dim", "64", "--conv_kernel", "7",
        "--warmup_steps", "5", "--logging_steps", "1", "--eval_steps", "4", "--report_to", "none",
        "--seed", str(SEED), "--heldout_fraction", str(HELD_OUT)]
SCRIPT = ROOT / "recipes" / "speaker_id" / "train.py"

speaker_id = recipe_modules("speaker_id", "data")


def args_for(corpus: Path, out: Path, *extra: str) -> list[str]:
    return last_flag_wins(["--data_dir", str(corpus / "librispeech"), "--output_dir", str(out), *TINY, *extra])


def train_durations(corpus: Path) -> list[float]:
    """The durations of the training utterances the recipe keeps (the others are held out)."""
    rows = read_librispeech(corpus / "librispeech", "train")
    return [d for i, d in zip(rows["id"], rows["duration"]) if not speaker_id.data.held_out(i, HELD_OUT)]


def test_the_held_out_utterances_are_a_function_of_their_ids(tiny_corpus):
    ids = read_librispeech(tiny_corpus / "librispeech", "train")["id"]
    held = [i for i in ids if speaker_id.data.held_out(i, HELD_OUT)]
    assert held == [i for i in reversed(ids) if speaker_id.data.held_out(i, HELD_OUT)][::-1]  # order-free
    assert 0 < len(held) < len(ids) / 2
    assert set(held) <= {i for i in ids if speaker_id.data.held_out(i, 2 * HELD_OUT)}  # nested


def test_help_lists_the_new_fields_and_a_bad_value_is_one_line():
    help_text = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "--heldout_fraction" in help_text.stdout
    assert "--speaker_column_name" in help_text.stdout
    for argv, message in ((["--heldout_fraction", "1"], "error: --heldout_fraction: must be in (0, 1), got 1.0"),
                          (["--speaker_column_name", "spk"], "error: --speaker_column_name applies to a "
                                                             "--dataset_name source; give --dataset_name, or drop it")):
        proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stderr.splitlines()) == (2, [message]), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_interrupted_equals_continuous(tiny_corpus, tmp_path, nproc):
    """Two SIGKILLs: one inside epoch 0, one inside epoch ≥ 1; same weights and per-step losses, also
    when the last leg loads its data in worker processes."""
    mbs = 16.0
    e0, e1, _ = epoch_lengths(train_durations(tiny_corpus), mbs, nproc, 3)
    assert e0 >= 3 and e1 >= 3
    k1, k2, max_steps = 2, e0 + 1, e0 + e1 + 1
    extra = ["--max_batch_seconds", str(mbs), "--max_steps", str(max_steps), "--save_steps", "1",
             "--save_total_limit", "3"]

    cont = tmp_path / "continuous"
    run("speaker_id", nproc, args_for(tiny_corpus, cont, *extra))
    cut = tmp_path / "interrupted"
    run("speaker_id", nproc, args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=k1)
    run("speaker_id", nproc, args_for(tiny_corpus, cut, *extra), kill_after_checkpoint=k2)
    run("speaker_id", nproc, args_for(tiny_corpus, cut, *extra, "--num_workers", "2"))

    (s1, ep1, b1), (s2, ep2, b2) = resumed_positions(tmp_path / "interrupted.log")
    assert ep1 == 0 and b1 > 0 and ep2 >= 1 and b2 > 0  # cut inside epoch 0, then inside a later one
    assert_same_weights(cont, cut)
    assert_same_losses(cont, cut)
    rows = metrics(cut)
    assert [r["step"] for r in rows] == list(range(1, max_steps + 1))  # each step once
    assert "eval_acc" in rows[-1] and (cut / "final" / "speakers.json").exists()
