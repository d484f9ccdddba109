"""Config composition: every shipped config composes, overrides apply, mistakes are clear. Run: pytest tests/test_config.py"""

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from moai_recipes.config.compose import (
    CONFIG_DIR,
    group_options,
    load_config,
    recipe_groups,
)
from moai_recipes.errors import UserError
from tests.helpers import ROOT

RECIPES = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def test_the_groups_have_the_options_the_product_promises():
    opts = group_options()
    assert {"tiny", "llama3_2_1b", "llama3_2_3b", "llama3_8b", "llama3_70b", "mistral", "qwen2_5_0_5b", "qwen2_5_7b",
            "qwen2_5_14b", "qwen2_5_72b"} <= set(opts["model"])
    assert {"demo", "instruct", "chat", "text"} <= set(opts["dataset"])
    assert {"auto", "cpu", "cpu-2", "cpu-4", "small", "medium", "large", "xlarge", "1.5xlarge", "2xlarge", "3xlarge", "4xlarge",
            "6xlarge", "8xlarge", "12xlarge", "24xlarge", "48xlarge"} <= set(opts["flavor"])
    assert {"wandb", "stdout"} <= set(opts["logger"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_option_of_every_group_composes(recipe):
    """Every option of a group, each in one of the recipes that have the group, dealt out in turn: a compose takes
    0.1 s of Hydra, and every option in every recipe took 40 s of the suite."""
    for group, options in group_options().items():
        holders = [r for r in RECIPES if group in recipe_groups(CONFIG_DIR / f"{r}.yaml")]
        for option in options[holders.index(recipe)::len(holders)] if recipe in holders else []:
            cfg = load_config(recipe, [f"{group}={option}"])
            assert cfg[group] is not None


def test_overrides_reach_every_level():
    cfg = load_config("full_finetune", ["batch_size=64", "optimizer.lr=1e-4", "flavor=4xlarge",
                                        "flavor.device_memory_gb=0.5", "plan.recompute=full", "model=mistral"])
    assert (cfg.batch_size, cfg.optimizer.lr, cfg.flavor.name, cfg.flavor.device_memory_gb) == (64, 1e-4, "4xLarge.2048GB", 0.5)
    assert cfg.plan.recompute == "full" and cfg.model.architecture.model_type == "mistral"


@pytest.mark.parametrize("argv, words", [
    (["batch_sze=3"], ["batch_sze", "batch_size"]),
    (["optimizer.lrr=1"], ["optimizer.lrr", "optimizer.lr"]),
    (["flavor=4xlarg"], ["4xlarg", "4xlarge"]),
    (["model=llama9"], ["llama9", "llama3_8b"]),
    (["batch_size=abc"], ["batch_size", "abc"]),
    (["batch_size=0"], ["batch_size=0"]),
    (["plan.recompute=some"], ["plan.recompute", "selective"]),
    (["logger=slack"], ["slack", "stdout"]),
    (["--cfg", "yaml"], ["--cfg", "job"]),
])
def test_mistakes_name_the_bad_value_and_what_is_valid(argv, words):
    with pytest.raises(UserError) as e:
        load_config("full_finetune", argv)
    for w in words:
        assert w in str(e.value)


def test_cfg_job_prints_the_composed_config_and_the_mistake_exits_2():
    run = lambda *a: subprocess.run([sys.executable, "-m", "recipes.full_finetune", *a], cwd=ROOT,
                                    capture_output=True, text=True, timeout=120)
    ok = run("--cfg", "job", "batch_size=7", "flavor=cpu-2")
    assert ok.returncode == 0, ok.stderr
    cfg = OmegaConf.create(ok.stdout)
    assert cfg.batch_size == 7 and cfg.flavor.processes == 2 and "model" in cfg and "logger" in cfg
    bad = run("flavor=nope")
    assert bad.returncode == 2
    assert "unknown flavor 'nope'" in bad.stderr and "Traceback" not in bad.stderr


def test_the_documented_column_map_override_works_as_typed(tmp_path):
    """README and docs/data.md write `dataset.column_map.output=response` (no `+`), and so does the missing-column
    message: it renames the column, in a real run, whether the map has keys already or not."""
    from tests.helpers import metrics, run_recipe, write_jsonl

    rows = [{"instruction": f"Say {i}.", "input": "", "response": f"{i}."} for i in range(16)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    common = ["dataset=instruct", f"dataset.path={data}", "max_steps=1", "batch_size=8", "logger=stdout",
              "sample_max_new_tokens=0"]
    missing = run_recipe(*common, f"output_dir={tmp_path / 'missing'}")
    assert missing.returncode == 2 and "map it with dataset.column_map.output=NAME" in missing.stderr, missing.stderr
    r = run_recipe(*common, "dataset.column_map.output=response", f"output_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    assert len(metrics(tmp_path / "run")) == 1
    both = load_config("full_finetune", ["dataset.column_map.output=response", "dataset.column_map.output=answer",
                                         "dataset.column_map.instruction=question"])
    assert dict(both.dataset.column_map) == {"output": "answer", "instruction": "question"}
