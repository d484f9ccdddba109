"""The planner: enumerate plans, predict each one's peak memory and step time, keep those that fit
the per-device budget, pick the fastest. Forced fields (plan.micro_batch_size=2) are honoured when
they fit and refused with the predicted memory when they do not."""

import math
from dataclasses import dataclass

from omegaconf import OmegaConf

from moai_recipes.errors import UserError
from moai_recipes.flavors import Flavor, resolve_flavor
from moai_recipes.models.spec import ModelSpec
from moai_recipes.planner.memory import MemoryBreakdown, model_sizes, predict_memory
from moai_recipes.planner.plan import Plan
from moai_recipes.planner.timing import TimeEstimate, predict_time

GiB = 2**30
SAFETY_MARGIN = 0.10  # of the device memory, kept free
FIXED_OVERHEAD = {"gpu": 1.0 * GiB, "cpu": 0}  # CUDA/ROCm context and communication buffers
SLACK = {"gpu": 0.08, "cpu": 0.05}  # allocator fragmentation, as a share of what is allocated
# Bytes of temporaries per trainable value in the optimizer step: training.build_optimizer takes fused
# AdamW on GPUs (none) and foreach AdamW on the CPU (one fp32 copy of the moments' update).
OPTIMIZER_TEMPORARY = {"gpu": 0, "cpu": 4}


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    memory: MemoryBreakdown
    time: TimeEstimate
    fits: bool

    def as_dict(self) -> dict:
        return {**self.plan.as_dict(), "fits": self.fits, "predicted_peak_bytes": self.memory.total,
                "predicted_step_s": self.time.total_s, "memory": self.memory.as_dict(), "time": self.time.as_dict()}


@dataclass(frozen=True)
class PlanChoice:
    chosen: Candidate
    candidates: list[Candidate]
    budget_bytes: int

    def report(self) -> list[str]:
        fit = sum(c.fits for c in self.candidates)
        c = self.chosen
        return [f"The number of candidates is {len(self.candidates)}.",
                f"The number of possible candidates is {fit} (predicted peak within {self.budget_bytes / GiB:.3g} GiB "
                f"per device).",
                f"Chosen: the fastest that fits: predicted {c.time.total_s:.3g} s/step, peak "
                f"{c.memory.total / GiB:.3g} GiB per device"]

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "chosen": self.chosen.as_dict(),
                "candidates": [c.as_dict() for c in self.candidates]}


def _options(n: int, per_device: int, flavor: Flavor, forced: dict) -> list[dict]:
    sizes = sorted({min(2**k, per_device) for k in range(0, per_device.bit_length() + 1)} | {per_device})
    recomputes = ["none", "selective", "full"]
    # One device shards nothing, so resharding is moot there: take what the user forced.
    reshards = [True, False] if n > 1 else [forced.get("reshard_after_forward", True)]
    offloads = [False, True] if flavor.device.kind == "gpu" else [False]
    opts = [dict(micro_batch_size=m, recompute=r, reshard_after_forward=s, cpu_offload=o, chunked_loss=c)
            for m in sizes for r in recomputes for s in reshards for o in offloads for c in (False, True)]
    return [o for o in opts if all(forced.get(k) is None or o[k] == forced[k] for k in o)]


def _impossible(forced: dict, flavor: Flavor) -> str:
    """Why no plan has the forced fields on this flavor (only the flavor limits them)."""
    if forced.get("cpu_offload"):
        return (f"plan.cpu_offload=true: {flavor.name} has no device memory to offload from (it runs on the CPU); "
                "drop plan.cpu_offload or pick a GPU flavor")
    return f"no plan of {flavor.name} has " + ", ".join(f"plan.{k}={v}" for k, v in forced.items())


def choose_plan(*, spec: ModelSpec, flavor: Flavor, batch_size: int, seq_len: int, dtype: str,
                forced: dict | None = None, lora=None) -> PlanChoice:
    """Plan a run; a UserError when nothing fits, naming a flavor or the settings that would."""
    forced = {k: v for k, v in (forced or {}).items() if v is not None}
    candidates, budget = _candidates(spec, flavor, batch_size, seq_len, dtype, forced, lora)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.memory.total)
        what = ("with " + ", ".join(f"plan.{k}={v}" for k, v in forced.items())) if forced else "with any plan"
        raise UserError(f"nothing fits {flavor.name} {what}: the smallest plan needs {smallest.memory.total / GiB:,.1f} GiB "
                        f"per device (budget {budget / GiB:.3g} GiB = {flavor.device_memory_gb:.4g} GiB less "
                        f"{SAFETY_MARGIN:.0%}). {_what_would_fit(spec, flavor, batch_size, seq_len, dtype, forced, lora)}")
    chosen = min(fitting, key=lambda c: (round(c.time.total_s, 6), c.memory.total))
    return PlanChoice(chosen=chosen, candidates=candidates, budget_bytes=budget)


