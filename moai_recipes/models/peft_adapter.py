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
# Settings whose effect a plain W + scale * B @ A merge cannot reproduce: refused, not ignored.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {},
                "alpha_pattern": {}}


@dataclass(frozen=True)
class PeftAdapter:
    folder: Path
    base_model: str | None  # adapter_config.json's base_model_name_or_path: a local folder or a Hub name
    rank: int
    alpha: float
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # Hugging Face module name -> (A [r, in], B [out, r])

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
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        return cls(folder=folder, base_model=config.get("base_model_name_or_path"), rank=rank, alpha=alpha, scale=scale,
                   weights={m: (a, b) for m, (a, b) in pairs.items()})

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
    if config.get("bias", "none") != "none":
        raise UserError(f"{path} sets bias={config['bias']!r}; only adapters without trained biases can be merged")
    return config


@torch.no_grad()
def merge_adapter(model: torch.nn.Module, adapter: PeftAdapter) -> None:
    """Add scale * B @ A to each adapted weight of `model` (loaded from a checkpoint that `adapter.check_base`
    accepted), one module at a time, in fp32."""
    params = dict(model.named_parameters())
    for module, (a, b) in adapter.weights.items():
        delta = adapter.scale * (b.float() @ a.float())  # [out, in], the layout of the weight
        param = params[tune_name(f"{module}.weight")]
        param.copy_(param.float() + delta.to(param.device))  # one rounding to the model's dtype
