"""One optimizer step of GRPO (recipes.grpo): generate (every num_iterations steps), score, train.

A step's global batch is batch_size / num_generations prompts; each data rank takes its share of them (all of a
prompt's completions on one rank, so its group is whole there), samples num_generations completions of each
(train/rollouts.py), and every rank's rewards are gathered so that advantages, and what is logged of them, are the
global batch's (models/grpo_loss.py). With num_iterations > 1 the completions are kept and trained on again in the
next steps, against the log-probabilities they were sampled with; with beta > 0 the reference's log-probabilities
are taken once, when they are sampled: the adapters switched off (LoRA) or a frozen copy (full).

Training runs the completions as the plan's micro-batches (padded rows, or packed) and sums each micro-batch's part
of the step's loss, divided by the step's global count (the completions, or their loss tokens), so the loss and the
gradients are the same on any flavor. The step line and metrics.jsonl carry TRL's names: reward, reward_std,
rewards/<fn>/mean, frac_reward_zero_std, kl, entropy, clip_ratio/*, completions/*.
"""

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from moai_recipes.data.images import made_inputs
from moai_recipes.models.grpo_loss import GRPOLoss, advantages, loss_sum, nanstd, normaliser, token_terms
from moai_recipes.models.loss import IGNORE_INDEX
from moai_recipes.models.moe import Routing, RoutingTotals, routing_recorded
from moai_recipes.planner.plan import Plan
from moai_recipes.train.micro_batches import micro_batch_shapes, model_inputs
from moai_recipes.train.mixed_precision import in_compute_dtype
from moai_recipes.train.optim import clip_gradients
from moai_recipes.train.parallel import all_reduce_gradients
from moai_recipes.train.preference_step import Reference, _adapters_off, _logits
from moai_recipes.train.rewards import Rewards
from moai_recipes.train.rollouts import Sampler, SamplingSettings, completion_seed
from moai_recipes.train.world import World


@dataclass
class Rollouts:
    """A generation round's completions on this rank, and what training on them needs."""

    round: int
    rows: list[dict]  # per completion: tokens (prompt + completion), labels (its completion's), prompt_index; an
    # image-text model's: images, its prompt's image inputs
    advantages: torch.Tensor  # [rows]
    completions: int  # of the global batch
    loss_tokens: int  # of the global batch: the completions' tokens the loss counts
    metrics: dict = field(default_factory=dict)  # generation-time, of the global batch
    old: list[torch.Tensor] | None = None  # per row: its tokens' log-probabilities when sampled (num_iterations > 1)
    ref: list[torch.Tensor] | None = None  # per row: the reference's (beta > 0)


