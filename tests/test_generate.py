"""recipes.generate as a person uses it: fine-tune the tiny model, then sample from OUT/model and OUT/adapter.

Run: pytest tests/test_generate.py  (about a minute and a half on two cores). The session fixture trains
for real (two demo facts, the fewest steps that learn them: the whole demo set would take hundreds);
the device_map placement is tested on made-up device sizes, the dispatch on the CPU (and on GPUs when
there are some).
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moai_recipes.config.compose import load_config
from moai_recipes.data.tokenizer import prompt_ids
from moai_recipes.errors import UserError
from moai_recipes.inference.device_map import (
    STRATEGIES,
    decoder_blocks,
    describe,
    device_budgets,
    dispatch,
    place_blocks,
    setup_caches,
)
from moai_recipes.models.tiny import DEMO_DATA
from tests.helpers import machine_cache, make_hf_checkpoint
from tests.helpers import run_recipe

FRANCE, COW = "What is the capital of France?", "What sound does a cow make?"


@dataclass
class Runs:
    model: Path  # OUT/model of a full fine-tune of the tiny model on the facts
    adapter: Path  # OUT/adapter of a LoRA run on top of that model


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("generate")
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines() if line.strip()]
    data = root / "facts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows if r["instruction"] in (FRANCE, COW)))
    env = {"MOAI_CACHE": str(machine_cache(tmp_path_factory)), "OMP_NUM_THREADS": "1"}
    common = ["dataset=instruct", f"dataset.path={data}", "flavor=cpu", "logger=stdout", "batch_size=2",
              "optimizer.warmup_steps=0", "sample_max_new_tokens=0"]
    full = run_recipe("model=tiny", *common, "epochs=20", "optimizer.lr=3e-3", f"output_dir={root / 'full'}", env=env)
    assert full.returncode == 0, full.stdout + full.stderr
    lora = run_recipe(f"model.checkpoint_dir={root / 'full' / 'model'}", *common, "epochs=2", "optimizer.lr=1e-2",
                      "lora.attn_modules=[q_proj,k_proj,v_proj,output_proj]", "lora.apply_to_mlp=true",
                      "save_merged=false", f"output_dir={root / 'lora'}", module="recipes.lora_finetune", env=env)
    assert lora.returncode == 0, lora.stdout + lora.stderr
    return Runs(model=root / "full" / "model", adapter=root / "lora" / "adapter")


def generate(*args, prompt: str) -> tuple[object, list[int]]:
    """The recipe's own generate(), in this process: (tokenizer, completion tokens)."""
    from moai_recipes.recipes.generate import generate as recipe_generate

    return recipe_generate(load_config("generate", list(args)), prompt=prompt)


def text(*args, prompt: str) -> str:
    tokenizer, ids = generate(*args, prompt=prompt)
    return tokenizer.decode(ids)


# --- as a person runs it ----------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_on_the_fine_tuned_model_says_what_it_learned(runs):
    r = run_recipe(f"model.checkpoint_dir={runs.model}", f"prompt={FRANCE}", module="recipes.generate")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris.", r.stdout
    if not torch.cuda.is_available():
        assert "Device map (auto): cpu: tok_embeddings, layers 0-3, norm, output" in r.stderr, r.stderr
    assert "A cow says moo." in text(f"model.checkpoint_dir={runs.model}", prompt=COW)


@pytest.mark.slow
def test_quantized_weights_answer_what_the_model_learned(runs):
    """Weight-only int8 keeps the fine-tuned model's greedy answers token for token; int4 (bf16, groups of 32 on this
    64-wide model) still says what it learned. bench/quantize.py measures speed and memory on SmolLM2-135M."""
    model = f"model.checkpoint_dir={runs.model}"
    for prompt in (FRANCE, COW):
        assert generate(model, "quantize=int8", prompt=prompt)[1] == generate(model, prompt=prompt)[1]
    r = run_recipe(model, "quantize=int4", f"prompt={FRANCE}", "max_new_tokens=12", module="recipes.generate")
    assert r.returncode == 0 and "in bfloat16; 29 linear layers' weights in int4 (groups of 32" in r.stderr, r.stderr
    assert "Paris" in r.stdout, r.stdout
    refused = run_recipe(model, "quantize=int4", "dtype=fp32", f"prompt={FRANCE}", module="recipes.generate")
    assert refused.returncode == 2 and "quantize=int4 computes in bf16" in refused.stderr


