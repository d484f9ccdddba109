"""recipes.grpo's generation phase, priced beside training: the KV cache a device holds while it samples
`Plan.generation_batch` completions at once, the logits beside it, and the seconds of the prefill, the decode steps
and the forwards over the completions that follow (the sampling policy's and the reference's log-probabilities).

A decode step computes `generation_batch` tokens: its matmuls run at the efficiency of so few rows, and it reads every
weight and the cache once more, so a step costs about max(FLOPs at that efficiency, bytes at the bandwidth) and its
operators' dispatch, whatever the rows; a larger batch shares that cost, at the price of a larger cache (the planner
takes the largest that fits: search._generation_batch). Every rank samples in chunks of the same count (FSDP2's
gathers are collectives), each chunk to the longest prompt plus max_completion_length.
"""

import math
from dataclasses import dataclass
from typing import Callable

from moai_recipes.planner.activations import trace_images
from moai_recipes.planner.memory import DTYPE_BYTES, param_dtype
from moai_recipes.planner.plan import Plan, Workload

# A decode step on the CPU (its forward with the KV cache, fp32, 2 threads, measured: SmolLM2-135M 39.0, 73.8 and
# 148.4 ms for 1, 16 and 64 rows with 32 positions cached, 540.6 ms for 64 rows with 128; the tiny model 1.4, 3.6 and
# 16.1 ms for 1 and 64 rows with 32 and 128): a fixed part, its weights read once (at the bandwidth) and its
# operators dispatched (torchtune's attention with its cache: DECODE_OPS_PER_LAYER a layer, HEAD_OPS for the norm,
# the output and the sampling), and per row its matmuls (at the training's efficiency for that many rows) and its
# attention over the cache, which on this CPU grows with the square of the cached positions: per layer, a part of its
# own and a part per query dimension (CACHE_SQUARED_S, CACHE_SQUARED_QUERY_S: fitted on the two models' 128-position
# forwards, SmolLM2's 576 query dimensions and the tiny model's 128). The GPUs' are estimates.
# (Fitted as 200 and 300 when the traces counted FakeTensorMode's device queries as operators, timing.PER_OP_S:
# divided by the 3.1 they inflated a layer's count by, the same seconds.)
DECODE_OPS_PER_LAYER = 65
HEAD_OPS = 97
CACHE_SQUARED_S = {"cpu": 0.72e-9, "gpu": 1e-12}
CACHE_SQUARED_QUERY_S = {"cpu": 2.13e-11, "gpu": 2e-14}
# Per completion and decode step, the draw: a softmax and a cumulative sum over the vocabulary in fp64
# (train/rollouts.py), and the row's own seeded uniform number: a generator call and its copy into the step's, two
# small operators (on a GPU two kernel launches of about 5 us, queued: the drawn tokens stay on the device until the
# chunk ends, and a step waits on the device once for all rows, tests/test_grpo.py counts it).
DRAW_VALUE_S = {"cpu": 1.5e-9, "gpu": 2e-12}
ROW_STEP_S = {"cpu": 10e-6, "gpu": 10e-6}


def kv_cache_bytes(work: Workload, rows: int, tokens: int, dtype: str) -> int:
    """torchtune's KV caches for `rows` sequences of `tokens` positions: keys and values of every layer."""
    spec = work.spec
    return 2 * spec.num_layers * rows * spec.num_kv_heads * spec.head_dim * tokens * DTYPE_BYTES[dtype]


def longest_prompt(work: Workload) -> int:
    """The prompts' longest (a chunk pads to it), from the data's rows (prompt + max_completion_length each)."""
    r = work.rollout
    return max(1, max(work.lengths or (work.seq_len,)) - r.completion_length)


def rollout_bytes(plan: Plan, work: Workload) -> tuple[int, int]:
    """(the KV cache, the logits) a device holds at once while it samples: the cache of a chunk of
    generation_batch completions, and the prefill's logits over the chunk's prompts (the model's output at every
    position) in the compute dtype, with the last position's in fp32 three times over (scaled, filtered, drawn)."""
    spec, rows = work.spec, plan.generation_batch
    width = longest_prompt(work)
    total = min(width + work.rollout.completion_length, work.seq_len)
    logits = rows * width * spec.vocab_size * DTYPE_BYTES[plan.param_dtype] + 3 * rows * spec.vocab_size * 4
    return kv_cache_bytes(work, rows, total, plan.param_dtype), logits


def picture_flops(plan: Plan, work: Workload) -> float:
    """An image-text model's vision tower and projector, forward only, on a prompt's pictures (their mean image
    tokens): what each prompt of a chunk adds to its prefill. Traced as training traces them (planner/activations.py:
    forward and backward where the tower trains, a third of it forward)."""
    images = work.images
    if images is None or not images.example_tokens:
        return 0.0
    seen = trace_images(work.spec, images.example, dtype=param_dtype(plan), lora=work.lora_key)
    forward = seen.flops / 3 if seen.retained else seen.flops
    return forward * images.mean / images.example_tokens


@dataclass(frozen=True)
class Speed:
    """A device as predict_time sees it: its kind, peak FLOP/s and usable bytes/s, the matmuls' share of the peak at a
    number of rows (`efficiency(rows)`), an operator's dispatch, and the seconds FSDP2 takes to gather the weights
    for one forward (0: a plain module, whole already)."""

    kind: str
    peak: float
    bandwidth: float
    efficiency: Callable[[float], float]
    per_op_s: float
    gather_s: float = 0.0


def rollout_seconds(plan: Plan, work: Workload, speed: Speed) -> float:
    """Seconds a step spends sampling (a round's, spread over its num_iterations steps): each chunk's prefill (the
    training's efficiency at its tokens, `efficiency(tokens)`; an image-text model's prompts' pictures through the
    vision tower too) and its decode steps (above), every completion run to
    max_completion_length; on FSDP2 shards, the weights gathered for each of those forwards, or once for the round
    (plan.gather_for_generation)."""
    spec, r = work.spec, work.rollout
    peak, efficiency, kind = speed.peak, speed.efficiency, speed.kind
    rows = plan.batch_per_device  # completions a device samples in a round
    chunks = math.ceil(rows / max(plan.generation_batch, 1))
    batch = min(plan.generation_batch, rows)
    width = longest_prompt(work)
    embedding = spec.vocab_size * spec.embed_dim
    # FLOPs a token's forward takes: its weights' products, the output projection's included, the lookup not.
    matmul = 2 * (spec.num_params(active=True) - embedding * (1 if spec.tie_word_embeddings else 2) + embedding)
    fixed = spec.num_params() * DTYPE_BYTES[plan.param_dtype] / speed.bandwidth + \
        (spec.num_layers * DECODE_OPS_PER_LAYER + HEAD_OPS) * speed.per_op_s
    prefill = (matmul * batch * width + batch * picture_flops(plan, work)) / (peak * efficiency(batch * width)) + fixed
    cached = min(width + r.completion_length, work.seq_len)  # the cache's positions (train/rollouts.py)
    attention = cached ** 2 * (CACHE_SQUARED_S[kind] + spec.num_heads * spec.head_dim * CACHE_SQUARED_QUERY_S[kind])
    per_row = (matmul / (peak * efficiency(batch)) + spec.num_layers * attention + spec.vocab_size * DRAW_VALUE_S[kind]
               + ROW_STEP_S[kind])
    gathers = 1 if plan.gather_for_generation else chunks * (1 + r.completion_length)
    return (chunks * (prefill + r.completion_length * (fixed + batch * per_row)) + gathers * speed.gather_s) \
        / r.num_iterations
