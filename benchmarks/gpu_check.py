"""One device call: warm CuPy's kernel cache in parallel, run the GPU tests, then benchmark.

    python3 benchmarks/gpu_check.py [--tests PATHS] [--pytest-args ARGS] [--no-bench] [--quick]

``--tests``: test files or node ids (default ``tests``); the environment variable ``PYTEST_K``
becomes pytest's ``-k``. pytest stops after ``PYTEST_TIMEOUT`` seconds (default 300), or at
``PYTEST_DEADLINE`` (seconds since the epoch) when that comes first; a run stopped before its
summary still reports what its progress lines show. Prints a short table last (the
benchmark's). Logs go to $OUT (else /tmp).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
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


def tally(text: str) -> str:
    """What pytest's progress lines (``-q``) report, for a run stopped before its summary:
    one character per test, ``.`` passed, ``s`` skipped, ``F`` failed, ``E`` error, ``x``/``X``
    expected failures and passes."""
    names = {".": "passed", "s": "skipped", "F": "failed", "E": "errors", "x": "xfailed",
             "X": "xpassed"}
    counts = dict.fromkeys(names, 0)
    for line in text.splitlines():
        m = re.fullmatch(r"([.sFExX]+)\s*(\[\s*\d+%\])?", line.strip())
        if m:
            for ch in m.group(1):
                counts[ch] += 1
    return ", ".join(f"{n} {names[c]}" for c, n in counts.items() if n) or "nothing"


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
    limit = int(os.environ.get("PYTEST_TIMEOUT", "300"))
    if os.environ.get("PYTEST_DEADLINE"):   # the warm-up above came out of the same budget
        limit = min(limit, int(float(os.environ["PYTEST_DEADLINE"]) - t))
    with open(os.path.join(out, "pytest_gpu.log"), "w") as log:
        try:
            rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = open(os.path.join(out, "pytest_gpu.log")).read()
    fails = [l for l in text.splitlines() if l.startswith(("FAILED", "ERROR"))]
    print("\n".join(fails[:40]))
    print(text[-1500:] if rc else text.splitlines()[-1])
    if rc == "timeout":
        print(f"stopped after {limit} s, before pytest's summary; its progress lines report: "
              f"{tally(text)}")
    print(f"pytest rc={rc} in {time.time() - t:.0f}s: {' '.join(cmd[2:])}", flush=True)
    if not args.no_bench:
        bcmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--out", out]
        if args.quick:
            bcmd.append("--quick")
        subprocess.call(bcmd, cwd=ROOT)


if __name__ == "__main__":
    main()
