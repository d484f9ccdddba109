"""Mixture-of-Experts MLPs (Qwen3-MoE, Mixtral), computed as transformers computes them.

A sparse layer's MLP is `MoE`: a linear router scores the experts of each token (softmax in fp32, the top k
kept, renormalised where the model says so), the token goes to those k experts, and their outputs come back
weighted by the scores (applied after the experts, as transformers applies them). The experts are held
stacked, one `[E, ...]` weight per projection (`GroupedExperts`: w1 the gate, w3 the up, w2 the down
projection, torchtune's names), never a list of modules: a layer's tokens are sorted by expert and every
expert's share is computed by one grouped matrix product per projection (`torch._grouped_mm`; on the CPU it
is a loop of matmuls inside one operator). `implementation = "loop"` computes each expert by itself with
F.linear, the same numbers bit for bit: the tests' oracle.

Every shape here is fixed by the token count (no bincount, no nonzero): the planner traces a layer on fake
tensors, torch.compile sees one graph, and a GPU never waits for a count to reach the host.

The load-balancing loss is transformers' `load_balancing_loss_func` (Switch Transformer's, over every sparse
layer's routing at once), computed per sample (`Routing`): a step's balancing loss is then the mean over its
samples, whatever the micro-batches, the ranks or the packing, like its token loss.

Test: `python -m pytest tests/test_moe.py -q`.
"""

import copy
import functools
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs of `hidden_dim`, their weights stacked: w1, w3 [E, hidden, dim], w2 [E, dim,
    hidden]. forward(x, counts): x holds the tokens sorted by expert, counts[e] of them for expert e.

    With `rank`, LoRA adapters on every expert's three projections, stacked alike (lora_a.w1 [E, rank, dim],
    lora_b.w1 [E, hidden, rank], ...): an expert's rows go through its A, then its B, two more grouped products,
    and its update B @ A is never made."""

    implementation = "grouped"  # or "loop": each expert by itself (the tests' oracle, the same bits)
    PROJECTIONS = ("w1", "w3", "w2")

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, *, rank: int = 0, alpha: float = 0.0,
                 quantize: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.summed_over = None  # MoE.summed_over: a group over which the weights' gradients are summed
        self.grad_scale = 1.0  # what the weights' gradients are multiplied by (train/expert_parallel.py)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        if quantize:  # QLoRA: frozen in NF4, which holds 2-D weights: [E x out, in], the experts one after another
            from torchao.dtypes.nf4tensor import to_nf4

            for k in self.PROJECTIONS:
                w = getattr(self, k)
                setattr(self, k, nn.Parameter(to_nf4(w.reshape(-1, w.shape[-1])), requires_grad=False))
        self.scale = alpha / rank if rank else 0.0
        if rank:
            inputs = {"w1": dim, "w3": dim, "w2": hidden_dim}
            outputs = {"w1": hidden_dim, "w3": hidden_dim, "w2": dim}
            self.lora_a = nn.ParameterDict({k: nn.Parameter(torch.empty(num_experts, rank, inputs[k]))
                                            for k in self.PROJECTIONS})
            self.lora_b = nn.ParameterDict({k: nn.Parameter(torch.empty(num_experts, outputs[k], rank))
                                            for k in self.PROJECTIONS})

    def weights(self) -> dict[str, torch.Tensor]:
        """The stacked weights and adapters as this device computes with them: its own experts' (a DTensor's local
        slice), their gradients scaled and summed as set."""
        named = {k: getattr(self, k) for k in self.PROJECTIONS}
        if hasattr(self, "lora_a"):
            named.update({f"lora_a.{k}": v for k, v in self.lora_a.items()})
            named.update({f"lora_b.{k}": v for k, v in self.lora_b.items()})
        return {k: w if is_nf4(w) else summed_gradients(_local(w), self.summed_over, self.grad_scale)
                for k, w in named.items()}

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [pairs, dim], the rows of each of this device's experts in turn, counts[e] of them for expert e."""
        linear = _per_expert if self.implementation == "loop" else _grouped
        ends = torch.cumsum(counts, 0, dtype=torch.int32)
        w = self.weights()

        def projection(rows: torch.Tensor, k: str) -> torch.Tensor:
            out = _NF4Grouped.apply(rows, w[k], ends, linear) if is_nf4(w[k]) else linear(rows, w[k], ends)
            if f"lora_a.{k}" in w:
                out = out + linear(linear(rows, w[f"lora_a.{k}"], ends), w[f"lora_b.{k}"], ends) * self.scale
            return out

        return projection(F.silu(projection(x, "w1")) * projection(x, "w3"), "w2")


def is_nf4(weight: torch.Tensor) -> bool:
    from torchao.dtypes.nf4tensor import NF4Tensor  # loaded with torchtune's modules already

    return isinstance(weight, NF4Tensor)


