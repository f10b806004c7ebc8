"""benchmarks/recipe.py builds each recipe through the seams of its train.py (build_data, build_models,
compute_loss), the same in every recipe: what the benchmarks time is the recipe's own data, models and
loss, and nothing in benchmarks/ or here tells one recipe from another but its flags."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.recipe import RECIPES, load_recipe

# Each recipe's test model (its flags only; a recipe not named here is built with its defaults).
TINY = {"best_rq": ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_dim", "64",
                    "--codebook_size", "64"],
        "asr": ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_dim", "64"],
        "tts": ["--dim", "32", "--ffn_dim", "64", "--duration_channels", "32", "--attention_dim", "32",
                "--num_heads", "2", "--num_valid", "2", "--num_test", "2"],
        "vocoder": ["--dim", "16", "--hidden_dim", "32", "--layers", "1", "--periods", "2,3", "--period_channels",
                    "4,4", "--resolutions", "256,512", "--resolution_channels", "4", "--segment_frames", "12",
                    "--num_valid", "2", "--num_test", "2"]}


def on_tiny_corpus(tiny_corpus) -> list[str]:
    """The flags that make a recipe read the tiny built-in corpus (already made) in the layout it chooses."""
    return ["--builtin_corpus", "tiny", "--data_cache_dir", str(tiny_corpus.parent)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_load_recipe_uses_the_recipes_seams(tiny_corpus, recipe):
    r = load_recipe(recipe, [*on_tiny_corpus(tiny_corpus), "--max_batch_seconds", "8", *TINY.get(recipe, [])])
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
    """build_data, build_models, build_optimizers and compute_loss, with the same parameters."""
    import inspect

    from benchmarks.recipe import _train_module

    assert {"best_rq", "asr", "tts", "vocoder"} <= set(RECIPES)  # found: every folder under recipes/ with a train.py
    shapes = {}
    for recipe in RECIPES:
        train = _train_module(recipe)
        shapes[recipe] = {name: list(inspect.signature(getattr(train, name)).parameters)
                          for name in ("build_data", "build_models", "build_optimizers", "compute_loss")}
    assert all(shape == shapes["best_rq"] for shape in shapes.values()), shapes


def test_model_only_recipe_skips_the_data(tiny_corpus):
    r = load_recipe("best_rq", [*on_tiny_corpus(tiny_corpus), *TINY["best_rq"]], data=False)
    assert not hasattr(r, "data")
    assert sum(p.numel() for p in r.build_model().parameters()) > 0
