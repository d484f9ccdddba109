"""Hugging Face checkpoint folders: describe one, load it into our model, save the model back alike.

The model is either implementation (models/spec.py): our native layers, whose parameter names differ from the
checkpoint's (`NativeNames`: the one mapping between the two), or transformers' own modules, whose names are the
checkpoint's up to transformers' conversion rules (models/transformers_weights.py). Both map each checkpoint tensor
to the parameter it is (or is a part of: a stacked expert), make a parameter whole from its tensors and give them
back; loading and saving here are the same for both.

Test: `python -m pytest tests/test_hf_checkpoint.py -q`. The model may be plain or FSDP2-sharded
(DTensor parameters sharded on dim 0). Loading reads one tensor at a time; saving holds one
input file's tensors at a time, so a 70B model never has to fit whole in one process.
"""

import functools
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moai_recipes import env
from moai_recipes.errors import UserError
from moai_recipes.files import Writes, disk_full
from moai_recipes.models.build import is_nf4
from moai_recipes.models.spec import ModelSpec, read_spec


def _is_dtensor(param: torch.Tensor) -> bool:
    """Whether `param` is a DTensor, without importing torch.distributed.tensor (0.4 s of a dry run's start, which
    reads a checkpoint's config through this module): a DTensor exists only once it is imported."""
    tensors = sys.modules.get("torch.distributed.tensor")
    return tensors is not None and isinstance(param, tensors.DTensor)

INDEX = "model.safetensors.index.json"
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Weights in other formats are never copied: a stale pytorch_model.bin beside the new weights would mislead.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".index.json")
_TIED_OUTPUT = "output.weight"  # torchtune's name for lm_head.weight; absent from tied models
# gpt-oss's experts as its checkpoints hold them (config.json's quantization_config: mxfp4): each projection's 4-bit
# values packed two a byte (`_blocks`) and a power-of-two scale per 32 (`_scales`); dequantized on load, written back
# in bf16 under the projection's own name.
MXFP4_PARTS = ("_blocks", "_scales")


