"""`python -m moai_recipes.recipes RECIPE [KEY=VALUE ...]`: what `moai run RECIPE` runs, from any folder.

A training recipe starts through launch/entry.py, which imports the recipe only in a process that trains
(a launcher of several processes reads the config and starts them); the others run their module's main.
"""

import importlib
import sys

from moai_recipes.launch.entry import recipe_main

TRAINING_RECIPES = ("full_finetune", "lora_finetune")  # whose `train` launch/entry.run_recipe runs

if __name__ == "__main__":
    recipe, args = sys.argv[1], sys.argv[2:]
    module = f"moai_recipes.recipes.{recipe}"
    sys.exit(recipe_main(module, args) if recipe in TRAINING_RECIPES else importlib.import_module(module).main(args))
