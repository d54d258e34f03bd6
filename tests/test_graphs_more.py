"""More of the graph runner's contract (SPEC §8): cases the tests of ``test_graphs.py`` leave
open, each guarding one rule (found by mutation testing of ``graphs/``).

They run on the CPU backend against the host capture stand-in (``graphs.HostCapture``),
with the fixtures and helpers of ``test_graphs.py`` (``env``, the autouse ``_fresh_graphs``
that resets the registries around each test, ``problem``, ``eager``, ...).
"""

from __future__ import annotations

import copy

import pytest

import sdm_cupy as sdm
from sdm_cupy import graphs
from sdm_cupy.graphs import pools
from test_graphs import (  # noqa: F401 - env and _fresh_graphs are fixtures
    _fresh_graphs, cfg, eager, env, grad_like, other_inputs, problem, runner, same, same_grads)


def _shares_any(env, out, arrays) -> bool:
    return bool(any(a is not None and env.xp.shares_memory(out, a) for a in arrays))


# ---- §8 "every output is a fresh array": forward-only replays, replayed backwards ----------
def test_forward_only_replay_outputs_are_fresh_arrays(env, rng):
    """SPEC §8 (graph memory is never handed out): a forward-only replay returns readings and a
    final bank of its own; a later replay with other inputs leaves them unchanged."""
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    x1, x2 = other_inputs(env, rng, pb), other_inputs(env, rng, pb)
    r.forward(p, *x1, c, batch=pb.B, needs_backward=False)   # the capture
    r.forward(p, *x1, c, batch=pb.B, needs_backward=False)   # a replay, not the capture
    e = r._entries[False]
    statics = [e.readings, e.bank, e.static_bank, *e.static_in]
    readings, bank, _ = r.forward(p, *x1, c, batch=pb.B, needs_backward=False)
    shared = [n for n, out in (("readings", readings), ("final bank", bank))
              if _shares_any(env, out, statics)]
    assert not shared, f"graph memory handed out: {shared}"
    r.forward(p, *x2, c, batch=pb.B, needs_backward=False)   # rewrites the graph's memory
    want_r, want_bank, _ = eager(p, x1, c, pb.B)
    same(readings, want_r, "readings after a later replay")
    same(bank, want_bank, "final bank after a later replay")
    assert r.stats["forward_capture"] == 1 and r.stats["forward_replay"] == 4


def test_replayed_backward_gradients_are_fresh_arrays(env, rng):
    """SPEC §8 (gradients are fresh arrays): the gradients of a replayed backward (the second
    and later ones, launched from the backward graph) are not the graph's gradient buffers; a
    later backward leaves them unchanged."""
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    _, _, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    r.backward(h, grad_like(env, rng, pb))   # the backward capture
    x2, x3 = other_inputs(env, rng, pb), other_inputs(env, rng, pb)
    dr2, dr3 = grad_like(env, rng, pb), grad_like(env, rng, pb)
    _, _, h2 = r.forward(p, *x2, c, batch=pb.B)
    g2 = r.backward(h2, dr2)
    assert r.stats["backward_replay"] == 1
    e = r._entries[True]
    statics = [*e.grad_out, e.grad_in, e.static_bank, *e.static_in]
    shared = [f for f in ("param", "write_w", "values", "beta", "read_w")
              if _shares_any(env, getattr(g2, f), statics)]
    assert not shared, f"gradients that are graph memory: {shared}"
    _, _, h3 = r.forward(p, *x3, c, batch=pb.B)
    r.backward(h3, dr3)   # rewrites the backward graph's buffers
    assert r.stats["backward_replay"] == 2
    same_grads(g2, eager(p, x2, c, pb.B, dr2)[2])


# ---- §8.5: a stale backward replays its own call's forward -------------------------------
def test_stale_backward_replays_with_the_calls_own_param(env, rng):
    """SPEC §8.5 (stale backward): a backward whose entry holds another call's state replays
    its own forward, from its own param, even when that param is not the one of the capture."""
    pb, p = problem(env, rng)
    _, p2 = problem(env, rng)
    c = cfg()
    r = runner(env)
    x1, x2 = other_inputs(env, rng, pb), other_inputs(env, rng, pb)
    r.forward(p, *pb.inputs, c, batch=pb.B)                  # captured with p
    _, _, h2 = r.forward(p2, *x2, c, batch=pb.B)             # another param, same key
    _, _, h1 = r.forward(p, *x1, c, batch=pb.B)              # the entry now holds this call
    dr2 = grad_like(env, rng, pb)
    same_grads(r.backward(h2, dr2), eager(p2, x2, c, pb.B, dr2)[2])
    assert r.stats["stale_replay"] == 1 and r.stats["eager_shape"] == 0


