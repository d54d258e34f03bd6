"""How long the CPU backend's kernels take to compile from a cold Numba cache.

Numba compiles each kernel once per argument types (bank dtype, compute dtype, id dtype,
layout) and caches it on disk. The test suite starts from an empty cache (a fresh clone in
CI), so these compiles are a large part of its time. Each case runs in a fresh process with an
empty ``NUMBA_CACHE_DIR``: one tiny ``sdm.forward(..., needs_backward=True)`` and one
``sdm.backward``, each timed (nearly all of it compiling), for four (bank, id) dtype pairs in
turn (the later ones reuse the helpers the earlier ones compiled, as the suite does).

    python benchmarks/cpu_compile_time.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

CASES = [("float32", "int32"), ("float64", "int32"), ("float32", "int64"),
         ("bfloat16", "int32")]

CHILD = r"""
import sys, time
import ml_dtypes, numpy as np
import sdm_cupy as sdm
rng = np.random.default_rng(0)
for bank_name, id_name in [tuple(c.split(":")) for c in sys.argv[1:]]:
    bdt = ml_dtypes.bfloat16 if bank_name == "bfloat16" else np.dtype(bank_name)
    f = np.float64 if bank_name == "float64" else np.float32
    B, T, P, hd, S, W = 1, 8, 1, 4, 16, 2
    bank = (rng.standard_normal((B * S, P * hd)) * 0.1).astype(bdt)
    wi = rng.integers(0, S, (B, T, P, W)).astype(id_name)
    ri = rng.integers(0, S, (B, T, P, W)).astype(id_name)
    a, c = rng.random((B, T, P, W)).astype(f), rng.random((B, T, P, W)).astype(f)
    v = rng.standard_normal((B, T, P * hd)).astype(bdt)
    beta = rng.random((B, T, P)).astype(f)
    t0 = time.perf_counter()
    out = sdm.forward(bank, wi, a, v, beta, ri, c, sdm.SDMConfig(S, P, 4))
    t1 = time.perf_counter()
    sdm.backward(out.saved, np.ones_like(out.readings))
    t2 = time.perf_counter()
    print(f"{bank_name:9s} {id_name:6s} forward {t1 - t0:6.1f} s   backward {t2 - t1:6.1f} s",
          flush=True)
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", CHILD, *(f"{b}:{i}" for b, i in CASES)],
                       env=env, check=True)
        print(f"total {time.perf_counter() - t0:.1f} s (a fresh process, empty cache)")


if __name__ == "__main__":
    main()
