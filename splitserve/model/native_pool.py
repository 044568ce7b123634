"""The C kernels' helper thread (splitserve/kernels/pool.c): prefill's linears and attention
borrow the idle time of a CPU the engine does not own.

A worker's engine runs one pinned thread beside its front-end's CPU on a small machine
(splitserve/placement.py). That CPU sleeps through most of a step, waking to stream tokens
and parse requests. The helper runs there under SCHED_IDLE, so it gets the CPU only while
nothing else wants it, and it claims work in small ranges rather than owning a share, so
the engine thread never waits for it beyond the one range it holds: with an idle CPU the
kernels run faster, with none exactly as fast as alone (docs/benchmarks.md, section 1: the
float32-worker rows with and without the helper).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import functools
import logging

from splitserve.kernels.build import load

logger = logging.getLogger(__name__)

_started: int | None = None   # the address of pool.h's struct pool_api once the helper runs
_cpu: int | None = None


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load("pool")
    if lib is None:
        return None
    lib.pool_start.argtypes = [ctypes.c_int]
    lib.pool_start.restype = ctypes.c_int
    lib.pool_api.argtypes = []
    lib.pool_api.restype = ctypes.c_void_p
    lib.pool_stats.argtypes = [ctypes.c_void_p]
    lib.pool_stats.restype = None
    lib.pool_quiesce.argtypes = [ctypes.c_int64]
    lib.pool_quiesce.restype = ctypes.c_int
    return lib


def start(cpu: int) -> bool:
    """Starts the helper on `cpu` (once per process); whether it runs."""
    global _started, _cpu
    lib = _library()
    if lib is None:
        return False
    err = lib.pool_start(cpu)
    if err:
        logger.warning("the kernels' helper thread could not start on CPU %d (errno %d): "
                       "prefill runs on the engine's CPUs alone", cpu, err)
        return False
    if _started is None:   # a second start keeps the first CPU, as pool_start does
        _started, _cpu = lib.pool_api(), cpu
        # Before the interpreter frees what is left at exit.
        atexit.register(quiesce)
    return True


def quiesce(timeout: float = 5.0) -> bool:
    """Waits (up to `timeout` s) until the helper runs no kernel's range: one it lost its CPU
    in may still be running after the kernel returned, reading the weights and the KV cache.
    The owner of that memory calls this before freeing it (ModelRunner, at exit). Whether
    the helper is clear of it (True when none runs)."""
    if _started is None:      # never started: nothing to wait for, nothing to load
        return True
    err = _library().pool_quiesce(int(timeout * 1e9))
    if err:
        logger.warning("the kernels' helper thread still ran a range after %.1f s (%s)",
                       timeout, errno.errorcode.get(err, err))
    return not err


def helper_cpu() -> int | None:
    """The CPU the helper runs on, if it runs."""
    return _cpu if _started is not None else None


def runner() -> int | None:
    """The pool for the kernels' *_shared entry points (the address of its struct
    pool_api), or None when no helper runs (they then run alone)."""
    return _started


def stats() -> tuple[int, int, float]:
    """(ranges the helper ran, ranges the engine thread took back from it, ms the engine
    thread spent waiting for its last ranges) so far."""
    lib = _library()
    if lib is None or _started is None:
        return 0, 0, 0.0
    out = (ctypes.c_int64 * 3)()
    lib.pool_stats(out)
    return out[0], out[1], out[2] / 1e6
