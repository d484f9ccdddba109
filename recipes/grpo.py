"""`python -m recipes.grpo` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/grpo.py; installed, `moai run grpo` runs it from any folder.

launch/entry.py composes the config once, then trains in this process or starts the flavor's processes on
launch/worker.py."""

import sys

from moai_recipes.launch.entry import main

if __name__ == "__main__":
    sys.exit(main("grpo"))
