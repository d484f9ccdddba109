"""The planner: enumerate plans, predict each one's peak memory and step time, keep those that fit
the per-device budget, pick the fastest. Forced fields (plan.micro_batch_size=2) are honoured when
they fit and refused with the predicted memory when they do not."""

import heapq
import math
from dataclasses import dataclass, replace

from moai_recipes.config.schema import Recompute
from moai_recipes.errors import UserError
from moai_recipes.flavors import Flavor
from moai_recipes.planner import calibration
from moai_recipes.planner.memory import (
    DTYPE_BYTES,
    HostMemory,
    MemoryBreakdown,
    predict_host_memory,
    predict_memory,
)
from moai_recipes.models.tiled_mlp import mlp_tiles
from moai_recipes.planner.activations import FEWEST_TILES
from moai_recipes.planner.layouts import layouts, why_not_tiled_mlp
from moai_recipes.planner.plan import Plan, Workload
from moai_recipes.planner.rollouts import rollout_bytes
from moai_recipes.planner.flops import ModelFlops
from moai_recipes.planner.timing import TimeEstimate, device_speed, predict_time

GiB = 2**30
SAFETY_MARGIN = 0.10  # of the device memory, kept free
# The CPU's bf16 matmuls (oneDNN) JIT kernels for each row count they have not seen and keep them, 3-7 MB per new
# row count of a weight's forward and backward: SmolLM2-135M's steps of new documents grew its process by about 70 MB
# a step and paid the JIT each step. Rows padded to one of 8 sizes per doubling (Plan.padded_row; at most 1/8 more
# tokens, 3.7% on its 429-token steps): resident memory flat, a step 0.87-0.92 s -> 0.81 s (docs/benchmarks.md).
# MKL's fp32 matmuls and GPUs JIT nothing.
ROW_SIZES_PER_DOUBLING = {("cpu", "bfloat16"): 8}


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    memory: MemoryBreakdown
    time: TimeEstimate
    fits: bool  # on the devices and in the host memory of a node
    host: HostMemory | None = None  # GPU flavors: a node's host memory (the CPU's is its device memory)
    mfu: float = 0.0  # predicted: a mean step's model FLOPs over its predicted time at the devices' peak
    kv_cache: int = 0  # recipes.grpo: bytes of the KV cache a device samples with (planner/rollouts.py)

    def as_dict(self) -> dict:
        host = {"predicted_host_bytes_per_node": self.host.total, "host": self.host.as_dict()} if self.host else {}
        return {**self.plan.as_dict(), "fits": self.fits, "predicted_peak_bytes": self.memory.total,
                "predicted_kv_cache_bytes": self.kv_cache,
                "predicted_step_s": self.time.total_s, "predicted_mfu": self.mfu, "memory": self.memory.as_dict(), "time": self.time.as_dict(),
                **host}


@dataclass(frozen=True)
class PlanChoice:
    flavor: str  # the name of the flavor planned for: 4xLarge.2048GB, cpu-2
    chosen: Candidate
    candidates: list[Candidate]
    budget_bytes: int
    steps: int | None = None  # of the run, when the data is known
    device: str = "cpu"  # the flavor's device: what a run's measurements calibrate (planner/calibration.py)
    reference: str = "none"  # recipes.dpo's reference, as planned (Workload.reference)

    def report(self) -> list[str]:
        fit = sum(c.fits for c in self.candidates)
        c = self.chosen
        return self._long_run() + [f"The number of candidates is {len(self.candidates)}.",
                f"The number of possible candidates is {fit} (predicted peak within {self.budget_bytes / GiB:.3g} GiB "
                f"per device).",
                f"Chosen: the fastest that fits: predicted {c.time.total_s:.3g} s/step (MFU {100 * c.mfu:.0f}%)"
                + (f" after {c.time.once_s:.3g} s once ("
                   + " and ".join(w for w, on in (("compiling", c.plan.compile),
                                                  ("the reference's first pass", self.reference == "cached")) if on)
                   + ")" if c.time.once_s else "")
                + f", peak {c.memory.total / GiB:.3g} GiB per device"]

    def _long_run(self) -> list[str]:
        """A warning, first, when the run is predicted to take more than a day."""
        if not self.steps:
            return []
        seconds = self.chosen.time.run_s(self.steps)
        if seconds <= 86400:
            return []
        return [f"Warning: the plan predicts {seconds / 86400:.1f} days for the run's {self.steps:,} steps "
                f"({self.chosen.time.total_s:,.0f} s a step); a larger flavor or a shorter max_seq_len would shorten it "
                "(recipes.plan compares flavors)"]

    def ranked(self, limit: int) -> list[Candidate]:
        """The `limit` best candidates: the chosen one, then the others that fit, fastest first, then those that do
        not, the closest to fitting first. A large flavor weighs tens of thousands (70B on 48xlarge: 48,641), and all
        of them in plan.json made a file of 128 MB that took 10 s to write; the runners-up are what says why the
        chosen plan won. (The chosen one can be a little slower a step than some: compiling pays once, and rows are
        split over devices only where that is clearly faster; choose_plan.)"""
        others = (c for c in self.candidates if c is not self.chosen)
        return [self.chosen, *heapq.nsmallest(limit - 1, others, key=lambda c: (not c.fits, c.time.total_s if c.fits
                                                                                 else c.memory.total))]

    def as_dict(self, limit: int = 200) -> dict:
        return {"flavor": self.flavor, "device": self.device, "budget_bytes": self.budget_bytes,
                "candidates_considered": len(self.candidates),
                "candidates_fitting": sum(c.fits for c in self.candidates),
                "chosen": self.chosen.as_dict(), "candidates": [c.as_dict() for c in self.ranked(limit)]}


