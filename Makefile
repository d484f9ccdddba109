# make demo: install, then fine-tune the tiny model on the demo data on the CPU (about a minute in all).
# make test: install, then run the test suite (about twelve minutes on two cores).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a looser request would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	rm -f $(VENV)/.installed-*; touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m recipes.full_finetune model=tiny dataset=demo flavor=cpu epochs=40 batch_size=8 optimizer.lr=3e-3 optimizer.warmup_steps=10

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) outputs wandb .pytest_cache
