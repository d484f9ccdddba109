"""The one error type for a user's mistake, the exit codes a scheduler can act on, and the entry-point guard.

Exit codes of every recipe and of `moai`:
    0   finished
    2   a mistake of the user (the message says what to fix); running it again changes nothing
    75  stopped on a signal (SIGTERM, SIGINT) after saving its state: run the same command to resume
        (EX_TEMPFAIL of sysexits.h; a scheduler requeues it)
    other: a failure (a crash, a dead worker after max_restarts)
"""

import functools
import os
import sys


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


EXIT_USER_ERROR = 2
EXIT_STOPPED = 75
EXIT_OUT_OF_MEMORY = 76  # a rank ran out of memory and left a smaller plan: start the processes again


def exit_on_user_error(main):
    """Wrap an entry point: a UserError prints one clean message and exits with code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            # Every worker of a launched group hits the same mistake: one message is enough.
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            sys.exit(130)

    return wrapper