@dataclass
class GRPOObjective:
    """What recipes.grpo's steps optimise: the train loop calls `step` in place of the token loss's.

    Of a Mixture-of-Experts model (`spec`), the policy's forward in the step records its routing per completion (its
    prompt and its tokens), and the step adds router_aux_loss_coef x the completions' mean balancing loss, each
    completion's as recipes.full_finetune counts a sample's (the same on any flavor; TRL adds its micro-batch's),
    and logs aux_loss and expert_load. Sampling and the old and reference log-probabilities record nothing."""

    loss: GRPOLoss
    sampling: SamplingSettings
    rewards: Rewards
    num_generations: int
    num_iterations: int
    scale_rewards: str
    mask_truncated_completions: bool
    seed: int
    tokenizer: object  # data.tokenizer.Tokenizer
    reference: Reference
    max_length: int  # the model's longest row (max_seq_len)
    completions_hook: object = None  # tests: fn(prompt ids, seeds) -> completions, in place of sampling
    spec: object = None  # the model's (models/spec.ModelSpec): a Mixture-of-Experts model's routing is balanced
    never: tuple[int, ...] = ()  # tokens never sampled (an image-text model's image token)
    rollouts: Rollouts | None = None
    restored: dict | None = None  # a checkpoint's round of completions, every rank's (load_state_dict)
    sampled_s: list = field(default_factory=list)  # (step, seconds to sample and score) of each generating step
    tokens_seen: float = 0.0  # prompt and completion tokens of every round sampled so far (TRL's num_tokens)

    def step(self, state, micro_batches: list[list[dict] | None], context):
        from moai_recipes.train.loop import StepResult, _all_reduce

        step, plan, world, settings = context.number, context.plan, context.world, context.settings
        pad_id = context.pad_id
        round_ = (step - 1) // self.num_iterations
        clock = {"generate": 0.0, "score": 0.0}
        if self.rollouts is None or self.rollouts.round != round_:
            prompts = [s for micro in micro_batches if micro for s in micro]
            if self.restored is not None and self.restored["round"] == round_:  # resumed mid-round: as saved
                self.rollouts = _mine(self.restored, prompts)
            else:
                self.rollouts = self._generate(state.model, prompts, round_, plan=plan, world=world, pad_id=pad_id,
                                               step=step, clock=clock)
                self.tokens_seen += self.rollouts.metrics["tokens"]
            self.restored = None
        r = self.rollouts
        start = time.perf_counter()
        scale = plan.shards / normaliser(self.loss, completions=r.completions, tokens=r.loss_tokens)
        # Each rank runs as many micro-batches as the busiest (FSDP2's collectives).
        groups = plan.micro_batches([len(row["tokens"]) for row in r.rows]) if r.rows else []
        count = int(_all_reduce([len(groups)], world.device, op=dist.ReduceOp.MAX)[0])
        sums = _Sums()
        spec = self.spec
        balancing = spec is not None and spec.is_moe and spec.router_aux_loss_coef > 0
        # The balancing loss: a mean over the global batch's completions, scaled as the policy loss is over the shards.
        routed = (RoutingTotals(spec, aux_scale=plan.shards / max(r.completions, 1) * spec.router_aux_loss_coef)
                  if balancing else None)
        with in_compute_dtype(state.model, plan):
            for k in range(count):
                if k >= len(groups):  # another rank's extra micro-batch: FSDP2 needs this rank in it too
                    (_logits(state.model, torch.full((1, 1), pad_id, dtype=torch.long)).sum() * 0).backward()
                    continue
                picked = groups[k]
                batch = model_inputs([r.rows[i] for i in picked], plan, pad_id)
                routing = (Routing(batch["samples"].to(world.device), batch["sample_count"], spec)
                           if routed is not None else None)
                with routing_recorded(state.model, routing):
                    logps, entropy, rows = completion_logps(state.model, batch, self.sampling.temperature)
                index = torch.tensor(picked, device=rows.device)[rows]  # each token's completion in r.rows
                old = torch.cat([r.old[i] for i in picked]).to(logps.device) if r.old is not None else None
                ref = torch.cat([r.ref[i] for i in picked]).to(logps.device) if r.ref is not None else None
                advantage = r.advantages.to(logps.device)[index]
                terms = token_terms(logps, old, ref, advantage, self.loss)
                row_tokens = torch.bincount(rows, minlength=len(picked))
                part = loss_sum(terms.loss, rows, row_tokens, self.loss)
                objective = part * scale
                if routing is not None:
                    stats = routing.stats()
                    routed.add(stats)
                    objective = objective + routed.balancing_losses(stats).sum() * routed.aux_scale
                objective.backward()
                sums.add(part.detach(), terms, entropy, rows, row_tokens)
        if plan.replicate:
            all_reduce_gradients(state.model)
        total = _all_reduce(sums.totals() + (routed.as_list() if routed else []), world.device)
        routing_totals = total[len(sums.totals()):]
        lows, highs = _gathered(sums.row_means(), world)
        grad_norm = clip_gradients(state.model, settings.max_grad_norm, stages=None)
        loss = total[0] / normaliser(self.loss, completions=r.completions, tokens=r.loss_tokens)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        tokens = max(total[1], 1)
        clock["train"] = time.perf_counter() - start
        if clock["generate"]:
            self.sampled_s.append((step, clock["generate"] + clock["score"]))
        extra = {**r.metrics, **{f"time/{k}": v for k, v in clock.items()}, "entropy": total[2] / tokens, "clip_ratio/low_mean": total[3] / tokens,
                 "clip_ratio/high_mean": total[4] / tokens, "clip_ratio/region_mean": total[5] / tokens,
                 "clip_ratio/low_min": min(lows, default=0.0), "clip_ratio/high_max": max(highs, default=0.0),
                 "num_tokens": self.tokens_seen}
        if self.loss.beta != 0.0:
            extra["kl"] = total[6] / tokens
        if routed is not None:
            extra.update(routed.metrics(routing_totals, r.completions))
        return StepResult(loss=loss, tokens=int(r.metrics["tokens"]), target_tokens=int(total[1]),
                          grad_norm=grad_norm, finite=finite, extra=extra)

    def micro_batch_shapes(self, plan: Plan, prompts: list[dict]) -> list[tuple[int, int, int]]:
        """The shapes of the micro-batches a step trains (train/micro_batches.micro_batch_shapes), of its completions
        at their longest (a prompt and max_completion_length tokens each): what its measured peak is compared at."""
        rows = [{"tokens": [0] * (len(p["tokens"]) + self.sampling.max_completion_length)}
                for p in prompts for _ in range(self.num_generations)]
        return micro_batch_shapes(plan, rows)

    def state_dict(self) -> dict | None:
        """The round of completions being trained on, every rank's (a checkpoint resumes mid-round with them, on any
        flavor: each rank then takes its prompts' rows). Every rank calls it (a gather)."""
        if self.rollouts is None:
            return None
        r = self.rollouts
        # Without the image inputs: a resumed run makes them again from its prompts (_mine).
        rows = [{**{k: v for k, v in row.items() if k != "images"}, "advantage": float(r.advantages[i]),
                 "old": r.old[i] if r.old is not None else None, "ref": r.ref[i] if r.ref is not None else None}
                for i, row in enumerate(r.rows)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, rows)
            rows = [row for part in everyone for row in part]
        return {"round": r.round, "completions": r.completions, "loss_tokens": r.loss_tokens, "metrics": r.metrics,
                "rows": rows, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict | None) -> None:
        self.restored = state
        self.tokens_seen = (state or {}).get("tokens_seen", 0.0)

    def _generate(self, model, prompts: list[dict], round_: int, *, plan: Plan, world: World, pad_id: int,
                  step: int, clock: dict) -> Rollouts:
        """This rank's completions of its prompts, their rewards and advantages (from every rank's rewards)."""
        G = self.num_generations
        start = time.perf_counter()
        ids = [p["tokens"] for p in prompts for _ in range(G)]
        seeds = [completion_seed(self.seed, round_, p["index"], g) for p in prompts for g in range(G)]
        # An image-text model's prompts: their image inputs, made once a round, shared by a prompt's completions.
        pictures = [made_inputs(p["images"]) if "images" in p else None for p in prompts]
        images = [m for m in pictures for _ in range(G)] if any(pictures) else None
        cache_bytes = 0
        if self.completions_hook is not None:
            completions = self.completions_hook(ids, seeds)
        else:
            sampler = Sampler(self.sampling, tuple(self.tokenizer.stop_ids), pad_id, plan, world.device, self.max_length,
                              never=self.never)
            # Outside the CPU's memory tracking (train/peak_memory.py, its first steps): it would follow each of the
            # decode steps' thousands of small operators. The KV cache is checked against the plan instead.
            with _disable_current_modes():
                samples = sampler.complete(model, ids, seeds, images)
            completions, cache_bytes = samples.completions, samples.kv_cache_bytes
        clock["generate"] = time.perf_counter() - start
        start = time.perf_counter()
        ends = set(self.tokenizer.stop_ids) | {pad_id}
        truncated = [not c or c[-1] not in ends for c in completions]
        texts = [self.tokenizer.decode(c) for c in completions]
        conversational = bool(prompts) and isinstance(prompts[0]["prompt"], list)
        shown = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [p["columns"][k] for p in prompts for _ in range(G)] for k in (prompts[0]["columns"] if prompts
                                                                                     else {})}
        scores = self.rewards.score(prompts=[p["prompt"] for p in prompts for _ in range(G)], completions=shown,
                                    completion_ids=completions, columns=columns, step=step - 1) if prompts else \
            torch.zeros((0, len(self.rewards.functions)))
        # Every rank's rewards, lengths and truncation, in rank order: the global batch's groups are whole. (A GRPO
        # plan is data-parallel only: recipes/grpo.py keeps pipeline, tensor and context degrees at 1.)
        mine = (scores, [len(c) for c in completions], truncated, [len(p["tokens"]) for p in prompts for _ in range(G)])
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        first = sum(len(e[1]) for e in everyone[:world.data_rank])
        per_function = torch.cat([e[0] for e in everyone])
        found = advantages(per_function, self.rewards.weights, group=G, scale=self.scale_rewards)
        lengths = torch.tensor([n for e in everyone for n in e[1]], dtype=torch.float32)
        cut = torch.tensor([t for e in everyone for t in e[2]])
        prompt_tokens = sum(n for e in everyone for n in e[3])
        rows = []
        owners = [p["index"] for p in prompts for _ in range(G)]
        for k, (prompt_ids, completion, was_cut, owner) in enumerate(zip(ids, completions, truncated, owners)):
            masked = was_cut and self.mask_truncated_completions
            labels = [IGNORE_INDEX] * (len(prompt_ids) - 1) + ([IGNORE_INDEX] * len(completion) if masked
                                                              else list(completion)) + [IGNORE_INDEX]
            rows.append({"tokens": list(prompt_ids) + list(completion), "labels": labels, "prompt_index": owner,
                         **({"images": images[k]} if images is not None and images[k] else {})})
        loss_tokens = int(sum(0 if (t and self.mask_truncated_completions) else n for n, t in
                              zip(lengths.long().tolist(), cut.tolist())))
        metrics = _generation_metrics(found, per_function, lengths, cut, names=self.rewards.names)
        metrics.update({"tokens": float(lengths.sum()) + prompt_tokens, "generation/kv_cache_bytes": cache_bytes})
        out = Rollouts(round=round_, rows=rows, advantages=found.values[first:first + len(rows)],
                       completions=len(lengths), loss_tokens=loss_tokens, metrics=metrics)
        if self.num_iterations > 1:
            out.old = self._logps(model, out.rows, plan=plan, world=world, pad_id=pad_id, reference=False)
        if self.loss.beta != 0.0:
            out.ref = self._logps(model, out.rows, plan=plan, world=world, pad_id=pad_id, reference=True)
        clock["score"] = time.perf_counter() - start
        return out

    @torch.no_grad()
    def _logps(self, model, rows: list[dict], *, plan: Plan, world: World, pad_id: int,
               reference: bool) -> list[torch.Tensor]:
        """Each row's completion tokens' log-probabilities now (the policy's, or the reference's), micro-batch by
        micro-batch as training runs them, every rank in step."""
        from moai_recipes.train.loop import _all_reduce

        groups = plan.micro_batches([len(row["tokens"]) for row in rows]) if rows else []
        count = int(_all_reduce([len(groups)], world.device, op=dist.ReduceOp.MAX)[0])
        out: list[torch.Tensor | None] = [None] * len(rows)
        use = self.reference.model if reference and self.reference.model is not None else model
        off = reference and self.reference.adapters_off
        with in_compute_dtype(model, plan), (_adapters_off(model) if off else contextlib.nullcontext()):
            for k in range(count):
                if k >= len(groups):
                    _logits(use, torch.full((1, 1), pad_id, dtype=torch.long))
                    continue
                batch = model_inputs([rows[i] for i in groups[k]], plan, pad_id)
                logps, _, row_of = completion_logps(use, batch, self.sampling.temperature, entropy=False)
                logps, row_of = logps.float().cpu(), row_of.cpu()
                for j, i in enumerate(groups[k]):
                    out[i] = logps[row_of == j]
        return out


