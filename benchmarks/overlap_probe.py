"""Could the forward's pre-pass run beside the forward kernel instead of before it?

The pre-pass (ids and weights only) takes 0.13-0.17 ms of the headline forward's ~0.94 ms
on an H100, about a fifth of the byte floor; the forward kernel alone is within ~1.1x of it.
Running chunk n+k's pre-pass while the forward kernel works on chunk n would hide it, if the
two kernels can share the multiprocessors without slowing the forward. This probe measures
that before anything is built: no flags, no ordering, only concurrency. It records the
launches of one forward, then times, interleaved, graph-free (CUDA events, median ms):

- ``seq``: pre-pass then forward on one stream (what the library does today);
- ``fwd``: the forward kernel alone (on the pre-pass output of the warm-up call);
- ``fwd/rN``: the same compiled with ``--maxrregcount=N`` (the forward at 512 threads and 128
  registers fills an SM's register file: nothing else can be resident beside it);
- ``pre/tN``: the pre-pass alone at N threads per block;
- ``conc rN tN``: forward (capped at N registers, high-priority stream, launched first) and the
  pre-pass (into a second set of outputs, low-priority stream) at once, from a common start
  event to both ends.

If ``conc`` is close to ``fwd/rN`` and that is close to ``fwd``, the overlapped design (the
pre-pass flagging each chunk done, the forward waiting on the flag) would take most of the
pre-pass's time off the forward. Headline shape, bf16, exact snapshots.

    cd benchmarks && python3 overlap_probe.py [--W 8 16] [--reps 30] [--caps 96 112]
"""

from __future__ import annotations

import argparse

import numpy as np

import cupy as cp

import sdm_cupy as sdm
from bench_gpu import make_inputs
from fwd_ab import occupancy
from sdm_cupy.kernels import _build as K
from sdm_cupy.kernels import gpu


def priority_range():
    """(least, greatest) stream priority, from the driver (CuPy's runtime module has none)."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")
    least, greatest = ctypes.c_int(), ctypes.c_int()
    cp.cuda.Device().synchronize()   # a current context
    if cuda.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)) != 0:
        return 0, -5
    return least.value, greatest.value


def record_launches(call):
    seen = []
    launch = gpu._launch

    def rec(src, key, name, grid, smem, args, threads=None):
        seen.append((src, key, name, grid, smem, args, threads or gpu.THREADS))
        return launch(src, key, name, grid, smem, args, threads)

    gpu._launch = rec
    try:
        call()
    finally:
        gpu._launch = launch
    return seen


def compiled(src, key, name, extra=()):
    mod = cp.RawModule(code=K.source(src), options=K.options() + tuple(extra),
                       name_expressions=[name])
    return mod.get_function(name)


def launcher(fn, grid, threads, smem, args):
    if smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem

    def go(stream):
        with stream:   # RawKernel launches on the current stream
            fn((grid,), (threads,), args, shared_mem=smem)
    return go


def timed(parts):
    """parts: [(go, stream)]; all start after one event on the current stream, which waits for
    every part's end. Returns ms."""
    main = cp.cuda.get_current_stream()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(main)
    ends = []
    for go, s in parts:
        s.wait_event(a)
        go(s)
        e = cp.cuda.Event()
        e.record(s)
        ends.append(e)
    for e in ends:
        main.wait_event(e)
    b.record(main)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b)


def probe(W, reps, caps, pre_threads):
    B, T, P, hd, S, C = 4, 4096, 8, 128, 16384, 64
    bank, wi, ww, v, beta, ri, rw, _ = make_inputs(B, T, P, hd, S, W)
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=C)

    def call():
        return sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True,
                           check_indices=False, needs_backward=True)

    call()
    seen = record_launches(call)
    cp.cuda.Device().synchronize()
    (psrc, pkey, pname, pgrid, psmem, pargs, pthr), = [x for x in seen if x[0] == "prepass"]
    (fsrc, fkey, fname, fgrid, fsmem, fargs, fthr), = [x for x in seen if x[0] == "fwd"]
    # a second set of pre-pass outputs (val, wrun, ptr, col), so that the concurrent pre-pass
    # never writes what the forward reads
    pargs2 = list(pargs)
    for i in (12, 13, 14, 15):
        pargs2[i] = cp.empty_like(pargs[i])
    pargs2 = tuple(pargs2)
    lo, hi = priority_range()
    s_main = cp.cuda.Stream(non_blocking=True)
    s_hi = cp.cuda.Stream(non_blocking=True, priority=hi)
    s_lo = cp.cuda.Stream(non_blocking=True, priority=lo)
    # the modules the recorded call built; only the register caps compile anew
    f0, pfn = K.get_function(fsrc, fkey, fname), K.get_function(psrc, pkey, pname)
    pre = {t: launcher(pfn, pgrid, t, psmem, pargs2) for t in pre_threads}
    pre_own = launcher(pfn, pgrid, pthr, psmem, pargs)
    fwd = {"fwd": launcher(f0, fgrid, fthr, fsmem, fargs)}
    info = {"fwd": occupancy(f0, fgrid, fthr, fsmem)}
    for r in caps:
        fn = compiled(fsrc, fkey, fname, (f"--maxrregcount={r}",))
        fwd[f"fwd/r{r}"] = launcher(fn, fgrid, fthr, fsmem, fargs)
        info[f"fwd/r{r}"] = occupancy(fn, fgrid, fthr, fsmem)
    variants = {"seq": [(pre_own, s_main), (fwd["fwd"], s_main)]}
    for k, go in fwd.items():
        variants[k] = [(go, s_main)]
    for t, go in pre.items():
        variants[f"pre/t{t}"] = [(go, s_main)]
    for k in fwd:
        for t in pre_threads:
            variants[f"conc {k[4:] or 'r128'} t{t}"] = [(fwd[k], s_hi), (pre[t], s_lo)]
    for t in pre_threads:
        variants[f"conc pre-first r{caps[0]} t{t}"] = [(pre[t], s_lo),
                                                       (fwd[f"fwd/r{caps[0]}"], s_hi)]
    for _ in range(3):
        for parts in variants.values():
            timed(parts)
    times = {k: [] for k in variants}
    for _ in range(reps):
        for k, parts in variants.items():
            times[k].append(timed(parts))
    sdm.check_device_errors()
    print(f"\nW = {W}: forward grid {fgrid} x {fthr} threads, {fsmem} B shared; pre-pass grid "
          f"{pgrid}, {psmem} B shared", flush=True)
    for k, text in info.items():
        print(f"  {k}: {text}")
    print(f"| W = {W} variant | median ms | q25 | q75 |")
    print("| --- | ---: | ---: | ---: |")
    for k, ts in times.items():
        q25, med, q75 = np.percentile(ts, [25, 50, 75])
        print(f"| {k} | {med:.3f} | {q25:.3f} | {q75:.3f} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--W", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--caps", type=int, nargs="+", default=[96, 112])
    ap.add_argument("--pre-threads", type=int, nargs="+", default=[512, 256])
    args = ap.parse_args()
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for W in args.W:
        probe(W, args.reps, args.caps, args.pre_threads)


if __name__ == "__main__":
    main()
