"""One device call: warm CuPy's kernel cache in parallel, run the GPU tests, then benchmark.

    python3 benchmarks/gpu_check.py [--tests PATHS] [--pytest-args ARGS] [--no-bench] [--quick]

``--tests``: test files or node ids (default ``tests``); the environment variable ``PYTEST_K``
becomes pytest's ``-k``. Prints a short table last (the benchmark's). Logs go to $OUT (else
/tmp).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build(job):
    src, key = job
    import cupy
    from sdm_cupy.kernels import _build as K
    t = time.time()
    cupy.RawModule(code=K.source(src), options=K.options(),
                   name_expressions=K._names(src, key)).get_function(K._names(src, key)[0])
    return src, str(key), time.time() - t


def warm(sources):
    from sdm_cupy.kernels import _build as K
    jobs = [(s, k) for s in sources for k in K.module_keys(s)]
    t = time.time()
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(16, len(jobs))) as ex:
        done = list(ex.map(_build, jobs))
    slow = max(done, key=lambda d: d[2])
    print(f"warmed {len(done)} modules in {time.time() - t:.1f}s (slowest {slow})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests", default="tests")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pytest-args", default="")
    args = ap.parse_args()
    out = os.environ.get("OUT", "/tmp")
    warm(["prepass", "batch", "fwd", "bwd"])
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "--tb=short", *args.tests.split(), *args.pytest_args.split()]
    if os.environ.get("PYTEST_K"):
        cmd += ["-k", os.environ["PYTEST_K"]]
    t = time.time()
    with open(os.path.join(out, "pytest_gpu.log"), "w") as log:
        try:
            rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 timeout=int(os.environ.get("PYTEST_TIMEOUT", "300")))
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = open(os.path.join(out, "pytest_gpu.log")).read()
    fails = [l for l in text.splitlines() if l.startswith(("FAILED", "ERROR"))]
    print("\n".join(fails[:40]))
    print(text[-1500:] if rc else text.splitlines()[-1])
    print(f"pytest rc={rc} in {time.time() - t:.0f}s: {' '.join(cmd[2:])}", flush=True)
    if not args.no_bench:
        bcmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--out", out]
        if args.quick:
            bcmd.append("--quick")
        subprocess.call(bcmd, cwd=ROOT)


if __name__ == "__main__":
    main()
