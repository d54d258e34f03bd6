"""The graph runner with real CUDA-graph capture on CuPy arrays (marker ``gpu``).

Every test of ``test_graphs.py`` runs here again with the ``env`` below (CuPy arrays, the
default CUDA capture), then the GPU-only ones: bitwise replays at a bf16 shape, memory that
does not grow over 1000 replays, out-of-memory forced with ``MemoryPool.set_limit``, a
non-capturable op inside the capture, graphs launched after other work on another stream, and
the stream still working after every failure path.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

import sdm_cupy as sdm
from sdm_cupy import graphs
from sdm_cupy.graphs import pools
from sdm_cupy.graphs.capture import cupy_capture

from test_graphs import *  # noqa: F401,F403 - the shared tests, run with the env below
from test_graphs import _fresh_graphs, cfg, eager, grad_like, problem, same, same_grads  # noqa: F401
from helpers import BF16, assert_close, make_problem

pytestmark = pytest.mark.gpu


class CudaEnv:
    """CuPy arrays, CUDA graphs through CuPy stream capture."""

    name = "cuda"

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.xp = cupy
        self.cap = cupy_capture()   # the process-wide backend

    def stream(self, name):
        return self.cupy.cuda.Stream(non_blocking=True)

    @contextlib.contextmanager
    def on(self, stream):
        # work queued on the legacy stream (the test's inputs) is done before a
        # non-blocking stream reads it. Not a device-wide synchronize: another thread may be
        # capturing on its own stream, and a device sync would invalidate that capture (and
        # fail here); the legacy stream has no implicit tie to non-blocking streams.
        self.cupy.cuda.Stream.null.synchronize()
        with stream:
            yield stream

    @contextlib.contextmanager
    def capturing(self):
        side = self.cupy.cuda.Stream(non_blocking=True)
        with side:
            side.begin_capture()
            try:
                yield
            finally:
                side.end_capture()   # the graph of the eager call is dropped
        assert not side.is_capturing()

    def force_oom(self, mempool):
        mempool.free_all_blocks()
        mempool.set_limit(size=max(1, mempool.total_bytes()))

    def clear_oom(self, mempool):
        mempool.set_limit(size=0)

    def set_settings(self, monkeypatch, value):
        from sdm_cupy.kernels import gpu
        monkeypatch.setattr(gpu, "TILE_WIDTH", 8)

    def sync(self):
        self.cupy.cuda.get_current_stream().synchronize()


@pytest.fixture
def env():
    return CudaEnv()


def stream_works(cp, stream=None):
    """The stream is out of capture mode and runs work (CuPy's graph tests do the same)."""
    stream = stream or cp.cuda.get_current_stream()
    assert not stream.is_capturing()
    with stream:
        x = cp.arange(1000, dtype=np.float32)
        assert float((x * 2).sum()) == 999000.0
    stream.synchronize()


def big_problem(cp, rng, B=2, T=100, dtype=BF16):
    pb = make_problem(rng, B=B, T=T, P=4, hd=64, S=1024, W=8, dtype=dtype,
                      weight_dtype=np.float32).to(cp)
    p = cp.asarray(rng.normal(size=(1024, 256)).astype(dtype))
    c = sdm.SDMConfig(num_memory_slots=1024, num_parallel=4, chunk_size=64)
    return pb, p, c


def test_bf16_replays_are_bitwise_eager(env, rng):
    cp = env.cupy
    pb, p, c = big_problem(cp, rng)
    r = graphs.GraphRunner("bf16")
    for _ in range(3):
        x = make_problem(rng, B=pb.B, T=pb.T, P=4, hd=64, S=1024, W=8, dtype=BF16,
                         weight_dtype=np.float32).to(cp).inputs
        dr = cp.asarray(rng.normal(size=(pb.B, pb.T, 256)).astype(BF16))
        readings, bank, h = r.forward(p, *x, c, batch=pb.B)
        g = r.backward(h, dr)
        bank0 = sdm.expand_memory_batch(p, pb.B)
        res = sdm.forward(bank0, *x, c, inplace=True, check_indices=False)
        want_bank = res.bank.copy()
        want = sdm.backward(res.saved, dr)
        same(readings, res.readings, "readings")
        same(bank, want_bank, "final bank")
        assert_close(g.param, sdm.sum_memory_batch(want.bank, 1024), 1e-6, name="grad param")
        for f in ("write_w", "values", "beta", "read_w"):
            assert_close(getattr(g, f), getattr(want, f), 1e-6, name=f"grad {f}")
    assert r.stats["backward_replay"] == 2 and r.stats["forward_replay"] == 3


def test_1000_replays_do_not_grow_memory(env, rng):
    cp = env.cupy
    pb, p, c = big_problem(cp, rng, T=1)
    r = graphs.GraphRunner("decode")
    default = cp.get_default_memory_pool()
    state = sdm.LayerState(sdm.expand_memory_batch(p, pb.B), 0)
    readings, state, _ = r.forward(state, *pb.inputs, c, batch=pb.B, needs_backward=False,
                                   seq_len=1)
    st = r.static_inputs()
    args = [st[n] for n in graphs.runner.INPUT_NAMES]
    mempool = r._entries[False].mempool
    for _ in range(10):
        readings, state, _ = r.forward(state, *args, c, batch=pb.B, needs_backward=False,
                                       seq_len=state.seq_len + 1)
    del readings
    cp.cuda.get_current_stream().synchronize()
    used, total = default.used_bytes(), mempool.total_bytes()
    for _ in range(1000):
        readings, state, _ = r.forward(state, *args, c, batch=pb.B, needs_backward=False,
                                       seq_len=state.seq_len + 1)
        del readings
    cp.cuda.get_current_stream().synchronize()
    assert default.used_bytes() == used and mempool.total_bytes() == total
    assert r.stats["forward_replay"] == 1011 and state.seq_len == 1011
    # training: fwd + bwd replays
    tr = graphs.GraphRunner("train")
    dr = cp.asarray(rng.normal(size=(pb.B, 1, 256)).astype(BF16))
    for i in range(110):
        if i == 10:
            cp.cuda.get_current_stream().synchronize()
            used, total = default.used_bytes(), tr._entries[True].mempool.total_bytes()
        _, _, h = tr.forward(p, *pb.inputs, c, batch=pb.B)
        g = tr.backward(h, dr)
        del g, h
    cp.cuda.get_current_stream().synchronize()
    assert default.used_bytes() == used and tr._entries[True].mempool.total_bytes() == total


def test_uncapturable_op_falls_back_and_the_stream_works(env, rng, monkeypatch):
    cp = env.cupy
    pb, p = problem(env, rng)
    c = cfg()
    real = sdm.forward

    def syncing(*a, **k):   # a host sync: not capturable
        out = real(*a, **k)
        if cp.cuda.get_current_stream().is_capturing():
            float(out.readings.sum())
        return out
    monkeypatch.setattr(sdm, "forward", syncing)
    r = graphs.GraphRunner("sync")
    readings, _, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    assert r.capture_failed and not h.graphed
    monkeypatch.setattr(sdm, "forward", real)
    same(readings, eager(p, pb.inputs, c, pb.B)[0], "eager readings")
    stream_works(cp)
    pool = pools.pool_for(env.cap, pb.values.device.id, cp.cuda.get_current_stream())
    stream_works(cp, pool.capture_stream)
    other = graphs.GraphRunner("after")
    _, _, h = other.forward(p, *pb.inputs, c, batch=pb.B)
    assert h.graphed, "capturing works again on the same capture stream"


def test_out_of_memory_paths_leave_streams_working(env, rng):
    cp = env.cupy
    pb, p = problem(env, rng)
    c = cfg()
    stream = cp.cuda.Stream(non_blocking=True)
    with env.on(stream):   # after the inputs' uploads on the legacy stream
        pool = pools.pool_for(env.cap, pb.values.device.id, stream)
        env.force_oom(pool.mempool)
        r = graphs.GraphRunner("oom-capture")
        readings, _, _ = r.forward(p, *pb.inputs, c, batch=pb.B)
        env.clear_oom(pool.mempool)
        assert r.capture_failed
        stream_works(cp, stream)
        stream_works(cp, pool.capture_stream)
        graphs.reset_graphs()
        r2 = graphs.GraphRunner("oom-backward")
        _, _, h = r2.forward(p, *pb.inputs, c, batch=pb.B)
        e = r2._entries[True]
        env.force_oom(e.mempool)
        dr = grad_like(env, rng, pb)
        g = r2.backward(h, dr)
        env.clear_oom(e.mempool)
        assert e.released and r2.capture_failed
        assert e.held == [] and e.result is None, "the entry dropped its blocks"
        same_grads(g, eager(p, pb.inputs, c, pb.B, dr)[2])
        stream_works(cp, stream)
        stream_works(cp, e.pool.capture_stream)


_SPIN = r"""
extern "C" __global__ void spin_copy(const float* src, float* dst, long long n,
                                     long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) dst[i] = src[i];
}
"""


def test_graphs_launched_after_work_on_another_stream(env, rng):
    """The pool's stream has slow work queued that writes the input; a replay on another
    stream must run after it (event), and the pool stream's next work after the replay."""
    cp = env.cupy
    spin = cp.RawKernel(_SPIN, "spin_copy")
    pb, p = problem(env, rng)
    c = cfg()
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    r = graphs.GraphRunner("streams")
    with s1:
        r.forward(p, *pb.inputs, c, batch=pb.B, needs_backward=False)   # pool stream: s1
    s1.synchronize()
    new_values = cp.asarray(rng.normal(size=pb.values.shape).astype(np.float32))
    target = cp.zeros_like(pb.values)
    x = list(pb.inputs)
    x[2] = target
    want = eager(p, [*pb.inputs[:2], new_values, *pb.inputs[3:]], c, pb.B)[0]
    cp.cuda.Device().synchronize()   # the legacy stream's work is done before s1 and s2 run
    with s1:   # ~50 ms of spinning, then target <- new_values
        spin((1,), (128,), (new_values, target, np.int64(target.size), np.int64(10 ** 8)))
    with s2:
        readings, _, _ = r.forward(p, *x, c, batch=pb.B, needs_backward=False)
        s2.synchronize()
    same(readings, want, "replay on s2 after s1's queued write")
    stream_works(cp, s1)
    stream_works(cp, s2)


def test_decode_example_runs():  # real CUDA graphs
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "examples", "decode_with_graphs.py")],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "PASSED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
