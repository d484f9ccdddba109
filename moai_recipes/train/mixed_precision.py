"""Mixed precision on a plain module (one process): what FSDP2's MixedPrecisionPolicy does for a sharded model,
without its per-layer copies in and out.

The module's registered parameters stay the fp32 master weights, so the optimizer, the gradient clipping, the
checkpoints and the exported model see only them. For a step (or an evaluation) `compute_copies` registers a bf16
copy of each in its place; each micro-batch's bf16 gradient is added to its master's fp32 gradient as soon as
autograd has it, which is what FSDP2 does with `reduce_dtype=float32` in a world of one. So a step computes the
same numbers as under FSDP2, bit for bit, and the losses stay those of the sharded plans.

Why not FSDP2 in one process: there it copies every layer's parameters into and out of its all-gather buffers and
casts them twice a step (forward, and again for the backward) and its gradients out of reduce-scatter buffers.
With bf16 matmuls 4x faster than fp32 on the CPU, that showed: SmolLM2-135M's bf16 step took 1.0 s under FSDP2 and
0.87 s without it (the same losses and gradient norms, bit for bit). But the whole model's bf16 copy is alive
through the step, where FSDP2 resharded after the forward holds a layer or two: the planner weighs the two
(Plan.sharded, `reshard_after_forward`) and falls back to FSDP2 where the copy does not fit (an 8B LoRA on one 80 GB
GPU). Replicas (several processes) stay fp32: the planner offers them only there.
"""

from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from moai_recipes.models.build import is_nf4
from moai_recipes.planner.plan import Plan


def _slots(model: nn.Module) -> dict[nn.Parameter, list[tuple[nn.Module, str]]]:
    """Each floating-point parameter and the (module, name) places that register it: a weight tied by registering
    it twice is one parameter with two places. NF4 base weights (QLoRA) compute in their own dtype already."""
    slots = defaultdict(list)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point() and not is_nf4(p):
                slots[p].append((module, name))
    return slots


def _register(tensor: nn.Parameter, places: list[tuple[nn.Module, str]]) -> None:
    """`tensor` as the parameter of each (module, name) place."""
    for module, name in places:
        module._parameters[name] = tensor


@contextmanager
def compute_copies(model: nn.Module, dtype: torch.dtype):
    """Within it, `model` computes with `dtype` copies of its parameters; the gradients of the trainable ones reach
    the fp32 masters' `.grad` (added to what is there), and the masters are registered again on the way out."""
    slots = _slots(model)
    hooks = []
    for master, places in slots.items():
        if master.requires_grad:
            copy = nn.Parameter(master.detach().to(dtype))
            hooks.append(copy.register_post_accumulate_grad_hook(_to_master(master)))
        else:
            copy = _frozen_copy(master, dtype)
        _register(copy, places)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for master, places in slots.items():
            _register(master, places)


# A frozen weight's copy (LoRA's base), kept from one step to the next: casting SmolLM2-135M's base again every step
# was 5% of a LoRA step. It is held through every step anyway (the planner counts it), so keeping it costs no peak.
# Made again if the master changed since.
_FROZEN = WeakIdKeyDictionary()  # master -> (what it was when copied, the copy); by identity, as tensors compare by value


def _frozen_copy(master: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
    seen = (master._version, master.data_ptr(), dtype)  # changed in place, or given other memory (`.data =`)
    held = _FROZEN.get(master)
    if held is None or held[0] != seen:
        held = (seen, nn.Parameter(master.detach().to(dtype), requires_grad=False))
        _FROZEN[master] = held
    return held[1]


def _to_master(master: nn.Parameter):
    def hook(copy: nn.Parameter) -> None:
        # FSDP2 (reduce_dtype float32): the bf16 gradient in fp32, added to the sharded one of earlier micro-batches
        # (in place: the bf16 values are widened as they are added, no fp32 copy of them made first).
        if master.grad is None:
            master.grad = copy.grad.to(master.dtype)
        else:
            master.grad.add_(copy.grad)
        copy.grad = None  # each micro-batch's gradient is added once, and the copy's memory goes at once

    return hook


def in_compute_dtype(model: nn.Module, plan: Plan):
    """The context a plan's forward and backward passes run in: `compute_copies` where a plain module computes in a
    dtype below its master weights' (Plan.casts_copies), nothing where FSDP2 casts or nothing is cast."""
    return compute_copies(model, getattr(torch, plan.param_dtype)) if plan.casts_copies else nullcontext()


def frozen_in_compute_dtype(model: nn.Module, plan: Plan) -> nn.Module:
    """`model` frozen (recipes.dpo's reference copy), its parameters cast once to the plan's compute dtype where a
    plain module computes on copies: it never changes, so one copy serves every step."""
    model.requires_grad_(False)
    if plan.casts_copies:
        for master, places in _slots(model).items():
            _register(nn.Parameter(master.detach().to(getattr(torch, plan.param_dtype)), requires_grad=False), places)
    return model
