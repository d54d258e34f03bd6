"""The capture mechanism the runner plugs in: real CUDA graphs (``CupyCapture``) or a host
stand-in (``HostCapture``) that lets the runner's bookkeeping run without a GPU.

A capture backend provides streams, memory pools, capture and launch; the runner
(``runner.py``) never touches CuPy's graph API itself. Both backends share one contract:

* ``capture(fn, mempool, stream, held)`` records ``fn()`` on ``stream`` with every allocation
  taken from ``mempool`` and appended to ``held``, and returns ``(graph, out)``. The arrays in
  ``out`` (and in ``held``) are the graph's static memory: the caller keeps them alive.
* ``launch(graph, stream)`` replays the graph: it rewrites ``out`` in place.
* ``copier(src)`` returns ``f(stream)``: a fresh copy of the static array ``src`` on
  ``stream`` (what ``copy(src)`` gives; the layout of ``src`` is read once, since graph memory
  never changes).
* ``run_on(stream, mempool)``: run eager work (warm-ups) on ``stream`` from ``mempool``.

Why ``held``: a CuPy ``Graph`` keeps no memory alive, and CuPy's ``MemoryPool`` releases its
cached free blocks with ``cudaFree`` when an allocation fails (``SingleDeviceMemoryPool.
_try_malloc`` calls ``free_all_blocks()`` before retrying, cupy 14). A temporary freed during a
capture would then be handed back to the driver while the graph still writes it on every
replay. So every block a capture allocates stays owned by its entry until the entry dies.
"""

from __future__ import annotations

import contextlib
import threading
import time

import sdm_cupy as sdm

__all__ = ["CupyCapture", "HostCapture", "HostOutOfMemory", "cupy_capture", "leaves"]


def leaves(obj) -> list:
    """The arrays of a capture's output (tuples, ForwardResult, SavedState, Gradients), in a
    fixed order; None entries are skipped."""
    if obj is None:
        return []
    if isinstance(obj, (tuple, list)):
        return [a for o in obj for a in leaves(o)]
    if isinstance(obj, sdm.ForwardResult):
        return leaves((obj.readings, obj.bank, obj.saved))
    if isinstance(obj, sdm.SavedState):
        return leaves((obj.bank, obj.inputs, obj.snapshots))
    if isinstance(obj, sdm.Gradients):
        return leaves((obj.bank, obj.write_w, obj.values, obj.beta, obj.read_w))
    return [obj]


# ---- real capture ---------------------------------------------------------------------------
_cp = None   # cupy, imported at first use (an import statement per call costs on every replay)


def _cupy():
    global _cp
    if _cp is None:
        import cupy
        _cp = cupy
    return _cp


class CupyCapture:
    """CUDA graphs through CuPy stream capture (relaxed mode, CuPy's default, because the pool
    may ``cudaMalloc`` while capturing)."""

    name = "cupy"

    def device(self, x):
        return x.data.device_id   # (cheaper than x.device.id: no Device object per call)

    def current_stream(self):
        return (_cp or _cupy()).cuda.get_current_stream()

    def stream_key(self, stream):
        return stream.ptr

    def is_capturing(self, stream=None) -> bool:
        try:
            if stream is None:
                stream = (_cp or _cupy()).cuda.get_current_stream()
            return bool(stream.is_capturing())
        except Exception:  # noqa: BLE001 - e.g. the legacy stream while another stream captures
            return True

    def new_mempool(self):
        return _cupy().cuda.MemoryPool()

    def new_stream(self):
        # Non-blocking: a capture on it is not joined by legacy-stream work of other threads.
        return _cupy().cuda.Stream(non_blocking=True)

    def wait(self, waiter, waited) -> None:
        """``waiter`` runs its next work after the work queued on ``waited`` so far."""
        waiter.wait_event(waited.record())

    # A plain cudaMemcpyAsync costs a few microseconds of host time; CuPy's elementwise copy
    # kernel costs several times that, which decode steps would feel.
    def copy(self, src):
        """A fresh C-contiguous copy of ``src`` on the current stream (default allocator)."""
        cupy = _cp or _cupy()
        if not src.flags.c_contiguous:
            return src.copy()
        out = cupy.empty(src.shape, dtype=src.dtype)
        if src.nbytes:
            out.data.copy_from_device_async(src.data, src.nbytes)
        return out

    def copier(self, src):
        """``f(stream)``: ``copy(src)`` on ``stream`` (the current one) for a static ``src``
        whose layout is read here once: an allocation from the current allocator and one
        ``cudaMemcpyAsync`` (the cheapest host path measured)."""
        cupy = _cp or _cupy()
        if not src.flags.c_contiguous or not src.nbytes:
            return lambda stream: self.copy(src)
        shape, dtype, nbytes = src.shape, src.dtype, src.nbytes
        data = src.data
        ptr, device = data.ptr, data.device_id
        alloc, ndarray = cupy.cuda.alloc, cupy.ndarray
        memcpy, d2d = cupy.cuda.runtime.memcpyAsync, cupy.cuda.runtime.memcpyDeviceToDevice

        def copy(stream):
            mem = alloc(nbytes)
            if mem.device_id == device:
                memcpy(mem.ptr, ptr, nbytes, d2d, stream.ptr)
            else:   # another current device: CuPy's peer copy
                mem.copy_from_device_async(data, nbytes, stream)
            return ndarray(shape, dtype, mem)
        return copy

    def copy_into(self, dst, src) -> None:
        """``dst[...] = src`` on the current stream; a memcpy when layouts match."""
        if (dst.dtype == src.dtype and dst.shape == src.shape and dst.flags.c_contiguous
                and src.flags.c_contiguous and dst.data.device_id == src.data.device_id):
            if src.nbytes:
                dst.data.copy_from_device_async(src.data, src.nbytes)
        else:
            dst[...] = src

    @contextlib.contextmanager
    def run_on(self, stream, mempool, held=None):
        cupy = _cupy()
        if held is None:
            alloc = mempool.malloc
        else:
            def alloc(size):
                mem = mempool.malloc(size)
                held.append(mem)
                return mem
        with stream, cupy.cuda.using_allocator(alloc):
            yield

    def capture(self, fn, mempool, stream, held):
        with self.run_on(stream, mempool, held):
            stream.begin_capture()
            try:
                out = fn()
            except BaseException:
                try:  # leave capture mode so that the stream stays usable
                    stream.end_capture()
                except Exception:  # noqa: BLE001 - an invalidated capture raises here
                    pass
                raise
            graph = stream.end_capture()
        return graph, out

    def launch(self, graph, stream) -> None:
        graph.launch(stream=stream)

    def is_oom(self, exc) -> bool:
        cupy = _cupy()
        if isinstance(exc, cupy.cuda.memory.OutOfMemoryError):
            return True
        rt = cupy.cuda.runtime
        return isinstance(exc, rt.CUDARuntimeError) and exc.status == rt.errorMemoryAllocation

    _gpu = None

    def settings(self) -> tuple:
        gpu = CupyCapture._gpu
        if gpu is None:   # (an import statement per call costs microseconds on every replay)
            from sdm_cupy.kernels import gpu
            CupyCapture._gpu = gpu
        return ("gpu",) + tuple(gpu.settings())

    def release(self, mempools, stream) -> None:
        """Returns the cached blocks of dropped graphs' pools to the driver."""
        stream.synchronize()
        for m in mempools:
            m.free_all_blocks()

    def __reduce__(self):
        return cupy_capture, ()


