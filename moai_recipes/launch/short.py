"""The dry run's process (`recipes.plan`, `moai run plan`): started and ended without the interpreter's housekeeping,
which costs it more than a large search does.

Measured on this 2-core machine (`recipes.plan flavor=48xlarge model=llama3_70b batch_size=512 max_seq_len=4096`):
- the cyclic collector's passes over torch's import and the search's 14,000 plans took 0.5 s of its 3.5 s
  (longest=true: 11 s of 36 s), and the process makes next to no cyclic garbage: its peak is the same without them
  (300 and 470 MB). `start` turns them off;
- the interpreter's teardown (freeing the modules, unloading torch's libraries) then took 0.5 s; `end` waits for
  what the interpreter would wait for (threads, exit handlers, buffered output) and skips the rest. The dry run
  writes its plan.json whole (files.write_json) before it returns.
The training recipes' processes freeze what they imported instead (train/process.py), and their forked workers end
by os._exit already (multiprocessing's fork); skipping their teardown too saved nothing measurable in the suite.
"""

import atexit
import gc
import os
import sys
import threading


def start() -> None:
    """Before the imports: no cyclic collection in this process."""
    gc.disable()


def end(code: int | None) -> None:
    """End this process with exit code `code` as the interpreter would, without its teardown: the threads it would
    wait for joined, the exit handlers run (logging's, wandb's), standard output and error flushed."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
