"""A Hugging Face checkpoint (a LoRA adapter merged into it, if given) written as one GGUF file that llama.cpp runs.

Test: `python -m pytest tests/test_export.py -q`. The `gguf` package (llama.cpp's own) writes the file: its
tensor-name map, its quantizers and its SpecialVocab (merges, special tokens, chat template); what is ours is
the choice of what each tensor becomes, following llama.cpp's convert_hf_to_gguf.py so that a file from here
and one from there agree:
- the architecture: Llama and Mistral are llama.cpp's `llama`, Qwen2/2.5 `qwen2`, Qwen3 `qwen3`;
- llama.cpp's `llama` rotates interleaved pairs while Hugging Face's checkpoints rotate halves: the q and k
  projections of a `llama` file are permuted back (and transformers' GGUF reader permutes them again);
- norms and biases stay fp32; 2-D weights take the format (q8_0 falls back to f16 for a tensor whose rows are not
  a whole number of 32-value blocks, as convert_hf_to_gguf.py does);
- the tokenizer: byte-level BPE (Llama 3, Qwen, SmolLM2, GPT-2 style), with the pre-tokenizer named by the rule
  its tokenizer.json applies. A SentencePiece tokenizer (Mistral 7B) is refused by name, as is anything else the
  format cannot say: a sliding attention window, a RoPE scaling llama.cpp does not implement.
The file is streamed: one tensor in memory at a time (a 70B model never has to fit), written aside and renamed.
"""

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from moai_recipes import env
from moai_recipes.errors import UserError
from moai_recipes.files import free_bytes, in_units, remove, room_for
from moai_recipes.models.hf_format import HFFolder, expert_index, tune_name
from moai_recipes.models.peft_adapter import PeftAdapter, expert_updates

FORMATS = ("f32", "f16", "bf16", "q8_0")
_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
          "mixtral": "llama"}
# A sparse layer's experts, one tensor per projection in a Hugging Face checkpoint, go into a GGUF file stacked
# (convert_hf_to_gguf.py's "merged" names, which gguf's tensor map knows for every Mixture-of-Experts architecture).
_STACKED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# The pre-tokenizer regexes llama.cpp implements (src/llama-vocab.cpp), keyed by what tokenizer.json's Split holds.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


@dataclass(frozen=True)
class Exported:
    path: Path
    fmt: str
    arch: str
    tensors: int
    bytes: int
    tokenizer_pre: str


