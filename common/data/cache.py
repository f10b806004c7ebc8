"""Where the per-machine data caches live: the built-in corpus (tools/corpus.py) and the built-in bases
trained on it (common/training/builtin_base.py). Standard library only: tools/corpus.py imports it
without torch."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(data_cache_dir: str | Path | None) -> Path:
    """The per-machine cache of the built-in corpus (tools/corpus.py) and of its bases: `data_cache_dir`,
    else $SPEECH_RECIPES_CACHE, else ~/.cache/speech_recipes."""
    root = data_cache_dir or os.environ.get("SPEECH_RECIPES_CACHE") or Path.home() / ".cache" / "speech_recipes"
    return Path(root).expanduser()
