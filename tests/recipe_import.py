"""One way for tests to import a recipe's modules: `recipe_modules("asr", "data", "model")`.

A recipe's scripts import their siblings by plain name (`from model import ...`, the folder is on
sys.path when the script runs). Here the folder goes on sys.path for the import only, and the
plain names are taken out of sys.modules again afterwards, so that another recipe's `model` or
`data` never collides with this one's. `RECIPES`: the recipes, found (every folder under recipes/
with a train.py), so that tests need no list of them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# Every folder under recipes/ with a train.py is a recipe: a copied one is covered without editing here.
RECIPES = tuple(sorted(p.parent.name for p in ROOT.glob("recipes/*/train.py")))
# The plain names a recipe's scripts import their siblings by: every module in a recipe folder.
LOCAL_NAMES = tuple(sorted({p.stem for recipe in RECIPES for p in (ROOT / "recipes" / recipe).glob("*.py")}))


def recipe_modules(recipe: str, *names: str) -> SimpleNamespace:
    folder = str(ROOT / "recipes" / recipe)
    saved_path = sys.path[:]
    saved = {n: sys.modules.pop(n) for n in LOCAL_NAMES if n in sys.modules}
    sys.path.insert(0, folder)
    try:
        return SimpleNamespace(**{n: importlib.import_module(n) for n in names})
    finally:
        sys.path[:] = saved_path
        for n in LOCAL_NAMES:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
