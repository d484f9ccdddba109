"""The product as `pip install .` installs it: a wheel in a fresh venv, used from a folder outside the checkout.

Run: python -m pytest tests/test_install.py -q (about a minute). The wheel is built from a copy of what it
ships (pyproject.toml, README.md, moai_recipes/), installed without its dependencies into a new venv that
borrows them from this one (a .pth file: torch and torchtune are not installed again), so that nothing of
the checkout can be imported there: the recipes, their configs and the `moai` script must all come from
the wheel.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ folder of a fresh venv with the wheel installed."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "moai_recipes", src / "moai_recipes", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(root / "dist"), str(src)], check=True, timeout=300)
    wheel = next((root / "dist").glob("moai_recipes-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "moai_recipes/configs/full_finetune.yaml" in names and "moai_recipes/configs/model/mistral.yaml" in names
    assert "moai_recipes/recipes/full_finetune.py" in names and "moai_recipes/assets/demo.jsonl" in names
    assert not any(n.startswith("recipes/") for n in names)  # torchtune's wheel owns the top-level name

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # Our dependencies, from this venv. Its .pth files are not read there: the editable checkout stays out.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)
    return venv / "bin"


def run(bin_dir: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(bin_dir / "moai"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_installed_wheel_runs_every_recipe_and_tool_from_any_folder(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run(installed, "run", "full_finetune", "--cfg", "job", cwd=elsewhere)
    assert where.returncode == 0, where.stderr
    probe = subprocess.run([str(installed / "python"), "-c", "import moai_recipes; print(moai_recipes.__file__)"],
                           cwd=elsewhere, capture_output=True, text=True)
    assert "site-packages" in probe.stdout and str(ROOT) not in probe.stdout, probe.stdout + probe.stderr

    full = run(installed, "run", "full_finetune", "max_steps=2", "batch_size=4", "logger=stdout",
               "output_dir=full", cwd=elsewhere)
    assert full.returncode == 0, full.stdout + full.stderr
    assert "[Step 2/2]" in full.stdout and (elsewhere / "full" / "model" / "config.json").exists()

    export = run(installed, "run", "export", "model.checkpoint_dir=full/model", "out=full.gguf", cwd=elsewhere)
    assert export.returncode == 0 and (elsewhere / "full.gguf").stat().st_size > 0, export.stdout + export.stderr
    held_out = run(installed, "run", "eval", "model.checkpoint_dir=full/model", "dataset.val_split=0.25",
                   "logger=stdout", "output_dir=eval", cwd=elsewhere)
    assert held_out.returncode == 0 and "perplexity" in held_out.stdout, held_out.stdout + held_out.stderr

    lora = run(installed, "run", "lora_finetune", "flavor=cpu-2", "max_steps=2", "batch_size=4", "logger=stdout",
               "output_dir=lora", cwd=elsewhere)
    assert lora.returncode == 0, lora.stdout + lora.stderr
    assert (elsewhere / "lora" / "adapter" / "adapter_config.json").exists()

    plan = run(installed, "run", "plan", "flavor=4xlarge", "model=llama3_70b", "batch_size=512", "output_dir=plan",
               cwd=elsewhere)
    assert plan.returncode == 0 and "Chosen:" in plan.stdout, plan.stderr
    assert json.loads((elsewhere / "plan" / "plan.json").read_text())["flavor"] == "4xLarge.2048GB"

    ls = run(installed, "ls", cwd=elsewhere)
    assert ls.returncode == 0 and "lora_finetune" in ls.stdout and "qwen2_5_7b" in ls.stdout, ls.stderr
    cp = run(installed, "cp", "full_finetune", "mine.yaml", cwd=elsewhere)
    assert cp.returncode == 0 and "batch_size: 16" in (elsewhere / "mine.yaml").read_text(), cp.stderr
    valid = run(installed, "validate", "mine.yaml", "flavor=cpu-2", cwd=elsewhere)
    assert valid.returncode == 0 and valid.stdout.rstrip().splitlines()[-1].startswith("OK"), valid.stdout + valid.stderr
    mine = run(installed, "run", "full_finetune", "--config-path", str(elsewhere), "--config-name", "mine",
               "--cfg", "job", cwd=elsewhere)
    assert mine.returncode == 0 and "batch_size: 16" in mine.stdout, mine.stderr
    bad = run(installed, "run", "full_finetune", "model=mistrall", cwd=elsewhere)
    assert bad.returncode == 2 and "did you mean model=mistral" in bad.stderr and "Traceback" not in bad.stderr


def test_make_refuses_a_python_older_than_the_package_asks_before_it_installs_anything(tmp_path):
    """On Python 3.10, `make` downloaded torch's multi-GB CUDA build before pip found no transformers 5.24 for it and
    said only that: the Makefile refuses an interpreter below pyproject.toml's requires-python first, by name."""
    import tomllib

    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert floor == ">=3.11", floor  # the Makefile's check says 3.11 too
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    old = tmp_path / "python3.10"  # answers as Python 3.10 does: the version check fails, --version says which
    old.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'Python 3.10.13'; exit 0; }\n"
                   "[ \"$1\" = -c ] && exit 1\necho \"asked to run $*\" >> \"$(dirname \"$0\")/ran\"\nexit 0\n")
    old.chmod(0o755)
    r = subprocess.run(["make", "install", f"PYTHON={old}"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"moai-recipes needs Python 3.11 or newer (transformers 5.24 does); {old} is Python 3.10.13" in r.stderr
    assert not (tmp_path / ".venv").exists() and not (tmp_path / "ran").exists(), r.stdout  # no venv, no pip
    r = subprocess.run(["make", "install", f"PYTHON={tmp_path / 'nothing'}"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and f"{tmp_path / 'nothing'} is not found" in r.stderr, r.stderr
