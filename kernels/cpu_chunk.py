"""Per-chunk building blocks of the Numba CPU kernels (SPEC §3), shared by forward and backward.

One worker owns one (b, p) and walks its chunks; everything here acts on that worker's scratch
for one chunk of L tokens starting at t0. Entry e = t*W + w of a chunk is the address
(t0+t, w); write entries carry slot ``wslot[e]`` and weight ``wa[e]``, read entries ``rslot[e]``
and ``rc[e]``. An id outside [0, S) becomes slot -1 with weight 0: it matches nothing, is never
gathered or scattered, and is counted.

Overlaps (G, H) come from a table of the chunk's write slots (a direct slot-indexed table when
the call touches many slots, else a small open-addressing hash): each slot met gets a bucket
(``hkey``) holding the chain of its write entries in increasing e (so in
token order: ``hhead``, ``enext``); ``used`` lists the buckets in first-seen order. G pairs up
the entries of each chain and a read entry finds its chain by one probe, so the cost is the
number of matching pairs, not C²W². G and H are dense L×L matrices plus, per row, the list of
columns that are set (``gcols[t, :gcnt[t]]``): substitutions touch only the nonzeros and
clearing costs what filling did.

Loops run in a fixed order, so results are bitwise reproducible from call to call.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cpu_formats import FMT_NATIVE, load_row
from .cpu_prefetch import PREFETCH_TOKENS, prefetch_token_rows

_HASH_MUL = 0x9E3779B1          # odd 32-bit multiplier (Knuth); slot ids are < 2^31


@njit(cache=True)
def hash_size(n, S, touches):
    """Size of the slot table. When the call touches about as many addresses as there are slots
    (``touches`` >= S/2), a direct table indexed by the slot itself (no hashing, no probing);
    its size is S or S+1, chosen not to be a power of two. Else a power-of-two open-addressing
    hash of >= 2n buckets (n = entries per chunk), so a call never pays O(S) for few ids."""
    if 2 * touches >= S:
        return S if (S & (S - 1)) != 0 else S + 1
    size = 16
    while size < 2 * n:
        size *= 2
    return size


@njit(cache=True)
def _bucket0(s, size):
    if (size & (size - 1)) != 0:         # direct table
        return s
    return ((s * _HASH_MUL) >> 15) & (size - 1)


@njit(cache=True)
def hash_build(wslot, n, hkey, hhead, htail, enext, used, emult):
    """Chains the valid write entries by slot; returns the number of buckets used.
    ``emult[e]`` = 0 for an entry whose slot the chunk writes once, 1 for the first entry of a
    longer chain, 2 for the later ones (lets a scatter walk the entries in order without the
    bucket tables). ``hkey`` must be all -1 on entry (``hash_clear`` restores that)."""
    size = hkey.shape[0]
    mask = size - 1                      # probing only happens in the power-of-two hash
    nused = 0
    for e in range(n):
        enext[e] = -1
        emult[e] = 0
        s = wslot[e]
        if s < 0:
            continue
        h = _bucket0(s, size)
        while True:
            k = hkey[h]
            if k == s:
                emult[hhead[h]] = 1
                emult[e] = 2
                enext[htail[h]] = e
                htail[h] = e
                break
            if k < 0:
                hkey[h] = s
                hhead[h] = e
                htail[h] = e
                used[nused] = h
                nused += 1
                break
            h = (h + 1) & mask
    return nused


@njit(cache=True)
def hash_find(hkey, s):
    """The bucket of slot s, -1 when the chunk writes no such slot."""
    size = hkey.shape[0]
    mask = size - 1
    h = _bucket0(s, size)
    while True:
        k = hkey[h]
        if k == s:
            return h
        if k < 0:
            return -1
        h = (h + 1) & mask


@njit(cache=True)
def hash_clear(hkey, used, nused):
    for q in range(nused):
        hkey[used[q]] = -1


@njit(cache=True)
def dot(A, ia, ca, Bm, ib, cb, n):
    """A[ia, ca:ca+n]·Bm[ib, cb:cb+n] with 8 interleaved partial sums (a fixed order:
    reproducible, and vectorisable without fastmath). Rows are indexed, never sliced: an
    array view costs two atomic reference-count updates, which two workers contend for."""
    # float32 zeros widen to float64 when the rows are float64 (an int 0 would make every
    # sum float64 and scalar)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0)
    # unsigned column indices: a signed one costs a negative-index fix-up per element, which
    # keeps LLVM from vectorising (measured ~3x on row loops)
    o1, o2, o3, o4 = np.uint64(1), np.uint64(2), np.uint64(3), np.uint64(4)
    o5, o6, o7, o8 = np.uint64(5), np.uint64(6), np.uint64(7), np.uint64(8)
    uca, ucb = np.uint64(ca), np.uint64(cb)
    n8 = np.uint64(n - n % 8)
    for k in range(np.uint64(0), n8, o8):
        ka, kb = uca + k, ucb + k
        s0 += A[ia, ka] * Bm[ib, kb]
        s1 += A[ia, ka + o1] * Bm[ib, kb + o1]
        s2 += A[ia, ka + o2] * Bm[ib, kb + o2]
        s3 += A[ia, ka + o3] * Bm[ib, kb + o3]
        s4 += A[ia, ka + o4] * Bm[ib, kb + o4]
        s5 += A[ia, ka + o5] * Bm[ib, kb + o5]
        s6 += A[ia, ka + o6] * Bm[ib, kb + o6]
        s7 += A[ia, ka + o7] * Bm[ib, kb + o7]
    for k in range(n8, np.uint64(n)):
        s0 += A[ia, uca + k] * Bm[ib, ucb + k]
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@njit(cache=True)
def gather_writes(idx, wts, bank, fmt, b, p, t0, L, W, S, row0, c0, hd, slot, wt, R, X, cv,
                  keep=True):
    """slot/wt of the chunk's write entries, R[e] = M0[slot] and X_t = Σ_w a_{t,w} R[e]
    (zeros for a skipped id). ``cv`` is a (u32 [1, hd], its float32 view) pair of scratch
    rows for 16-bit banks. Returns the number of ids outside [0, S). ``keep=False`` (native
    banks only) skips storing R: the forward's scatter then reads M0 from the bank itself."""
    uhd = np.uint64(hd)
    uc0 = np.uint64(c0)
    bad = 0
    for t in range(L):
        prefetch_token_rows(bank, idx, b, t0 + t + PREFETCH_TOKENS, p, W, S, row0, c0, hd, 0)
        for k in range(uhd):
            X[t, k] = 0
        for w in range(W):
            e = t * W + w
            s = idx[b, t0 + t, p, w]
            if s < 0 or s >= S:
                bad += 1
                slot[e] = -1
                wt[e] = 0
                if keep:
                    for k in range(uhd):
                        R[e, k] = 0
                continue
            slot[e] = s
            aw = wts[b, t0 + t, p, w]
            wt[e] = aw
            if fmt == FMT_NATIVE and not keep:
                for k in range(uhd):
                    X[t, k] += aw * bank[row0 + s, uc0 + k]
            elif fmt == FMT_NATIVE:
                for k in range(uhd):
                    x = bank[row0 + s, uc0 + k]
                    R[e, k] = x
                    X[t, k] += aw * x
            else:
                load_row(bank, row0 + s, c0, hd, fmt, R, e, cv[0], cv[1])
                for k in range(uhd):
                    X[t, k] += aw * R[e, k]
    return bad