def test_stale_backward_after_refilling_the_static_param(env, rng):
    """SPEC §8.5 / §8.4 (the handle keeps copies of static arrays the caller filled in place):
    a call whose param is the entry's static param, refilled in place before a later call,
    still gets the gradients of its own param in its (stale) backward."""
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    r.forward(p, *pb.inputs, c, batch=pb.B)
    st = r.static_inputs(needs_backward=True)
    pa, pbb = (env.xp.asarray(rng.normal(size=p.shape).astype(p.dtype)) for _ in range(2))
    x1, x2 = other_inputs(env, rng, pb), other_inputs(env, rng, pb)
    st["param"][...] = pa
    _, _, h1 = r.forward(st["param"], *x1, c, batch=pb.B)
    st["param"][...] = pbb   # refilled for the next call
    _, _, h2 = r.forward(st["param"], *x2, c, batch=pb.B)
    dr1, dr2 = grad_like(env, rng, pb), grad_like(env, rng, pb)
    same_grads(r.backward(h1, dr1), eager(pa, x1, c, pb.B, dr1)[2])   # stale
    same_grads(r.backward(h2, dr2), eager(pbb, x2, c, pb.B, dr2)[2])
    assert r.stats["stale_replay"] == 2


# ---- §8.5: an outdated ReplayedState passed back is refused --------------------------------
def test_outdated_replayed_state_passed_back_raises(env, rng):
    """SPEC §8.5 (the replayed state raises once its bank was overwritten): passing back a
    ReplayedState whose bank a later call advanced raises the "overwritten" error rather than
    continuing from that later call's bank; the current state still continues correctly."""
    pb, p = problem(env, rng, T=1)
    c = cfg()
    r = runner(env)
    x1, x2, x3 = (other_inputs(env, rng, pb) for _ in range(3))
    _, s1, _ = r.forward(p, *x1, c, batch=pb.B, needs_backward=False, seq_len=1)
    _, s2, _ = r.forward(s1, *x2, c, batch=pb.B, needs_backward=False, seq_len=2)
    with pytest.raises(RuntimeError, match="overwritten"):
        r.forward(s1, *x3, c, batch=pb.B, needs_backward=False, seq_len=2)
    bank2 = sdm.forward(eager(p, x1, c, pb.B)[1], *x2, c, needs_backward=False, inplace=False,
                        check_indices=False).bank
    want = sdm.forward(bank2, *x3, c, needs_backward=False, inplace=False, check_indices=False)
    readings, s3, _ = r.forward(s2, *x3, c, batch=pb.B, needs_backward=False, seq_len=3)
    same(readings, want.readings, "readings continuing from the current state")
    same(s3.memory, want.bank, "bank continuing from the current state")


# ---- §8.7: failures of capture() itself -------------------------------------------------
def test_out_of_memory_in_capture_itself_runs_eager(env, rng):
    """SPEC §8.7 (out of memory falls back to eager): an out-of-memory error raised by the
    capture itself (not the warm-up before it) makes the call, and the runner's later calls,
    run eager with the eager results."""
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    env.cap.fail_capture = graphs.HostOutOfMemory("stand-in: out of memory in capture (test)")
    dr = grad_like(env, rng, pb)
    readings, bank, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    want_r, want_bank, want_g = eager(p, pb.inputs, c, pb.B, dr)
    same(readings, want_r, "readings")
    same(bank, want_bank, "final bank")
    same_grads(r.backward(h, dr), want_g)
    assert r.capture_failed and not h.graphed and r._entries == {}
    r.forward(p, *pb.inputs, c, batch=pb.B)
    assert r.stats["eager_capture_failed"] == 2 and r.stats["forward_capture"] == 0


def test_refusal_raised_by_capture_itself_is_the_calls_own_error(env, rng):
    """SPEC §8.7 (refusals are the call's own errors): an UnsupportedConfigurationError raised
    while capturing propagates to the caller and is not a capture failure: the next call
    captures."""
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    env.cap.fail_capture = sdm.UnsupportedConfigurationError("refused while capturing (test)")
    with pytest.raises(sdm.UnsupportedConfigurationError, match="refused while capturing"):
        r.forward(p, *pb.inputs, c, batch=pb.B)
    assert not r.capture_failed and r.stats["eager_capture_failed"] == 0
    readings, _, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    assert h.graphed and r.stats["forward_capture"] == 1
    same(readings, eager(p, pb.inputs, c, pb.B)[0], "readings after the refusal")


