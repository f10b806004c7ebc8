"""One way for tests to import a recipe's modules: `recipe_modules("asr", "data", "model")` (the one of
the benchmarks and tools.demo too, tools/recipe_import.py: a recipe's folder on sys.path for the import
only, its plain module names taken out of sys.modules afterwards). `RECIPES`: every folder under recipes/ with a
train.py, so that tests need no list of them (a copied recipe is covered without editing here), and
`tiny_flags(recipe)`, the test model its train.py declares.
"""

from tools.recipe_import import LOCAL as LOCAL_NAMES, RECIPES, recipe_modules  # noqa: F401


def tiny_flags(recipe: str) -> list[str]:
    """The recipe's test model: the `TEST_TINY` flags its train.py declares, added to its config.yaml to
    train it in seconds on the tiny built-in corpus (a copy brings its own, so no test names a recipe's
    model flags). A train.py without them fails the test that asks, saying what to declare."""
    flags = getattr(recipe_modules(recipe, "train").train, "TEST_TINY", None)
    assert isinstance(flags, list) and all(isinstance(f, str) for f in flags), (
        f"recipes/{recipe}/train.py: declare TEST_TINY = [\"--flag\", \"value\", ...] beside its Config, the "
        f"flags that make its model small enough for the tests (docs/adapt.md)")
    return flags