@pytest.mark.slow
def test_the_adapter_finds_its_base_and_generates_as_peft_does_token_for_token(runs, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moai_recipes.recipes.generate import main

    assert main([f"adapter_dir={runs.adapter}", f"prompt={FRANCE}"]) == 0  # the base from adapter_config.json
    out = capsys.readouterr()
    assert "Paris" in out.out and f"adapter {runs.adapter} merged (r=8, alpha=16)" in out.err, out

    base = AutoModelForCausalLM.from_pretrained(runs.model, dtype=torch.float32)
    probe = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        base_logits = base(probe).logits
        peft = PeftModel.from_pretrained(base, runs.adapter).eval()
        assert (peft(probe).logits - base_logits).abs().max() > 1e-2  # the adapter matters
    for prompt in (FRANCE, "What is the opposite of fast?"):  # a learned answer, and an unseen question
        tokenizer, ours = generate(f"adapter_dir={runs.adapter}", "max_new_tokens=16", "dtype=fp32", prompt=prompt)
        ids = prompt_ids(tokenizer, prompt, chat=True)
        with torch.no_grad():
            out = peft.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=16, do_sample=False, eos_token_id=tokenizer.stop_ids,
                                pad_token_id=tokenizer.pad_id)[0, len(ids):].tolist()
        theirs = next((out[:i] for i, t in enumerate(out) if t in tokenizer.stop_ids), out)
        assert ours == theirs, (prompt, tokenizer.decode(ours), tokenizer.decode(theirs))


