"""Backward kernel of the Numba CPU backend (SPEC §4, rewinding the bank in place); the
step-by-step map is in the docstring of ``sdm_cupy.kernels.cpu``."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu_chunk import (build_overlaps, entry_tokens,
                        clear_overlaps, dot, gather_reads, gather_writes,
                        hash_build, hash_clear, hash_scratch, overlap_grads, overlap_scratch,
                        scratch, snapshot_row, substitute)
from .cpu_formats import SNAP_EXACT, dequantize_row, store_row
from .cpu_prefetch import PREFETCH_TOKENS, prefetch_token_rows
from .cpu_threads import on_pool, parallel_for


@njit(cache=True, nogil=True)
def _bwd_heads(bp0, bp1, bank, fmt, wi, a, v, beta, ri, c, dr, dM, S, P, hd, C, mode,
               snap_nat, snap_u16, snap_u8, scales, da, dv, dbeta, dc, bad):
    uhd = np.uint64(hd)
    B, T, _, W = wi.shape
    Lmax = min(C, T)
    dt = a.dtype
    wslot, wa, rslot, rc, R, X, E, U = scratch(Lmax, W, hd, dt)
    Z = np.empty((Lmax, hd), dt)
    DR = np.empty((Lmax * W, hd), dt)
    hkey, hhead, htail, enext, used, emult = hash_scratch(Lmax * W, S, T * W)
    etok = entry_tokens(Lmax * W, W)
    G, gmark, gcols, gcnt, H, hmark, hcols, hcnt = overlap_scratch(Lmax, dt)
    dG = np.empty((Lmax, Lmax), dt)
    dH = np.empty((Lmax, Lmax), dt)
    da_c = np.empty(Lmax * W, dt)
    dc_c = np.empty(Lmax * W, dt)
    no_rows = np.empty((0, hd), dt)
    tmp = np.empty((1, hd), dt)
    u32 = np.empty(hd, np.uint32)
    f32v = u32.view(np.float32)
    cv = (u32, f32v)
    for bp in range(bp0, bp1):        # scratch is allocated once per block of heads
        b, p = bp // P, bp % P
        row0, c0 = b * S, p * hd
        uc0 = np.uint64(c0)
        badw = 0
        badr = 0
        nchunks = (T + C - 1) // C
        for ci in range(nchunks - 1, -1, -1):
            t0 = ci * C
            L = min(C, T - t0)
            n = L * W
            # 1. rewind this chunk's written rows, then recompute on M0
            for e in range(n):
                t, w = etok[e], e - etok[e] * W
                if w == 0:
                    prefetch_token_rows(bank, wi, b, t0 + t + PREFETCH_TOKENS, p, W, S, row0, c0,
                                        hd, 0)
                s = wi[b, t0 + t, p, w]
                if s < 0 or s >= S:
                    continue
                srow = snapshot_row(b, p, t0 + t, w, P, T, W)
                if mode == SNAP_EXACT:
                    for k in range(uhd):
                        bank[row0 + s, uc0 + k] = snap_nat[srow, k]
                else:
                    dequantize_row(mode, srow, hd, snap_u16, snap_u8, scales, tmp, 0, u32, f32v)
                    store_row(bank, row0 + s, c0, hd, fmt, tmp, 0, u32, f32v)
            badw += gather_writes(wi, a, bank, fmt, b, p, t0, L, W, S, row0, c0, hd, wslot, wa,
                                  R, X, cv)
            badr += gather_reads(ri, c, bank, fmt, b, p, t0, T, L, W, S, row0, c0, hd, rslot, rc,
                                 no_rows, dr, dc_c, tmp, cv)      # dc_{t,w} = dr_t·M0[j]
            nused = hash_build(wslot, n, hkey, hhead, htail, enext, used, emult)
            build_overlaps(n, W, etok, wa, rslot, rc, hkey, hhead, enext, emult, nused, G, gmark,
                           gcols, gcnt, H, hmark, hcols, hcnt)
            substitute(v, beta, b, p, t0, T, L, c0, hd, X, G, gcols, gcnt, E, U)
            # 2. du = H^T dr + k·dM (dM as at the chunk's end), into Z
            for t in range(L):
                prefetch_token_rows(dM, wi, b, t0 + t + PREFETCH_TOKENS, p, W, S, row0, c0, hd, 0)
                for k in range(uhd):
                    Z[t, k] = 0
                for w in range(W):
                    e = t * W + w
                    s = wslot[e]
                    if s < 0:
                        for k in range(uhd):
                            DR[e, k] = 0
                        continue
                    aw = wa[e]
                    for k in range(uhd):
                        DR[e, k] = dM[row0 + s, uc0 + k]
                    for k in range(uhd):
                        Z[t, k] += aw * DR[e, k]
            for s in range(L):
                rs = b * T + t0 + s
                for q in range(hcnt[s]):
                    tau = hcols[s, q]
                    h = H[s, tau]
                    for k in range(uhd):
                        Z[tau, k] += h * dr[rs, uc0 + k]
            # 3. back substitution: z_t = du_t − Σ_{s>t} β_s G[s,t] z_s
            for t in range(L - 1, -1, -1):
                bt = beta[b, t0 + t, p]
                for q in range(gcnt[t]):
                    tau = gcols[t, q]
                    g = bt * G[t, tau]
                    for k in range(uhd):
                        Z[tau, k] -= g * Z[t, k]
            # 4. dv, dβ, dG, dH
            for t in range(L):
                bt = beta[b, t0 + t, p]
                rt = b * T + t0 + t
                for k in range(uhd):
                    dv[rt, uc0 + k] = bt * Z[t, k]
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
                    t = etok[e]
                    bt = beta[b, t0 + t, p]
                    da_c[e] = dot(U, t, 0, DR, e, 0, hd) - bt * dot(Z, t, 0, R, e, 0, hd)
                else:
                    da_c[e] = 0
            overlap_grads(n, W, etok, wa, rslot, rc, hkey, hhead, enext, emult, nused, dG, dH, da_c,
                          dc_c)
            for e in range(n):
                da[b, t0 + etok[e], p, e - etok[e] * W] = da_c[e]
                dc[b, t0 + etok[e], p, e - etok[e] * W] = dc_c[e]
            # 6. dM at the chunk's start: += a dX (write rows), += c dr (read rows)
            for e in range(n):
                s = wslot[e]
                if s >= 0:
                    t = etok[e]
                    g = -wa[e] * beta[b, t0 + t, p]
                    for k in range(uhd):
                        dM[row0 + s, uc0 + k] += g * Z[t, k]
            for e in range(n):
                if e == etok[e] * W:
                    prefetch_token_rows(dM, ri, b, t0 + etok[e] + PREFETCH_TOKENS, p, W, S, row0,
                                        c0, hd, 1)
                j = rslot[e]
                if j >= 0:
                    cw = rc[e]
                    rt = b * T + t0 + etok[e]
                    for k in range(uhd):
                        dM[row0 + j, uc0 + k] += cw * dr[rt, uc0 + k]
            clear_overlaps(L, gmark, gcols, gcnt, hmark, hcols, hcnt)
            hash_clear(hkey, used, nused)
        bad[bp, 0] = badw
        bad[bp, 1] = badr


def sdm_bwd_kernel(bank, fmt, wi, a, v, beta, ri, c, dr, dM, S, P, hd, C, mode, snap_nat,
                   snap_u16, snap_u8, scales, da, dv, dbeta, dc, bad, nblocks):
    """SPEC §4 for every (b, p); see the module docstring. v, dr, dv are [B*T, D]. The B·P
    heads are split into ``nblocks`` blocks, run as ``cpu_threads`` decides; a block
    allocates its scratch once."""
    if not on_pool():
        _bwd_prange(bank, fmt, wi, a, v, beta, ri, c, dr, dM, S, P, hd, C, mode, snap_nat,
                    snap_u16, snap_u8, scales, da, dv, dbeta, dc, bad, nblocks)
        return
    nbp = wi.shape[0] * P

    def block(blk):
        _bwd_heads(blk * nbp // nblocks, (blk + 1) * nbp // nblocks, bank, fmt, wi, a, v, beta,
                   ri, c, dr, dM, S, P, hd, C, mode, snap_nat, snap_u16, snap_u8, scales, da,
                   dv, dbeta, dc, bad)

    parallel_for(nblocks, block, work=wi.size * hd)


@njit(parallel=True, cache=True)
def _bwd_prange(bank, fmt, wi, a, v, beta, ri, c, dr, dM, S, P, hd, C, mode, snap_nat,
                snap_u16, snap_u8, scales, da, dv, dbeta, dc, bad, nblocks):
    nbp = wi.shape[0] * P
    for blk in prange(nblocks):
        _bwd_heads(blk * nbp // nblocks, (blk + 1) * nbp // nblocks, bank, fmt, wi, a, v, beta,
                   ri, c, dr, dM, S, P, hd, C, mode, snap_nat, snap_u16, snap_u8, scales, da,
                   dv, dbeta, dc, bad)
