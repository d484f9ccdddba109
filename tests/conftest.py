"""Shared fixtures: tiny Hugging Face checkpoints of each family, made by transformers itself.

Run the suite with `make test`. Nothing is downloaded: the tokenizer is trained on the demo data
and the weights are a seeded random initialisation written by `save_pretrained`.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# torchtune's wheel ships a top-level `recipes` that raises on import: ours must come first.
sys.path.insert(0, str(ROOT))

from moai_recipes.models.tiny import demo_texts  # noqa: E402
from tests.helpers import machine_cache, make_hf_checkpoint, write_varied_text  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2")


# The modules that take longest, in seconds of one worker (`bash .ci/run` on a fresh clone of this 2-core machine,
# cold caches, 2026-11-28; test_architectures less the traces that run on real tensors since). `make test` hands
# whole modules to its workers in the order collected (--no-loadscope-reorder), and they are collected longest first:
# the longest start at once, the short ones fill in at the end, and the workers end together instead of one running
# a long module alone while the other core idles (in the order of 2026-11-26, which lacked test_architectures,
# test_gpu_check and test_vision, one worker ended 49 s after the other). A module not named here counts as short;
# a wrong figure costs balance, never a test. test_compile (118 s) is placed second, above its figure: test_checkpoints
# and test_architectures side by side, each spawning its runs' processes, were both 20% slower (an order of
# 2026-11-26), and the worker that ends test_compile first takes test_checkpoints.
LONGEST_FIRST = {"test_architectures.py": 155, "test_compile.py": 150, "test_checkpoints.py": 133,
                 "test_gpu_check.py": 89, "test_export.py": 84, "test_layouts.py": 77, "test_context_parallel.py": 70,
                 "test_smollm2.py": 66, "test_vision.py": 57, "test_precision.py": 55, "test_full_finetune.py": 52,
                 "test_grpo.py": 47, "test_eval.py": 46, "test_readme.py": 43, "test_install.py": 41,
                 "test_cli.py": 39, "test_planner.py": 36, "test_dpo.py": 32, "test_expert_parallel.py": 31,
                 "test_optimizer_in_backward.py": 29, "test_dpo_vision.py": 26, "test_moe.py": 25,
                 "test_lora_finetune.py": 25, "test_multinode.py": 21, "test_grpo_vision.py": 20,
                 "test_out_of_memory.py": 20, "test_generate.py": 17}

# Offline from the start: `datasets` and huggingface_hub read it as they are imported, and a test module may import
# them as it is collected, before any fixture (_quiet_env) runs; in-process runs then meet the Hub as commands do.
os.environ["HF_HUB_OFFLINE"] = "1"

# Under pytest-xdist each worker gets its share of the cores for the runs it makes (in this process and the
# processes it starts): two workers of two threads each on two cores made OpenMP's threads wait on each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# This CPU's speed as the planner reads it from the suite's cache (per thread: a quiet measurement of this
# machine, rounded), never measured during the suite: a measurement depends on how busy the machine is, and
# one taken while the suite ran was taken again ten minutes later (planner/cpu_speed.py), so a plan chosen
# between two runs that must match bit for bit could change (packed rows for one, padded for the other). Tests
# of the measurement itself give their own cache.
CPU_SPEED_PER_THREAD = {"fp32_flops": 9e10, "bytes_per_s": 2e10, "bf16_flops": 2.2e11}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -LONGEST_FIRST.get(item.path.name, 0))  # stable: the order within a module is kept


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
    return write_varied_text(tmp_path_factory.mktemp("data") / "varied.jsonl", " ".join(demo_texts()).split())


@pytest.fixture(scope="session", autouse=True)
def _pinned_cpu_speed(tmp_path_factory):
    from moai_recipes.files import write_json
    from moai_recipes.planner.cpu_speed import speed_key

    cache = machine_cache(tmp_path_factory)
    cache.mkdir(parents=True, exist_ok=True)
    write_json(cache / "cpu-speed.json", {
        speed_key(threads): {**{k: v * threads for k, v in CPU_SPEED_PER_THREAD.items()}, "quiet": True,
                             "measured_at": 0.0}
        for threads in range(1, (os.cpu_count() or 1) + 1)})


@pytest.fixture(scope="session", autouse=True)
def _quiet_env(tmp_path_factory):
    """The suite's environment, for every test and every fixture: session-wide, so that it is set before the module
    fixtures that make reference runs (a reference made without MOAI_CACHE read the developer's cache and its CPU
    speed, measured under the suite's load, and planned another micro-batching than the runs compared with it)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("WANDB_MODE", os.environ.get("WANDB_MODE", "offline"))
    patch.setenv("WANDB_SILENT", "true")
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("MOAI_CACHE", str(machine_cache(tmp_path_factory)))
    # The developer's own `moai switch` choice (and running recipes) must never reach a test.
    patch.setenv("MOAI_HOME", str(tmp_path_factory.getbasetemp() / "moai-home"))
    yield
    patch.undo()


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
