"""benchmarks/recipe.py builds each recipe through the seams of its train.py (build_data, build_models,
compute_loss), the same in every recipe: what the benchmarks time is the recipe's own data, models and
loss — the models exactly as the recipe's main builds them (weights, --init_from, what trains) — and
nothing in benchmarks/ or here tells one recipe from another but its flags."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.recipe import RECIPES, load_recipe
from tests.harness.recipe_import import tiny_flags
from tests.harness.harness import SUPPORT, run

def on_tiny_corpus(tiny_corpus) -> list[str]:
    """The flags that make a recipe read the tiny built-in corpus (already made) in the layout it chooses."""
    return ["--builtin_corpus", "tiny", "--data_cache_dir", str(tiny_corpus.parent)]


def load_as_main_builds(recipe: str, argv: list[str], out: Path):
    """`load_recipe(recipe, argv)`, after checking that its `build_models()` gives, weight for weight and
    flag for flag, the models the recipe's main hands to `accelerator.prepare` with the same flags (a run
    forked with tests/harness/support's DUMP_PREPARED, which stops it there)."""
    dump = out / "prepared"
    dump.mkdir(parents=True)
    run(recipe, 1, [*argv, "--output_dir", str(out / "run"), "--report_to", "none"],
        env={"PYTHONPATH": str(SUPPORT), "DUMP_PREPARED": str(dump)})
    mains = torch.load(dump / "models.pt", weights_only=True)
    r = load_recipe(recipe, argv)
    ours = list(r.build_models().values())
    assert len(ours) == len(mains)
    for model, main in zip(ours, mains):
        state = model.state_dict()
        assert state.keys() == main["state"].keys()
        assert [k for k in state if not torch.equal(state[k], main["state"][k])] == []
        assert {n: p.requires_grad for n, p in model.named_parameters()} == main["requires_grad"]
    return r


@pytest.mark.parametrize("recipe", RECIPES)
def test_load_recipe_uses_the_recipes_seams(tiny_corpus, tmp_path, recipe):
    r = load_as_main_builds(recipe, [*on_tiny_corpus(tiny_corpus), "--max_batch_seconds", "8", *tiny_flags(recipe)],
                            tmp_path)
    # the recipe's checked manifest, its training loader (1 process: a multiple of 1 batch) and sampler
    assert len(r.train_set) == len(r.dataset) > 0
    assert r.data.train_loader.batch_sampler is r.data.train_sampler
    batch = next(iter(r.data.train_loader))
    torch.manual_seed(0)
    model = r.build_model()
    modules = list(model.values()) if isinstance(model, torch.nn.ModuleDict) else [model]
    assert {type(m).__module__ for m in modules} == {"model"}  # the recipe folder's model.py
    loss = r.loss(model, batch)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    loss.backward()
    assert all(any(p.grad is not None for p in m.parameters()) for m in modules)


def test_every_recipe_has_the_same_seams():
    """build_data, build_models, build_optimizers and compute_loss, with the same parameters (and the
    same defaults: build_models(cfg, data), `data` always given)."""
    import inspect

    from benchmarks.recipe import _train_module

    assert {"best_rq", "asr", "tts", "vocoder"} <= set(RECIPES)  # found: every folder under recipes/ with a train.py
    shapes = {}
    for recipe in RECIPES:
        train = _train_module(recipe)
        shapes[recipe] = {name: [(p.name, p.default is p.empty)
                                 for p in inspect.signature(getattr(train, name)).parameters.values()]
                          for name in ("build_data", "build_models", "build_optimizers", "compute_loss")}
    assert all(shape == shapes["best_rq"] for shape in shapes.values()), shapes


@pytest.mark.slow
def test_load_recipe_initializes_from_init_from_as_main_does(tiny_corpus, reference, tmp_path):
    """--init_from read by build_models: an ASR model started from another ASR run (its encoder and
    feature statistics; the suite's shared 30-step run) is the same in the benchmarks as in main."""
    from tests.recipes import test_asr

    base = reference("asr", 1, lambda out: test_asr.args_for(tiny_corpus, out, *test_asr.SHORT_RUN))
    r = load_as_main_builds("asr", [*on_tiny_corpus(tiny_corpus), "--max_batch_seconds", "8", *test_asr.ENCODER,
                                    "--init_from", str(base)], tmp_path)
    prefix = "wav2vec2_bert."  # the encoder's prefix in an exported ASR model (Wav2Vec2BertForCTC)

    model = r.build_model()
    final = load_file(base / "final" / "model.safetensors")  # the encoder under transformers' names
    encoder = {k[len(prefix):]: v for k, v in final.items() if k.startswith(prefix)}
    assert model.stats_given and encoder.keys() == model.encoder.state_dict().keys()
    assert all(torch.equal(v, encoder[k]) for k, v in model.encoder.state_dict().items())
