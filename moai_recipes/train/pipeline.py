"""Pipeline parallelism: a decoder cut into stages of consecutive layers, run by torch.distributed.pipelining.

The layers are split by their cost, not their count (the planner's `planner.layouts.split_layers`): the first
stage also embeds, the last also runs the final norm, the output projection and the loss, so with a large
vocabulary the last stage holds fewer layers. Each device of the `pipeline` mesh dimension holds one stage (GPipe, 1F1B) or two (interleaved
1F1B: stages d and d + P of P devices, which halves the bubble).

A device's stages keep the decoder's own parameter names (`PipelinedModel`: `layers.7.attn.q_proj.weight`),
so step checkpoints (DCP) load on any layout, and the Hugging Face export asks each weight of the stage that
holds it (`whole_parameter`).

A step's micro-batches run through the schedule all at once; the schedule needs them of one shape, so a step's
rows are padded to its longest (ignored labels: the loss and the gradients are unchanged).

Under context parallelism (train/context_parallel.py) each stage's devices run the schedule on their share of every
row: the stacked rows are cut to it before the schedule splits them into micro-batches, so what the stages send
each other is 1 / C of the hidden states, and each stage's attention meets the other context devices of its own
stage (they run the same schedule, so their collectives come in the same order). The whole row's documents travel
as before and become the share's ContextShare in the stage.
"""

from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moai_recipes.models.attention import Documents
from moai_recipes.models.loss import IGNORE_INDEX, cross_entropy_sum
from moai_recipes.models.moe import Routing, RoutingTotals, balancing_losses, routing_recorded
from moai_recipes.planner.plan import Plan
from moai_recipes.train.context_parallel import ContextShare, share_indices
from moai_recipes.train.tensor_parallel import parallel_loss, sequence_share, summed_over_shares
from moai_recipes.train.world import World


class Stage(nn.Module):
    """One stage: the embedding (first stage), its layers, the final norm and output projection (last stage).

    Of a Mixture-of-Experts model (`spec`), each stage also passes on the routing of its samples so far
    (models/moe.Routing.stats(), a row per sample slot, differentiable), its own layers' added: the last stage's
    loss has every sparse layer's, as one device's would."""

    def __init__(self, decoder: nn.Module, layers: range, *, first: bool, last: bool, spec=None, tensor=None,
                 context=None, way: str = "none"):
        super().__init__()
        # A tied output projection (tie_word_embeddings) is the embedding's weight: the last stage holds a copy of it,
        # under the same name, kept equal to the first stage's (PipelinedModel.sync_tied_gradients).
        tied = last and not first and not isinstance(decoder.output, nn.Module)
        self.tok_embeddings = decoder.tok_embeddings if first or tied else None
        self.embeds = first
        self.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layers})
        self.norm = decoder.norm if last else None
        self.output = decoder.output if last else None
        self.__dict__["spec"] = spec if spec is not None and spec.is_moe else None
        self.__dict__["tensor"] = tensor  # the tensor mesh, under sequence parallelism
        self.__dict__["context"] = context  # the context mesh, where rows are split over its devices
        self.way = way

    def forward(self, h: torch.Tensor, routed: torch.Tensor | None = None, *,
                document_lengths: torch.Tensor | None = None, input_pos: torch.Tensor | None = None,
                samples: torch.Tensor | None = None, sample_slots: torch.Tensor | None = None):
        first = self.embeds
        if first:
            h = self.tok_embeddings(h)
        mask = None
        if document_lengths is not None:  # a packed row's documents travel as a tensor (the schedule cuts tensors)
            mask = Documents(tuple(n for n in document_lengths[0].tolist() if n))
            if self.context is not None:  # h is this device's share of the row; input_pos was cut the same way
                mask = ContextShare(documents=mask, mesh=self.context, way=self.way)
        routing = None
        if self.spec is not None:
            mine = samples if self.tensor is None else sequence_share(samples, self.tensor)
            routing = Routing(mine, sample_slots.shape[1], self.spec, tokens=first)
        with routing_recorded(self, routing):
            for layer in self.layers.values():
                h = layer(h, mask=mask, input_pos=input_pos)
        if self.output is not None:
            h = self.output(self.norm(h))
            h = h.float()
        if routing is None:
            return h
        stats = summed_over_shares(routing.stats(), self.tensor, self.context)  # a share of its rows' tokens each
        return h, stats if routed is None else routed + stats