class _NF4Grouped(torch.autograd.Function):
    """The grouped product of rows with frozen NF4 experts ([E x out, in]): dequantized for the forward and again for
    the backward (its input's gradient), never kept between them, as torchao's linear_nf4 does for one weight."""

    @staticmethod
    def forward(ctx, x, weight, ends, linear):
        ctx.save_for_backward(ends)
        ctx.weight, ctx.linear, ctx.experts = weight, linear, ends.shape[0]
        return linear(x, _dequantized(weight, ctx.experts, x.dtype), ends)

    @staticmethod
    def backward(ctx, grad):
        (ends,) = ctx.saved_tensors
        w = _dequantized(ctx.weight, ctx.experts, grad.dtype)
        return ctx.linear(grad, w.transpose(-2, -1), ends), None, None, None


def _dequantized(weight: torch.Tensor, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Stacked NF4 experts [E x out, in] as [E, out, in] in `dtype`."""
    return weight.get_original_weight().to(dtype).view(experts, -1, weight.shape[-1])


class _WeightGradient(torch.autograd.Function):
    """The identity; its backward scales the gradient and sums it over a process group (either may be absent)."""

    @staticmethod
    def forward(ctx, weight, group, scale):
        ctx.group, ctx.scale = group, scale
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad * ctx.scale if ctx.scale != 1.0 else grad.contiguous().clone()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def summed_gradients(weight: torch.Tensor, group, scale: float = 1.0) -> torch.Tensor:
    """`weight`, its gradient summed over `group` (None: not) and scaled by `scale`: a weight that every device of
    the group holds whole and applies to tokens of its own; experts whose gradients FSDP2 sums over fewer devices
    than the tokens came from (train/expert_parallel.py)."""
    return weight if group is None and scale == 1.0 else _WeightGradient.apply(weight, group, scale)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This device's experts of a stacked weight: all of them, or under expert parallelism (a DTensor sharded over
    the expert dimension, train/expert_parallel.py) its own slice. A DTensor exists only once torch.distributed.tensor
    is imported: not imported here, for the planner's sake (0.4 s of a dry run's start; it builds layers to trace)."""
    tensors = sys.modules.get("torch.distributed.tensor")
    return weight.to_local() if tensors is not None and isinstance(weight, tensors.DTensor) else weight


def _grouped(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x @ weight[e].T for each expert's rows of x (rows ends[e-1]:ends[e]), one grouped matrix product."""
    fake = is_fake(x)
    # torch 2.13's grouped product runs on the CPU in any float dtype and on CUDA in bf16 (compute capability 8.0 on:
    # A100, RTX 4090, A6000; H100), but its shape function (fake tensors) accepts bf16 only.
    if x.dtype == torch.bfloat16 and grouped_product_runs(x, weight) or x.device.type == "cpu" and not fake:
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)
    if fake and not torch.compiler.is_compiling():
        # The planner's trace (planner/activations.py): one product of the same shapes and FLOPs stands in.
        return F.linear(x, weight[0])
    return _per_expert(x, weight, ends)


def grouped_product_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether PyTorch's grouped product takes these bf16 rows and stacked weights where they are: on the CPU, or on a
    CUDA device of compute capability 8.0 or more (torch 2.9 on: Ampere, Ada, Hopper; it was Hopper alone before),
    each row's and weight's dimensions a multiple of 16 bytes (its kernel's alignment, checked by its own shape
    function). Elsewhere the experts run one product each (_per_expert)."""
    if x.device.type == "cpu":
        return True
    if x.device.type != "cuda" or _capability(x.device.index) < (8, 0):
        return False
    return x.shape[-1] % 8 == 0 and weight.shape[-2] % 8 == 0  # bf16: 8 values are 16 bytes


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _per_expert(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The same as _grouped, one F.linear per expert (the counts read on the host). Split and unbound, not sliced and
    indexed: their backwards are one concatenation and one stack, where each slice's or index's would fill a whole
    tensor of zeros."""
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return torch.cat([F.linear(rows, w) for w, rows in zip(weight.unbind(0), x.split(counts))])


class MoE(nn.Module):
    """A sparse layer's MLP: the router (Hugging Face's `gate`) and the experts. Takes and returns [..., dim].

    `scores_in_fp32`: the router's weights scale the experts' outputs in fp32 (Mixtral) rather than cast first to
    the compute dtype (Qwen3-MoE), as each model's transformers code does. `layer`: the decoder layer it belongs to
    (the experts' load is reported per layer). `rank`, `alpha`: LoRA adapters on the experts; `quantize`: the
    experts frozen in NF4 (QLoRA; GroupedExperts)."""

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 scores_in_fp32: bool, layer: int, rank: int = 0, alpha: float = 0.0, quantize: bool = False):
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim, rank=rank, alpha=alpha, quantize=quantize)
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.scores_in_fp32, self.layer = scores_in_fp32, layer
        self.routing: Routing | None = None  # set while a forward's routing is recorded (routing_recorded)
        self.expert_parallel = None  # train/expert_parallel.py's dispatch over the mesh's expert dimension
        # Under tensor (sequence) parallelism each device of the group routes its own share of the tokens with the
        # same weights: their gradients are summed over it (train/tensor_parallel.py sets the group).
        self.summed_over = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities [tokens, E] in fp32, the top-k experts [tokens, k], their weights [tokens, k])."""
        weight = summed_gradients(_local(self.router.weight), self.summed_over)
        probs = F.softmax(F.linear(x, weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, experts, weights if self.scores_in_fp32 else weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, experts, weights = self.route(x)
        if self.routing is not None:
            self.routing.record(self.layer, probs, experts)
        if self.expert_parallel is not None:
            out = self.expert_parallel(self, x, experts, weights)
        else:
            out = local_experts(self.experts, x, experts, weights)
        return out.reshape(shape)


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-expert pairs of `experts` [tokens, k] sorted by expert (stable: by token within an expert):
    (each pair's place in experts.flatten(), in sorted order; the pairs per expert [E])."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def combine(x: torch.Tensor, outputs: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
            top_k: int) -> torch.Tensor:
    """Each token's experts' `outputs` (in `order`), weighted and summed in the order of their experts."""
    weighted = (outputs * weights.flatten()[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add(0, order // top_k, weighted)


def local_experts(module: GroupedExperts, x: torch.Tensor, experts: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """The experts' weighted outputs for tokens x [tokens, dim], every expert on this device."""
    top_k = experts.shape[-1]
    order, counts = sort_by_expert(experts, module.num_experts)
    return combine(x, module(x[order // top_k], counts), order, weights, top_k)


class Routing:
    """What the routers of one forward decided, per sample: for the load-balancing loss and the experts' load.

    `samples` [tokens]: the sample each token of the forward belongs to (0 .. count - 1), -1 for padding, which
    counts nowhere (transformers' attention mask). `stats()` is what the routers recorded, one row per sample:
    its router probabilities summed over the sparse layers [E] (differentiable), its tokens' top-k picks of each
    expert in each sparse layer [layers x E], and its tokens (a pipeline's stages add up their rows:
    train/pipeline.py). One sample's balancing loss (balancing_losses) is transformers' load_balancing_loss_func on
    that sample alone: E x the sum over experts of (its picks of the expert over tokens x layers) x (its mean router
    probability of the expert), every sparse layer of the model together."""

    def __init__(self, samples: torch.Tensor, count: int, spec, *, tokens: bool = True):
        self.samples, self.count = samples.flatten(), count
        self.num_experts, self.sparse_layers = spec.num_experts, tuple(spec.moe_layers)
        valid = self.samples >= 0
        self._index, self._valid = self.samples.clamp(min=0), valid[:, None].float()
        self.tokens = torch.zeros(count, device=samples.device)
        if tokens:  # the stage that embeds counts the tokens; later stages add zeros
            self.tokens.index_add_(0, self._index, valid.float())
        self.probs = None  # [count, E]: the router probabilities summed over the sparse layers (differentiable)
        self.picks = torch.zeros(count, len(self.sparse_layers), self.num_experts, device=samples.device)

    def record(self, layer: int, probs: torch.Tensor, experts: torch.Tensor) -> None:
        picked = torch.zeros_like(probs).scatter_(1, experts, 1.0).mul_(self._valid)
        per_sample = torch.zeros(self.count, self.num_experts, device=probs.device)
        summed = per_sample.index_add(0, self._index, probs * self._valid)
        self.probs = summed if self.probs is None else self.probs + summed
        self.picks[:, self.sparse_layers.index(layer)] += per_sample.index_add(0, self._index, picked)

    def replica(self) -> "Routing":
        """A routing of the same samples that records into tensors of its own: a recomputed layer records into it
        (models/recompute.py), leaving this one as its forward left it."""
        twin = copy.copy(self)
        twin.probs, twin.picks = None, torch.zeros_like(self.picks)
        return twin

    def stats(self) -> torch.Tensor:
        """[count, E + layers x E + 1]: probabilities, picks per layer, tokens (see the class)."""
        probs = self.probs if self.probs is not None else torch.zeros(self.count, self.num_experts,
                                                                      device=self.picks.device)
        return torch.cat([probs, self.picks.flatten(1), self.tokens[:, None]], dim=1)

    def balancing_losses(self) -> torch.Tensor:
        return balancing_losses(self.stats(), self.num_experts, len(self.sparse_layers))


def balancing_losses(stats: torch.Tensor, num_experts: int, sparse_layers: int) -> torch.Tensor:
    """Each sample's load-balancing loss from its Routing.stats() row (0 for a sample without tokens)."""
    probs, picks, tokens = _split_stats(stats, num_experts, sparse_layers)
    rows = (tokens * sparse_layers).clamp(min=1)[:, None]
    return num_experts * ((picks.sum(1) / rows) * (probs / rows)).sum(-1)


def _split_stats(stats: torch.Tensor, num_experts: int, sparse_layers: int):
    E, L = num_experts, sparse_layers
    return stats[:, :E], stats[:, E:E + L * E].reshape(-1, L, E), stats[:, E + L * E]


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def recorders(module: nn.Module) -> list[nn.Module]:
    """The modules under `module` whose forward records a routing: our sparse layers' MoE, transformers' routers
    (models/transformers_model.py hooks them)."""
    return [m for m in module.modules() if "routing" in m.__dict__]


@contextmanager
def routing_recorded(model: nn.Module, routing: Routing | None):
    """Within it, every forward of `model`'s sparse layers records its routing in `routing` (None: nothing is
    recorded, a dense model). A layer's recomputation in the backward pass runs outside it: it records into a replica
    (routing_replayed)."""
    modules = recorders(model) if routing is not None else []
    for m in modules:
        m.routing = routing
    try:
        yield routing
    finally:
        for m in modules:
            m.routing = None


def routing_replayed(layer_recorders: list[nn.Module]):
    """For a layer's forward that recomputation will run again (models/recompute.py), `layer_recorders` its
    recorders: None if it records no routing, else a context manager under which the rerun records into replicas of
    what the forward recorded into.
    torch.utils.checkpoint matches the tensors the rerun saves to the forward's one by one, so the rerun must run the
    recording's operators too (without them: "a different number of tensors was saved", every Mixture-of-Experts
    model recomputed with its balancing loss on), and with the same samples, whose mask the recording's gradient
    reads; the step's routing is left as the forward recorded it."""
    # The replicas are made here, before the checkpoint: made in the rerun, their zeros would be operators the
    # selective recomputation's log of the forward does not hold.
    replicas = [(m, m.routing.replica()) for m in layer_recorders if m.routing is not None]
    if not replicas:
        return None

    @contextmanager
    def replayed():
        before = [m.routing for m, _ in replicas]
        for m, replica in replicas:
            m.routing = replica
        try:
            yield
        finally:
            for (m, _), routing in zip(replicas, before):
                m.routing = routing
    return replayed


class RoutingTotals:
    """A step's routing on this process, over its micro-batches: the balancing losses' sum and the tokens each
    sparse layer sent to each expert. One flat vector (as_list) summed over the processes gives the step's.
    `aux_scale`: what the step's backward multiplies each sample's balancing loss by."""

    def __init__(self, spec, aux_scale: float = 0.0):
        self.spec, self.aux_scale = spec, aux_scale
        self.layers, self.num_experts = tuple(spec.moe_layers), spec.num_experts
        self.balancing = 0.0
        self.load = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float64)

    def add(self, stats: torch.Tensor) -> None:
        """Routing.stats() of samples this process computes the losses of (under tensor parallelism: summed over
        the tensor devices, added by one of them)."""
        stats = stats.detach()
        self.balancing += float(self.balancing_losses(stats).sum())
        self.load += _split_stats(stats, self.num_experts, len(self.layers))[1].sum(0).double().cpu()

    def balancing_losses(self, stats: torch.Tensor) -> torch.Tensor:
        """Each sample's balancing loss from its stats row."""
        return balancing_losses(stats, self.num_experts, len(self.layers))

    def as_list(self) -> list[float]:
        return [self.balancing, *self.load.flatten().tolist()]

    def metrics(self, summed: list[float], samples: float) -> dict[str, float]:
        """The step's metrics from as_list() summed over the processes: `aux_loss`, the balancing loss's mean over
        the global batch's samples, and each layer's load, the most tokens an expert got over the mean
        (`expert_load/layer_N`; 1 is even, E the worst), and `expert_load`, the most of any layer."""
        load = torch.tensor(summed[1:], dtype=torch.float64).view(len(self.layers), self.num_experts)
        per_layer = load.max(dim=1).values / (load.mean(dim=1)).clamp(min=1e-12)
        out = {"aux_loss": summed[0] / max(samples, 1), "expert_load": float(per_layer.max())}
        out.update({f"expert_load/layer_{layer}": float(v) for layer, v in zip(self.layers, per_layer)})
        return out
