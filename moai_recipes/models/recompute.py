"""Recompute a layer's activations in the backward pass instead of keeping them (plan.recompute).

Here, beside the model, because both the training run (train/parallel.py) and the planner's layer traces
(planner/activations.py) wrap layers with it: the planner counts what training will keep.
"""

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from moai_recipes.config.schema import Recompute
from moai_recipes.models.activation_offload import ActivationOffload
from moai_recipes.models.moe import recorders, routing_replayed

# Selective recompute keeps what is expensive to redo (matmuls, attention) and recomputes the
# cheap, memory-hungry pointwise ops (norms, SiLU, residual adds) in the backward pass.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _SAVE_OPS.add(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
# Not the experts' grouped product (aten._grouped_mm), though it is a matmul: transformers' experts add their biases
# to its output in place (gpt-oss: `out.add_(bias)` in integrations/moe.py), and torch refuses a kept output that
# was changed afterwards ("Tensor cached during selective activation checkpoint has been mutated"): kept, every
# gpt-oss run in bf16 (a GPU's) and its plan stopped at the first backward (2026-11-29). Recomputed, as before.


# The profiler's markers (torch.profiler.record_function: FSDP2 brackets each of its hooks with one) are not
# computations: run as they come in the forward and in the rerun, never matched one to one. Selective recomputation
# matches every operator of the rerun to the forward's by its index, and the experts split over expert devices are
# an FSDP2 group of their own inside the layer (train/parallel.shard_model), whose hooks run a marker more in the
# rerun than in the forward: Qwen3.5-MoE with plan.expert_parallel=2 and plan.recompute=selective stopped at its
# first backward ("profiler._record_function_enter_new.default invocation index 3 ... not found in storage",
# 2026-11-29). torch ignores its own such operators there (SAC_IGNORED_OPS: detach, device queries).
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_selective_context = partial(create_selective_checkpoint_contexts, _selective_policy)
# What torch.compile's cache of traced graphs (AOTAutogradCache) keys a selectively recomputed layer by: without it,
# every compile of such a layer is traced anew, also on a warm cache (12 s of a tiny model's 18 s compiled run).
_selective_context.cache_hash = "moai selective recompute, saving " + ", ".join(sorted(map(str, _SAVE_OPS)))


def apply_recompute(layers: nn.ModuleList, policy: str, offload: ActivationOffload | None = None) -> None:
    """Recompute each layer's activations in the backward pass (`full` or `selective`); with `offload`, what a
    fully recomputed layer keeps (its input) lives in host memory between its forward and its backward.

    Only the layer's `forward` is checkpointed, not the module call: FSDP2's hooks (all-gather,
    reshard, input casts) then stay outside the recomputed region, as with torchtitan's
    checkpoint wrapper inside `fully_shard`. Selective recompute replays the region's ops
    against what it saved, so hooks inside it would be replayed too and break it. One group's
    hooks do run inside: experts split over expert devices are sharded as a group of their own
    (train/parallel.shard_model), their all-gathers run again in the rerun like any recomputed
    operator, and their profiler markers are not matched (SAC_IGNORED_OPS, above). Patching
    `forward` in place keeps parameter names (and the checkpoint conversion) the same.
    """
    policy = Recompute(policy)
    if policy == Recompute.none:
        return
    # Full recomputation passes no context_fn at all: torch.compile (plan.compile) traces checkpoint only
    # with its own default.
    options = dict(context_fn=_selective_context) if policy == Recompute.selective else {}
    if offload is not None and policy != Recompute.full:
        raise ValueError("activations are offloaded under full recomputation only")
    for layer in layers:
        # Found once: the modules a layer holds do not change, and its forward is a hot path.
        layer.forward = _checkpointed(layer.forward, options, offload, recorders(layer))


def _checkpointed(forward, options: dict, offload: ActivationOffload | None, layer_recorders: list[nn.Module]):
    def recomputed_forward(*args, **kwargs):
        return checkpoint(_rerun_alike(forward, layer_recorders), *args, use_reentrant=False, **options, **kwargs)

    def offloaded_forward(*args, **kwargs):
        # Around the checkpoint, not inside it: the checkpoint saves the layer's inputs through these hooks, and
        # what the layer computes inside it through its own.
        with offload.hooks():
            return checkpoint(_rerun_alike(forward, layer_recorders), *args, use_reentrant=False, **options,
                              **kwargs)
    return recomputed_forward if offload is None else offloaded_forward


def _rerun_alike(forward, layer_recorders: list[nn.Module]):
    """`forward`, whose rerun in the backward (the recomputation) records the routing of a Mixture-of-Experts
    layer as this call does (models/moe.routing_replayed): the rerun outside the step's recording would otherwise run
    fewer operators than the forward did."""
    replayed = routing_replayed(layer_recorders)
    if replayed is None:
        return forward
    ran = False

    def rerun_alike(*args, **kwargs):
        nonlocal ran
        if not ran:  # the forward itself
            ran = True
            return forward(*args, **kwargs)
        with replayed():
            return forward(*args, **kwargs)
    return rerun_alike