def _generation_metrics(found, per_function: torch.Tensor, lengths: torch.Tensor, cut: torch.Tensor, *,
                        names: tuple[str, ...]) -> dict:
    """What TRL logs of a generation, over the global batch: the weighted reward's mean and spread, the share of
    groups with nothing to learn, each function's rewards, the completions' lengths and how many were cut."""
    ended = lengths[~cut] if (~cut).any() else torch.zeros(1)
    metrics = {"reward": float(torch.nanmean(found.rewards)), "reward_std": float(nanstd(found.rewards)),
               "frac_reward_zero_std": float(found.zero_std.float().mean()),
               "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
               "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(cut.float().mean()),
               "completions/mean_terminated_length": float(ended.mean()),
               "completions/min_terminated_length": float(ended.min()),
               "completions/max_terminated_length": float(ended.max())}
    for j, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = float(torch.nanmean(per_function[:, j]))
        metrics[f"rewards/{name}/std"] = float(nanstd(per_function[:, j]))
    return metrics


def _mine(saved: dict, prompts: list[dict]) -> Rollouts:
    """This rank's rows of a saved round: its prompts' completions, in its prompts' order (an image-text model's with
    their prompt's image inputs, made again)."""
    by_prompt: dict[int, list[dict]] = {}
    for row in saved["rows"]:
        by_prompt.setdefault(row["prompt_index"], []).append(row)
    rows = [row for p in prompts for row in by_prompt.get(p["index"], [])]
    old = [row["old"] for row in rows] if rows and rows[0]["old"] is not None else None
    ref = [row["ref"] for row in rows] if rows and rows[0]["ref"] is not None else None
    pictures = {p["index"]: made_inputs(p["images"]) for p in prompts if "images" in p}
    kept = [{**{k: row[k] for k in ("tokens", "labels", "prompt_index")},
             **({"images": pictures[row["prompt_index"]]} if pictures.get(row["prompt_index"]) else {})}
            for row in rows]
    return Rollouts(round=saved["round"], rows=kept, advantages=torch.tensor([row["advantage"] for row in rows]),
                    completions=saved["completions"], loss_tokens=saved["loss_tokens"], metrics=saved["metrics"],
                    old=old, ref=ref)


