"""CPU benchmark: the Numba backend against a plain NumPy implementation of SPEC §2.

Both run in this process on the same inputs: forward (``needs_backward=False``) and
forward+backward. The NumPy recurrence is vectorised over batch and heads (fancy indexing,
``np.add.at``) and loops over tokens in Python; its backward is reverse mode through the same
recurrence (it keeps each token's pre-write rows, like the snapshots).

Also reported: the byte floor of SPEC §10 (bytes the op must move / the bandwidth of a large
measured memcpy) and time / floor.

    python benchmarks/bench_cpu.py [--repeats 7] [--write-results]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

import numba
import numpy as np

import sdm_cupy as sdm
from sdm_cupy.kernels import cpu

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------ the NumPy recurrence (§2)

def numpy_forward(bank, wi, a, v, beta, ri, c, S, P, keep_history=False):
    """Readings [B, T, D]; ``bank`` [B*S, D] is updated in place. With ``keep_history``, also
    returns each token's pre-write rows [T, B, P, W, hd] (what the backward needs)."""
    B, T, _, W = wi.shape
    D = bank.shape[1]
    hd = D // P
    M = bank.reshape(B, S, P, hd)
    bI = np.arange(B)[:, None, None]
    pI = np.arange(P)[None, :, None]
    v4 = v.reshape(B, T, P, hd)
    r = np.empty((B, T, P, hd), bank.dtype)
    hist = np.empty((T, B, P, W, hd), bank.dtype) if keep_history else None
    for t in range(T):
        i, j = wi[:, t], ri[:, t]                                  # [B, P, W]
        rows = M[bI, i, pI]                                        # [B, P, W, hd]
        if keep_history:
            hist[t] = rows
        e = v4[:, t] - np.einsum("bpw,bpwh->bph", a[:, t], rows)
        upd = (beta[:, t, :, None, None] * a[:, t, :, :, None]) * e[:, :, None, :]
        np.add.at(M, (bI, i, pI), upd)
        r[:, t] = np.einsum("bpw,bpwh->bph", c[:, t], M[bI, j, pI])
    return r.reshape(B, T, D), hist


def numpy_backward(bank, hist, wi, a, v, beta, ri, c, S, P, dr):
    """Gradients (bank, a, v, beta, c); rewinds ``bank`` in place from ``hist``."""
    B, T, _, W = wi.shape
    D = bank.shape[1]
    hd = D // P
    M = bank.reshape(B, S, P, hd)
    g = np.zeros_like(M)
    bI = np.arange(B)[:, None, None]
    pI = np.arange(P)[None, :, None]
    v4, dr4 = v.reshape(B, T, P, hd), dr.reshape(B, T, P, hd)
    da, dc = np.empty_like(a), np.empty_like(c)
    dv, dbeta = np.empty((B, T, P, hd), bank.dtype), np.empty_like(beta)
    for t in reversed(range(T)):
        i, j = wi[:, t], ri[:, t]
        at, ct, bt = a[:, t], c[:, t], beta[:, t]
        dc[:, t] = np.einsum("bpwh,bph->bpw", M[bI, j, pI], dr4[:, t])
        np.add.at(g, (bI, j, pI), ct[..., None] * dr4[:, t, :, None, :])
        M[bI, i, pI] = hist[t]                                     # rewind this token
        rows = hist[t]
        e = v4[:, t] - np.einsum("bpw,bpwh->bph", at, rows)
        gi = g[bI, i, pI]
        kg = np.einsum("bpw,bpwh->bph", at, gi)
        dbeta[:, t] = np.einsum("bph,bph->bp", kg, e)
        de = bt[..., None] * kg
        dv[:, t] = de
        da[:, t] = (bt[..., None] * np.einsum("bpwh,bph->bpw", gi, e)
                    - np.einsum("bpwh,bph->bpw", rows, de))
        np.add.at(g, (bI, i, pI), -at[..., None] * de[:, :, None, :])
    return g.reshape(B * S, D), da, dv.reshape(B, T, D), dbeta, dc


# -------------------------------------------------------------------------------- helpers

def median_time(fn, repeats, setup=None):
    times = []
    for _ in range(repeats):
        state = setup() if setup else None
        t0 = time.perf_counter()
        fn(state)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), times


