"""Per-chunk building blocks of the Numba CPU kernels (SPEC §3), shared by forward and backward.

One worker owns one (b, p) and walks its chunks; everything here acts on that worker's
scratch (``Scratch`` below names the arrays) for one chunk of L tokens starting at t0. Entry
e = t*W + w of a chunk is the address (t0+t, w); write entries carry slot ``wslot[e]`` and
weight ``wa[e]``, read entries ``rslot[e]`` and ``rc[e]``. An id outside [0, S) becomes slot -1
with weight 0: it matches nothing, is never gathered or scattered, and is counted.

Overlaps (G, H) come from the write entries sorted by slot (a stable argsort, so sums run in a
fixed order): entries of one slot form a run, G pairs up the entries of each run, and a read
entry finds its run by binary search. The cost is the number of matching pairs, not C²W².
G and H are kept as dense L×L matrices plus, per row, the list of columns that are set
(``gcols[t, :gcnt[t]]``), so that substitutions touch only the nonzeros and clearing after the
chunk costs what filling did.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cpu_formats import load_row


@njit(cache=True)
def lower_bound(a, n, x):
    """First k in [0, n) with a[k] >= x (a sorted ascending), n when none."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def gather_entries(idx, wts, bank, fmt, b, p, t0, L, W, S, row0, c0, hd, slot, wt, rows,
                   u32, f32v):
    """slot/wt of the chunk's entries from idx/wts [B, T, P, W]; rows[e] = M0[slot] (zeros for
    a skipped id) when ``rows`` has any rows. Returns the number of ids outside [0, S)."""
    bad = 0
    keep = rows.shape[0] > 0
    for t in range(L):
        for w in range(W):
            e = t * W + w
            s = idx[b, t0 + t, p, w]
            if s < 0 or s >= S:
                bad += 1
                slot[e] = -1
                wt[e] = 0.0
                if keep:
                    rows[e, :hd] = 0.0
                continue
            slot[e] = s
            wt[e] = wts[b, t0 + t, p, w]
            if keep:
                load_row(bank, row0 + s, c0, hd, fmt, rows[e], u32, f32v)
    return bad


@njit(cache=True)
def sort_slots(wslot, n, order, sslot):
    """order[:n] = stable argsort of wslot[:n]; sslot[k] = wslot[order[k]]."""
    o = np.argsort(wslot[:n], kind="mergesort")
    for k in range(n):
        order[k] = o[k]
        sslot[k] = wslot[o[k]]


@njit(cache=True)
def build_overlaps(n, W, wa, rslot, rc, order, sslot, G, gmark, gcols, gcnt, H, hmark, hcols,
                   hcnt):
    """G[t,τ] (τ<t) and H[t,τ] (τ<=t) of SPEC §3 from the sorted write entries."""
    L = n // W
    for t in range(L):
        gcnt[t] = 0
        hcnt[t] = 0
    k0 = 0
    while k0 < n:
        s = sslot[k0]
        k1 = k0 + 1
        while k1 < n and sslot[k1] == s:
            k1 += 1
        if s >= 0 and k1 - k0 > 1:
            for ka in range(k0, k1):
                ea = order[ka]
                ta = ea // W
                for kb in range(k0, k1):
                    eb = order[kb]
                    tb = eb // W
                    if tb < ta:
                        if gmark[ta, tb] == 0:
                            gmark[ta, tb] = 1
                            gcols[ta, gcnt[ta]] = tb
                            gcnt[ta] += 1
                            G[ta, tb] = 0.0
                        G[ta, tb] += wa[ea] * wa[eb]
        k0 = k1
    for er in range(n):
        j = rslot[er]
        if j < 0:
            continue
        ts = er // W
        k = lower_bound(sslot, n, j)
        while k < n and sslot[k] == j:
            e = order[k]
            tt = e // W
            if tt <= ts:
                if hmark[ts, tt] == 0:
                    hmark[ts, tt] = 1
                    hcols[ts, hcnt[ts]] = tt
                    hcnt[ts] += 1
                    H[ts, tt] = 0.0
                H[ts, tt] += rc[er] * wa[e]
            k += 1


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
def substitute(v, beta, b, p, t0, L, W, c0, hd, wa, R, G, gcols, gcnt, X, E, U):
    """X_t = k_t·M0, e_t = v_t − X_t − Σ_{τ<t} G[t,τ] u_τ, u_t = β_t e_t (forward
    substitution of SPEC §3; e is kept for the backward's dβ)."""
    for t in range(L):
        X[t, :hd] = 0.0
        for w in range(W):
            e = t * W + w
            aw = wa[e]
            if aw != 0.0:
                for k in range(hd):
                    X[t, k] += aw * R[e, k]
        for k in range(hd):
            E[t, k] = v[b, t0 + t, c0 + k] - X[t, k]
        for q in range(gcnt[t]):
            tau = gcols[t, q]
            g = G[t, tau]
            for k in range(hd):
                E[t, k] -= g * U[tau, k]
        bt = beta[b, t0 + t, p]
        for k in range(hd):
            U[t, k] = bt * E[t, k]
