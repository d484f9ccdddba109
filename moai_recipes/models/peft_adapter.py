"""PEFT LoRA adapters read back: adapter_config.json and adapter_model.safetensors, merged into a loaded model.

Test: `python -m pytest tests/test_generate.py -q`. Reads what recipes/lora_finetune.py writes (moai_recipes/
lora.py), and what peft writes for any Llama, Mistral, Qwen2 or Qwen3 model. The merge is W + scale * B @ A,
in the checkpoint's own layout (which the model keeps, models/rope.py), so it matches what `peft`'s
merge_and_unload computes.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from moai_recipes.errors import UserError
from moai_recipes.models.hf_format import HFFolder, tune_name
from moai_recipes.models.sources import resolve_model_dir

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's wrapper around the Hugging Face model
_KINDS = {".lora_A.weight": 0, ".lora_B.weight": 1}
_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name of a Hugging Face Hub repository
# Settings whose effect a plain W + scale * B @ A merge cannot reproduce: refused, not ignored. (rank_pattern and
# alpha_pattern are read for the experts' stacked parameters only: models/lora.py writes them for the fused gate and
# up projections.)
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None}
_PATTERNED = ("gate_up_proj", "down_proj")
# A Mixture-of-Experts layer's experts as PEFT's ParamWrapper adapts them (target_parameters): the fused gate and up
# projections under `base_layer`, the down projection outside it (models/lora.py writes them so).
_EXPERTS = re.compile(r"(model\.(?:\w+\.)?layers\.\d+\.mlp\.experts)((?:\.base_layer)*)")


@dataclass(frozen=True)
class PeftAdapter:
    folder: Path
    base_model: str | None  # adapter_config.json's base_model_name_or_path: a local folder or a Hub name
    rank: int
    alpha: float
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # Hugging Face module name -> (A [r, in], B [out, r])
    scales: dict[str, float] | None = None  # a module's own scale where its rank or alpha is not the adapter's
    # adapter_config.json's target_parameters: the stacked weights PEFT adapts as parameters, the first innermost
    parameters: tuple[str, ...] = ()

    @classmethod
    def open(cls, folder: str | Path) -> "PeftAdapter":
        """Read and check a PEFT LoRA adapter folder (a UserError says what is wrong with it)."""
        folder = Path(folder).expanduser().resolve()
        config = _read_config(folder)
        try:
            tensors = load_file(folder / WEIGHTS)
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {folder / WEIGHTS} ({e}); is adapter_dir a PEFT adapter folder?") from None
        pairs: dict[str, list] = {}
        for name, tensor in tensors.items():
            kind = next((k for k in _KINDS if name.endswith(k)), None)
            if kind is None or not name.startswith(_PREFIX):
                raise UserError(f"{folder / WEIGHTS} holds {name}, not a LoRA A or B matrix of a decoder; only "
                                "plain LoRA adapters (no embedding adapters, biases or saved modules) can be merged")
            pairs.setdefault(name[len(_PREFIX):-len(kind)], [None, None])[_KINDS[kind]] = tensor
        if not pairs:
            raise UserError(f"{folder / WEIGHTS} holds no LoRA weights")
        for module, (a, b) in pairs.items():
            if a is None or b is None or a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
                raise UserError(f"{folder / WEIGHTS}: the LoRA A and B matrices of {module} do not pair up; "
                                "the adapter is damaged: train or download it again")
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        scaled = lambda r, a: a / math.sqrt(r) if config.get("use_rslora") else a / r  # noqa: E731
        scales = {}
        for module in pairs:  # the experts' parameters may have ranks and alphas of their own
            if _EXPERTS.fullmatch(module):
                name = "gate_up_proj" if module.endswith(".base_layer") else "down_proj"
                scales[module] = scaled(config.get("rank_pattern", {}).get(name, rank),
                                        config.get("alpha_pattern", {}).get(name, alpha))
        return cls(folder=folder, base_model=config.get("base_model_name_or_path"), rank=rank, alpha=alpha,
                   scale=scaled(rank, alpha), weights={m: (a, b) for m, (a, b) in pairs.items()}, scales=scales,
                   parameters=tuple(config.get("target_parameters") or ()))

    @property
    def base_on_hub(self) -> bool:
        """Whether the base adapter_config.json names is a Hub name (not a folder here): base_model_dir downloads it."""
        base = self.base_model or ""
        return not Path(base).expanduser().is_dir() and bool(_HUB_NAME.fullmatch(base))

    def base_model_dir(self, *, download: bool = True) -> Path | None:
        """The folder of the base model adapter_config.json names: a local folder, or a Hub name (its cached
        copy, or a download), as peft's AutoPeftModel reads base_model_name_or_path. Without `download`, None
        for a Hub name not in the cache."""
        base = self.base_model
        if base and Path(base).expanduser().is_dir():
            return Path(base).expanduser().resolve()
        if self.base_on_hub:
            try:
                return resolve_model_dir(name=base, checkpoint_dir=None, hf_repo=base, download=download)
            except UserError as e:  # "model=NAME: could not get ..." would name a model= the user never typed
                raise UserError(f"{self.folder / CONFIG} names the base model {base}: "
                                f"{str(e).partition(': ')[2]}") from None
        raise UserError(f"{self.folder / CONFIG} names the base model {base!r}, which is not a folder here; "
                        "set model.checkpoint_dir=DIR to the base model's folder")

    def check_base(self, hf: HFFolder) -> None:
        """UserError unless every adapted module is a weight of `hf` with the adapter's shapes."""
        for module, (a, b) in self.weights.items():
            if _EXPERTS.fullmatch(module):
                if hf.spec.native:
                    _expert_delta(module, a, b, hf.spec, 1.0, folder=self.folder)  # its shapes checked
                continue  # transformers' modules: checked against the module's own weight as it is merged
            shape = hf.shapes.get(f"{module}.weight")
            if shape != (b.shape[0], a.shape[1]):
                found = f"has shape {list(shape)}" if shape else "has no such weight"
                raise UserError(
                    f"the adapter {self.folder} was trained for another base model: it adapts {module} as a "
                    f"{b.shape[0]}x{a.shape[1]} matrix, but {hf.folder} {found}. Set model.checkpoint_dir to the "
                    f"base it was trained on (its adapter_config.json names {self.base_model!r})")


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG
    if not folder.is_dir():
        raise UserError(f"adapter_dir={folder} is not a folder; give a PEFT adapter folder "
                        f"({CONFIG}, {WEIGHTS}), e.g. OUTPUT_DIR/adapter of a LoRA run")
    if not path.is_file() or not (folder / WEIGHTS).is_file():
        raise UserError(f"adapter_dir={folder} has no {CONFIG} or no {WEIGHTS}; give a PEFT adapter folder, "
                        "e.g. OUTPUT_DIR/adapter of a LoRA run")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise UserError(f"{path}: peft_type is {config.get('peft_type') if isinstance(config, dict) else None!r}; "
                        "only LoRA adapters can be merged")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise UserError(f"{path} needs a positive integer r and a number lora_alpha")
    for key, plain in _UNSUPPORTED.items():
        if config.get(key) not in (plain, None):
            raise UserError(f"{path} sets {key}={config[key]!r}; only plain LoRA adapters can be merged here")
    for key in ("rank_pattern", "alpha_pattern"):
        other = sorted(set(config.get(key) or {}) - set(_PATTERNED))
        if other:
            raise UserError(f"{path} sets {key} for {', '.join(other)}; only plain LoRA adapters (per-module ranks for "
                            "the experts' gate_up_proj and down_proj alone) can be merged here")
    if config.get("bias", "none") != "none":
        raise UserError(f"{path} sets bias={config['bias']!r}; only adapters without trained biases can be merged")
    return config


