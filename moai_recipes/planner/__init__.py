"""The planner: decide, before the first step and without touching a device, how a run executes.

activations.py counts one layer's activation memory from the real model (FakeTensorMode +
MemTracker); memory.py predicts a plan's peak per device; timing.py its step time; search.py
enumerates the plans and picks the fastest that fits.
"""

from moai_recipes.planner.search import GiB, PlanChoice, choose_plan

__all__ = ["GiB", "PlanChoice", "choose_plan"]
