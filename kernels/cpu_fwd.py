"""Forward kernels of the Numba CPU backend: the token-by-token recurrence (SPEC §2) for
float32/float64 banks and the chunked form (SPEC §3) for 16-bit banks; the step-by-step map
is in the docstring of ``sdm_cupy.kernels.cpu``."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu_chunk import (build_overlaps, entry_tokens,
                        clear_overlaps, gather_reads, gather_writes, hash_build,
                        hash_clear, hash_scratch, overlap_scratch, scratch, snapshot_row,
                        substitute)
from .cpu_formats import FMT_NATIVE, SNAP_EXACT, SNAP_OFF, quantize_row, store_row
from .cpu_prefetch import PREFETCH_TOKENS, _prefetch_level, prefetch_token_rows
from .cpu_threads import on_pool, parallel_for

#: tokens ahead whose rows the native (token-by-token) forward prefetches; 0: none
PREFETCH_SEQ = 2
#: its locality hint (see ``cpu_prefetch._prefetch_level``)
PREFETCH_LOC = 1


@njit(cache=True, nogil=True)
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


def sdm_fwd_kernel(bank, fmt, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16,
                   snap_u8, scales, bad, nblocks):
    """SPEC §3 for every (b, p); see the module docstring. v, r are [B*T, D]. The B·P heads
    are split into ``nblocks`` blocks, run as ``cpu_threads`` decides; a block allocates its
    scratch once."""
    if not on_pool():
        _fwd_prange(bank, fmt, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16,
                    snap_u8, scales, bad, nblocks)
        return
    nbp = wi.shape[0] * P

    def block(blk):
        _fwd_heads(blk * nbp // nblocks, (blk + 1) * nbp // nblocks, bank, fmt, wi, a, v, beta,
                   ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16, snap_u8, scales, bad)

    parallel_for(nblocks, block, work=wi.size * hd)


@njit(parallel=True, cache=True)
def _fwd_prange(bank, fmt, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16,
                snap_u8, scales, bad, nblocks):
    nbp = wi.shape[0] * P
    for blk in prange(nblocks):
        _fwd_heads(blk * nbp // nblocks, (blk + 1) * nbp // nblocks, bank, fmt, wi, a, v, beta,
                   ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16, snap_u8, scales, bad)


# ------------------------------------------------------- native banks: the recurrence itself

@njit(cache=True)
def _seq_snapshots(b, p0, p1, t0, t1, bank, wi, S, P, hd, mode, snap_nat, snap_u16, snap_u8,
                   scales, tmp, u32, f32v):
    """Snapshot rows of the write entries of tokens t0..t1-1 (one chunk), heads p0..p1-1,
    taken before the chunk runs: the bank rows are M0 (SPEC §3), repeated slots included."""
    uhd = np.uint64(hd)
    T, W = wi.shape[1], wi.shape[3]
    row0 = b * S
    for t in range(t0, t1):
        for p in range(p0, p1):
            uc0 = np.uint64(p * hd)
            for w in range(W):
                srow = snapshot_row(b, p, t, w, P, T, W)
                s = wi[b, t, p, w]
                ok = s >= 0 and s < S
                if mode == SNAP_EXACT:
                    if ok:
                        for k in range(uhd):
                            snap_nat[srow, k] = bank[row0 + s, uc0 + k]
                    else:
                        for k in range(uhd):
                            snap_nat[srow, k] = 0
                    continue
                if ok:
                    for k in range(uhd):
                        tmp[0, k] = bank[row0 + s, uc0 + k]
                else:
                    for k in range(uhd):
                        tmp[0, k] = 0
                quantize_row(tmp, 0, hd, mode, srow, snap_u16, snap_u8, scales, u32, f32v)


@njit(cache=True, inline="always")
def _rows_dot(X, g, bank, rows, wts, q, n, uc0, uhd):
    """X[g] = sum_j wts[q, j] * bank[rows[q, j], uc0:uc0+hd] for j < n, summed in j order. Rows
    go 8 or 4 per pass over the columns: the same additions in the same order as one row at a
    time, but X[g] is loaded and stored once per group."""
    for k in range(uhd):
        X[g, k] = 0
    j = 0
    while j + 8 <= n:
        r0, r1, r2, r3 = rows[q, j], rows[q, j + 1], rows[q, j + 2], rows[q, j + 3]
        r4, r5, r6, r7 = rows[q, j + 4], rows[q, j + 5], rows[q, j + 6], rows[q, j + 7]
        a0, a1, a2, a3 = wts[q, j], wts[q, j + 1], wts[q, j + 2], wts[q, j + 3]
        a4, a5, a6, a7 = wts[q, j + 4], wts[q, j + 5], wts[q, j + 6], wts[q, j + 7]
        for k in range(uhd):
            ck = uc0 + k
            X[g, k] = (((((((X[g, k] + a0 * bank[r0, ck]) + a1 * bank[r1, ck])
                           + a2 * bank[r2, ck]) + a3 * bank[r3, ck])
                         + a4 * bank[r4, ck]) + a5 * bank[r5, ck])
                       + a6 * bank[r6, ck]) + a7 * bank[r7, ck]
        j += 8
    if j + 4 <= n:
        r0, r1, r2, r3 = rows[q, j], rows[q, j + 1], rows[q, j + 2], rows[q, j + 3]
        a0, a1, a2, a3 = wts[q, j], wts[q, j + 1], wts[q, j + 2], wts[q, j + 3]
        for k in range(uhd):
            ck = uc0 + k
            X[g, k] = (((X[g, k] + a0 * bank[r0, ck]) + a1 * bank[r1, ck])
                       + a2 * bank[r2, ck]) + a3 * bank[r3, ck]
        j += 4
    while j < n:
        r0 = rows[q, j]
        a0 = wts[q, j]
        for k in range(uhd):
            X[g, k] += a0 * bank[r0, uc0 + k]
        j += 1


@njit(cache=True, nogil=True)
def _seq_group(b, p0, p1, bank, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat,
               snap_u16, snap_u8, scales, bad):
    """Heads p0..p1-1 of batch element b, token by token (SPEC §2). Native banks only
    (float32/float64 storage). Per token, the phases run over all heads of the group: every
    head's pred = k_t·M gathers, then every head's u and scatter, then every head's readings,
    so that the row loads of one phase do not wait behind the stores of another head. With
    snapshots, each chunk of C tokens first stores the rows M0[i] its write entries will
    change (``_seq_snapshots``)."""
    uhd = np.uint64(hd)
    B, T, _, W = wi.shape
    dt = a.dtype
    G = p1 - p0
    X = np.empty((G, hd), dt)
    wrow = np.empty((G, W), np.int64)          # valid write entries of the token, per head
    wwt = np.empty((G, W), dt)
    wcnt = np.zeros(G, np.int64)
    rrow = np.empty((1, W), np.int64)        # valid read entries of the token (one head)
    rwt = np.empty((1, W), dt)
    tmp = np.empty((1, hd), dt)
    u32 = np.empty(hd, np.uint32)
    f32v = u32.view(np.float32)
    row0 = b * S
    step = max(1, 64 // bank.itemsize)           # bank values per cache line
    badw = 0
    badr = 0
    for t0 in range(0, T, C):
        t1 = min(T, t0 + C)
        if mode != SNAP_OFF:
            _seq_snapshots(b, p0, p1, t0, t1, bank, wi, S, P, hd, mode, snap_nat, snap_u16,
                           snap_u8, scales, tmp, u32, f32v)
        for t in range(t0, t1):
            if PREFETCH_SEQ > 0:
                tp = t + PREFETCH_SEQ
                if tp < T:
                    for p in range(p0, p1):
                        c0 = p * hd
                        for w in range(W):
                            s = wi[b, tp, p, w]
                            if s >= 0 and s < S:
                                for off in range(0, hd, step):
                                    _prefetch_level(bank, row0 + s, c0 + off, PREFETCH_LOC)
                            s = ri[b, tp, p, w]
                            if s >= 0 and s < S:
                                for off in range(0, hd, step):
                                    _prefetch_level(bank, row0 + s, c0 + off, PREFETCH_LOC)
            vr = b * T + t
            # 1. pred = k_t·M for every head, summed in w order (``_rows_dot``)
            for g in range(G):
                p = p0 + g
                uc0 = np.uint64(p * hd)
                n = 0
                for w in range(W):
                    s = wi[b, t, p, w]
                    if s < 0 or s >= S:
                        badw += 1
                        continue
                    wrow[g, n] = row0 + s
                    wwt[g, n] = a[b, t, p, w]
                    n += 1
                wcnt[g] = n
                _rows_dot(X, g, bank, wrow, wwt, g, n, uc0, uhd)
            # 2. u = β (v − pred) (in X), M[i] += a u in w order (repeats accumulate)
            for g in range(G):
                p = p0 + g
                uc0 = np.uint64(p * hd)
                bt = beta[b, t, p]
                for k in range(uhd):
                    X[g, k] = bt * (v[vr, uc0 + k] - X[g, k])
                for j in range(wcnt[g]):
                    rb = wrow[g, j]
                    aw = wwt[g, j]
                    for k in range(uhd):
                        bank[rb, uc0 + k] += aw * X[g, k]
            # 3. r_t = q_t·M after the write, summed like pred
            for g in range(G):
                p = p0 + g
                uc0 = np.uint64(p * hd)
                n = 0
                for w in range(W):
                    s = ri[b, t, p, w]
                    if s < 0 or s >= S:
                        badr += 1
                        continue
                    rrow[0, n] = row0 + s
                    rwt[0, n] = c[b, t, p, w]
                    n += 1
                _rows_dot(X, g, bank, rrow, rwt, 0, n, uc0, uhd)
                for k in range(uhd):
                    r[vr, uc0 + k] = X[g, k]
    bad[b * P + p0, 0] = badw            # the group's counts go to its first head's row
    bad[b * P + p0, 1] = badr


def sdm_fwd_seq_kernel(bank, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16,
                       snap_u8, scales, bad, ngroups):
    """SPEC §2 for native banks; blocks of (b, group of ``P // ngroups`` heads), run as
    ``cpu_threads`` decides. v, r are [B*T, D]; ``bad`` [B*P, 2] gets the counts of ids
    outside [0, S) (only its sums mean anything) and must be zero on entry."""
    if not on_pool():
        _seq_prange(bank, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16,
                    snap_u8, scales, bad, ngroups)
        return

    def block(blk):
        b, g = blk // ngroups, blk % ngroups
        _seq_group(b, g * P // ngroups, (g + 1) * P // ngroups, bank, wi, a, v, beta, ri, c,
                   r, S, P, hd, C, mode, snap_nat, snap_u16, snap_u8, scales, bad)

    parallel_for(wi.shape[0] * ngroups, block, work=wi.size * hd)


@njit(parallel=True, cache=True)
def _seq_prange(bank, wi, a, v, beta, ri, c, r, S, P, hd, C, mode, snap_nat, snap_u16,
                snap_u8, scales, bad, ngroups):
    for blk in prange(wi.shape[0] * ngroups):
        b, g = blk // ngroups, blk % ngroups
        _seq_group(b, g * P // ngroups, (g + 1) * P // ngroups, bank, wi, a, v, beta, ri, c,
                   r, S, P, hd, C, mode, snap_nat, snap_u16, snap_u8, scales, bad)
