"""`python -m recipes.eval` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/eval.py; installed, `moai run eval` runs it from any folder."""

import sys

from moai_recipes.recipes.eval import main

if __name__ == "__main__":
    sys.exit(main())
