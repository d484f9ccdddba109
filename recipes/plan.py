"""`python -m recipes.plan` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/plan.py; installed, `moai run plan` runs it from any folder."""

import sys

from moai_recipes.recipes.plan import main

if __name__ == "__main__":
    sys.exit(main())
