"""The optimizer, its schedule and gradient clipping, as every recipe builds them."""

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moai_recipes.planner.plan import Plan


def build_optimizer(params, settings, plan: Plan) -> torch.optim.Optimizer:
    """AdamW over `params` as the `optimizer` config group says, its moments in plan.optimizer_states:

    - fp32 or bf16 moments, in the trained weights' dtype (precision=mixed: fp32 masters; precision=bf16: bf16
      weights): torch's fused AdamW, one pass over each parameter, its gradient and moments, no temporaries. On the
      CPU too: there torch's foreach AdamW loops over the tensors op by op (a dozen passes over memory), 6.7x slower
      for SmolLM2-135M's parameters (47 ms against 313 ms a step). bf16 weights are updated rounding to nearest, as
      torchtune's bf16 runs are: an update below half a weight's last bit (8 bits of mantissa) is lost. Stochastic
      rounding (torchao's AdamW, bf16_stochastic_round) would keep it in expectation, but its compiled kernel fails on
      FSDP2's sharded parameters (torchao 0.14.1, torch 2.13: the noise is drawn at the whole weight's shape), and
      one process rounding otherwise than eight would give the flavors different loss curves.
    - int8 moments (optimizer.states=int8): torchao's 8-bit AdamW, each moment quantised per block of 256 values. Its
      step is a compiled kernel per parameter shape (inductor, on the CPU as on GPUs): the first steps take the
      compile time.

    With plan.optimizer_in_backward, that AdamW for each parameter, applied in the backward
    (train/optimizer_in_backward.py)."""
    if plan.optimizer_in_backward:  # each parameter updated in the backward, as soon as its gradient is complete
        from moai_recipes.train.optimizer_in_backward import AdamWInBackward

        return AdamWInBackward(params, plan, engine=lambda one: _adamw(one, settings, plan))
    return _adamw(params, settings, plan)


def _adamw(params, settings, plan: Plan) -> torch.optim.Optimizer:
    kwargs = dict(lr=settings.lr, betas=tuple(settings.betas), eps=settings.eps, weight_decay=settings.weight_decay)
    if plan.optimizer_states == "int8":
        from torchao.optim import AdamW8bit

        return _outside_dispatch_modes(AdamW8bit)(params, **kwargs)
    return torch.optim.AdamW(params, fused=True, **kwargs)


def _outside_dispatch_modes(cls: type) -> type:
    """A torchao optimizer whose step runs with the dispatch modes set aside: its step is torch.compile(fullgraph=True),
    which dynamo refuses under a mode, and the CPU's first steps run under MemTracker's (train/peak_memory.py). What
    the step allocates is then not followed (a compiled kernel per parameter: no temporaries the size of the
    model); the moments are, as the optimizer's state, from the step after their first."""
    from torch.utils._python_dispatch import _disable_current_modes

    class Untracked(cls):
        def step(self, closure=None):
            with _disable_current_modes():
                return super().step(closure)

    Untracked.__name__ = Untracked.__qualname__ = cls.__name__
    return Untracked


def build_scheduler(optimizer, settings, *, total_steps: int):
    """Linear warm-up over `settings.warmup_steps`, then cosine decay to zero at `total_steps`."""
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=settings.warmup_steps,
                                           num_training_steps=total_steps)


@contextlib.contextmanager
def _quiet_redistribution():
    """Within it, DTensor does not warn that a norm partial over two mesh dimensions (FSDP2's shards x the tensor
    devices) takes two all-reduces, one a dimension: of one scalar a step, which costs two latencies and nothing
    else, and every rank reduces in the same order. The warning, once a process, read as a fault."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def clip_gradients(model: nn.Module, max_norm: float | None, *, stages=None, counted_elsewhere=()) -> float:
    """Clip to `max_norm` (None: measure only) and return the total gradient norm before clipping: over every
    shard (DTensor), and over the pipeline's `stages` (a process group: each stage holds its own layers).
    `counted_elsewhere`: parameters another stage holds too (a tied embedding's copy, train/pipeline.py), clipped here
    but counted in the norm there."""
    # DTensors on different meshes (split experts beside FSDP2's shards) are measured mesh by mesh.
    by_mesh: dict = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    skip = {id(p) for p in counted_elsewhere}
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group if id(p) not in skip], norm_type=2.0)
             for group in by_mesh.values()]
    with _quiet_redistribution():
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    norm = norms[0] if len(norms) == 1 else torch.stack([n.double() for n in norms]).norm().to(norms[0].dtype)
    if stages is not None:
        squared = norm.double() ** 2
        dist.all_reduce(squared, group=stages)
        norm = squared.sqrt().to(norm.dtype)
    # torch scales by min(1, max_norm / (norm + 1e-6)): by exactly 1, a pass over every gradient that changes
    # nothing (3% of a SmolLM2 bf16 CPU step, perf): skipped, on the same condition computed in the same dtype.
    coef = max_norm / (norm + 1e-6) if max_norm is not None else None
    if coef is not None and float(coef) < 1.0:
        # Each process scales its own part of every gradient, as torch's clip_grads_with_norm_ does through DTensor:
        # a scale is linear, so a shard, a replica and a partial sum (the LoRA A of a tensor-parallel projection,
        # whose gradient is summed over the tensor devices later) are all scaled right by it. torch 2.11's DTensor
        # scales a partial sum wrongly (a replicated weight's partial gradient came out 0.004 off, its norm 0.007):
        # its local tensors are scaled here on any version.
        groups: dict = {}
        for p in (p for group in by_mesh.values() for p in group):
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), grads in groups.items():  # one pass a device and dtype, as torch's own clipping groups them
            torch._foreach_mul_(grads, coef.to(device))
    return float(norm)


