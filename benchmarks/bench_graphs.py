"""Graph replay vs the eager op, side by side in one run (issue 4, SPEC §10 "decode").

    python3 benchmarks/bench_graphs.py [--quick] [--results benchmarks/RESULTS.md] [--out DIR]

* decode: T=1, B=64, P=8, hd=128, S=16384, W=16, bfloat16 bank and values, float32 weights.
  Eager = ``sdm.forward(bank, ..., needs_backward=False, inplace=True, check_indices=False)``
  on the carried bank (the cheapest eager call). Replay = ``GraphRunner.forward`` with the
  ``ReplayedState`` of the previous step as ``param`` (the bank advances inside the graph) and
  the step's inputs written into ``runner.static_inputs()``; also with fresh input arrays
  (six copies into the static inputs per step).
* training step: B=1, T=256, same heads and sizes, a learned bf16 initial bank ``param``
  [S, D]. Eager = expand, forward with snapshots, backward, sum over the batch. Replay =
  ``runner.forward`` + ``runner.backward`` (fresh outputs: readings, final bank, gradients).

Latency per step is host wall-clock over a loop of steps with one synchronisation at the end
(what a decode loop sees: launch-bound steps), the median of several loops after warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time

import numpy as np

import cupy as cp
import ml_dtypes

import sdm_cupy as sdm
from sdm_cupy import graphs

BF16 = np.dtype(ml_dtypes.bfloat16)
NAMES = ("write_idx", "write_w", "values", "beta", "read_idx", "read_w")


HOST = {}   # case -> host (enqueue) time per step, to tell host-bound from device-bound


def per_step(fn, steps, loops=5, warmup=20, name=None):
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    ts, hs = [], []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        t1 = time.perf_counter()
        cp.cuda.Device().synchronize()
        ts.append((time.perf_counter() - t0) / steps)
        hs.append((t1 - t0) / steps)
    if name:
        HOST[name] = float(np.median(hs))
    return float(np.median(ts))


def _raw_copy(src, stream):
    mem = cp.cuda.alloc(src.nbytes)
    cp.cuda.runtime.memcpyAsync(mem.ptr, src.data.ptr, src.nbytes,
                                cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
    return cp.ndarray(src.shape, src.dtype, mem)


def breakdown(runner, box, sx, cfg, B, steps=2000):
    """Host time of the pieces of one decode replay (us each)."""
    e = runner._entries[False]
    cap = e.pool.capture
    stream = cp.cuda.get_current_stream()
    parts = {
        "graph launch": lambda: cap.launch(e.forward, stream),
        "readings copy (memcpy)": lambda: cap.copy(e.readings),
        "readings copy (ndarray.copy)": lambda: e.readings.copy(),
        "cupy.empty alone": lambda: cp.empty(e.readings.shape, dtype=e.readings.dtype),
        "readings copy (alloc + runtime.memcpyAsync)": lambda: _raw_copy(e.readings, stream),
        "stream.is_capturing": lambda: stream.is_capturing(),
        "settings": lambda: cap.settings(),
    }
    out = {}
    for name, fn in parts.items():
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        out[name] = (time.perf_counter() - t0) / steps * 1e6
        cp.cuda.Device().synchronize()
    return out


def inputs(rng, B, T, P, hd, S, W):
    D = P * hd
    wi = cp.asarray(rng.integers(0, S, size=(B, T, P, W)).astype(np.int32))
    ri = cp.asarray(rng.integers(0, S, size=(B, T, P, W)).astype(np.int32))
    ww = cp.asarray((rng.uniform(-1, 1, size=(B, T, P, W)) / np.sqrt(W)).astype(np.float32))
    rw = cp.asarray(rng.normal(size=(B, T, P, W)).astype(np.float32))
    v = cp.asarray(rng.normal(size=(B, T, D)).astype(BF16))
    beta = cp.asarray(rng.uniform(0.1, 0.9, size=(B, T, P)).astype(np.float32))
    return (wi, ww, v, beta, ri, rw)


def bench_decode(rng, steps, B=64, P=8, hd=128, S=16384, W=16):
    D = P * hd
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=64)
    x = inputs(rng, B, 1, P, hd, S, W)
    bank = cp.asarray(rng.normal(size=(S, D)).astype(BF16))
    bank = sdm.expand_memory_batch(bank, B)

    def eager():
        sdm.forward(bank, *x, cfg, needs_backward=False, inplace=True, check_indices=False)

    runner = graphs.GraphRunner("decode")
    box = {"state": sdm.LayerState(bank.copy(), 0)}
    box["state"] = runner.forward(box["state"], *x, cfg, batch=B, needs_backward=False,
                                  seq_len=1)[1]   # captures
    static = runner.static_inputs()
    for n, a in zip(NAMES, x):
        static[n][...] = a
    sx = [static[n] for n in NAMES]

    def replay_static():
        box["state"] = runner.forward(box["state"], *sx, cfg, batch=B, needs_backward=False,
                                      seq_len=box["state"].seq_len + 1)[1]

    def replay_copies():
        box["state"] = runner.forward(box["state"], *x, cfg, batch=B, needs_backward=False,
                                      seq_len=box["state"].seq_len + 1)[1]

    t_eager = per_step(eager, steps, name="decode eager")
    t_static = per_step(replay_static, steps, name="decode replay (static inputs)")
    t_copies = per_step(replay_copies, steps, name="decode replay (input copies)")
    assert runner.stats["forward_capture"] == 1 and runner.stats["eager_shape"] == 0
    print("decode replay pieces, host us:", {k: round(v, 2) for k, v in
                                             breakdown(runner, box, sx, cfg, B).items()})
    return {"eager": t_eager, "replay (static inputs)": t_static,
            "replay (input copies)": t_copies}


def bench_train(rng, steps, B=1, T=256, P=8, hd=128, S=16384, W=16):
    D = P * hd
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=64)
    x = inputs(rng, B, T, P, hd, S, W)
    param = cp.asarray((0.1 * rng.normal(size=(S, D))).astype(BF16))
    dr = cp.asarray(rng.normal(size=(B, T, D)).astype(BF16))

    def eager():
        bank = sdm.expand_memory_batch(param, B)
        res = sdm.forward(bank, *x, cfg, inplace=True, check_indices=False)
        g = sdm.backward(res.saved, dr)
        sdm.sum_memory_batch(g.bank, S)

    runner = graphs.GraphRunner("train")

    def replay():   # the final bank comes back as a fresh copy
        _, _, h = runner.forward(param, *x, cfg, batch=B)
        runner.backward(h, dr)

    def replay_state():   # the state object instead (seq_len given): no bank copy
        _, _, h = runner.forward(param, *x, cfg, batch=B, seq_len=T)
        runner.backward(h, dr)

    replay()
    t_eager = per_step(eager, steps, warmup=5, name="train eager")
    t_replay = per_step(replay, steps, warmup=5, name="train replay (bank copied)")
    t_state = per_step(replay_state, steps, warmup=5, name="train replay (state object)")
    assert runner.stats["backward_replay"] > 0 and runner.stats["stale_replay"] == 0
    return {"eager": t_eager, "replay (bank copied)": t_replay,
            "replay (state object)": t_state}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--results", default=None, help="append the table to this markdown file")
    ap.add_argument("--out", default=None, help="also write bench_graphs.{json,md} here")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    steps = 50 if args.quick else 200
    dec = bench_decode(rng, steps)
    tr = bench_train(rng, max(10, steps // 4))
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = "unknown"
    commit = commit or os.environ.get("SDM_COMMIT", "unknown")
    rows = []
    for case, res in (("decode T=1 B=64 P=8 hd=128 S=16384 W=16 bf16", dec),
                      ("train step fwd+bwd B=1 T=256 (same sizes)", tr)):
        base = res["eager"]
        kind = "decode" if case.startswith("decode") else "train"
        for how, t in res.items():
            rows.append((case, how, t * 1e6, HOST.get(f"{kind} {how}", float("nan")) * 1e6,
                         base / t))
    lines = ["", f"## Graph replay vs eager ({datetime.date.today().isoformat()})", "",
             f"commit `{commit}`, device {device}, cupy {cp.__version__}, command "
             f"`python3 benchmarks/bench_graphs.py{' --quick' if args.quick else ''}`", "",
             "| case | path | per step (us) | host enqueue per step (us) | speed-up vs eager |",
             "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {c} | {h} | {t:.1f} | {hh:.1f} | {s:.2f}x |" for c, h, t, hh, s in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_graphs.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "bench_graphs.json"), "w") as f:
            json.dump({"decode": dec, "train": tr, "device": device, "commit": commit}, f)


if __name__ == "__main__":
    main()