class PipelinedModel(nn.Module):
    """This device's stages of a decoder, its parameters named as in the decoder. `stages` (not children: the
    names stay the decoder's) are what the schedule runs; they are the plan's stages `stage_ids`."""

    def __init__(self, decoder: nn.Module, stages: list[Stage], *, world: World, plan: Plan):
        super().__init__()
        for name in ("tok_embeddings", "norm", "output"):
            held = [getattr(s, name) for s in stages if getattr(s, name) is not None]
            setattr(self, name, held[0] if held else None)
        self.layers = nn.ModuleDict({k: v for s in stages for k, v in s.layers.items()})
        self.__dict__["stages"] = stages
        self.__dict__["decoder"] = decoder  # on the meta device: the whole model's names and shapes
        self.world, self.plan = world, plan
        self.__dict__["tied_group"] = _tied_group(decoder, world, plan)

    def sync_tied_gradients(self) -> None:
        """A tied embedding's gradient, the first stage's (its lookups) and the last's (the output projection),
        summed on both devices of each pair: their copies take the same step and stay equal. Every device of a pair
        calls it after the backward (its local shard: both stages shard it alike)."""
        p = self._params.get("tok_embeddings.weight") if self.tied_group is not None else None
        if p is None or p.grad is None:  # no copy here, or frozen (LoRA)
            return
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            # Tensor parallelism's vocabulary-cut embedding gets its lookups' gradient whole (Replicate): cut as
            # the weight is, as the output projection's is, before the two are summed.
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=self.tied_group)

    def counted_elsewhere(self) -> list[nn.Parameter]:
        """The tied embedding's copy on the last stage's device: its gradient norm is the first stage's."""
        if self.tied_group is None or any(s.embeds for s in self.stages):
            return []
        p = self._params.get("tok_embeddings.weight")
        return [p] if p is not None else []

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through its schedule (train/pipeline.py), not as a module")

    @property
    def stage_ids(self) -> range:
        return _stage_ids(self.plan, self.world)

    @cached_property
    def _params(self) -> dict[str, nn.Parameter]:
        return dict(self.named_parameters())

    @cached_property
    def _owners(self) -> dict[str, int]:
        """The pipeline rank holding each parameter of the decoder."""
        P, split = self.plan.pipeline_stages, self.plan.stage_ranges()
        n = len(split)
        owners = {}
        for name, _ in self.decoder.named_parameters():
            if name.startswith("layers."):
                i = int(name.split(".")[1])
                stage = next(s for s, r in enumerate(split) if i in r)
            else:
                stage = 0 if name.startswith("tok_embeddings.") else n - 1
            owners[name] = stage % P
        return owners

    def whole_parameter(self, name: str, whole) -> torch.Tensor | None:
        """The whole parameter `name` on the world's rank 0 (None elsewhere). `whole(param)`: the gather of a
        parameter among its own stage's devices (hf_format.full_tensor), run by all of them."""
        world, owner = self.world, self._owners[name]
        mine = world.coordinate("pipeline") == owner
        tensor = whole(self._params[name]) if mine else None
        if owner == 0:
            return tensor if world.rank == 0 else None
        # The stage's first device (data 0, context 0, tensor 0) sends it to rank 0.
        sender = owner * world.size("data") * world.size("context") * world.size("tensor")
        shape = self.decoder.get_parameter(name).shape
        if world.rank == sender:
            dist.send(tensor.to(world.device, torch.float32).contiguous(), dst=0)
        elif world.rank == 0:
            received = torch.empty(shape, dtype=torch.float32, device=world.device)
            dist.recv(received, src=sender)
            return received.cpu()
        return None


def pipeline_stages(decoder: nn.Module, plan: Plan, world: World, spec=None) -> PipelinedModel:
    """This device's stages of `decoder` (built on meta), as the plan splits its layers (Plan.stage_layers). `spec`:
    the model's, whose sparse layers' routing the stages pass on (models/moe.py)."""
    split = plan.stage_ranges()
    tensor = world.dim("tensor") if plan.tensor_parallel > 1 else None
    context = world.dim("context") if plan.context_parallel > 1 else None
    stages = [Stage(decoder, split[s], first=s == 0, last=s == len(split) - 1, spec=spec, tensor=tensor,
                    context=context, way=plan.context_parallel_way) for s in _stage_ids(plan, world)]
    return PipelinedModel(decoder, stages, world=world, plan=plan)


def _tied_group(decoder: nn.Module, world: World, plan: Plan):
    """For a tied model, this device's pair of first-stage and last-stage devices (the same data, context, expert and
    tensor place), as a process group (None: untied, or this device holds neither). Every rank makes every pair's."""
    if isinstance(decoder.output, nn.Module) or plan.pipeline_stages < 2:
        return None
    ranks = world.mesh.mesh  # [pipeline, replica, context, expert, tensor]
    mine = None
    for a, b in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
        group = dist.new_group([a, b])
        if world.rank in (a, b):
            mine = group
    return mine


def _stage_ids(plan: Plan, world: World) -> range:
    """The plan's stages this device runs: d, d + P, ... on device d of the pipeline's P."""
    P = plan.pipeline_stages
    return range(world.coordinate("pipeline"), P * plan.stages_per_device, P)


