"""Memory a CPU process has freed, given back to the system while it trains split rows (glibc's malloc_trim).

glibc keeps the pages of freed heap chunks resident unless they sit at the heap's top: the tensors a long row's layer
makes and frees in its forward, recomputation and backward (and context parallelism's blocks and collectives)
leave holes it never returns, so a process's resident memory grows with the layers past the tensors it holds. On
cpu-4, a 4-layer SmolLM2 at one 20,480-token row (gather): 2.1-2.5 GB resident a process for 0.69 GiB of tensors,
1.33 GB with freed pages trimmed every 0.2 s; the 30-layer model reached 6.8 GB and was killed by the kernel's
out-of-memory. `MALLOC_MMAP_THRESHOLD_` and `MALLOC_ARENA_MAX` did not help. A GPU's memory is its caching
allocator's, not this.
"""

import contextlib
import ctypes
import ctypes.util
import threading

TRIM_EVERY_S = 0.2


@contextlib.contextmanager
def freed_memory_returned(enabled: bool):
    """While inside (and `enabled`, and glibc is the C library), a thread returns glibc's free heap pages to the
    system every TRIM_EVERY_S seconds."""
    trim = _malloc_trim() if enabled else None
    if trim is None:
        yield
        return
    stop = threading.Event()

    def loop():
        while not stop.wait(TRIM_EVERY_S):
            trim(0)

    thread = threading.Thread(target=loop, name="malloc-trim", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim this way
        return None