@dataclass
class HFFolder:
    """A Hugging Face model folder (what `model.checkpoint_dir` names: config.json, *.safetensors, the tokenizer),
    described from its headers without loading weights. Not a step checkpoint (checkpoint/steps.py)."""

    folder: Path
    spec: ModelSpec
    files: dict[str, list[str]]  # safetensors file name -> the Hugging Face tensor names in it
    dtypes: dict[str, torch.dtype]
    shapes: dict[str, tuple]

    @classmethod
    def open(cls, folder: str | Path, *, spec: ModelSpec | None = None, implementation: str = "auto",
             trust_remote_code: bool = False) -> "HFFolder":
        """The folder described from its headers; `spec` (its config.json's, built as the run builds it) is read
        from the folder when not given."""
        folder = Path(folder)
        # read_spec also says when the folder or config.json is missing
        spec = spec or read_spec(folder, implementation=implementation, trust_remote_code=trust_remote_code)
        files, dtypes, shapes = _weight_map(folder), {}, {}
        for fname, names in files.items():
            with _open(folder / fname) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise UserError(f"{folder / INDEX} puts {name} in {fname}, which does not hold it; "
                                        "the download is incomplete: download the checkpoint again")
                    sl = f.get_slice(name)
                    packed = spec.mxfp4 and sl.get_dtype() == "U8" and name.endswith(MXFP4_PARTS)
                    if sl.get_dtype() not in _DTYPES and not packed:
                        raise UserError(f"{fname}: {name} is {sl.get_dtype()}; only float32, bfloat16 and float16 "
                                        "checkpoints are supported (and gpt-oss's MXFP4 experts)")
                    dtypes[name] = torch.uint8 if packed else _DTYPES[sl.get_dtype()]
                    shapes[name] = tuple(sl.get_shape())
        hf = cls(folder=folder, spec=spec, files=files, dtypes=dtypes, shapes=shapes)
        hf.params  # a tensor no mapping knows is a UserError now, not halfway through loading
        return hf

    @functools.cached_property
    def names(self):
        """How this checkpoint's tensors map to the model's parameters (NativeNames or TransformersNames)."""
        if self.spec.native:
            return NativeNames(self.spec)
        from moai_recipes.models.transformers_model import causal_lm_of
        from moai_recipes.models.transformers_weights import TransformersNames

        return TransformersNames(causal_lm_of(self.spec), mxfp4=self.spec.mxfp4)

    @functools.cached_property
    def params(self) -> dict[str, str | None]:
        """Each tensor's parameter (None: not a weight of the model, e.g. rotary inv_freq: copied as it is)."""
        out = {}
        for names in self.files.values():
            for name in names:
                try:
                    out[name] = self.names.param_of(name)
                except KeyError:
                    raise UserError(f"{self.folder}: tensor {name} is not part of a {self.spec.family} model; the "
                                    "weights and config.json do not belong together") from None
        return out

    @functools.cached_property
    def sources(self) -> dict[str, list[str]]:
        """Each parameter's tensors in the checkpoint, in the files' order (a stacked one's in expert order)."""
        out: dict[str, list[str]] = {}
        for name, param in self.params.items():
            if param is not None:
                out.setdefault(param, []).append(name)
        return {param: self.names.ordered(names) for param, names in out.items()}

    def whole_shape(self, param: str) -> tuple:
        """The shape a parameter has when made from its tensors (without reading them)."""
        metas = {n: torch.empty(self.shapes[n], dtype=self.dtypes[n], device="meta") for n in self.sources[param]}
        return tuple(self.names.gather(param, metas).shape)

    def tensors(self):
        """(Hugging Face name, tensor) for every weight, file by file, in the files' order: one in memory at a time."""
        for fname, names in self.files.items():
            with _open(self.folder / fname) as f:
                for name in names:
                    yield name, f.get_tensor(name)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from the file that holds it."""
        fname = next(f for f, names in self.files.items() if name in names)
        with _open(self.folder / fname) as f:
            return f.get_tensor(name)

    def fingerprint(self) -> str:
        """A digest of the model as read: config.json, and each weights file's header and its first and last MiB of
        weights (another model, or the same one trained further, differs there; reading all of a 70B model would
        take minutes)."""
        digest = hashlib.sha256((self.folder / "config.json").read_bytes())
        for fname in self.files:
            path = self.folder / fname
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                end = path.stat().st_size
                digest.update(fname.encode() + f.read(length) + f.read(2**20))
                f.seek(max(8 + length, end - 2**20))
                digest.update(f.read())
        return digest.hexdigest()


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        why = _safetensors_damage(path) or str(e)  # "truncated (N of M bytes)" says more than the parser's words
        raise UserError(f"cannot read {path}: {why}; download the checkpoint again") from None


def _safetensors_damage(path: Path) -> str | None:
    """What is wrong with one .safetensors file, in a few words (None: its header reads and its data is all
    there)."""
    if not path.is_file():
        return "missing"
    have = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > have:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        return f"not a readable safetensors file ({e})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if have < 8 + length + end:
        return f"truncated ({have} of {8 + length + end} bytes)"
    return None


def _weight_map(folder: Path) -> dict[str, list[str]]:
    """safetensors file -> tensor names, from the index or the single weights file."""
    index = folder / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{index} is malformed ({e!r}); download the checkpoint again") from None
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        missing = sorted(f for f in files if not (folder / f).is_file())
        if missing:
            raise UserError(f"{index} names {', '.join(missing)}, missing from {folder}; "
                            "the download is incomplete: download the checkpoint again")
        return dict(sorted(files.items()))
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    if not found:
        raise UserError(f"{folder} has no *.safetensors weights; download the safetensors version of the model "
                        "(other formats such as pytorch_model.bin are not read)")
    if "model.safetensors" not in found and len(found) > 1:
        raise UserError(f"{folder} has several safetensors files ({', '.join(found)}) but no {INDEX}")
    fname = "model.safetensors" if "model.safetensors" in found else found[0]
    with _open(folder / fname) as f:
        return {fname: list(f.keys())}


# Hugging Face tensor names and ours (torchtune's module names), layer {i}: the one mapping between the two.
# Tensors are never permuted: rope.py rotates halves as transformers does, so q and k keep their layout.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn.q_proj", "self_attn.k_proj": "attn.k_proj", "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.output_proj", "mlp.gate_proj": "mlp.w1", "mlp.down_proj": "mlp.w2",
    "mlp.up_proj": "mlp.w3",
}
_LAYER_NORMS = {  # Hugging Face module -> our module whose weight is RMSNorm's `scale`
    "input_layernorm": "sa_norm", "post_attention_layernorm": "mlp_norm",
    "self_attn.q_norm": "attn.q_proj.head_norm", "self_attn.k_norm": "attn.k_proj.head_norm",  # Qwen3, build.py
}
_TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.scale",
              "lm_head.weight": "output.weight"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_TUNE_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias|scale)")
# Mixture-of-Experts: each expert's projection is a tensor of its own in a Hugging Face checkpoint (Qwen3-MoE:
# mlp.experts.N.gate_proj, Mixtral: block_sparse_moe.experts.N.w1), a slice of our stacked weight (models/moe.py);
# the router is `gate`.
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
                     r"\.weight")
_EXPERT_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight")
_NOT_WEIGHTS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # old transformers' buffers


def tune_name(hf_name: str) -> str | None:
    """Our parameter name for a Hugging Face tensor name; None for a buffer that is not a weight; KeyError for a
    name no supported model has. An expert's projection is one slice of its layer's stacked weight (expert_index)."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    if _NOT_WEIGHTS.fullmatch(hf_name):
        return None
    m = _EXPERT.fullmatch(hf_name)
    if m:
        layer, _, projection = m.groups()
        return f"layers.{layer}.mlp.experts.{_EXPERT_PROJECTIONS[projection]}"
    m = _ROUTER.fullmatch(hf_name)
    if m:
        return f"layers.{m.group(1)}.mlp.router.weight"
    m = _LAYER.fullmatch(hf_name)
    if m:
        layer, module, kind = m.groups()
        if module in _LAYER_NAMES:
            return f"layers.{layer}.{_LAYER_NAMES[module]}.{kind}"
        if module in _LAYER_NORMS and kind == "weight":
            return f"layers.{layer}.{_LAYER_NORMS[module]}.scale"
    raise KeyError(hf_name)


