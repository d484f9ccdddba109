"""moai-recipes: fine-tune large language models on any flavor of accelerator with one command."""
