"""What every recipe under recipes/ is tested for without a line about it in tests/ (docs/adapt.md,
"How the tests pick up the copy"): its test model (`TEST_TINY` in its train.py) is a valid set of its
flags, and — unless its own tests/recipes/test_<name>.py has an `interrupted_equals_continuous` test —
a run killed twice (inside epoch 0, inside a later epoch) and resumed, the last leg with data workers,
ends with the weights and the metrics.jsonl rows of a run never interrupted, in 1 and 2 processes.
Here that is speaker_id (a copy of best_rq); a copied recipe is tested the same way, unedited."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.config import parse_config
from tests.harness.recipe_import import RECIPES, recipe_modules, tiny_flags
from tests.harness.harness import (ROOT, assert_same_weights, last_flag_wins, metrics, resumed_positions, run)


def has_own_resume_test(recipe: str) -> bool:
    """Whether tests/recipes/test_<recipe>.py tests the recipe's kill and resume itself."""
    own = ROOT / "tests" / "recipes" / f"test_{recipe}.py"
    return own.is_file() and re.search(r"^def test_\w*interrupted_equals_continuous", own.read_text(), re.M) is not None


RESUMED_HERE = [recipe for recipe in RECIPES if not has_own_resume_test(recipe)]


def on_tiny_corpus(recipe: str, tiny_corpus: Path, out: Path, *extra: str) -> list[str]:
    """The recipe's test model on the tiny built-in corpus (in the layout the recipe chooses), every step
    logged, its feature statistics (if it has any) from 8 training utterances instead of all of them,
    then `extra` (a later flag replaces an earlier one)."""
    import dataclasses

    config = recipe_modules(recipe, "train").train.Config
    has_stats = ("stats_utterances" in {f.name for f in dataclasses.fields(config)}
                 and "stats_utterances" not in getattr(config, "LEFT_OUT", {}))
    stats = ["--stats_utterances", "8"] if has_stats else []
    return last_flag_wins(["--builtin_corpus", "tiny", "--data_cache_dir", str(tiny_corpus.parent),
                           "--output_dir", str(out), "--max_batch_seconds", "16", "--warmup_steps", "5",
                           "--logging_steps", "1", "--report_to", "none", *stats, *tiny_flags(recipe), *extra])


def epoch_lengths(recipe: str, argv: list[str], nproc: int, tmp: Path) -> list[int]:
    """Optimizer steps in epochs 0 and 1 of `nproc` processes: the recipe's own `build_data` sized to that
    global batch, asked for its training batches."""
    from common.training.distributed import build_accelerator

    train = recipe_modules(recipe, "train").train
    cfg = parse_config(train.Config, argv, default_yaml=ROOT / "recipes" / recipe / "config.yaml")
    data = train.build_data(cfg, build_accelerator(), tmp, global_batch=nproc, num_workers=0)
    lengths = []
    for epoch in (0, 1):
        data.train_sampler.set_epoch(epoch)
        lengths.append(len(data.train_sampler) // nproc)
    return lengths


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_test_model_is_a_valid_set_of_flags(recipe):
    cfg = parse_config(recipe_modules(recipe, "train").train.Config, tiny_flags(recipe),
                       default_yaml=ROOT / "recipes" / recipe / "config.yaml")
    assert cfg.max_steps > 0


def test_a_recipe_with_its_own_resume_test_is_resumed_there():
    assert {"best_rq", "asr", "tts", "vocoder"} <= set(RECIPES) - set(RESUMED_HERE)
    assert "speaker_id" in RESUMED_HERE


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("recipe", RESUMED_HERE)
def test_interrupted_equals_continuous(recipe, nproc, tiny_corpus, tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    args = lambda name, *extra: on_tiny_corpus(recipe, tiny_corpus, folder / name, *extra)  # noqa: E731
    e0, e1 = epoch_lengths(recipe, args("sizes"), nproc, tmp_path / "sizes")
    assert e0 >= 3 and e1 >= 3, (f"{recipe}: epochs of {e0} and {e1} steps in {nproc} process(es) on the tiny "
                                 f"corpus; the test cuts inside each: give more batches (TEST_TINY: a smaller "
                                 f"--max_batch_seconds)")
    k1, k2, max_steps = 2, e0 + 1, e0 + e1 + 1
    steps = ["--max_steps", str(max_steps), "--save_steps", "1", "--save_total_limit", "3", "--eval_steps", "4"]

    run(recipe, nproc, args("continuous", *steps))
    run(recipe, nproc, args("interrupted", *steps), kill_after_checkpoint=k1)
    run(recipe, nproc, args("interrupted", *steps), kill_after_checkpoint=k2)
    run(recipe, nproc, args("interrupted", *steps, "--num_workers", "2"))

    (_, ep1, b1), (_, ep2, b2) = resumed_positions(folder / "interrupted.log")
    assert ep1 == 0 and b1 > 0 and ep2 >= 1 and b2 > 0  # cut inside epoch 0, then inside a later one
    cont, cut = folder / "continuous", folder / "interrupted"
    assert_same_weights(cont, cut)
    rows = [r for r in metrics(cut) if "step" in r]
    assert [r["step"] for r in rows] == list(range(1, max_steps + 1))  # each step once
    assert rows == [r for r in metrics(cont) if "step" in r]  # every logged value, validation included
    assert any(k.startswith("eval_") for k in rows[-1]) and (cut / "final" / "COMPLETE").is_file()
