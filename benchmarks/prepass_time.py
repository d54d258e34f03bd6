"""Device time of the pre-pass alone at the headline shape: the forward's form (SPARSE=1, every
chunk) and the backward's (SPARSE=2, one range of chunks), for several block sizes, in one
process. The pre-pass is bank-independent, so it is the part of the forward that no bandwidth
argument bounds; this is the harness for making it cheaper.

    python3 benchmarks/prepass_time.py [--threads 128 256 512] [--W 16]
"""

from __future__ import annotations

import argparse

import numpy as np

import sdm_cupy as sdm
from bench_gpu import make_inputs, timeit
from sdm_cupy.kernels import _build as K
from sdm_cupy.kernels import gpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--W", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    B, T, P, hd, S, C = 4, 4096, 8, 128, 16384, 64
    bank, wi, ww, v, beta, ri, rw, _ = make_inputs(B, T, P, hd, S, args.W)
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=C)
    lay = sdm._validate.layout(bank, wi, ww, v, beta, ri, rw, cfg)
    pl = gpu.plan(lay, cfg)
    plb = gpu.plan(lay, cfg, backward=True)
    acc = np.dtype(np.float32)
    srt, ptr, col, val = gpu._bwd_scratch(lay, plb, acc)
    seg = plb.seg

    def bwd_pre():
        gpu._launch("prepass", (acc, lay.index_dtype),
                    K.prepass_name(acc, lay.index_dtype, 2, lay.S), B * P * seg, plb.smem_pre,
                    (wi, ww, ri, rw, beta, np.int32(T), np.int32(P), np.int32(args.W),
                     np.int64(S), np.int32(plb.C), np.int32(0), np.int32(seg), val, srt, ptr,
                     col, np.int32(plb.CS), gpu._err_array()), gpu.PREPASS_THREADS)

    print(f"B={B} T={T} P={P} S={S} W={args.W} C={pl.C}: {B * P * pl.Nt} forward chunks, "
          f"backward range of {seg} chunks per (b, p) ({B * P * seg} blocks); "
          f"shared memory {pl.smem_pre} B per block")
    rows = []
    for th in args.threads:
        gpu.PREPASS_THREADS = th
        tf = timeit(lambda: gpu._prepass_sparse(lay, pl, acc, wi, ww, ri, rw, beta), args.reps)
        tb = timeit(bwd_pre, args.reps)
        rows.append((th, tf * 1e3, tb * 1e3, tb * 1e3 * pl.Nt / seg))
    gpu.PREPASS_THREADS = 512
    sdm.check_device_errors()
    print("| threads | forward pre-pass ms | backward pre-pass ms (one range) | backward, all ranges ms |")
    print("| ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.3f} | {r[2]:.3f} | {r[3]:.3f} |")


if __name__ == "__main__":
    main()