@torch.no_grad()
def merge_adapter(model: torch.nn.Module, adapter: PeftAdapter, spec=None) -> None:
    """Add scale * B @ A to each adapted weight of `model` (loaded from a checkpoint that `adapter.check_base`
    accepted), one module at a time, in fp32. `spec`: the model's (its experts, for a Mixture-of-Experts adapter)."""
    params = dict(model.named_parameters())
    if spec is not None and not spec.native:  # transformers' modules: the checkpoint's names, stacked weights as PEFT's
        for module, (a, b) in adapter.weights.items():
            m = _EXPERTS.fullmatch(module)
            if m and adapter.parameters:
                param = params[_stacked_weight(adapter, module, m)]
                delta = _stacked_delta(a, b, tuple(param.shape), adapter.scales[module], module=module,
                                       folder=adapter.folder)
            else:
                param = params[f"{module}.weight"]
                delta = adapter.scale * (b.float() @ a.float())
            param.copy_(param.float() + delta.to(param.device))
        return
    for layer, updates in expert_updates(adapter, spec).items():
        for projection, delta in updates.items():
            param = params[f"{layer}.{projection}"]
            param.copy_(param.float() + delta.to(param.device))
    for module, (a, b) in adapter.weights.items():
        if _EXPERTS.fullmatch(module):
            continue
        delta = adapter.scale * (b.float() @ a.float())  # [out, in], the layout of the weight
        # Our native layers' names, or transformers' modules' (the checkpoint's own).
        param = params[tune_name(f"{module}.weight") if spec is None or spec.native else f"{module}.weight"]
        param.copy_(param.float() + delta.to(param.device))  # one rounding to the model's dtype


