"""The planner: decide, before the first step and without touching a device, how a run executes.

plan.py holds what is planned (Workload) and the Plan; activations.py traces one layer and the head of
the real model on fake tensors; memory.py predicts a plan's peak per device; timing.py its step time;
search.py enumerates the plans and picks the fastest that fits (choose_plan). Nothing is imported here:
importing planner.plan (the Plan a launcher or a tool reads) must not pull in the tracing and torchtune.
"""
