"""Tensor parallelism (Megatron's layout, through torch.distributed.tensor.parallel) on a torchtune decoder.

Inside a layer the attention heads and the MLP's hidden units are cut over the `tensor` mesh: q/k/v and
w1/w3 column-wise (each device computes its own heads and hidden units), output_proj and w2 row-wise
(their partial sums are reduce-scattered). Between the cut modules the residual stream is cut along
the sequence (sequence parallelism): the norms run on a device's share of the tokens, and each layer
all-gathers its input once per attention and MLP. The embedding is cut over the vocabulary, and so is the
output projection, whose logits stay cut for the loss (loss parallel: torch's cross-entropy on vocabulary
shards, `loss_parallel`), so no device ever holds a whole row of logits.

LoRA adapters follow their base weight: a column-wise LoRALinear keeps `lora_a` whole and cuts `lora_b` by
rows; a row-wise one cuts `lora_a` by columns and keeps `lora_b` whole (its partial sum joins the base's).
Every device computes exactly what one device would, up to the order of floating-point sums.

Qwen3's per-head q/k norms (models/build.py: a child `head_norm` of the projection, run as its forward hook) see the
heads a device holds: their weight is whole on every device (replicated), and DTensor sums its gradient over the
heads of all of them. A tied output projection (tie_word_embeddings) is the embedding's weight, cut over the
vocabulary for both: the embedding looks up a device's share of the vocabulary, the projection computes its share of
the logits.

A Mixture-of-Experts layer (models/moe.py) keeps its router and experts whole on every device: each routes its own
share of the sequence (sequence parallelism already cuts it there), and their gradients are summed over the group.

The tokens of a micro-batch must divide by the degree (train/micro_batches.py pads them).
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from moai_recipes.models.moe import MoE


COLUMN_WISE = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.w1", "mlp.w3")
ROW_WISE = ("attn.output_proj", "mlp.w2")


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Cut `model` (on the meta device, before FSDP2) over the 1-D `mesh`, as the module docstring says. What was
    frozen stays frozen (torch's styles make new parameters, trainable)."""
    from torchtune.modules import TiedLinear

    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    tied = isinstance(model.output, TiedLinear)
    root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel()}
    if not tied:
        root["output"] = _style(model.output, "column", output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, root)
    if tied:  # the embedding's weight, now cut over the vocabulary (Shard(0)), is the projection's as well
        model.output = _TiedVocabularyCut(model.tok_embeddings, mesh)
    degree = mesh.size()
    for layer in model.layers:
        plan = {"sa_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), Shard(1)),
                                           desired_input_layouts=(Replicate(), Replicate()))}
        sparse = isinstance(layer.mlp, MoE)
        if sparse:
            # A sparse layer routes each device's own share of the tokens (the sequence stays cut): its router and
            # experts are whole on every device, their gradients summed over the group (MoE.summed_over).
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True)
            _replicate(layer.mlp, mesh)
        else:
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in COLUMN_WISE:
            if not (sparse and name.startswith("mlp.")):
                plan[name] = _style(layer.get_submodule(name), "column")
        for name in ROW_WISE:
            if not (sparse and name.startswith("mlp.")):
                plan[name] = _style(layer.get_submodule(name), "row", output_layouts=Shard(1))
        # A q/k norm is its projection's child (models/build.py _norm_heads): out of the projection's cut, whole.
        norms = {}
        for name in ("attn.q_proj", "attn.k_proj"):
            proj = layer.get_submodule(name)
            if hasattr(proj, "head_norm"):
                norms[proj] = proj.head_norm
                del proj.head_norm
        parallelize_module(layer, mesh, plan)
        for proj, norm in norms.items():
            proj.head_norm = distribute_module(norm, mesh)  # its weight replicated; its input, a device's heads
        # torchtune's attention reshapes by its head counts: a device holds 1/degree of them.
        layer.attn.num_heads //= degree
        layer.attn.num_kv_heads //= degree
        layer.attn.embed_dim //= degree
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)


