"""Real-world configurations, built from config.json alone, against transformers.

Each entry is a scaled-down copy of a real model made by transformers, with that model's features
(tied embeddings, RoPE kind, biases, q/k norm, head_dim, grouped-query ratio, norm epsilon). For each:
- our logits within 1e-4 of transformers' in fp32;
- loading then saving gives back the same files, bit for bit (what an lr=0 run writes);
- a LoRA adapter we write loads in peft, with logits equal to ours;
- greedy generation (our KV-cache path) equal to transformers' generate.
The recipes run on Qwen3 in test_full_finetune.py (lr=0) and test_lora_finetune.py (peft). Run:
python -m pytest tests/test_real_configs.py -q -s (-s prints each configuration's largest logit difference)
"""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from moai_recipes.inference.device_map import setup_caches
from moai_recipes.inference.sampling import Sampling, complete
from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.hf_format import HFFolder, load_weights, save_weights
from moai_recipes.models.lora import (
    LoraOptions,
    freeze_base,
    gather_adapters,
    save_adapter,
)

LLAMA3_8X = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
# name: (transformers config class, the real model's features, scaled down: 2 layers, a 256-token vocabulary)
CONFIGS = {
    "SmolLM2-135M": ("LlamaConfig", dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3,
                                         tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)),
    "TinyLlama-1.1B": ("LlamaConfig", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=1,
                                           rope_theta=10000.0, rms_norm_eps=1e-5)),
    "Llama-2-7B": ("LlamaConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                       rope_theta=10000.0, rms_norm_eps=1e-5)),
    "Llama-3.1-8B": ("LlamaConfig", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                         rope_theta=500000.0, rope_scaling=LLAMA3_8X, rms_norm_eps=1e-5)),
    "Llama-3.2-1B": ("LlamaConfig", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                         tie_word_embeddings=True, rope_theta=500000.0,
                                         rope_scaling={**LLAMA3_8X, "factor": 32.0}, rms_norm_eps=1e-5)),
    "Vicuna-13B-16k (linear RoPE)": ("LlamaConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                                         rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "Mistral-7B-v0.3": ("MistralConfig", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                              rope_theta=1000000.0, sliding_window=None, rms_norm_eps=1e-5)),
    "Mistral-Nemo (head_dim 128 of 5120/32)": ("MistralConfig", dict(hidden_size=96, num_attention_heads=4,
                                                                     num_key_value_heads=2, head_dim=32,
                                                                     rope_theta=1000000.0, sliding_window=None)),
    "Qwen2.5-0.5B": ("Qwen2Config", dict(hidden_size=112, num_attention_heads=7, num_key_value_heads=1,
                                         tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "Qwen2.5-7B": ("Qwen2Config", dict(hidden_size=112, num_attention_heads=7, num_key_value_heads=1,
                                       rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "Qwen3-0.6B": ("Qwen3Config", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "DeepSeek-R1-Distill-Qwen-1.5B": ("Qwen2Config", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=1,
                                                          rope_theta=10000.0, sliding_window=4096,
                                                          use_sliding_window=False, rms_norm_eps=1e-6)),
}
SEQ = 24


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def real(request, tmp_path_factory):
    """(name, the transformers model in fp32, its saved folder)."""
    cls, features = CONFIGS[request.param]
    config = getattr(transformers, cls)(vocab_size=256, intermediate_size=160, num_hidden_layers=2,
                                        max_position_embeddings=4096, initializer_range=0.2, **features)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms start at 1 and biases at 0, where a mistake in their place or order would not show
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp("real") / "model"
    model.save_pretrained(folder)
    return request.param, model, folder


def ours(folder, *, lora: LoraOptions | None = None):
    hf = HFFolder.open(folder)
    model = build_model(hf.spec, max_seq_len=64, lora=lora.builder_kwargs() if lora else None)
    init_buffers(model, device="cpu")
    load_weights(model, hf, allow_missing=("lora_a", "lora_b"))
    return hf, model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(seed))


LARGEST = {}  # name -> the largest logit difference, printed for the record


def test_logits_equal_transformers(real):
    name, reference, folder = real
    _, model = ours(folder)
    x = tokens()
    with torch.no_grad():
        got, want = model(x), reference(x).logits
    diff = (got - want).abs().max().item()
    LARGEST[name] = diff
    print(f"{name}: largest logit difference {diff:.2e} (logits up to {want.abs().max().item():.1f})")
    assert diff <= 1e-4


def test_loading_then_saving_gives_the_same_files_bit_for_bit(real, tmp_path):
    _, _, folder = real
    hf, model = ours(folder)
    save_weights(model, hf, tmp_path / "out", rank=0)
    for f in folder.glob("*.safetensors"):
        before, after = load_file(f), load_file(tmp_path / "out" / f.name)
        assert before.keys() == after.keys()
        for k in before:
            assert torch.equal(before[k], after[k]), k
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((folder / "config.json").read_text())


def test_a_lora_adapter_loads_in_peft_with_equal_logits(real, tmp_path):
    from peft import PeftModel

    name, reference, folder = real
    opts = LoraOptions(attn_modules=("q_proj", "k_proj", "v_proj", "output_proj"), apply_to_mlp=True,
                       apply_to_output=not reference.config.tie_word_embeddings, rank=4, alpha=8.0, dropout=0.0,
                       quantize_base=False)
    hf, model = ours(folder, lora=opts)
    freeze_base(model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # trained-looking adapters: B is not zero
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    save_adapter(gather_adapters(model), opts=opts, out_dir=tmp_path / "adapter", base_model=str(folder))
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder).float(),
                                           tmp_path / "adapter").eval()
    x = tokens(3)
    with torch.no_grad():
        got, want, base = model(x), peft_model(x).logits, reference(x).logits
    assert (want - base).abs().max() > 1e-2  # the adapter changes the model
    assert (got - want).abs().max().item() <= 1e-4


def test_greedy_generation_equals_transformers(real):
    _, reference, folder = real
    _, model = ours(folder)
    prompt = tokens(4)[0, :8].tolist()
    setup_caches(model, {f"layers.{i}": "cpu" for i in range(len(model.layers))}, dtype=torch.float32, max_seq_len=32)
    got = complete(model, prompt, sampling=Sampling(temperature=0.0, top_k=None, top_p=1.0, max_new_tokens=16, seed=0),
                   stop_ids=[], device=torch.device("cpu"))
    want = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, 8:].tolist()
    assert got == want


def test_a_tokenizer_of_another_model_is_refused_naming_its_file(tmp_path):
    from moai_recipes.errors import UserError
    from moai_recipes.models.tiny import demo_texts, write_tokenizer
    from moai_recipes.inputs import checked_tokenizer
    from tests.helpers import make_hf_checkpoint

    folder = make_hf_checkpoint(tmp_path / "other", "llama")
    write_tokenizer(folder, demo_texts() * 3, vocab_size=1024)  # another model's, larger tokenizer
    with pytest.raises(UserError, match="tokenizer.json has .* tokens, but config.json's vocab_size is .* another model"):
        checked_tokenizer(HFFolder.open(folder))


LINEAR = {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("rope", [
    {"rope_theta": 5e5, "rope_scaling": LINEAR},  # transformers 4's layout
    {"rope_parameters": {"rope_theta": 5e5, **LINEAR}},  # transformers 5's
    {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}, "rope_scaling": LINEAR},  # both: the legacy wins
    {"rope_theta": 2e5, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}, "rope_scaling": LINEAR},
    {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}},
], ids=["legacy", "parameters", "both", "both-top-theta", "plain"])
def test_rope_is_read_from_config_json_as_transformers_reads_it(family, rope):
    """A config.json may carry RoPE in either layout, or both (transformers 5 keeps a legacy rope_scaling and
    prefers it): we read the theta and the scaling transformers reads, or we would train another model."""
    from moai_recipes.models.spec import spec_from_hf_config

    config = {"model_type": family, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 1024,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **json.loads(json.dumps(rope))}
    theirs = transformers.AutoConfig.for_model(**json.loads(json.dumps(config))).rope_parameters
    spec = spec_from_hf_config(config)
    assert spec.rope_base == pytest.approx(theirs["rope_theta"])
    kind = theirs.get("rope_type", "default")
    if kind == "default":
        assert spec.rope_scaling is None
    else:
        assert spec.rope_scaling["rope_type"] == kind and spec.rope_scaling["factor"] == theirs["factor"]


def test_a_scaling_we_cannot_build_is_refused_in_either_layout():
    """YaRN beside a plain rope_parameters is YaRN for transformers: our own layers refuse it by name (never trained as
    plain RoPE), and model.implementation=auto trains it with transformers' modules, YaRN and all."""
    from moai_recipes.errors import UserError
    from moai_recipes.models.spec import spec_from_hf_config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 1024,
              "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}, "rope_scaling": yarn}
    assert transformers.AutoConfig.for_model(**json.loads(json.dumps(config))).rope_parameters["rope_type"] == "yarn"
    with pytest.raises(UserError, match="rope_type 'yarn'"):
        spec_from_hf_config(config, implementation="native")
    assert spec_from_hf_config(config).implementation == "transformers"
