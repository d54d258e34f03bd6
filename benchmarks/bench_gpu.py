"""GPU benchmark of the SDM op (SPEC §10): tokens/s, byte floor, time/floor, peak memory, and
FLA's chunk_delta_rule at the same B, T, heads and hd, in one run.

    python3 benchmarks/bench_gpu.py [--quick] [--out DIR] [--replot bench_gpu.json]

The byte floor is the bytes the op cannot avoid moving (SPEC §10; distinct slots counted per
chunk, as the kernels gather and write each distinct row once) over the bandwidth of a large
device-to-device copy measured in the same run (bytes read + bytes written per second).
Times are medians of CUDA-event timings after warm-up, two ways: "eager" (one call with the
device idle before it, host time included) and "graph" (one replay of the call captured in a
CUDA graph: device time alone). Floors, ratios and the comparison with FLA use the graph time;
FLA launches many small kernels from Python, so its eager time is mostly host time. The columns
"at floor vs FLA" give the tokens/s, relative to FLA's, of a call that took exactly its byte
floor: the best any kernel that moves those bytes through device memory could reach. Peak
memory is the memory pool's high-water mark over one forward+backward (pool emptied first).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import cupy as cp
import ml_dtypes

import sdm_cupy as sdm
from sdm_cupy.kernels import gpu

BF16 = np.dtype(ml_dtypes.bfloat16)


def timeit(fn, reps=10, warmup=2):
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return float(np.median(ts))


def capture_graph(fn):
    """fn captured into a CUDA graph on a non-blocking stream of its own, allocating from a
    pool of its own that nothing else uses afterwards (so the graph's buffers stay its own
    while it lives); replayed once. Returns (graph, stream, pool): keep all three alive."""
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    cp.cuda.Device().synchronize()
    with cp.cuda.using_allocator(pool.malloc), stream:
        fn()                                   # compiled and planned before the capture
        stream.synchronize()
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    return graph, stream, pool


def replay_time(graph, stream):
    """Device time of one replay (CUDA events on the graph's stream), seconds."""
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(stream)
    graph.launch(stream)
    b.record(stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1e-3


def graph_time(fn, reps=20):
    """Median device time of one replay of fn captured into a CUDA graph: no host launch cost."""
    graph, stream, pool = capture_graph(fn)
    ts = [replay_time(graph, stream) for _ in range(reps)]
    del graph
    pool.free_all_blocks()
    return float(np.median(ts))


def copy_bandwidth():
    n = 1 << 30
    src = cp.ones(n // 4, dtype=np.float32)
    dst = cp.empty_like(src)
    t = timeit(lambda: dst.__setitem__(Ellipsis, src), reps=20)
    return 2 * n / t


def distinct_per_chunk(idx, C):
    """Distinct slot ids per (b, p, chunk): idx [B, T, P, W] (host)."""
    B, T, P, W = idx.shape
    Nt = -(-T // C)
    pad = Nt * C - T
    x = np.moveaxis(idx, 2, 1)                       # [B, P, T, W]
    if pad:
        x = np.concatenate([x, np.repeat(x[:, :, -1:], pad, axis=2)], axis=2)
    x = np.sort(x.reshape(B, P, Nt, C * W), axis=-1)
    return int((np.diff(x, axis=-1) != 0).sum() + B * P * Nt)


def distinct_union(wi, ri, C):
    return distinct_per_chunk(np.concatenate([wi, ri], axis=-1), C)


def floors(B, T, P, hd, S, W, C, wi, ri, bank_sz=2, val_sz=2, w_sz=4, idx_sz=4, grad_sz=4):
    D = P * hd
    e = B * T * P * W
    inputs = 2 * e * idx_sz + 2 * e * w_sz + B * T * P * w_sz + B * T * D * val_sz
    uw, ur = distinct_per_chunk(wi, C), distinct_per_chunk(ri, C)
    uwr = distinct_union(wi, ri, C)
    row = hd * bank_sz
    fwd = inputs + B * T * D * val_sz + e * row + (uw + ur) * row + uw * row
    bwd = (inputs + B * T * D * val_sz + e * row + uw * row + ur * row
           + 2 * uwr * hd * grad_sz + B * S * D * grad_sz
           + B * T * D * val_sz + 2 * e * w_sz + B * T * P * w_sz)
    return fwd, fwd + bwd


def make_inputs(B, T, P, hd, S, W, seed=0):
    rs = cp.random.RandomState(seed)
    D = P * hd
    bank = rs.standard_normal((B * S, D), dtype=np.float32).astype(BF16)
    wi = rs.randint(0, S, size=(B, T, P, W), dtype=np.int32)
    ri = rs.randint(0, S, size=(B, T, P, W), dtype=np.int32)
    ww = (rs.uniform(-1, 1, size=(B, T, P, W), dtype=np.float32) / np.sqrt(W)).astype(np.float32)
    rw = rs.standard_normal((B, T, P, W), dtype=np.float32)
    v = rs.standard_normal((B, T, D), dtype=np.float32).astype(BF16)
    beta = rs.uniform(0.1, 0.9, size=(B, T, P), dtype=np.float32)
    dr = rs.standard_normal((B, T, D), dtype=np.float32).astype(BF16)
    return bank, wi, ww, v, beta, ri, rw, dr


def bench_sdm(B, T, P, hd, S, W, C, bw, reps=10, tile=None, threads=256, keep=None,
              bwd_threads=512, bwd_tile=None, graphs=True, stage=None, tuned=False):
    gpu.TILE_WIDTH, gpu.THREADS, gpu.KEEP_ROWS = tile, threads, keep
    gpu.STAGE_READS = stage   # None: the forward stages its read rows where the plan says
    gpu.BWD_THREADS, gpu.BWD_TILE_WIDTH = bwd_threads, bwd_tile
    bank, wi, ww, v, beta, ri, rw, dr = make_inputs(B, T, P, hd, S, W)
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=C)
    # `tuned`: the plan that sdm.tune picks for this layout (what a user who calls it gets)
    tn = sdm.tune(bank, wi, ww, v, beta, ri, rw, cfg) if tuned else None

    def fwd():
        return sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True, check_indices=False)

    t_fwd_ns = timeit(lambda: sdm.forward(bank, wi, ww, v, beta, ri, rw, cfg, inplace=True,
                                          needs_backward=False, check_indices=False), reps)
    # forward (with snapshots) and forward+backward from one loop: events around the forward
    # alone and around the pair; the backward rewinds the bank, so every rep sees the same bank
    tf, tfb = [], []
    for i in range(reps + 2):
        e0, e1, e2 = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        res = fwd()
        e1.record()
        sdm.backward(res.saved, dr)
        e2.record()
        e2.synchronize()
        if i >= 2:
            tf.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3)
            tfb.append(cp.cuda.get_elapsed_time(e0, e2) * 1e-3)
        del res
    t_fwd, t_fb = float(np.median(tf)), float(np.median(tfb))
    # the same two, replayed from CUDA graphs (device time, as FLA's graph rows)
    g_fwd = g_fb = float("nan")
    if graphs:
        def fb_pair():
            sdm.backward(fwd().saved, dr)
        try:
            g_fb = graph_time(fb_pair, reps)
            g_fwd = graph_time(lambda: fwd().bank, reps)   # the bank drifts: timing only
        except Exception as exc:  # noqa: BLE001
            print(f"graph replay of our op failed: {type(exc).__name__}: {exc}", flush=True)
        bank[...] = make_inputs(B, T, P, hd, S, W)[0]
    # peak: what the call allocates (a fresh pool's high-water mark: freed blocks stay cached
    # in it) on top of the arrays that exist before it (bank, inputs, dr)
    cp.cuda.Device().synchronize()
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        res = fwd()
        g = sdm.backward(res.saved, dr)
        cp.cuda.Device().synchronize()
    held = sum(a.nbytes for a in (bank, wi, ww, v, beta, ri, rw, dr))
    peak = held + pool.total_bytes()
    del res, g
    pool.free_all_blocks()
    # the pre-pass alone (bank-independent part of the forward)
    lay = sdm._validate.layout(bank, wi, ww, v, beta, ri, rw, cfg)
    pl = gpu.plan(lay, cfg)
    bwd_tw = gpu.plan(lay, cfg, backward=True).TW
    t_pre = timeit(lambda: gpu._prepass_sparse(lay, pl, np.dtype(np.float32), wi, ww, ri, rw,
                                               beta), reps)
    snaps = B * T * P * W * hd * 2
    grad_bank = B * S * P * hd * 4
    outputs = v.nbytes * 2 + ww.nbytes * 2 + beta.nbytes
    f_fwd, f_fb = floors(B, T, P, hd, S, W, C, wi.get(), ri.get())
    gpu.TILE_WIDTH, gpu.THREADS, gpu.KEEP_ROWS = None, 256, None
    gpu.BWD_THREADS, gpu.BWD_TILE_WIDTH = 512, None
    sdm.check_device_errors()
    if tuned:
        gpu.clear_tuning()
    return dict(B=B, T=T, P=P, hd=hd, S=S, W=W, C=C, tile=tile or "auto", threads=threads,
                halve=None if tn is None else tn.halve,
                tune_ms=None if tn is None else {str(k): v for k, v in tn.ms.items()},
                t_prepass_ms=t_pre * 1e3, tile_used=pl.TW, keep=pl.keep,
                bwd_tile_used=bwd_tw, bwd_threads=bwd_threads,
                t_fwd_nosnap_ms=t_fwd_ns * 1e3, t_fwd_ms=t_fwd * 1e3, t_fb_ms=t_fb * 1e3,
                g_fwd_ms=g_fwd * 1e3, g_fb_ms=g_fb * 1e3,
                fwd_tok_s=B * T / t_fwd, fb_tok_s=B * T / t_fb,
                floor_fwd_ms=f_fwd / bw * 1e3, floor_fb_ms=f_fb / bw * 1e3,
                fwd_over_floor=t_fwd / (f_fwd / bw), fb_over_floor=t_fb / (f_fb / bw),
                g_fwd_over_floor=g_fwd / (f_fwd / bw), g_fb_over_floor=g_fb / (f_fb / bw),
                g_fwd_tok_s=B * T / g_fwd, g_fb_tok_s=B * T / g_fb,
                peak_mb=peak / 2 ** 20,
                need_mb=(held + snaps + grad_bank + outputs) / 2 ** 20)


def bench_fla(B, T, H, K, reps=10):
    try:
        import torch
        from fla.ops.delta_rule import chunk_delta_rule
    except Exception as exc:  # noqa: BLE001
        return dict(error=f"{type(exc).__name__}: {exc}")
    dev = "cuda"
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev, dtype=torch.float32),
                                      dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    beta = torch.rand(B, T, H, device=dev, dtype=torch.bfloat16)
    do = torch.randn_like(v)

    def tt(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e-3)
        return float(np.median(ts))

    def fwd():
        with torch.no_grad():
            chunk_delta_rule(q, k, v, beta, output_final_state=True)

    qq, kk, vv, bb = (x.clone().requires_grad_(True) for x in (q, k, v, beta))

    def fb():
        o, _ = chunk_delta_rule(qq, kk, vv, bb, output_final_state=True)
        o.backward(do)

    t_f, t_fb = tt(fwd), tt(fb)
    out = dict(t_fwd_ms=t_f * 1e3, t_fb_ms=t_fb * 1e3, fwd_tok_s=B * T / t_f,
               fb_tok_s=B * T / t_fb)
    # device time: both calls replayed from CUDA graphs (FLA launches many small Triton kernels
    # from Python, so its eager time above partly measures the host: it moved 0.46-1.08 ms
    # between leases while its device work did not change)
    try:
        gt = {}
        for name, fn in (("fwd", fwd), ("fb", fb)):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            gt[name] = tt(graph.replay)
            del graph
        out.update(g_fwd_ms=gt["fwd"] * 1e3, g_fb_ms=gt["fb"] * 1e3)
    except Exception as exc:  # noqa: BLE001
        out["graph_error"] = f"{type(exc).__name__}: {exc}"
    # our cases run after it: give its cached blocks back to the device
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return out


