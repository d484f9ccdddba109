"""LoRA: which modules get adapters, their deterministic initialisation, and export as a PEFT adapter.

The adapters are torchtune's LoRALinear modules, placed by models.build_model; this module
freezes the base, initialises the adapters the same way on every flavor, and writes what `peft`
loads: adapter_config.json and adapter_model.safetensors with PEFT's tensor names.
"""

import json
import math
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from moai_recipes.errors import UserError
from moai_recipes.files import Writes, disk_full
from moai_recipes.models.build import nf4_weights
from moai_recipes.models.hf_format import (
    copy_full_into,
    whole_model,
    whole_parameter,
    hf_name,
)
from moai_recipes.models.spec import ModelSpec

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")
# torchao's to_nf4 defaults (torchtune's QLoRA builders use them): one scale per 64 values, and those
# scales quantized again 256 at a time, so an NF4 weight (and each FSDP shard of it) holds whole blocks
# of 64 * 256 values.
NF4_BLOCK = 64 * 256
# torchtune module name -> the Hugging Face module name PEFT targets
_PEFT_TARGETS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj",
                 "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj", "output": "lm_head"}


@dataclass(frozen=True)
class LoraOptions:
    attn_modules: tuple[str, ...]
    apply_to_mlp: bool
    apply_to_output: bool
    rank: int
    alpha: float
    dropout: float
    quantize_base: bool
    apply_to_experts: bool = False  # every expert's projections of a Mixture-of-Experts model (models/moe.py)
    # transformers' modules: the linear modules adapted by their own names (PEFT's target_modules; "all-linear"),
    # instead of attn_modules and apply_to_mlp; under QLoRA the linear weights NF4 cannot hold (lora_options)
    target_modules: tuple[str, ...] | None = None
    unquantized: tuple[str, ...] = ()
    # An image-text model's vision tower and projector: frozen, adapted ("lora") or trained whole ("full": these
    # modules, PEFT's modules_to_save).
    vision: str = "frozen"
    projector: str = "frozen"
    trained_whole: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def builder_kwargs(self) -> dict:
        """The adapters' keyword arguments of torchtune's lora_* model builders (build_model takes
        quantize_base on its own: the planner traces the layer's activations in full precision)."""
        return dict(lora_attn_modules=list(self.attn_modules), apply_lora_to_mlp=self.apply_to_mlp,
                    apply_lora_to_output=self.apply_to_output, lora_rank=self.rank, lora_alpha=self.alpha,
                    lora_dropout=self.dropout, apply_lora_to_experts=self.apply_to_experts,
                    **({"target_modules": list(self.target_modules)} if self.target_modules is not None else {}),
                    **({"unquantized": list(self.unquantized)} if self.unquantized else {}),
                    **({"vision": self.vision} if self.vision != "frozen" else {}),
                    **({"projector": self.projector} if self.projector != "frozen" else {}),
                    **({"trained_whole": list(self.trained_whole)} if self.trained_whole else {}))

    @classmethod
    def from_builder_kwargs(cls, kwargs: Mapping) -> "LoraOptions":
        targets = kwargs.get("target_modules")
        return cls(tuple(kwargs["lora_attn_modules"]), kwargs["apply_lora_to_mlp"], kwargs["apply_lora_to_output"],
                   kwargs["lora_rank"], kwargs["lora_alpha"], kwargs["lora_dropout"], False,
                   kwargs.get("apply_lora_to_experts", False), None if targets is None else tuple(targets),
                   tuple(kwargs.get("unquantized", ())), kwargs.get("vision", "frozen"),
                   kwargs.get("projector", "frozen"), tuple(kwargs.get("trained_whole", ())))


