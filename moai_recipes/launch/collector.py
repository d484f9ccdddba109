"""Python's cyclic garbage collector while a command imports the training stack: paused, then what was imported
frozen out of its reach.

Importing torch, torchtune and transformers makes half a million objects that live as long as the process, and the
collector's full passes walk everything imported so far, again and again as it grows: 0.7 to 1.4 s of the 6 s that
`import moai_recipes.recipes.lora_finetune, moai_recipes.launch.worker, transformers.modeling_utils` took, 4.5 to
5.8 s with the collector off (three alternated runs, 2026-11-30); a pass then found 10,693 objects to free among
636,000 (1 to 2 MB). A training command's process pauses it from its start (launch/entry.command, a bare worker's main)
until its recipe is imported (worker.run) or its workers are about to be forked (entry.launch): what exists then is
frozen, never walked again, and collection resumes for everything made after. Never in a caller's process (a test's
in-process run, a notebook): its garbage, frozen with the imports, would never be freed (an in-process suite ran out
of file descriptors that way). The garbage made while it was paused (the imports' own, the config's) is frozen with
it rather than collected: one full pass to find it costs 0.4 to 0.5 s. The dry run keeps the collector off for its
whole short life instead (launch/short.py).
"""

import gc

_PAUSED = False  # whether pause() turned the collector off and it is still off


def pause() -> None:
    """No collection until imports_done(), in a process that runs one command (unless it is off already)."""
    global _PAUSED
    if gc.isenabled():
        gc.disable()
        _PAUSED = True


def imports_done() -> None:
    """Where pause() turned the collector off: what exists now (this process's imports) frozen out of its reach, and
    collection resumed. Otherwise nothing: a caller's heap is not this module's to freeze."""
    global _PAUSED
    if _PAUSED:
        gc.freeze()
        gc.enable()
        _PAUSED = False
