"""recipes.grpo's rollouts: `num_generations` completions of each prompt, sampled with the KV cache on the model as the
plan laid it out (FSDP2 shards included), each completion seeded by itself.

A completion's random stream is seeded from (the run's seed, the generation round, the prompt's place in the
dataset, which of its completions it is), never from the process: the same step samples the same completions on one
process or eight (given the same weights), and a resumed run samples what the uninterrupted run sampled. Sampling
is transformers' order: logits / temperature, then top-k, then top-p, then a draw (inverse transform sampling, one
uniform number a completion and token).

Every rank runs the same number of forward passes (FSDP2's gathers are collectives): a rank whose completions have
all ended keeps stepping with its rows masked until every rank's have ended or `max_completion_length` is reached.
A completion ends after its first stop token (included, as TRL keeps it).

An image-text model's prompts come with their image inputs: the prompts' pass takes them (the vision tower's features
in the prompt's place), the decode steps read them from the cache; multimodal rotary positions (Qwen's) are the
model's own for the prompt, and move on from its largest for each token drawn, as transformers' generate places them.
The model's image token is never drawn (as TRL suppresses it): an image token in a completion would ask for an image
that is not there.
"""

import math
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moai_recipes.data.images import collate_images
from moai_recipes.planner.plan import Plan
from moai_recipes.train.mixed_precision import in_compute_dtype
from moai_recipes.train.parallel import gathered

_MIX = 0x9E3779B97F4A7C15  # splitmix64's increment: seeds of nearby (round, prompt, completion) far apart


