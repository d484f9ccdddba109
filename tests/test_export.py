"""recipes.export format=gguf: the file runs in llama.cpp (llama-cpp-python, the real client) as the model runs in
recipes.generate, transformers' GGUF reader reads it back (bit for bit in the checkpoint's own type), an adapter is
merged as peft merges it, and what the format cannot say is refused by name with nothing left half-written.
The real model's round trip (SmolLM2 taught a fact, exported to q8_0, asked through llama.cpp) is in test_smollm2.
Run: python -m pytest tests/test_export.py -q
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import (ROOT, SmallDisk, command_env, make_hf_checkpoint, make_peft_adapter, run_recipe,
                           without_packages)

pytest.importorskip("llama_cpp")

PROMPT = "Where is the quiet harbour?"


def _llama3_scaled(folder: Path) -> Path:
    """Llama 3.1's RoPE scaling, on a context short enough that a prompt of 30 tokens reaches the scaled band."""
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _renormalised(folder: Path) -> Path:
    """Qwen3-MoE as the released models route (norm_topk_prob, which llama.cpp's qwen3moe always applies)."""
    config = json.loads((folder / "config.json").read_text())
    config["norm_topk_prob"] = True
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return {"llama": _llama3_scaled(make_hf_checkpoint(root / "llama", "llama")),
            "qwen2": make_hf_checkpoint(root / "qwen2", "qwen2", seed=1),
            "qwen3": make_hf_checkpoint(root / "qwen3", "qwen3", seed=2),
            "qwen3_moe": _renormalised(make_hf_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=3)),
            "mixtral": make_hf_checkpoint(root / "mixtral", "mixtral", seed=5)}


