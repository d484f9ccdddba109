"""Recipes from the checkout: `python -m recipes.<name>` runs moai_recipes/recipes/<name>.py (see DESIGN.md)."""
