"""The layout's rules (docs/architecture.md), checked: every module imports on its own, the library below the
recipes never imports a recipe or the entry point, no public function takes more than six parameters.
Run: python -m pytest tests/test_layout.py -q
"""

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

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


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_library_never_imports_a_recipe_or_the_entry_point():
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "recipes":
            continue
        bad = {m for m in _imports(path) if m.startswith(("moai_recipes.recipes", "recipes")) or m == "moai_recipes.launch.entry"}
        assert not bad, (path, bad)


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