# ---- §8.3: suspend_graphs ----------------------------------------------------------------
def test_suspend_runs_forward_only_calls_eager(env, rng):
    """SPEC §8.3 (every call inside suspend_graphs() runs eager): forward-only calls too,
    capturing nothing; after the block the same call captures."""
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    with graphs.suspend_graphs():
        readings, bank, h = r.forward(p, *pb.inputs, c, batch=pb.B, needs_backward=False,
                                      seq_len=1)
    assert h is None and not isinstance(bank, graphs.ReplayedState)
    assert r.stats["eager_suspended"] == 1 and r.stats["forward_capture"] == 0
    assert r._entries == {}
    want_r, want_bank, _ = eager(p, pb.inputs, c, pb.B)
    same(readings, want_r, "readings")
    same(bank.memory, want_bank, "final bank")
    _, state, _ = r.forward(p, *pb.inputs, c, batch=pb.B, needs_backward=False, seq_len=1)
    assert isinstance(state, graphs.ReplayedState) and r.stats["forward_capture"] == 1


def test_suspend_ends_when_its_block_raises(env, rng, monkeypatch):
    """SPEC §8.3 (suspend_graphs() is a block): an exception raised inside it still ends the
    suspension, and calls after it capture again."""
    pb, p = problem(env, rng)
    r = runner(env)
    # (restores the suspension count at teardown, so that a leak fails this test alone)
    monkeypatch.setattr(graphs.runner, "_suspended", graphs.runner._suspended)
    with pytest.raises(KeyError, match="inside the block"):
        with graphs.suspend_graphs():
            raise KeyError("inside the block")
    assert not graphs.graphs_suspended()
    _, _, h = r.forward(p, *pb.inputs, cfg(), batch=pb.B)
    assert h.graphed and r.stats["eager_suspended"] == 0


# ---- §8.9: regions and slots -------------------------------------------------------------
def test_a_replay_in_a_region_takes_its_slot(env, rng):
    """SPEC §8.9 (runners of one key inside one region take distinct slots): a runner that
    replays its shared entry inside a region holds that slot there, so a runner of the same key
    first called later in that region takes another slot and leaves the first's state alone."""
    pb, p = problem(env, rng)
    c = cfg()
    a, b = runner(env, "a"), runner(env, "b")
    xa, xb = other_inputs(env, rng, pb), other_inputs(env, rng, pb)
    with graphs.region():
        a.forward(p, *xa, c, batch=pb.B)   # captured: slot 0
    with graphs.region():
        _, sa, _ = a.forward(p, *xa, c, batch=pb.B, seq_len=1)   # a replay
        b.forward(p, *xb, c, batch=pb.B)
    ea, eb = a._entries[True], b._entries[True]
    assert ea is not eb and (ea.slot, eb.slot) == (0, 1)
    assert b.stats["forward_shared"] == 0 and b.stats["forward_capture"] == 1
    same(sa.memory, eager(p, xa, c, pb.B)[1], "a's state after b's call in the same region")


def test_regions_on_other_streams_do_not_share_entries(env, rng):
    """SPEC §8.9 with §8.6 (pools per stream): runners in different regions share an entry
    only within one pool; a runner first called on another stream captures its own entry in
    that stream's pool."""
    pb, p = problem(env, rng)
    c = cfg()
    a, b = runner(env, "a"), runner(env, "b")
    s1, s2 = env.stream("one"), env.stream("two")
    with env.on(s1), graphs.region():
        a.forward(p, *pb.inputs, c, batch=pb.B)
    with env.on(s2), graphs.region():
        _, _, hb = b.forward(p, *pb.inputs, c, batch=pb.B)
    ea, eb = a._entries[True], b._entries[True]
    assert ea is not eb and ea.pool is not eb.pool
    assert eb.pool is pools.pool_for(env.cap, "cpu", s2) and eb.mempool is not ea.mempool
    assert b.stats["forward_shared"] == 0 and b.stats["forward_capture"] == 1
    dr = grad_like(env, rng, pb)
    same_grads(b.backward(hb, dr), eager(p, pb.inputs, c, pb.B, dr)[2])


