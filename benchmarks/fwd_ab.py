"""Interleaved A/B timing of kernel variants in one process (the headline forward).

Each variant replaces one source of ``kernels/`` (``fwd`` unless ``--source`` names another,
e.g. ``prepass``) by a file, with optional extra NVRTC options; all are compiled up front, then
one forward of each runs in turn, rep after rep, so that clock and neighbour drift hit every
variant alike (separate processes differed by up to 8% on one lease). Prints the median and
quartiles per variant.

    cd benchmarks && python3 fwd_ab.py LABEL=FILE[:OPTIONS][@NAME=VALUE,...] ... [--source fwd]
        [--reps 40] [--threads 256] [--W 16] [--S 16384] [--hd 128] [--float32] [--C 64]
        [--backward] [--check] [--graph]

``--graph`` times replays of CUDA graphs, one captured per variant: device time alone, without
the 0.1-0.3 ms of host time an eager call adds (and its noise).

Each kernel instance a variant launches is compiled alone (``cupy.RawModule`` with that one
name expression), not in its module of 6-8 instances: about 2 s instead of 19 s for the
backward's (NVRTC, here; stop 49 found each instance's machine code byte for byte the same
either way). ``--full-modules`` compiles whole modules, as the package does.

``@NAME=VALUE`` sets launcher knobs of ``kernels/gpu.py`` for that variant only (integers or
None), e.g. ``t32=../kernels/sdm_fwd.cu@TILE_WIDTH=32,THREADS=512``. Variant files are
opened relative to the working directory (``benchmarks/``, as above).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

import cupy as cp

import sdm_cupy as sdm
from bench_gpu import capture_graph, make_inputs, replay_time
from sdm_cupy.kernels import _build as K
from sdm_cupy.kernels import gpu


def occupancy(fn, grid, threads, smem):
    """Blocks per multiprocessor, and for a kernel with compile-time cluster dimensions the
    clusters that can be resident at once (driver API through ctypes; "?" when unavailable)."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int()
        r = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), ctypes.c_void_p(fn.kernel.ptr), ctypes.c_int(threads), ctypes.c_size_t(smem))
        text = f"{n.value} blocks per SM" if r == 0 else f"blocks per SM: error {r}"

        class LaunchConfig(ctypes.Structure):
            _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                        ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                        ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                        ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]

        cfg = LaunchConfig(int(grid), 1, 1, int(threads), 1, 1, int(smem), None, None, 0)
        r = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(fn.kernel.ptr),
                                              ctypes.byref(cfg))
        # without cluster dimensions the driver counts single blocks as clusters
        return text + (f", {n.value} clusters at once" if r == 0 else f", clusters: error {r}")
    except Exception as exc:  # noqa: BLE001
        return f"? ({type(exc).__name__}: {exc})"


