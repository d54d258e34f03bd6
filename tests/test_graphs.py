"""The graph runner's contract (SPEC §8), one test per behaviour.

Here the tests run on the CPU backend against the host capture stand-in
(``graphs.HostCapture``: a "graph" re-runs its Python callable and rewrites its static
outputs). ``test_graphs_gpu.py`` runs the same tests with real CUDA-graph capture on CuPy arrays
(its ``env`` fixture overrides the one below), plus GPU-only ones.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import pickle
import threading
import weakref

import numpy as np
import pytest

import sdm_cupy as sdm
from sdm_cupy import graphs
from sdm_cupy.graphs import pools
from helpers import BF16, assert_close, make_problem, to_numpy

S, P, HD, W = 16, 2, 8, 3


class HostEnv:
    """NumPy arrays, the host stand-in capture."""

    name = "host"

    def __init__(self):
        self.xp = np
        self.cap = graphs.HostCapture()

    def stream(self, name):
        return graphs.HostStream(name)

    def on(self, stream):
        return self.cap.using_stream(stream)

    def capturing(self):
        """A block during which the current stream is capturing a graph."""
        s = self.cap.current_stream()

        @contextlib.contextmanager
        def block():
            s.capturing = True
            try:
                yield
            finally:
                s.capturing = False
        return block()

    def force_oom(self, mempool):
        mempool.fail_alloc = True

    def clear_oom(self, mempool):
        mempool.fail_alloc = False

    def set_settings(self, monkeypatch, value):
        monkeypatch.setattr(self.cap, "settings_value", (value,))

    def sync(self):
        pass


@pytest.fixture
def env():
    return HostEnv()


@pytest.fixture(autouse=True)
def _fresh_graphs():
    graphs.reset_graphs()
    yield
    graphs.reset_graphs()


def problem(env, rng, B=2, T=9, dtype=np.float32, param=True):
    pb = make_problem(rng, B=B, T=T, P=P, hd=HD, S=S, W=W, dtype=dtype).to(env.xp)
    p = env.xp.asarray(rng.normal(size=(S, P * HD)).astype(dtype)) if param else None
    return pb, p


def cfg(**kw):
    return sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=4, **kw)


def other_inputs(env, rng, pb, dtype=np.float32):
    """Inputs of the same shapes as ``pb``'s, other values."""
    return make_problem(rng, B=pb.B, T=pb.T, P=P, hd=HD, S=S, W=W, dtype=dtype).to(env.xp).inputs


def eager(param, inputs, config, batch, dr=None, needs_backward=True):
    """The op through the public API alone: the reference every replay must equal."""
    xp = np if isinstance(inputs[2], np.ndarray) else __import__("cupy")
    D = inputs[2].shape[-1]
    bank = (xp.zeros((batch * S, D), dtype=inputs[2].dtype) if param is None
            else sdm.expand_memory_batch(param, batch))
    res = sdm.forward(bank, *inputs, config, needs_backward=dr is not None, inplace=True,
                      check_indices=False)
    if dr is None:
        return res.readings, res.bank, None
    bank_out = res.bank.copy()
    g = sdm.backward(res.saved, dr)
    gp = None if param is None else sdm.sum_memory_batch(g.bank, S)
    return res.readings, bank_out, graphs.RunnerGradients(gp, g.write_w, g.values, g.beta,
                                                           g.read_w)


def same(got, want, name):
    g, w = to_numpy(got), to_numpy(want)
    assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: {g.shape}/{g.dtype} vs {w.shape}/{w.dtype}"
    assert np.array_equal(g, w), f"{name}: replay differs from eager (max abs {np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))})"


def same_grads(got, want, rtol=1e-5):
    for f in ("param", "write_w", "values", "beta", "read_w"):
        a, b = getattr(got, f), getattr(want, f)
        if b is None:
            assert a is None, f
        else:
            assert_close(a, b, rtol, name=f"grad {f}")


def grad_like(env, rng, pb):
    return env.xp.asarray(rng.normal(size=(pb.B, pb.T, P * HD)).astype(np.float32))


def runner(env, name="layer"):
    return graphs.GraphRunner(name, capture=env.cap)


