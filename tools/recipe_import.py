"""Import a recipe's modules from outside its folder, as its own scripts import them.

A recipe's scripts import their siblings by plain name (`from model import ...`: the folder is on
sys.path when a script runs), so two recipes' `model` or `data` would collide in one process.
`recipe_path(recipe)` puts the recipe's folder first on sys.path for a block and keeps every recipe's
plain module names apart meanwhile (another recipe's are taken out of sys.modules and restored after);
`recipe_modules(recipe, *names)` imports some of them that way. Used by the benchmarks, the tests
(tests/harness/recipe_import.py) and tools.demo (ASR and TTS in one process). Standard library only.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# Every folder under recipes/ with a train.py is a recipe (a copied one is found unedited), and every
# module in a recipe folder a plain name its scripts import.
RECIPES = tuple(sorted(p.parent.name for p in ROOT.glob("recipes/*/train.py")))
LOCAL = tuple(sorted({p.stem for p in ROOT.glob("recipes/*/*.py")}))


@contextlib.contextmanager
def recipe_path(recipe: str):
    """recipes/<recipe>/ first on sys.path for the block, the recipes' plain module names (model, data,
    train, ...) out of sys.modules meanwhile; afterwards sys.path and those entries are as before.
    Import inside the block everything the recipe's code will import (a lazy import after it would
    find another recipe's module, or none)."""
    saved_path, saved = sys.path[:], {n: sys.modules.pop(n) for n in LOCAL if n in sys.modules}
    sys.path.insert(0, str(ROOT / "recipes" / recipe))
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for n in LOCAL:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def recipe_modules(recipe: str, *names: str) -> SimpleNamespace:
    """A recipe's modules by their plain names (`recipe_modules("asr", "data", "model")`), imported
    inside `recipe_path`. Importing `train` parses no command line (train.py does that only under
    `__main__`)."""
    with recipe_path(recipe):
        return SimpleNamespace(**{n: importlib.import_module(n) for n in names})
