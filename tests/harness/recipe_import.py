"""One way for tests to import a recipe's modules: `recipe_modules("asr", "data", "model")` (the
benchmarks' own, benchmarks/recipe.py: a recipe's folder on sys.path for the import only, its plain
module names taken out of sys.modules afterwards). `RECIPES`: every folder under recipes/ with a
train.py, so that tests need no list of them (a copied recipe is covered without editing here).
"""

from benchmarks.recipe import LOCAL as LOCAL_NAMES, RECIPES, recipe_modules  # noqa: F401
