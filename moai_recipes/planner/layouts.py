"""The ways a model can be spread over a flavor's devices: tensor-parallel degrees that cut its heads, pipeline
stages that cut its layers (split by cost), and the data-parallel copies left over. search.py prices each."""

import functools
import math
from dataclasses import dataclass

from moai_recipes.errors import UserError
from moai_recipes.models.spec import ModelSpec
from moai_recipes.models.transformers_model import RECURRENT_KINDS
from moai_recipes.planner.plan import stages_per_device

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# GPipe is priced only where forced: it runs every forward before any backward, so it holds all M micro-batches in
# flight where 1F1B holds at most P - d on device d, at the same bubble ((P - 1) / M): never faster, never smaller
# (checked on all 6,540 twin plans of 70B on 48xlarge), it is never the fastest that fits.
UNFORCED_SCHEDULES = ("1f1b", "interleaved_1f1b")
# What the embedding lookup costs next to a matmul of the same parameters: a read of a few rows.
EMBEDDING_COST = 0.0


def stage_costs(spec: ModelSpec) -> tuple[float, float, float]:
    """(embedding, one layer, head): each part's forward and backward work, in multiply-adds per token."""
    d, q, kv = spec.embed_dim, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if spec.parts is not None:  # counted on the model: a layer's weights a token computes with
        layer = sum(spec.parts.active_layers) / spec.num_layers
    else:
        layer = d * (2 * q + 2 * kv) + spec.mean_mlp_params(active=True)  # a sparse layer: its router and top-k experts
    return EMBEDDING_COST * spec.vocab_size * d, float(layer), float(spec.vocab_size * d)


def split_layers(spec: ModelSpec, stages: int) -> tuple[int, ...]:
    """How many layers each of `stages` stages holds: consecutive, at least one each, the most expensive stage as cheap
    as can be (the embedding counts on the first stage, the head on the last)."""
    return _split(spec.num_layers, stage_costs(spec), stages)


@functools.cache  # the planner asks for the same split of every plan of a layout
def _split(n: int, costs: tuple[float, float, float], stages: int) -> tuple[int, ...]:
    if stages > n:
        raise ValueError(f"{stages} stages for {n} layers")
    embed, layer, head = costs

    def cost(first: int, end: int) -> float:
        return (end - first) * layer + (embed if first == 0 else 0) + (head if end == n else 0)

    # best[s][e]: the smallest largest-stage cost of layers [0, e) in s stages; cut[s][e]: where the last begins.
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for e in range(s, n + 1):
            for b in range(s - 1, e):
                c = max(best[s - 1][b], cost(b, e))
                if c < best[s][e] - 1e-9:
                    best[s][e], cut[s][e] = c, b
    counts, e = [], n
    for s in range(stages, 0, -1):
        counts.append(e - cut[s][e])
        e = cut[s][e]
    return tuple(counts[::-1])


def tensor_degrees(spec: ModelSpec, limit: int) -> list[int]:
    """The tensor-parallel degrees up to `limit` that cut the model evenly: its query and key/value heads, its
    MLP and its vocabulary (powers of two, as devices come)."""
    return [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= limit and not why_not_tensor(spec, t)]


def why_not_tensor(spec: ModelSpec, degree: int) -> str | None:
    """Why `degree` cannot cut this model's layers (None: it can)."""
    if degree == 1:
        return None
    if not spec.native:
        return (f"its layers are transformers' modules (our own layers do not build {spec.family}), which are not "
                "cut by heads yet (their base_model_tp_plan is not applied here); FSDP2 shards them over the data-parallel "
                "devices instead")
    parts = [("num_key_value_heads", spec.num_kv_heads), ("num_attention_heads", spec.num_heads),
             ("intermediate_size", spec.intermediate_dim), ("vocab_size", spec.vocab_size)]
    for name, value in parts:
        if value % degree:
            return f"{name}={value} does not divide by {degree}"
    return None


def why_not_pipeline(spec: ModelSpec, stages: int, schedule: str) -> str | None:
    """Why `stages` devices running `schedule` cannot cut this model's layers (None: they can)."""
    if not spec.native:
        return (f"its layers are transformers' modules (our own layers do not build {spec.family}), which are not "
                "cut into pipeline stages yet (a stage would need the model's own masks and rotary tables passed between "
                "stages); FSDP2 shards them over the data-parallel devices instead")
    per = stages_per_device(schedule)
    if stages * per > spec.num_layers:
        return (f"{stages * per} stages need at least as many layers, and the model has {spec.num_layers}"
                + (" (interleaved 1F1B runs two stages a device)" if per == 2 else ""))
    return None