def get_function_alone(src: str, key: tuple, name: str):
    """``_build.get_function`` with each instance in a module of its own (the current
    variant's source and options, cached in its ``K._modules``)."""
    k = (cp.cuda.Device().id, src, key, name)
    mod = K._modules.get(k)
    if mod is None:
        mod = K._modules[k] = cp.RawModule(code=K.source(src), options=K.options(),
                                           name_expressions=[name])
    return mod.get_function(name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=256)
    ap.add_argument("--W", type=int, default=16)
    ap.add_argument("--no-snapshots", action="store_true")
    ap.add_argument("--source", default="fwd", choices=sorted(K.SOURCES))
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    ap.add_argument("--check", action="store_true",
                    help="first check that every variant's forward (readings, final bank, "
                         "snapshots; with --backward also the gradients and the rewound bank) "
                         "is bitwise the first variant's, from the same bank")
    ap.add_argument("--smem-pre", action="append", default=[], metavar="LABEL=BYTES",
                    help="pre-pass shared memory of a variant whose layout differs from gpu._smem's")
    ap.add_argument("--C", type=int, default=64, help="chunk size")
    ap.add_argument("--S", type=int, default=16384, help="memory slots")
    ap.add_argument("--hd", type=int, default=128, help="head width")
    ap.add_argument("--float32", action="store_true",
                    help="float32 bank, values and reading grads (default bfloat16)")
    ap.add_argument("--graph", action="store_true",
                    help="time replays of each variant's call captured in a CUDA graph (device "
                         "time only) instead of eager calls")
    ap.add_argument("--full-modules", action="store_true",
                    help="compile whole modules, as the package does, instead of each launched "
                         "instance alone")
    args = ap.parse_args()
    gpu.THREADS = args.threads
    if not args.full_modules:
        K.get_function = get_function_alone
    B, T, P, hd, S, C = 4, 4096, 8, args.hd, args.S, args.C
    bank, wi, ww, v, beta, ri, rw, dr = make_inputs(B, T, P, hd, S, args.W)
    if args.float32:
        bank, v, dr = (x.astype(np.float32) for x in (bank, v, dr))
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=C)
    source, options, plan = K.source, K.options, gpu.plan
    smem_pre = dict((lab, int(n)) for lab, n in (x.split("=") for x in args.smem_pre))
    variants = []
    for spec in args.variants:
        label, rest = spec.split("=", 1)
        rest, _, sets = rest.partition("@")
        path, _, opts = rest.partition(":")
        text = open(path).read()
        knobs = {k: (None if v == "None" else int(v))
                 for k, v in (x.split("=") for x in sets.split(",") if x)}
        for k in knobs:
            if not hasattr(gpu, k):
                raise SystemExit(f"kernels/gpu.py has no knob {k}")
        variants.append((label, text, tuple(opts.split()), {}, knobs))
    knob_names = {k for var in variants for k in var[4]}
    defaults = {k: getattr(gpu, k) for k in knob_names}

    def select(var):
        label, text, opts, mods, knobs = var
        for k in knob_names:
            setattr(gpu, k, knobs.get(k, defaults[k]))
        K.source = (lambda name, t=text: K.inline_header(t) if name == args.source
                    else source(name))
        K.options = lambda o=opts: options() + o
        K._modules = mods
        pre = smem_pre.get(label)
        gpu.plan = plan if pre is None else (
            lambda *a, **k: dataclasses.replace(plan(*a, **k), smem_pre=pre))

    def call():
        res = sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True, check_indices=False,
                          needs_backward=args.backward or not args.no_snapshots)
        if args.backward:   # rewinds the bank: every rep sees the same one
            sdm.backward(res.saved, dr)

    if args.check:
        bank0, ref = bank.copy(), None
        for var in variants:
            select(var)
            bank[...] = bank0
            res = sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True,
                              check_indices=False)
            snaps = res.saved.snapshots
            snaps = snaps if isinstance(snaps, (tuple, list)) else (snaps,)
            outs = [res.readings.copy(), bank.copy()] + [x.copy() for x in snaps if x is not None]
            if args.backward:   # and the gradients, and the rewound bank
                grads = sdm.backward(res.saved, dr)
                outs += [getattr(grads, f.name).copy() for f in dataclasses.fields(grads)
                         if getattr(grads, f.name) is not None] + [bank.copy()]
            del res
            if ref is None:
                ref = outs
                continue
            same = [bool(cp.array_equal(a.view(cp.uint8), b.view(cp.uint8)))
                    for a, b in zip(ref, outs)]
            print(f"{var[0]}: bitwise equal to {variants[0][0]} (readings, final bank, "
                  f"snapshots{', gradients, rewound bank' if args.backward else ''}): {same}",
                  flush=True)
        bank[...] = bank0
        del ref, outs, bank0
    launches = {}
    launch = gpu._launch

    def record(src, key, name, grid, smem, a, threads=None):
        if src == "fwd":
            launches[current[0]] = (K.get_function(src, key, name), grid, threads or gpu.THREADS,
                                    smem)
        return launch(src, key, name, grid, smem, a, threads)

    gpu._launch, current = record, [None]
    for var in variants:   # compile and warm each
        current[0] = var[0]
        select(var)
        call()
        call()
    gpu._launch = launch
    cp.cuda.Device().synchronize()
    for label, (fn, grid, threads, smem) in launches.items():
        print(f"{label}: forward grid {grid} x {threads} threads, {smem} B shared memory: "
              f"{occupancy(fn, grid, threads, smem)}", flush=True)
    times = {var[0]: [] for var in variants}
    graphs = {}
    if args.graph:   # each variant's call captured once, with its own modules and knobs
        for var in variants:
            select(var)
            graphs[var[0]] = capture_graph(call)
    for _ in range(args.reps):
        for var in variants:
            if args.graph:
                graph, stream, _ = graphs[var[0]]
                times[var[0]].append(replay_time(graph, stream) * 1e3)
                continue
            select(var)
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            call()
            b.record()
            b.synchronize()
            times[var[0]].append(cp.cuda.get_elapsed_time(a, b))
    sdm.check_device_errors()
    what = ("forward+backward" if args.backward else
            "forward" + ("" if args.no_snapshots else " with snapshots"))
    print(f"{what}, W={args.W}, S={S}, hd={hd}, {'float32' if args.float32 else 'bfloat16'}, "
          f"threads={args.threads}, variants of {args.source}, {args.reps} interleaved "
          f"{'graph replays' if args.graph else 'reps'} (ms):")
    print("| variant | median | q25 | q75 |")
    print("| --- | ---: | ---: | ---: |")
    for label, ts in times.items():
        q25, q50, q75 = np.percentile(ts, [25, 50, 75])
        print(f"| {label} | {q50:.3f} | {q25:.3f} | {q75:.3f} |")


if __name__ == "__main__":
    main()
