"""Forward kernel of the Numba CPU backend (SPEC §3); the step-by-step map is in the
docstring of ``sdm_cupy.kernels.cpu``."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu_chunk import (build_overlaps, entry_tokens,
                        clear_overlaps, gather_reads, gather_writes, hash_build,
                        hash_clear, hash_scratch, overlap_scratch, scratch, snapshot_row,
                        substitute)
from .cpu_formats import FMT_NATIVE, SNAP_EXACT, SNAP_OFF, quantize_row, store_row
from .cpu_prefetch import PREFETCH_TOKENS, prefetch_token_rows


@njit(cache=True)
def _fwd_heads(bp0, bp1, bank, fmt, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat,
               snap_u16, snap_u8, scales, bad):
    uhd = np.uint64(hd)
    B, T, _, W = wi.shape
    Lmax = min(C, T)
    dt = a.dtype
    Y = np.empty((Lmax, hd), dt)
    hkey, hhead, htail, enext, used, emult = hash_scratch(Lmax * W, S, T * W)
    etok = entry_tokens(Lmax * W, W)
    G, gmark, gcols, gcnt, H, hmark, hcols, hcnt = overlap_scratch(Lmax, dt)
    no_dc = np.empty(0, dt)
    acc = np.empty((1, hd), dt)
    u32 = np.empty(hd, np.uint32)
    f32v = u32.view(np.float32)
    cv = (u32, f32v)
    # R (the M0 rows) is only needed by 16-bit banks and quantized snapshots; else the scatter
    # reads M0 from the bank rows themselves (unchanged until the chunk's scatter)
    keep = fmt != FMT_NATIVE or (mode != SNAP_OFF and mode != SNAP_EXACT)
    wslot, wa, rslot, rc, R, X, E, U = scratch(Lmax, W, hd, dt, keep)
    for bp in range(bp0, bp1):        # scratch is allocated once per block of heads
        b, p = bp // P, bp % P
        row0, c0 = b * S, p * hd
        uc0 = np.uint64(c0)
        if T <= PREFETCH_TOKENS and bp + 1 < bp1:
            # short calls (decoding) never reach the in-chunk prefetch: fetch the next head's
            # rows while this one runs
            bn, pn = (bp + 1) // P, (bp + 1) % P
            for tn in range(T):
                prefetch_token_rows(bank, wi, bn, tn, pn, W, S, bn * S, pn * hd, hd, 0)
                prefetch_token_rows(bank, ri, bn, tn, pn, W, S, bn * S, pn * hd, hd, 0)
        badw = 0
        badr = 0
        for t0 in range(0, T, C):
            L = min(C, T - t0)
            n = L * W
            # 1. write entries, M0 rows (R), X = k·M0, snapshots
            badw += gather_writes(wi, a, bank, fmt, b, p, t0, L, W, S, row0, c0, hd, wslot, wa,
                                  R, X, cv, keep)
            if mode != SNAP_OFF:
                for e in range(n):
                    srow = snapshot_row(b, p, t0 + etok[e], e - etok[e] * W, P, T, W)
                    s = wslot[e]
                    if mode == SNAP_EXACT:
                        if s >= 0:
                            for k in range(uhd):
                                snap_nat[srow, k] = bank[row0 + s, uc0 + k]
                        else:
                            for k in range(uhd):
                                snap_nat[srow, k] = 0
                    else:
                        quantize_row(R, e, hd, mode, srow, snap_u16, snap_u8, scales, u32, f32v)
            # 2. read entries and Y = q·M0
            badr += gather_reads(ri, c, bank, fmt, b, p, t0, T, L, W, S, row0, c0, hd, rslot, rc,
                                 Y, v, no_dc, acc, cv)
            # 3. overlaps, 4. forward substitution
            nused = hash_build(wslot, n, hkey, hhead, htail, enext, used, emult)
            build_overlaps(n, W, etok, wa, rslot, rc, hkey, hhead, enext, emult, nused, G, gmark,
                           gcols, gcnt, H, hmark, hcols, hcnt)
            substitute(v, beta, b, p, t0, T, L, c0, hd, X, G, gcols, gcnt, E, U)
            # 5. readings r_t = Y_t + Σ H[t,τ] u_τ
            for t in range(L):
                for q in range(hcnt[t]):
                    tau = hcols[t, q]
                    h = H[t, tau]
                    for k in range(uhd):
                        Y[t, k] += h * U[tau, k]
                rr = b * T + t0 + t
                for k in range(uhd):
                    r[rr, uc0 + k] = Y[t, k]
            # 6. M_end = M0 + Σ k u^T, one store per written slot. Entries are walked in order
            # (sequential loads, no bucket tables): a slot written once is updated from its
            # entry, a longer chain is summed at its first entry (the buckets' first-seen order,
            # so the same bits as walking the buckets)
            for e in range(n):
                s = wslot[e]
                if s < 0:
                    continue
                m = emult[e]
                if m == 2:
                    continue
                rb = row0 + s
                if fmt == FMT_NATIVE and m == 0:            # the common case: slot written once
                    aw = wa[e]
                    t = etok[e]
                    if keep:
                        for k in range(uhd):
                            bank[rb, uc0 + k] = R[e, k] + aw * U[t, k]
                    else:
                        for k in range(uhd):
                            bank[rb, uc0 + k] += aw * U[t, k]
                    continue
                if keep:
                    for k in range(uhd):
                        acc[0, k] = R[e, k]
                else:
                    for k in range(uhd):
                        acc[0, k] = bank[rb, uc0 + k]
                ec = e
                while ec >= 0:
                    aw = wa[ec]
                    t = etok[ec]
                    for k in range(uhd):
                        acc[0, k] += aw * U[t, k]
                    ec = enext[ec]
                store_row(bank, rb, c0, hd, fmt, acc, 0, u32, f32v)
            clear_overlaps(L, gmark, gcols, gcnt, hmark, hcols, hcnt)
            hash_clear(hkey, used, nused)
        bad[bp, 0] = badw
        bad[bp, 1] = badr


@njit(parallel=True, cache=True)
def sdm_fwd_kernel(bank, fmt, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16,
                   snap_u8, scales, bad, nblocks):
    """SPEC §3 for every (b, p); see the module docstring. v, r are [B*T, D]. The B·P heads
    are split into ``nblocks`` blocks (``prange``); a block allocates its scratch once."""
    nbp = wi.shape[0] * P
    for blk in prange(nblocks):
        _fwd_heads(blk * nbp // nblocks, (blk + 1) * nbp // nblocks, bank, fmt, wi, a, v, beta,
                   ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16, snap_u8, scales, bad)
