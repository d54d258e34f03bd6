"""Runs the headline forward (+ backward) a few times: a target for Nsight Compute.

    SDM_CUPY_NVRTC_OPTIONS=-lineinfo ncu --clock-control none -k regex:sdm_ \\
        --launch-skip 3 --launch-count 3 python3 benchmarks/profile_gpu.py [--backward]
"""

from __future__ import annotations

import argparse

import cupy as cp

import sdm_cupy as sdm
from bench_gpu import make_inputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--W", type=int, default=16)
    ap.add_argument("--time", action="store_true", help="print CUDA-event times instead")
    ap.add_argument("--decode", action="store_true",
                    help="time the decode-shaped call (T=1, B=64): device and host per call")
    ap.add_argument("--threads", type=int, default=None, help="forward block size (gpu.THREADS)")
    ap.add_argument("--fuse-threads", type=int, default=None,
                    help="block size of the one-token forward (gpu.FUSE_THREADS)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a launcher knob of kernels/gpu.py (an integer or None), e.g. "
                         "FWD_CHUNK=32; repeatable")
    args = ap.parse_args()
    from sdm_cupy.kernels import gpu
    for item in args.set:
        name, _, value = item.partition("=")
        if not hasattr(gpu, name):
            raise SystemExit(f"kernels/gpu.py has no knob {name}")
        setattr(gpu, name, None if value == "None" else int(value))
    if args.fuse_threads:
        gpu.FUSE_THREADS = args.fuse_threads
    if args.threads:
        gpu.THREADS = args.threads
    if args.decode:
        return decode()
    B, T, P, hd, S, W, C = 4, 4096, 8, 128, 16384, args.W, 64
    bank, wi, ww, v, beta, ri, rw, dr = make_inputs(B, T, P, hd, S, W)
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=C)
    if args.time:
        import numpy as np
        from bench_gpu import timeit
        lay = sdm._validate.layout(bank, wi, ww, v, beta, ri, rw, cfg)
        pl = gpu.plan(lay, cfg)
        t_pre = timeit(lambda: gpu._prepass_sparse(lay, pl, np.dtype(np.float32), wi, ww, ri,
                                                   rw, beta))
        t_f = timeit(lambda: sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True,
                                         check_indices=False, needs_backward=False))
        t_fs = timeit(lambda: sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True,
                                          check_indices=False))
        print(f"W={W}: pre-pass {t_pre * 1e3:.3f} ms, forward no snapshots {t_f * 1e3:.3f} ms, "
              f"with snapshots {t_fs * 1e3:.3f} ms (keep={pl.keep}, smem {pl.smem_fwd})")
        return
    for _ in range(args.reps):
        res = sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True, check_indices=False,
                          needs_backward=args.backward)
        if args.backward:
            sdm.backward(res.saved, dr)
    cp.cuda.Device().synchronize()
    print("done")


def decode(steps=500):
    import time
    from bench_gpu import timeit
    B, P, hd, S, W = 64, 8, 128, 16384, 16
    bank, wi, ww, v, beta, ri, rw, _ = make_inputs(B, 1, P, hd, S, W)
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=64)

    def call():
        sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True, check_indices=False,
                    needs_backward=False)

    dev = timeit(call, reps=200)   # events around one call: device time incl. launch gaps
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        call()
    host = (time.perf_counter() - t0) / steps
    cp.cuda.Device().synchronize()
    wall = (time.perf_counter() - t0) / steps
    print(f"decode T=1 B={B} W={W}: one call {dev * 1e6:.1f} us (events), host {host * 1e6:.1f} "
          f"us per call, wall {wall * 1e6:.1f} us per call over {steps}")


if __name__ == "__main__":
    main()
