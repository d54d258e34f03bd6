"""Measures what each ``snapshot_quant`` mode saves and what it costs in gradient error.

For every (bank dtype, mode) pair it runs forward+backward on random problems and prints:
the saved-state bytes (``res.saved.nbytes``) against the exact mode, the worst relative RMS
error over seeds of the gradients of write_w, beta and read_w (the ones that depend on the
rewound bank) against the exact-snapshot run, and of the rewound bank's written rows against
the initial bank. The numbers in docs/CHOOSING.md come from

    python examples/snapshot_quant_error.py            # CPU backend (CuPy arrays: --gpu)
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np

import sdm_cupy as sdm

BF16 = np.dtype(ml_dtypes.bfloat16)


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2)) / max(np.sqrt(np.mean(want ** 2)), 1e-300))


def problem(rng, B, T, P, hd, S, W, dtype):
    D = P * hd
    return (rng.normal(size=(B * S, D)).astype(dtype),
            rng.integers(0, S, (B, T, P, W)).astype(np.int32),
            (rng.uniform(-1, 1, (B, T, P, W)) / np.sqrt(W)).astype(np.float32),
            rng.normal(size=(B, T, D)).astype(dtype),
            rng.uniform(0.1, 0.9, (B, T, P)).astype(np.float32),
            rng.integers(0, S, (B, T, P, W)).astype(np.int32),
            rng.normal(size=(B, T, P, W)).astype(np.float32))


def run(xp, args, cfg, dr, dM):
    x = [xp.asarray(a) for a in args]
    res = sdm.forward(*x, cfg)
    nbytes = res.saved.nbytes
    g = sdm.backward(res.saved, xp.asarray(dr), xp.asarray(dM))
    to = (lambda a: a.get()) if xp is not np else (lambda a: a)  # noqa: E731
    return nbytes, {k: to(getattr(g, k)) for k in ("write_w", "beta", "read_w")}, to(res.bank)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--shape", default="2,256,4,64,1024,8",
                    help="B,T,P,hd,S,W (default 2,256,4,64,1024,8)")
    ap.add_argument("--chunk", type=int, default=64)
    a = ap.parse_args(argv)
    if a.gpu:
        import cupy as xp
    else:
        xp = np
    B, T, P, hd, S, W = (int(v) for v in a.shape.split(","))
    print(f"B={B} T={T} P={P} hd={hd} S={S} W={W} C={a.chunk}, {a.seeds} seeds, "
          f"{'GPU' if a.gpu else 'CPU'} backend")
    print(f"{'bank':>9} {'mode':>9} {'saved MiB':>10} {'vs exact':>9} {'grad err':>9} "
          f"{'rewound err':>11}")
    for dtype, modes in ((np.dtype(np.float32), (None, "bf16", "fp8_e4m3", "int8")),
                         (BF16, (None, "fp8_e4m3", "int8"))):
        exact_bytes = None
        for mode in modes:
            worst_g, worst_b, nbytes = 0.0, 0.0, 0
            for seed in range(a.seeds):
                rng = np.random.default_rng(seed)
                args = problem(rng, B, T, P, hd, S, W, dtype)
                dr = rng.normal(size=(B, T, P * hd)).astype(dtype)
                dM = rng.normal(size=(B * S, P * hd)).astype(np.float32)
                cfg = sdm.SDMConfig(S, P, chunk_size=a.chunk, snapshot_quant=mode)
                _, g_x, _ = run(xp, args, sdm.SDMConfig(S, P, chunk_size=a.chunk), dr, dM)
                nbytes, g_q, rewound = run(xp, args, cfg, dr, dM)
                worst_g = max([worst_g] + [rel(g_q[k], g_x[k]) for k in g_q])
                written = np.zeros(args[0].shape, bool)
                for b in range(B):
                    for p in range(P):
                        written[b * S + np.unique(args[1][b, :, p]), p * hd:(p + 1) * hd] = True
                worst_b = max(worst_b, rel(rewound[written].astype(np.float64),
                                           args[0][written].astype(np.float64)))
            exact_bytes = exact_bytes or nbytes
            print(f"{dtype.name:>9} {str(mode):>9} {nbytes / 2**20:10.2f} "
                  f"{nbytes / exact_bytes:9.3f} {worst_g:9.1e} {worst_b:11.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
