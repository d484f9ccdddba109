"""`python -m recipes.lora_finetune` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/lora_finetune.py; installed, `moai run lora_finetune` runs it from any folder.

launch/entry.py composes the config once, then trains in this process or starts the flavor's processes on
launch/worker.py."""

import sys

from moai_recipes.launch.entry import main

if __name__ == "__main__":
    sys.exit(main("lora_finetune"))
