"""`python -m recipes.dpo` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/dpo.py; installed, `moai run dpo` runs it from any folder.

launch/entry.py composes the config once, then trains in this process or starts the flavor's processes on
launch/worker.py."""

import sys

from moai_recipes.launch.entry import main

if __name__ == "__main__":
    sys.exit(main("dpo"))