@njit(cache=True)
def gather_reads(idx, wts, bank, fmt, b, p, t0, T, L, W, S, row0, c0, hd, slot, wt, Y, dr, dc,
                 tmp, cv):
    """slot/wt of the chunk's read entries; then either Y_t = Σ_w c_{t,w} M0[j] (forward, when
    Y has rows) or dc[e] = dr_t·M0[j] (backward; dr is [B*T, D])."""
    uhd = np.uint64(hd)
    uc0 = np.uint64(c0)
    bad = 0
    fwd = Y.shape[0] > 0
    for t in range(L):
        prefetch_token_rows(bank, idx, b, t0 + t + PREFETCH_TOKENS, p, W, S, row0, c0, hd, 0)
        if fwd:
            for k in range(uhd):
                Y[t, k] = 0
        for w in range(W):
            e = t * W + w
            s = idx[b, t0 + t, p, w]
            if s < 0 or s >= S:
                bad += 1
                slot[e] = -1
                wt[e] = 0
                if not fwd:
                    dc[e] = 0
                continue
            slot[e] = s
            cw = wts[b, t0 + t, p, w]
            wt[e] = cw
            if fmt == FMT_NATIVE:
                if fwd:
                    for k in range(uhd):
                        Y[t, k] += cw * bank[row0 + s, uc0 + k]
                else:
                    dc[e] = dot(dr, b * T + t0 + t, c0, bank, row0 + s, c0, hd)
                continue
            load_row(bank, row0 + s, c0, hd, fmt, tmp, 0, cv[0], cv[1])
            if fwd:
                for k in range(uhd):
                    Y[t, k] += cw * tmp[0, k]
            else:
                dc[e] = dot(dr, b * T + t0 + t, c0, tmp, 0, 0, hd)
    return bad


