"""One optimizer step of preference tuning (recipes.dpo), and the reference model's log-probabilities it compares with.

A micro-batch of pairs runs as one forward: its chosen sequences, then its rejected ones (data/preferences.py).
Each pair's loss (models/preference_loss.py) is summed over the rank's share and divided by the number of pairs in
the GLOBAL batch, so the loss, the gradients and the rewards are the same whatever the flavor, the micro-batch or
the accumulation (as TRL's mean over a batch is, for a batch of equal micro-batches).

The reference (not for SimPO and ORPO, which have none) is one of:
- `copy`: a frozen model run on each micro-batch. Full fine-tuning: a second copy of the weights, sharded as the
  policy is. LoRA: the policy itself with its adapters switched off, which costs no memory;
- `cached`: each pair's reference log-probabilities computed once, in a first pass over the data before step 1
  (every rank its share, in step with the others for FSDP2), then read: no second model, one forward less a step.
Both give the same numbers (tests/test_dpo.py).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moai_recipes.data.preferences import collate_pairs, completion_logps
from moai_recipes.models.moe import Routing, RoutingTotals, routing_recorded
from moai_recipes.models.preference_loss import PairScores, PreferenceLoss, pair_losses
from moai_recipes.planner.plan import Plan
from moai_recipes.train.micro_batches import micro_batch_shapes
from moai_recipes.train.mixed_precision import in_compute_dtype
from moai_recipes.train.optim import clip_gradients
from moai_recipes.train.parallel import all_reduce_gradients
from moai_recipes.train.world import World

REWARDS = ("chosen", "rejected", "accuracies", "margins")


@dataclass
class Reference:
    """Where the reference log-probabilities come from: `model` (a frozen copy), the policy with its adapters off
    (`adapters_off`), or `cached` (pair index -> (chosen, rejected)); none of them for a reference-free loss."""

    model: torch.nn.Module | None = None
    adapters_off: bool = False
    cached: dict[int, tuple[float, float]] | None = None

    @property
    def mode(self) -> str:
        return "cached" if self.cached is not None else ("copy" if self.model is not None or self.adapters_off
                                                         else "none")

    @torch.no_grad()
    def logps(self, policy: torch.nn.Module, pairs: list[dict], batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cached is not None:
            values = torch.tensor([self.cached[p["index"]] for p in pairs], dtype=torch.float32)
            return values[:, 0], values[:, 1]
        model = self.model if self.model is not None else policy
        with _adapters_off(policy) if self.model is None else contextlib.nullcontext():
            logits = _logits(model, batch["tokens"], batch.get("documents"), batch.get("images"))
        summed, _ = completion_logps(logits, batch)
        return summed.cpu().chunk(2)


@contextlib.contextmanager
def _adapters_off(model: torch.nn.Module):
    from torchtune.modules.peft import disable_adapter

    with disable_adapter(model):
        yield


def _logits(model: torch.nn.Module, tokens: torch.Tensor, documents=None, images: dict | None = None) -> torch.Tensor:
    """`images`: an image-text model's inputs for the rows' images (data/preferences.collate_pairs)."""
    device = next(iter(model.parameters())).device
    extra = {} if documents is None else {"mask": documents, "input_pos": documents.positions(device)}
    if images:
        extra["images"] = {k: v.to(device) for k, v in images.items()}
    logits = model(tokens.to(device), **extra)
    logits = torch.cat(logits, dim=1) if isinstance(logits, list) else logits
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


@torch.no_grad()
def cache_reference(model: torch.nn.Module, dataset, *, micro_batch: int, world: World, pad_id: int,
                    adapters_off: bool) -> dict[int, tuple[float, float]]:
    """Every pair's reference log-probabilities, in one pass before step 1: each data rank its share, every rank in
    every forward (a rank out of pairs runs a one-token forward), then shared with all."""
    was_training = model.training
    model.eval()
    mine = list(range(world.data_rank, len(dataset), world.size("data")))
    steps = -(-len(range(0, len(dataset), world.size("data"))) // micro_batch)
    found: dict[int, tuple[float, float]] = {}
    with _adapters_off(model) if adapters_off else contextlib.nullcontext():
        for k in range(steps):
            pairs = [dataset[i] for i in mine[k * micro_batch:(k + 1) * micro_batch]]
            if not pairs:
                _logits(model, torch.full((1, 1), pad_id, dtype=torch.long))
                continue
            batch = collate_pairs(pairs, pad_id=pad_id)
            summed, _ = completion_logps(_logits(model, batch["tokens"], images=batch.get("images")), batch)
            chosen, rejected = summed.cpu().chunk(2)
            found.update({p["index"]: (float(c), float(r)) for p, c, r in zip(pairs, chosen, rejected)})
    model.train(was_training)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, found)
        found = {k: v for share in shares for k, v in share.items()}
    return found


@dataclass
class PreferenceObjective:
    """What recipes.dpo's steps optimise: the train loop calls `step` in place of the token loss's.

    Of a Mixture-of-Experts model (`spec`), the policy's forward records its routing per sequence, and the step adds
    router_aux_loss_coef x the sequences' mean balancing loss, each sequence's as recipes.full_finetune counts a
    sample's (models/moe.Routing: transformers' load_balancing_loss_func on it alone, so the same on any flavor; TRL
    adds its micro-batch's instead), and logs aux_loss and expert_load. The reference's forward records nothing."""

    loss: PreferenceLoss
    reference: Reference
    spec: object = None

    def micro_batch_shapes(self, plan: Plan, pairs: list[dict]) -> list[tuple[int, int, int]]:
        # A pair as the planner prices it (its Workload's lengths): one sample of its two sequences' tokens.
        return micro_batch_shapes(plan, pairs)

    def step(self, state, micro_batches: list[list[dict] | None], context):
        from moai_recipes.train.loop import StepResult, _all_reduce

        plan, world, settings, pad_id = context.plan, context.world, context.settings, context.pad_id

        pairs_here = sum(len(m) for m in micro_batches if m)
        tokens_here = sum(len(p["prompt"]) * 2 + len(p["chosen"]) + len(p["rejected"]) for m in micro_batches if m
                          for p in m)
        global_pairs, global_tokens = _all_reduce([pairs_here, tokens_here], world.device)
        # FSDP averages gradients over the data ranks: scaling by their number makes that a sum over the global batch.
        scale = (plan.data_parallel if plan.sharded else 1) / max(global_pairs, 1)
        sums = torch.zeros(1 + len(REWARDS) + 2, dtype=torch.float64)  # loss, rewards, completion tokens
        spec = self.spec
        balancing = spec is not None and spec.is_moe and spec.router_aux_loss_coef > 0
        # The balancing loss: a mean over the global batch's sequences (two a pair), scaled as the pairs' loss is.
        routed = RoutingTotals(spec, aux_scale=scale / 2 * spec.router_aux_loss_coef) if balancing else None
        with in_compute_dtype(state.model, plan):
            for micro in micro_batches:
                if not micro:  # another rank's extra micro-batch: FSDP2 needs this rank in its forward and backward
                    (_logits(state.model, torch.full((1, 1), pad_id, dtype=torch.long)).sum() * 0).backward()
                    continue
                batch = collate_pairs(micro, pad_id=pad_id, packed=plan.packing, padded_row=plan.padded_row)
                routing = (Routing(batch["samples"].to(world.device), 2 * len(micro), spec) if routed is not None
                           else None)
                with routing_recorded(state.model, routing):
                    logits = _logits(state.model, batch["tokens"], batch.get("documents"), batch.get("images"))
                summed, counts = completion_logps(logits, batch)
                chosen, rejected = summed.chunk(2)
                chosen_n, rejected_n = counts.chunk(2)
                ref = self.reference.logps(state.model, micro, batch) if self.loss.uses_reference else (None, None)
                ref = tuple(r.to(chosen.device) if r is not None else None for r in ref)
                losses, rewards = pair_losses(PairScores(chosen, rejected, chosen_n, rejected_n, *ref), self.loss)
                objective = losses.sum() * scale
                if routing is not None:
                    stats = routing.stats()
                    routed.add(stats)
                    objective = objective + routed.balancing_losses(stats).sum() * routed.aux_scale
                objective.backward()
                sums += torch.tensor([float(losses.detach().sum()), *(float(rewards[k].sum()) for k in REWARDS),
                                      float(chosen_n.sum()), float(rejected_n.sum())], dtype=torch.float64)
        if plan.replicate:
            all_reduce_gradients(state.model)
        total = _all_reduce(sums.tolist() + (routed.as_list() if routed else []), world.device)
        routing_totals, total = total[len(sums):], total[:len(sums)]
        grad_norm = clip_gradients(state.model, settings.max_grad_norm, stages=None)
        loss = total[0] / max(global_pairs, 1)
        finite = bool(torch.isfinite(torch.tensor(loss))) and bool(torch.isfinite(torch.tensor(grad_norm)))
        if finite:
            state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        extra = {f"rewards/{k}": total[1 + i] / max(global_pairs, 1) for i, k in enumerate(REWARDS)}
        if routed is not None:
            extra.update(routed.metrics(routing_totals, 2 * global_pairs))
        return StepResult(loss=loss, tokens=int(global_tokens), target_tokens=int(total[-2] + total[-1]),
                          grad_norm=grad_norm, finite=finite, extra=extra)
