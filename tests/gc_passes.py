"""`python -m tests.gc_passes OUT.json MODULE ARGS...`: run `python -m MODULE ARGS...` in this process, recording the
freeze count at the start of each of Python's cyclic-collection passes (gc.get_freeze_count: it grows when the
command freezes what it imported, launch/collector.py), written to OUT.json with the command's exit code."""

import gc
import json
import runpy
import sys

if __name__ == "__main__":
    out, module, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    passes = []
    sys.argv = [module, *args]
    gc.collect()  # a fork's inherited allocation count could otherwise start a pass before the command does
    gc.callbacks.append(lambda phase, info: phase == "start" and passes.append(gc.get_freeze_count()))
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    with open(out, "w") as f:
        json.dump({"code": code, "passes": passes, "enabled": gc.isenabled()}, f)
    sys.exit(code)
