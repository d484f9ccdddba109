"""The layout's rules (docs/architecture.md), checked: every module imports on its own, packages import one way
(a layer never imports one above it), environment variables are named in env.py only, no public function takes
more than six parameters.
Run: python -m pytest tests/test_layout.py -q
"""

import ast
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "moai_recipes"
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for p in PACKAGE.rglob("*.py"))


def test_every_module_imports_on_its_own():
    # One interpreter (torch is imported once); our modules are forgotten between imports, so that each is
    # imported first, as a worker or a test importing it alone would: an import cycle fails here.
    script = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "moai_recipes" or m.startswith("moai_recipes.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
"""
    r = subprocess.run([sys.executable, "-c", script, *MODULES], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_torchtunes_and_torchaos_inits_run_only_when_a_name_of_their_own_is_asked_for():
    """moai_recipes/deferred_init.py: torchtune's modules load without its package __init__ (which imports its whole
    library: HF datasets, every model family's builders) and without torchao's (its quantization, kernels, inductor
    passes: torchtune's modules need NF4Tensor alone), the learning-rate schedule without torchtune.training's; their
    own names still answer once their __init__ has run, and torchao's NF4Tensor is one class before and after."""
    script = """
import sys
import moai_recipes
from torchtune.modules import RMSNorm
from torchtune.modules.peft import LoRALinear
from torchtune.modules.common_utils import NF4Tensor
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup
deferred = not any(m in sys.modules for m in ("torchtune.datasets", "torchtune.models", "torchao",
                                              "torchtune.training.checkpointing"))
from torchtune import generation  # a submodule: imported alone
alone = "torchtune.datasets" not in sys.modules
import torchtune
asked = torchtune.__version__[0].isdigit() and "torchtune.datasets" in sys.modules  # its __init__ has run
import torchao.optim  # any other part of torchao: its __init__ runs as always
import torchao, torchtune.training
print(deferred, alone, asked, torchtune.modules.RMSNorm is RMSNorm,
      torchao.__version__[0].isdigit() and "torchao.quantization" in sys.modules,
      torchao.dtypes.nf4tensor.NF4Tensor is NF4Tensor and torchao.dtypes.NF4Tensor is NF4Tensor,
      torchtune.training.get_cosine_schedule_with_warmup is get_cosine_schedule_with_warmup)
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["True"] * 7, r.stdout + r.stderr


def test_moai_recipes_imports_where_torchtune_is_not_installed():
    """The deferral registers torchtune.training only under a torchtune it registered: where torchtune is missing
    (Python's own finder answers None for it, as for any package not installed), `import moai_recipes` still works and
    leaves the error to what needs torchtune."""
    script = """
import importlib.util, sys
found = importlib.util.find_spec
def find_spec(name, package=None):  # torchtune not installed, as importlib answers then
    if name == "torchtune":
        return None
    if name.startswith("torchtune.") and "torchtune" not in sys.modules:
        raise ModuleNotFoundError("No module named 'torchtune'", name="torchtune")
    return found(name, package)
importlib.util.find_spec = find_spec
import moai_recipes
print("torchtune" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stdout + r.stderr


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function (`from moai_recipes import env` included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


# Bottom to top (docs/architecture.md): a module imports from its own layer and those below it, never above.
LAYERS = [
    ("deferred_init", "env", "errors", "files", "flavors", "rewards"),
    ("config",),
    ("models",),
    ("data",),
    ("planner", "inference"),
    ("checkpoint",),
    ("inputs", "train"),
    ("recipes",),
    ("launch",),
    ("tools",),
]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "moai_recipes" or len(parts) < 2 or parts[1] == "__init__":
        return None
    return next(i for i, names in enumerate(LAYERS) if parts[1] in names)


def test_packages_depend_one_way():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        here = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for name in _imports(path):
            there = _layer(name)
            if here is not None and there is not None and there > here:
                upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, upward
    assert {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("_")
            and (p.suffix == ".py" or (p / "__init__.py").exists())} == {n for names in LAYERS for n in names}


def test_environment_variables_are_named_in_env_py_only():
    readers = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if p.name != "env.py" and ("os.environ" in p.read_text() or "getenv" in p.read_text())]
    assert not readers, readers


def test_no_public_function_takes_more_than_six_parameters():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if len(names) > 6:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({', '.join(names)})")
    assert not long, long


def test_the_architecture_doc_names_every_module():
    table = (ROOT / "docs" / "architecture.md").read_text()
    missing = [m for m in MODULES if m.count(".") and not m.startswith("moai_recipes.recipes.")  # `recipes/*`
               and f"`{m.removeprefix('moai_recipes.').replace('.', '/')}`" not in table]
    assert not missing, missing