# ---- §8.1: forward and backward graphs, captured once, replayed ---------------------------
@pytest.mark.parametrize("with_param", [True, False], ids=["param", "zeros"])
def test_replays_equal_eager(env, rng, with_param):
    pb, p = problem(env, rng, param=with_param)
    c = cfg()
    r = runner(env)
    for step in range(3):
        inputs = other_inputs(env, rng, pb)
        dr = grad_like(env, rng, pb)
        readings, bank, h = r.forward(p, *inputs, c, batch=pb.B)
        g = r.backward(h, dr)
        want_r, want_bank, want_g = eager(p, inputs, c, pb.B, dr)
        same(readings, want_r, "readings")
        same(bank, want_bank, "final bank")
        same_grads(g, want_g)
    assert r.stats["forward_capture"] == 1 and r.stats["backward_capture"] == 1
    assert r.stats["forward_replay"] == 3 and r.stats["backward_replay"] == 2
    assert r.stats["stale_replay"] == 0


def test_forward_only_calls_are_a_key_of_their_own(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    readings, bank, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    r.backward(h, grad_like(env, rng, pb))
    for _ in range(2):
        inputs = other_inputs(env, rng, pb)
        readings, bank, h = r.forward(p, *inputs, c, batch=pb.B, needs_backward=False)
        assert h is None
        want_r, want_bank, _ = eager(p, inputs, c, pb.B)
        same(readings, want_r, "readings")
        same(bank, want_bank, "final bank")
    assert r.stats["forward_capture"] == 2 and r.stats["forward_replay"] == 3
    assert r.stats["eager_shape"] == 0


def test_decode_state_continues_in_place(env, rng):
    """Forward-only calls carry a ReplayedState: passing it back continues without a copy and
    gives the eager LayerState loop's readings and bank."""
    pb, p = problem(env, rng, T=1)
    c = cfg()
    r = runner(env)
    state = sdm.LayerState(sdm.expand_memory_batch(p, pb.B), 0)
    ref = sdm.LayerState(sdm.expand_memory_batch(p, pb.B), 0)
    old = None
    for t in range(5):
        inputs = other_inputs(env, rng, pb)
        readings, state, _ = r.forward(state, *inputs, c, batch=pb.B, needs_backward=False,
                                       seq_len=t + 1)
        res = sdm.forward(ref.memory, *inputs, c, needs_backward=False, check_indices=False)
        ref.update_(res.bank, seq_len=1)
        same(readings, res.readings, f"readings at step {t}")
        assert state.seq_len == ref.seq_len == t + 1
        if old is not None:
            assert old._copy is None, "continued in place, without copying the bank"
            with pytest.raises(RuntimeError, match="overwritten"):
                old.memory   # its bank was advanced in place by this step
        old = state
    assert isinstance(state, graphs.ReplayedState) and isinstance(state, sdm.LayerState)
    same(state.memory, ref.memory, "final bank")
    assert r.stats["forward_capture"] == 1 and r.stats["forward_replay"] == 5


# ---- §8.2: keys, eager fallback, one warning per reason, reset ----------------------------
def test_other_key_runs_eager_and_warns_once(env, rng, caplog):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env, "keyed")
    r.forward(p, *pb.inputs, c, batch=pb.B)
    longer, _ = problem(env, rng, T=pb.T + 3)
    with caplog.at_level(logging.WARNING, logger="sdm_cupy.graphs"):
        for _ in range(3):
            readings, bank, h = r.forward(p, *longer.inputs, c, batch=pb.B)
        want_r, _, want_g = eager(p, longer.inputs, c, pb.B, grad_like(env, rng, longer))
    same(readings, want_r, "eager readings")
    assert r.stats["eager_shape"] == 3
    warnings = [m for m in caplog.messages if "differs from the captured" in m]
    assert len(warnings) == 1 and warnings[0].startswith("keyed:")
    assert not h.graphed


@pytest.mark.parametrize("change", ["dtype", "config", "batch", "param", "settings"])
def test_key_covers_every_setting(env, rng, monkeypatch, change):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    r.forward(p, *pb.inputs, c, batch=pb.B)
    kw = dict(batch=pb.B)
    args = [p, *pb.inputs, c]
    if change == "dtype":
        kw["dtype"] = np.float64
    elif change == "config":
        args[-1] = cfg(grad_bank_fp32=False)
    elif change == "batch":
        one = make_problem(rng, B=1, T=pb.T, P=P, hd=HD, S=S, W=W, dtype=np.float32).to(env.xp)
        args[1:7] = one.inputs
        kw["batch"] = 1
    elif change == "param":
        args[0] = None
    else:
        env.set_settings(monkeypatch, "other")
    r.forward(*args, **kw)
    assert r.stats["eager_shape"] == 1


