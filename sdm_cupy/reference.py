"""The float64 reference: SPEC §2's recurrence, token by token, and its backward.

Deliberately plain (loops over batch, head and token; NumPy row operations) so that it is
obviously right. Every backend is tested against it, and it is tested against finite
differences (tests/test_reference.py). Inputs may be NumPy or CuPy arrays of any float dtype;
everything is computed in float64 NumPy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["forward", "backward"]


def _np64(x):
    if hasattr(x, "get"):
        x = x.get()
    x = np.asarray(x)
    return x if x.dtype.kind in "iub" else x.astype(np.float64)   # bfloat16 has kind "V"


def _heads(bank, B, S, P):
    """[B*S, D] -> [B, P, S, hd] float64 copy."""
    D = bank.shape[1]
    return _np64(bank).reshape(B, S, P, D // P).transpose(0, 2, 1, 3).copy()


def _unheads(M):
    B, P, S, hd = M.shape
    return M.transpose(0, 2, 1, 3).reshape(B * S, P * hd)


def forward(bank, write_idx, write_w, values, beta, read_idx, read_w, num_memory_slots, num_parallel):
    """Returns (readings [B, T, D], final bank [B*S, D]), both float64 NumPy."""
    wi, ri = np.asarray(_np64(write_idx)), np.asarray(_np64(read_idx))
    a, c, v, be = _np64(write_w), _np64(read_w), _np64(values), _np64(beta)
    B, T, P, W = wi.shape
    S = num_memory_slots
    M = _heads(bank, B, S, P)
    hd = M.shape[-1]
    v = v.reshape(B, T, P, hd)
    r = np.zeros((B, T, P, hd))
    for b in range(B):
        for p in range(P):
            m = M[b, p]
            for t in range(T):
                i, j = wi[b, t, p], ri[b, t, p]
                pred = a[b, t, p] @ m[i]                          # k_t . M
                e = v[b, t, p] - pred
                np.add.at(m, i, be[b, t, p] * a[b, t, p][:, None] * e[None, :])
                r[b, t, p] = c[b, t, p] @ m[j]                    # read after the write
    return r.reshape(B, T, P * hd), _unheads(M)


def backward(bank, write_idx, write_w, values, beta, read_idx, read_w, num_memory_slots,
             num_parallel, grad_readings, grad_bank=None):
    """Gradients (bank, write_w, values, beta, read_w) of <readings, grad_readings> +
    <final bank, grad_bank>, float64 NumPy, by reverse-mode through the recurrence."""
    wi, ri = np.asarray(_np64(write_idx)), np.asarray(_np64(read_idx))
    a, c, v, be = _np64(write_w), _np64(read_w), _np64(values), _np64(beta)
    B, T, P, W = wi.shape
    S = num_memory_slots
    M = _heads(bank, B, S, P)
    hd = M.shape[-1]
    v = v.reshape(B, T, P, hd)
    dr = _np64(grad_readings).reshape(B, T, P, hd)
    dM = np.zeros_like(M) if grad_bank is None else _heads(grad_bank, B, S, P)
    da, dc = np.zeros_like(a), np.zeros_like(c)
    dv, dbe = np.zeros_like(v), np.zeros_like(be)
    for b in range(B):
        for p in range(P):
            m, g = M[b, p], dM[b, p]
            # forward again, keeping each token's error e_t and the bank before it
            history = []
            for t in range(T):
                i = wi[b, t, p]
                history.append(m.copy())
                e = v[b, t, p] - a[b, t, p] @ m[i]
                np.add.at(m, i, be[b, t, p] * a[b, t, p][:, None] * e[None, :])
            for t in reversed(range(T)):
                i, j = wi[b, t, p], ri[b, t, p]
                at, ct, bt = a[b, t, p], c[b, t, p], be[b, t, p]
                m_after = m
                m_before = history[t]
                # r_t = sum_w c_w M_t[j_w]
                dc[b, t, p] = m_after[j] @ dr[b, t, p]
                np.add.at(g, j, ct[:, None] * dr[b, t, p][None, :])
                # M_t = M_{t-1} + beta k e^T,  e = v - k^T M_{t-1}
                e = v[b, t, p] - at @ m_before[i]
                kg = at @ g[i]                                     # k^T dM  (hd)
                dbe[b, t, p] = kg @ e
                de = bt * kg
                dv[b, t, p] = de
                # dk from the outer product (beta dM e) and from e (-M_{t-1} de)
                da[b, t, p] = bt * (g[i] @ e) - m_before[i] @ de
                np.add.at(g, i, -at[:, None] * de[None, :])
                m = m_before
            M[b, p] = m
    return (_unheads(dM), da, dv.reshape(B, T, P * hd), dbe, dc)