def lora_options(settings: Mapping, *, spec: ModelSpec, world_size: int = 1) -> LoraOptions:
    """The user's LoRA settings (the `lora` config group: attn_modules, apply_to_mlp, apply_to_output, rank,
    alpha, dropout, quantize_base), validated against the model (and, for QLoRA, the number of processes)."""
    s = settings
    apply_to_mlp, apply_to_output, quantize_base = s["apply_to_mlp"], s["apply_to_output"], s["quantize_base"]
    rank, alpha, dropout = s["rank"], s["alpha"], s["dropout"]
    apply_to_experts = bool(s.get("apply_to_experts", False))
    modules = tuple(s["attn_modules"])
    targets = s.get("target_modules")
    if targets is not None:
        targets = tuple(targets)
        if spec.native:  # PEFT's names, translated to our layers' (all of the MLP or none of it)
            modules, apply_to_mlp = _native_targets(targets)
            targets = None
        else:
            from moai_recipes.models.transformers_model import linear_names

            known = linear_names(spec)
            unknown = [t for t in targets if t not in known and t != "all-linear"]
            if unknown or not targets:
                raise UserError(f"lora.target_modules: {', '.join(unknown) or 'an empty list'} names no linear module "
                                f"of this {spec.family} model's layers; its linear modules are {', '.join(known)}, or "
                                "[all-linear]")
    bad = [m for m in modules if m not in ATTN_MODULES]
    if bad:
        raise UserError(f"lora.attn_modules: {', '.join(bad)} is not an attention module; valid: {', '.join(ATTN_MODULES)}")
    # An image-text model's vision tower and projector: frozen, lora or full each.
    parts = {part: str(s.get(part, "frozen")) for part in ("vision", "projector")}
    if not modules and not apply_to_mlp and not apply_to_output and not apply_to_experts and not targets \
            and set(parts.values()) == {"frozen"}:
        raise UserError("LoRA needs at least one target: set lora.attn_modules=[q_proj,v_proj] or lora.apply_to_mlp=true")
    if apply_to_experts and not spec.is_moe:
        raise UserError(f"lora.apply_to_experts=true adapts a Mixture-of-Experts model's experts, and this "
                        f"{spec.family} model has none; use lora.apply_to_mlp=true for its MLP")
    if apply_to_experts and not spec.native and not spec.parts.experts_dispatchable:
        raise UserError(f"lora.apply_to_experts=true: this {spec.family} model's experts are not held as transformers' "
                        "experts interface holds them (stacked weights), which the adapters are made for; adapt its "
                        "attention and shared MLP (lora.target_modules) instead")
    if apply_to_experts and dropout:
        raise UserError(f"lora.apply_to_experts=true with lora.dropout={dropout}: PEFT loads adapters of the experts' "
                        "stacked weights only without dropout (its ParamWrapper); set lora.dropout=0")
    if rank < 1:
        raise UserError(f"lora.rank={rank} must be at least 1")
    if alpha <= 0:
        raise UserError(f"lora.alpha={alpha} must be positive")
    if not 0 <= dropout < 1:
        raise UserError(f"lora.dropout={dropout} must be in [0, 1)")
    if apply_to_output and spec.tie_word_embeddings:
        raise UserError("lora.apply_to_output=true is not possible for a model whose output shares the embedding "
                        "weights (tie_word_embeddings); leave it false")
    for key, value in parts.items():
        if value not in ("frozen", "lora", "full"):
            raise UserError(f"lora.{key}={value}: use frozen, lora or full")
        if value != "frozen" and not spec.reads_images:
            raise UserError(f"lora.{key}={value}: this {spec.family} model reads no images (it has no vision tower "
                            "or projector); leave it frozen")
    whole = ()
    if "full" in parts.values():
        from moai_recipes.models.transformers_model import image_modules

        whole = tuple(m for part, value in parts.items() if value == "full" for m in image_modules(spec, part))
    opts = LoraOptions(modules, apply_to_mlp, apply_to_output, rank, float(alpha), float(dropout), quantize_base,
                       apply_to_experts, targets, vision=parts["vision"], projector=parts["projector"],
                       trained_whole=whole)
    if quantize_base and spec.native:
        _check_nf4(spec, opts, world_size)
    if quantize_base and not spec.native:
        opts = replace(opts, unquantized=_unquantized(spec, world_size))
    return opts


