"""`python -m recipes.full_finetune` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/full_finetune.py; installed, `moai run full_finetune` runs it from any folder."""

import sys

from moai_recipes.recipes.full_finetune import main

if __name__ == "__main__":
    sys.exit(main())
