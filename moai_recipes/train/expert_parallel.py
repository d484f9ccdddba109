"""Expert parallelism: each sparse layer's experts split over the mesh's `expert` dimension, tokens sent to their
experts' devices and back with all-to-all.

The `expert` devices of a mesh are also data-parallel: each brings its own tokens. A sparse layer routes them
where they are (the router is everyone's), sorts the token-expert pairs by expert (so by the device that holds
it: expert e lives on device e // (E / degree)), and one all-to-all sends each device the pairs of its experts,
counts first (each device learns how many rows it receives, per source and per local expert). The device groups
what it received by expert, runs its experts' grouped products, and a second all-to-all sends the outputs back in
the order they came; the scores and the sum over a token's experts happen at home, as on one device
(models/moe.py). The backward is the same two exchanges reversed. Uneven splits, experts that receive nothing and
every token sent to one expert are all plain all-to-alls of other sizes: every device takes part in each, so none
waits for another.

The experts' weights are DTensors sharded on dim 0 over the `expert` dimension (a device's slice: its E / degree
experts), so a step checkpoint (DCP) holds whole [E, ...] weights and resumes on any expert degree, and the
Hugging Face export gathers them whole. FSDP2 then shards them over the `replica` and `context` dimensions, what is
left of data parallelism and the devices that share its rows (train/parallel.py).

transformers' modules (models/transformers_model.py) are split the same way: each sparse layer's experts module, which
transformers' experts interface calls with the tokens, their top-k experts and weights, is given the tokens of its
experts from every device (`TransformersExpertDispatch`) and computes them as it computes its own, its stacked weights
its device's slices for the time of the call.

Test: `python -m pytest tests/test_expert_parallel.py tests/test_architectures.py -q`.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moai_recipes.models.moe import MoE, combine, moe_modules, sort_by_expert
from moai_recipes.train.collectives import AllToAll


class ExpertDispatch:
    """A sparse layer's tokens to its experts over `mesh` (1-D: the expert dimension) and back. Set on every MoE
    module of the model as its `expert_parallel` (MoE.forward calls it with its router's decisions)."""

    def __init__(self, mesh: DeviceMesh):
        self.group, self.degree = mesh.get_group(), mesh.size()

    def __call__(self, moe: MoE, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k, degree = experts.shape[-1], self.degree
        local = moe.num_experts // degree
        order, counts = sort_by_expert(experts, moe.num_experts)  # counts [E]: this device's pairs per expert
        # Each device learns what it receives: from each source, the pairs of each of its local experts.
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)
        incoming = incoming.view(degree, local)  # [source, local expert]
        sent = counts.view(degree, local).sum(1).tolist()
        received = incoming.sum(1).tolist()
        rows = AllToAll.apply(x[order // top_k], sent, received, self.group)
        # Received rows come source by source, each source's by expert: regroup them expert by expert (stable, so
        # an expert's rows stay in source order), run the experts, and put the outputs back in arrival order.
        expert_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(degree), incoming.flatten())
        by_expert = torch.argsort(expert_of, stable=True)
        out = _unsorted(moe.experts(rows[by_expert], incoming.sum(0)), by_expert)
        back = AllToAll.apply(out, received, sent, self.group)
        return combine(x, back, order, weights, top_k)


def _unsorted(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The rows of `values` (in `order`) back in their original places: the inverse of values = original[order]."""
    return torch.empty_like(values).index_copy(0, order, values)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split every sparse layer's experts of `model` (on the meta device, before FSDP2) over the 1-D `mesh`: their
    stacked weights become DTensors sharded on dim 0, and the layer's tokens go to them through ExpertDispatch.

    A device's experts get the gradients of the tokens of every device of `mesh`; FSDP2 then averages them over the
    devices of the replica (x context) dimensions alone, where every other weight's are averaged over all the
    data-parallel (x context) devices (replica x expert): the experts' gradients are divided by the mesh's size on
    their way (GroupedExperts' grad_scale), so that both are the same mean."""
    dispatch = ExpertDispatch(mesh)
    for moe in moe_modules(model):
        assert moe.num_experts % mesh.size() == 0, (moe.num_experts, mesh.size())  # the planner's degrees divide
        experts = moe.experts
        for name, p in list(experts.named_parameters()):  # the stacked weights, and their adapters (LoRA)
            owner, _, leaf = name.rpartition(".")
            module = experts.get_submodule(owner) if owner else experts
            module.register_parameter(leaf, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]),
                                                         requires_grad=p.requires_grad))
        moe.expert_parallel = dispatch
        experts.grad_scale = 1.0 / mesh.size()



