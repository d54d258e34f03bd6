"""The Numba CPU backend of sdm_cupy (contract: docs/BACKEND_CONTRACT.md).

Kernels and the SPEC steps they implement
-----------------------------------------
``sdm_fwd_kernel`` (SPEC §3), ``prange`` over the B·P (batch, head) pairs; one worker owns the
S×hd block of its head (bank columns p*hd:(p+1)*hd, rows b*S:(b+1)*S) and walks the chunks in
order, so its scatters need no atomics. Per chunk of L <= C tokens starting at t0:

1. ``gather_entries`` (write ids): reads a, i and the rows M0[i_{t,w}] once into ``R`` (n = L·W
   rows of hd, compute dtype). Those rows are the snapshot: stored per (b, p, t, w) in
   ``snapshot[B, P, T, W, hd]`` (exact bits for ``snapshot_quant=None``, else quantized,
   ``cpu_formats.quantize_row``, with ``scales[B, P, T, W]`` for fp8/int8). Only the T real
   tokens are stored.
2. ``gather_entries`` (read ids) and Y_t = Σ_w c_{t,w} M0[j_{t,w}] (reads the bank rows).
3. ``sort_slots`` + ``build_overlaps``: G[t,τ] = k_t·k_τ (τ<t) and H[t,τ] = q_t·k_τ (τ<=t) from
   the write entries sorted by slot (cost: the matching pairs, not C²W²).
4. ``substitute``: X_t = k_t·M0, e_t = v_t − X_t − Σ_{τ<t} G[t,τ] u_τ, u_t = β_t e_t.
5. r_t = Y_t + Σ_{τ<=t} H[t,τ] u_τ (writes ``readings[b, t, p*hd:(p+1)*hd]``).
6. M_end = M0 + Σ_t k_t u_tᵀ: for each slot run of the sorted entries, the row is summed in the
   compute dtype from R and written to the bank once (one rounding per row for 16-bit banks).

``sdm_bwd_kernel`` (SPEC §4), same workers, chunks last to first, dM (the grad-bank
accumulator, compute dtype) as it is at the chunk's end:

1. Rewind: the snapshot rows are written back into the bank (M[i_{t,w}] <- snapshot), then steps
   1-4 above run again on the rewound bank (recompute instead of store), without Y.
2. du_t = Σ_{s>=t} H[s,t] dr_s + Σ_w a_{t,w} dM[i_{t,w}]  (dM rows gathered once into ``DR``).
3. z = (I + diag(β) tril(G,−1))⁻ᵀ du by back substitution, in place in ``Z``.
4. dv_t = β_t z_t, dβ_t = z_t·e_t, dX_t = −β_t z_t, dG[t,τ] = −β_t z_t·u_τ, dH[t,τ] = dr_t·u_τ
   (only where G, H have entries).
5. da from u_t·dM[i], dX_t·M0[i] and the slot runs (dG, dH); dc from dr_t·M0[j] and dH
   (``overlap_grads``).
6. dM[i_{t,w}] += a_{t,w} dX_t, dM[j_{t,w}] += c_{t,w} dr_t.

Memory: per worker O(C·W·hd + C²) scratch; C is capped at ``CHUNK_CAP`` (a speed knob only,
SPEC §2). Column tiles inside a head are not used: B·P workers already fill a small CPU.

Formats: 16-bit banks reach the kernels as uint16 bits plus a format code (``cpu_formats``);
values, dr and weights are handed over in the compute dtype (float32, float64 for float64 calls),
so each kernel compiles for at most (bank storage: f64/f32/u16) × (compute: f32/f64) types. A
16-bit grad bank (``grad_bank_fp32=False``) is accumulated in float32 and rounded once at the
end. Bank rows of a float16/bfloat16 bank are rounded from the compute dtype with RNE (from
float64 through float32 when the values are float64: double rounding in that rare mix).

Safety: Numba does no bounds checks. Every slot id is tested against [0, S) before it is used;
an id outside is skipped (weight 0) and counted, and the host wrapper raises ValueError after
the kernel (``check_indices=False`` in the API skips the up-front check, never this one).
The parallel kernels run under ``_LOCK``: Numba's default workqueue threading layer is not safe
when several Python threads launch parallel functions at once.
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
from numba import njit, prange

from sdm_cupy.config import UnsupportedConfigurationError  # noqa: F401 (refusals, see check_config)

from .cpu_chunk import (build_overlaps, clear_overlaps, dot, gather_reads, gather_writes,
                        hash_build, hash_clear, hash_find, hash_size, substitute)
from .cpu_prefetch import PREFETCH_TOKENS, prefetch_token_rows
from .cpu_formats import (FMT_BF16, FMT_F16, FMT_NATIVE, SNAP_CODES, SNAP_EXACT, SNAP_OFF,
                          dequantize_row, quantize_row, store_row)

__all__ = ["check_config", "sdm_fwd", "sdm_bwd", "expand_memory_batch", "sum_memory_batch",
           "CHUNK_CAP"]

#: Chunks longer than this are split: the per-worker L×L overlap matrices stay small.
CHUNK_CAP = 256

_LOCK = threading.Lock()
_BF16 = np.dtype(ml_dtypes.bfloat16)
_SNAP_VIEW = {"bf16": _BF16, "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "int8": np.dtype(np.int8)}


# ------------------------------------------------------------------------------------ kernels

@njit(cache=True)
def _scratch(Lmax, W, hd, dt):
    n = Lmax * W
    return (np.empty(n, np.int64), np.empty(n, dt), np.empty(n, np.int64), np.empty(n, dt),
            np.empty((n, hd), dt), np.empty((Lmax, hd), dt), np.empty((Lmax, hd), dt),
            np.empty((Lmax, hd), dt))


@njit(cache=True)
def _hash_scratch(n):
    size = hash_size(n)
    return (np.full(size, -1, np.int64), np.empty(size, np.int64), np.empty(size, np.int64),
            np.empty(n, np.int64), np.empty(n, np.int64))


@njit(cache=True)
def _overlap_scratch(L, dt):
    return (np.empty((L, L), dt), np.zeros((L, L), np.uint8), np.empty((L, L), np.int64),
            np.zeros(L, np.int64), np.empty((L, L), dt), np.zeros((L, L), np.uint8),
            np.empty((L, L), np.int64), np.zeros(L, np.int64))


@njit(cache=True)
def _snapshot_row(b, p, t, w, P, T, W):
    return ((b * P + p) * T + t) * W + w


@njit(cache=True)
def _fwd_head(bp, bank, fmt, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16,
              snap_u8, scales, bad):
    B, T, _, W = wi.shape
    b, p = bp // P, bp % P
    row0, c0 = b * S, p * hd
    Lmax = min(C, T)
    dt = a.dtype
    wslot, wa, rslot, rc, R, X, E, U = _scratch(Lmax, W, hd, dt)
    Y = np.empty((Lmax, hd), dt)
    hkey, hhead, htail, enext, used = _hash_scratch(Lmax * W)
    G, gmark, gcols, gcnt, H, hmark, hcols, hcnt = _overlap_scratch(Lmax, dt)
    no_dc = np.empty(0, dt)
    acc = np.empty((1, hd), dt)
    u32 = np.empty(hd, np.uint32)
    f32v = u32.view(np.float32)
    cv = (u32, f32v)
    badw = 0
    badr = 0
    for t0 in range(0, T, C):
        L = min(C, T - t0)
        n = L * W
        # 1. write entries, M0 rows (R), X = k·M0, snapshots
        badw += gather_writes(wi, a, bank, fmt, b, p, t0, L, W, S, row0, c0, hd, wslot, wa,
                              R, X, cv)
        if mode != SNAP_OFF:
            for e in range(n):
                srow = _snapshot_row(b, p, t0 + e // W, e % W, P, T, W)
                s = wslot[e]
                if mode == SNAP_EXACT:
                    if s >= 0:
                        for k in range(hd):
                            snap_nat[srow, k] = bank[row0 + s, c0 + k]
                    else:
                        for k in range(hd):
                            snap_nat[srow, k] = 0
                else:
                    quantize_row(R, e, hd, mode, srow, snap_u16, snap_u8, scales, u32, f32v)
        # 2. read entries and Y = q·M0
        badr += gather_reads(ri, c, bank, fmt, b, p, t0, T, L, W, S, row0, c0, hd, rslot, rc,
                             Y, v, no_dc, acc, cv)
        # 3. overlaps, 4. forward substitution
        nused = hash_build(wslot, n, hkey, hhead, htail, enext, used)
        build_overlaps(n, W, wa, rslot, rc, hkey, hhead, enext, used, nused, G, gmark, gcols,
                       gcnt, H, hmark, hcols, hcnt)
        substitute(v, beta, b, p, t0, T, L, c0, hd, X, G, gcols, gcnt, E, U)
        # 5. readings r_t = Y_t + Σ H[t,τ] u_τ
        for t in range(L):
            for q in range(hcnt[t]):
                tau = hcols[t, q]
                h = H[t, tau]
                for k in range(hd):
                    Y[t, k] += h * U[tau, k]
            rr = b * T + t0 + t
            for k in range(hd):
                r[rr, c0 + k] = Y[t, k]
        # 6. M_end = M0 + Σ k u^T, one store per written slot
        for q in range(nused):
            hb = used[q]
            e = hhead[hb]
            if fmt == FMT_NATIVE and enext[e] < 0:      # the common case: slot written once
                aw = wa[e]
                t = e // W
                rb = row0 + hkey[hb]
                for k in range(hd):
                    bank[rb, c0 + k] = R[e, k] + aw * U[t, k]
                continue
            for k in range(hd):
                acc[0, k] = R[e, k]
            while e >= 0:
                aw = wa[e]
                t = e // W
                for k in range(hd):
                    acc[0, k] += aw * U[t, k]
                e = enext[e]
            store_row(bank, row0 + hkey[hb], c0, hd, fmt, acc, 0, u32, f32v)
        clear_overlaps(L, gmark, gcols, gcnt, hmark, hcols, hcnt)
        hash_clear(hkey, used, nused)
    bad[bp, 0] = badw
    bad[bp, 1] = badr


@njit(parallel=True, cache=True)
def sdm_fwd_kernel(bank, fmt, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16,
                   snap_u8, scales, bad):
    """SPEC §3 for every (b, p); see the module docstring. v, r are [B*T, D]."""
    B = wi.shape[0]
    for bp in prange(B * P):
        _fwd_head(bp, bank, fmt, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat,
                  snap_u16, snap_u8, scales, bad)


@njit(cache=True)
def overlap_grads(n, W, wa, rslot, rc, hkey, hhead, enext, used, nused, dG, dH, da, dc):
    """The dG, dH terms of SPEC §4 step 5: walks the same chains as ``build_overlaps``."""
    for q in range(nused):
        h = used[q]
        first = hhead[h]
        if enext[first] < 0:
            continue
        ea = enext[first]
        while ea >= 0:
            ta = ea // W
            eb = first
            while eb != ea:
                tb = eb // W
                if tb < ta:
                    d = dG[ta, tb]
                    da[ea] += d * wa[eb]
                    da[eb] += d * wa[ea]
                eb = enext[eb]
            ea = enext[ea]
    for er in range(n):
        j = rslot[er]
        if j < 0:
            continue
        h = hash_find(hkey, j)
        if h < 0:
            continue
        ts = er // W
        e = hhead[h]
        while e >= 0:
            tt = e // W
            if tt > ts:
                break
            d = dH[ts, tt]
            da[e] += d * rc[er]
            dc[er] += d * wa[e]
            e = enext[e]


@njit(cache=True)
def _bwd_head(bp, bank, fmt, wi, a, v, beta, ri, c, dr, dM, S, P, hd, C, mode, snap_nat,
              snap_u16, snap_u8, scales, da, dv, dbeta, dc, bad):
    B, T, _, W = wi.shape
    b, p = bp // P, bp % P
    row0, c0 = b * S, p * hd
    Lmax = min(C, T)
    dt = a.dtype
    wslot, wa, rslot, rc, R, X, E, U = _scratch(Lmax, W, hd, dt)
    Z = np.empty((Lmax, hd), dt)
    DR = np.empty((Lmax * W, hd), dt)
    hkey, hhead, htail, enext, used = _hash_scratch(Lmax * W)
    G, gmark, gcols, gcnt, H, hmark, hcols, hcnt = _overlap_scratch(Lmax, dt)
    dG = np.empty((Lmax, Lmax), dt)
    dH = np.empty((Lmax, Lmax), dt)
    da_c = np.empty(Lmax * W, dt)
    dc_c = np.empty(Lmax * W, dt)
    no_rows = np.empty((0, hd), dt)
    tmp = np.empty((1, hd), dt)
    u32 = np.empty(hd, np.uint32)
    f32v = u32.view(np.float32)
    cv = (u32, f32v)
    badw = 0
    badr = 0
    nchunks = (T + C - 1) // C
    for ci in range(nchunks - 1, -1, -1):
        t0 = ci * C
        L = min(C, T - t0)
        n = L * W
        # 1. rewind this chunk's written rows, then recompute on M0
        for e in range(n):
            t, w = e // W, e % W
            if w == 0:
                prefetch_token_rows(bank, wi, b, t0 + t + PREFETCH_TOKENS, p, W, S, row0, c0,
                                    hd, 1)
            s = wi[b, t0 + t, p, w]
            if s < 0 or s >= S:
                continue
            srow = _snapshot_row(b, p, t0 + t, w, P, T, W)
            if mode == SNAP_EXACT:
                for k in range(hd):
                    bank[row0 + s, c0 + k] = snap_nat[srow, k]
            else:
                dequantize_row(mode, srow, hd, snap_u16, snap_u8, scales, tmp, 0, u32, f32v)
                store_row(bank, row0 + s, c0, hd, fmt, tmp, 0, u32, f32v)
        badw += gather_writes(wi, a, bank, fmt, b, p, t0, L, W, S, row0, c0, hd, wslot, wa,
                              R, X, cv)
        badr += gather_reads(ri, c, bank, fmt, b, p, t0, T, L, W, S, row0, c0, hd, rslot, rc,
                             no_rows, dr, dc_c, tmp, cv)      # dc_{t,w} = dr_t·M0[j]
        nused = hash_build(wslot, n, hkey, hhead, htail, enext, used)
        build_overlaps(n, W, wa, rslot, rc, hkey, hhead, enext, used, nused, G, gmark, gcols,
                       gcnt, H, hmark, hcols, hcnt)
        substitute(v, beta, b, p, t0, T, L, c0, hd, X, G, gcols, gcnt, E, U)
        # 2. du = H^T dr + k·dM (dM as at the chunk's end), into Z
        for t in range(L):
            prefetch_token_rows(dM, wi, b, t0 + t + PREFETCH_TOKENS, p, W, S, row0, c0, hd, 1)
            for k in range(hd):
                Z[t, k] = 0
            for w in range(W):
                e = t * W + w
                s = wslot[e]
                if s < 0:
                    for k in range(hd):
                        DR[e, k] = 0
                    continue
                aw = wa[e]
                for k in range(hd):
                    DR[e, k] = dM[row0 + s, c0 + k]
                for k in range(hd):
                    Z[t, k] += aw * DR[e, k]
        for s in range(L):
            rs = b * T + t0 + s
            for q in range(hcnt[s]):
                tau = hcols[s, q]
                h = H[s, tau]
                for k in range(hd):
                    Z[tau, k] += h * dr[rs, c0 + k]
        # 3. back substitution: z_t = du_t − Σ_{s>t} β_s G[s,t] z_s
        for t in range(L - 1, -1, -1):
            bt = beta[b, t0 + t, p]
            for q in range(gcnt[t]):
                tau = gcols[t, q]
                g = bt * G[t, tau]
                for k in range(hd):
                    Z[tau, k] -= g * Z[t, k]
        # 4. dv, dβ, dG, dH
        for t in range(L):
            bt = beta[b, t0 + t, p]
            rt = b * T + t0 + t
            for k in range(hd):
                dv[rt, c0 + k] = bt * Z[t, k]
            dbeta[b, t0 + t, p] = dot(Z, t, 0, E, t, 0, hd)
            for q in range(gcnt[t]):
                tau = gcols[t, q]
                dG[t, tau] = -bt * dot(Z, t, 0, U, tau, 0, hd)
            for q in range(hcnt[t]):
                tau = hcols[t, q]
                dH[t, tau] = dot(dr, rt, c0, U, tau, 0, hd)
        # 5. da = u·dM[i] + dX·M0[i] + (dG, dH terms); dc += dH terms
        for e in range(n):
            if wslot[e] >= 0:
                t = e // W
                bt = beta[b, t0 + t, p]
                da_c[e] = dot(U, t, 0, DR, e, 0, hd) - bt * dot(Z, t, 0, R, e, 0, hd)
            else:
                da_c[e] = 0
        overlap_grads(n, W, wa, rslot, rc, hkey, hhead, enext, used, nused, dG, dH, da_c,
                      dc_c)
        for e in range(n):
            da[b, t0 + e // W, p, e % W] = da_c[e]
            dc[b, t0 + e // W, p, e % W] = dc_c[e]
        # 6. dM at the chunk's start: += a dX (write rows), += c dr (read rows)
        for e in range(n):
            s = wslot[e]
            if s >= 0:
                t = e // W
                g = -wa[e] * beta[b, t0 + t, p]
                for k in range(hd):
                    dM[row0 + s, c0 + k] += g * Z[t, k]
        for e in range(n):
            if e % W == 0:
                prefetch_token_rows(dM, ri, b, t0 + e // W + PREFETCH_TOKENS, p, W, S, row0,
                                    c0, hd, 1)
            j = rslot[e]
            if j >= 0:
                cw = rc[e]
                rt = b * T + t0 + e // W
                for k in range(hd):
                    dM[row0 + j, c0 + k] += cw * dr[rt, c0 + k]
        clear_overlaps(L, gmark, gcols, gcnt, hmark, hcols, hcnt)
        hash_clear(hkey, used, nused)
    bad[bp, 0] = badw
    bad[bp, 1] = badr


@njit(parallel=True, cache=True)
def sdm_bwd_kernel(bank, fmt, wi, a, v, beta, ri, c, dr, dM, S, P, hd, C, mode, snap_nat,
                   snap_u16, snap_u8, scales, da, dv, dbeta, dc, bad):
    """SPEC §4 for every (b, p); see the module docstring. v, dr, dv are [B*T, D]."""
    B = wi.shape[0]
    for bp in prange(B * P):
        _bwd_head(bp, bank, fmt, wi, a, v, beta, ri, c, dr, dM, S, P, hd, C, mode, snap_nat,
                  snap_u16, snap_u8, scales, da, dv, dbeta, dc, bad)


# ------------------------------------------------------------------------------- host side

def _storage(x):
    """(array the kernels take, format code): 16-bit floats travel as uint16 bits."""
    if x.dtype == np.float16:
        return x.view(np.uint16), FMT_F16
    if x.dtype == _BF16:
        return x.view(np.uint16), FMT_BF16
    return x, FMT_NATIVE


def _chunk(lay) -> int:
    return int(min(lay.C, CHUNK_CAP, lay.T))


def _kernel_inputs(lay, inputs):
    wi, a, v, beta, ri, c = inputs
    cd = lay.compute_dtype
    return (np.ascontiguousarray(wi, dtype=np.int64), np.ascontiguousarray(a, dtype=cd),
            np.ascontiguousarray(v, dtype=cd), np.ascontiguousarray(beta, dtype=cd),
            np.ascontiguousarray(ri, dtype=np.int64), np.ascontiguousarray(c, dtype=cd))


def _snapshot_arrays(lay, bank_k, snapshots, mode):
    """Kernel views (snap_nat, snap_u16, snap_u8, scales) of the snapshot tuple."""
    hd = lay.hd
    nat = np.empty((0, hd), bank_k.dtype)
    u16 = np.empty((0, hd), np.uint16)
    u8 = np.empty((0, hd), np.uint8)
    sc = np.empty(0, np.float32)
    if snapshots is None:
        return nat, u16, u8, sc
    rows, scales = snapshots
    flat = rows.reshape(-1, hd)
    if mode == SNAP_EXACT:
        nat = flat.view(bank_k.dtype)
    elif mode == SNAP_CODES["bf16"]:
        u16 = flat.view(np.uint16)
    else:
        u8 = flat.view(np.uint8)
        sc = scales.reshape(-1)
    return nat, u16, u8, sc


def _raise_bad_ids(bad, lay, wi, ri):
    for col, name, idx in ((0, "write_idx", wi), (1, "read_idx", ri)):
        count = int(bad[:, col].sum())
        if count:
            lo, hi = int(idx.min()), int(idx.max())
            raise ValueError(
                f"{name} values must lie in [0, num_memory_slots) = [0, {lay.S}); found {count} "
                f"id(s) outside (values in [{lo}, {hi}]). The CPU kernels skipped them (treated "
                "as weight 0), so the outputs of this call are not the op's; with inplace=True "
                "the bank was updated without them.")


def check_config(lay, config) -> None:
    """CPU refusals for a call that saves snapshots: none. Every mode of SPEC §5 and every hd
    run here (the conversions are done on bits, rows need no tiling)."""
    return None


def sdm_fwd(lay, config, bank, write_idx, write_w, values, beta, read_idx, read_w, *,
            save_snapshots):
    """Forward of SPEC §3; ``bank`` [B*S, D] is updated in place to the final bank.

    Returns (readings [B, T, D] in lay.value_dtype, snapshots) where snapshots is None or
    (rows [B, P, T, W, hd], scales [B, P, T, W] float32 or None): rows in the bank dtype
    (``snapshot_quant=None``), bfloat16, float8_e4m3fn codes or int8 codes.
    """
    B, T, P, W, hd, S = lay.B, lay.T, lay.P, lay.W, lay.hd, lay.S
    cd = lay.compute_dtype
    bank_k, fmt = _storage(bank)
    wi, a, v, be, ri, c = _kernel_inputs(
        lay, (write_idx, write_w, values, beta, read_idx, read_w))
    r = np.empty((B, T, lay.D), cd)
    quant = config.snapshot_quant
    snapshots = None
    mode = SNAP_OFF
    if save_snapshots:
        mode = SNAP_CODES[quant]
        nrows = (B, P, T, W, hd)
        if quant is None:
            snapshots = (np.empty(nrows, bank.dtype), None)
        elif quant == "bf16":
            snapshots = (np.empty(nrows, _BF16), None)
        else:
            snapshots = (np.empty(nrows, _SNAP_VIEW[quant]), np.empty((B, P, T, W), np.float32))
    nat, u16, u8, sc = _snapshot_arrays(lay, bank_k, snapshots, mode)
    bad = np.zeros((B * P, 2), np.int64)
    with _LOCK:
        sdm_fwd_kernel(bank_k, fmt, wi, a, v.reshape(B * T, lay.D), be, ri, c,
                       r.reshape(B * T, lay.D), S, P, hd, _chunk(lay), mode, nat, u16, u8, sc,
                       bad)
    if bad.any():
        _raise_bad_ids(bad, lay, wi, ri)
    readings = r if r.dtype == lay.value_dtype else r.astype(lay.value_dtype)
    return readings, snapshots


def sdm_bwd(lay, config, bank, inputs, snapshots, dr, dM):
    """Backward of SPEC §4; rewinds ``bank`` in place to the initial bank.

    Returns (d_bank [B*S, D] in lay.grad_bank_dtype, d_write_w, d_values (lay.value_dtype),
    d_beta, d_read_w); the weight gradients are in the compute dtype.
    """
    B, T, P, W, hd, S = lay.B, lay.T, lay.P, lay.W, lay.hd, lay.S
    cd = lay.compute_dtype
    bank_k, fmt = _storage(bank)
    wi, a, v, be, ri, c = _kernel_inputs(lay, inputs)
    drk = np.ascontiguousarray(dr, dtype=cd)
    if dM is None:
        dMk = np.zeros((B * S, lay.D), cd)
    else:
        dMk = np.ascontiguousarray(dM, dtype=cd)   # no copy when dM is already cd
    mode = SNAP_CODES[config.snapshot_quant]
    nat, u16, u8, sc = _snapshot_arrays(lay, bank_k, snapshots, mode)
    da = np.empty((B, T, P, W), cd)
    dv = np.empty((B, T, lay.D), cd)
    dbeta = np.empty((B, T, P), cd)
    dc = np.empty((B, T, P, W), cd)
    bad = np.zeros((B * P, 2), np.int64)
    with _LOCK:
        sdm_bwd_kernel(bank_k, fmt, wi, a, v.reshape(B * T, lay.D), be, ri, c,
                       drk.reshape(B * T, lay.D), dMk, S, P, hd, _chunk(lay), mode, nat, u16,
                       u8, sc, da, dv.reshape(B * T, lay.D), dbeta, dc, bad)
    if bad.any():
        _raise_bad_ids(bad, lay, wi, ri)
    d_bank = dMk if dMk.dtype == lay.grad_bank_dtype else dMk.astype(lay.grad_bank_dtype)
    d_values = dv if dv.dtype == lay.value_dtype else dv.astype(lay.value_dtype)
    return d_bank, da, d_values, dbeta, dc


def expand_memory_batch(param, batch: int):
    """[S, D] -> [B*S, D]: ``batch`` copies of ``param`` (SPEC §6)."""
    S, D = param.shape
    out = np.empty((batch, S, D), param.dtype)
    out[...] = param
    return out.reshape(batch * S, D)


def sum_memory_batch(grad_bank, S: int):
    """[B*S, D] -> [S, D]: the sum of the B copies, accumulated in float32 at least."""
    rows, D = grad_bank.shape
    acc_dt = np.float64 if grad_bank.dtype == np.float64 else np.float32
    g = grad_bank.reshape(rows // S, S, D)
    acc = g[0].astype(acc_dt)
    for b in range(1, rows // S):
        acc += g[b]
    return acc if acc.dtype == grad_bank.dtype else acc.astype(grad_bank.dtype)
