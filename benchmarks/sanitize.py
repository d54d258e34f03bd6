"""Every GPU kernel path under NVIDIA's compute-sanitizer: out-of-bounds and misaligned accesses
(memcheck), shared-memory races (racecheck), barrier misuse (synccheck) and reads of memory
never written (initcheck). One device call:

    python3 benchmarks/sanitize.py [--tools memcheck,racecheck,synccheck,initcheck]
                                   [--cases NAME,...] [--timeout 480] [--no-warm]

First every kernel module is compiled in parallel (``gpu_check.warm``: about a minute on a
fresh 16-core machine, seconds once CuPy's cache holds them; inside ``--timeout``), then every
case runs without the tool (its results checked against the float64 reference); then, per
tool, one process runs every case under ``compute-sanitizer`` with CuPy's memory pool off, so
that each array is an allocation of its own and an access past its end is one the tool sees
(memcheck also pads allocations). Logs go to $OUT (``sanitize_<tool>.log``); a table of errors
per tool and case comes last.

The cases are small (microseconds each without the tool) and cover the launcher's paths: the
forward's staged, kept and re-read rows, a last 16-byte piece only partly inside the row
(hd = 34 in float32), forced narrow tiles, one-token chunks with and without the pre-pass, the
backward with its exact snapshots staged and unstaged, its 256-thread blocks and one range per
chunk, quantized snapshots, a 16-bit grad bank, int64 ids, ids outside [0, S) with
``check_indices=False``, a one-wave bf16 shape at hd = 128 (also with the backward's chunk
halved for its dM stage and the forward's sub-chunk snapshots), and the batch kernels. Reports
are attributed to the case whose marker precedes them (each case ends with a device
synchronisation); the tool's own error count is in the table beside them.
"""

from __future__ import annotations

import argparse
import os
import glob
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
TOOL_ARGS = {"memcheck": ["--padding", "256"], "racecheck": ["--racecheck-report", "all"],
             "synccheck": [], "initcheck": []}
# kernel reports only: CUDA API calls that fail by design (CuPy probing at start-up) are not
# what this run is for
COMMON_ARGS = ["--print-limit", "1000", "--report-api-errors", "no"]

# name: (make_problem arguments, SDMConfig arguments, gpu knobs, kind)
BF16 = "bfloat16"
SMALL = dict(B=2, T=70, P=2, hd=32, S=40, W=5)
CASES = {
    "f32": (dict(SMALL, dtype=np.float32), {}, {}, "fb"),
    "f64": (dict(SMALL), {}, {}, "fb"),
    "bf16-staged": (dict(SMALL, dtype=BF16), {}, {"STAGE_READS": True}, "fb"),
    "bf16-kept": (dict(SMALL, dtype=BF16), {}, {"STAGE_READS": False}, "fb"),
    "f32-reread": (dict(SMALL, dtype=np.float32), {},
                   {"STAGE_READS": False, "KEEP_ROWS": False}, "fb"),
    "f32-hd34": (dict(SMALL, hd=34, dtype=np.float32), {}, {}, "fb"),   # a 2-of-4 last piece
    "bf16-hd36-tile16": (dict(SMALL, hd=36, dtype=BF16), {}, {"TILE_WIDTH": 16,
                                                              "BWD_TILE_WIDTH": 16}, "fb"),
    "f16-W40-repeats": (dict(SMALL, W=40, hd=16, dtype="float16", repeat=True), {}, {}, "fb"),
    "decode-C1-W40": (dict(B=2, T=6, P=2, hd=24, S=20, W=40), {"chunk_size": 1}, {}, "fb"),
    "decode-C1-W80": (dict(B=2, T=6, P=2, hd=24, S=20, W=80), {"chunk_size": 1}, {}, "fb"),
    "quant-bf16": (dict(SMALL, dtype=np.float32), {"snapshot_quant": "bf16"}, {}, "fb-quant"),
    "quant-fp8": (dict(SMALL, dtype=BF16), {"snapshot_quant": "fp8_e4m3"}, {}, "fb-quant"),
    "quant-int8": (dict(SMALL, hd=20, dtype=BF16), {"snapshot_quant": "int8"}, {}, "fb-quant"),
    "bwd-256-threads": (dict(SMALL, dtype=np.float32), {}, {"BWD_THREADS": 256}, "fb"),
    "bwd-unstaged": (dict(SMALL, dtype=np.float32), {}, {"BWD_THREADS": 256, "KEEP_SMEM": 1},
                     "fb"),   # exact snapshots read from global memory, not staged
    "bwd-many-ranges": (dict(SMALL, dtype=np.float32), {"chunk_size": 8},
                        {"BWD_SCRATCH": 1}, "fb"),
    "grad-bank-bf16": (dict(SMALL, dtype=BF16), {"grad_bank_fp32": False}, {}, "fb"),
    "int64-ids": (dict(SMALL, dtype=np.float32, index_dtype=np.int64), {}, {}, "fb"),
    "bad-ids": (dict(SMALL, dtype=np.float32), {}, {}, "bad-ids"),
    "one-wave-bf16": (dict(B=1, T=130, P=4, hd=128, S=512, W=16, dtype=BF16), {}, {}, "fb"),
    # the backward's chunk halved for its dM stage (32 tokens), the saving forward keeping its
    # 64 and writing snapshots at each 32-token sub-chunk (stop 28's paths; sdm.tune's choice at
    # the headline on an H200)
    "one-wave-bf16-halved": (dict(B=1, T=130, P=4, hd=128, S=512, W=16, dtype=BF16), {},
                             {"BWD_DM_HALVE": True}, "fb"),
    "batch-kernels": (dict(SMALL, dtype=np.float32), {}, {}, "batch"),
}
TOL = {"float64": 1e-9, "float32": 1e-4}   # 16-bit banks: 2e-2


def _problem(kw):
    import ml_dtypes
    from helpers import make_problem
    kw = dict(kw)
    if kw.get("dtype") == BF16:
        kw["dtype"] = ml_dtypes.bfloat16
    return make_problem(np.random.default_rng(len(str(kw))), **kw)


def run_case(name: str, check: bool) -> None:
    """One case on the GPU; with ``check``, its outputs against the float64 reference."""
    import cupy as cp

    import sdm_cupy as sdm
    from helpers import assert_close, reference_bwd, reference_fwd, to_numpy
    from sdm_cupy.kernels import gpu
    pkw, ckw, knobs, kind = CASES[name]
    old = {k: getattr(gpu, k) for k in knobs}
    try:
        for k, v in knobs.items():
            setattr(gpu, k, v)
        pb = _problem(pkw)
        cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P,
                            **{"chunk_size": 64, **ckw})
        x = pb.to(cp)
        if kind == "batch":
            param = x.bank[:pb.S]
            full = sdm.expand_memory_batch(param, 3)
            back = sdm.sum_memory_batch(full, pb.S)
            if check:
                assert_close(to_numpy(back), 3 * to_numpy(param).astype(np.float64), 1e-6,
                             "sum of expanded")
            return
        rng = np.random.default_rng(7)
        dr = rng.normal(size=pb.values.shape).astype(pb.values.dtype)
        if kind == "bad-ids":
            wi, ri = pb.write_idx.copy(), pb.read_idx.copy()
            wi[0, 3, 1, 2], wi[1, 7, 0, 0], wi[1, pb.T - 2, 1, pb.W - 1] = pb.S, -5, 2 ** 31 - 1
            ri[1, 30, 1, 3], ri[0, pb.T - 1, 0, pb.W - 1], ri[1, 0, 0, 0] = 10 ** 6, pb.S, -1
            res = sdm.forward(x.bank, cp.asarray(wi), x.write_w, x.values, x.beta,
                              cp.asarray(ri), x.read_w, cfg, check_indices=False)
            sdm.backward(res.saved, cp.asarray(dr))
            try:
                sdm.check_device_errors()
            except ValueError:
                pass
            else:
                raise AssertionError("bad ids were not flagged")
            return
        res = sdm.forward(x.bank, *x.inputs, cfg)
        r, fin = to_numpy(res.readings).copy(), to_numpy(res.bank).copy()
        g = sdm.backward(res.saved, cp.asarray(dr))
        cp.cuda.runtime.deviceSynchronize()
        if not check:
            return
        tol = TOL.get(np.dtype(pb.bank.dtype).name, 2e-2)
        r_ref, fin_ref = reference_fwd(pb)
        assert_close(r, r_ref, tol, f"{name}: readings")
        assert_close(fin, fin_ref, tol, f"{name}: final bank")
        if kind == "fb-quant":   # quantized snapshots: gradients only approximately
            for n in ("bank", "write_w", "values", "beta", "read_w"):
                assert np.isfinite(to_numpy(getattr(g, n)).astype(np.float64)).all(), n
            return
        want = reference_bwd(pb, dr.astype(np.float64))
        for n, w in zip(("bank", "write_w", "values", "beta", "read_w"), want):
            assert_close(to_numpy(getattr(g, n)), w, tol, f"{name}: grad {n}")
        assert np.array_equal(to_numpy(res.bank).view(np.uint8), pb.bank.view(np.uint8)), \
            f"{name}: rewound bank"
    finally:
        for k, v in old.items():
            setattr(gpu, k, v)


