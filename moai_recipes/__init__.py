"""moai-recipes: fine-tune large language models on any flavor of accelerator with one command."""

import logging

from moai_recipes.deferred_init import defer_package_inits

# torchao (under torchtune) warns on import that its optional C++ kernels do not match torch 2.13;
# nothing we run uses them, and the warning would greet every user on every run.
logging.getLogger("torchao").setLevel(logging.ERROR)
# torchtune's __init__ imports its whole library (0.35 s of a cold dry run): run only when asked (deferred_init.py).
defer_package_inits()
