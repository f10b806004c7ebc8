"""A recipe for the benchmarks, built through its own seams (`build_data`, `build_models`, `compute_loss`
in its `train.py`, the same in every recipe: README.md, "Adapt a recipe"): nothing here wires a recipe
a second time, and nothing here knows one recipe from another.

`load_recipe(name)`, `name` one of `RECIPES` (every folder under recipes/ with a train.py), builds
what `main` builds before its first step, in its order: the recipe's `build_data` on the built-in
corpus (checked into a temporary output folder; global batch 1, no data workers), then its
`build_models(cfg, data)` (a fresh start: --init_from read as main reads it). It returns a namespace with:
- `cfg`: the recipe's Config (dataclass defaults < its config.yaml), with `overrides` applied and what
  the data recorded applied as main applies it (`data.recorded`: TTS's symbol table);
- `accelerator`: one process, built as `train.py` builds it;
- `data`: what `build_data` returns (`common.data.source.RecipeData`: the source's rows, items, collator,
  loaders, sampler; epoch 0 set on its `epoch_objects`);
- `train_set`, `dataset`, `collator`: its training rows (a manifest), items (before the RAM cache) and collator;
- `build_models()`: the recipe's models by name, as main builds them; `build_model()`: the same as one
  module (the only model, or a `torch.nn.ModuleDict` of them: a GAN's generator and discriminators);
- `loss(model, batch)`: the training loss of one batch at step 0, the recipe's `compute_loss`, summed
  over its models (for a GAN, its backward also reaches the discriminators from the generator's loss:
  the compute of a step, not its update).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]

from tools.recipe_import import RECIPES, recipe_modules  # noqa: F401 (RECIPES: what the benchmarks take)


def _train_module(recipe: str):
    return recipe_modules(recipe, "train").train


def load_recipe(recipe: str, overrides: list[str] = ()) -> SimpleNamespace:
    import dataclasses

    import torch

    from common.config import parse_config
    from common.training.distributed import build_accelerator, seed_everything

    if recipe not in RECIPES:
        raise SystemExit(f"unknown recipe {recipe!r}: one of {', '.join(RECIPES)}")
    train = _train_module(recipe)
    if not hasattr(train, "build_models"):
        raise SystemExit(f"{ROOT / 'recipes' / recipe / 'train.py'} has no build_data/build_models/compute_loss "
                         f"seams (a checkout from before they existed): use a newer one")
    cfg = parse_config(train.Config, list(overrides), default_yaml=ROOT / "recipes" / recipe / "config.yaml")
    r = SimpleNamespace(name=recipe, cfg=cfg, accelerator=build_accelerator())
    seed_everything(cfg.seed)  # as start_run seeds before the data: the models start where main's start
    out = Path(tempfile.mkdtemp(prefix=f"bench_{recipe}_"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    r.data = built = train.build_data(cfg, r.accelerator, out, global_batch=1, num_workers=0)
    if hasattr(built, "recorded"):  # main's next line: what the data decided, recorded in the run's config
        r.cfg = dataclasses.replace(cfg, **built.recorded)
        built.set_epoch(0)
    else:  # a checkout from before `recorded` (benchmarks/checkpoint.py --root): its data's config
        r.cfg = built.cfg
    r.train_set, r.dataset, r.collator = built.source.splits["train"], built.train_items, built.collate
    names = []  # the models' names, as the last build_models gave them

    def build_models() -> dict:
        models = train.build_models(r.cfg, built)
        names[:] = models
        return models

    def build_model():
        models = build_models()
        return models[names[0]] if len(names) == 1 else torch.nn.ModuleDict(models)

    def loss(model, batch):
        models = {names[0]: model} if len(names) == 1 else dict(model.items())
        return sum(train.compute_loss(models, batch, r.cfg, 0)[0].values())

    r.build_models, r.build_model, r.loss = build_models, build_model, loss
    return r
