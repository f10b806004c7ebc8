"""One way for tests to import a recipe's modules: `recipe_modules("asr", "data", "model")`.

A recipe's scripts import their siblings by plain name (`from model import ...`, the folder is on
sys.path when the script runs). Here the folder goes on sys.path for the import only, and the
plain names are taken out of sys.modules again afterwards, so that another recipe's `model` or
`data` never collides with this one's.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
LOCAL_NAMES = ("audio", "ctc_decode", "data", "frontend", "model", "scoring", "text", "train", "decode", "synthesize",
               "score", "lm", "export", "evaluate")


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
