"""Hugging Face checkpoints in and out, plain and FSDP2-sharded, checked against transformers; the export's memory.

Run: python -m pytest tests/test_hf_checkpoint.py -q
"""

import json
import math
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers
from conftest import make_hf_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moai_recipes.errors import UserError
from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.hf_format import (
    INDEX,
    HFFolder,
    load_weights,
    save_weights,
)
from tests.helpers import run_command
from tests.hf_checkpoint_ranks import SEQ, tokens_for


def make_llama32_tied(folder: Path) -> Path:
    """Llama 3.2 style: tied embeddings and llama3 scaled RoPE (conftest makes neither)."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def add_lm_head(folder: Path) -> Path:
    """Some tied checkpoints store lm_head.weight anyway (a copy of the embeddings)."""
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return {
        "llama": hf_checkpoints["llama"],
        "mistral": hf_checkpoints["mistral"],
        "qwen2_tied": make_hf_checkpoint(root / "qwen2_tied", "qwen2", tie=True),
        "qwen2_tied_lm_head": add_lm_head(make_hf_checkpoint(root / "qwen2_lm_head", "qwen2", tie=True, seed=2)),
        "llama_sharded": make_hf_checkpoint(root / "llama_sharded", "llama", max_shard_size="100KB", seed=3),
        "mistral_bf16": make_hf_checkpoint(root / "mistral_bf16", "mistral", dtype="bfloat16", seed=4),
        "llama32_tied": make_llama32_tied(root / "llama32_tied"),
    }


def tune_model(hf: HFFolder) -> torch.nn.Module:
    """The recipe's order: build on meta, give memory, recompute RoPE, load."""
    with torch.device("meta"):
        model = build_model(hf.spec, max_seq_len=SEQ)
    model.to_empty(device="cpu")
    init_buffers(model, device="cpu")
    load_weights(model, hf)
    return model.eval()