class _Scaled(torch.autograd.Function):
    """The identity forward, its gradient multiplied by `scale` backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class TransformersExpertDispatch:
    """A transformers experts module's tokens sent to the devices of its experts over `mesh` and back: its forward
    (hidden states [T, dim], top-k experts [T, k], their weights [T, k]) replaced by one that sends each (token, expert)
    pair to the device holding the expert, calls the module's own forward there on the pairs it received (each with
    its one expert, by its place among the device's, and its weight), and sums each token's outputs at home.

    The experts' weights get the gradients of every device's tokens, and FSDP2 averages them over the replica (x
    context) devices alone: the module's output gradient is divided by the degree on its way in, its inputs'
    multiplied back, so that only the weights' are (as GroupedExperts' grad_scale does for our own layers)."""

    def __init__(self, mesh: DeviceMesh):
        self.group, self.degree = mesh.get_group(), mesh.size()

    def wrap(self, experts: nn.Module) -> None:
        forward, degree, group = experts.forward, self.degree, self.group
        total = experts.num_experts
        local = total // degree

        def dispatched(hidden_states, top_k_index, top_k_weights):
            tokens, top_k = top_k_index.shape
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=total)
            incoming = torch.empty_like(counts)
            dist.all_to_all_single(incoming, counts, group=group)
            incoming = incoming.view(degree, local)  # [source, local expert]
            sent, received = counts.view(degree, local).sum(1).tolist(), incoming.sum(1).tolist()
            rows = AllToAll.apply(hidden_states[order // top_k], sent, received, group)
            weights = AllToAll.apply(top_k_weights.reshape(-1, 1)[order], sent, received, group)
            expert = torch.repeat_interleave(torch.arange(local, device=flat.device).repeat(degree), incoming.flatten())
            with _as_local(experts, local):
                out = forward(_Scaled.apply(rows, degree), expert[:, None], _Scaled.apply(weights, degree))
            back = AllToAll.apply(_Scaled.apply(out, 1.0 / degree), received, sent, group)
            summed = back.new_zeros(tokens * top_k, back.shape[-1]).index_copy(0, order, back)
            return summed.view(tokens, top_k, -1).sum(1)

        experts.forward = dispatched


@contextlib.contextmanager
def _as_local(experts: nn.Module, local: int):
    """Within it, the experts module's stacked weights are its device's slices (plain tensors, their gradients going
    to the DTensors) and its count of experts its device's."""
    held = {module: dict(module._parameters) for module in experts.modules()}  # its own, its adapters'
    count = experts.num_experts
    for module, params in held.items():
        for name, p in params.items():
            if isinstance(p, DTensor):
                module._parameters[name] = p.to_local()
    experts.num_experts = local
    try:
        yield
    finally:
        for module, params in held.items():
            module._parameters.update(params)
        experts.num_experts = count


def apply_transformers_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split every sparse layer's experts of a model of transformers' modules (on the meta device, before FSDP2) over
    the 1-D `mesh`: their stacked weights (and biases) DTensors sharded on dim 0, their tokens sent to them by
    TransformersExpertDispatch."""
    from moai_recipes.models.transformers_model import experts_of

    dispatch = TransformersExpertDispatch(mesh)
    for layer in model.layers:
        experts = experts_of(layer)
        if experts is None:
            continue
        assert experts.num_experts % mesh.size() == 0, (experts.num_experts, mesh.size())  # the planner's degrees
        for name, p in list(experts.named_parameters()):  # the stacked weights, and their adapters (LoRA)
            owner, _, leaf = name.rpartition(".")
            module = experts.get_submodule(owner) if owner else experts
            module.register_parameter(leaf, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]),
                                                         requires_grad=p.requires_grad))
        dispatch.wrap(experts)
