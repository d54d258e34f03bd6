"""Host time of eager ``forward``/``backward`` calls on the GPU, and where it goes.

    python3 benchmarks/host_overhead.py [--T 4096] [--B 4] [--calls 20] [--profile]

Three timings per shape, after warm-up (medians over loops of ``--calls`` calls):

* host: wall time of the Python call alone (the device is synchronised between loops, outside
  the timed part, so that a full launch queue does not throttle the host);
* synced: CUDA events around each call with the device idle before it (``bench_gpu.timeit``,
  as bench_gpu.py's eager rows: host time before the first kernel + device time);
* queued: CUDA events around ``--calls`` calls issued back to back (device time per call when
  the host keeps ahead, as in a training loop).

Two more forward-only rows range-check the ids first (``check_indices=True``, the default:
one elementwise pass over both index arrays and one host sync) and, for comparison, the way
stops 1-16 did it (minimum and maximum of each array: four reductions, four syncs). A checked
call waits for the device, so its host time includes the device time of the call before it.

One more forward-only row clears the launcher's remembered plans before each call (how every
call ran before stop 17).

``--profile`` adds a cProfile of the forward-only calls (top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

import cupy as cp

import sdm_cupy as sdm
from bench_gpu import make_inputs, timeit
from sdm_cupy import _validate as V
from sdm_cupy.kernels import gpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--W", type=int, default=16)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--loops", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    B, T, P, hd, S, W = args.B, args.T, 8, 128, 16384, args.W
    bank, wi, ww, v, beta, ri, rw, dr = make_inputs(B, T, P, hd, S, W)
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=64)

    def fwd_only():
        return sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True,
                           needs_backward=False, check_indices=False)

    def fwd_checked():
        return sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True,
                           needs_backward=False)

    def fwd_checked_per_array():
        V.check_index_range("write_idx", wi, S)
        V.check_index_range("read_idx", ri, S)
        return fwd_only()

    def fwd_no_plan_cache():   # as before stop 17: the launcher computes its plans afresh
        gpu._PLANS.clear()
        return fwd_only()

    def fwd_bwd():
        res = sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True, check_indices=False)
        return sdm.backward(res.saved, dr)

    rows = []
    for name, fn in (("forward (no snapshots)", fwd_only), ("forward+backward", fwd_bwd),
                     ("forward, plans computed afresh", fwd_no_plan_cache),
                     ("forward, ids checked (one pass)", fwd_checked),
                     ("forward, ids checked per array (min, max)", fwd_checked_per_array)):
        for _ in range(3):
            fn()
        cp.cuda.Device().synchronize()
        host, synced, queued = [], [], []
        for _ in range(args.loops):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            host.append((time.perf_counter() - t0) / args.calls)
            synced.append(timeit(fn, reps=args.calls, warmup=0))
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            for _ in range(args.calls):
                fn()
            b.record()
            b.synchronize()
            queued.append(cp.cuda.get_elapsed_time(a, b) * 1e-3 / args.calls)
        rows.append((name, np.median(host), np.median(synced), np.median(queued)))
        print(rows[-1], flush=True)
    if args.profile:
        cp.cuda.Device().synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fwd_only()
        prof.disable()
        cp.cuda.Device().synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(f"B={B} T={T} P={P} hd={hd} S={S} W={W}, bf16; ms per call")
    print("| call | host | synced (host + device) | queued (device) |")
    print("| --- | ---: | ---: | ---: |")
    for name, h, s, q in rows:
        print(f"| {name} | {h * 1e3:.3f} | {s * 1e3:.3f} | {q * 1e3:.3f} |")


if __name__ == "__main__":
    main()
