"""benchmarks/recipe.py builds each recipe through the seams of its train.py (build_data, build_model,
compute_loss): what the benchmarks time is the recipe's own data, model and loss."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.recipe import load_recipe

TINY = {"best_rq": ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_dim", "64",
                    "--codebook_size", "64"],
        "asr": ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_dim", "64"],
        "tts": ["--dim", "32", "--ffn_dim", "64", "--duration_channels", "32", "--attention_dim", "32",
                "--num_heads", "2", "--num_valid", "2", "--num_test", "2"]}


@pytest.mark.parametrize("recipe", ["best_rq", "asr", "tts"])
def test_load_recipe_uses_the_recipes_seams(tiny_corpus, recipe):
    layout = "ljspeech" if recipe == "tts" else "librispeech"
    r = load_recipe(recipe, ["--data_dir", str(tiny_corpus / layout), "--max_batch_seconds", "8", *TINY[recipe]])
    # the recipe's checked manifest, its training loader (1 process: a multiple of 1 batch) and sampler
    assert len(r.train_set) == len(r.dataset) > 0
    assert r.data.train_loader.batch_sampler is r.data.train_sampler
    batch = next(iter(r.data.train_loader))
    torch.manual_seed(0)
    model = r.build_model()
    assert type(model).__module__ == "model"  # the recipe folder's model.py
    loss = r.loss(model, batch)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    loss.backward()
    assert any(p.grad is not None for p in model.parameters())


def test_model_only_recipe_skips_the_data(tiny_corpus):
    r = load_recipe("best_rq", ["--data_dir", str(tiny_corpus / "librispeech"), *TINY["best_rq"]], data=False)
    assert not hasattr(r, "data")
    assert sum(p.numel() for p in r.build_model().parameters()) > 0
