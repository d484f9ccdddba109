"""moai-recipes: fine-tune large language models on any flavor of accelerator with one command."""

import logging

# torchao (under torchtune) warns on import that its optional C++ kernels do not match torch 2.13;
# nothing we run uses them, and the warning would greet every user on every run.
logging.getLogger("torchao").setLevel(logging.ERROR)
