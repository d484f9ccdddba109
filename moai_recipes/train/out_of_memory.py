"""An out-of-memory step is redone with the next smaller plan, not the end of the run.

The planner's memory model can be wrong on a given machine (another process holds memory, an allocator
fragments, a kernel needs a workspace). When a step's forward or backward runs out of memory (a GPU's
torch.OutOfMemoryError, or the CPU allocator's failure), nothing has been applied yet: the gradients of the
step's micro-batches so far are dropped and the same global batch runs again in smaller micro-batches, the
fastest candidate of the plan's own choice that differs only in a smaller token budget. The loss and the
gradients stay those of the global batch (normalised by its target tokens, whatever the split), so the run
continues exactly as planned; the log says so and plan.json records the change.

On several processes a step cannot be redone in place: a rank that ran out of memory has left the others
waiting inside FSDP's collectives. That rank leaves the smaller plan in the run folder (output_dir.write_hint)
and raises RestartSmaller, on which its process exits with EXIT_OUT_OF_MEMORY (launch/worker.py); the launcher (ours, or torchrun with restarts) starts the processes again, they resume
from the last checkpoint (or the first step) with the smaller plan forced, and redo the steps since then:
the same global batches, the same losses. Without a launcher that restarts, the user runs the same command
again and it does the same.

`MOAI_FAULT_OOM_TOKENS=N` makes any micro-batch of more than N tokens run out of memory, as a device that
size would; `MOAI_FAULT_MEMORY_HEADROOM=BYTES` limits the process's address space after its first step, so that an
allocation fails for real, in the middle of a forward or a backward: how the recovery is tested on the CPU
(tests/test_out_of_memory.py). train/process.py reads them once.
"""

import gc
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from moai_recipes import env
from moai_recipes.checkpoint.output_dir import write_hint
from moai_recipes.errors import RestartSmaller, UserError
from moai_recipes.planner.plan import Plan
from moai_recipes.planner.search import Candidate, PlanChoice
from moai_recipes.train.metrics_log import MetricsLog
from moai_recipes.train.world import World


class StepOutOfMemory(Exception):
    """A step's forward or backward ran out of memory before anything was applied. It carries the error's words only:
    the error's traceback holds the failed pass's frames, and with them its graph and activations, which must be gone
    before the step runs again (tests/test_out_of_memory.py checks that the redo fits where they would not)."""


def is_out_of_memory(error: BaseException) -> bool:
    """A GPU's out-of-memory error, or the CPU allocator's ("can't allocate memory"), or Python's MemoryError."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def injected_fault(tokens: int, limit: int | None) -> None:
    """Raise an out-of-memory error for a micro-batch of more than `limit` tokens (MOAI_FAULT_OOM_TOKENS; None: never)."""
    if limit is not None and tokens > limit:
        raise torch.OutOfMemoryError(f"{env.FAULT_OOM_TOKENS}={limit}: a micro-batch of {tokens} tokens is out of memory")


@contextmanager
def address_space_limit(headroom: int | None):
    """Within the block, from the first time `limit()` is called, this process's address space may grow by `headroom`
    bytes more and no further (MOAI_FAULT_MEMORY_HEADROOM; None: no limit): an allocation past it fails as on a
    machine that size, wherever it happens. Lifted at the end (the export and the plots load libraries)."""
    import resource

    import psutil

    before = resource.getrlimit(resource.RLIMIT_AS)

    def limit():
        if headroom is not None:
            resource.setrlimit(resource.RLIMIT_AS, (psutil.Process().memory_info().vms + headroom, before[1]))

    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)


def release_memory(optimizer: torch.optim.Optimizer) -> None:
    """Drop the failed step's gradients and give the caches back before it runs again."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def smaller_plan(choice: PlanChoice, plan: Plan, *, step: int, error: str) -> Candidate:
    """The fastest candidate that differs from `plan` only by a smaller token budget; a UserError when none does."""
    smaller = [c for c in choice.candidates
               if replace(c.plan, micro_batch_size=plan.micro_batch_size, accumulation_steps=plan.accumulation_steps) == plan
               and c.plan.token_budget < plan.token_budget]
    best = min(smaller, key=lambda c: c.time.total_s, default=None)
    if best is None:
        raise UserError(f"step {step}: out of memory with micro-batches of up to {plan.token_budget} tokens "
                        f"({str(error).splitlines()[0][:200]}), and no smaller plan of the same kind exists. Run the "
                        "same command again with more recomputation (plan.recompute=full) or a flavor with more "
                        "memory per device; resume=auto continues from the last checkpoint")
    return best


def forced_plan(forced, hint: dict | None) -> dict:
    """The plan fields the user forced (plan.*), with the smaller micro-batch an out-of-memory step of this run
    left (`hint`, RunInputs.out_of_memory_hint), if any."""
    return {**dict(forced or {}), "micro_batch_size": hint["micro_batch_size"]} if hint else dict(forced or {})


class SmallerOnOutOfMemory:
    """Runs each step as the plan says and, after an out-of-memory error, the same global batch again with the next
    smaller plan; `choice` is the plan the run goes on with. On several processes the processes start again
    instead (RestartSmaller), leaving the smaller plan in the run folder for them."""

    def __init__(self, choice: PlanChoice, *, world: World, out: Path, hint: dict | None, log: MetricsLog | None):
        self.choice, self.world, self.out, self.log = choice, world, out, log
        self._earlier = (hint or {}).get("changes", [])  # this run's earlier restarts, kept in the hint

    @property
    def plan(self) -> Plan:
        return self.choice.chosen.plan

    def run(self, step_fn, *, step: int, optimizer: torch.optim.Optimizer):
        """`step_fn(plan)` (a step that raises StepOutOfMemory before it applies anything), redone smaller until it
        fits; a UserError when no smaller plan of the same kind exists."""
        while True:
            try:
                return step_fn(self.plan)
            except StepOutOfMemory as oom:
                release_memory(optimizer)
                smaller = smaller_plan(self.choice, self.plan, step=step, error=str(oom))
                change = {"step": step, "error": str(oom).splitlines()[0][:300], "from": self.plan.as_dict(),
                          "to": smaller.plan.as_dict()}
                if self.world.world_size > 1:  # the others wait inside a collective: start them all again, smaller
                    mbs = smaller.plan.micro_batch_size
                    write_hint(self.out, micro_batch_size=mbs, changes=[*self._earlier, change])
                    raise RestartSmaller(f"step {step} ran out of memory ({change['error']}); the processes start "
                                         f"again with plan.micro_batch_size={mbs}, from the last checkpoint")
                self.choice = replace(self.choice, chosen=smaller)
                if self.log:
                    self.log.plan_changed(self.choice.as_dict(), change)