def _stacked_weight(adapter: PeftAdapter, module: str, m: re.Match) -> str:
    """The stacked weight a module key of PEFT's ParamWrapper adapts: the last of target_parameters outermost, each
    earlier one a `base_layer` further in."""
    names = [p.rpartition(".")[2] for p in adapter.parameters if p.rpartition(".")[0].endswith("mlp.experts")]
    depth = m.group(2).count(".base_layer")
    if depth >= len(names):
        raise UserError(f"the adapter {adapter.folder} adapts {module}, deeper than its target_parameters "
                        f"{list(adapter.parameters)} wrap: the adapter is damaged")
    return f"{m.group(1)}.{names[len(names) - 1 - depth]}"


def _stacked_delta(a: torch.Tensor, b: torch.Tensor, shape: tuple, scale: float, *, module: str,
                   folder: Path) -> torch.Tensor:
    """The update of a stacked weight [E, m, n] from PEFT's ParamWrapper matrices A [E x R, m], B [n, R x E]: expert
    e's A_e^T B_e^T, scaled."""
    E, m, n = shape
    if a.shape[0] % E or a.shape[1] != m or b.shape[0] != n or b.shape[1] != a.shape[0]:
        raise UserError(f"the adapter {folder} adapts {module} with matrices {list(a.shape)} and {list(b.shape)}, "
                        f"which are not of this model's stacked experts {list(shape)}; set model.checkpoint_dir to "
                        "the base it was trained on")
    rank = a.shape[0] // E
    return torch.einsum("ore,eri->eio", b.float().reshape(n, rank, E), a.float().reshape(E, rank, m)) * scale


def expert_updates(adapter: PeftAdapter, spec) -> dict[str, dict[str, torch.Tensor]]:
    """The adapter's updates of each sparse layer's stacked experts, scaled, by our names: {"layers.L.mlp.experts":
    {"w1": [E, hidden, dim], "w3": ..., "w2": [E, dim, hidden]}} (the fused gate and up update split in two)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for module, (a, b) in adapter.weights.items():
        m = _EXPERTS.fullmatch(module)
        if not m:
            continue
        layer = tune_name(f"{m.group(1)}.0.gate_proj.weight").rpartition(".")[0]  # layers.L.mlp.experts
        delta = _expert_delta(module, a, b, spec, adapter.scales[module], folder=adapter.folder)
        half = delta.shape[1] // 2
        out.setdefault(layer, {}).update({"w1": delta[:, :half], "w3": delta[:, half:]} if m.group(2) else {"w2": delta})
    return out


def _expert_delta(module: str, a: torch.Tensor, b: torch.Tensor, spec, scale: float, *, folder: Path) -> torch.Tensor:
    """The update of a sparse layer's stacked experts from PEFT's ParamWrapper matrices: A [E x R, m], B [n, R x E],
    expert e's update A_e^T B_e^T [m, n]: the fused gate and up projections [E, 2 x hidden, dim] (under `base_layer`)
    or the down projection [E, dim, hidden], scaled."""
    E, hidden, dim = spec.num_experts, spec.expert_dim, spec.embed_dim
    fused = module.endswith(".base_layer")
    want = (2 * hidden, dim) if fused else (dim, hidden)
    if not spec.is_moe or a.shape[0] % E or (a.shape[1], b.shape[0]) != want:
        raise UserError(f"the adapter {folder} adapts {module} with matrices {list(a.shape)} and {list(b.shape)}, "
                        f"which are not of this model's {E} experts ({'gate_up_proj' if fused else 'down_proj'} "
                        f"{[E, *want]}); set model.checkpoint_dir to the base it was trained on")
    rank = a.shape[0] // E
    return torch.einsum("ore,eri->eio", b.float().reshape(b.shape[0], rank, E),
                        a.float().reshape(E, rank, a.shape[1])) * scale