def _options(layout: dict, per_device: int, flavor: Flavor, forced: dict, work: Workload, compute: str) -> list[dict]:
    """The plans of one layout (layouts.layouts): micro-batches, packing, recomputation, and how the data-parallel
    copies hold the model."""
    context = layout["context_parallel"] > 1
    data = flavor.num_devices // (layout["tensor_parallel"] * layout["pipeline_stages"] * layout["context_parallel"])
    cut = layout["tensor_parallel"] > 1 or layout["pipeline_stages"] > 1
    sizes = sorted({min(2**k, per_device) for k in range(0, per_device.bit_length() + 1)} | {per_device})
    recomputes = [r.value for r in Recompute]
    # One copy shards nothing, so resharding is moot there (take what the user forced), except for an uncut copy
    # below its master dtype: resharded, FSDP2 casts it layer by layer; not, the whole model's bf16 copies are held
    # through the step (Plan.sharded, train/mixed_precision.py): faster, and more memory.
    uncast = compute == ("bfloat16" if work.precision == "bf16" else "float32")  # computing in the stored dtype
    cast = not uncast and not cut
    reshards = [True, False] if data > 1 or context or cast else [forced.get("reshard_after_forward", True)]
    # A cut model is FSDP2-sharded over its copies, held on the devices, its loss whole per stage (the vocabulary
    # is cut by tensor parallelism already): replicas, offloading and the chunked loss are for uncut models.
    # Split experts are FSDP2-sharded over what is left of the data-parallel devices, held on them. Context devices
    # shard like data-parallel ones (FSDP2 over data x context): their shards can live on the host as well.
    experts = layout["expert_parallel"] > 1
    offloads = [False, True] if flavor.device.kind == "gpu" and not cut and not experts else [False]
    # Replicas are plain modules: several processes computing in their master dtype (FSDP2 casts to bf16).
    # Context devices compute parts of the same samples' gradients: FSDP2 over data x context sums them.
    replicas = [False, True] if data > 1 and uncast and not cut and not experts and not context \
        else [False]
    chunks = [False] if cut else [False, True]
    # Compiling is predicted to gain nothing on the CPU in fp32 (timing.COMPILED), so it is offered there only when
    # forced (in bf16 it gains, and a run long enough to win back the compile time is compiled); never with NF4 base
    # weights (QLoRA), whose tensor subclass inductor does not compile; and not yet over a cut model (compiled
    # DTensor layers and pipeline stages are untested here), nor transformers' modules (their per-document attention
    # and mixers are Python loops over the documents: untested under dynamo).
    qlora = work.lora is not None and work.lora.quantize_base
    gains = flavor.device.kind == "gpu" or compute == "bfloat16" or forced.get("compile")
    compiles = [False, True] if not qlora and not cut and not context and gains and work.spec.native else [False]
    # A row is cut over context devices as documents laid end to end: packed rows only. A model whose layers would
    # carry one document's state into the next is padded.
    packings = (False,) if work.spec.why_not_packed else (True,) if context else (False, True)
    # Under full recomputation, for rows too long for the rest: the layers' inputs on the host (a GPU's: on the CPU
    # the host is the device, so only where forced) and the MLP in tiles (a dense, uncut one: layouts.why_not_tiled_mlp).
    activation_offloads = [False, True] if flavor.device.kind == "gpu" or forced.get("offload_activations") else [False]
    tileable = not why_not_tiled_mlp(work.spec, layout["tensor_parallel"])
    # AdamW in the backward: where nothing clips the gradients, each device holds its own gradients whole (no
    # pipeline: a stage's micro-batches interleave), and recipes.dpo's step (its own) is not the one run.
    in_backward = [False, True] if not work.clips and work.reference == "none" and layout["pipeline_stages"] == 1 \
        else [False]
    opts = [dict(micro_batch_size=m, packing=p, recompute=r, replicate=d, reshard_after_forward=s, cpu_offload=o,
                 chunked_loss=c, compile=k, offload_activations=a, tiled_mlp=t, optimizer_in_backward=b, **layout)
            for m in sizes for p in packings for r in recomputes for d in replicas
            for s in (reshards[:1] if d else reshards)  # nothing is resharded in a replica
            for o in ([False] if d else offloads) for c in chunks for k in compiles
            for a in (activation_offloads if r == "full" and not k else [False])
            for t in ([0, _tiles(layout, m, p, work)] if r == "full" and tileable and not k else [0])
            for b in (in_backward if not d and not o else [False])]
    # A pipeline of P devices runs at least P micro-batches (1F1B's schedules: at once, padded with empty ones).
    stages = layout["pipeline_stages"]
    pinned = [(k, v) for k, v in forced.items() if v is not None and k in opts[0] and k != "stage_layers"] if opts else []
    return [o for o in opts if all(_as_forced(k, o[k]) == v for k, v in pinned)
            and not _runs_eager(o, flavor) and (stages == 1 or math.ceil(per_device / o["micro_batch_size"]) >= stages)]