def expert_degrees(spec: ModelSpec, data: int, tensor: int = 1) -> list[int]:
    """The expert-parallel degrees that split a Mixture-of-Experts model's experts evenly over `data` data-parallel
    devices (1 alone for a dense model), beside `tensor`-parallel ones."""
    return [e for e in range(1, data + 1) if data % e == 0 and not why_not_expert(spec, e, data, tensor)]


def why_not_expert(spec: ModelSpec, degree: int, data: int, tensor: int = 1) -> str | None:
    """Why `degree` of the `data` data-parallel devices cannot split this model's experts (None: they can)."""
    if degree == 1:
        return None
    if not spec.is_moe:
        return f"this {spec.family} model has no experts"
    if not spec.native and not spec.parts.experts_dispatchable:
        return (f"this {spec.family} model's experts do not take their tokens through transformers' experts interface "
                "(hidden states, top-k experts and weights), which expert parallelism sends them by")
    if spec.num_experts % degree:
        return f"its {spec.num_experts} experts (num_experts) do not divide by {degree}"
    if data % degree:
        return f"the plan's {data} data-parallel device(s) do not divide by {degree}"
    return None


CONTEXT_WAYS = ("ulysses", "gather")


def why_not_context(spec: ModelSpec, degree: int, tensor: int = 1, way: str = "ulysses", *,
                    qlora: bool = False) -> str | None:
    """Why `degree` context devices cannot split this model's rows `way` beside `tensor` devices (None: they can).
    Pipeline stages take any: each stage's devices split the rows it runs (train/pipeline.py)."""
    if degree == 1:
        return None
    if way not in CONTEXT_WAYS:
        return f"plan.context_parallel_way={way} is not a way; valid: {', '.join(CONTEXT_WAYS)}"
    if not spec.native:
        recurrent = sorted({k.split(",")[0] for k in spec.parts.kinds if k.split(",")[0] in RECURRENT_KINDS})
        if recurrent or spec.why_not_packed:
            return (f"its {', '.join(recurrent) or 'own token-mixing'} layers carry a state from one token to the "
                    "next, which is not passed between context devices")
        if way != "gather":
            return ("transformers' modules split a row over context devices the gather way (plan.context_parallel_way="
                    "gather): each device's queries against the row's keys and values, under the model's own masks")
    if qlora:
        return "QLoRA's NF4 weights are not combined with context parallelism yet"
    heads = spec.num_heads // tensor
    if way == "ulysses" and heads % degree:
        return (f"ulysses gives each context device H / {degree} of the {heads} query heads "
                f"{'a tensor-parallel device holds' if tensor > 1 else 'of a layer'}, which do not divide; "
                "plan.context_parallel_way=gather takes any head count")
    return None


def why_not_tiled_mlp(spec: ModelSpec, tensor: int = 1) -> str | None:
    """Why this model's MLP cannot be computed in tiles beside `tensor` devices (None: it can)."""
    if not spec.native:
        return "the MLP is computed in tiles in our own layers only"
    if spec.is_moe:
        return "a Mixture-of-Experts layer routes its tokens together (its balancing loss counts them whole)"
    if tensor > 1:
        return "tensor parallelism cuts the MLP's intermediate already (each device holds 1 / T of it)"
    return None


def _context_options(spec: ModelSpec, data: int, tensor: int, *, qlora: bool = False,
                    degree: int | None = None, way: str | None = None) -> list[tuple[int, str]]:
    """(degree, way) of context parallelism over `data` devices left by the tensor and pipeline cuts: `degree` and
    `way` where given (forced), else every degree above 1 that divides them, each way that can split the model."""
    degrees = [degree] if degree else [c for c in range(2, data + 1) if data % c == 0]
    return [(c, w) for c in degrees if data % c == 0 for w in ([way] if way else CONTEXT_WAYS)
            if not why_not_context(spec, c, tensor, w, qlora=qlora)]


