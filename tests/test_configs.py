"""Every shipped YAML is valid: recipe configs against their recipe's Config dataclass (no unknown
keys, every value of the declared type), accelerate profiles through accelerate's own loader."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from common.config import parse_config
from tests.recipe_import import recipe_modules

ROOT = Path(__file__).resolve().parents[1]
RECIPE_CONFIGS = sorted(ROOT.glob("recipes/*/config*.yaml"))


def recipe_config_class(recipe_dir: Path):
    return recipe_modules(recipe_dir.name, "train").train.Config


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_config_is_valid(path):
    cfg = parse_config(recipe_config_class(path.parent), ["--config", str(path)])
    assert cfg.max_steps > 0 and cfg.save_steps > 0


@pytest.mark.parametrize("path", sorted(ROOT.glob("accelerate_configs/*.yaml")), ids=lambda p: p.name)
def test_accelerate_profile_loads(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
