"""Collectives with autograd, over a process group: what expert and context parallelism send between devices
inside the forward, their gradients sent back the way they came in the backward."""

import torch
import torch.distributed as dist


class AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with autograd: rows `x` [n, ...] split by `sent` go out, rows split by `received`
    come in; the backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x, sent: list[int], received: list[int], group):
        ctx.sent, ctx.received, ctx.group = sent, received, group
        out = x.new_empty((sum(received), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return back, None, None, None


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, *, group) -> None:
    """torch 2.13's all_gather_single; torch 2.11 and 2.12 call it all_gather_into_tensor (2.13 keeps that name,
    deprecated). Looked up at each call, as torch.distributed has it then."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


class AllGather(torch.autograd.Function):
    """Every device's `x` [n, ...] stacked in rank order ([size, n, ...]); the backward gives each device the sum of
    every device's gradient of its own part (a reduce-scatter: an all-reduce and this device's part, which gloo has
    where it lacks reduce_scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # gloo takes the parts concatenated on dim 0
        _all_gather_single(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        if dist.get_backend(ctx.group) == "gloo":
            summed = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(summed, group=ctx.group)
            return summed[dist.get_rank(ctx.group)].clone(), None
        mine = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(mine, grad.reshape(-1, *grad.shape[2:]).contiguous(), group=ctx.group)
        return mine, None
