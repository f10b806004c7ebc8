"""A recipe for the benchmarks, built through its own seams (`build_data`, `build_model`, `compute_loss`
in its `train.py`): nothing here wires a recipe a second time.

`load_recipe("best_rq" | "asr" | "tts")` returns a namespace with:
- `cfg`: the recipe's Config (dataclass defaults < its config.yaml), with `overrides` applied;
- `accelerator`: one process, built as `train.py` builds it;
- `build_model()`: the recipe's model, freshly initialized;
- `loss(model, batch)`: the training loss of one batch, the recipe's `compute_loss`;
and, unless `data=False`, the recipe's `build_data` on the built-in corpus (checked into a temporary
output folder; global batch 1, no data workers):
- `data`: what it returns (`common.data.RecipeData`: manifests, items, collator, loaders, sampler);
- `train_set`, `dataset`, `collator`: its training manifest, items (before the RAM cache; epoch 0) and
  collator.
"""

from __future__ import annotations

import atexit
import importlib
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ("audio", "ctc_decode", "data", "frontend", "model", "scoring", "text", "train")
RECIPES = ("best_rq", "asr", "tts")


def _train_module(recipe: str):
    """A recipe's `train` module, imported by its plain name (its siblings too, as its scripts do), then
    the names taken out of sys.modules so that another recipe's `model`/`data` cannot collide.
    Importing it parses no command line (train.py does that only under `__main__`)."""
    saved_path, saved = sys.path[:], {n: sys.modules.pop(n) for n in LOCAL if n in sys.modules}
    sys.path.insert(0, str(ROOT / "recipes" / recipe))
    try:
        return importlib.import_module("train")
    finally:
        sys.path[:] = saved_path
        for n in LOCAL:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def load_recipe(recipe: str, overrides: list[str] = (), *, data: bool = True) -> SimpleNamespace:
    from common.config import parse_config
    from common.distributed import build_accelerator

    if recipe not in RECIPES:
        raise SystemExit(f"unknown recipe {recipe!r}: one of {', '.join(RECIPES)}")
    train = _train_module(recipe)
    if not hasattr(train, "build_data"):
        raise SystemExit(f"{ROOT / 'recipes' / recipe / 'train.py'} has no build_data/build_model/compute_loss "
                         f"seams (a checkout from before they existed): use a newer one")
    cfg = parse_config(train.Config, list(overrides), default_yaml=ROOT / "recipes" / recipe / "config.yaml")
    r = SimpleNamespace(name=recipe, cfg=cfg, accelerator=build_accelerator())
    tokenizer = None
    if data or recipe == "asr":  # ASR's model is sized by its tokenizer, built with the data
        out = Path(tempfile.mkdtemp(prefix=f"bench_{recipe}_"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        built = train.build_data(cfg, r.accelerator, out, global_batch=1, num_workers=0)
        if recipe == "asr":  # (data, tokenizer)
            r.data, tokenizer = built
        elif recipe == "tts":  # (data, cfg with the symbol table the items were encoded with)
            r.data, cfg = built
            r.cfg = cfg
        else:
            r.data = built
        r.train_set, r.dataset, r.collator = r.data.train_set, r.data.train_items, r.data.collate
        for obj in (r.dataset, r.collator):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(0)
    if recipe == "asr":
        r.build_model = lambda: train.build_model(cfg, tokenizer.vocab_size)
    else:
        r.build_model = lambda: train.build_model(cfg)
    if recipe == "tts":  # before binarization_start_steps: no binarization loss
        r.loss = lambda model, batch: train.compute_loss(model, batch, cfg, binarize=False)[0]
    else:
        r.loss = lambda model, batch: train.compute_loss(model, batch)[0]
    return r