def child(names, check: bool, no_pool: bool) -> int:
    import cupy as cp
    if no_pool:
        cp.cuda.set_allocator(None)
    failed = 0
    for name in names:
        print(f"@@CASE {name}", flush=True)
        t = time.time()
        try:
            run_case(name, check)
            cp.cuda.runtime.deviceSynchronize()   # its reports before the next marker
            print(f"@@DONE {name} {time.time() - t:.2f}s", flush=True)
        except Exception as e:   # noqa: BLE001 - reported per case, the run goes on
            failed += 1
            print(f"@@FAIL {name}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


_ERR = re.compile(r"=+ (?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed "
                  r"\((\d+) errors?, (\d+) warnings?\))")


def per_case(text: str) -> dict:
    """Sanitizer reports per case: the lines that start with '=========' between one case's
    marker and the next (or the summary)."""
    out, cur = {}, None
    for line in text.splitlines():
        if line.startswith("@@CASE "):
            cur = line.split()[1]
            out.setdefault(cur, {"reports": 0, "status": "?"})
        elif line.startswith("@@DONE ") and cur:
            out[cur]["status"] = "ok"
        elif line.startswith("@@FAIL ") and cur:
            out[cur]["status"] = "failed"
        elif cur and re.match(r"=+ (Invalid|Race|Barrier|Uninitialized|Misaligned|Error|"
                              r"Warning|Program hit|Out-of-range|Malformed|Cuda API)", line):
            out[cur]["reports"] += 1
    return out


def _sanitizer() -> str:
    """compute-sanitizer on the PATH, else in a CUDA toolkit's usual places."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for pattern in ("/usr/local/cuda*/bin/compute-sanitizer",
                    "/usr/local/cuda*/compute-sanitizer/compute-sanitizer",
                    "/opt/nvidia/*/compute-sanitizer"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return "compute-sanitizer"


def _run(cmd, timeout):
    """(output with stderr in order, return code or 'timeout'); the whole process group is
    killed on timeout (compute-sanitizer and the Python process under it)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=ROOT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=max(1, timeout))
        return out, p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return out, "timeout"


def _summary(text: str):
    """The tool's own count of errors (None if it printed no summary)."""
    counts = [int(m.group(1) or m.group(2)) for m in _ERR.finditer(text)]
    return counts[-1] if counts else None


def _table(names, rows) -> str:
    lines = ["| tool | rc | s | tool's error count | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for tool, cases, secs, rc, total in rows:
        cells = []
        for n in names:
            c = cases.get(n)
            cells.append("-" if c is None else
                         f"{c['status']}" + (f", {c['reports']} reports" if c["reports"] else ""))
        shown = sum(c["reports"] for c in cases.values())
        flag = "" if total is None or total <= shown else f" (more than the {shown} shown)"
        lines.append(f"| {tool} | {rc} | {secs:.0f} | {'-' if total is None else total}{flag} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout", type=int, default=480, help="seconds for all tools together")
    ap.add_argument("--sanitizer-args", default="", metavar="ARGS",
                    help="more compute-sanitizer options, e.g. '--kernel-name-exclude "
                         "kns=sdm_prepass' to list the other kernels' reports past the "
                         "pre-pass's first thousand")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-pool", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-warm", action="store_true",
                    help="skip compiling every kernel module in parallel first (on a fresh "
                         "machine the reference pass would otherwise compile them one by one, "
                         "inside its share of the time)")
    args = ap.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if args.child:
        return child(names, not args.no_check, args.no_pool)
    out = os.environ.get("OUT", "/tmp")
    me = [sys.executable, os.path.abspath(__file__), "--child", "--cases", ",".join(names)]
    t0 = time.time()
    if not args.no_warm:   # inside --timeout, like everything else
        try:
            import gpu_check   # beside this script (sys.path[0])
            gpu_check.warm(["prepass", "batch", "fwd", "bwd"])
        except Exception as exc:  # noqa: BLE001 (the reference pass compiles what it needs)
            print(f"warm-up failed ({type(exc).__name__}: {exc}); going on", flush=True)
    text, rc = _run(me, min(150, max(30, (args.timeout - (time.time() - t0)) // 3)))
    with open(os.path.join(out, "sanitize_plain.log"), "w") as f:
        f.write(text)
    rows = [("no tool (reference check)", per_case(text), time.time() - t0, rc, None)]
    print(f"no tool: rc {rc} in {time.time() - t0:.0f}s", flush=True)
    tools = [t for t in args.tools.split(",") if t]
    for i, tool in enumerate(tools):
        left = args.timeout - (time.time() - t0)
        budget = min(left, max(60.0, left / (len(tools) - i)))   # later tools keep their share
        if budget < 20:
            print(f"{tool}: skipped (time)", flush=True)
            continue
        t = time.time()
        cmd = [_sanitizer(), "--tool", tool, *COMMON_ARGS, *TOOL_ARGS.get(tool, []),
               *shlex.split(args.sanitizer_args), *me,
               "--no-check", "--no-pool"]
        try:
            text, rc = _run(cmd, budget)
        except FileNotFoundError:
            text, rc = "compute-sanitizer not found", "missing"
        if "Device not supported" in text:
            rc = "device not supported"
        with open(os.path.join(out, f"sanitize_{tool}.log"), "w") as f:
            f.write(text)
        total = _summary(text)
        print(f"{tool}: rc {rc} in {time.time() - t:.0f}s; tool's error count {total}",
              flush=True)
        rows.append((tool, per_case(text), time.time() - t, rc, total))
        print(_table(names, rows), flush=True)   # so far (an outer timeout keeps this much)
    print("\n" + _table(names, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