@torch.no_grad()
def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model(tokens).logits


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Same files, tensor names per file, dtypes, shapes, bit-identical tensors, same other files."""
    assert sorted(p.name for p in a.iterdir() if p.is_file()) == sorted(p.name for p in b.iterdir())
    ca, cb = HFFolder.open(a), HFFolder.open(b)
    assert {f: sorted(n) for f, n in ca.files.items()} == {f: sorted(n) for f, n in cb.files.items()}
    assert ca.dtypes == cb.dtypes and ca.shapes == cb.shapes
    for fname, names in ca.files.items():
        with safe_open(a / fname, "pt") as fa, safe_open(b / fname, "pt") as fb:
            assert all(torch.equal(fa.get_tensor(n), fb.get_tensor(n)) for n in names), fname
    for path in a.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", INDEX)):
            assert path.read_bytes() == (b / path.name).read_bytes(), path.name
    if (a / INDEX).exists():
        ia, ib = json.loads((a / INDEX).read_text()), json.loads((b / INDEX).read_text())
        assert ia["weight_map"] == ib["weight_map"]
        size = sum(math.prod(shape) * cb.dtypes[n].itemsize for n, shape in cb.shapes.items())
        assert ib["metadata"]["total_size"] == ia["metadata"]["total_size"] == size


CASES = ["llama", "mistral", "qwen2_tied", "qwen2_tied_lm_head", "llama_sharded", "mistral_bf16", "llama32_tied"]


@pytest.mark.parametrize("case", CASES)
def test_load_matches_transformers_and_save_mirrors_input(case, checkpoints, tmp_path):
    folder = checkpoints[case]
    hf = HFFolder.open(folder)
    model = tune_model(hf)
    tokens = tokens_for(hf)
    with torch.no_grad():
        logits = model(tokens)
    torch.testing.assert_close(logits, hf_logits(folder, tokens), atol=1e-4, rtol=0)

    save_weights(model, hf, tmp_path / "out", rank=0)
    assert_same_checkpoint(folder, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the temporary folder was renamed
    torch.testing.assert_close(hf_logits(tmp_path / "out", tokens), logits, atol=1e-4, rtol=0)


def test_input_description(checkpoints):
    hf = HFFolder.open(checkpoints["llama_sharded"])
    assert len(hf.files) > 1 and sum(map(len, hf.files.values())) == len(hf.shapes) == 21
    assert hf.shapes["model.layers.0.self_attn.k_proj.weight"] == (32, 64)
    assert set(HFFolder.open(checkpoints["mistral_bf16"]).dtypes.values()) == {torch.bfloat16}


def test_save_copies_extras_but_not_other_weights_or_subfolders(checkpoints, tmp_path):
    folder = shutil.copytree(checkpoints["mistral"], tmp_path / "in")
    (folder / "special_tokens_map.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"stale")
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.00.pth").write_bytes(b"meta format")
    hf = HFFolder.open(folder)
    save_weights(tune_model(hf), hf, tmp_path / "out", rank=0)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]
    with pytest.raises(FileExistsError):
        save_weights(tune_model(hf), hf, tmp_path / "out", rank=0)


def test_malformed_inputs_are_user_errors(checkpoints, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        HFFolder.open(tmp_path / "nowhere")

    no_config = shutil.copytree(checkpoints["mistral"], tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(UserError, match="no config.json"):
        HFFolder.open(no_config)

    no_weights = shutil.copytree(checkpoints["mistral"], tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no \\*.safetensors"):
        HFFolder.open(no_weights)

    missing_file = shutil.copytree(checkpoints["llama_sharded"], tmp_path / "missing_file")
    (missing_file / "model-00002-of-00006.safetensors").unlink()
    with pytest.raises(UserError, match="model-00002-of-00006.safetensors, missing"):
        HFFolder.open(missing_file)

    truncated = shutil.copytree(checkpoints["llama_sharded"], tmp_path / "truncated")
    shard = truncated / "model-00003-of-00006.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])  # an interrupted download or copy
    with pytest.raises(UserError, match=r"model-00003-of-00006.safetensors: truncated \(\d+ of \d+ bytes\); download"):
        HFFolder.open(truncated)

    int_weights = shutil.copytree(checkpoints["mistral"], tmp_path / "int_weights")
    tensors = load_file(int_weights / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, int_weights / "model.safetensors")
    with pytest.raises(UserError, match="model.norm.weight is I8"):
        HFFolder.open(int_weights)

    unknown = shutil.copytree(checkpoints["mistral"], tmp_path / "unknown")
    save_file({**load_file(unknown / "model.safetensors"), "vision_tower.weight": torch.zeros(2)},
              unknown / "model.safetensors")
    with pytest.raises(UserError, match="vision_tower.weight is not part of a mistral model"):
        HFFolder.open(unknown)


def test_weights_that_do_not_fit_config_json_are_user_errors(checkpoints, tmp_path):
    wrong_shape = shutil.copytree(checkpoints["llama"], tmp_path / "wrong_shape")
    config = json.loads((wrong_shape / "config.json").read_text())
    (wrong_shape / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    hf = HFFolder.open(wrong_shape)
    with pytest.raises(UserError, match=r"mlp.down_proj.weight has shape \[64, 160\] but its config.json needs "
                                        r"\[64, 96\]"):
        tune_model(hf)

    more_layers = shutil.copytree(checkpoints["llama"], tmp_path / "more_layers")
    (more_layers / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(UserError, match=r"no weights for model\.layers\.2\.input_layernorm\.weight, "
                                        r"model\.layers\.2\.mlp\.down_proj\.weight"):  # the checkpoint's names
        tune_model(HFFolder.open(more_layers))

    fewer_layers = shutil.copytree(checkpoints["llama"], tmp_path / "fewer_layers")
    (fewer_layers / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(UserError, match="model.layers.1.* has no place"):
        tune_model(HFFolder.open(fewer_layers))


# ---- two processes, gloo, FSDP2 -------------------------------------------------------------


def two_ranks(work: str, tmp_path: Path, jobs: list[tuple[str, str, str]]) -> None:
    """tests/hf_checkpoint_ranks.py's `work` on two gloo processes, forked from the zygote (which imported the stack
    once: two spawned workers importing it and this module again took 6 s of CPU each)."""
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    r = run_command("tests.hf_checkpoint_ranks", work, str(tmp_path / "rendezvous"), str(tmp_path / "jobs.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.slow
def test_fsdp2_two_processes_load_and_save(checkpoints, tmp_path):
    cases = ["llama_sharded", "qwen2_tied"]
    jobs = [(str(checkpoints[c]), str(tmp_path / c), str(tmp_path / f"{c}.pt")) for c in cases]
    two_ranks("load_and_save", tmp_path, jobs)
    for case, (folder, out_dir, logits_file) in zip(cases, jobs):
        assert_same_checkpoint(Path(folder), Path(out_dir))
        tokens = tokens_for(HFFolder.open(folder))
        torch.testing.assert_close(torch.load(logits_file), hf_logits(Path(folder), tokens), atol=1e-4, rtol=0)


# ---- the export's memory: one input file's tensors at a time, on every rank -------------------


def regroup(src: Path, dst: Path, file_of: Callable[[str], int]) -> Path:
    """Copy a checkpoint with its tensors regrouped into files by `file_of(name)`, with an index."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", INDEX))
    groups: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            groups.setdefault(file_of(name), {})[name] = tensor
    weight_map = {}
    for i, key in enumerate(sorted(groups)):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(groups[key], dst / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(groups[key], fname))
    total = sum(t.numel() * t.element_size() for group in groups.values() for t in group.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX).write_text(json.dumps(index))
    return dst