def _candidates(spec: ModelSpec, flavor: Flavor, batch_size: int, seq_len: int, dtype: str, forced: dict,
                lora) -> tuple[list[Candidate], int]:
    """Every plan the forced fields allow, with its predictions; a UserError if they allow none."""
    n = flavor.num_devices
    per_device = math.ceil(batch_size / n)
    if forced.get("micro_batch_size", 0) > per_device:
        raise UserError(f"plan.micro_batch_size={forced['micro_batch_size']} is larger than the batch per device "
                        f"({per_device} = batch_size {batch_size} over {n} devices); use at most {per_device}")
    compute = "bfloat16" if (dtype == "bf16" or (dtype == "auto" and flavor.device.kind == "gpu")) else "float32"
    lora_key = tuple(sorted(lora.builder_kwargs().items(), key=lambda kv: kv[0])) if lora else None
    lora_key = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in lora_key) if lora_key else None
    sizes = model_sizes(spec, lora)
    budget = int(flavor.device_memory_gb * GiB * (1 - SAFETY_MARGIN))
    kind = flavor.device.kind
    options = _options(n, per_device, flavor, forced)
    if not options:
        raise UserError(_impossible(forced, flavor))
    candidates = []
    for o in options:
        accumulation = math.ceil(per_device / o["micro_batch_size"])
        plan = Plan(batch_size=batch_size, num_devices=n, accumulation_steps=accumulation, param_dtype=compute,
                    master_dtype="float32", **o)
        memory = predict_memory(spec, sizes, num_devices=n, micro_batch_size=o["micro_batch_size"], seq_len=seq_len,
                                recompute=o["recompute"], reshard_after_forward=o["reshard_after_forward"],
                                cpu_offload=o["cpu_offload"], chunked_loss=o["chunked_loss"], compute_dtype=compute,
                                fixed_overhead=FIXED_OVERHEAD[kind], slack=SLACK[kind],
                                optimizer_temporary=OPTIMIZER_TEMPORARY[kind], lora=lora_key,
                                accumulation_steps=accumulation)
        time = predict_time(spec, sizes, flavor.device, num_devices=n, batch_size=batch_size, accumulation_steps=accumulation,
                            seq_len=seq_len, compute_dtype=compute, lora=lora_key, **o)
        candidates.append(Candidate(plan=plan, memory=memory, time=time, fits=memory.total <= budget))
    return candidates, budget


def _what_would_fit(spec, flavor: Flavor, batch_size, seq_len, dtype, forced, lora) -> str:
    from moai_recipes.config.compose import CONFIG_DIR

    hints = []
    if forced and _fits(spec, flavor, batch_size, seq_len, dtype, {}, lora):
        hints.append("Let the planner choose (drop the plan.* overrides).")
    if flavor.device.kind == "gpu":
        options = []
        for path in CONFIG_DIR.joinpath("flavor").glob("*.yaml"):
            f = OmegaConf.to_container(OmegaConf.load(path))
            if f["device"] != "cpu" and f["memory_gb"]:
                options.append((f["memory_gb"], path.stem, f))
        for _, name, f in sorted(options):
            other = resolve_flavor(**{**f, "device": flavor.device.name})
            if other.total_memory_gb > flavor.total_memory_gb and _fits(spec, other, batch_size, seq_len, dtype, forced,
                                                                        lora):
                hints.append(f"The smallest flavor that fits is {name} ({other.name} on {flavor.device.name}): "
                             f"flavor={name}.")
                break
    if not hints:
        hints.append(f"Try a shorter max_seq_len (now {seq_len}), LoRA (recipes.lora_finetune), or a larger "
                     "flavor.device_memory_gb.")
    return " ".join(hints)


def _fits(spec, flavor, batch_size, seq_len, dtype, forced, lora) -> bool:
    try:
        return any(c.fits for c in _candidates(spec, flavor, batch_size, seq_len, dtype, forced, lora)[0])
    except UserError:  # the forced fields allow no plan there
        return False
