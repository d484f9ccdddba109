"""The one error type for a user's mistake, the exit codes a scheduler can act on, and the entry-point guard.

Exit codes of every recipe and of `moai`:
    0   finished
    2   a mistake of the user (the message says what to fix); running it again changes nothing
    75  stopped on a signal (SIGTERM, SIGINT) after saving its state: run the same command to resume
        (EX_TEMPFAIL of sysexits.h; a scheduler requeues it)
    76  a worker ran out of memory and left a smaller plan: its launcher starts the processes again (ours does,
        torchrun does with --max-restarts; otherwise run the same command again)
    130 interrupted (Ctrl-C) before a step had begun, nothing to save
    1 or other: a failure (a crash, a dead worker after max_restarts)
"""

import errno
import functools
import sys

from moai_recipes import env


class UserError(Exception):
    """A mistake the user can fix: unknown name, bad value, missing file, a plan that cannot fit.

    The message says what is wrong and what to do; entry points print it without a traceback.
    """


class Stopped(Exception):
    """The run stopped at a step boundary on SIGTERM or SIGINT, after saving a checkpoint (exit EXIT_STOPPED)."""

    def __init__(self, step: int, checkpoint, signame: str):
        super().__init__(f"{signame}: stopped after step {step}; the state is saved in {checkpoint}. "
                         "Run the same command again to resume (resume=auto)")
        self.step, self.checkpoint = step, checkpoint


class RestartSmaller(Exception):
    """On several processes, a step ran out of memory and this rank left a smaller plan in the run folder
    (train/out_of_memory.py): the process ends at once with EXIT_OUT_OF_MEMORY and its launcher starts them all
    again (launch/worker.py)."""


class RedoSkipping(Exception):
    """The optimizer in the backward applied part of a step whose other gradients proved not finite: what it applied
    cannot be taken back in place, so the run goes back to its last checkpoint (or its first step) and redoes the steps
    since then, that one skipped whole, as a step after the backward skips it (train/loop.py). Several processes end
    at once with EXIT_REDO and their launcher starts them again; one process starts again by itself
    (launch/worker.py)."""


EXIT_USER_ERROR = 2
EXIT_STOPPED = 75
EXIT_OUT_OF_MEMORY = 76  # a rank ran out of memory and left a smaller plan: start the processes again
EXIT_REDO = 77  # a step was partly applied and proved not finite: start again from the last checkpoint, skipping it
EXIT_INTERRUPTED = 130  # Ctrl-C outside a training loop (inside one, the run saves and exits EXIT_STOPPED)
EXIT_FAILURE = 1


def is_disk_full(error: BaseException | None, _seen=None) -> bool:
    """Whether `error`, its causes, or the failures DCP gathered from its ranks, is a full disk or quota."""
    seen = _seen or set()
    if error is None or id(error) in seen:
        return False
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException) and is_disk_full(inner, seen):
                return True
    if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
        return True  # a failure another rank sent as text
    return is_disk_full(error.__cause__, seen) or is_disk_full(error.__context__, seen)


def exit_on_user_error(main):
    """Wrap an entry point: a UserError prints one clean message and exits with code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            # Every worker of a launched group hits the same mistake: one message is enough.
            if env.rank() == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except Exception as e:
            if not is_disk_full(e):
                raise
            # A write no writer of ours wraps (they name the file, the bytes and the checkpoint that resumes).
            print(f"error: the disk is full ({e}). Free space there or write to another disk (output_dir=...); "
                  "the same command resumes from the last complete checkpoint", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper
