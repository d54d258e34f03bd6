"""Host time per call of ``GraphRunner`` replays (the runner's own bookkeeping, issue 4).

    python3 benchmarks/runner_overhead.py            # CPU: the host capture stand-in
    python3 benchmarks/runner_overhead.py --gpu      # CuPy arrays, real CUDA graphs
    python3 benchmarks/runner_overhead.py --profile  # cProfile of each case
                                                     # (--only forward: the decode replay)
    python3 benchmarks/runner_overhead.py --compare /tmp/old/graphs   # A/B, one process

Cases (both through ``GraphRunner.forward``, after the capture):

* forward-only replay (decode): ``param`` is the ``ReplayedState`` of the previous call, the
  inputs are the arrays of ``runner.static_inputs()`` (filled in place by the caller),
  ``needs_backward=False``, ``seq_len`` given.
* training replay: ``forward(param, *inputs, needs_backward=True)`` + ``backward`` with the
  caller's own input arrays.

On the CPU the stand-in's launch is replaced by a no-op by default (``--launch none``), so the
time is the runner's bookkeeping plus the fresh output copies; ``--launch standin`` re-runs
the op as the stand-in does. With ``--gpu`` the shapes default to the decode step of
bench_graphs.py (T=1, B=64, P=8, hd=128, S=16384, W=16, bf16; the training case B=1, T=64,
``--train-shape``) and the time is the host
(enqueue) time: the device is synchronised between blocks of ``--sync-every`` calls, outside
the timed part, so that a full launch queue does not throttle the host.

Each figure is the median over ``--loops`` loops of ``--calls`` calls. ``--compare DIR``
imports a second copy of graphs/ from DIR and alternates the loops of both copies in one
process, so that both see the same machine state. A copy of an older commit:

    mkdir -p /tmp/old/graphs && for f in __init__ capture entry pools runner; do
        git show COMMIT:graphs/$f.py > /tmp/old/graphs/$f.py; done
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import sys
import time

import numpy as np

NAMES = ("write_idx", "write_w", "values", "beta", "read_idx", "read_w")


def load_graphs(path, name):
    """Imports the copy of graphs/ in ``path`` as package ``name`` (its imports are relative,
    or of sdm_cupy itself)."""
    path = os.path.abspath(path)
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(path, "__init__.py"), submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Backend:
    """Arrays, capture and synchronisation of one run (CPU stand-in or CuPy)."""

    def __init__(self, gpu, launch, graphs):
        self.gpu = gpu
        if gpu:
            import cupy
            self.xp = cupy
            self.capture = None   # the runner's default: CUDA graphs
        else:
            self.xp = np
            cap = graphs.HostCapture()
            if launch == "none":
                cap.launch = lambda graph, stream: None   # the bookkeeping alone
            self.capture = cap

    def sync(self):
        if self.gpu:
            self.xp.cuda.Device().synchronize()


def make_inputs(xp, rng, B, T, P, hd, S, W, dtype):
    D = P * hd
    wi = rng.integers(0, S, size=(B, T, P, W)).astype(np.int32)
    ri = rng.integers(0, S, size=(B, T, P, W)).astype(np.int32)
    ww = (rng.uniform(-1, 1, size=(B, T, P, W)) / np.sqrt(W)).astype(np.float32)
    rw = rng.normal(size=(B, T, P, W)).astype(np.float32)
    v = rng.normal(size=(B, T, D)).astype(dtype)
    beta = rng.uniform(0.1, 0.9, size=(B, T, P)).astype(np.float32)
    return tuple(xp.asarray(a) for a in (wi, ww, v, beta, ri, rw))


def timed(fn, be, calls, sync_every):
    """Host seconds per call of ``fn`` over one loop of ``calls`` calls (synchronisations not
    timed)."""
    block = sync_every or calls
    total, done = 0.0, 0
    while done < calls:
        n = min(block, calls - done)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        total += time.perf_counter() - t0
        be.sync()
        done += n
    return total / calls


def medians(fns, be, calls, loops, sync_every, warmup=50):
    """Median host seconds per call of each of ``fns``, their loops interleaved."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    be.sync()
    ts = [[] for _ in fns]
    for _ in range(loops):
        for t, fn in zip(ts, fns):
            t.append(timed(fn, be, calls, sync_every))
    return [float(np.median(t)) for t in ts]


def setup_decode(sdm, graphs, be, rng, a):
    cfg = sdm.SDMConfig(num_memory_slots=a.S, num_parallel=a.P, chunk_size=64)
    x = make_inputs(be.xp, rng, a.B, 1, a.P, a.hd, a.S, a.W, a.dtype)
    bank = sdm.expand_memory_batch(
        be.xp.asarray(rng.normal(size=(a.S, a.P * a.hd)).astype(a.dtype)), a.B)
    runner = graphs.GraphRunner("decode", capture=be.capture)
    box = [runner.forward(sdm.LayerState(bank, 0), *x, cfg, batch=a.B, needs_backward=False,
                          seq_len=1)[1]]   # captures
    static = runner.static_inputs()
    for n, arr in zip(NAMES, x):
        static[n][...] = arr
    sx = [static[n] for n in NAMES]
    B = a.B

    def step():
        s = box[0]
        box[0] = runner.forward(s, *sx, cfg, batch=B, needs_backward=False,
                                seq_len=s.seq_len + 1)[1]
    return runner, step


