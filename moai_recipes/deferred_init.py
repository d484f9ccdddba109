"""Package __init__s that import far more than a run uses (torchtune's, torchtune.training's, torchao's), run only
when something of their own is asked for, not whenever one of their submodules is imported.

`from torchtune.modules import RMSNorm` runs torchtune/__init__.py first, and it imports every part of the library:
its datasets (HF datasets and pandas), the builders of every model family it ships, its generation and its utils.
A cold dry run of Llama-3-70B (`recipes.plan flavor=48xlarge model=llama3_70b`, 6.4-6.8 s on two cores) spent
0.35-0.4 s there (`python -X importtime`) and uses none of it: it builds one layer of torchtune's modules to trace.
torchtune's parts import one another by their full names, so its submodules load without the package's __init__: the
package is registered as its spec makes it, empty, and its __init__ runs, once, when something asks the package for a
name it lacks (`torchtune.__version__`; `from torchtune import datasets` imports that submodule alone).

What the skipped __init__ also did: it raised when torchao is missing (torchtune.modules imports torchao, which
raises then too) and set HF_HUB_ENABLE_HF_TRANSFER where hf_transfer is installed (not among our dependencies; a
user who installs it can set the variable). Called once, from moai_recipes/__init__.py, before anything imports
torchtune.

torchtune.training's __init__ is deferred the same way: it imports every part of its training utilities (its
checkpointers, profiler, quantizers: these import the whole of torchao), and a run uses one of them, the learning-rate
schedule (torchtune.training.lr_schedulers, which imports torchtune.training.memory alone).

torchao's NF4Tensor (QLoRA's weights) is the one part of torchao that torchtune's modules import (every one of them,
through torchtune.modules.common_utils), and its module imports torch alone; torchao's package __init__, run first by
any import of it, imports its quantization, kernels and inductor passes (0.9 s of the 70B's dry run: 2.0 s of
torchtune.modules' import against 1.1 s without). So when torchtune.modules is about to be imported and torchao is
not, torchao/dtypes/nf4tensor.py is loaded alone, under its own name, where every `from torchao.dtypes.nf4tensor
import ...` finds it; any other torchao import (8-bit AdamW, quantize_, QAT) runs torchao's __init__ as always, its
C++ kernels loaded before any module that could use them (the NF4 ops are aten's), and the torchao.dtypes it
imports adopts the module loaded before (the same NF4Tensor class, `torchao.dtypes.nf4tensor` an attribute as usual).
"""

import importlib
import importlib.util
import sys
import threading
from pathlib import Path

DEFERRED = ("torchtune", "torchtune.training")  # parents first
# A module loaded alone (its package's __init__ not run) when the first is about to be imported: see the docstring.
ALONE = {"torchtune.modules": "torchao.dtypes.nf4tensor"}
_PACKAGES = {alone.rpartition(".")[0]: alone for alone in ALONE.values()}  # the package each adopts it, by name
_LOCK = threading.RLock()


def defer_package_inits() -> None:
    """Register each package of DEFERRED not imported yet without running its __init__ (not installed: left to the
    import that needs it, which says so)."""
    for name in DEFERRED:
        parent, _, child = name.rpartition(".")
        if name in sys.modules or (parent and parent not in sys.modules):  # a parent not installed: nothing to defer
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            continue
        module = importlib.util.module_from_spec(spec)
        module.__getattr__ = _completing(module)
        sys.modules[name] = module
        if parent:
            setattr(sys.modules[parent], child, module)
    if not any(isinstance(finder, _LoadsAlone) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LoadsAlone())


class _LoadsAlone:
    """An import finder that finds nothing itself: it loads ALONE's module before its trigger is imported, and makes
    that module's package adopt it when the package is imported after all."""

    def find_spec(self, name, path=None, target=None):  # asked at every import: two dictionary lookups
        alone = ALONE.get(name)
        if alone is not None and alone.partition(".")[0] not in sys.modules:
            _load_alone(alone)
        child = _PACKAGES.get(name)
        if child is None or child not in sys.modules or name in sys.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _Adopting(spec.loader, {child.rpartition(".")[2]: sys.modules[child]})
                return spec
        return None


def _load_alone(name: str) -> None:
    """Execute the module `name` under its name without importing its packages (its file found where they are)."""
    with _LOCK:
        if name in sys.modules:
            return
        top, _, rest = name.partition(".")
        spec = importlib.util.find_spec(top)
        if spec is None or spec.submodule_search_locations is None:
            return  # not installed: the import that needs it says so
        for location in spec.submodule_search_locations:
            path = Path(location, *rest.split(".")).with_suffix(".py")
            if path.is_file():
                break
        else:
            return
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise


class _Adopting:
    """A package's loader that sets the submodules loaded alone before as its attributes, then runs its __init__
    (which imports them and finds them in sys.modules)."""

    def __init__(self, loader, children: dict):
        self._loader, self._children = loader, children

    def __getattr__(self, attr):
        if attr in ("_loader", "_children"):  # not set yet (a copy made without __init__): no endless lookup
            raise AttributeError(attr)
        return getattr(self._loader, attr)  # get_source, get_resource_reader...: the package's own loader answers

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__dict__.update(self._children)
        self._loader.exec_module(module)


def _completing(module):
    """The deferred package's module-level __getattr__ (PEP 562): a submodule imported alone; any other name runs
    the package's __init__ (once) and is then looked up as usual."""
    name = module.__name__

    def __getattr__(attr: str):
        if attr.startswith("__") and attr not in ("__all__", "__version__"):
            raise AttributeError(attr)  # introspection (pickle, inspect, pytest) probing, not asking the package
        if importlib.util.find_spec(f"{name}.{attr}") is not None:
            return importlib.import_module(f"{name}.{attr}")
        with _LOCK:
            if module.__dict__.get("__getattr__") is __getattr__:
                del module.__getattr__  # the __init__ below defines what it defines; nothing is deferred after
                module.__spec__.loader.exec_module(module)
        try:
            return module.__dict__[attr]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None

    return __getattr__