def _as_forced(field: str, value):
    """A plan field's value as plan.* forces it: plan.tiled_mlp=true is a count of tiles the planner sets."""
    return bool(value) if field == "tiled_mlp" else value


def _tiles(layout: dict, micro_batch_size: int, packing: bool, work: Workload) -> int:
    """The tiles of a tiled MLP: its device's share of a row, in tiles of about the hidden size (models/tiled_mlp.py)."""
    row = micro_batch_size * work.seq_len if packing else work.seq_len
    return mlp_tiles(row // layout["context_parallel"], work.spec.embed_dim, fewest=FEWEST_TILES)


def _runs_eager(option: dict, flavor: Flavor) -> bool:
    """A compiled plan dynamo would leave eager: on the CPU a packed row's attention runs a document at a time,
    outside the graph (models/attention.py); inside a recomputed layer dynamo cannot break the graph there, so it
    runs the whole layer eagerly (tests/test_compile.py saw 0 graphs captured)."""
    return (option["compile"] and option["packing"] and option["recompute"] != Recompute.none.value
            and flavor.device.kind == "cpu")


def _impossible(forced: dict, flavor: Flavor, work: Workload) -> str:
    """Why no plan has the forced fields on this flavor (the flavor, QLoRA and the CPU's packed attention limit
    them)."""
    if forced.get("compile") and forced.get("packing") and forced.get("recompute", "none") != "none" \
            and flavor.device.kind == "cpu":
        return (f"plan.compile=true with plan.packing=true and plan.recompute={forced['recompute']}: on the CPU a "
                "packed row's attention runs outside the graph, which a recomputed layer cannot leave, so nothing "
                "would be compiled; drop one of the three")
    if forced.get("compile") and not work.spec.native:
        return (f"plan.compile=true: transformers' modules (this {work.spec.family} model) are not compiled here yet; "
                "drop plan.compile")
    if forced.get("compile") and work.lora is not None and work.lora.quantize_base:
        return ("plan.compile=true: QLoRA's NF4 base weights cannot be compiled; drop plan.compile or train LoRA "
                "(lora.quantize_base=false)")
    for name in ("offload_activations", "tiled_mlp"):
        if forced.get(name) and forced.get("recompute", "full") != "full":
            return (f"plan.{name}=true works under full recomputation (what a layer keeps is its input alone), and "
                    f"plan.recompute={forced['recompute']}: force plan.recompute=full or drop one of them")
        if forced.get(name) and forced.get("compile"):
            return f"plan.{name}=true is not compiled (plan.compile=true): drop one of them"
    if forced.get("tiled_mlp"):
        why = why_not_tiled_mlp(work.spec, forced.get("tensor_parallel") or 1)
        if why:
            return f"plan.tiled_mlp=true cannot tile this model's MLP: {why}; drop plan.tiled_mlp"
    if forced.get("optimizer_in_backward"):
        why = ("optimizer.max_grad_norm clips the gradients to their total norm, known only once the last is made, "
               "when the others would be applied already: set optimizer.max_grad_norm=null" if work.clips else
               "recipes.dpo runs its own step: drop it" if work.reference != "none" else
               f"it needs each device's gradients on the device and whole for the step, and the flavor's other plan "
               f"fields ({', '.join(f'plan.{k}={v}' for k, v in forced.items() if k != 'optimizer_in_backward')}) "
               "ask for pipeline stages, replicas or CPU offload: drop them")
        return f"plan.optimizer_in_backward=true: {why}"
    if forced.get("gather_for_generation") is not None:
        others = [f"plan.{k}={v}" for k, v in forced.items() if k != "gather_for_generation"]
        with_them = f"with {', '.join(others)} " if others else ""
        if forced["gather_for_generation"]:
            return ("plan.gather_for_generation=true gathers FSDP2's shards for sampling, and this flavor's plans "
                    f"{with_them}hold a plain module (one process, or replicas), whose weights are whole already: "
                    "drop it")
        return (f"plan.gather_for_generation=false: this flavor's plans {with_them}keep their layers gathered after a "
                "forward (plan.reshard_after_forward=false), through the sampling too: force "
                "plan.reshard_after_forward=true as well, or drop it")
    if forced.get("packing") and work.spec.why_not_packed:
        return (f"plan.packing=true: this {work.spec.family} model's rows hold one document each: "
                f"{work.spec.why_not_packed}; drop plan.packing")
    if forced.get("cpu_offload"):
        return (f"plan.cpu_offload=true: {flavor.name} has no device memory to offload from (it runs on the CPU); "
                "drop plan.cpu_offload or pick a GPU flavor")
    return f"no plan of {flavor.name} has " + ", ".join(f"plan.{k}={v}" for k, v in forced.items())


def choose_reference(work: Workload, flavor: Flavor, *, forced: dict, modes: tuple[str, ...]) -> tuple[PlanChoice, str]:
    """recipes.dpo: a plan for each way of having the reference in `modes` ("copy": a frozen copy run each step;
    "cached": its log-probabilities computed in a first pass), and the way whose run is predicted fastest, first pass
    included (the smaller peak on a tie). A mode whose every plan is too large is passed over, unless all are."""
    found, refused = [], None
    for mode in modes:
        try:
            choice = choose_plan(replace(work, reference=mode), flavor, forced=forced)
        except UserError as e:
            refused = e
            continue
        found.append((choice.chosen.time.run_s(work.steps), choice.chosen.memory.total, mode, choice))
    if not found:
        raise refused
    _, _, mode, choice = min(found, key=lambda f: f[:3])
    return choice, mode


def choose_plan(work: Workload, flavor: Flavor, forced=None) -> PlanChoice:
    """Plan `work` on `flavor`, honouring the `forced` plan fields (plan.* overrides; None: the planner
    decides); a UserError when nothing fits, naming a flavor or the settings that would."""
    forced = {k: v for k, v in dict(forced or {}).items() if v is not None}
    sampling = [k for k in ("generation_batch", "gather_for_generation") if k in forced]
    if sampling and work.rollout is None:
        raise UserError(f"{', '.join(f'plan.{k}' for k in sampling)}: how recipes.grpo samples its completions, and "
                        "this recipe samples none; drop it")
    candidates, budget = _candidates(work, flavor, forced)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        what = ("with " + ", ".join(f"plan.{k}={v}" for k, v in forced.items())) if forced else "with any plan"
        on_devices = [c for c in candidates if c.memory.total <= budget]
        if on_devices:  # the devices would hold it; the host memory of a node does not
            least = min(on_devices, key=lambda c: c.host.total)
            raise UserError(
                f"nothing fits {flavor.name} {what}: the plans that fit its devices need at least "
                f"{least.host.total / GiB:,.0f} GiB of host memory per node ({_host_parts(least)}), and a node of "
                f"{flavor.device.name} has {flavor.host_memory_gb:,.0f} GiB (budget {flavor.host_memory_gb * (1 - SAFETY_MARGIN):,.0f} "
                f"GiB). {_what_would_fit(work, flavor, forced)}")
        smallest = min(candidates, key=lambda c: c.memory.total)
        raise UserError(f"nothing fits {flavor.name} {what}: the smallest plan needs {smallest.memory.total / GiB:,.1f} GiB "
                        f"per device (budget {budget / GiB:.3g} GiB = {flavor.device_memory_gb:.4g} GiB less "
                        f"{SAFETY_MARGIN:.0%}). {_what_would_fit(work, flavor, forced)}")
    # The fastest run: compiling pays once for faster steps, so it is chosen only where the run is long enough.
    fastest = lambda plans: min(plans, key=lambda c: (round(c.time.run_s(work.steps), 6), c.memory.total))  # noqa: E731
    chosen = fastest(fitting)
    whole = [c for c in fitting if c.plan.context_parallel == 1]
    if chosen.plan.context_parallel > 1 and whole and "context_parallel" not in forced:
        # Splitting rows is chosen over keeping them whole only where it is clearly faster: its exchanges are
        # estimates, not yet measured on GPUs (a few percent can come from dividing a batch more evenly).
        kept = fastest(whole)
        if chosen.time.run_s(work.steps) > (1 - CONTEXT_MARGIN) * kept.time.run_s(work.steps):
            chosen = kept
    return PlanChoice(flavor=flavor.name, chosen=chosen, candidates=candidates, budget_bytes=budget, steps=work.steps,
                      device=flavor.device.name, reference=work.reference)


# A row split over context devices into shares of fewer tokens than this is a last resort, priced only where no other
# plan fits: a device's matmuls on a few hundred tokens run far below their peak (timing.EFFICIENCY), the exchanges
# of keys, values or heads come every layer whatever the share, and a short row's activations are what full
# recomputation and its offload hold cheaply. Large flavors offer hundreds of such layouts (70B on 48xlarge at 4,096
# tokens: 18,790 of its 48,640 plans, split 12 to 384 ways). At 1,024 tokens the rule changed a choice: Qwen3-235B-A22B
# on 48xlarge (4,096-token rows) splits them 8 ways, 512 tokens a device, predicted 4% faster than what is left. At
# 512, none of fourteen searches checked (dense, MoE, transformers' modules, LoRA, the CPU, DPO, GRPO, 8 to 384
# devices; docs/planner.md) chose differently, nor did the suite's.
MIN_CONTEXT_TOKENS = 512
# How much faster a plan that splits rows over context devices must be predicted than the fastest that keeps them
# whole, to be chosen over it (choose_plan).
CONTEXT_MARGIN = 0.05
LONGEST_LIMIT = 1 << 22  # 4M tokens: past any model's context; the search stops there


def longest_row(work: Workload, flavor: Flavor, forced=None) -> tuple[int, PlanChoice] | None:
    """The longest samples (a multiple of 1,024 tokens, every sample of `work`'s global batch that long) a plan of
    `flavor` trains, and that plan; None when not even 1,024 tokens fit. Doubling, then halving the interval: a
    longer row never needs less memory, so what fits is a prefix of the lengths."""
    forced = {k: v for k, v in dict(forced or {}).items() if v is not None}

    def plan(tokens: int) -> PlanChoice | None:
        at = replace(work, seq_len=tokens, lengths=None)
        if not _fits(at, flavor, forced):  # not choose_plan's refusal: its hints price other methods
            return None
        return choose_plan(at, flavor, forced=forced)

    best, tokens = None, 1024
    while tokens <= LONGEST_LIMIT and (choice := plan(tokens)) is not None:
        best, tokens = (tokens, choice), tokens * 2
    if best is None:
        return None
    low, high = best[0], tokens  # low fits, high does not (or is past the limit)
    while high - low > 1024 and high <= LONGEST_LIMIT:
        middle = (low + high) // 2 // 1024 * 1024
        choice = plan(middle)
        if choice is None:
            high = middle
        else:
            low, best = middle, (middle, choice)
    return best


def stored_dtypes(work: Workload, flavor: Flavor) -> tuple[str, str, str]:
    """(compute, trained weights and their gradients, AdamW's moments) as the user's dtype, precision and
    optimizer.states ask: numerics are the user's, never the planner's to change. A frozen weight is stored in the
    compute dtype (train/mixed_precision.py)."""
    bf16 = work.precision == "bf16"
    if bf16 and work.dtype == "fp32":
        raise UserError("precision=bf16 stores the weights in bf16 and computes in bf16: drop dtype=fp32, or keep "
                        "precision=mixed (fp32 master weights) with dtype=bf16")
    gpu = flavor.device.kind == "gpu"
    compute = "bfloat16" if (work.dtype == "bf16" or bf16 or (work.dtype == "auto" and gpu)) else "float32"
    master = "bfloat16" if bf16 else "float32"
    states = {"auto": master, "fp32": "float32", "bf16": "bfloat16", "int8": "int8"}[work.states]
    if states == "int8" and bf16:
        # Measured: torchao 0.14.1's 8-bit moments of FSDP2-sharded bf16 weights do not load back from a step
        # checkpoint (their step fails on the loaded state's dtype); over fp32 master weights they do.
        raise UserError("optimizer.states=int8 goes with precision=mixed (fp32 master weights): with precision=bf16 "
                        "use optimizer.states=auto (bf16 moments)")
    if states != "int8" and states != master:  # torch's AdamW keeps the moments in the weights' dtype
        raise UserError(f"optimizer.states={work.states} keeps AdamW's moments in the trained weights' dtype, which "
                        f"precision={work.precision} stores in {master}: use optimizer.states=auto or int8"
                        + (", or precision=bf16" if states == "bfloat16" else ""))
    return compute, master, states


def _candidates(work: Workload, flavor: Flavor, forced: dict, *, until_fit: bool = False) -> tuple[list[Candidate], int]:
    """Every plan the forced fields allow, with its predictions; a UserError if they allow none. `until_fit`: stop
    at the first that fits (whether any fits is all the caller asks)."""
    n = flavor.num_devices
    compute, _, _ = stored_dtypes(work, flavor)
    # Each layout's copies of the model split the global batch: its options, with the sequences a copy gets.
    options, fewest, last_resort = [], None, []
    for layout in layouts(work, flavor, forced):
        copies = n // (layout["tensor_parallel"] * layout["pipeline_stages"] * layout["context_parallel"])
        per_device = Plan.device_share(work.batch_size, copies)
        fewest = copies if fewest is None else min(fewest, copies)
        if forced.get("micro_batch_size", 0) <= per_device:
            context = layout["context_parallel"]
            short = context > 1 and work.seq_len < MIN_CONTEXT_TOKENS * context and not forced.get("context_parallel")
            if short:
                last_resort.append((layout, per_device))
            else:
                options += [(o, per_device) for o in _options(layout, per_device, flavor, forced, work, compute)]
    if not options and not last_resort and fewest and \
            forced.get("micro_batch_size", 0) > Plan.device_share(work.batch_size, fewest):
        most = Plan.device_share(work.batch_size, fewest)
        raise UserError(f"plan.micro_batch_size={forced['micro_batch_size']} is larger than the batch per copy of the "
                        f"model ({most} = batch_size {work.batch_size} over {fewest} "
                        f"{'copies' if fewest > 1 else 'copy'}); use at most {most}")
    if not options and not last_resort:
        raise UserError(_impossible(forced, flavor, work))
    candidates = _priced(options, work, flavor, forced, until_fit=until_fit)
    if last_resort and not any(c.fits for c in candidates):
        last_resort = [(o, per_device) for layout, per_device in last_resort
                       for o in _options(layout, per_device, flavor, forced, work, compute)]
        candidates += _priced(last_resort, work, flavor, forced, until_fit=until_fit)
    if not candidates:
        raise UserError(_impossible(forced, flavor, work))
    return candidates, _device_budget(flavor)


def _device_budget(flavor: Flavor) -> int:
    """Bytes a plan may peak at on one device: its memory less SAFETY_MARGIN."""
    return int(flavor.device_memory_gb * GiB * (1 - SAFETY_MARGIN))


def _priced(options: list[tuple[dict, int]], work: Workload, flavor: Flavor, forced: dict, *,
            until_fit: bool) -> list[Candidate]:
    """The plans of `options` (each with the sequences a copy of the model gets), with their predictions."""
    n = flavor.num_devices
    compute, master, states = stored_dtypes(work, flavor)
    budget = _device_budget(flavor)
    host_budget = int(flavor.host_memory_gb * GiB * (1 - SAFETY_MARGIN))
    candidates, scales = [], calibration.scales(flavor.device.name)
    flops, (peak, _) = ModelFlops.of(work.spec, work.lora), device_speed(flavor.device, compute_dtype=compute, num_devices=n)
    lengths = work.lengths or (work.seq_len,)
    tokens, pairs = (work.batch_size / len(lengths) * sum(f(k) for k in lengths)
                     for f in (lambda k: k, lambda k: k * (k + 1) // 2))  # a mean step's
    whole_mlp = {}  # each option's twin with its MLP whole, already priced (it comes first)
    attention_length, row_sizes = work.spec.attention_length, ROW_SIZES_PER_DOUBLING.get((flavor.device.kind, compute), 0)
    for o, per_device in options:
        if o["tiled_mlp"] and not _tiling_can_help(whole_mlp.get(_twin(o)), forced, budget, work):
            continue
        accumulation = math.ceil(per_device / o["micro_batch_size"])
        if o["optimizer_in_backward"] and accumulation > 1 and not forced.get("optimizer_in_backward"):
            continue  # earlier micro-batches' gradients are held as without it: nothing saved
        plan = Plan(batch_size=work.batch_size, num_devices=n, max_seq_len=work.seq_len,
                    accumulation_steps=accumulation,
                    param_dtype=compute, master_dtype=master, optimizer_states=states,
                    attention_length=attention_length, row_sizes=row_sizes, **o)
        traced = scales.get(calibration.MEMORY, 1.0)
        if work.rollout is not None:
            sampled = _generation_batch(plan, work, flavor, budget, forced, scales)
            if sampled is None:  # the forced plan.gather_for_generation does not apply to this plan
                continue
            plan, memory = sampled
        else:
            memory = predict_memory(plan, work, flavor.device.kind, traced_scale=traced)
        time = predict_time(plan, work, flavor.device, scales=scales)
        host = predict_host_memory(plan, work, flavor.processes_per_node) if flavor.device.kind == "gpu" else None
        fits = memory.total <= budget and (host is None or host.total <= host_budget)
        mfu, _ = flops.of_totals(tokens, pairs, recompute=plan.recompute).utilisation(
            time.total_s, peak, n)
        kv = rollout_bytes(plan, work)[0] if plan.generation_batch else 0
        candidates.append(Candidate(plan=plan, memory=memory, time=time, fits=fits, host=host, mfu=mfu, kv_cache=kv))
        if not o["tiled_mlp"] and o["recompute"] == Recompute.full.value:  # the MLP is tiled under full recomputation
            whole_mlp[_twin(o)] = candidates[-1]
        if until_fit and fits:
            break
    return candidates


def _generation_batch(plan: Plan, work: Workload, flavor: Flavor, budget: int, forced: dict,
                      scales: dict) -> tuple[Plan, MemoryBreakdown] | None:
    """recipes.grpo: how the plan samples, the fastest way that fits beside its training: how many completions at
    once (a power of two up to a device's completions: fewer chunks, each decode step reading the weights once for
    all its rows, against a larger KV cache) and, on FSDP2 shards, whether each layer is gathered once for the
    round's sampling or again at every decode step (the whole model held in the compute dtype while sampling, against
    a gather of every layer per token generated). The forced ones (plan.generation_batch,
    plan.gather_for_generation); where nothing fits, the smallest; None where the forced gathering does not apply to
    `plan`. With its predicted memory (`scales`: the machine's calibration)."""
    most, traced = plan.batch_per_device, scales.get(calibration.MEMORY, 1.0)
    if forced.get("generation_batch"):
        sizes = [min(forced["generation_batch"], most)]
    else:
        sizes = sorted({min(2**k, most) for k in range(most.bit_length() + 1)}, reverse=True)
    gathers = [g for g in _generation_gathers(plan) if forced.get("gather_for_generation") in (None, g)]
    if not gathers:
        return None
    fitting, smallest = [], None
    for size in sizes:
        for gather in gathers:
            candidate = replace(plan, generation_batch=size, gather_for_generation=gather)
            memory = predict_memory(candidate, work, flavor.device.kind, traced_scale=traced)
            if memory.total <= budget:
                fitting.append((candidate, memory))
            elif smallest is None or memory.total < smallest[1].total:
                smallest = (candidate, memory)
    if not fitting:
        return smallest
    if len(fitting) == 1:
        return fitting[0]
    return min(fitting, key=lambda f: (predict_time(f[0], work, flavor.device, scales=scales).total_s, f[1].total))


def _generation_gathers(plan: Plan) -> list[bool]:
    """What plan.gather_for_generation can be for `plan`: a plain module (one fp32 process, replicas) holds its weights
    whole, nothing to gather; FSDP2 layers that stay gathered after their forward (reshard_after_forward=false) keep
    them through the round's sampling anyway (no backward reshards them); only resharding layers have the choice."""
    if not plan.sharded:
        return [False]
    return [True, False] if plan.reshard_after_forward else [True]


def _twin(option: dict) -> tuple:
    return tuple((k, v) for k, v in option.items() if k != "tiled_mlp")


# What a tiled MLP saves at most, in tensors of a device's row tokens x the intermediate size: SwiGLU's backward
# holds three (traced: 3.2 at SmolLM2-135M's widths, 3.8 at Llama-3-8B's, 16K tokens).
TILED_SAVES_AT_MOST = 5


def _tiling_can_help(whole: Candidate | None, forced: dict, budget: int, work: Workload) -> bool:
    """Whether a tiled MLP's plan is worth pricing (its layer traces take a second a row length): only where its
    twin with the MLP whole does not fit (tiling is slower: the MLP's forward once more) and would with the most
    tiling can save; always where forced."""
    if forced.get("tiled_mlp") or whole is None:
        return True
    if whole.fits:
        return False
    plan = whole.plan
    tokens = plan.micro_batch_size * plan.max_seq_len / plan.context_parallel
    saved = TILED_SAVES_AT_MOST * tokens * work.spec.intermediate_dim * DTYPE_BYTES[plan.param_dtype]
    return whole.memory.total - saved * 1.2 <= budget


def _host_parts(c: Candidate) -> str:
    h = c.host
    parts = [f"{h.processes} process(es) x ({h.runtime / GiB:.0f} GiB runtime"]
    if h.offloaded:
        parts.append(f" + {h.offloaded / GiB:,.0f} GiB offloaded weights, gradients and AdamW state")
    if h.activations:
        parts.append(f" + {h.activations / GiB:,.0f} GiB offloaded activations")
    parts.append(f" + {h.loading / GiB:.1f} GiB for the largest weight) + {h.export_file / GiB:.1f} GiB for one file "
                 "of the export")
    return "".join(parts)


def _what_would_fit(work: Workload, flavor: Flavor, forced: dict) -> str:
    from moai_recipes.config.shipped_flavors import catalog

    hints = []
    if forced and _fits(work, flavor, {}):
        hints.append("Let the planner choose (drop the plan.* overrides).")
    if flavor.device.kind == "gpu":
        for option in catalog():  # by total memory, smallest first
            if option.flavor.device.kind == "cpu":
                continue
            other = option.on(flavor.device.name)
            if other.total_memory_gb > flavor.total_memory_gb and _fits(work, other, forced):
                hints.append(f"The smallest flavor that fits is {option.option} ({other.name} on {flavor.device.name}): "
                             f"flavor={option.option}.")
                break
    precision = _precision_that_fits(work, flavor, forced)
    if precision:
        hints.append(precision)
    if work.lora is None:
        fits = _adapters_that_fit(work, flavor, forced)
        if fits:
            hints.append(fits)
    if not hints:
        hints.append(f"Try a shorter max_seq_len (now {work.seq_len}), LoRA (recipes.lora_finetune), or a larger "
                     "flavor.device_memory_gb.")
    return " ".join(hints)


def _precision_that_fits(work: Workload, flavor: Flavor, forced: dict) -> str | None:
    """Which leaner storage fits where the user's does not: int8 AdamW moments, or bf16 weights, gradients and moments.
    Named, never chosen: numerics are the user's (stored_dtypes)."""
    from dataclasses import replace

    leaner = []
    if work.precision == "mixed" and work.states in ("auto", "fp32"):
        leaner.append((replace(work, states="int8"), "optimizer.states=int8 (8-bit AdamW moments)"))
    if work.precision == "mixed" and work.dtype != "fp32" and work.states != "int8":
        leaner.append((replace(work, precision="bf16", states="auto"),
                       "precision=bf16 (weights, gradients and AdamW moments in bf16, as torchtune keeps them)"))
    for lean, how in leaner:
        if _fits(lean, flavor, forced):
            return f"With {how} it fits."
    return None


def _adapters_that_fit(work: Workload, flavor: Flavor, forced: dict) -> str | None:
    """Which of LoRA or QLoRA (the lora recipe's default adapters) fits where full fine-tuning does not."""
    from dataclasses import asdict, replace

    from moai_recipes.config.schema import LoraConfig
    from moai_recipes.models.lora import lora_options

    for quantize, how in ((False, "LoRA fits: python -m recipes.lora_finetune"),
                          (True, "QLoRA fits: python -m recipes.lora_finetune lora.quantize_base=true")):
        try:
            lora = lora_options({**asdict(LoraConfig()), "quantize_base": quantize}, spec=work.spec,
                                world_size=flavor.num_devices)
        except UserError:  # QLoRA's NF4 blocks do not divide this model's weights
            continue
        if _fits(replace(work, lora=lora), flavor, forced):
            return f"{how} (with the same flavor and batch)."
    return None


def _fits(work: Workload, flavor: Flavor, forced: dict) -> bool:
    try:
        return any(c.fits for c in _candidates(work, flavor, forced, until_fit=True)[0])
    except UserError:  # the forced fields allow no plan there
        return False
