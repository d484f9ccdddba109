"""`python -m recipes.full_finetune` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/full_finetune.py; installed, `moai run full_finetune` runs it from any folder.

Only the process that trains imports the recipe: with several processes, this one reads the config and starts
them (launch/entry.py)."""

import sys

from moai_recipes.launch.entry import recipe_main

if __name__ == "__main__":
    sys.exit(recipe_main("moai_recipes.recipes.full_finetune"))
