"""`python -m recipes.export` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/export.py; installed, `moai run export` runs it from any folder."""

import sys

from moai_recipes.recipes.export import main

if __name__ == "__main__":
    sys.exit(main())