def export_gguf(hf: HFFolder, out: Path, *, fmt: str, adapter: PeftAdapter | None = None) -> Exported:
    """Write `hf` (with `adapter` merged: W + scale * B @ A in fp32, one rounding to `fmt`) to `out` as GGUF."""
    import gguf

    if hf.spec.family not in _ARCHS:  # an architecture llama.cpp's own converter lays out
        return _through_llama_cpp(hf, out, fmt=fmt, adapter=adapter)
    arch = _arch(hf)
    tokens, types, pre = _vocab(hf)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hf.spec.num_layers)
    plan = [(entry, _gguf_name(name_map, arch, hf, entry.name), _qtype(gguf, entry.shape, fmt, entry.name))
            for entry in _entries(hf)]
    extra = _rope_freqs(hf)
    size = sum(_nbytes(gguf, e.shape, q) for e, _, q in plan) + (4 * extra.size if extra is not None else 0)
    size += sum(len(t.encode()) + 16 for t in tokens) + 2**20
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    if free_bytes(out.parent) < size:
        raise UserError(f"{out} needs about {in_units(size)}, but its disk has {in_units(free_bytes(out.parent))} "
                        "free; free space there or write elsewhere (out=FILE.gguf)")

    _remove_stale(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    with room_for(out.parent, f"the GGUF file {out.name}", needed=size, aside=[tmp]):
        try:
            _write_metadata(gguf, writer, hf, fmt=fmt, arch=arch)
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(pre)
            writer.add_token_list(tokens)
            writer.add_token_types(types)
            writer.add_add_bos_token(_adds_bos(hf.folder))
            gguf.SpecialVocab(hf.folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
            for entry, new, qtype in plan:
                writer.add_tensor_info(new, entry.shape, np.dtype(np.float32), _nbytes(gguf, entry.shape, qtype),
                                       raw_dtype=qtype)
            if extra is not None:
                writer.add_tensor_info("rope_freqs.weight", extra.shape, extra.dtype, extra.nbytes,
                                       raw_dtype=gguf.GGMLQuantizationType.F32)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            updates = expert_updates(adapter, hf.spec) if adapter is not None else {}
            for entry, _, qtype in plan:
                data = _llama_cpp_layout(hf, entry, adapter, updates, arch=arch).numpy()
                writer.write_tensor_data(gguf.quants.quantize(data, qtype))
            if extra is not None:
                writer.write_tensor_data(extra)
            writer.close()
            time.sleep(env.fault_save_delay())  # a test's window to kill an export half-done
            os.replace(tmp, out)
        except BaseException:
            writer.close()
            remove([tmp])
            raise
    return Exported(path=out, fmt=fmt, arch=arch, tensors=len(plan) + (extra is not None), bytes=out.stat().st_size,
                    tokenizer_pre=pre)


def _through_llama_cpp(hf: HFFolder, out: Path, *, fmt: str, adapter: PeftAdapter | None) -> Exported:
    """`hf` written by llama.cpp's converter (models/llama_cpp_converter.py); with `adapter`, the merged model first
    written aside as a checkpoint (loaded whole in fp32 to merge it: the converter reads checkpoints)."""
    from moai_recipes.models import llama_cpp_converter

    config = json.loads((hf.folder / "config.json").read_text())
    text = {**config, **(config.get("text_config") or {})}
    llama_cpp_converter.check(text, hf.folder)
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    if adapter is None:
        llama_cpp_converter.convert(hf.folder, out, fmt=fmt, config=text)
    else:
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.merged-", dir=out.parent) as aside:
            merged = Path(aside) / hf.folder.name
            _write_merged(hf, adapter, merged)
            llama_cpp_converter.convert(merged, out, fmt=fmt, config=text)
    arch, tensors, pre = llama_cpp_converter.described(out)
    return Exported(path=out, fmt=fmt, arch=arch, tensors=tensors, bytes=out.stat().st_size, tokenizer_pre=pre)


def _write_merged(hf: HFFolder, adapter: PeftAdapter, folder: Path) -> None:
    """`hf` with `adapter` merged, written as a checkpoint laid out as `hf` (its files, names and dtypes)."""
    from moai_recipes.models.build import build_model, init_buffers
    from moai_recipes.models.hf_format import load_weights, save_weights
    from moai_recipes.models.peft_adapter import merge_adapter

    with torch.device("meta"):
        model = build_model(hf.spec, max_seq_len=16)
    model.to_empty(device="cpu")
    init_buffers(model, device="cpu")
    load_weights(model, hf)
    with torch.no_grad():
        merge_adapter(model, adapter, hf.spec)
    save_weights(model, hf, folder, rank=0)


@dataclass(frozen=True)
class _Entry:
    """A tensor of the GGUF file: a checkpoint's tensor, or a sparse layer's experts' projection stacked from
    theirs (`sources`, in expert order)."""

    name: str
    shape: tuple
    sources: tuple[str, ...]


def _entries(hf: HFFolder) -> list[_Entry]:
    """The file's tensors in the checkpoint's order (no rotary inv_freq); a stacked projection where its first
    expert comes."""
    entries, stacked = [], {}
    for in_file in hf.files.values():
        for name in in_file:
            tune = tune_name(name)
            if not tune:
                continue
            index = expert_index(name)
            if index is None:
                entries.append(_Entry(name, hf.shapes[name], (name,)))
                continue
            if tune not in stacked:
                stacked[tune] = {}
                entries.append(tune)
            stacked[tune][index] = name
    out = []
    for entry in entries:
        if isinstance(entry, _Entry):
            out.append(entry)
            continue
        experts = stacked[entry]
        sources = tuple(experts[e] for e in range(len(experts)))
        layer, projection = entry.split(".")[1], entry.rpartition(".")[2]
        out.append(_Entry(f"model.layers.{layer}.mlp.experts.{_STACKED[projection]}.weight",
                          (len(sources), *hf.shapes[sources[0]]), sources))
    return out


def _remove_stale(out: Path) -> None:
    """The aside copies of exports to `out` that were killed (their process is gone): never read, only in the way."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            tmp.unlink(missing_ok=True)


def source_type(hf: HFFolder) -> str:
    """llama.cpp's `auto` outtype: bf16 for a checkpoint in bf16, f16 otherwise."""
    return "bf16" if torch.bfloat16 in hf.dtypes.values() else "f16"


def _arch(hf: HFFolder) -> str:
    spec = hf.spec
    if spec.family not in _ARCHS:
        raise UserError(f"{hf.folder}: a {spec.family} model cannot be written as GGUF here; llama, mistral, qwen2 and "
                        "qwen3 can")
    if spec.is_moe and len(spec.moe_layers) < spec.num_layers:
        raise UserError(f"{hf.folder}: layers {sorted(set(range(spec.num_layers)) - set(spec.moe_layers))} of this "
                        f"{spec.family} model keep a dense MLP (config.json's mlp_only_layers or decoder_sparse_step), "
                        "which llama.cpp's Mixture-of-Experts architectures cannot hold beside sparse ones")
    if spec.family == "qwen3_moe" and not spec.norm_topk_prob:
        raise UserError(f"{hf.folder}/config.json has norm_topk_prob=false, and llama.cpp's qwen3moe always "
                        "renormalises the top-k routing weights: the GGUF file would compute another model")
    if spec.sliding_window is not None:
        raise UserError(f"{hf.folder}/config.json turns on a sliding attention window ({spec.sliding_window} "
                        "tokens), which llama.cpp's llama architecture does not apply: the GGUF file would compute "
                        "another model. Export a checkpoint without it")
    return _ARCHS[spec.family]


def _vocab(hf: HFFolder) -> tuple[list[str], list[int], str]:
    """llama.cpp's token list (padded to the embedding's rows), token types and pre-tokenizer name."""
    tokens, types, pre, _ = byte_level_vocab(hf.folder, hf.spec.vocab_size)
    return tokens, types, pre


def byte_level_vocab(folder: Path, n: int) -> tuple[list[str], list[int], str, bool]:
    """A byte-level BPE tokenizer.json as llama.cpp takes it: its token list padded to `n` (the embedding's rows),
    token types, pre-tokenizer name (by the rule it applies), and whether plain text starts with BOS."""
    import gguf

    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or (tok.get("decoder") or {}).get("type") != "ByteLevel":
        raise UserError(f"{path} is not a byte-level BPE tokenizer (a SentencePiece one, as Mistral 7B's?); GGUF "
                        "export here writes byte-level BPE tokenizers (Llama 3, Qwen, SmolLM2, GPT-2 style) only")
    pre = _pre_tokenizer(tok.get("pre_tokenizer"), path)
    tokens: list[str | None] = [None] * n
    for text, i in model["vocab"].items():
        if i < n:
            tokens[i] = text
    types = [gguf.TokenType.NORMAL] * n
    for added in tok.get("added_tokens", []):
        i = added["id"]
        if i < n:
            tokens[i] = added["content"]
            types[i] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    for i, text in enumerate(tokens):
        if text is None:  # embedding rows past the tokenizer (padded to a round size)
            tokens[i], types[i] = f"[PAD{i}]", gguf.TokenType.UNUSED
    return tokens, [int(t) for t in types], pre, _adds_bos(folder)


def _pre_tokenizer(pre: dict | None, path: Path) -> str:
    def byte_level(p, *, regex: bool) -> bool:
        return p.get("type") == "ByteLevel" and bool(p.get("use_regex", True)) == regex and not p.get("add_prefix_space")

    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    kinds = [p.get("type") for p in steps]
    if len(steps) == 1 and byte_level(steps[0], regex=True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_level(steps[1], regex=True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and byte_level(steps[1], regex=False):
        name = _SPLITS.get((steps[0].get("pattern") or {}).get("Regex"))
        if name:
            return name
    raise UserError(f"{path}: its pre-tokenizer ({json.dumps(pre)[:200]}) is not one llama.cpp implements under a "
                    "name; GGUF export here knows Llama 3's, Qwen2's, SmolLM's and GPT-2's")


def _adds_bos(folder: Path) -> bool:
    """Whether plain text starts with the BOS token, as our Tokenizer (data/tokenizer.py) does it."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return config.get("bos_token") is not None and config.get("add_bos_token", True) is not False


def _write_metadata(gguf, writer, hf: HFFolder, *, fmt: str, arch: str) -> None:
    spec = hf.spec
    writer.add_name(hf.folder.name)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[fmt])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.embed_dim)
    writer.add_feed_forward_length(spec.intermediate_dim)
    if spec.is_moe:
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.experts_per_token)
        if arch != "llama":  # Mixtral's experts are its intermediate_size wide
            writer.add_expert_feed_forward_length(spec.expert_dim)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_layer_norm_rms_eps(spec.norm_eps)
    writer.add_vocab_size(spec.vocab_size)
    if spec.head_dim != spec.embed_dim // spec.num_heads:  # Qwen3: heads wider than hidden / heads
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(spec.head_dim)
    scaling = spec.rope_scaling
    if scaling and scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling and scaling["rope_type"] != "llama3":  # llama3's is the rope_freqs tensor
        raise UserError(f"{hf.folder}: {scaling['rope_type']} RoPE scaling cannot be written as GGUF here")


def _rope_freqs(hf: HFFolder) -> np.ndarray | None:
    """Llama 3.1+'s RoPE scaling as llama.cpp takes it: one divisor per frequency (convert_hf_to_gguf.py's rule)."""
    s, spec = hf.spec.rope_scaling, hf.spec
    if not s or s["rope_type"] != "llama3":
        return None
    freqs = 1.0 / (spec.rope_base ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim))
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _gguf_name(name_map, arch: str, hf: HFFolder, name: str) -> str:
    new = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
    if new is None:
        raise UserError(f"{hf.folder}: the tensor {name} has no place in a GGUF {arch} model")
    return new


def _qtype(gguf, shape: tuple, fmt: str, name: str):
    Q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or name.endswith("norm.weight") or fmt == "f32":
        return Q.F32  # what llama.cpp computes norms and biases in
    q = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[fmt]
    block = gguf.GGML_QUANT_SIZES[q][0]
    return q if shape[-1] % block == 0 else Q.F16


def _nbytes(gguf, shape: tuple, qtype) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def _llama_cpp_layout(hf: HFFolder, entry: _Entry, adapter: PeftAdapter | None, updates: dict, *,
                      arch: str) -> torch.Tensor:
    """The tensor of `entry` in fp32, the adapter's product added, in the layout llama.cpp's `arch` computes with."""
    name = entry.name
    if len(entry.sources) > 1 or entry.shape != hf.shapes.get(entry.sources[0]):  # stacked experts
        w = torch.stack([hf.tensor(source).float() for source in entry.sources])
        layer, projection = name.split(".")[2], name.split(".")[-2]
        ours = next(k for k, v in _STACKED.items() if v == projection)
        delta = updates.get(f"layers.{layer}.mlp.experts", {}).get(ours)
        return (w + delta if delta is not None else w).contiguous()
    w = hf.tensor(name).float()
    if adapter is not None and name.endswith(".weight") and name[:-len(".weight")] in adapter.weights:
        a, b = adapter.weights[name[:-len(".weight")]]
        w += adapter.scale * (b.float() @ a.float())
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        heads = hf.spec.num_heads if ".q_proj." in name else hf.spec.num_kv_heads
        w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.contiguous()