def completion_logps(model, batch: dict, temperature: float, *, entropy: bool = True):
    """(log-probabilities [n], entropies [n] or None, completion of each [n]) of a micro-batch's loss tokens, in their
    order: log_softmax(logits / temperature) at each label, as TRL's fused head computes them, in fp32."""
    logits = _logits(model, batch["tokens"], batch.get("documents"), batch.get("images"))
    labels = batch["labels"].to(logits.device)
    keep = labels != IGNORE_INDEX
    z = logits[keep].float() / temperature
    log_z = torch.logsumexp(z, dim=-1)
    logps = z.gather(-1, labels[keep].unsqueeze(-1)).squeeze(-1) - log_z
    ent = None
    if entropy:
        with torch.no_grad():
            ent = log_z - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logps, ent, batch["samples"].to(logits.device)[keep]


class _Sums:
    """A rank's sums over its micro-batches: the loss, loss tokens, entropy, clipped tokens, KL; and per completion
    the share of its tokens clipped low and high (clip_ratio/low_min, high_max)."""

    def __init__(self):
        self.values = [0.0] * 7
        self.low_means: list[float] = []
        self.high_means: list[float] = []

    def add(self, part, terms, entropy, rows, row_tokens) -> None:
        low, high = terms.low_clipped.float(), terms.high_clipped.float()
        region = (terms.low_clipped | terms.high_clipped).float()
        kl = float(terms.kl.detach().sum()) if terms.kl is not None else 0.0
        for i, v in enumerate((float(part), float(rows.numel()), float(entropy.sum()), float(low.sum()),
                               float(high.sum()), float(region.sum()), kl)):
            self.values[i] += v
        n = row_tokens.float()
        has = n > 0  # a completion with no loss token (masked as truncated): no ratio (TRL: NaN, dropped)
        per_low = torch.zeros_like(n).index_add_(0, rows, low) / n.clamp(min=1)
        per_high = torch.zeros_like(n).index_add_(0, rows, high) / n.clamp(min=1)
        self.low_means += per_low[has].tolist()
        self.high_means += per_high[has].tolist()

    def totals(self) -> list[float]:
        return list(self.values)

    def row_means(self) -> tuple[list[float], list[float]]:
        return self.low_means, self.high_means


def _gathered(means: tuple[list[float], list[float]], world: World) -> tuple[list[float], list[float]]:
    """Every rank's per-completion clip shares."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return means
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, means)
    return [v for e in everyone for v in e[0]], [v for e in everyone for v in e[1]]
