"""`python -m moai_recipes.launch RECIPE [KEY=VALUE ...]`: what `moai run RECIPE` runs, from any folder.

A training recipe goes through launch/entry.py (compose once, train here or start the workers); the others
(plan, generate) are one process and run their own main.
"""

import importlib
import sys

from moai_recipes.launch import short

if __name__ == "__main__":
    recipe, args = sys.argv[1], sys.argv[2:]
    if recipe == "plan":  # the dry run: a short process (launch/short.py)
        short.start()

    from moai_recipes.config.compose import load_config

    if "-h" in args or "--help" in args:
        load_config(recipe, args)  # prints the usage and exits before any recipe's imports (torch, torchtune: 5 s)
    from moai_recipes.launch.entry import TRAINING_RECIPES, main

    if recipe in TRAINING_RECIPES:
        sys.exit(main(recipe, args))
    code = importlib.import_module(f"moai_recipes.recipes.{recipe}").main(args)
    if recipe == "plan":
        short.end(code)
    sys.exit(code)
