"""Where the CPU kernels' blocks of heads run: on the calling thread, on a pool of Python
threads, or in a Numba ``prange``.

The kernels that do the work (``cpu_fwd._seq_group``, ``cpu_fwd._fwd_heads``,
``cpu_bwd._bwd_heads``) are compiled with ``nogil=True``. Up to ``POOL_MAX_THREADS`` threads
(``numba.get_num_threads()``), the calling thread and a pool of Python threads run them at once,
each on its own blocks, taking block numbers from one counter. Beyond that, a ``prange`` wrapper
does (``parallel=True``, next to each kernel).

Why both (stop 44): Numba compiles a ``parallel=True`` wrapper for each argument types on top
of the kernel it calls, at about half the kernel's cost again (the backward at float32: 16.8 s
with the wrapper, 9.7 s without); the pool needs no compile. But each pool thread must take
the GIL once to start its block, and the GIL passes from one sleeping thread to the next: with
16 threads (an H100 host's 16 cores) the forward of ``bench_cpu.py`` took 2.4-2.7 ms on the
pool against 1.4 on the ``prange``, whose threads start without the GIL. With 2 threads there
is one hand-off, and the two run at the same speed.

On the pool, a call below ``SERIAL_BELOW`` row elements runs on the calling thread alone. Every
block writes only its own heads, so the results are bitwise the same on any path, for any
thread count and in any order.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading

import numba

_pool = None
_pool_size = 0
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """A forked child has none of its parent's threads: it starts a pool of its own."""
    global _pool, _pool_size
    _pool, _pool_size = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _workers(n: int):
    """The pool, with at least ``n`` threads."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n:
            old = _pool
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=n, thread_name_prefix="sdm-cupy-cpu")
            _pool_size = n
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def threads() -> int:
    """How many threads a call runs on: Numba's thread count in the calling thread."""
    return max(1, int(numba.get_num_threads()))


#: the most threads a call runs on the pool; above, on the kernels' ``prange`` wrappers
POOL_MAX_THREADS = 2


def on_pool() -> bool:
    """Whether a call runs on the calling thread and the pool (``parallel_for``) rather than
    on a ``prange`` wrapper, which starts its threads for less (as before stop 44)."""
    return threads() <= POOL_MAX_THREADS


#: below this many row elements (B·T·P·W·hd) a call runs on the calling thread alone: handing
#: blocks to the pool costs ~50-100 µs (a decode step, T = 1, takes less than that in all)
SERIAL_BELOW = 1 << 17


def parallel_for(n: int, body, work: int | None = None) -> None:
    """Calls ``body(i)`` for i in range(n), on up to ``threads()`` threads (the caller's among
    them), or on the caller's alone where ``work`` (row elements) is below ``SERIAL_BELOW``.
    Returns when every call has returned; re-raises the first exception of any."""
    nthreads = min(int(n), threads())
    if work is not None and work < SERIAL_BELOW:
        nthreads = 1
    if nthreads <= 1:
        for i in range(n):
            body(i)
        return
    counter = itertools.count()
    take = threading.Lock()
    failed = []

    def worker():
        while not failed:
            with take:
                i = next(counter)
            if i >= n:
                return
            try:
                body(i)
            except BaseException:
                failed.append(True)
                raise

    futures = [_workers(nthreads - 1).submit(worker) for _ in range(nthreads - 1)]
    errors = []
    try:
        worker()
    except BaseException as e:   # the pool's threads stop at their next block
        errors.append(e)
    for f in futures:
        e = f.exception()        # waits for it
        if e is not None:
            errors.append(e)
    if errors:
        raise errors[0]