def plot(out: dict, path: str) -> None:
    """Two panels from a run's results (``bench_gpu.json``): device time over the byte floor
    per case, with the targets; and tokens/s relative to FLA, measured and at the floor (the
    best any kernel that moves the floor's bytes could do), with the targets."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows, fla = out["rows"], out.get("fla", {})
        have_fla = "g_fwd_ms" in fla and "g_fb_ms" in fla
        fig, axes = plt.subplots(1, 2 if have_fla else 1, figsize=(14 if have_fla else 9, 4.5),
                                 squeeze=False)
        x = np.arange(len(rows))
        names = [r["case"] for r in rows]
        ax = axes[0][0]
        ax.bar(x - 0.2, [r["g_fwd_over_floor"] for r in rows], 0.4, label="forward / floor")
        ax.bar(x + 0.2, [r["g_fb_over_floor"] for r in rows], 0.4, label="fwd+bwd / floor")
        ax.axhline(1.3, color="C0", ls=":", lw=1, label="target, forward (1.3)")
        ax.axhline(1.5, color="C1", ls=":", lw=1, label="target, fwd+bwd (1.5)")
        ax.set_xticks(x, names, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("device time (graph replay) / byte floor")
        ax.set_title(f"sdm-cupy on {out['device']} (copy {out['copy_bw_TBs']:.2f} TB/s)")
        ax.legend(fontsize=7)
        if have_fla:
            ax = axes[0][1]
            bars = (("forward, measured", [fla["g_fwd_ms"] / r["g_fwd_ms"] for r in rows], "C0", None),
                    ("forward at its floor", [fla["g_fwd_ms"] / r["floor_fwd_ms"] for r in rows], "C0", "//"),
                    ("fwd+bwd, measured", [fla["g_fb_ms"] / r["g_fb_ms"] for r in rows], "C1", None),
                    ("fwd+bwd at its floor", [fla["g_fb_ms"] / r["floor_fb_ms"] for r in rows], "C1", "//"))
            for k, (label, vals, color, hatch) in enumerate(bars):
                ax.bar(x + (k - 1.5) * 0.2, vals, 0.2, label=label, color=color, hatch=hatch,
                       alpha=0.5 if hatch else 1.0, edgecolor=color)
            ax.axhline(1.0, color="C0", ls=":", lw=1, label="target, headline forward (1.0)")
            ax.axhline(1.3, color="C1", ls=":", lw=1, label="target, W=8 fwd+bwd (1.3)")
            ax.set_xticks(x, names, rotation=45, ha="right", fontsize=7)
            ax.set_ylabel("tokens/s / FLA chunk_delta_rule's (device time)")
            ax.set_title("against FLA: measured, and at the byte floor")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    except Exception as exc:  # noqa: BLE001
        print("plot failed:", exc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default=None, help="run only the case of this name (and not FLA)")
    ap.add_argument("--replot", metavar="JSON", default=None,
                    help="only draw bench_gpu.png into --out from an earlier run's bench_gpu.json")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.join(args.out, "bench_gpu.png"))
        return
    t0 = time.time()
    bw = copy_bandwidth()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    l2_mb = props["l2CacheSize"] / 2**20
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write); L2 {l2_mb:.0f} MiB",
          flush=True)
    rows = []
    head = dict(B=4, T=4096, P=8, hd=128, S=16384, W=16, C=64)
    fla = {}

    def dump():
        # after every case, so that a run cut short by a time limit keeps what it measured
        out = dict(device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                   copy_bw_TBs=bw / 1e12, l2_mib=l2_mb, rows=rows, fla=fla,
                   wall_s=time.time() - t0)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            json.dump(out, f, indent=1)
        return out

    def run(tag, **kw):
        if args.only is not None and tag != args.only:
            return
        cfg = {**head, **kw}
        r = bench_sdm(**cfg, bw=bw, reps=5 if args.quick else 10)
        r["case"] = tag
        rows.append(r)
        print(f"{tag:24s} fwd {r['t_fwd_ms']:7.3f} ms eager, {r['g_fwd_ms']:7.3f} graph "
              f"({r['g_fwd_over_floor']:.2f}x floor, pre-pass {r['t_prepass_ms']:.3f}, no "
              f"snapshots {r['t_fwd_nosnap_ms']:.3f})  fwd+bwd {r['t_fb_ms']:7.3f} eager, "
              f"{r['g_fb_ms']:7.3f} graph ({r['g_fb_over_floor']:.2f}x)  "
              f"peak {r['peak_mb']:.0f} MB (need {r['need_mb']:.0f})", flush=True)
        if r.get("halve") is not None:
            print(f"{'':24s} sdm.tune: halve={r['halve']} (eager fwd+bwd ms by choice: "
                  f"{r['tune_ms']})", flush=True)
        dump()

    run("headline")
    # the anchor right after the headline: a run cut short still has both (stop 30: an H200
    # run's time limit fell between the last case and FLA)
    if args.only is None:
        fla.update(bench_fla(4, 4096, 8, 128))
        print("FLA chunk_delta_rule B=4 T=4096 H=8 K=V=128 bf16:", fla, flush=True)
        dump()
    run("headline tuned", tuned=True)   # sdm.tune's plan (stop 28: halving wins on the H200)
    run("headline register gather", stage=0)   # the forward's read rows through registers
    run("headline rows re-read", keep=False)
    run("headline W=8", W=8)
    run("headline bwd 256 threads", bwd_threads=256)
    run("headline bwd tile=16", bwd_tile=16)
    if not args.quick:
        for tile in (8, 32, 64):
            run(f"headline tile={tile}", tile=tile)
        for S in (4096, 65536, 262144, 1 << 20):
            run(f"S={S}", S=S)
        for W in (4, 24, 32, 48):   # 24 and up: stages that fit only shorter chunks
            run(f"W={W}", W=W)
        run("hd=64", hd=64)   # the read-row stage at the register form's tile width
        for T in (1024, 16384):
            run(f"T={T}", T=T)
    out = dump()
    # times: "eager" = events around one call with the device idle before it (host time
    # included, as a caller that waits on every call sees it); "graph" = one replay of the
    # call captured in a CUDA graph (device time only). Floors and ratios use the graph time.
    have_fla = "t_fwd_ms" in fla
    have_fla_g = "g_fwd_ms" in fla

    def vs(ours_ms, key):
        return f"{fla[key] / ours_ms:.2f}x" if key in fla and ours_ms == ours_ms else "-"

    lines = ["| case | tile | bwd tile | fwd ms eager | fwd ms graph | pre-pass ms | "
             "fwd/floor | fwd tok/s vs FLA (graph) | fwd at floor vs FLA | fwd+bwd ms eager | "
             "fwd+bwd ms graph | fb/floor | fwd+bwd tok/s vs FLA (graph) | fb at floor vs FLA | "
             "peak MB | need MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['tile_used']} | {r['bwd_tile_used']} | "
                     f"{r['t_fwd_ms']:.3f} | {r['g_fwd_ms']:.3f} | {r['t_prepass_ms']:.3f} | "
                     f"{r['g_fwd_over_floor']:.2f} | {vs(r['g_fwd_ms'], 'g_fwd_ms')} | "
                     f"{vs(r['floor_fwd_ms'], 'g_fwd_ms')} | "
                     f"{r['t_fb_ms']:.3f} | {r['g_fb_ms']:.3f} | {r['g_fb_over_floor']:.2f} | "
                     f"{vs(r['g_fb_ms'], 'g_fb_ms')} | {vs(r['floor_fb_ms'], 'g_fb_ms')} | "
                     f"{r['peak_mb']:.0f} | {r['need_mb']:.0f} |")
    if have_fla:
        g_f = f"{fla['g_fwd_ms']:.3f}" if have_fla_g else "-"
        g_fb = f"{fla['g_fb_ms']:.3f}" if have_fla_g else "-"
        lines.append(f"| FLA chunk_delta_rule (H=8, K=V=128) | - | - | {fla['t_fwd_ms']:.3f} | "
                     f"{g_f} | - | - | 1.00x | - | {fla['t_fb_ms']:.3f} | {g_fb} | - | 1.00x | - | - | - |")
    if fla.get("graph_error"):
        lines += ["", f"FLA graph replay failed: {fla['graph_error']}"]
    table = "\n".join(lines)
    with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
        f.write(table + "\n")
    plot(out, os.path.join(args.out, "bench_gpu.png"))
    print(table)


if __name__ == "__main__":
    main()
