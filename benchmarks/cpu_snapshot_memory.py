"""What fresh snapshot memory costs the CPU forward (issue 2's shape, float32, 2 threads).

A forward that saves snapshots writes B*T*P*W*hd elements (32 MiB here). Fresh memory of that
size is a new mapping whose pages the OS zeroes at first touch, inside the forward (with
NumPy's huge-page advice, through page compaction on this kind of VM). The CPU backend
therefore reuses a consumed forward's snapshot buffers (``kernels.cpu.recycle_snapshots``).
This measures, interleaved in one process, each forward followed by its backward:
  * forward without snapshots (``needs_backward=False``),
  * forward with snapshots, buffers reused after each backward (the default),
  * forward with snapshots in fresh memory every call (``cpu.SPARE_BYTES = 0``),
and prints the medians; ``NO_HUGEPAGE=1`` turns NumPy's huge-page advice off first.

    python benchmarks/cpu_snapshot_memory.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import numba
import numpy as np

import sdm_cupy as sdm
from sdm_cupy import demo
from sdm_cupy.kernels import cpu


def main():
    if os.environ.get("NO_HUGEPAGE"):
        np._core.multiarray._set_madvise_hugepage(False)
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    B, N, S, P, hd, W, C = 4, 512, 4096, 4, 64, 8, 64   # T = 2N = 1024
    rng = np.random.default_rng(0)
    bank, widx, ww, values, beta, ridx, rw = demo.make_inputs(rng, B, N, S, P, hd, W)[:7]
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=C)
    dr = np.zeros_like(values)

    def call(kind):
        cpu.SPARE_BYTES = 0 if kind == "fresh" else 1 << 30
        if kind == "fresh":
            cpu.release_spare_buffers()
        elif kind == "reused":   # an untimed forward+backward leaves its buffers to reuse
            sdm.backward(sdm.forward(bank, widx, ww, values, beta, ridx, rw, cfg, inplace=True,
                                     check_indices=False).saved, dr)
        t0 = time.perf_counter()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        res = sdm.forward(bank, widx, ww, values, beta, ridx, rw, cfg, inplace=True,
                          check_indices=False, needs_backward=kind != "none")
        t1 = time.perf_counter()
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        if kind != "none":
            sdm.backward(res.saved, dr)
        t2 = time.perf_counter()
        cpu.SPARE_BYTES = 1 << 30
        return t1 - t0, f1 - f0, t2 - t1

    kinds = ("none", "reused", "fresh")
    for k in kinds:   # warm-up: Numba's cache, the first mappings
        call(k)
    times = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for k in kinds:
            times[k].append(call(k))
    print(f"B={B} T={2 * N} P={P} hd={hd} S={S} W={W} C={C}, float32, "
          f"{numba.get_num_threads()} threads, snapshots {B * 2 * N * P * W * hd * 4 / 2 ** 20:.0f} MiB; "
          f"medians of {args.repeats}")
    print("| forward | fwd ms | kernel-side (sys) ms in fwd | bwd ms |")
    print("| --- | ---: | ---: | ---: |")
    names = {"none": "no snapshots (needs_backward=False)",
             "reused": "snapshots, buffers reused after the backward (default)",
             "fresh": "snapshots, fresh memory every call (SPARE_BYTES = 0)"}
    for k in kinds:
        f, s, b = (float(np.median([t[i] for t in times[k]])) * 1e3 for i in range(3))
        print(f"| {names[k]} | {f:.1f} | {s:.1f} | {'-' if k == 'none' else f'{b:.1f}'} |")


if __name__ == "__main__":
    main()