# ---- §8.7 / §8.8 / §8.2 / §8.6: smaller ones --------------------------------------------
def test_out_of_memory_first_backward_releases_the_memory_pool(env, rng):
    """SPEC §8.7 (an out-of-memory first backward frees the pool's blocks): the dropped
    entries' memory pool is released once."""
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    _, _, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    mempool = r._entries[True].mempool
    assert mempool.released == 0
    dr = grad_like(env, rng, pb)
    env.force_oom(mempool)
    try:
        g = r.backward(h, dr)
    finally:
        env.clear_oom(mempool)
    same_grads(g, eager(p, pb.inputs, c, pb.B, dr)[2])
    assert mempool.released == 1 and r.capture_failed


def test_deepcopy_of_a_failed_runner_captures(env, rng):
    """SPEC §8.8 (a copy is a fresh runner): the deep copy of a runner whose capture failed
    captures its own graphs."""
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env, "failed")
    env.cap.fail_capture = RuntimeError("stream capture unsupported (test)")
    r.forward(p, *pb.inputs, c, batch=pb.B)
    assert r.capture_failed
    clone = copy.deepcopy(r)
    assert not clone.capture_failed
    readings, _, h = clone.forward(p, *pb.inputs, c, batch=pb.B)
    assert h.graphed and clone.stats["forward_capture"] == 1
    same(readings, eager(p, pb.inputs, c, pb.B)[0], "the copy's readings")
    assert r.capture_failed, "the original still runs eager"


def test_reset_graphs_gives_new_forwards_a_shared_pool_again(env, rng):
    """SPEC §8.2 / §8.6 (reset drops every captured graph; forwards share a pool until its
    first backward): after reset_graphs(), forwards captured on the same stream as a pool that
    had a backward share one memory pool again."""
    pb, p = problem(env, rng)
    c = cfg()
    first = runner(env, "first")
    _, _, h = first.forward(p, *pb.inputs, c, batch=pb.B)
    first.backward(h, grad_like(env, rng, pb))
    old = first._entries[True].pool
    assert old.has_backward
    graphs.reset_graphs()
    a, b = runner(env, "a"), runner(env, "b")
    a.forward(p, *pb.inputs, c, batch=pb.B)
    b.forward(p, *pb.inputs, c, batch=pb.B)
    ea, eb = a._entries[True], b._entries[True]
    assert ea.pool is not old and not ea.pool.has_backward
    assert ea.mempool is eb.mempool and (ea.index, eb.index) == (0, 1)


def test_backward_captured_in_its_forwards_mempool(env, rng, monkeypatch):
    """SPEC §8.6 (a training entry's graphs live in its pool's memory, released together):
    the backward capture records into the memory pool of its forward."""
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    used = []
    real = env.cap.capture
    monkeypatch.setattr(env.cap, "capture",
                        lambda fn, mempool, *a, **k: used.append(mempool) or real(fn, mempool,
                                                                                    *a, **k))
    _, _, h = r.forward(p, *pb.inputs, c, batch=pb.B)
    r.backward(h, grad_like(env, rng, pb))
    mempool = r._entries[True].mempool
    assert len(used) == 2 and r.stats["backward_capture"] == 1
    assert used[0] is mempool and used[1] is mempool


# ---- §8 point 8: what keeps a runner alive; point 2: batch is part of the key ---------------
def test_a_pending_backward_does_not_keep_its_runner_alive(env, rng):
    """SPEC §8 (entries live while a runner or a pending backward refers to them): the entry
    refers to its runners weakly, so a pending backward keeps the entry, not the runner."""
    import gc
    import weakref
    pb, p = problem(env, rng)
    r = runner(env)
    _, _, h = r.forward(p, *pb.inputs, cfg(), batch=pb.B)
    alive = weakref.ref(r)
    entry = weakref.ref(r._entries[True])
    del r
    gc.collect()
    assert alive() is None, "the pending backward kept its runner"
    assert entry() is not None, "the pending backward must keep its entry"
    del h


def test_static_inputs_with_another_batch_are_refused(env, rng):
    """SPEC §8 (the key covers the batch): the static inputs passed back with another
    ``batch`` do not replay the entry; the call is checked like any other and refused."""
    pb, p = problem(env, rng)
    c = cfg()
    r = runner(env)
    r.forward(p, *pb.inputs, c, batch=pb.B, needs_backward=False)
    st = r.static_inputs(needs_backward=False)
    args = [st[name] for name in graphs.runner.INPUT_NAMES]
    replays = r.stats["forward_replay"]
    with pytest.raises(ValueError):
        r.forward(p, *args, c, batch=pb.B + 1, needs_backward=False)
    assert r.stats["forward_replay"] == replays