def layouts(work, flavor, forced: dict) -> list[dict]:
    """Every way to spread `work`'s model over `flavor`'s devices that the forced plan fields allow: tensor degrees
    that divide its heads (inside a node: tensor parallelism all-gathers twice a layer), pipeline stages that
    divide its layers, the data-parallel copies left over, and of those the expert degrees that divide a
    Mixture-of-Experts model's experts. A forced degree that cannot cut the model, or that does not divide the
    devices, is a UserError naming why. Of the data-parallel devices left, context degrees that split a packed
    row's tokens (each way the model allows)."""
    spec, n = work.spec, flavor.num_devices
    node = n if flavor.device.kind == "cpu" else flavor.device.per_node  # the CPU's processes share one machine
    qlora = work.lora is not None and work.lora.quantize_base
    t_forced, p_forced, s_forced, e_forced = (forced.get(k) for k in ("tensor_parallel", "pipeline_stages",
                                                                      "pipeline_schedule", "expert_parallel"))
    _check_forced(spec, n, t_forced, p_forced, s_forced, qlora)
    if qlora and (e_forced or 1) > 1:
        raise UserError(f"plan.expert_parallel={e_forced}: QLoRA's NF4 weights are sharded by FSDP2 only; drop "
                        "plan.expert_parallel, or train LoRA (lora.quantize_base=false)")
    c_forced, w_forced = forced.get("context_parallel"), forced.get("context_parallel_way")
    if w_forced and c_forced in (None, 1):
        raise UserError(f"plan.context_parallel_way={w_forced} needs plan.context_parallel of 2 or more")
    if c_forced is not None and (c_forced < 1 or n % c_forced):
        raise UserError(f"plan.context_parallel={c_forced} must divide the flavor's {n} devices")
    if c_forced and c_forced > 1:  # refused when no way (the forced one, else either) can split the rows
        whys = [why_not_context(spec, c_forced, t_forced or 1, way, qlora=qlora)
                for way in ([w_forced] if w_forced else CONTEXT_WAYS)]
        if all(whys):
            raise UserError(f"plan.context_parallel={c_forced} cannot split this model's rows: {whys[0]}")
    tensors = [t_forced] if t_forced else [t for t in tensor_degrees(spec, min(n, node)) if n % t == 0]
    out = []
    for t in tensors:
        for p in ([p_forced] if p_forced else range(1, n // t + 1)):
            if (n // t) % p or (qlora and (t > 1 or p > 1)):
                continue
            if c_forced and c_forced > 1:
                contexts = _context_options(spec, n // (t * p), t, qlora=qlora, degree=c_forced, way=w_forced)
            else:
                contexts = [(1, "none")] + (_context_options(spec, n // (t * p), t, qlora=qlora)
                                            if c_forced is None else [])
            for c, way in contexts:
                out += _expert_layouts(spec, n, t, p, c, way, e_forced, s_forced, qlora)
    if e_forced and not out:
        t, data = t_forced or 1, n // ((t_forced or 1) * (p_forced or 1) * (c_forced or 1))
        why = why_not_expert(spec, e_forced, data, t) or f"no layout of {n} devices leaves {e_forced} to split them"
        raise UserError(f"plan.expert_parallel={e_forced} cannot split this model's experts: {why}"
                        + (f". Degrees that can: {', '.join(map(str, expert_degrees(spec, data, t)))}" if spec.is_moe
                           else ""))
    return out


def _expert_layouts(spec: ModelSpec, n: int, t: int, p: int, c: int, way: str, e_forced: int | None,
                    s_forced: str | None, qlora: bool) -> list[dict]:
    """The layouts of `t` tensor, `p` pipeline and `c` context devices: each expert degree and pipeline schedule."""
    out = []
    data = n // (t * p * c)
    experts = [e_forced] if e_forced else expert_degrees(spec, data, t)
    if qlora:  # NF4 weights are sharded by FSDP2 only
        experts = [e for e in experts if e == 1]
    if e_forced and why_not_expert(spec, e_forced, data, t):
        return out
    context = dict(context_parallel=c, context_parallel_way=way)
    if p == 1:
        if not s_forced:
            out += [dict(tensor_parallel=t, pipeline_stages=1, pipeline_schedule="none", stage_layers=(),
                         expert_parallel=e, **context) for e in experts]
        return out
    for schedule in ([s_forced] if s_forced else UNFORCED_SCHEDULES):
        if why_not_pipeline(spec, p, schedule):
            continue
        out += [dict(tensor_parallel=t, pipeline_stages=p, pipeline_schedule=schedule,
                     stage_layers=split_layers(spec, p * stages_per_device(schedule)), expert_parallel=e,
                     **context)
                for e in experts]
    return out


def _check_forced(spec: ModelSpec, n: int, tensor: int | None, stages: int | None, schedule: str | None,
                  qlora: bool) -> None:
    if qlora and ((tensor or 1) > 1 or (stages or 1) > 1):
        raise UserError("QLoRA's NF4 weights are sharded by FSDP2 only: drop plan.tensor_parallel and "
                        "plan.pipeline_stages, or train LoRA (lora.quantize_base=false)")
    for name, value in (("tensor_parallel", tensor), ("pipeline_stages", stages)):
        if value is not None and (value < 1 or n % value):
            raise UserError(f"plan.{name}={value} must divide the flavor's {n} devices")
    if tensor and stages and n % (tensor * stages):
        raise UserError(f"plan.tensor_parallel={tensor} x plan.pipeline_stages={stages} must divide the flavor's "
                        f"{n} devices")
    why = why_not_tensor(spec, tensor) if tensor else None
    if why:
        raise UserError(f"plan.tensor_parallel={tensor} cannot cut this model: {why}. "
                        f"Degrees that can: {', '.join(map(str, tensor_degrees(spec, n)))}")
    if schedule is not None and schedule not in SCHEDULES:
        raise UserError(f"plan.pipeline_schedule={schedule} is not a schedule; valid: {', '.join(SCHEDULES)}")
    if schedule and stages == 1:
        raise UserError(f"plan.pipeline_schedule={schedule} needs plan.pipeline_stages of 2 or more")
    if stages and stages > 1:
        why = why_not_pipeline(spec, stages, schedule or "1f1b")
        if why:
            raise UserError(f"plan.pipeline_stages={stages} cannot cut this model: {why}")


@dataclass(frozen=True)
class DeviceShare:
    """What one pipeline device of a plan holds (without a pipeline: the whole model)."""

    layers: int  # of its stages together
    embedding: bool  # it holds the first stage
    head: bool  # it holds the last stage: final norm, output projection, loss
    in_flight: float  # micro-batches whose activations (of all its layers) it holds at once, at its peak


def device_shares(plan, spec: ModelSpec) -> list[DeviceShare]:
    """One DeviceShare per pipeline device. In flight at the peak: GPipe runs every forward before any backward
    (all micro-batches); 1F1B holds at most P - d on device d (its warm-up forwards); interleaved 1F1B's device d
    warms up with 2(P - d - 1) + (v - 1)P + 1 stage passes of its v stages (torch's schedule), each a 1/v of its
    layers."""
    return list(_shares(plan, spec))


def _shares(plan, spec: ModelSpec) -> tuple[DeviceShare, ...]:
    # Many plans share a pipeline (a search prices tens of thousands of them): computed once for each.
    return _device_shares(spec.num_layers, plan.pipeline_stages, plan.pipeline_schedule, plan.accumulation_steps,
                          plan.stage_layers)


def busiest_share(plan, spec: ModelSpec) -> DeviceShare:
    """The pipeline device with the most work a step, which sets the pace (its layers, and the head on the last)."""
    return _busiest(_shares(plan, spec), stage_costs(spec)[1:])


@functools.lru_cache(maxsize=4096)  # a search asks for each of its plans; a pipeline has up to 64 devices
def _busiest(shares: tuple[DeviceShare, ...], costs: tuple[float, float]) -> DeviceShare:
    layer_cost, head_cost = costs
    return max(shares, key=lambda s: s.layers * layer_cost + s.head * head_cost)


def peak_shares(plan, spec: ModelSpec) -> tuple[DeviceShare, ...]:
    """The pipeline devices whose memory can be the largest: the first (the most micro-batches in flight, the
    embedding), the last (the head and its logits) and the one whose layers hold the most activations, each once;
    the others need no prediction."""
    return _peak_shares(_shares(plan, spec))


@functools.lru_cache(maxsize=4096)
def _peak_shares(shares: tuple[DeviceShare, ...]) -> tuple[DeviceShare, ...]:
    if len(shares) <= 3:
        return shares
    return tuple(dict.fromkeys((shares[0], shares[-1], max(shares, key=lambda s: s.layers * s.in_flight))))


@functools.lru_cache(maxsize=4096)
def _device_shares(num_layers: int, P: int, schedule: str, M: int,
                   stage_layers: tuple[int, ...]) -> tuple[DeviceShare, ...]:
    if P == 1:
        return (DeviceShare(layers=num_layers, embedding=True, head=True, in_flight=1.0),)
    v = stages_per_device(schedule)
    last = len(stage_layers) - 1
    shares = []
    for d in range(P):
        mine = list(range(d, P * v, P))
        if schedule == "gpipe":
            flight = float(M)
        elif schedule == "1f1b":
            flight = float(min(M, P - d))
        else:
            flight = min(v * M, 2 * (P - d - 1) + (v - 1) * P + 1) / v
        shares.append(DeviceShare(layers=sum(stage_layers[s] for s in mine), embedding=0 in mine,
                                  head=last in mine, in_flight=flight))
    return tuple(shares)
