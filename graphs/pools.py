"""Memory pools, stream ordering, regions and the process-wide registries of the runner.

One ``Pool`` per (capture backend, device, stream a runner first ran on): its forward graphs
share one memory pool and are captured in call order (``Pool.forward``); its ``lock``
serialises every thread's replays on those graphs; ``ordered()`` joins a replay on another
stream to the pool's stream with events, so that graphs sharing the pool never overlap.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

__all__ = ["Pool", "pool_for", "ordered", "region"]


class Pool:
    """The graphs of one (backend, device, stream). ``mempool`` is shared by forward captures
    until the first backward capture (``has_backward``); later forward captures take a private
    one. ``stream`` is the stream the pool was made for; captures record on ``capture_stream``
    (CuPy refuses to capture the legacy stream)."""

    def __init__(self, capture, device, stream):
        self.capture, self.device, self.stream = capture, device, stream
        self.mempool = capture.new_mempool()
        self.capture_stream = capture.new_stream()
        self.forward = []          # weak references to shared forward entries, capture order
        self.has_backward = False
        self.lock = threading.RLock()
        # Every shared entry above this index has token None: tokens are only issued by
        # replays, under the lock, each followed by invalidate_after (skipped when this is the
        # entry's index already: it would change nothing). So a replay clears tokens up to here
        # only: O(entries replayed since), not O(entries captured after it).
        self.high = -1
        # The last token issued to a replay of one of its entries (under ``lock``). A token is
        # only ever compared with its own entry's, so a count per pool is enough.
        self.tokens = 0

    def invalidate_after(self, entry) -> None:
        """A replay of ``entry`` may rewrite the blocks of entries captured after it in the
        shared pool: their state is no longer theirs. (Under ``lock``.)"""
        i = entry.index
        if i is None:
            return
        if self.high > i:
            for ref in self.forward[i + 1:self.high + 1]:
                later = ref()
                if later is not None:
                    later.token = None
        self.high = i


_pools: dict = {}
_pools_lock = threading.Lock()


def pool_for(capture, device, stream) -> Pool:
    key = (capture.name, id(capture), device, capture.stream_key(stream))
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = Pool(capture, device, stream)
    return pool


def forget(pool) -> None:
    with _pools_lock:
        for key, p in list(_pools.items()):
            if p is pool:
                del _pools[key]


def clear_pools() -> None:
    with _pools_lock:
        _pools.clear()


class ordered:
    """``with ordered(pool) as stream:`` runs the block alone among the threads' blocks on
    ``pool``; when the current stream is not the pool's, the block's work runs after the work
    queued on the pool's stream and before the work queued there next (events). Yields the
    current stream. (A class, not a generator: it sits on every replay's path.)"""

    __slots__ = ("pool", "current", "other")

    def __init__(self, pool, current=None):
        self.pool, self.current, self.other = pool, current, False

    def __enter__(self):
        pool = self.pool
        cap = pool.capture
        pool.lock.acquire()
        try:
            current = self.current if self.current is not None else cap.current_stream()
            self.current = current
            if current is not pool.stream and cap.stream_key(current) != cap.stream_key(pool.stream):
                cap.wait(current, pool.stream)
                self.other = True
        except BaseException:
            pool.lock.release()
            raise
        return current

    def __exit__(self, *exc):
        try:
            if self.other:
                self.pool.capture.wait(self.pool.stream, self.current)
        finally:
            self.pool.lock.release()
        return False


# ---- entries shared across regions ----------------------------------------------------------
# (pool, key, slot) -> entry, held weakly: by the runners and the pending backwards using it.
shared = weakref.WeakValueDictionary()
shared_lock = threading.Lock()


class _Region:
    def __init__(self):
        self.used = weakref.WeakSet()   # entries the region's calls took


_local = threading.local()


@contextlib.contextmanager
def region():
    """Runners of one key inside one region take distinct shared entries ("slots"); runners in
    different regions share them. Use one region per repeated block of layers (e.g. per
    checkpointed layer): L identical layers then hold the memory of one entry, and each
    backward whose entry a later layer overwrote replays its forward first."""
    stack = getattr(_local, "regions", None)
    if stack is None:
        stack = _local.regions = []
    r = _Region()
    stack.append(r)
    try:
        yield r
    finally:
        stack.pop()


def current_region():
    stack = getattr(_local, "regions", None)
    return stack[-1] if stack else None


def clear_regions() -> None:
    _local.__dict__.clear()