def _unquantized(spec: ModelSpec, world_size: int) -> tuple[str, ...]:
    """transformers' modules under QLoRA: the linear weights of the layers that NF4 cannot hold (fewer values than
    whole blocks of NF4_BLOCK, or a process's share of their rows not whole blocks), kept in the compute dtype, frozen
    (bitsandbytes-style QLoRA quantizes every linear; torchao's NF4 needs whole blocks). Most models' are their
    small projections (a linear attention's gates, a router), the rest in NF4."""
    from moai_recipes.models.transformers_model import linear_shapes

    return tuple(name for name, (rows, cols) in linear_shapes(spec).items()
                 if rows % world_size or (rows // world_size * cols) % NF4_BLOCK)


# PEFT's names of our native layers' linear modules (lora.target_modules on a native model).
_NATIVE_TARGETS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "output_proj",
                   "output_proj": "output_proj"}
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def _native_targets(targets: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """(attn_modules, apply_to_mlp) of PEFT-style target_modules on our native layers."""
    if "all-linear" in targets:
        return ATTN_MODULES, True
    unknown = [t for t in targets if t not in _NATIVE_TARGETS and t not in _MLP_TARGETS]
    if unknown:
        raise UserError(f"lora.target_modules: {', '.join(unknown)} names no linear module of this model's layers; "
                        f"they are {', '.join([*_NATIVE_TARGETS][:4] + list(_MLP_TARGETS))}, or [all-linear]")
    mlp = [t for t in _MLP_TARGETS if t in targets]
    if mlp and len(mlp) < 3:
        raise UserError(f"lora.target_modules: {', '.join(mlp)} without {', '.join(set(_MLP_TARGETS) - set(mlp))}: "
                        "our own layers adapt the MLP's three projections together; name all three, or set "
                        "model.implementation=transformers")
    return tuple(dict.fromkeys(_NATIVE_TARGETS[t] for t in targets if t in _NATIVE_TARGETS)), bool(mlp)


def _check_nf4(spec: ModelSpec, opts: LoraOptions, world_size: int) -> None:
    """UserError unless every NF4 weight, and each process's share of its rows, holds whole NF4 blocks."""
    for module, ((rows, cols), dims) in nf4_weights(spec, opts).items():
        share = rows // world_size * cols
        if rows % world_size == 0 and share % NF4_BLOCK == 0:
            continue
        what = f"lora.quantize_base=true: the {module} weight of this model [{rows}, {cols}] ({dims})"
        if (rows * cols) % NF4_BLOCK:
            raise UserError(f"{what} cannot be stored in NF4: its {rows * cols} values are not a whole number of "
                            f"NF4 blocks of {NF4_BLOCK} (64 x 256). Fine-tune this model with plain LoRA "
                            "(lora.quantize_base=false)")
        why = (f"its {rows} rows do not split evenly" if rows % world_size else
               f"a share of {rows // world_size} rows ({share} values) is not a whole number of NF4 blocks of "
               f"{NF4_BLOCK} (64 x 256)")
        raise UserError(f"{what} cannot be split in NF4 over {world_size} processes: {why}. Use a flavor with "
                        "fewer processes, or plain LoRA (lora.quantize_base=false)")


def is_adapter(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name


def trained_under_lora(model: nn.Module, name: str) -> bool:
    """Whether a parameter trains under LoRA: an adapter's, or one of a module trained whole (an image-text model's
    vision tower or projector with lora.vision=full or lora.projector=full: models/transformers_model.add_adapters)."""
    return is_adapter(name) or name.startswith(tuple(f"{m}." for m in getattr(model, "trained_whole", ())))


def freeze_base(model: nn.Module) -> None:
    """Only adapter parameters (and those of modules trained whole) get gradients, and so optimizer state."""
    for name, p in model.named_parameters():
        p.requires_grad_(trained_under_lora(model, name))


def init_adapters(model: nn.Module, *, seed: int) -> None:
    """LoRA's initialisation (A Kaiming-uniform, B zero), computed whole from a seed per tensor so that
    every flavor, whatever its sharding, starts from the same adapters."""
    for name, p in model.named_parameters():
        if ".lora_a." in name:
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1 / math.sqrt(p.shape[-1])  # kaiming_uniform_(a=sqrt(5)) on a [rank, in] matrix (an expert's too)
            copy_full_into(p, (torch.rand(p.shape, generator=g) * 2 - 1) * bound)
        elif ".lora_b." in name:
            copy_full_into(p, torch.zeros(p.shape))


def gather_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter tensor whole, on every rank (a collective; adapters are small); under pipeline parallelism
    on rank 0 only (hf_format.whole_parameter)."""
    whole = whole_model(model)
    names = [name for name, _ in whole.named_parameters() if trained_under_lora(whole, name)]
    params = dict(model.named_parameters())
    return {name: whole_parameter(model, name, params) for name in names}


def merge_into(adapters: dict[str, torch.Tensor], scale: float):
    """A save_weights transform: W + scale * B @ A for each base weight that has an adapter.

    QLoRA merges as torchtune does: W is the base the adapters were trained against, the NF4 weight
    dequantized (full_tensor does it, in float32), not the original checkpoint's; the sum is cast to the
    checkpoint's dtype when written.
    """

    def transform(tune_name: str, weight: torch.Tensor) -> torch.Tensor:
        stem = tune_name.removesuffix(".weight")
        if ".mlp.experts." in stem:  # a stacked experts' weight [E, out, in] and its adapters [E, out, r] @ [E, r, in]
            owner, _, projection = stem.rpartition(".")
            stem = f"{owner}.lora_{{}}.{projection}"
        else:
            stem = f"{stem}.lora_{{}}.weight"
        a, b = adapters.get(stem.format("a")), adapters.get(stem.format("b"))
        if a is None:
            return weight
        return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)

    return transform


# The experts' parameters of transformers' Qwen3-MoE and Mixtral PEFT adapts (target_parameters): the fused gate and up
# projections [E, 2 x hidden, dim], wrapped first (its adapters under `base_layer`), and the down projection.
PEFT_EXPERT_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _peft_experts(prefix: str, stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A sparse layer's expert adapters (lora_a.w1 [E, r, dim], lora_b.w1 [E, hidden, r], ...) as PEFT's
    ParamWrapper holds those of transformers' stacked parameters. PEFT reads a parameter [E, m, n] as n = in and
    m = out the other way round from F.linear, lora_A [E x R, m] and lora_B [n, R x E]: its update of expert e is
    A_e^T B_e^T, [m, n]. So for the down projection [E, dim, hidden] A_e is our B_e^T and B_e our A_e^T; for the
    fused gate and up [E, 2 hidden, dim], rank 2r: A_e = diag(B_gate^T, B_up^T), B_e = [A_gate^T, A_up^T]."""
    a1, b1, a3, b3, a2, b2 = (stacked[k].float() for k in ("lora_a.w1", "lora_b.w1", "lora_a.w3", "lora_b.w3",
                                                              "lora_a.w2", "lora_b.w2"))
    E, r, dim = a1.shape
    hidden = b1.shape[1]
    fused_a = torch.zeros(E, 2 * r, 2 * hidden)
    fused_a[:, :r, :hidden], fused_a[:, r:, hidden:] = b1.transpose(1, 2), b3.transpose(1, 2)
    fused_b = torch.cat([a1.transpose(1, 2), a3.transpose(1, 2)], dim=2)  # [E, dim, 2r]
    dtype = stacked["lora_a.w1"].dtype
    return {f"{prefix}.base_layer.lora_A.weight": fused_a.reshape(E * 2 * r, 2 * hidden).to(dtype),
            f"{prefix}.base_layer.lora_B.weight": fused_b.permute(1, 2, 0).reshape(dim, 2 * r * E).to(dtype),
            f"{prefix}.lora_A.weight": b2.transpose(1, 2).reshape(E * r, dim).to(dtype).contiguous(),
            f"{prefix}.lora_B.weight": a2.permute(2, 1, 0).reshape(hidden, r * E).to(dtype).contiguous()}


# An experts module's adapters of transformers' modules (models/transformers_model._adapt_experts): module, a or b,
# the stacked weight.
_TRANSFORMERS_EXPERTS = re.compile(r"(model\..*\.experts)\.lora_([ab])\.(\w+)")


def _peft_parameters(prefix: str, weights: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """An experts module's adapters on its stacked weights W [E, m, n] (A [E, r, n], B [E, m, r]: W + s B @ A) as
    PEFT's ParamWrapper holds them: lora_A [E x r, m], lora_B [n, r x E], expert e's update A_e^T B_e^T (see
    _peft_experts). PEFT wraps the module once a weight, in the order of target_parameters: the first innermost (its
    matrices under `base_layer`, under as many as come after it)."""
    out, names = {}, list(weights)
    for i, name in enumerate(names):
        a, b = weights[name]["a"], weights[name]["b"]
        E, r, n = a.shape
        where = prefix + ".base_layer" * (len(names) - 1 - i)
        out[f"{where}.lora_A.weight"] = b.transpose(1, 2).reshape(E * r, b.shape[1]).contiguous()
        out[f"{where}.lora_B.weight"] = a.permute(2, 1, 0).reshape(n, r * E).contiguous()
    return out


def save_adapter(adapters: dict[str, torch.Tensor], *, opts: LoraOptions, out_dir: Path, base_model: str,
                 rank: int = 0) -> None:
    """Write a PEFT adapter folder (written aside, then renamed): what PeftModel.from_pretrained loads.

    Every rank calls it, rank 0 writes; a full disk there is every rank's DiskFull (none goes on alone into the
    merged model's gathers)."""
    writes = Writes()
    if rank == 0:
        writes.run(lambda: _write_adapter(adapters, opts=opts, out_dir=out_dir, base_model=base_model))
    if writes.failed_anywhere():
        raise disk_full(out_dir.parent, f"the adapter {out_dir}", needed=sum(t.nbytes for t in adapters.values() if t is not None))


# What a model's list of layers is called (transformers' decoders, vision towers' blocks).
_LAYER_LISTS = ("layers", "blocks", "h", "layer", "block")


def _write_adapter(adapters: dict[str, torch.Tensor], *, opts: LoraOptions, out_dir: Path, base_model: str) -> None:
    tensors, targets, experts, stacked, modules = {}, set(), {}, {}, set()
    for name, t in adapters.items():
        m = _TRANSFORMERS_EXPERTS.fullmatch(name)
        if m:  # transformers' modules: model.layers.1.mlp.experts.lora_a.gate_up_proj, by module and weight
            module, kind, weight = m.groups()
            stacked.setdefault(module, {}).setdefault(weight, {})[kind] = t
            continue
        if ".mlp.experts.lora_" in name:  # layers.0.mlp.experts.lora_a.w1: written per layer below
            layer, _, leaf = name.partition(".experts.")
            experts.setdefault(layer, {})[leaf] = t
            continue
        if not is_adapter(name):  # a module trained whole (opts.trained_whole): PEFT's modules_to_save, as it is
            tensors["base_model.model." + name] = t.contiguous()
            continue
        stem, kind = name.rsplit(".lora_", 1)  # layers.0.attn.q_proj, a.weight
        try:
            base = hf_name(f"{stem}.weight")
        except KeyError:  # transformers' modules: our names are the checkpoint's
            base = f"{stem}.weight"
        peft = "base_model.model." + base.removesuffix(".weight") + (".lora_A.weight" if kind.startswith("a") else ".lora_B.weight")
        tensors[peft] = t.contiguous()
        leaf = stem.rsplit(".", 1)[-1]
        targets.add(_PEFT_TARGETS.get(leaf, leaf))
        parts = base.removesuffix(".weight").split(".")  # a layer's number is any layer's (not an MLP's 0 and 2)
        modules.add(r"\.".join(r"\d+" if part.isdigit() and parts[i - 1] in _LAYER_LISTS else re.escape(part)
                                for i, part in enumerate(parts)))
    for layer, adapters_of in experts.items():
        tensors.update(_peft_experts(f"base_model.model.model.{layer}.experts", adapters_of))
    parameters = []
    for module, weights in stacked.items():
        tensors.update(_peft_parameters(f"base_model.model.{module}", weights))
        parameters += [f"{module.split('.', 3)[-1]}.{w}" for w in weights]  # mlp.experts.gate_up_proj
    parameters = list(dict.fromkeys(parameters))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": opts.rank, "lora_alpha": opts.alpha, "lora_dropout": opts.dropout,
        "target_modules": sorted(targets) or None,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": list(opts.trained_whole) or None, "use_dora": False, "use_rslora": False,
        "layers_to_transform": None,
    }
    if any(r"\.language_model\." in m for m in modules):
        # An image-text model's vision tower has linear modules of the names adapted in its language model (SigLIP's
        # q_proj): PEFT matches a string of target_modules as a regular expression on the whole module name.
        config.update(target_modules="|".join(sorted(modules)))
    if parameters:  # transformers' modules: PEFT adapts each stacked weight as it is (its ParamWrapper)
        config.update(target_parameters=parameters)
    if experts:
        # transformers keeps a sparse layer's experts as two stacked parameters, the gate and up projections fused:
        # PEFT adapts them as parameters (its ParamWrapper), the fused one with the gate's and the up's adapters
        # side by side (rank 2r, alpha 2 alpha: the same scale).
        config.update(target_parameters=list(PEFT_EXPERT_TARGETS),
                      rank_pattern={"gate_up_proj": 2 * opts.rank}, alpha_pattern={"gate_up_proj": 2 * opts.alpha})
    if out_dir.exists():
        raise FileExistsError(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.rename(tmp, out_dir)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
