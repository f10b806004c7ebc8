"""Every shipped YAML is valid: recipe configs against their recipe's Config dataclass (no unknown
keys, every value of the declared type), accelerate profiles through accelerate's own loader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from common.config import parse_config
from common.config_rules import Range, field_specs
from tests.harness.recipe_import import RECIPES, recipe_modules

ROOT = Path(__file__).resolve().parents[1]
RECIPE_CONFIGS = sorted(ROOT.glob("recipes/*/config*.yaml"))


def recipe_config_class(recipe_dir: Path):
    return recipe_modules(recipe_dir.name, "train").train.Config


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_config_is_valid(path):
    cfg = parse_config(recipe_config_class(path.parent), ["--config", str(path)])
    assert cfg.max_steps > 0 and cfg.save_steps > 0


# Every script of every recipe (a folder under recipes/ with a train.py) that parses a Config: found
# from its `parse_config(ConfigClass` call, so that a copied recipe's scripts are checked unedited.
RECIPE_SCRIPTS = [(recipe, script.stem, name) for recipe in RECIPES
                  for script in sorted((ROOT / "recipes" / recipe).glob("*.py"))
                  for name in dict.fromkeys(re.findall(r"\bparse_config\((\w+)", script.read_text()))]


def test_the_scripts_are_found():
    assert {("best_rq", "train", "Config"), ("asr", "decode", "EvalConfig"), ("vocoder", "evaluate", "EvalConfig")} \
        <= set(RECIPE_SCRIPTS)
    assert {recipe for recipe, script, _ in RECIPE_SCRIPTS if script == "train"} == set(RECIPES)


@pytest.mark.parametrize("recipe,script,name", RECIPE_SCRIPTS, ids=lambda x: x)
def test_every_number_of_a_recipe_config_has_a_range(recipe, script, name):
    """A float field without bounds is how `--dropout 2` or `--max_grad_norm 0` once trained."""
    cls = getattr(getattr(recipe_modules(recipe, script), script), name)
    unbounded = [f for f, (tp, rules) in field_specs(cls).items()
                 if tp is float and not any(isinstance(r, Range) for r in rules)]
    assert not unbounded, f"{recipe}/{script}.py {name}: float fields without a Range: {unbounded}"


@pytest.mark.parametrize("path", sorted(ROOT.glob("accelerate_configs/*.yaml")), ids=lambda p: p.name)
def test_accelerate_profile_loads(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