def _layer(name: str) -> int | None:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def uneven_files(name: str) -> int:
    """8 layers in 7 files of 48 to 506 KiB: the embeddings, layers 0-1, layer 2's attention, its MLP
    with layer 3, layer 4, layers 5-7 (a third of the model), the final norm with the output."""
    layer = _layer(name)
    if layer is None:
        return 0 if "embed_tokens" in name else 6
    if layer == 2:
        return 2 if "self_attn" in name else 3
    return {0: 1, 1: 1, 3: 3, 4: 4, 5: 5, 6: 5, 7: 5}[layer]


def two_halves(name: str) -> int:
    layer = _layer(name)
    return 0 if "embed_tokens" in name or (layer is not None and layer < 4) else 1


@pytest.mark.slow
def test_fsdp2_export_holds_at_most_one_input_file_and_one_tensor_per_rank(tmp_path):
    """The promise that lets a 70B model be exported: no rank ever holds more than one input file's
    tensors plus the one being gathered (the all-gather output, and its q/k permuted copy), measured
    with PyTorch's MemTracker, which counts every tensor an operator creates while it is active."""
    src = make_hf_checkpoint(tmp_path / "src", "llama", num_layers=8, seed=5)
    layouts = {"uneven": regroup(src, tmp_path / "uneven", uneven_files),
               "halves": regroup(src, tmp_path / "halves", two_halves)}
    jobs = [(str(folder), str(tmp_path / f"out-{name}"), str(tmp_path / f"peak-{name}"))
            for name, folder in layouts.items()]
    two_ranks("export_memory", tmp_path, jobs)

    peaks = {}
    for (name, folder), (_, out_dir, peaks_file) in zip(layouts.items(), jobs):
        assert_same_checkpoint(folder, Path(out_dir))
        hf = HFFolder.open(folder)
        nbytes = {n: math.prod(s) * 4 for n, s in hf.shapes.items()}  # fp32 in the files and in the model
        files = {f: sum(nbytes[n] for n in names) for f, names in hf.files.items()}
        largest_file, largest_tensor, model_bytes = max(files.values()), max(nbytes.values()), sum(nbytes.values())
        # A file's kept tensors plus the whole weight being gathered and converted, for the worst file.
        bound = max(files[f] + max(nbytes[n] for n in names) for f, names in hf.files.items())
        rank0, rank1 = (int(Path(f"{peaks_file}.{r}").read_text()) for r in range(2))
        print(f"{name}: peak rank 0 {rank0} B, rank 1 {rank1} B; largest file {largest_file} B, largest tensor "
              f"{largest_tensor} B, bound {bound} B, whole model {model_bytes} B")
        # 1% slack for small tensors an operator may create beside the data (none seen with torch 2.13:
        # the peaks are exact sums of weights); below the smallest matrix here (8 KiB).
        slack = bound // 100
        # Rank 0 keeps one file's tensors for save_file: the tracker sees them, and never more.
        assert largest_file <= rank0 <= bound + slack
        # Rank 1 keeps nothing: at most one gathered tensor and its converted copy.
        assert largest_tensor <= rank1 <= 2 * largest_tensor + slack
        peaks[name] = (rank0, bound, model_bytes)
    rank0, bound, model_bytes = peaks["uneven"]
    assert bound < model_bytes / 2  # so the bound can fail: gathering the whole model would break it
    assert peaks["halves"][0] > 1.4 * rank0  # larger files, larger measured peak: the tracker sees the gathers
