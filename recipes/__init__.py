"""Recipes: one file per recipe, run from the repository root as `python -m recipes.<name>`."""