def expert_index(hf_name: str) -> int | None:
    """The expert a Hugging Face tensor holds one projection of (its slice of our stacked weight), or None."""
    m = _EXPERT.fullmatch(hf_name)
    return int(m.group(2)) if m else None


_HF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_HF_LAYER_NORMS = {v: k for k, v in _LAYER_NORMS.items()}
_HF_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}


def hf_name(tune: str) -> str:
    """The Hugging Face name of one of our parameter names (KeyError for a name that has none, e.g. an adapter)."""
    if tune in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[tune]
    m = _TUNE_LAYER.fullmatch(tune)
    if m:
        layer, module, kind = m.groups()
        if kind == "scale" and module in _HF_LAYER_NORMS:
            return f"model.layers.{layer}.{_HF_LAYER_NORMS[module]}.weight"
        if kind != "scale" and module in _HF_LAYER_NAMES:
            return f"model.layers.{layer}.{_HF_LAYER_NAMES[module]}.{kind}"
    raise KeyError(tune)


class NativeNames:
    """Our native layers' parameter names for a checkpoint's (tune_name, hf_name): each tensor is a parameter, or one
    expert's slice of a stacked one."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        # A tied model's checkpoint may still hold lm_head.weight: the embedding is the output (read from its own name,
        # written to both).
        self.aliases = {_TIED_OUTPUT: "tok_embeddings.weight"} if spec.tie_word_embeddings else {}

    def param_of(self, name: str) -> str | None:
        return tune_name(name)

    def ordered(self, names: list[str]) -> list[str]:
        return sorted(names, key=lambda n: expert_index(n) or 0)

    def gather(self, param: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if len(tensors) == 1 and expert_index(next(iter(tensors))) is None:
            return next(iter(tensors.values()))
        return torch.stack([tensors[n] for n in self.ordered(list(tensors))])  # [E, out, in]

    def stacked(self, param: str, whole: torch.Tensor) -> torch.Tensor:
        """A stacked experts' weight as [E, out, in] (QLoRA holds it as [E x out, in]); any other as it is."""
        return whole.view(self.spec.num_experts, -1, whole.shape[-1]) if ".mlp.experts." in param else whole

    def scatter(self, param: str, whole: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
        if len(names) == 1 and expert_index(names[0]) is None:
            return {names[0]: whole}
        whole = self.stacked(param, whole)
        return {n: whole[expert_index(n)] for n in names}

    def check(self, hf: HFFolder, param: str, names: list[str]) -> None:
        """A stacked weight's experts: each of config.json's, once."""
        indices = [expert_index(n) for n in names]
        if indices[0] is None:
            return
        count = self.spec.num_experts
        beyond = [n for n, i in zip(names, indices) if i >= count]
        if beyond:
            raise UserError(f"{hf.folder}: tensor {beyond[0]} is of expert {expert_index(beyond[0])}, but its "
                            f"config.json has {count} experts; the weights and config.json do not belong together")
        missing = sorted(set(range(count)) - set(indices))
        if missing:
            raise UserError(f"{hf.folder} has no weights for {_expert_name(names[0], missing[0])} (experts "
                            f"{missing[:4]} of that projection); the weights are incomplete or do not belong to its "
                            "config.json")

    def hf_names(self, param: str) -> str:
        """How a checkpoint names one of our parameters (for what is missing)."""
        try:
            return hf_name(param)
        except KeyError:
            m = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.(w[123])", param)
            if m:
                projection = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[m.group(2)]
                return f"model.layers.{m.group(1)}.mlp.experts.*.{projection}.weight"
            return param


def _expert_name(name: str, expert: int) -> str:
    m = _EXPERT.fullmatch(name)
    return name[:m.start(2)] + str(expert) + name[m.end(2):]


def _check_matches(model: torch.nn.Module, hf: HFFolder, allow_missing: tuple[str, ...]) -> None:
    """UserError unless the checkpoint has exactly the model's parameters, with their shapes, each named as the
    checkpoint names it."""
    params = dict(model.named_parameters(remove_duplicate=False))  # transformers' tied output under its own name
    buffers = dict(model.named_buffers())
    aliases = getattr(hf.names, "aliases", {})
    for param, names in hf.sources.items():
        if param in aliases:
            continue
        if param not in params and param not in buffers:
            raise UserError(f"{hf.folder}: tensor {names[0]} has no place in the model its config.json describes; "
                            "the weights and config.json do not belong together")
        if hasattr(hf.names, "check"):
            hf.names.check(hf, param, names)
        held = params[param] if param in params else buffers[param]
        if getattr(hf.names, "dequantized", lambda *a: False)(param, names):  # MXFP4: the dequantized shape
            if hf.whole_shape(param) != tuple(held.shape):
                raise UserError(f"{hf.folder}: tensors {', '.join(names)} make {param} of shape "
                                f"{list(hf.whole_shape(param))}, but its config.json needs {list(held.shape)}; the "
                                "weights and config.json do not belong together")
            continue
        # What each of its tensors must be: the parameter's shape laid out as the checkpoint lays it out.
        try:
            needed = hf.names.scatter(param, torch.empty(held.shape, device="meta"), names)
        except (RuntimeError, ValueError, AssertionError):  # not laid out by any rule: shown as a whole
            needed = None
        for name in names:
            want = tuple(needed[name].shape) if needed is not None else tuple(held.shape)
            if hf.shapes[name] != want and (needed is not None or len(names) == 1):
                raise UserError(f"{hf.folder}: tensor {name} has shape {list(hf.shapes[name])} but its config.json "
                                f"needs {list(want)}; the weights and config.json do not belong together")
    missing = [p for p in dict(model.named_parameters()) if p not in hf.sources
               and not any(s in p for s in allow_missing)]
    if missing:
        named = [hf.names.hf_names(p) if hasattr(hf.names, "hf_names") else p for p in missing]
        raise UserError(f"{hf.folder} has no weights for {', '.join(sorted(named)[:4])}; the weights are "
                        "incomplete or do not belong to its config.json")


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Set a (possibly sharded) parameter from the whole tensor, which every rank holds."""
    # The very local tensor FSDP holds (to_local() of a parameter is a new alias): NF4 is updated in it.
    local = param._local_tensor if _is_dtensor(param) else param
    if is_nf4(local):
        _copy_full_into_nf4(param, local, full)
        return
    full = full.to(param.dtype)
    if _is_dtensor(param):
        # Every rank read the whole tensor from the file: keep this rank's shard, no communication.
        from torch.distributed.tensor import distribute_tensor

        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def _copy_full_into_nf4(param: torch.Tensor, local: torch.Tensor, full: torch.Tensor) -> None:
    """Quantize the WHOLE tensor to NF4, then keep this rank's rows: its codes, scales and scaler mean are
    those of the whole tensor whatever the flavor (a shard quantized alone would have its own mean)."""
    from torch.distributed.tensor import Shard
    from torchao.dtypes.nf4tensor import to_nf4

    quantized = to_nf4(full.to(local.device, local.dtype), local.block_size, local.scaler_block_size)
    if _is_dtensor(param):
        assert param.placements == (Shard(0),) and param.device_mesh.ndim == 1, param.placements
        mesh = param.device_mesh
        quantized = torch.chunk(quantized, mesh.size(), dim=0)[mesh.get_local_rank()]  # whole scaler blocks
    local.copy_(quantized)  # codes and scales, in place: FSDP all-gathers them from this very tensor
    # to_empty gives memory to those three only; the scaler mean and the NF4 code book stay on meta.
    local.scaler_mean, local.nf4 = quantized.scaler_mean, quantized.nf4


def load_weights(model: torch.nn.Module, hf: HFFolder, *, allow_missing: tuple[str, ...] = ()) -> None:
    """Copy the checkpoint into `model` (plain or FSDP2-sharded), one tensor at a time.

    Every rank reads the files. `allow_missing` names substrings of parameters the checkpoint cannot
    hold (LoRA adapters: (".lora_a.", ".lora_b.")); all other parameters must be in it.
    """
    _check_matches(whole_model(model), hf, allow_missing)  # before reading any weight
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    aliases = getattr(hf.names, "aliases", {})
    pending: dict[str, dict[str, torch.Tensor]] = {}  # a parameter's tensors as they are read (a stacked one's experts)
    for fname, names in hf.files.items():
        with _open(hf.folder / fname) as f:
            for name in names:
                param = hf.params[name]
                # rotary inv_freq, another pipeline stage's, a tied output (read as the embedding)
                if param in aliases or (param not in params and param not in buffers):
                    continue
                parts = pending.setdefault(param, {})
                parts[name] = f.get_tensor(name)
                if len(parts) < len(hf.sources[param]):
                    continue
                whole = hf.names.gather(param, pending.pop(param))
                if param in buffers:  # a buffer the checkpoint holds (Gemma 4's layer scalars)
                    with torch.no_grad():
                        buffers[param].copy_(whole.to(buffers[param].dtype))
                else:
                    copy_full_into(params[param], whole.reshape(params[param].shape))  # [E x out, in] in NF4
    assert not pending, sorted(pending)  # _check_matches saw every part


def whole_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder `model` is part of (a pipeline device's stages keep it, on the meta device), or `model`: its
    parameters' names and whole shapes."""
    return getattr(model, "decoder", model)


def whole_parameter(model: torch.nn.Module, name: str, params: dict | None = None) -> torch.Tensor | None:
    """The whole parameter `name` on the CPU: on every rank, or for a pipeline device's stages (which hold some
    of the parameters) on rank 0 only, None elsewhere. Every rank must ask for the same names in the same
    order (a collective)."""
    if hasattr(model, "whole_parameter"):  # train/pipeline.PipelinedModel
        return model.whole_parameter(name, full_tensor)
    return full_tensor((params or dict(model.named_parameters()))[name])


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter on the CPU, as a fresh tensor (a collective for DTensors).

    An NF4 weight (QLoRA) comes back dequantized, in the dtype it was quantized from: each shard holds
    whole scaler blocks and the whole tensor's scaler mean, so it dequantizes on its own rank.
    """
    local = param.to_local() if _is_dtensor(param) else param.detach()
    nf4 = is_nf4(local)
    if nf4:
        local = local.get_original_weight()
    if not _is_dtensor(param):
        return local.to("cpu", copy=True)
    mesh = param.device_mesh
    if nf4 or local.device.type != mesh.device_type:  # or CPU-offloaded shards of a GPU mesh
        from torch.distributed.tensor import DTensor

        param = DTensor.from_local(local.to(mesh.device_type), mesh, param.placements, shape=param.shape,
                                   stride=param.stride())
    return param.full_tensor().cpu()


def save_weights(model: torch.nn.Module, hf: HFFolder, out_dir: Path, *, rank: int,
                 transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Write `model` to `out_dir` laid out exactly as `hf`: files, tensor names, dtypes, index, other files.

    Every rank must call it (gathering sharded parameters is a collective); only rank 0 writes,
    into a temporary sibling folder renamed to `out_dir` at the end. Raises FileExistsError if
    `out_dir` exists. Other ranks return without waiting for rank 0 to finish writing.
    `transform(torchtune_name, whole_tensor)` may change a weight on its way out (LoRA merges its adapters).
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied output under its own name too
    # Rank 0 writes; a full disk there stops its writing but not its part in the gathers, and every rank learns of it
    # at the end (a collective), so none is left waiting in a gather that never comes.
    writes, tmp = Writes(), None
    if rank == 0:
        def make_tmp():
            nonlocal tmp
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        writes.run(make_tmp)
    try:
        export = _Export(model, params, hf, transform, rank)
        total_size = sum(_save_file(export, hf, fname, tmp, writes) for fname in hf.files)
        if rank == 0:
            writes.run(lambda: _write_index_and_extras(hf, tmp, total_size, export.names_written))
            time.sleep(env.fault_save_delay())
            writes.run(lambda: os.rename(tmp, out_dir))
        if writes.failed_anywhere():
            raise disk_full(out_dir.parent, f"the model {out_dir}", needed=total_size)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_file(export: "_Export", hf: HFFolder, fname: str, tmp: Path | None, writes: Writes) -> int:
    """Gather, convert and (if `tmp`, i.e. on rank 0) write one input file's tensors; returns its byte size."""
    tensors, size = {}, 0
    with _open(hf.folder / fname) as f:
        for name in hf.files[fname]:  # the same order on every rank: full_tensor() is a collective
            # A tensor that is not a trained weight of the model (rotary inv_freq, a buffer) is copied as it was.
            written = export(name) if export.exported(name) else {name: f.get_tensor(name)}
            if written is None:  # held by another pipeline stage, sent to rank 0
                size += math.prod(hf.shapes[name]) * hf.dtypes[name].itemsize
                continue
            for out, tensor in written.items():
                dtype = hf.dtypes[out] if out in hf.dtypes else torch.bfloat16  # a dequantized one: bf16
                size += tensor.numel() * dtype.itemsize
                if out in hf.shapes:
                    assert tuple(tensor.shape) == hf.shapes[out], (out, tensor.shape, hf.shapes[out])
                if tmp is not None:
                    tensors[out] = tensor.to(dtype).contiguous()
                export.names_written.setdefault(fname, []).append(out)
            del written  # on every rank, before the next gather: only the file's kept tensors stay
        metadata = {**(f.metadata() or {}), "format": "pt"}
    if tmp is not None:
        writes.run(lambda: save_file(tensors, str(tmp / fname), metadata=metadata))
    return size


class _Export:
    """Checkpoint tensors from the model's whole weights, each weight gathered (a collective) and transformed once. A
    stacked experts' weight is kept while its experts are written one by one (a file lists a layer's experts'
    projections in turn: gathering the whole weight for each expert would take E collectives); its layer's three are
    kept, no more."""

    KEPT = 3

    def __init__(self, model, params: dict, hf: HFFolder, transform, rank: int):
        self.model, self.params, self.hf, self.transform, self.rank = model, params, hf, transform, rank
        self.kept: dict[str, dict[str, torch.Tensor] | None] = {}
        self.aliases = getattr(hf.names, "aliases", {})
        # The whole model's parameters (a pipeline device's stages hold some: the others are sent to rank 0).
        self.whole = set(dict(whole_model(model).named_parameters(remove_duplicate=False)))
        self.names_written: dict[str, list[str]] = {}  # file -> the tensor names written to it (the index's)

    def exported(self, name: str) -> bool:
        """Whether the tensor is written from the model (a parameter, or a part of one): not a buffer or rotary table.
        The same answer on every rank (whole_parameter is a collective)."""
        param = self.hf.params[name]
        return param is not None and (param in self.whole or param in self.aliases)

    def __call__(self, name: str) -> dict[str, torch.Tensor] | None:
        """What to write in place of checkpoint tensor `name`: itself, from the model (None: another pipeline stage's,
        sent to rank 0); for a dequantized parameter, the parameter under its own name in place of its first packed
        tensor, and nothing in place of the others."""
        param = self.hf.params[name]
        if param not in self.kept:
            if len(self.kept) == self.KEPT:
                del self.kept[next(iter(self.kept))]
            whole = self._whole(param)
            self.kept[param] = None if whole is None else self.hf.names.scatter(param, whole, self.hf.sources[param])
        tensors = self.kept[param]
        if tensors is None:
            return None
        if name in tensors:
            return {name: tensors[name]}
        return tensors if name == self.hf.sources[param][0] else {}

    def _whole(self, param: str) -> torch.Tensor | None:
        """One whole weight, gathered and transformed; its intermediates die on return."""
        source = self.aliases.get(param, param)
        whole = self._checkpoints(source) if self._narrowed(source) else whole_parameter(self.model, source, self.params)
        if whole is not None and hasattr(self.hf.names, "stacked"):
            whole = self.hf.names.stacked(source, whole)
        return whole if self.transform is None or whole is None else self.transform(source, whole)

    def _narrowed(self, param: str) -> bool:
        """Whether the model holds this frozen weight in a narrower dtype than the checkpoint (LoRA's base stored in
        the bf16 it computes in, train/mixed_precision.py): then the checkpoint's own values are what it was, and what
        a merge adds the adapters to. Decided alike on every rank (no gather is skipped by some only). NF4 weights
        (QLoRA) are merged into as trained, dequantized, as torchtune merges them."""
        p = self.params.get(param)
        if p is None or p.requires_grad or is_nf4(p) or param not in self.hf.sources:
            return False
        return p.dtype.itemsize < min(self.hf.dtypes[name].itemsize for name in self.hf.sources[param])

    def _checkpoints(self, param: str) -> torch.Tensor | None:
        """The weight read from the checkpoint's files in fp32, on rank 0 (None elsewhere)."""
        if self.rank != 0:
            return None
        names, parts = self.hf.sources[param], {}
        for fname, in_file in self.hf.files.items():  # each file opened once, in order
            wanted = [n for n in in_file if n in names]
            if wanted:
                with _open(self.hf.folder / fname) as f:
                    parts.update({n: f.get_tensor(n).float() for n in wanted})
        return self.hf.names.gather(param, parts)


def _write_index_and_extras(hf: HFFolder, tmp: Path, total_size: int, written: dict[str, list[str]]) -> None:
    """The index (its weight map as written: a dequantized weight's own name in place of its packed tensors' names),
    and every other file but weights and subfolders as it was (config.json without its quantization_config where the
    weights were dequantized)."""
    index = hf.folder / INDEX
    if index.exists():
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = total_size
        where = {name: fname for fname, names in written.items() for name in names}
        if set(where) != set(data["weight_map"]):  # a dequantized weight in place of its packed tensors, in order
            mapped = {}
            for name in data["weight_map"]:
                out = name if name in where else hf.params.get(name)
                if out in where:
                    mapped.setdefault(out, where[out])
            data["weight_map"] = mapped
        (tmp / INDEX).write_text(json.dumps(data, indent=2) + "\n")
    for path in sorted(hf.folder.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, tmp / path.name)
    if hf.spec.mxfp4:
        config = json.loads((hf.folder / "config.json").read_text())
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
