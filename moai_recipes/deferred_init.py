"""torchtune's package __init__ run when a name only it defines is asked for, not whenever one of its submodules is.

`from torchtune.modules import RMSNorm` runs torchtune/__init__.py first, and it imports every part of the library:
its datasets (HF datasets and pandas), the builders of every model family it ships, its generation and its utils.
A cold dry run of Llama-3-70B (`recipes.plan flavor=48xlarge model=llama3_70b`, 6.4-6.8 s on two cores) spent
0.35-0.4 s there (`python -X importtime`) and uses none of it: it builds one layer of torchtune's modules to trace.
(A training process still imports HF datasets, through torchtune.data: the tokenizer's base.) torchtune's parts
import one another by their full names, so its submodules load without the package's __init__: the package is
registered as its spec makes it, empty, and its __init__ runs, once, when something asks the package for a name it
lacks (`torchtune.__version__`; `from torchtune import datasets` imports that submodule alone).

What the skipped __init__ also did: it raised when torchao is missing (torchtune.modules imports torchao, which
raises then too) and set HF_HUB_ENABLE_HF_TRANSFER where hf_transfer is installed (not among our dependencies; a
user who installs it can set the variable). Called once, from moai_recipes/__init__.py, before anything imports
torchtune.
"""

import importlib
import importlib.util
import sys
import threading

DEFERRED = ("torchtune",)
_LOCK = threading.RLock()


def defer_package_inits() -> None:
    """Register each package of DEFERRED not imported yet without running its __init__ (not installed: left to the
    import that needs it, which says so)."""
    for name in DEFERRED:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            continue
        module = importlib.util.module_from_spec(spec)
        module.__getattr__ = _completing(module)
        sys.modules[name] = module


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