def run_pipeline(model: PipelinedModel, batches: list[dict], *, plan: Plan, pad_id: int,
                 scale: float | None, routed: RoutingTotals | None = None) -> torch.Tensor:
    """Forward of a step's (or a validation batch's) `batches` (train/micro_batches.model_inputs) through the
    schedule, and with `scale` their backward, the loss scaled by it. Returns the summed loss, unscaled, on the
    last stage (0 elsewhere). `plan`: the model's, or a smaller one of the same layout (an out-of-memory step).
    A Mixture-of-Experts model adds its samples' balancing losses, scaled by routed.aux_scale, and the last stage
    adds what its routers decided to `routed`."""
    from torch.distributed.pipelining import PipelineStage

    world, spec = model.world, model.stages[0].spec
    moe = spec is not None
    aux_scale = routed.aux_scale if routed is not None else 0.0
    inputs = _stacked(batches, _count(plan, len(batches)), pad_id, routing=moe)
    if plan.context_parallel > 1:  # every row padded to a multiple of 2C already (Plan.padded_row)
        mine = share_indices(inputs["tokens"].shape[1], world.size("context"), world.coordinate("context"))
        inputs.update({k: inputs[k][:, mine] for k in ("tokens", "labels", "input_pos", "samples") if k in inputs})
    group = world.dim("pipeline").get_group()
    count = plan.pipeline_stages * plan.stages_per_device
    stages = [PipelineStage(stage, s, count, world.device, group=group)
              for stage, s in zip(model.stages, model.stage_ids)]

    def loss_fn(output, target):
        if not moe:
            return cross_entropy_sum(output, target) * (scale or 1.0)
        logits, stats = output
        balancing = balancing_losses(stats, spec.num_experts, len(spec.moe_layers)).sum()
        return cross_entropy_sum(logits, target) * (scale or 1.0) + balancing * aux_scale

    schedule = _schedule(plan.pipeline_schedule, stages, inputs["count"], loss_fn)
    args = (inputs["tokens"].to(world.device),) if any(s.is_first for s in stages) else ()
    kwargs = {k: inputs[k].to(world.device) for k in ("document_lengths", "input_pos", "samples", "sample_slots")
              if k in inputs}
    target = inputs["labels"].to(world.device) if any(s.is_last for s in stages) else None
    losses = []  # the schedule's, one per micro-batch (its first forward also infers the stages' shapes)
    with parallel_loss(plan.tensor_parallel > 1):
        run = schedule.step if scale is not None else schedule.eval
        output = run(*args, target=target, losses=losses, **kwargs)
    total = torch.zeros((), dtype=torch.float64, device=world.device)
    for loss in losses:
        total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().double()
    if moe and output is not None:  # the last stage: every micro-batch's routing, their balancing losses taken out
        stats = output[1].detach()
        total -= balancing_losses(stats, spec.num_experts, len(spec.moe_layers)).sum().double() * aux_scale
        if routed is not None and all(plan_size == 1 or world.coordinate(dim) == 0 for dim, plan_size in
                                      (("tensor", plan.tensor_parallel), ("context", plan.context_parallel))):
            routed.add(stats)
    return total / (scale or 1.0)


def _count(plan: Plan, n: int) -> int:
    """Micro-batches the schedule runs (empty ones added): 1F1B's take at least one per device, interleaved 1F1B a
    multiple of the devices."""
    P = plan.pipeline_stages
    if plan.pipeline_schedule == "gpipe":
        return n
    return -(-n // P) * P if plan.pipeline_schedule == "interleaved_1f1b" else max(n, P)


def _schedule(name: str, stages: list, count: int, loss_fn):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=count, loss_fn=loss_fn, scale_grads=False)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return kind(stages[0], n_microbatches=count, loss_fn=loss_fn, scale_grads=False)


def _stacked(batches: list[dict], count: int, pad_id: int, *, routing: bool = False) -> dict:
    """Micro-batches of one shape, stacked along the rows (the schedule cuts them apart again): `count` of them
    (empty ones added: a row of padding), each of the most rows and the longest row of any. `routing`: each token's
    sample (-1: padding) and a slot per sample, as many as the most samples of any micro-batch (Stage.forward)."""
    rows = max(b["tokens"].shape[0] for b in batches)
    width = max(b["tokens"].shape[1] for b in batches)
    packed = "documents" in batches[0]
    docs = max((len(b["documents"].lengths) for b in batches), default=0) + 1 if packed else 0
    tokens = torch.full((count * rows, width), pad_id, dtype=torch.long)
    labels = torch.full((count * rows, width), IGNORE_INDEX, dtype=torch.long)
    out = {"tokens": tokens, "labels": labels, "count": count}
    if packed:
        out["document_lengths"] = torch.zeros((count, docs), dtype=torch.long)
        out["input_pos"] = torch.zeros((count, width), dtype=torch.long)
    if routing:
        out["samples"] = torch.full((count * rows, width), -1, dtype=torch.long)
        out["sample_slots"] = torch.zeros((count, max(1, max(b["sample_count"] for b in batches))))
    for m in range(count):
        b = batches[m] if m < len(batches) else None
        r0 = m * rows
        if packed:
            lengths = list(b["documents"].lengths) if b is not None else []
            used = sum(lengths)
            if width > used:
                lengths.append(width - used)
            out["document_lengths"][m, :len(lengths)] = torch.tensor(lengths)
            out["input_pos"][m] = Documents(tuple(lengths)).positions(torch.device("cpu"))[0]
        if b is None:
            continue
        n, w = b["tokens"].shape
        tokens[r0:r0 + n, :w] = b["tokens"]
        labels[r0:r0 + n, :w] = b["labels"]
        if routing:
            out["samples"][r0:r0 + n, :w] = b["samples"]
    return out
