"""A recipe for the benchmarks, built through its own seams (`build_data`, `build_models`, `compute_loss`
in its `train.py`, the same in every recipe: README.md, "Adapt a recipe"): nothing here wires a recipe
a second time, and nothing here knows one recipe from another.

`load_recipe(name)`, `name` one of `RECIPES` (every folder under recipes/ with a train.py), returns a
namespace with:
- `cfg`: the recipe's Config (dataclass defaults < its config.yaml), with `overrides` applied (and,
  with the data, as the data left it: TTS's symbol table);
- `accelerator`: one process, built as `train.py` builds it;
- `build_models()`: the recipe's models by name, freshly initialized; `build_model()`: the same as one
  module (the only model, or a `torch.nn.ModuleDict` of them: a GAN's generator and discriminators);
- `loss(model, batch)`: the training loss of one batch at step 0, the recipe's `compute_loss`, summed
  over its models (for a GAN, its backward also reaches the discriminators from the generator's loss:
  the compute of a step, not its update);
and, unless `data=False` (a recipe whose models are sized by its data builds it anyway), the recipe's
`build_data` on the built-in corpus (checked into a temporary output folder; global batch 1, no data
workers):
- `data`: what it returns (`common.data.source.RecipeData`: the source's rows, items, collator, loaders, sampler);
- `train_set`, `dataset`, `collator`: its training rows (a manifest), items (before the RAM cache;
  epoch 0) and collator.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# Every folder under recipes/ with a train.py is a recipe (a copied one is benchmarked unedited), and
# every module in a recipe folder a plain name its scripts import.
RECIPES = tuple(sorted(p.parent.name for p in ROOT.glob("recipes/*/train.py")))
LOCAL = tuple(sorted({p.stem for recipe in RECIPES for p in (ROOT / "recipes" / recipe).glob("*.py")}))


def recipe_modules(recipe: str, *names: str) -> SimpleNamespace:
    """A recipe's modules by their plain names (`recipe_modules("asr", "data", "model")`), imported as its
    scripts import them (the folder on sys.path: their siblings too), then the plain names taken out of
    sys.modules again so that another recipe's `model` or `data` never collides with this one's.
    Importing `train` parses no command line (train.py does that only under `__main__`). The tests
    import recipes with this too (tests/recipe_import.py)."""
    saved_path, saved = sys.path[:], {n: sys.modules.pop(n) for n in LOCAL if n in sys.modules}
    sys.path.insert(0, str(ROOT / "recipes" / recipe))
    try:
        return SimpleNamespace(**{n: importlib.import_module(n) for n in names})
    finally:
        sys.path[:] = saved_path
        for n in LOCAL:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def _train_module(recipe: str):
    return recipe_modules(recipe, "train").train


def _needs_data(train) -> bool:
    """Whether the recipe's models are sized by its data: its `build_models`' `data` has no default
    (a recipe whose models do not depend on the data gives it the default None)."""
    return inspect.signature(train.build_models).parameters["data"].default is inspect.Parameter.empty


def load_recipe(recipe: str, overrides: list[str] = (), *, data: bool = True) -> SimpleNamespace:
    import torch

    from common.config import parse_config
    from common.training.distributed import build_accelerator

    if recipe not in RECIPES:
        raise SystemExit(f"unknown recipe {recipe!r}: one of {', '.join(RECIPES)}")
    train = _train_module(recipe)
    if not hasattr(train, "build_models"):
        raise SystemExit(f"{ROOT / 'recipes' / recipe / 'train.py'} has no build_data/build_models/compute_loss "
                         f"seams (a checkout from before they existed): use a newer one")
    cfg = parse_config(train.Config, list(overrides), default_yaml=ROOT / "recipes" / recipe / "config.yaml")
    r = SimpleNamespace(name=recipe, cfg=cfg, accelerator=build_accelerator())
    built = None
    if data or _needs_data(train):
        out = Path(tempfile.mkdtemp(prefix=f"bench_{recipe}_"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        r.data = built = train.build_data(cfg, r.accelerator, out, global_batch=1, num_workers=0)
        r.cfg = built.cfg
        r.train_set, r.dataset, r.collator = built.source.splits["train"], built.train_items, built.collate
        for obj in (r.dataset, r.collator):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(0)
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
