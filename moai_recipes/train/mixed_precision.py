"""Mixed precision on a plain module (one process): what FSDP2's MixedPrecisionPolicy does for a sharded model,
without its per-layer copies in and out.

The module's registered parameters stay the fp32 master weights of what trains, so the optimizer, the gradient
clipping and the checkpoints see only them; a frozen weight (LoRA's base, DPO's reference) is stored in bf16 from the
start (`stored_as_planned`, as under FSDP2): it never changes, so an fp32 master of it would only hold memory
(SmolLM2-135M's base: 540 MB in fp32 beside its 270 MB bf16 copy). For a step (or an evaluation) `compute_copies`
registers a bf16 copy of each trained weight in its place; each micro-batch's bf16 gradient is added to its master's fp32 gradient as soon as
autograd has it, which is what FSDP2 does with `reduce_dtype=float32` in a world of one. So a step computes the
same numbers as under FSDP2, bit for bit, and the losses stay those of the sharded plans.

Why not FSDP2 in one process: there it copies every layer's parameters into and out of its all-gather buffers and
casts them twice a step (forward, and again for the backward) and its gradients out of reduce-scatter buffers.
With bf16 matmuls 4x faster than fp32 on the CPU, that showed: SmolLM2-135M's bf16 step took 1.0 s under FSDP2 and
0.87 s without it (the same losses and gradient norms, bit for bit). But the bf16 copy of every trained weight is
alive through the step, where FSDP2 resharded after the forward holds a layer or two: the planner weighs the two
(Plan.sharded, `reshard_after_forward`) and falls back to FSDP2 where the copies do not fit (full fine-tuning near the
device's memory). An 8B LoRA on one 80 GB GPU, whose base needed an fp32 master and a bf16 copy, is now a plain
module: its base is 16 GB of bf16, its adapters' copies a few MB. Replicas (several processes) compute in their
master dtype: the planner offers them only there. With precision=bf16 the weights are stored in bf16 and nothing
is cast.
"""

from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

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
def compute_copies(model: nn.Module, dtype: torch.dtype, ready=None):
    """Within it, `model` computes with `dtype` copies of its trained parameters; their gradients reach the fp32
    masters' `.grad` (added to what is there), and the masters are registered again on the way out. Frozen weights
    are stored in `dtype` already (stored_as_planned): they compute as they are. `ready(master)`, if given, is
    called once a master's gradient has the copy's added (autograd's own hooks on the master never run: its gradient
    is not accumulated by autograd): the optimizer in the backward (train/optimizer_in_backward.py)."""
    slots = {p: places for p, places in _slots(model).items() if p.dtype != dtype}
    assert all(p.requires_grad for p in slots), "frozen weights are stored in the compute dtype (stored_as_planned)"
    hooks = []
    for master, places in slots.items():
        copy = nn.Parameter(master.detach().to(dtype))
        hooks.append(copy.register_post_accumulate_grad_hook(_to_master(master, ready)))
        _register(copy, places)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for master, places in slots.items():
            _register(master, places)


def _to_master(master: nn.Parameter, ready=None):
    def hook(copy: nn.Parameter) -> None:
        # FSDP2 (reduce_dtype float32): the bf16 gradient in fp32, added to the sharded one of earlier micro-batches
        # (in place: the bf16 values are widened as they are added, no fp32 copy of them made first).
        if master.grad is None:
            master.grad = copy.grad.to(master.dtype)
        else:
            master.grad.add_(copy.grad)
        copy.grad = None  # each micro-batch's gradient is added once, and the copy's memory goes at once
        if ready is not None:
            ready(master)

    return hook


def in_compute_dtype(model: nn.Module, plan: Plan, optimizer=None):
    """The context a plan's forward and backward passes run in: `compute_copies` where a plain module computes in a
    dtype below its master weights' (Plan.casts_copies), nothing where FSDP2 casts or nothing is cast. `optimizer`:
    the step's, told of each master's gradient when it applies them in the backward."""
    if not plan.casts_copies:
        return nullcontext()
    return compute_copies(model, getattr(torch, plan.param_dtype), ready=getattr(optimizer, "gradient_ready", None))


def stored_as_planned(model: nn.Module, plan: Plan) -> nn.Module:
    """`model`'s weights in the dtypes the plan stores them in: a trained one in the master dtype (fp32; bf16 with
    precision=bf16), a frozen one (LoRA's base, recipes.dpo's reference copy) in the compute dtype: a weight that never
    changes needs no fp32 master beside the copy it computes with. Called on the meta model, before FSDP2 shards it
    (which then gathers each as it is, casting only fp32 masters) and before the weights are loaded (cast from the
    checkpoint as the compute copy was cast from the master: the same numbers). NF4 weights (QLoRA) stay NF4."""
    compute, master = getattr(torch, plan.param_dtype), getattr(torch, plan.master_dtype)
    for param, places in _slots(model).items():
        dtype = master if param.requires_grad else compute
        if param.dtype != dtype:
            _register(nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad), places)
    return model