@njit(cache=True)
def build_overlaps(n, W, etok, wa, rslot, rc, hkey, hhead, enext, emult, nused, G, gmark, gcols,
                   gcnt, H, hmark, hcols, hcnt):
    """G[t,τ] (τ<t) and H[t,τ] (τ<=t) of SPEC §3 from the hashed write entries."""
    L = n // W
    for t in range(L):
        gcnt[t] = 0
        hcnt[t] = 0
    for first in range(n):             # chain heads in entry order = the buckets' order
        if emult[first] != 1:
            continue
        ea = enext[first]
        while ea >= 0:                 # pairs (eb before ea) of one slot's chain
            ta = etok[ea]
            eb = first
            while eb != ea:
                tb = etok[eb]
                if tb < ta:
                    if gmark[ta, tb] == 0:
                        gmark[ta, tb] = 1
                        gcols[ta, gcnt[ta]] = tb
                        gcnt[ta] += 1
                        G[ta, tb] = 0
                    G[ta, tb] += wa[ea] * wa[eb]
                eb = enext[eb]
            ea = enext[ea]
    for er in range(n):
        j = rslot[er]
        if j < 0:
            continue
        h = hash_find(hkey, j)
        if h < 0:
            continue
        ts = etok[er]
        e = hhead[h]
        while e >= 0:
            tt = etok[e]
            if tt > ts:
                break                  # chains are in token order
            if hmark[ts, tt] == 0:
                hmark[ts, tt] = 1
                hcols[ts, hcnt[ts]] = tt
                hcnt[ts] += 1
                H[ts, tt] = 0
            H[ts, tt] += rc[er] * wa[e]
            e = enext[e]


@njit(cache=True)
def clear_overlaps(L, gmark, gcols, gcnt, hmark, hcols, hcnt):
    for t in range(L):
        for q in range(gcnt[t]):
            gmark[t, gcols[t, q]] = 0
        for q in range(hcnt[t]):
            hmark[t, hcols[t, q]] = 0
        gcnt[t] = 0
        hcnt[t] = 0


@njit(cache=True)
def substitute(v, beta, b, p, t0, T, L, c0, hd, X, G, gcols, gcnt, E, U):
    """e_t = v_t − X_t − Σ_{τ<t} G[t,τ] u_τ, u_t = β_t e_t (forward substitution of SPEC §3;
    v is [B*T, D]; e is kept for the backward's dβ)."""
    uhd = np.uint64(hd)
    uc0 = np.uint64(c0)
    for t in range(L):
        vr = b * T + t0 + t
        for k in range(uhd):
            E[t, k] = v[vr, uc0 + k] - X[t, k]
        for q in range(gcnt[t]):
            tau = gcols[t, q]
            g = G[t, tau]
            for k in range(uhd):
                E[t, k] -= g * U[tau, k]
        bt = beta[b, t0 + t, p]
        for k in range(uhd):
            U[t, k] = bt * E[t, k]


@njit(cache=True)
def overlap_grads(n, W, etok, wa, rslot, rc, hkey, hhead, enext, emult, nused, dG, dH, da,
                  dc):
    """The dG, dH terms of SPEC §4 step 5: walks the same chains as ``build_overlaps``."""
    for first in range(n):             # chain heads in entry order = the buckets' order
        if emult[first] != 1:
            continue
        ea = enext[first]
        while ea >= 0:
            ta = etok[ea]
            eb = first
            while eb != ea:
                tb = etok[eb]
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
        ts = etok[er]
        e = hhead[h]
        while e >= 0:
            tt = etok[e]
            if tt > ts:
                break
            d = dH[ts, tt]
            da[e] += d * rc[er]
            dc[er] += d * wa[e]
            e = enext[e]


# ------------------------------------------------------------------- per-worker scratch

@njit(cache=True)
def scratch(Lmax, W, hd, dt, keep=True):
    """Per-worker scratch; ``keep=False`` gives R no rows (the forward without R). R is the
    one large buffer (C·W·hd values, 128 KiB on the benchmark shape): above glibc's default
    mmap threshold, so each allocation was an mmap + page faults + munmap (a TLB shootdown
    across the workers), which made a cold process's 2-thread forward ~3x slower."""
    n = Lmax * W
    return (np.empty(n, np.int64), np.empty(n, dt), np.empty(n, np.int64), np.empty(n, dt),
            np.empty((n if keep else 0, hd), dt), np.empty((Lmax, hd), dt),
            np.empty((Lmax, hd), dt),
            np.empty((Lmax, hd), dt))


@njit(cache=True)
def entry_tokens(n, W):
    """etok[e] = e // W for the entries of a chunk: a load instead of an integer division
    (tens of cycles each) in the per-entry loops."""
    etok = np.empty(n, np.int64)
    for t in range(n // W):
        for w in range(W):
            etok[t * W + w] = t
    return etok


@njit(cache=True)
def hash_scratch(n, S, touches):
    size = hash_size(n, S, touches)
    return (np.full(size, -1, np.int64), np.empty(size, np.int64), np.empty(size, np.int64),
            np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.uint8))


@njit(cache=True)
def overlap_scratch(L, dt):
    return (np.empty((L, L), dt), np.zeros((L, L), np.uint8), np.empty((L, L), np.int64),
            np.zeros(L, np.int64), np.empty((L, L), dt), np.zeros((L, L), np.uint8),
            np.empty((L, L), np.int64), np.zeros(L, np.int64))


@njit(cache=True)
def snapshot_row(b, p, t, w, P, T, W):
    return ((b * P + p) * T + t) * W + w
