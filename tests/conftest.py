"""Shared fixtures: tiny Hugging Face checkpoints of each family, made by transformers itself.

Run the suite with `make test`. Nothing is downloaded: the tokenizer is trained on the demo data
and the weights are a seeded random initialisation written by `save_pretrained`.
"""

import json
import os
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# torchtune's wheel ships a top-level `recipes` that raises on import: ours must come first.
sys.path.insert(0, str(ROOT))

from moai_recipes.models.tiny import demo_texts  # noqa: E402
from tests.helpers import machine_cache, make_hf_checkpoint  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2")


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """One tiny checkpoint per family: {'llama': Path, 'mistral': Path, 'qwen2': Path}."""
    root = tmp_path_factory.mktemp("hf")
    return {f: make_hf_checkpoint(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The embedded demo checkpoint (tiny Llama, its tokenizer and chat template), written for this module."""
    from moai_recipes.models.tiny import tiny_checkpoint_dir

    return tiny_checkpoint_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from moai_recipes.data.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(tiny_dir)


@pytest.fixture(scope="module")
def varied_file(tmp_path_factory):
    """Plain text whose samples spread from a few words to the whole max_seq_len, with a long tail."""
    words = " ".join(demo_texts()).split()
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "varied.jsonl"
    with open(path, "w") as f:
        for _ in range(48):
            n = min(int(rng.lognormvariate(3.0, 0.9)) + 2, 200)
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    return path


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("WANDB_MODE", os.environ.get("WANDB_MODE", "offline"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MOAI_CACHE", str(machine_cache(tmp_path_factory)))
    # The developer's own `moai switch` choice (and running recipes) must never reach a test.
    monkeypatch.setenv("MOAI_HOME", str(tmp_path_factory.getbasetemp() / "moai-home"))


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(megabytes): a tmpfs of that size mounted for the test (tests/helpers.SmallDisk), unmounted after."""
    from tests.helpers import SmallDisk

    disks = []

    def make(megabytes: int) -> SmallDisk:
        disks.append(SmallDisk(tmp_path / f"disk{len(disks)}", megabytes))
        return disks[-1]

    yield make
    for disk in disks:
        disk.close()