def setup_train(sdm, graphs, be, rng, a):
    cfg = sdm.SDMConfig(num_memory_slots=a.S, num_parallel=a.P, chunk_size=64)
    B, T = a.train_batch, a.train_T
    x = make_inputs(be.xp, rng, B, T, a.P, a.hd, a.S, a.W, a.dtype)
    param = be.xp.asarray((0.1 * rng.normal(size=(a.S, a.P * a.hd))).astype(a.dtype))
    dr = be.xp.asarray(rng.normal(size=(B, T, a.P * a.hd)).astype(a.dtype))
    runner = graphs.GraphRunner("train", capture=be.capture)

    def step():
        _, _, h = runner.forward(param, *x, cfg, batch=B)
        runner.backward(h, dr)
    step()   # captures both graphs
    return runner, step


def pieces(runner, be, calls, loops, sync_every):
    """Host time of the parts of a forward-only replay that are not the runner's Python."""
    e = runner._entries[False]
    cap = e.pool.capture
    stream = cap.current_stream()
    names = ("launch", "readings copy (capture.copy)")
    fns = (lambda: cap.launch(e.forward, stream), lambda: cap.copy(e.readings))
    if getattr(e, "copy_readings", None) is not None:
        names += ("readings copy (entry copier)",)
        fns += (lambda: e.copy_readings(stream),)
    return dict(zip(names, medians(fns, be, calls, loops, sync_every)))


def profile(step, be, calls, sync_every, title):
    prof = cProfile.Profile()
    for k in range(calls):
        prof.enable()
        step()
        prof.disable()
        if sync_every and (k + 1) % sync_every == 0:
            be.sync()
    be.sync()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(f"--- cProfile, {title}, {calls} calls ---")
    print(buf.getvalue())


def check(runner):
    assert runner.stats["forward_capture"] == 1 and runner.stats["forward_replay"] > 0, \
        dict(runner.stats)
    assert not any(k.startswith("eager") or k == "stale_replay" for k in runner.stats), \
        dict(runner.stats)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="CuPy arrays and real CUDA graphs")
    ap.add_argument("--launch", choices=("none", "standin"), default="none",
                    help="CPU only: no-op launch (bookkeeping alone) or the stand-in's replay")
    ap.add_argument("--calls", type=int, default=None, help="calls per loop (CPU 5000, GPU 2000)")
    ap.add_argument("--loops", type=int, default=9)
    ap.add_argument("--sync-every", type=int, default=None,
                    help="synchronise after this many calls, untimed (GPU default 100)")
    ap.add_argument("--shape", default=None,
                    help="B,P,hd,S,W of both cases (CPU 2,2,8,16,3; GPU 64,8,128,16384,16)")
    ap.add_argument("--train-shape", default=None,
                    help="B,T of the training case (CPU 2,4; GPU 1,64)")
    ap.add_argument("--only", choices=("forward", "train"), default=None)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile each case (of the installed graphs) and print the top "
                         "functions")
    ap.add_argument("--compare", default=None, metavar="DIR",
                    help="also time the copy of graphs/ in DIR, loops interleaved")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    a = ap.parse_args(argv)

    import ml_dtypes
    import sdm_cupy as sdm
    from sdm_cupy import graphs
    copies = [("installed", graphs)]
    if a.compare:
        copies.append((f"compare ({a.compare})", load_graphs(a.compare, "_graphs_compare")))
    shape = a.shape or ("64,8,128,16384,16" if a.gpu else "2,2,8,16,3")
    a.B, a.P, a.hd, a.S, a.W = (int(v) for v in shape.split(","))
    a.train_batch, a.train_T = (int(v) for v in
                                (a.train_shape or ("1,64" if a.gpu else "2,4")).split(","))
    a.dtype = np.dtype(ml_dtypes.bfloat16) if a.gpu else np.dtype(np.float32)
    calls = a.calls or (2000 if a.gpu else 5000)
    sync_every = a.sync_every if a.sync_every is not None else (100 if a.gpu else 0)

    results = {"backend": "cupy" if a.gpu else f"host stand-in (launch={a.launch})",
               "calls": calls, "loops": a.loops, "cases": {}}
    print(f"{results['backend']}, {calls} calls x {a.loops} loops, median host us per call")
    cases = []
    if a.only in (None, "forward"):
        cases.append(("forward-only replay", setup_decode))
    if a.only in (None, "train"):
        cases.append(("training replay (forward + backward)", setup_train))
    for name, setup in cases:
        runs = []
        for label, g in copies:
            be = Backend(a.gpu, a.launch, g)
            runner, step = setup(sdm, g, be, np.random.default_rng(0), a)
            runs.append((label, g, be, runner, step))
        ts = medians([r[4] for r in runs], runs[0][2], calls, a.loops, sync_every)
        out = results["cases"][name] = {}
        for (label, g, be, runner, step), t in zip(runs, ts):
            check(runner)
            out[label] = t * 1e6
            print(f"{name} [{label}]: {t * 1e6:.2f} us", flush=True)
        if setup is setup_decode:
            label, g, be, runner, step = runs[0]
            for k, v in pieces(runner, be, calls, a.loops, sync_every).items():
                out[f"{k} alone"] = v * 1e6
                print(f"  {k} alone: {v * 1e6:.2f} us", flush=True)
        if a.profile:
            profile(runs[0][4], runs[0][2], calls, sync_every, name)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
