"""`python -m recipes.full_finetune` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/full_finetune.py; installed, `moai run full_finetune` runs it from any folder.

launch/entry.py composes the config once, then trains in this process or starts the flavor's processes on
launch/worker.py."""

import sys

from moai_recipes.launch.entry import main

if __name__ == "__main__":
    sys.exit(main("full_finetune"))
