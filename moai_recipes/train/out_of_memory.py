"""An out-of-memory step is redone with the next smaller plan, not the end of the run.

The planner's memory model can be wrong on a given machine (another process holds memory, an allocator
fragments, a kernel needs a workspace). When a step's forward or backward runs out of memory (a GPU's
torch.OutOfMemoryError, or the CPU allocator's failure), nothing has been applied yet: the gradients of the
step's micro-batches so far are dropped and the same global batch runs again in smaller micro-batches, the
fastest candidate of the plan's own choice that differs only in a smaller token budget. The loss and the
gradients stay those of the global batch (normalised by its target tokens, whatever the split), so the run
continues exactly as planned; the log says so and plan.json records the change.

On several processes a step cannot be redone in place: a rank that ran out of memory has left the others
waiting inside FSDP's collectives. That rank leaves the smaller plan in the run folder (OUT_OF_MEMORY_HINT)
and exits with EXIT_OUT_OF_MEMORY; the launcher (ours, or torchrun with restarts) starts the processes again, they resume
from the last checkpoint (or the first step) with the smaller plan forced, and redo the steps since then:
the same global batches, the same losses. Without a launcher that restarts, the user runs the same command
again and it does the same.

`MOAI_FAULT_OOM_TOKENS=N` makes any micro-batch of more than N tokens run out of memory, as a device that
size would: how the recovery is tested on the CPU (tests/test_out_of_memory.py).
"""

import gc
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from moai_recipes.checkpoint.run_folder import OUT_OF_MEMORY_HINT, read_hint
from moai_recipes.errors import EXIT_OUT_OF_MEMORY, UserError
from moai_recipes.files import write_json
from moai_recipes.planner.plan import Plan
from moai_recipes.planner.search import Candidate, PlanChoice

FAULT_TOKENS = "MOAI_FAULT_OOM_TOKENS"


def is_out_of_memory(error: BaseException) -> bool:
    """A GPU's out-of-memory error, or the CPU allocator's ("can't allocate memory"), or Python's MemoryError."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def injected_fault(tokens: int) -> None:
    """Raise an out-of-memory error for a micro-batch larger than MOAI_FAULT_OOM_TOKENS (unset: never)."""
    limit = os.environ.get(FAULT_TOKENS)
    if limit and tokens > int(limit):
        raise torch.OutOfMemoryError(f"{FAULT_TOKENS}={limit}: a micro-batch of {tokens} tokens is out of memory")


def release_memory(optimizer: torch.optim.Optimizer) -> None:
    """Drop the failed step's gradients and give the caches back before it runs again."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def smaller_plan(choice: PlanChoice, plan: Plan, *, step: int, error: BaseException) -> Candidate:
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


def forced_plan(forced, out: Path | None) -> dict:
    """The plan fields the user forced (plan.*), with the smaller micro-batch an out-of-memory step of this run
    folder left, if any."""
    hint = read_hint(out)
    return {**dict(forced or {}), "micro_batch_size": hint["micro_batch_size"]} if hint else dict(forced or {})


def restart_smaller(out: Path, change: dict, *, micro_batch_size: int) -> None:
    """On several processes: leave the smaller plan for the restarted processes and end this one at once (the
    others wait inside a collective that will never come; the launcher stops them)."""
    earlier = (read_hint(out) or {}).get("changes", [])
    write_json(out / OUT_OF_MEMORY_HINT, {"micro_batch_size": micro_batch_size, "changes": [*earlier, change]})
    print(f"Rank {os.environ.get('RANK', '0')}: step {change['step']} ran out of memory ({change['error']}); the "
          f"processes start again with plan.micro_batch_size={micro_batch_size}, from the last checkpoint",
          file=sys.stderr, flush=True)
    os._exit(EXIT_OUT_OF_MEMORY)
