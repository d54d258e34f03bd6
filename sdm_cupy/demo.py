"""The main job: store key->value pairs in the memory and read them back (``sdm-cupy demo``).

Each of N keys is a random vector; its address in each head is the top-W of its similarity to
S random slot keys (softmax weights, normalised so that sum_w a_w^2 = 1). The first N tokens
write value n at key n's address with beta = 1 (the delta rule then stores it exactly, up to
interference from later writes that share a slot); the next N tokens read at the same
addresses. A read counts as recalled when its nearest stored value (cosine) is the right one.
Then one backward of the squared error of the readings, for the timing of forward+backward.
"""

from __future__ import annotations

import time

import numpy as np

from .api import backward, forward
from .config import SDMConfig


def _addresses(rng, n, S, P, W, dk):
    slot_keys = rng.normal(size=(P, S, dk)).astype(np.float32)
    keys = rng.normal(size=(n, dk)).astype(np.float32)
    idx = np.empty((n, P, W), np.int32)
    w = np.empty((n, P, W), np.float32)
    for p in range(P):
        sim = keys @ slot_keys[p].T / np.sqrt(dk)                 # [n, S]
        top = np.argpartition(-sim, W - 1, axis=1)[:, :W]
        s = np.take_along_axis(sim, top, axis=1)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        a = e / np.sqrt((e ** 2).sum(axis=1, keepdims=True))    # sum_w a_w^2 = 1
        idx[:, p], w[:, p] = top, a
    return idx, w


def make_inputs(rng, B, N, S, P, hd, W):
    """Inputs of one demo call (NumPy): T = 2N tokens per batch element."""
    D, T = P * hd, 2 * N
    widx = np.empty((B, T, P, W), np.int32)
    ww = np.zeros((B, T, P, W), np.float32)
    rw = np.zeros((B, T, P, W), np.float32)
    values = np.zeros((B, T, D), np.float32)
    beta = np.zeros((B, T, P), np.float32)
    stored = rng.normal(size=(B, N, D)).astype(np.float32)
    for b in range(B):
        idx, w = _addresses(rng, N, S, P, W, dk=32)
        widx[b, :N], widx[b, N:] = idx, idx
        ww[b, :N] = w              # write phase: write at key n's address...
        rw[b, N:] = w              # ...read phase: read there
        values[b, :N] = stored[b]
        beta[b, :N] = 1.0
    bank = np.zeros((B * S, D), np.float32)
    return bank, widx, ww, values, beta, widx.copy(), rw, stored


def recall_accuracy(readings, stored):
    """Fraction of reads whose nearest stored value (cosine) is the one written at that key."""
    N = stored.shape[1]
    r = readings[:, N:]
    rn = r / (np.linalg.norm(r, axis=-1, keepdims=True) + 1e-12)
    sn = stored / (np.linalg.norm(stored, axis=-1, keepdims=True) + 1e-12)
    sim = np.einsum("bnd,bmd->bnm", rn, sn)
    return float((sim.argmax(-1) == np.arange(N)).mean())


def run(B=4, N=1024, S=4096, P=4, hd=64, W=8, C=64, rounds=5, device="auto", seed=0, out=print):
    from tqdm import tqdm

    from . import _why_no_gpu, gpu_available
    use_gpu = device == "gpu" or (device == "auto" and gpu_available())
    if device == "gpu" and not gpu_available():
        raise SystemExit("sdm-cupy demo: --device gpu asked for, but the GPU backend is not "
                         f"available: {_why_no_gpu()}")
    xp = np
    if use_gpu:
        import cupy as xp
    rng = np.random.default_rng(seed)
    cfg = SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=C)
    host = make_inputs(rng, B, N, S, P, hd, W)
    bank, widx, ww, values, beta, ridx, rw = (xp.asarray(a) for a in host[:7])
    stored = host[7]
    T = 2 * N
    backend = "GPU (CUDA C++ via CuPy)" if use_gpu else "CPU (Numba)"
    out(f"sdm-cupy demo: {B}x{N} key->value pairs, S={S} slots, P={P} heads of hd={hd}, "
        f"top-{W} addressing, chunk {C}, on the {backend}")

    def sync():
        if use_gpu:
            xp.cuda.get_current_stream().synchronize()

    # warm-up: kernel compilation (Numba's cache or CuPy's) stays out of the timings
    res = forward(bank, widx, ww, values, beta, ridx, rw, cfg)
    backward(res.saved, xp.zeros_like(res.readings))
    sync()
    t_fwd, t_fb, acc, loss, rel = [], [], 0.0, 0.0, 0.0
    for _ in tqdm(range(rounds), desc="forward+backward", unit="round", leave=False):
        t0 = time.perf_counter()
        res = forward(bank, widx, ww, values, beta, ridx, rw, cfg)
        sync()
        t1 = time.perf_counter()
        r = res.readings
        target = xp.zeros_like(r)
        target[:, N:] = xp.asarray(stored)
        err = r - target
        err[:, :N] = 0
        loss = float((err ** 2).sum()) / (B * N)
        rel = loss / float((stored.astype(np.float64) ** 2).sum() / (B * N))
        t2 = time.perf_counter()
        g = backward(res.saved, 2 * err / (B * N))
        sync()
        t3 = time.perf_counter()
        t_fwd.append(t1 - t0)
        t_fb.append((t1 - t0) + (t3 - t2))
        acc = recall_accuracy(r.get() if use_gpu else r, stored)
    rewound = float(abs(res.bank - bank).max())
    fwd_s, fb_s = float(np.median(t_fwd)), float(np.median(t_fb))
    gnorm = float(xp.sqrt((g.values.astype(xp.float32) ** 2).sum()))
    out(f"recall accuracy : {acc:.4f} of {B * N} reads (chance {1.0 / N:.4f})")
    out(f"read-back error : {rel:.4f} (||r - v||^2 / ||v||^2: interference of slots shared by "
        f"later writes)")
    out(f"forward         : {B * T / fwd_s:,.0f} tokens/s ({fwd_s * 1e3:.1f} ms per call of {B}x{T} tokens)")
    out(f"forward+backward: {B * T / fb_s:,.0f} tokens/s ({fb_s * 1e3:.1f} ms)")
    out(f"backward        : |grad values| = {gnorm:.4f}; bank rewound to its initial state "
        f"(max abs difference {rewound:.1e})")
    out(f"backend         : {backend}")
    return {"accuracy": acc, "loss": loss, "relative_error": rel, "fwd_tokens_per_s": B * T / fwd_s,
            "fb_tokens_per_s": B * T / fb_s, "backend": backend, "rewind_error": rewound}