_CUPY = CupyCapture()


def cupy_capture() -> CupyCapture:
    """The process-wide CuPy capture backend (the runner's default for CuPy arrays)."""
    return _CUPY


# ---- host stand-in --------------------------------------------------------------------------
class HostOutOfMemory(MemoryError):
    """The stand-in's out-of-memory error (``HostPool.fail_alloc``)."""


class HostStream:
    """A named stand-in stream; ``capturing`` is True while a stand-in capture records on it."""

    def __init__(self, name: str):
        self.name = name
        self.capturing = False

    def __repr__(self):
        return f"HostStream({self.name!r})"


class HostPool:
    """Stand-in memory pool. ``fail_alloc = True`` makes the next allocation (a warm-up or a
    capture) raise ``HostOutOfMemory``, like ``MemoryPool.set_limit`` does on the GPU."""

    def __init__(self):
        self.fail_alloc = False
        self.released = 0

    def check(self):
        if self.fail_alloc:
            raise HostOutOfMemory("stand-in pool: allocation over its limit")


class HostGraph:
    """Records a Python callable; a launch runs it again and copies its results into the
    arrays of the capture (the static outputs), as a real graph rewrites its memory."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out
        self.launches = 0

    def replay(self):
        new = self.fn()
        for static, fresh in zip(leaves(self.out), leaves(new)):
            if static is not fresh:
                static[...] = fresh
            time.sleep(0)  # let other threads in: unlocked concurrent replays then interleave
        self.launches += 1


class HostCapture:
    """Capture stand-in for NumPy arrays on the CPU backend (tests and CI): streams are names,
    a capture runs the callable once to create its static outputs and a launch runs it again.
    Replays give the eager results but no speed-up. ``waits`` records cross-stream ordering,
    ``fail_capture`` (an exception) makes the next capture raise it."""

    name = "host"

    def __init__(self):
        self._local = threading.local()
        self.default_stream = HostStream("default")
        self.waits = []
        self.fail_capture = None
        self.settings_value = ()

    def device(self, x):
        return "cpu"

    def current_stream(self):
        return getattr(self._local, "stream", None) or self.default_stream

    @contextlib.contextmanager
    def using_stream(self, stream):
        """Makes ``stream`` this thread's current stand-in stream inside the block."""
        prev = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = prev

    def stream_key(self, stream):
        return id(stream)

    def is_capturing(self, stream=None) -> bool:
        return (stream or self.current_stream()).capturing

    def new_mempool(self):
        return HostPool()

    def new_stream(self):
        return HostStream("capture")

    def wait(self, waiter, waited) -> None:
        self.waits.append((waiter, waited))

    def copy(self, src):
        return src.copy()

    def copier(self, src):
        return lambda stream: self.copy(src)

    def copy_into(self, dst, src) -> None:
        dst[...] = src

    @contextlib.contextmanager
    def run_on(self, stream, mempool, held=None):
        mempool.check()
        with self.using_stream(stream):
            yield

    def capture(self, fn, mempool, stream, held):
        if self.fail_capture is not None:
            exc, self.fail_capture = self.fail_capture, None
            raise exc
        with self.run_on(stream, mempool):
            stream.capturing = True
            try:
                out = fn()
            finally:
                stream.capturing = False
        return HostGraph(fn, out), out

    def launch(self, graph, stream) -> None:
        graph.replay()

    def is_oom(self, exc) -> bool:
        return isinstance(exc, HostOutOfMemory)

    def settings(self) -> tuple:
        return ("host",) + tuple(self.settings_value)

    def release(self, mempools, stream) -> None:
        for m in mempools:
            m.released += 1

    def __reduce__(self):
        return HostCapture, ()
