"""`python -m recipes.generate` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/generate.py; installed, `moai run generate` runs it from any folder."""

import sys

from moai_recipes.recipes.generate import main

if __name__ == "__main__":
    sys.exit(main())
