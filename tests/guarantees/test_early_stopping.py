"""Early stopping end to end (common/training/early_stopping.py): a run stops at the step its patience
runs out, final/ holds the best validation's weights, and a run SIGKILLed after the stopper's state
changed and re-launched stops at the same step with the same weights (the test GAN recipe, 1 and 2
processes); a re-launch of a stopped run trains no step. The ASR recipe's auto patience on a voice
(the tiny corpus as --data_dir), with the weight average it validates, through its real entry point."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

import pytest

from common.model.hf_export import load_recipe_ctc_weights
from tests.harness.harness import metrics, resumed_positions, run
from tests.recipes.test_asr import args_for as asr_args_for

pytestmark = pytest.mark.slow

GAN = "tests/harness/support/gan_recipe/train.py"
# Validations at 2, 4, 6, 8: the threshold makes the first the only improvement, so patience 3 stops at 8.
STOPPING = ["--eval_steps", "2", "--early_stopping_patience", "3", "--early_stopping_threshold", "1e9",
            "--max_steps", "16", "--gradient_accumulation_steps", "2", "--save_steps", "3", "--save_total_limit", "0"]


def weights(folder, name):
    return load_file(folder / name / "model.safetensors")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_killed_run_stops_at_the_same_step_with_the_same_weights(tmp_path, nproc):
    cont, cut = tmp_path / "continuous", tmp_path / "interrupted"
    log = run(GAN, nproc, ["--output_dir", str(cont), *STOPPING], launcher=False)
    assert "early stopping at step 8: eval_loss did not improve by more than 1e+09 in 3 validation(s)" in log
    assert [r["step"] for r in metrics(cont)] == list(range(1, 9))  # no step after the stop
    last = cont / "checkpoints" / "step_00000008"  # saved where it stopped (not a multiple of --save_steps)
    assert sorted(p.name for p in last.parent.iterdir()) == ["step_00000003", "step_00000006", last.name]
    kept = torch.load(last / "custom_checkpoint_1.pkl", weights_only=True)  # [Balance, EarlyStopping, RunState]
    assert (kept["best_step"], kept["bad_rounds"], kept["last_step"]) == (2, 3, 8)
    for name in ("generator", "discriminator"):  # final/ holds the weights step 2's validation scored
        assert same(weights(cont / "final", name), kept["weights"][name]), name
        assert not same(weights(cont / "final", name), load_file(last / ("model_1.safetensors" if name[0] == "d"
                                                                          else "model.safetensors"))), name

    # killed after step 3 (or 6, should the kill land late): the best (step 2) and the validations since are run state
    run(GAN, nproc, ["--output_dir", str(cut), *STOPPING], kill_after_checkpoint=3, launcher=False)
    run(GAN, nproc, ["--output_dir", str(cut), *STOPPING], launcher=False)
    assert 3 <= resumed_positions(tmp_path / "interrupted.log")[0][0] < 8
    assert metrics(cut) == metrics(cont)
    for name in ("generator", "discriminator"):
        assert same(weights(cut / "final", name), weights(cont / "final", name)), name

    # the same command again: the run stopped, so no step is trained and final/ is the same
    log = run(GAN, nproc, ["--output_dir", str(cut), *STOPPING], launcher=False)
    assert "this run stopped early at step 8" in log and metrics(cut) == metrics(cont)
    assert same(weights(cut / "final", "generator"), weights(cont / "final", "generator"))


def test_the_asr_recipe_stops_a_voice_by_default_and_exports_its_best_average(tiny_corpus, tmp_path):
    """The tiny corpus given as --data_dir is a voice (under 10 h): auto patience 6 (config.yaml's
    weight average on, as the plain command has it); the threshold makes the first validation the best."""
    out = tmp_path / "asr"
    args = asr_args_for(tiny_corpus, out, "--max_steps", "12", "--eval_steps", "1", "--save_steps", "100",
                        "--early_stopping_threshold", "1e9")
    i = args.index("--early_stopping_patience")
    log = run("asr", 1, args[:i] + args[i + 2:])  # the tests' TINY turns auto off: back to the default
    assert "--early_stopping_patience None (auto): 6 on" in log and "early stopping at step 7" in log
    assert metrics(out)[-1]["step"] == 7
    last = out / "checkpoints" / "step_00000007"  # saved where it stopped; it holds the stopper's copy of step 1
    kept = torch.load(last / "custom_checkpoint_1.pkl", weights_only=True)  # [WeightAverage, EarlyStopping, RunState]
    assert (kept["best_step"], kept["bad_rounds"]) == (1, 6)
    final, average = load_recipe_ctc_weights(out / "final"), load_recipe_ctc_weights(last)
    assert same(final, kept["weights"]["model"])  # step 1's weight average, what its validation scored
    assert not torch.equal(final["head.weight"], average["head.weight"])  # not step 7's
    card = (out / "final" / "README.md").read_text()
    assert ("training ended: stopped early at step 7: eval_cer did not improve by more than 1e+09 in 6 validation(s) "
            "(patience 6; best") in card and "this folder holds the weights validated at step 1" in card