@dataclass(frozen=True)
class SamplingSettings:
    """TRL's names: temperature, top_p, top_k (0: none), max_completion_length."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_completion_length: int = 512


def completion_seed(seed: int, round_: int, prompt_index: int, generation: int) -> int:
    """The seed of one completion's random stream."""
    x = (seed * 1_000_003 + round_) * 1_000_003 + prompt_index
    x = (x * 31 + generation + 1) & 0xFFFFFFFFFFFFFFFF
    x = (x + _MIX) & 0xFFFFFFFFFFFFFFFF  # splitmix64's finaliser
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def filtered_logits(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """[rows, vocab] fp32 logits / temperature with what top-k and top-p leave out at -inf (transformers' order)."""
    z = logits.float() / settings.temperature
    if settings.top_k and settings.top_k < z.size(-1):
        kth = torch.topk(z, settings.top_k).values[:, -1:]
        z = z.masked_fill(z < kth, -math.inf)
    if settings.top_p < 1.0:
        probs, order = torch.softmax(z, dim=-1).sort(dim=-1, descending=False)
        outside = probs.cumsum(dim=-1) <= 1 - settings.top_p  # transformers' TopPLogitsWarper
        outside[:, -1] = False  # the likeliest always stays
        z = z.masked_fill(outside.scatter(-1, order, outside), -math.inf)
    return z


@dataclass(frozen=True)
class Sampler:
    """How a run samples: its settings, the tokens that end a completion, the padding, and where (the plan's compute
    dtype, the device, the model's longest row: a prompt and its completion)."""

    settings: SamplingSettings
    stop_ids: tuple[int, ...]
    pad_id: int
    plan: Plan
    device: torch.device
    max_length: int
    never: tuple[int, ...] = ()  # tokens never drawn (an image-text model's image token)

    @torch.no_grad()
    def complete(self, model: nn.Module, prompts: list[list[int]], seeds: list[int],
                 images: list[dict | None] | None = None) -> "Samples":
        """One completion of each prompt (a prompt repeated G times gives G), each drawn from its own seeded stream;
        a completion is cut after its first stop token (kept) or at max_completion_length tokens. In chunks of the
        plan's generation_batch, as many on every rank. `images`: an image-text model's inputs for each prompt's
        pictures (data/images.py), or None for a prompt without."""
        size = max(self.plan.generation_batch, 1)
        chunks = -(-len(prompts) // size)
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([chunks], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            chunks = int(t[0])
        out, cache = [], 0
        with gathered(model, keep=self.plan.gather_for_generation):
            for k in range(max(chunks, 1)):
                part = slice(k * size, (k + 1) * size)
                completions, cache_bytes = self._chunk(model, prompts[part], seeds[part],
                                                       images[part] if images is not None else None)
                out += completions
                cache = max(cache, cache_bytes)
        return Samples(out, cache)

    def _chunk(self, model: nn.Module, prompts: list[list[int]], seeds: list[int],
               images: list[dict | None] | None) -> tuple[list[list[int]], int]:
        from torchtune.generation import get_causal_mask_from_padding_mask, get_position_ids_from_padding_mask
        from torchtune.modules.common_utils import local_kv_cache

        settings, device, pad_id = self.settings, self.device, self.pad_id
        rows = len(prompts)
        # Every rank pads its prompts to the longest of any rank's, so all step as often (FSDP2); and each needs a
        # row.
        width = _longest(max((len(p) for p in prompts), default=1), device)
        new = min(settings.max_completion_length, self.max_length - width)
        tokens = torch.full((max(rows, 1), width), pad_id, dtype=torch.long, device=device)
        real = torch.zeros_like(tokens, dtype=torch.bool)
        for i, p in enumerate(prompts):  # left-padded
            tokens[i, width - len(p):] = torch.tensor(p, device=device)
            real[i, width - len(p):] = True
        total = width + new
        masks = get_causal_mask_from_padding_mask(real, target_seq_len=total)
        positions = get_position_ids_from_padding_mask(torch.nn.functional.pad(real, (0, new), value=True))
        pictures = {}
        if images is not None and any(images):
            pictures = {k: v.to(device) for k, v in collate_images(
                [{"tokens": p, "images": m} for p, m in zip(prompts, images)], width, left=True).items()}
        prompt_positions, offset = (model.sampling_positions(tokens, real, positions[:, :width], pictures)
                                    if pictures else (positions[:, :width], None))
        # What a decode step reads of the pictures besides the cache: Llama 3.2 Vision's tiles each row's token sees,
        # those its prompt's last token sees (transformers' generate goes on so).
        seeing = {k: v[:, -1:] for k, v in pictures.items()
                  if v.dim() > 2 and v.shape[:2] == tokens.shape and not v.is_floating_point()}
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        stops = torch.tensor(self.stop_ids, device=device)
        never = torch.tensor(self.never, dtype=torch.long, device=device)
        out = [[] for _ in range(rows)]
        done = torch.zeros(max(rows, 1), dtype=torch.bool, device=device)
        done[rows:] = True
        was_training = model.training
        model.eval()
        try:
            with in_compute_dtype(model, self.plan), local_kv_cache(model, batch_size=tokens.size(0), device=device,
                                                                    dtype=getattr(torch, self.plan.param_dtype),
                                                                    decoder_max_seq_len=total):
                cache_bytes = sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                                  if name.endswith(("kv_cache.k_cache", "kv_cache.v_cache")))
                _unchecked_cache_updates(model)
                logits = _last(model(tokens, mask=masks, input_pos=prompt_positions,
                                     **({"images": pictures} if pictures else {})))
                # The drawn tokens stay on the device until the chunk ends (one copy to the host then): a decode step
                # waits on the host once, for whether every row is done.
                drawn, kept = [], []
                for t in range(new):
                    if len(never):
                        logits = logits.index_fill(-1, never, -math.inf)
                    nxt = _draw(filtered_logits(logits, settings), generators, rows)
                    drawn.append(nxt)
                    kept.append(~done)  # a row's token counts until its first stop token, which it keeps
                    done = done | torch.isin(nxt, stops)
                    if t == new - 1 or _all_done(done, device):
                        break
                    pos = width + t
                    step_mask = masks.new_zeros((tokens.size(0), 1, total))
                    step_mask[:, 0, :width] = real
                    step_mask[:, 0, width:pos + 1] = True
                    step = positions[:, pos:pos + 1]
                    if offset is not None:  # multimodal rotary positions: text, then time, height, width moved on
                        step = torch.cat([step[None], (step + offset)[None].expand(3, -1, -1)])
                    logits = _last(model(nxt.unsqueeze(1), mask=step_mask, input_pos=step,
                                         **({"images": seeing} if seeing else {})))
        finally:
            model.train(was_training)
        if drawn:
            for i, (row, keep) in enumerate(zip(torch.stack(drawn, 1)[:rows].tolist(),
                                                torch.stack(kept, 1)[:rows].tolist())):
                out[i] = [token for token, k in zip(row, keep) if k]
        return out, cache_bytes


@dataclass(frozen=True)
class Samples:
    completions: list[list[int]]
    kv_cache_bytes: int  # the KV caches one chunk held (the largest chunk's): what the planner predicts


def _last(logits) -> torch.Tensor:
    logits = torch.cat(logits, dim=1) if isinstance(logits, list) else logits  # a chunked output
    return logits[:, -1]


def _draw(z: torch.Tensor, generators: list[torch.Generator], rows: int) -> torch.Tensor:
    """A token per row from softmax(z), each row from its own stream: one uniform number a row, through the row's
    cumulative distribution (inverse transform sampling: exact, and a draw per row, not per vocabulary entry)."""
    probs = torch.softmax(z, dim=-1, dtype=torch.float64)
    u = torch.ones(probs.size(0), 1, dtype=torch.float64, device=probs.device)
    for i in range(rows):
        u[i, 0] = torch.rand((), dtype=torch.float64, generator=generators[i], device=probs.device)
    cdf = probs.cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1)
    # u * total < total, so a token is always found; a token of probability 0 is never the first whose cdf reaches it
    return chosen.clamp(max=probs.size(-1) - 1)


def _longest(longest: int, device: torch.device) -> int:
    """The longest prompt of any rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return longest
    t = torch.tensor([longest], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0])


def _unchecked_cache_updates(model: nn.Module) -> None:
    """torchtune's KVCache.update asserts that the cache has room by reading its position back from the device: a wait
    per layer and decode step. This sampler sized the caches for the longest prompt and every new token
    (local_kv_cache's decoder_max_seq_len), so each cache of `model` gets the same writes without the read (until
    local_kv_cache removes the caches)."""
    from torchtune.modules.kv_cache import KVCache

    def update(cache, k_val: torch.Tensor, v_val: torch.Tensor):
        places = cache.cache_pos[:k_val.shape[2]]
        cache.k_cache[:, :, places] = k_val
        cache.v_cache[:, :, places] = v_val
        cache.cache_pos.add_(k_val.shape[2])
        return cache.k_cache, cache.v_cache

    for module in model.modules():
        if isinstance(module, KVCache):
            module.update = types.MethodType(update, module)


def _all_done(done: torch.Tensor, device: torch.device) -> bool:
    """Whether every row of every rank is done: one wait on the device (and one all-reduce where there are ranks)."""
    finished = done.all().float().reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(finished, op=dist.ReduceOp.MIN)
    return bool(finished.item())