@pytest.mark.slow
def test_an_adapter_whose_base_is_a_hub_name_finds_it_in_the_hub_cache(runs, tmp_path):
    # What peft does with base_model_name_or_path "owner/name": here offline, from a Hub cache made by hand.
    cache = tmp_path / "hub"
    snapshot = cache / "models--me--tiny-facts" / "snapshots" / ("0" * 40)
    shutil.copytree(runs.model, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    for name, base in (("cached", "me/tiny-facts"), ("missing", "me/never-downloaded")):
        adapter = tmp_path / name
        shutil.copytree(runs.adapter, adapter)
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}  # huggingface_hub reads them when first imported
    r = run_recipe(f"adapter_dir={tmp_path / 'cached'}", f"prompt={FRANCE}", module="recipes.generate", env=env,
                   isolated=True)
    assert r.returncode == 0 and "Paris" in r.stdout and f"Model {snapshot}" in r.stderr, r.stdout + r.stderr
    r = run_recipe(f"adapter_dir={tmp_path / 'missing'}", f"prompt={FRANCE}", module="recipes.generate", env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    for words in ("names the base model me/never-downloaded: could not get", "HF_HUB_OFFLINE", "model.checkpoint_dir=DIR"):
        assert words in r.stderr, r.stderr


@pytest.mark.slow
def test_sampling_is_reproducible_and_its_limits_are_greedy(runs):
    model = f"model.checkpoint_dir={runs.model}"
    prompt = 'Say "hi", then: ${x} null, 42'  # taken as typed, not as Hydra syntax
    greedy = generate(model, "max_new_tokens=12", prompt=prompt)[1]
    hot = [model, "max_new_tokens=12", "temperature=1.5"]
    once = generate(*hot, "seed=3", prompt=prompt)[1]
    assert generate(*hot, "seed=3", prompt=prompt)[1] == once != generate(*hot, "seed=4", prompt=prompt)[1]
    assert generate(*hot, "top_k=1", "seed=5", prompt=prompt)[1] == greedy
    assert generate(*hot, "top_p=0.01", "seed=5", prompt=prompt)[1] == greedy  # a nucleus of one token
    assert generate(model, "max_new_tokens=12", "chat=false", prompt=prompt)[1] != greedy  # plain text, no template


@pytest.mark.parametrize("args, words", [
    (["model.checkpoint_dir=/nonexistent/hf"], ["model.checkpoint_dir=/nonexistent/hf", "not a folder"]),
    (["temperature=-1"], ["temperature=-1", ">= 0"]),
    (["top_p=1.5"], ["top_p=1.5", "(0, 1]"]),
    (["top_k=0"], ["top_k=0"]),
    (["device_map=spread"], ["device_map=spread", "balanced_low_0"]),
    (["adapter_dir=/nonexistent/adapter"], ["adapter_dir=/nonexistent/adapter"]),
])
def test_user_mistakes_exit_2_with_one_message(args, words, capsys):
    from moai_recipes.recipes.generate import main

    with pytest.raises(SystemExit) as e:
        main([*args, f"prompt={FRANCE}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("error:") == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.slow
def test_an_adapter_for_another_base_a_dora_adapter_and_a_missing_prompt_exit_2(runs, tmp_path, capsys):
    from moai_recipes.recipes.generate import main

    other = make_hf_checkpoint(tmp_path / "other", "llama")
    with pytest.raises(SystemExit) as e:
        main([f"model.checkpoint_dir={other}", f"adapter_dir={runs.adapter}", f"prompt={FRANCE}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "trained for another base model" in err and str(runs.model) in err, err
    with pytest.raises(UserError, match="prompt="):
        generate(f"model.checkpoint_dir={runs.model}", prompt="")
    dora = tmp_path / "dora"
    shutil.copytree(runs.adapter, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(UserError, match="use_dora=True; only plain LoRA"):  # refused, not silently merged wrong
        generate(f"adapter_dir={dora}", prompt=FRANCE)


# --- device_map: placement on made-up devices, dispatch on this machine ----------------------------------

SIZES = {"tok_embeddings": 4, **{f"layers.{i}": 10 for i in range(8)}, "norm": 1, "output": 4}  # 89 in all
GPUS = {f"cuda:{i}": 100 for i in range(4)}


def on(placement: dict[str, str], device: str) -> list[str]:
    return [name for name, d in placement.items() if d == device]


def test_device_map_sequential_fills_gpu_0_first_and_overflows_to_the_cpu():
    assert set(place_blocks(SIZES, GPUS, "sequential").values()) == {"cuda:0"}
    small = place_blocks(SIZES, {"cuda:0": 30, "cuda:1": 30}, "sequential")
    assert on(small, "cuda:0") == ["tok_embeddings", "layers.0", "layers.1"]
    assert on(small, "cuda:1") == ["layers.2", "layers.3", "layers.4"]
    assert on(small, "cpu") == ["layers.5", "layers.6", "layers.7", "norm", "output"]
    assert set(place_blocks(SIZES, {}, "auto").values()) == {"cpu"}  # no GPU: everything on the CPU


@pytest.mark.parametrize("strategy", ["auto", "balanced"])
def test_device_map_balanced_shares_the_model_evenly(strategy):
    # Accelerate's share: 89 // 4 + 1.25 * the largest layer = 34 on every GPU but the last.
    assert device_budgets(SIZES, GPUS, strategy) == {"cuda:0": 34, "cuda:1": 34, "cuda:2": 34, "cuda:3": 100}
    placement = place_blocks(SIZES, GPUS, strategy)
    assert on(placement, "cuda:0") == ["tok_embeddings", "layers.0", "layers.1", "layers.2"]
    assert on(placement, "cuda:1") == ["layers.3", "layers.4", "layers.5"]
    assert on(placement, "cuda:2") == ["layers.6", "layers.7", "norm", "output"]
    assert describe(placement) == ("cuda:0: tok_embeddings, layers 0-2; cuda:1: layers 3-5; "
                                   "cuda:2: layers 6-7, norm, output")
    one = place_blocks(SIZES, {"cuda:0": 100}, strategy)  # one GPU: nothing to balance
    assert set(one.values()) == {"cuda:0"}


def test_device_map_balanced_low_0_leaves_gpu_0_what_the_others_cannot_hold():
    placement = place_blocks(SIZES, GPUS, "balanced_low_0")
    assert on(placement, "cuda:0") == [] and on(placement, "cpu") == []
    assert on(placement, "cuda:1") == ["tok_embeddings", "layers.0", "layers.1", "layers.2"]
    assert on(placement, "cuda:3") == ["layers.7", "norm", "output"]
    tight = {"cuda:0": 100, "cuda:1": 40, "cuda:2": 45}  # the others hold 85 of 89: GPU 0 gets the rest, 4
    assert device_budgets(SIZES, tight, "balanced_low_0")["cuda:0"] == 4
    assert on(place_blocks(SIZES, tight, "balanced_low_0"), "cuda:0") == ["tok_embeddings"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_device_map_keeps_the_order_and_every_budget(strategy):
    free = {"cuda:0": 50, "cuda:1": 23, "cuda:2": 41}
    placement = place_blocks(SIZES, free, strategy)
    assert list(placement) == list(SIZES)
    order = [d for d in dict.fromkeys(placement.values())]
    assert order == sorted(order, key=lambda d: (d == "cpu", d))  # never back to an earlier device
    budgets = device_budgets(SIZES, free, strategy)
    for device, budget in budgets.items():
        assert sum(SIZES[n] for n in on(placement, device)) <= budget <= free[device]
    with pytest.raises(UserError, match="balanced_low_0"):
        place_blocks(SIZES, free, "spread")


def _reference_and_dispatched(folder: Path, placement_for):
    from moai_recipes.models.build import build_model, init_buffers
    from moai_recipes.models.hf_format import HFFolder, load_weights

    hf = HFFolder.open(folder)
    with torch.device("meta"):
        reference, model = build_model(hf.spec, max_seq_len=64), build_model(hf.spec, max_seq_len=64)
    reference.to_empty(device="cpu")
    init_buffers(reference, device="cpu")
    load_weights(reference, hf)
    placement = placement_for(list(decoder_blocks(model)))
    dispatch(model, placement, main=torch.device(placement["tok_embeddings"]))
    load_weights(model, hf)
    return reference.eval(), model.eval(), placement


@pytest.mark.parametrize("family, tie", [("llama", False), ("qwen2", True)])
def test_dispatch_on_the_cpu_is_the_plain_model_and_cached_greedy_matches(tmp_path, family, tie):
    from moai_recipes.inference.sampling import Sampling, complete
    from moai_recipes.train.answers import greedy_continuation

    folder = make_hf_checkpoint(tmp_path / family, family, tie=tie)
    reference, model, placement = _reference_and_dispatched(folder, lambda blocks: dict.fromkeys(blocks, "cpu"))
    tokens = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)
    setup_caches(model, placement, dtype=torch.float32, max_seq_len=30)
    prompt = tokens[0].tolist()
    greedy = Sampling(temperature=0.0, top_k=None, top_p=1.0, max_new_tokens=20, seed=0)
    assert complete(model, prompt, sampling=greedy, stop_ids=[], device=torch.device("cpu")) == \
        greedy_continuation(reference, prompt, max_new_tokens=20, stop_ids=[], device=torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_dispatch_across_gpus_and_the_cpu_moves_activations_at_the_boundaries(tmp_path):
    from moai_recipes.inference.sampling import Sampling, complete

    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] + ["cpu"]

    def spread(blocks):  # contiguous runs over every GPU, then the CPU
        per = -(-len(blocks) // len(devices))
        return {b: devices[i // per] for i, b in enumerate(blocks)}

    folder = make_hf_checkpoint(tmp_path / "llama", "llama", num_layers=4)
    reference, model, placement = _reference_and_dispatched(folder, spread)
    assert len(set(placement.values())) == len(devices)
    tokens = torch.randint(0, 300, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens.to(devices[0])).cpu(), reference(tokens), rtol=1e-4, atol=1e-4)
    setup_caches(model, placement, dtype=torch.float32, max_seq_len=30)
    greedy = Sampling(temperature=0.0, top_k=None, top_p=1.0, max_new_tokens=16, seed=0)
    setup_caches(reference, dict.fromkeys(placement, "cpu"), dtype=torch.float32, max_seq_len=30)
    assert complete(model, tokens[0].tolist(), sampling=greedy, stop_ids=[], device=torch.device(devices[0])) == \
        complete(reference, tokens[0].tolist(), sampling=greedy, stop_ids=[], device=torch.device("cpu"))
