"""`python -m recipes.plan` from the checkout. The recipe itself, read top to bottom, is
moai_recipes/recipes/plan.py; installed, `moai run plan` runs it from any folder."""

from moai_recipes.launch import short

short.start()  # before the imports (launch/short.py)

from moai_recipes.recipes.plan import main  # noqa: E402

if __name__ == "__main__":
    short.end(main())