def _expert_adapter(base: Path, folder: Path):
    """peft's LoRA of a transformers MoE checkpoint on q_proj and its stacked experts (target_parameters), B drawn so
    that it changes the model, saved in `folder`; the peft model."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                      target_parameters=["mlp.experts.gate_up_proj",
                                                                         "mlp.experts.down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    lora.save_pretrained(folder)
    return lora


def _export(*args):
    r = run_recipe(*args, module="recipes.export")
    assert r.returncode == 0, r.stdout + r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_llama_cpp_tokenizes_and_generates_as_recipes_generate(checkpoints, family):
    from moai_recipes.config.compose import load_config
    from moai_recipes.data.tokenizer import prompt_ids
    from moai_recipes.inference.llama_cpp import greedy_tokens, tokenize
    from moai_recipes.recipes.generate import generate

    folder = checkpoints[family]
    cfg = load_config("generate", [f"model.checkpoint_dir={folder}", "max_new_tokens=24"])
    tokenizer, ours = generate(cfg, prompt=PROMPT)
    ids = prompt_ids(tokenizer, PROMPT, chat=True)
    assert len(ours) == 24  # a random model runs to the limit: every one of the 24 tokens is compared
    for outtype in ("f32", "f16"):
        path = _export(f"model.checkpoint_dir={folder}", f"outtype={outtype}")
        assert path == folder.parent / f"{family}-{outtype}.gguf"
        # The file's tokenizer splits the rendered chat prompt (special tokens and all) as ours does.
        text = tokenizer.render([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        assert tokenize(path, text) == tokenizer.encode(text, add_bos=False, add_eos=False)
        # llama.cpp's greedy continuation of our prompt is ours, token for token (f16's rounding changes none here).
        assert greedy_tokens(path, ids, max_new_tokens=24) == ours, outtype
    assert not list(folder.parent.glob(".*.tmp-*"))


@pytest.mark.parametrize("dtype,outtype", [("float32", "f32"), ("bfloat16", "auto"), ("float16", "auto")])
def test_transformers_reads_the_file_back_bit_for_bit(tmp_path, dtype, outtype):
    import transformers

    folder = make_hf_checkpoint(tmp_path / "model", "llama", dtype=dtype, tie=True)
    path = _export(f"model.checkpoint_dir={folder}", f"outtype={outtype}")
    assert path.name == {"float32": "model-f32.gguf", "bfloat16": "model-bf16.gguf", "float16": "model-f16.gguf"}[dtype]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=getattr(torch, dtype))
    original = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    b, o = back.state_dict(), original.state_dict()
    assert set(b) == set(o)
    assert all(torch.equal(b[k], o[k]) for k in o)  # the q/k permutation undone exactly, every value kept


def test_q8_0_is_half_of_f16_and_close_to_the_model(checkpoints):
    import transformers

    folder = checkpoints["qwen2"]
    q8, f16 = (_export(f"model.checkpoint_dir={folder}", f"outtype={t}") for t in ("q8_0", "f16"))
    assert q8.stat().st_size < 0.65 * f16.stat().st_size
    probe = torch.tensor([[3, 40, 77, 120, 9, 250]])
    back = transformers.AutoModelForCausalLM.from_pretrained(q8.parent, gguf_file=q8.name, dtype=torch.float32)
    original = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        a, b = back(probe).logits, original(probe).logits
    assert (a - b).abs().max() < 0.02 * b.abs().max()  # 8-bit blocks: close, not equal
    assert not torch.equal(a, b)


def test_an_adapter_is_merged_as_peft_merges_it(tmp_path):
    import transformers

    base = make_hf_checkpoint(tmp_path / "base", "llama")
    lora = make_peft_adapter(base, tmp_path / "adapter", ["q_proj", "k_proj", "v_proj"])
    probe = torch.tensor([[3, 40, 77, 120, 9, 250]])
    with torch.no_grad():
        expected = lora.merge_and_unload()(probe).logits
    path = _export(f"adapter_dir={tmp_path / 'adapter'}", f"model.checkpoint_dir={base}", "outtype=f32")
    assert path == tmp_path / "adapter-merged-f32.gguf"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        got = back(probe).logits
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert (plain(probe).logits - expected).abs().max() > 1e-2  # the adapter matters
    assert (got - expected).abs().max() < 1e-5


def test_an_adapter_of_every_expert_is_merged_as_peft_merges_it(tmp_path, checkpoints):
    """A PEFT adapter of transformers' Qwen3-MoE (its attention and its stacked experts' parameters) merged into the
    GGUF file: llama.cpp's greedy tokens are those of peft's merged model in transformers."""
    import transformers

    from moai_recipes.inference.llama_cpp import greedy_tokens

    base = checkpoints["qwen3_moe"]
    lora = _expert_adapter(base, tmp_path / "adapter")
    ids = [3, 40, 77, 120, 9, 250, 31, 8]
    with torch.no_grad():
        merged = lora.merge_and_unload().eval()
        expected = merged.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        assert not torch.equal(plain(torch.tensor([ids])).logits.argmax(-1), merged(torch.tensor([ids])).logits.argmax(-1))
    path = _export(f"adapter_dir={tmp_path / 'adapter'}", f"model.checkpoint_dir={base}", "outtype=f32")
    assert greedy_tokens(path, ids, max_new_tokens=16) == expected and len(expected) == 16


def test_what_gguf_cannot_say_is_refused_by_name(tmp_path):
    spm = make_hf_checkpoint(tmp_path / "spm", "llama")
    tok = json.loads((spm / "tokenizer.json").read_text())
    tok["model"]["byte_fallback"] = True  # as a SentencePiece tokenizer converted to tokenizer.json has it
    (spm / "tokenizer.json").write_text(json.dumps(tok))
    window = make_hf_checkpoint(tmp_path / "window", "mistral")
    config = json.loads((window / "config.json").read_text())
    (window / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
    # Qwen3-MoE that llama.cpp's qwen3moe would compute otherwise: top-k weights left as they are, a dense layer.
    unnormalised = make_hf_checkpoint(tmp_path / "unnormalised", "qwen3_moe")
    dense = make_hf_checkpoint(tmp_path / "dense", "qwen3_moe", num_layers=3)  # layer 1 is dense (mlp_only_layers)
    config = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**config, "norm_topk_prob": True}))
    for args, words in [((f"model.checkpoint_dir={spm}",), "is not a byte-level BPE tokenizer"),
                        ((f"model.checkpoint_dir={window}",), "sliding attention window"),
                        ((f"model.checkpoint_dir={unnormalised}",), "norm_topk_prob=false"),
                        ((f"model.checkpoint_dir={dense}",), "keep a dense MLP"),
                        ((f"model.checkpoint_dir={spm}", f"out={tmp_path / 'x.bin'}"), "ends in .gguf"),
                        (("format=onnx",), "format")]:
        r = run_recipe(*args, module="recipes.export")
        assert r.returncode == 2, r.stdout + r.stderr
        assert words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp-*"))


def test_prompts_without_llama_cpp_say_how_to_get_it_before_writing(tmp_path):
    """`make demo` installs no llama-cpp-python (it builds llama.cpp: minutes): prompts= on such a machine is refused
    with how to get it, exit 2, before any file is written. The package is made unimportable for that process."""
    folder = make_hf_checkpoint(tmp_path / "model", "llama")
    r = run_recipe(f"model.checkpoint_dir={folder}", "prompts=[Hello]", module="recipes.export", isolated=True,
                   env=without_packages(tmp_path / "site", "llama_cpp"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "llama-cpp-python is not installed: pip install llama-cpp-python" in r.stderr, r.stderr
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp-*"))


def test_a_full_disk_or_a_kill_leaves_the_last_file_whole(tmp_path):
    folder = make_hf_checkpoint(tmp_path / "model", "llama", hidden=256, num_layers=4)  # a 12 MB f32 file
    disk = SmallDisk(tmp_path / "small", 4)
    try:
        old = disk.path / "model.gguf"
        old.write_bytes(b"an earlier export")
        r = run_recipe(f"model.checkpoint_dir={folder}", "outtype=f32", f"out={old}", module="recipes.export")
        assert r.returncode == 2 and "free" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert old.read_bytes() == b"an earlier export" and sorted(p.name for p in disk.path.iterdir()) == ["model.gguf"]
    finally:
        disk.close()

    # Killed while writing: the file it replaces stays whole; the next export clears the dead one's aside copy.
    out = tmp_path / "model.gguf"
    out.write_bytes(b"an earlier export")
    env = command_env({"MOAI_FAULT_SAVE_DELAY": "30"})
    p = subprocess.Popen([sys.executable, "-m", "recipes.export", f"model.checkpoint_dir={folder}", "outtype=f32",
                          f"out={out}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".model.gguf.tmp-*")) and time.time() < deadline:
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert out.read_bytes() == b"an earlier export" and list(tmp_path.glob(".model.gguf.tmp-*"))
    _export(f"model.checkpoint_dir={folder}", "outtype=f32", f"out={out}")
    assert out.stat().st_size > 10**7 and not list(tmp_path.glob(".model.gguf.tmp-*"))


# Architectures our own writer does not lay out, written by llama.cpp's converter (models/llama_cpp_converter.py), each
# on a tiny checkpoint of tests/architectures.py. Llama 4's with the chunk and NoPE interval llama.cpp fixes (the
# released models'); Qwen3.5's with MRoPE sections its 4 rotary dimensions hold (llama.cpp stops on more).
_MROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
          "mrope_interleaved": True}
CONVERTED = {"gemma3": {}, "gemma4": {}, "gpt_oss": {}, "qwen3_5": {"rope_parameters": _MROPE},
             "qwen3_5_moe": {"rope_parameters": _MROPE}, "deepseek_v3": {}, "glm4_moe": {}, "phi4": {}, "smollm3": {},
             "llama4": {"attention_chunk_size": 8192, "no_rope_layer_interval": 4, "no_rope_layers": [1, 1, 1, 0],
                        "layer_types": ["chunked_attention"] * 3 + ["full_attention"]}}
# llama.cpp computes in fp32 (its cache too, asked so) with kernels of its own: its logits are ours within this, of
# logits up to 1 (measured: 3e-7 to 2e-4 for most, Gemma 4 2e-3, Qwen3.5's Gated DeltaNet layers 3e-3 and 8e-3 from
# the first position). A file laid out wrong was 0.05 to 0.8 off.
LOGIT_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def converter_cache():
    """Where llama.cpp's converter is fetched to (once a machine: ~/.cache/moai-recipes, or MOAI_TEST_MODELS)."""
    return str(Path(os.environ.get("MOAI_TEST_MODELS") or Path.home() / ".cache" / "moai-recipes"))


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_llama_cpps_converter_writes_a_file_llama_cpp_runs_as_we_do(name, tmp_path, converter_cache):
    from moai_recipes.config.compose import load_config
    from moai_recipes.data.tokenizer import prompt_ids
    from moai_recipes.inference.llama_cpp import greedy_tokens, logits, tokenize
    from moai_recipes.inference.loading import load_for_inference, whole_sequence_logits
    from moai_recipes.models.hf_format import HFFolder
    from moai_recipes.recipes.generate import generate
    from tests.architectures import make_checkpoint

    folder = make_checkpoint(tmp_path / name, name, **CONVERTED[name])
    cfg = load_config("generate", [f"model.checkpoint_dir={folder}", "max_new_tokens=24"])
    tokenizer, ours = generate(cfg, prompt=PROMPT)
    ids = prompt_ids(tokenizer, PROMPT, chat=True)
    r = run_recipe(f"model.checkpoint_dir={folder}", "outtype=f32", module="recipes.export",
                   env={"MOAI_CACHE": converter_cache})
    assert r.returncode == 0, r.stdout + r.stderr
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path == tmp_path / f"{name}-f32.gguf"
    text = tokenizer.render([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    assert tokenize(path, text) == tokenizer.encode(text, add_bos=False, add_eos=False)
    # Every position of the prompt and our continuation: llama.cpp's logits are ours.
    loaded = load_for_inference(cfg, HFFolder.open(folder), None, max_seq_len=64)
    with torch.no_grad():
        expected = whole_sequence_logits(loaded.model, torch.tensor([ids + ours]))[0].float().numpy()
    apart = abs(logits(path, ids + ours) - expected).max()
    assert apart <= LOGIT_TOLERANCE
    # llama.cpp's greedy tokens are ours, token for token: all of them where our best logit leads the runner-up by more
    # than twice the largest difference (then its argmax is ours), up to the first near tie of the random model.
    top2 = torch.tensor(expected[len(ids) - 1:]).topk(2).values
    clear = next((i for i, (a, b) in enumerate(top2.tolist()) if a - b <= 2 * apart), len(ours))
    assert greedy_tokens(path, ids, max_new_tokens=24)[:clear] == ours[:clear]


def test_an_adapter_of_transformers_stacked_experts_is_merged_as_peft_merges_it(tmp_path, converter_cache):
    """A PEFT adapter of Qwen3.5-MoE (attention and stacked experts, PEFT's target_parameters) merged into the file
    llama.cpp's converter writes: llama.cpp's logits are those of peft's merged model in transformers."""
    import transformers

    from moai_recipes.inference.llama_cpp import logits
    from tests.architectures import make_checkpoint

    base = make_checkpoint(tmp_path / "base", "qwen3_5_moe", **CONVERTED["qwen3_5_moe"])
    lora = _expert_adapter(base, tmp_path / "adapter")
    ids = [3, 40, 77, 120, 9, 250, 31, 8]
    with torch.no_grad():
        expected = lora.merge_and_unload()(torch.tensor([ids])).logits[0].numpy()
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(torch.tensor([ids]))
    assert abs(plain.logits[0].numpy() - expected).max() > 0.05  # the adapter matters
    r = run_recipe(f"adapter_dir={tmp_path / 'adapter'}", f"model.checkpoint_dir={base}", "outtype=f32",
                   module="recipes.export", env={"MOAI_CACHE": converter_cache})
    assert r.returncode == 0, r.stdout + r.stderr
    assert abs(logits(tmp_path / "adapter-merged-f32.gguf", ids) - expected).max() <= LOGIT_TOLERANCE


@pytest.mark.parametrize("name, fields, words", [
    ("llama4", {}, "attention_chunk_size=16, and llama.cpp's llama4_text architecture fixes it at 8192"),
    ("qwen3_5", {}, "mrope_section [11, 11, 10] covers 64 rotary dimensions of the 4 its heads rotate")])
def test_what_llama_cpp_would_compute_otherwise_is_refused_by_name(name, fields, words, tmp_path):
    from tests.architectures import make_checkpoint

    folder = make_checkpoint(tmp_path / name, name, **fields)
    r = run_recipe(f"model.checkpoint_dir={folder}", "outtype=f32", module="recipes.export")
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp-*"))
