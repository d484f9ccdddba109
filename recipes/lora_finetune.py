"""`python -m recipes.lora_finetune` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/lora_finetune.py; installed, `moai run lora_finetune` runs it from any folder."""

import sys

from moai_recipes.recipes.lora_finetune import main

if __name__ == "__main__":
    sys.exit(main())