def test_reset_graphs_captures_again(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    r.forward(p, *pb.inputs, c, batch=pb.B)
    longer, _ = problem(env, rng, T=pb.T + 1)
    r.forward(p, *longer.inputs, c, batch=pb.B)
    assert r.stats["eager_shape"] == 1
    graphs.reset_graphs()
    readings, _, h = r.forward(p, *longer.inputs, c, batch=pb.B)
    assert r.stats["forward_capture"] == 2 and h.graphed
    same(readings, eager(p, longer.inputs, c, pb.B)[0], "readings after reset")


# ---- §8.3: suspend, nested capture --------------------------------------------------------
def test_suspend_runs_eager(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    with graphs.suspend_graphs():
        assert graphs.graphs_suspended()
        readings, bank, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    assert not graphs.graphs_suspended()
    dr = grad_like(env, rng, pb)
    g = r.backward(h, dr)   # outside the block
    want_r, want_bank, want_g = eager(p, pb.inputs, c, pb.B, dr)
    same(readings, want_r, "readings")
    same_grads(g, want_g)
    assert r.stats["eager_suspended"] == 1 and r.stats["forward_capture"] == 0
    assert not h.graphed


def test_call_inside_a_capture_runs_eager(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    with env.capturing():
        r.forward(p, *pb.inputs, c, batch=pb.B, needs_backward=False)
    assert r.stats["eager_nested_capture"] == 1 and r.stats["forward_capture"] == 0
    readings, _, _ = r.forward(p, *pb.inputs, c, batch=pb.B, needs_backward=False)
    assert r.stats["forward_capture"] == 1   # the stream still captures and replays
    same(readings, eager(p, pb.inputs, c, pb.B)[0], "readings after the nested capture")


# ---- §8.4: the same saved items on both paths; eager recomputes ---------------------------
def test_both_paths_keep_token_param_inputs(env, rng, monkeypatch):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    _, _, graphed = r.forward(p, *pb.inputs, c, batch=pb.B)
    with graphs.suspend_graphs():
        _, _, plain = r.forward(p, *pb.inputs, c, batch=pb.B)
    for h in (graphed, plain):
        assert h.param is p
        assert all(a is b for a, b in zip(h.inputs, pb.inputs))
    assert graphed.token > 0 and graphed.graphed
    assert plain.token == 0 and plain.entry is None
    calls = []
    real = sdm.forward
    monkeypatch.setattr(sdm, "forward", lambda *a, **k: calls.append(k) or real(*a, **k))
    dr = grad_like(env, rng, pb)
    g = r.backward(plain, dr)
    assert len(calls) == 1 and calls[0]["needs_backward"], "eager backward recomputes its forward"
    same_grads(g, eager(p, pb.inputs, c, pb.B, dr)[2])


def test_handle_is_consumed(env, rng):
    pb, p = problem(env, rng)
    r = runner(env)
    _, _, h = r.forward(p, *pb.inputs, cfg(), batch=pb.B)
    with pytest.raises(ValueError, match="grad_readings"):
        r.backward(h, env.xp.zeros((1, 1, 1), dtype=np.float32))
    r.backward(h, grad_like(env, rng, pb))
    with pytest.raises(RuntimeError, match="already used"):
        r.backward(h, grad_like(env, rng, pb))


# ---- §8.5: tokens, owners, stale backward, the replayed state ----------------------------
def test_stale_backward_replays_its_forward(env, rng, caplog):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    first = other_inputs(env, rng, pb)
    second = other_inputs(env, rng, pb)
    _, _, h1 = r.forward(p, *first, c, batch=pb.B)
    _, _, h2 = r.forward(p, *second, c, batch=pb.B)   # the entry now holds the second call
    dr1, dr2 = grad_like(env, rng, pb), grad_like(env, rng, pb)
    with caplog.at_level(logging.WARNING, logger="sdm_cupy.graphs"):
        g1 = r.backward(h1, dr1)
        g2 = r.backward(h2, dr2)   # stale too: h1's replay and backward ran since
    same_grads(g1, eager(p, first, c, pb.B, dr1)[2])
    same_grads(g2, eager(p, second, c, pb.B, dr2)[2])
    assert r.stats["stale_replay"] == 2
    assert sum("replays that forward first" in m for m in caplog.messages) == 1
    _, _, h3 = r.forward(p, *first, c, batch=pb.B)
    r.backward(h3, dr1)
    assert r.stats["stale_replay"] == 2, "an owning call's backward replays nothing"


def test_replayed_state_copies_lazily_and_refuses_overwritten_bank(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    first, second = other_inputs(env, rng, pb), other_inputs(env, rng, pb)
    _, s1, _ = r.forward(p, *first, c, batch=pb.B, seq_len=pb.T)
    _, s2, h2 = r.forward(p, *second, c, batch=pb.B, seq_len=pb.T)
    with pytest.raises(RuntimeError, match="overwritten"):
        s1.memory
    same(s2.memory, eager(p, second, c, pb.B)[1], "state of the owning call")
    kept = s2.memory
    assert kept is s2.memory, "copied once"
    r.backward(h2, grad_like(env, rng, pb))   # rewinds the static bank
    same(s2.memory, eager(p, second, c, pb.B)[1], "a copy taken before the backward stays")
    _, s3, h3 = r.forward(p, *first, c, batch=pb.B, seq_len=pb.T)
    r.backward(h3, grad_like(env, rng, pb))
    with pytest.raises(RuntimeError, match="overwritten"):
        s3.memory
    s3.update_(kept, seq_len=2)   # replacing never reads the overwritten bank
    assert s3.memory is kept and s3.seq_len == pb.T + 2


# ---- §8.6: shared pools in call order, private pools after the first backward -------------
def test_replay_invalidates_entries_captured_after_it(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    a, b = runner(env, "a"), runner(env, "b")
    xa, xb = other_inputs(env, rng, pb), other_inputs(env, rng, pb)
    a.forward(p, *xa, c, batch=pb.B, needs_backward=False)     # captured first
    b.forward(p, *xb, c, batch=pb.B, needs_backward=False)
    ea, eb = a._entries[False], b._entries[False]
    assert ea.pool is eb.pool and ea.mempool is eb.mempool and (ea.index, eb.index) == (0, 1)
    _, sb, _ = b.forward(p, *xb, c, batch=pb.B, needs_backward=False, seq_len=1)
    _, sa, _ = a.forward(p, *xa, c, batch=pb.B, needs_backward=False, seq_len=1)
    with pytest.raises(RuntimeError, match="overwritten"):
        sb.memory   # a's replay may reuse b's blocks
    same(sa.memory, eager(p, xa, c, pb.B)[1], "a's state")
    _, sa, _ = a.forward(p, *xa, c, batch=pb.B, needs_backward=False, seq_len=1)
    b.forward(p, *xb, c, batch=pb.B, needs_backward=False)
    same(sa.memory, eager(p, xa, c, pb.B)[1], "a replay of b leaves a, captured before, alone")


def test_stale_backward_after_an_earlier_entry_replayed(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    a, b = runner(env, "a"), runner(env, "b")
    xa, xb = other_inputs(env, rng, pb), other_inputs(env, rng, pb)
    a.forward(p, *xa, c, batch=pb.B)
    _, _, hb = b.forward(p, *xb, c, batch=pb.B)
    a.forward(p, *xa, c, batch=pb.B)
    dr = grad_like(env, rng, pb)
    same_grads(b.backward(hb, dr), eager(p, xb, c, pb.B, dr)[2])
    assert b.stats["stale_replay"] == 1


def test_forward_captured_after_first_backward_gets_private_pool(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    a, late = runner(env, "a"), runner(env, "late")
    xa, xl = other_inputs(env, rng, pb), other_inputs(env, rng, pb)
    _, _, ha = a.forward(p, *xa, c, batch=pb.B)
    a.backward(ha, grad_like(env, rng, pb))
    ea = a._entries[True]
    assert ea.pool.has_backward and ea.backward is not None
    _, sl, _ = late.forward(p, *xl, c, batch=pb.B, seq_len=1)
    el = late._entries[True]
    assert el.pool is ea.pool, "same stream: same pool (lock, ordering)"
    assert el.mempool is not ea.mempool and el.index is None
    a.forward(p, *xa, c, batch=pb.B)
    same(sl.memory, eager(p, xl, c, pb.B)[1], "a private pool is not invalidated")


def test_replay_on_another_stream_is_ordered_with_events(env, rng):
    if env.name != "host":
        pytest.skip("the stand-in records the waits; test_graphs_gpu checks real streams")
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    r.forward(p, *pb.inputs, c, batch=pb.B, needs_backward=False)
    pool = r._entries[False].pool
    env.cap.waits.clear()
    r.forward(p, *pb.inputs, c, batch=pb.B, needs_backward=False)
    assert env.cap.waits == [], "same stream: no events"
    side = env.stream("side")
    with env.on(side):
        r.forward(p, *pb.inputs, c, batch=pb.B, needs_backward=False)
    assert env.cap.waits == [(side, pool.stream), (pool.stream, side)]


def _threads(n, fn):
    errors = []

    def run(i):
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def test_threads_share_a_runner_under_the_pool_lock(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    r.forward(p, *pb.inputs, c, batch=pb.B)   # capture first
    cases = [(other_inputs(env, rng, pb), grad_like(env, rng, pb)) for _ in range(4)]
    wants = [eager(p, x, c, pb.B, dr) for x, dr in cases]

    def work(i):
        x, dr = cases[i]
        for _ in range(5):
            readings, bank, h = r.forward(p, *x, c, batch=pb.B)
            g = r.backward(h, dr)
            env.sync()
            same(readings, wants[i][0], f"thread {i} readings")
            same(bank, wants[i][1], f"thread {i} bank")
            same_grads(g, wants[i][2])
    _threads(4, work)
    assert r.stats["forward_capture"] == 1


def test_threads_on_their_own_streams(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    runners = [runner(env, f"t{i}") for i in range(4)]
    streams = [env.stream(f"s{i}") for i in range(4)]
    cases = [(other_inputs(env, rng, pb), grad_like(env, rng, pb)) for _ in range(4)]
    wants = [eager(p, x, c, pb.B, dr) for x, dr in cases]

    def work(i):
        x, dr = cases[i]
        with env.on(streams[i]):
            for _ in range(5):
                readings, _, h = runners[i].forward(p, *x, c, batch=pb.B)
                g = runners[i].backward(h, dr)
                env.sync()
                same(readings, wants[i][0], f"thread {i} readings")
                same_grads(g, wants[i][2])
    _threads(4, work)
    assert len({id(rr._entries[True].pool) for rr in runners}) == 4


# ---- §8.7: out-of-memory fallbacks; refusals are the call's own errors --------------------
def test_out_of_memory_while_capturing_runs_eager(env, rng, caplog):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env, "oom")
    pool = pools.pool_for(env.cap, env.cap.device(pb.values), env.cap.current_stream())
    env.force_oom(pool.mempool)
    try:
        with caplog.at_level(logging.WARNING, logger="sdm_cupy.graphs"):
            dr = grad_like(env, rng, pb)
            readings, _, h = r.forward(p, *pb.inputs, c, batch=pb.B)
            g = r.backward(h, dr)
            r.forward(p, *pb.inputs, c, batch=pb.B)
    finally:
        env.clear_oom(pool.mempool)
    want_r, _, want_g = eager(p, pb.inputs, c, pb.B, dr)
    same(readings, want_r, "readings")
    same_grads(g, want_g)
    assert r.capture_failed and r.stats["eager_capture_failed"] == 2
    assert sum("capturing the op failed" in m for m in caplog.messages) == 1
    graphs.reset_graphs()
    _, _, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    assert h.graphed and r.stats["forward_capture"] == 1


def test_out_of_memory_first_backward_releases_the_pool(env, rng, caplog):
    pb, p = problem(env, rng)
    c = cfg()
    a, b = runner(env, "a"), runner(env, "b")
    xa, xb = other_inputs(env, rng, pb), other_inputs(env, rng, pb)
    _, sa, ha = a.forward(p, *xa, c, batch=pb.B, seq_len=1)
    _, _, hb = b.forward(p, *xb, c, batch=pb.B)
    ea, eb = a._entries[True], b._entries[True]
    mempool = ea.mempool
    assert eb.mempool is mempool
    env.force_oom(mempool)
    dra, drb = grad_like(env, rng, pb), grad_like(env, rng, pb)
    try:
        with caplog.at_level(logging.WARNING, logger="sdm_cupy.graphs"):
            ga = a.backward(ha, dra)
    finally:
        env.clear_oom(mempool)
    same_grads(ga, eager(p, xa, c, pb.B, dra)[2])
    assert ea.released and eb.released and a.capture_failed and b.capture_failed
    assert a._entries == {} and b._entries == {}
    with pytest.raises(RuntimeError, match="overwritten"):
        sa.memory
    same_grads(b.backward(hb, drb), eager(p, xb, c, pb.B, drb)[2])   # pending: eager
    assert b.stats["eager_backward"] == 1
    readings, _, h = a.forward(p, *xa, c, batch=pb.B)   # runs eager, keeps working
    same(readings, eager(p, xa, c, pb.B)[0], "eager after the release")
    assert not h.graphed and a.stats["eager_capture_failed"] == 2
    assert any("ran out of memory" in m for m in caplog.messages)
    new = runner(env, "new")
    _, _, h = new.forward(p, *xa, c, batch=pb.B)
    assert h.graphed and new._entries[True].mempool is not mempool, "a new pool"


def test_refusal_is_the_calls_own_error(env, rng):
    pb, _ = problem(env, rng, dtype=BF16, param=False)
    r = runner(env)
    with pytest.raises(sdm.UnsupportedConfigurationError, match="does not shrink"):
        r.forward(None, *pb.inputs, cfg(snapshot_quant="bf16"), batch=pb.B, dtype=BF16)
    assert not r.capture_failed and r.stats["eager_capture_failed"] == 0
    with pytest.raises(ValueError, match="write_w"):
        r.forward(None, pb.write_idx, pb.write_w[:, :1], *pb.inputs[2:], cfg(), batch=pb.B)
    assert not r.capture_failed


def test_a_failed_capture_runs_eager_until_reset(env, rng, monkeypatch, caplog):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env, "fails")
    real = env.cap.capture

    def broken(*a, **k):
        raise RuntimeError("stream capture unsupported (test)")
    monkeypatch.setattr(env.cap, "capture", broken)
    with caplog.at_level(logging.WARNING, logger="sdm_cupy.graphs"):
        for _ in range(3):
            readings, _, _ = r.forward(p, *pb.inputs, c, batch=pb.B)
    same(readings, eager(p, pb.inputs, c, pb.B)[0], "eager readings")
    assert r.stats["eager_capture_failed"] == 3
    assert sum("capture unsupported (test)" in m for m in caplog.messages) == 1
    monkeypatch.setattr(env.cap, "capture", real)
    r.forward(p, *pb.inputs, c, batch=pb.B)
    assert r.stats["forward_capture"] == 0, "never re-captured on its own"
    graphs.reset_graphs()
    r.forward(p, *pb.inputs, c, batch=pb.B)
    assert r.stats["forward_capture"] == 1


def test_a_failed_backward_capture_runs_the_backward_eagerly(env, rng, monkeypatch):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    _, _, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    real = env.cap.capture
    monkeypatch.setattr(env.cap, "capture", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("backward not capturable (test)")))
    dr = grad_like(env, rng, pb)
    same_grads(r.backward(h, dr), eager(p, pb.inputs, c, pb.B, dr)[2])
    monkeypatch.setattr(env.cap, "capture", real)
    x = other_inputs(env, rng, pb)
    _, _, h = r.forward(p, *x, c, batch=pb.B)
    same_grads(r.backward(h, dr), eager(p, x, c, pb.B, dr)[2])
    assert r.stats["eager_backward_capture"] == 1 and r.stats["eager_backward"] == 1
    assert r.stats["forward_replay"] == 2 and r.stats["backward_capture"] == 0


# ---- graph memory is never handed out; static inputs filled in place ----------------------
def test_outputs_are_fresh_arrays(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    readings, bank, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    g = r.backward(h, grad_like(env, rng, pb))
    e = r._entries[True]
    statics = [e.readings, e.bank, *e.grad_out, *e.static_in, e.static_param, e.grad_in]
    for out in (readings, bank, g.param, g.write_w, g.values, g.beta, g.read_w):
        for s in statics:
            if s is not None:
                assert not env.xp.shares_memory(out, s)
    want = readings.copy()
    readings[...] = 0   # the caller owns it
    again, _, _ = r.forward(p, *pb.inputs, c, batch=pb.B)
    same(again, want, "a replay after the caller wrote its output")


def test_static_inputs_filled_in_place(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    assert r.static_inputs() is None
    r.forward(p, *pb.inputs, c, batch=pb.B, needs_backward=False)
    r.forward(p, *pb.inputs, c, batch=pb.B)
    for needs in (False, True):
        st = r.static_inputs(needs_backward=needs)
        x = other_inputs(env, rng, pb)
        for name, a in zip(graphs.runner.INPUT_NAMES, x):
            st[name][...] = a
        args = [st[name] for name in graphs.runner.INPUT_NAMES]
        readings, _, h = r.forward(st.get("param", p), *args, c, batch=pb.B,
                                   needs_backward=needs)
        same(readings, eager(p, x, c, pb.B)[0], f"readings (needs_backward={needs})")
    # the training handle kept copies: refilling the static inputs does not change them
    for name, a in zip(graphs.runner.INPUT_NAMES, other_inputs(env, rng, pb)):
        st[name][...] = a
    r.forward(p, *pb.inputs, c, batch=pb.B)   # the entry now holds another call
    dr = grad_like(env, rng, pb)
    same_grads(r.backward(h, dr), eager(p, x, c, pb.B, dr)[2])
    assert r.stats["stale_replay"] == 1


def test_decode_with_static_inputs_then_every_key_change(env, rng, monkeypatch):
    """The decode step's path (its ReplayedState back as ``param``, the static inputs filled in
    place) gives the eager loop's readings; after such calls, a change of shape, index dtype,
    bank dtype or kernel settings still runs eager, an equal config replays, and the static
    path then replays correctly again (the replay's key check caches nothing stale)."""
    pb, p = problem(env, rng, T=1)
    c = cfg()
    r = runner(env)
    names = graphs.runner.INPUT_NAMES
    ref = sdm.LayerState(sdm.expand_memory_batch(p, pb.B), 0)
    _, state, _ = r.forward(sdm.LayerState(sdm.expand_memory_batch(p, pb.B), 0), *pb.inputs, c,
                            batch=pb.B, needs_backward=False, seq_len=1)
    ref.update_(sdm.forward(ref.memory, *pb.inputs, c, needs_backward=False,
                            check_indices=False).bank)
    st = r.static_inputs()
    args = [st[n] for n in names]

    def step(state, x, fill=True, config=c):
        if fill:
            for n, a in zip(names, x):
                st[n][...] = a
        readings, state, _ = r.forward(state, *(args if fill else x), config, batch=pb.B,
                                       needs_backward=False, seq_len=state.seq_len + 1)
        res = sdm.forward(ref.memory, *x, config, needs_backward=False, check_indices=False)
        ref.update_(res.bank)
        same(readings, res.readings, "readings")
        return state

    for _ in range(3):
        state = step(state, other_inputs(env, rng, pb))
    assert r.stats["forward_replay"] == 4 and r.stats["eager_shape"] == 0   # (the capture's too)
    state = step(state, other_inputs(env, rng, pb), config=cfg())   # equal, another object
    state = step(state, other_inputs(env, rng, pb), fill=False)     # the caller's arrays
    assert r.stats["forward_replay"] == 6 and r.stats["eager_shape"] == 0

    def changed(*x, **kw):   # an eager call; its result is dropped (the chain goes on)
        r.forward(state, *x, kw.pop("config", c), batch=pb.B, needs_backward=False,
                  seq_len=state.seq_len + 1, **kw)

    longer = make_problem(rng, B=pb.B, T=2, P=P, hd=HD, S=S, W=W, dtype=np.float32).to(env.xp)
    changed(*longer.inputs)
    changed(args[0].astype(np.int64), *args[1:])
    changed(*args, dtype=np.float64)
    env.set_settings(monkeypatch, "other")
    changed(*args)
    monkeypatch.undo()
    assert r.stats["eager_shape"] == 4 and r.stats["forward_replay"] == 6
    for _ in range(2):
        state = step(state, other_inputs(env, rng, pb))
    assert r.stats["forward_replay"] == 8 and r.stats["forward_capture"] == 1
    same(state.memory, ref.memory, "final bank")


def test_replays_invalidate_later_entries_in_any_order(env, rng):
    """A replay invalidates the state of every entry captured after it in the shared pool,
    whatever the order of the replays before (the pool tracks which entries may hold one)."""
    pb, p = problem(env, rng)
    c = cfg()
    rs = [runner(env, f"r{i}") for i in range(4)]
    xs = [other_inputs(env, rng, pb) for _ in rs]
    for r_, x in zip(rs, xs):
        r_.forward(p, *x, c, batch=pb.B, needs_backward=False)   # captured in this order
    assert [r_._entries[False].index for r_ in rs] == [0, 1, 2, 3]
    wants = [eager(p, x, c, pb.B)[1] for x in xs]
    for _ in range(25):
        seq = [int(i) for i in rng.integers(0, 4, size=int(rng.integers(1, 7)))]
        last = {}
        for k, i in enumerate(seq):
            last[i] = (k, rs[i].forward(p, *xs[i], c, batch=pb.B, needs_backward=False,
                                        seq_len=1)[1])
        for i, (k, state) in last.items():
            if all(j > i for j in seq[k + 1:]):   # no replay of an entry captured before since
                same(state.memory, wants[i], f"state of r{i} after {seq}")
            else:
                with pytest.raises(RuntimeError, match="overwritten"):
                    state.memory


# ---- §8.8: lifetime, copies ---------------------------------------------------------------
def test_entries_live_while_a_runner_or_backward_refers_to_them(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    _, _, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    ref = weakref.ref(r._entries[True])
    del r
    gc.collect()
    assert ref() is not None, "the pending backward keeps the entry"
    del h
    gc.collect()
    assert ref() is None, "no runner and no pending backward: freed"
    r2 = runner(env)
    r2.forward(p, *pb.inputs, c, batch=pb.B)
    ref2 = weakref.ref(r2._entries[True])
    graphs.reset_graphs()
    gc.collect()
    assert ref2() is None, "reset drops the runner's entries"


def test_deepcopy_and_pickle_give_fresh_runners(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env, "orig")
    r.forward(p, *pb.inputs, c, batch=pb.B)
    for clone in (copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert clone.name == "orig" and clone._entries == {} and not clone.stats
        readings, _, h = clone.forward(p, *pb.inputs, c, batch=pb.B)
        if clone.capture is not None:
            assert clone.stats["forward_capture"] == 1
            assert clone._entries[True] is not r._entries[True]
        same(readings, eager(p, pb.inputs, c, pb.B)[0], "copy's readings")
    assert r.stats["forward_capture"] == 1


# ---- §8.9: regions and slots --------------------------------------------------------------
def test_runners_in_one_region_take_distinct_slots(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    a, b = runner(env, "a"), runner(env, "b")
    with graphs.region():
        a.forward(p, *pb.inputs, c, batch=pb.B)
        b.forward(p, *pb.inputs, c, batch=pb.B)
    assert a._entries[True] is not b._entries[True]
    assert (a._entries[True].slot, b._entries[True].slot) == (0, 1)


def test_runners_in_different_regions_share_one_entry(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    layers = [runner(env, f"l{i}") for i in range(3)]
    xs = [other_inputs(env, rng, pb) for _ in layers]
    drs = [grad_like(env, rng, pb) for _ in layers]
    handles = []
    for lay, x in zip(layers, xs):
        with graphs.region():
            handles.append(lay.forward(p, *x, c, batch=pb.B)[2])
    entries = {id(lay._entries[True]) for lay in layers}
    assert len(entries) == 1, "L identical layers hold one entry"
    assert sum(lay.stats["forward_capture"] for lay in layers) == 1
    assert sum(lay.stats["forward_shared"] for lay in layers) == 2
    for lay, h, x, dr in reversed(list(zip(layers, handles, xs, drs))):
        same_grads(lay.backward(h, dr), eager(p, x, c, pb.B, dr)[2])
    # the last layer owned the entry; the two before it replayed their forward first
    assert [lay.stats["stale_replay"] for lay in layers] == [1, 1, 0]
    ref = weakref.ref(layers[0]._entries[True])
    del layers, handles, lay, h  # (the loop variables refer to them too)
    gc.collect()
    assert ref() is None and len(pools.shared) == 0


def test_a_runner_outside_regions_keeps_its_own_entry(env, rng):
    pb, p = problem(env, rng)
    c = cfg()
    a, b = runner(env, "a"), runner(env, "b")
    with graphs.region():
        a.forward(p, *pb.inputs, c, batch=pb.B)
    b.forward(p, *pb.inputs, c, batch=pb.B)
    assert a._entries[True] is not b._entries[True] and b._entries[True].slot is None


def test_numpy_without_stand_in_runs_eager(rng):
    pb, p = problem(HostEnv(), rng)
    r = graphs.GraphRunner("plain")
    readings, bank, h = r.forward(p, *pb.inputs, cfg(), batch=pb.B)
    assert r.stats["eager_host"] == 1 and not h.graphed
    same(readings, eager(p, pb.inputs, cfg(), pb.B)[0], "readings")


def test_decode_example_runs_on_the_stand_in():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "examples", "decode_with_graphs.py"),
                           "--cpu", "--tokens", "8"], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "PASSED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