class _TiedVocabularyCut:
    """The output projection of a tied model under tensor parallelism (as torchtune's TiedLinear, a callable holding
    the embedding, not a module: FSDP2 sees the weight once): the embedding's vocabulary-cut weight applied to the
    whole normed hidden states (gathered from their sequence cut), the logits left cut over the vocabulary for the
    loss, as the untied projection's are. (The chunked loss, which would read the weight, is not planned on a cut
    model.)"""

    def __init__(self, embedding: nn.Module, mesh: DeviceMesh):
        self.tied_module, self.mesh = embedding, mesh

    def __call__(self, x: torch.Tensor) -> DTensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, [Shard(1)], run_check=False)
        return nn.functional.linear(x.redistribute(placements=[Replicate()]), self.tied_module.weight)


def sequence_share(rows: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This device's share of [rows, tokens] under sequence parallelism: its slice of each row's tokens."""
    return rows.chunk(mesh.size(), dim=1)[mesh.get_local_rank()]


class _Summed(torch.autograd.Function):
    """The sum over a process group of each device's tensor, the same on all; the backward hands each device the
    gradient of the sum as it is (each device backpropagates the same loss of it through its own share)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def summed_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`x` summed over the devices of `mesh` (one dimension), differentiable as _Summed says."""
    return _Summed.apply(x, mesh.get_group())


def summed_over_shares(x: torch.Tensor, *meshes: DeviceMesh | None) -> torch.Tensor:
    """`x` summed over each of `meshes` that is not None (the tensor and context devices that each hold a share of
    the same rows' tokens), differentiable as _Summed says."""
    for mesh in meshes:
        if mesh is not None:
            x = summed_over(x, mesh)
    return x


def _replicate(moe: MoE, mesh: DeviceMesh) -> None:
    """A sparse layer's router and experts whole on every device of `mesh` (replicated DTensors, as the norms'
    weights are), computed on each device's tokens, their gradients summed over it. Experts already split over the
    expert dimension (train/expert_parallel.py) stay as they are: each device of `mesh` holds the same split."""
    for name, p in list(moe.named_parameters()):  # the router, the experts and their adapters (LoRA)
        if isinstance(p, DTensor):
            continue
        owner, _, leaf = name.rpartition(".")
        moe.get_submodule(owner).register_parameter(leaf, nn.Parameter(distribute_tensor(p, mesh, [Replicate()]),
                                                                       requires_grad=p.requires_grad))
    moe.summed_over = moe.experts.summed_over = mesh.get_group()


def parallel_loss(enabled: bool):
    """The context the loss and its backward run in: cross-entropy on vocabulary-cut logits under tensor
    parallelism, nothing otherwise."""
    return loss_parallel() if enabled else nullcontext()


def _style(module: nn.Module, how: str, **kwargs):
    """torch's Colwise/RowwiseParallel for a plain linear; ours for a LoRA-adapted one."""
    from torchtune.modules.peft import LoRALinear

    if isinstance(module, LoRALinear):
        return _LoraParallel(how, **kwargs)
    if how == "column":
        # The output projection's input is the final norm's, cut along the sequence; a layer's are whole.
        return ColwiseParallel(input_layouts=Shard(1) if "output_layouts" in kwargs else Replicate(), **kwargs)
    return RowwiseParallel(**kwargs)


class _LoraParallel(ParallelStyle):
    """A ParallelStyle for torchtune's LoRALinear: the base weight cut as the plain linear's would be, the
    adapters cut so that their product is cut the same way. DTensor computes the rest (a row-wise layer's
    partial sums, its bias once)."""

    def __init__(self, how: str, output_layouts=None, use_local_output: bool = True):
        self.how = how
        self.output_layouts = output_layouts or (Shard(-1) if how == "column" else Replicate())
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        column = self.how == "column"
        base = Shard(0) if column else Shard(1)

        def partition(name, sub, mesh):
            for pname, p in list(sub.named_parameters(recurse=False)):
                if sub is module:
                    place = base if pname == "weight" or column else Replicate()  # a row-wise bias is added once
                elif sub is module.lora_a:
                    place = Replicate() if column else Shard(1)
                else:  # lora_b
                    place = Shard(0) if column else Replicate()
                sub.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [place]),
                                                           requires_grad=p.requires_grad))

        # The input: column-wise, the whole (gathered) hidden state; row-wise, this device's hidden units.
        into = Replicate() if column else Shard(-1)

        def inputs(mod, args, mesh):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [into], run_check=False)
            return (x.redistribute(placements=[into]), *args[1:])

        def outputs(mod, out, mesh):
            out = out.redistribute(placements=[self.output_layouts])
            return out.to_local() if self.use_local_output else out

        return distribute_module(module, mesh, partition, inputs, outputs)