def memcpy_bandwidth(nbytes=512 << 20, repeats=5):
    """Read+write bytes per second of a large NumPy copy (the CPU's copy bandwidth)."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t, _ = median_time(lambda _: np.copyto(dst, src), repeats)
    return 2 * src.nbytes / t


def byte_floor(B, T, P, hd, S, W, wi, ri, itemsize=4, idx_size=4, backward=False):
    """Bytes the op cannot avoid moving (SPEC §10), float32 arrays, idx_size-byte ids."""
    D = P * hd
    n = B * T * P * W
    inputs = 2 * n * idx_size + 2 * n * itemsize + B * T * D * itemsize + B * T * P * itemsize
    rows = n * hd * itemsize
    fwd = inputs + B * T * D * itemsize + 2 * rows + rows            # + readings, gathers, writes
    if not backward:
        return fwd
    fwd += rows                                                       # snapshots written
    bI = np.arange(B)[:, None, None, None]
    pI = np.arange(P)[None, None, :, None]
    touched = set()
    for idx in (wi, ri):
        touched.update(np.unique(((bI * P + pI) * S + idx).ravel()).tolist())
    bwd = (inputs + B * T * D * itemsize                              # inputs, dr
           + rows + rows + rows                                  # snapshots, rewind, read rows
           + 2 * len(touched) * hd * itemsize                         # grad-bank rows r+w
           + B * S * D * itemsize                                     # grad bank zeroed
           + 2 * n * itemsize + B * T * D * itemsize + B * T * P * itemsize)  # gradients
    return fwd + bwd


def git_commit():
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                       text=True).strip()
    except Exception:  # noqa: BLE001 - not a checkout
        return "unknown"


# ----------------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--hd", type=int, default=64)
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--W", type=int, default=8)
    ap.add_argument("--C", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--numpy-repeats", type=int, default=3)
    ap.add_argument("--write-results", action="store_true",
                    help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    B, T, P, hd, S, W, C = args.B, args.T, args.P, args.hd, args.S, args.W, args.C
    D = P * hd
    rng = np.random.default_rng(0)
    f32 = np.float32
    bank0 = (0.1 * rng.normal(size=(B * S, D))).astype(f32)
    wi = rng.integers(0, S, (B, T, P, W)).astype(np.int32)
    ri = rng.integers(0, S, (B, T, P, W)).astype(np.int32)
    a = (rng.uniform(-1, 1, (B, T, P, W)) / np.sqrt(W)).astype(f32)
    c = rng.normal(size=(B, T, P, W)).astype(f32)
    v = rng.normal(size=(B, T, D)).astype(f32)
    beta = rng.uniform(0.1, 0.9, (B, T, P)).astype(f32)
    dr = rng.normal(size=(B, T, D)).astype(f32)
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=C)

    load_start = os.getloadavg()[0]
    # warm-up (compiles or loads the Numba cache) and a correctness cross-check
    res = sdm.forward(bank0, wi, a, v, beta, ri, c, cfg, needs_backward=True)
    nb = bank0.copy()
    r_np, hist = numpy_forward(nb, wi, a, v, beta, ri, c, S, P, keep_history=True)
    fwd_err = float(np.abs(res.readings - r_np).max() / np.abs(r_np).max())
    g = sdm.backward(res.saved, dr)
    g_np = numpy_backward(nb, hist, wi, a, v, beta, ri, c, S, P, dr)
    bwd_err = max(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30))
                  for x, y in zip((g.bank, g.write_w, g.values, g.beta, g.read_w), g_np))

    copy = lambda: bank0.copy()  # noqa: E731 - fresh bank per repeat, outside the timing
    t_nb_f, ts_nb_f = median_time(lambda m: sdm.forward(m, wi, a, v, beta, ri, c, cfg,
                                                  needs_backward=False, inplace=True),
                            args.repeats, copy)

    def nb_fb(m):
        rs = sdm.forward(m, wi, a, v, beta, ri, c, cfg, needs_backward=True, inplace=True)
        sdm.backward(rs.saved, dr)
    t_nb_fb, ts_nb_fb = median_time(nb_fb, args.repeats, copy)
    cpu.FORWARD = "chunked"   # SPEC §3's chunked kernel for this float32 bank too
    t_ch_f, ts_ch_f = median_time(lambda m: sdm.forward(m, wi, a, v, beta, ri, c, cfg,
                                                  needs_backward=False, inplace=True),
                            args.repeats, copy)
    cpu.FORWARD = "auto"
    nthreads = numba.get_num_threads()
    numba.set_num_threads(1)                 # the same kernels on one core, like NumPy's
    t_nb1_f, ts_nb1_f = median_time(lambda m: sdm.forward(m, wi, a, v, beta, ri, c, cfg,
                                                   needs_backward=False, inplace=True),
                             args.repeats, copy)
    t_nb1_fb, ts_nb1_fb = median_time(nb_fb, args.repeats, copy)
    numba.set_num_threads(nthreads)
    t_np_f, ts_np_f = median_time(lambda m: numpy_forward(m, wi, a, v, beta, ri, c, S, P),
                            args.numpy_repeats, copy)

    def np_fb(m):
        _, h = numpy_forward(m, wi, a, v, beta, ri, c, S, P, keep_history=True)
        numpy_backward(m, h, wi, a, v, beta, ri, c, S, P, dr)
    t_np_fb, ts_np_fb = median_time(np_fb, args.numpy_repeats, copy)

    bw = memcpy_bandwidth()
    floor_f = byte_floor(B, T, P, hd, S, W, wi, ri) / bw
    floor_fb = byte_floor(B, T, P, hd, S, W, wi, ri, backward=True) / bw
    tok = B * T
    load_end = os.getloadavg()[0]
    nb = f"numba ({nthreads} threads)"
    rows = [
        ("forward", nb, t_nb_f, ts_nb_f, floor_f),
        ("forward", f"numba chunked §3 ({nthreads} threads)", t_ch_f, ts_ch_f, floor_f),
        ("forward", "numba (1 thread)", t_nb1_f, ts_nb1_f, floor_f),
        ("forward", "numpy", t_np_f, ts_np_f, floor_f),
        ("forward+backward", nb, t_nb_fb, ts_nb_fb, floor_fb),
        ("forward+backward", "numba (1 thread)", t_nb1_fb, ts_nb1_fb, floor_fb),
        ("forward+backward", "numpy", t_np_fb, ts_np_fb, floor_fb),
    ]
    lines = [
        f"B={B} T={T} P={P} hd={hd} S={S} W={W} C={C}, float32, {os.cpu_count()} CPUs, "
        f"memcpy {bw / 1e9:.1f} GB/s (read+write), 1-min load average {load_start:.1f} at "
        f"start / {load_end:.1f} at end (other processes share these CPUs when > ~0)",
        "",
        "| pass | impl | median ms | min ms | tokens/s (median) | byte floor ms | median/floor "
        "| speed-up vs numpy (median) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ref = {"forward": t_np_f, "forward+backward": t_np_fb}
    for name, impl, t, ts, fl in rows:
        lines.append(f"| {name} | {impl} | {t * 1e3:.2f} | {min(ts) * 1e3:.2f} | {tok / t:,.0f} | "
                     f"{fl * 1e3:.3f} | {t / fl:.1f} | {ref[name] / t:.1f}x |")
    lines += ["", f"numba vs numpy max relative difference: forward {fwd_err:.1e}, "
                  f"gradients {bwd_err:.1e}"]
    table = "\n".join(lines)
    print(table)
    if args.write_results:
        path = os.path.join(HERE, "RESULTS.md")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write("# Benchmark results\n\nSections are appended by the benchmark scripts "
                        "(`--write-results`); newest last.\n")
        cmd = "python benchmarks/bench_cpu.py " + " ".join(sys.argv[1:])
        with open(path, "a") as f:
            day = datetime.date.today().isoformat()
            f.write(f"\n## CPU (Numba) vs NumPy recurrence, {day}\n\n"
                    f"- git commit: {git_commit()}\n- machine: CI-like 2-core CPU\n"
                    f"- command: `{cmd}`\n\n{table}\n")


if __name__ == "__main__":
    main()
