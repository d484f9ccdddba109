"""A process that imports the training stack once and forks a child for each multi-process command the suite runs.

`python -m recipes.full_finetune flavor=cpu-2 ...` spends seconds of CPU importing torch, dynamo (under torchao's
NF4Tensor), torchtune, transformers and the recipe before its launcher forks the workers (5.3 s when torchao's
whole __init__ ran too); the suite runs about a
hundred such commands. Each pytest worker starts one of these (tests/helpers.run_recipe), which imports all that
once and then, for each command, forks a child that is what `python -m` would have become by then: the repository
first on sys.path, cwd the repository, the command's environment, its argv, stdin empty, stdout and stderr to
files, the module run as __main__, its exit code (or the signal that killed it) reported back. The child is a real
process: its launcher, its workers, their signals and exit codes are the ones under test.

It imports nothing else and starts no thread and no OpenMP team (the launcher forks its workers under the same
condition: launch/elastic.prepare_workers). A variable a library reads as it is imported cannot be changed for one
command here: helpers.run_recipe starts a process of its own for a command that changes any but the runtime ones
(RUNTIME_VARIABLES).

Protocol on stdin and stdout, a JSON line each way: {"module", "args", "env", "stdout", "stderr"} in, {"pid"}
out once forked, then {"code"} once the child has ended.
"""

import gc
import json
import os
import runpy
import sys

# Read when a run reads them, not when a module is imported: a command may change them for itself.
RUNTIME_PREFIXES = ("MOAI_", "WANDB_")
# TORCHINDUCTOR_CACHE_DIR: inductor reads it at each compile (runtime/cache_dir_utils.cache_dir), and the zygote
# compiles nothing.
RUNTIME_VARIABLES = ("HOME", "NETRC", "TERM", "TORCHINDUCTOR_CACHE_DIR")
PRELOADED = ("moai_recipes.launch.entry", "moai_recipes.launch.elastic", "moai_recipes.launch.worker",
             "moai_recipes.recipes.full_finetune", "moai_recipes.recipes.lora_finetune",
             "moai_recipes.recipes.dpo", "moai_recipes.recipes.grpo",
             # What a launcher imports before it forks its workers (inputs.import_ahead), but a model family's own:
             # torchtune's layers (with dynamo, 1.5 s), its learning-rate schedule (torchtune.training's __init__ is
             # deferred: moai_recipes/deferred_init.py) and transformers' modelling (1.6 s).
             "torchtune.modules", "torchtune.training.lr_schedulers",
             "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
             # What rank 0 imports at the end of every run to draw loss.png (0.7 s, a fifth of a short run's time).
             "matplotlib.pyplot")


def runtime_only(changes: dict) -> bool:
    """Whether a command that changes the environment by `changes` can be forked from here."""
    return all(k.startswith(RUNTIME_PREFIXES) or k in RUNTIME_VARIABLES for k in changes)


def _child(request: dict) -> None:
    """Become `python -m module args` and exit as it would (SystemExit unwinds the serving loop too)."""
    os.chdir(request["cwd"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                           (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        if fd == 2 and path == request["stdout"]:  # stderr=STDOUT: one file, one offset, as a shell's 2>&1
            os.dup2(1, 2)
            continue
        opened = os.open(path, mode, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def serve() -> None:
    import importlib

    os.environ.setdefault("MPLBACKEND", "Agg")  # as metrics_log.plot_loss picks it: nothing here opens a window
    for name in PRELOADED:
        importlib.import_module(name)
    # A command's own process composes its config before it imports torch (launch/entry.py), over a small heap; a
    # child of this one inherits the preloads' half a million objects, which every full collection of its compose
    # and checks would walk (copying each page it touches) until the launcher freezes them itself. Frozen here, the
    # child collects as that process does: a forked cpu-2 run of 4 steps took 2.12 CPU-seconds against 2.32 (median
    # of 6 alternated pairs), cpu-4's of 2 steps 2.97 against 3.14 (5 pairs; 2026-11-30).
    gc.freeze()
    protocol_in, protocol_out = sys.stdin, os.fdopen(os.dup(1), "w")
    for line in protocol_in:
        request = json.loads(line)
        protocol_out.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            protocol_out.close()  # the child, and the workers it forks, must not hold the protocol's pipe
            _child(request)
        protocol_out.write(json.dumps({"pid": pid}) + "\n")
        protocol_out.flush()
        _, status = os.waitpid(pid, 0)
        protocol_out.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        protocol_out.flush()


if __name__ == "__main__":
    serve()
