"""The SDM op as a ``torch.autograd.Function``, checked against torch autograd of the recurrence.

The forward hands torch's tensors to ``sdm.forward`` as NumPy (CPU) or CuPy (CUDA) views
through DLPack, and hands the readings back the same way: no copies at the boundary, no trip
through the host for CUDA tensors. The backward calls ``sdm.backward`` on the state the
forward saved. On CUDA the op runs on torch's current stream (``sdm.external_stream``),
so nothing waits across streams.

One copy is made on purpose: the final bank returned to torch is a copy of ``res.bank``,
because ``sdm.backward`` rewinds ``res.bank`` in place (SPEC §4) and the caller's tensor must
not change under it.

    python examples/torch_autograd.py          # CPU, and CUDA when torch and CuPy see a GPU

Exits 1 if a gradient differs from torch autograd's.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import torch

import sdm_cupy as sdm


def _op_stream(device: torch.device):
    """Run CuPy on torch's current stream (CUDA); nothing to do on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdm.external_stream(torch.cuda.current_stream(device))


def _view(t):
    return sdm.from_dlpack(t.detach())


def _tensor(x):
    return torch.from_dlpack(sdm.to_dlpack(x))


class SDMFunction(torch.autograd.Function):
    """(bank, write_idx, write_w, values, beta, read_idx, read_w, config) -> (readings,
    final_bank). Shapes and dtypes as in SPEC §1; indices get no gradient."""

    @staticmethod
    def forward(ctx, bank, write_idx, write_w, values, beta, read_idx, read_w, config):
        with _op_stream(bank.device):
            args = [_view(t) for t in (bank, write_idx, write_w, values, beta, read_idx, read_w)]
            res = sdm.forward(*args, config, needs_backward=True)
            readings = _tensor(res.readings)
            final_bank = _tensor(res.bank.copy())   # res.bank is rewound by backward
        ctx.saved = res.saved
        ctx.dtypes = (bank.dtype, write_w.dtype, values.dtype, beta.dtype, read_w.dtype)
        ctx.set_materialize_grads(False)            # an unused final bank costs nothing
        return readings, final_bank

    @staticmethod
    def backward(ctx, d_readings, d_bank):
        saved, ctx.saved = ctx.saved, None          # sdm.backward consumes it
        if d_readings is None:
            d_readings = torch.zeros(saved.layout.B, saved.layout.T, saved.layout.D,
                                     dtype=ctx.dtypes[2], device=d_bank.device)
        with _op_stream(d_readings.device):
            dr = _view(d_readings.contiguous())
            dM = None if d_bank is None else _view(d_bank.contiguous())
            g = sdm.backward(saved, dr, dM)
            grads = [_tensor(x).to(dt) for x, dt in
                     zip((g.bank, g.write_w, g.values, g.beta, g.read_w), ctx.dtypes)]
        d_bank0, d_ww, d_v, d_beta, d_rw = grads
        return d_bank0, None, d_ww, d_v, d_beta, None, d_rw, None


def sdm_op(bank, write_idx, write_w, values, beta, read_idx, read_w, config):
    """``SDMFunction.apply``: returns (readings [B, T, D], final bank [B*S, D])."""
    return SDMFunction.apply(bank, write_idx, write_w, values, beta, read_idx, read_w, config)


def torch_recurrence(bank, write_idx, write_w, values, beta, read_idx, read_w, S, P):
    """SPEC §2 in plain torch ops (autograd differentiates it), over batch and heads at once."""
    B, T, _, W = write_idx.shape
    D = bank.shape[1]
    hd = D // P
    M = bank.reshape(B, S, P, hd).permute(0, 2, 1, 3)             # [B, P, S, hd]
    v = values.reshape(B, T, P, hd)
    out = []
    for t in range(T):
        i = write_idx[:, t].long()[..., None].expand(B, P, W, hd)
        j = read_idx[:, t].long()[..., None].expand(B, P, W, hd)
        a, c = write_w[:, t][..., None], read_w[:, t][..., None]    # [B, P, W, 1]
        pred = (a * M.gather(2, i)).sum(2)                         # k_t . M
        e = v[:, t] - pred
        M = M.scatter_add(2, i, beta[:, t][..., None, None] * a * e[:, :, None, :])
        out.append((c * M.gather(2, j)).sum(2))                    # read after the write
    readings = torch.stack(out, 1).reshape(B, T, D)
    return readings, M.permute(0, 2, 1, 3).reshape(B * S, D)


def make_inputs(gen, device, dtype, B=2, T=23, P=2, hd=8, S=16, W=3):
    def rand(*shape, lo=None, hi=None):
        x = torch.rand(*shape, generator=gen, dtype=torch.float64) if lo is not None else \
            torch.randn(*shape, generator=gen, dtype=torch.float64)
        if lo is not None:
            x = lo + (hi - lo) * x
        return x.to(device=device, dtype=dtype)
    D = P * hd
    idx = lambda: torch.randint(0, S, (B, T, P, W), generator=gen).to(device)  # noqa: E731
    return dict(bank=rand(B * S, D), write_idx=idx(), write_w=rand(B, T, P, W, lo=-0.6, hi=0.6),
                values=rand(B, T, D), beta=rand(B, T, P, lo=0.1, hi=0.9), read_idx=idx(),
                read_w=rand(B, T, P, W)), S, P


def check(device: str, dtype=torch.float64, tol=1e-10, chunk_size=8) -> bool:
    """Gradients of <readings, dr> + <final bank, dM> from SDMFunction vs torch autograd."""
    gen = torch.Generator().manual_seed(0)
    inputs, S, P = make_inputs(gen, device, dtype)
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=chunk_size)
    diff = ("bank", "write_w", "values", "beta", "read_w")
    results = []
    for fn in (lambda **kw: sdm_op(**kw, config=cfg),
               lambda **kw: torch_recurrence(**kw, S=S, P=P)):
        leaves = {k: (v.clone().requires_grad_(k in diff)) for k, v in inputs.items()}
        readings, final = fn(**leaves)
        results.append((readings, final, leaves))
    dr = torch.randn(results[0][0].shape, generator=gen, dtype=torch.float64).to(device, dtype)
    dM = torch.randn(results[0][1].shape, generator=gen, dtype=torch.float64).to(device, dtype)
    ok = True
    for readings, final, leaves in results:
        ((readings * dr).sum() + (final * dM).sum()).backward()
    (r_op, f_op, g_op), (r_ref, f_ref, g_ref) = results
    pairs = [("readings", r_op, r_ref), ("final bank", f_op, f_ref)]
    pairs += [(f"grad {k}", g_op[k].grad, g_ref[k].grad) for k in diff]
    for name, got, want in pairs:
        got, want = got.detach().double(), want.detach().double()
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        good = err <= tol and not torch.isnan(got).any()
        ok &= bool(good)
        print(f"  [{device} {str(dtype).split('.')[-1]}] {name:12s} rel err {err:.2e} "
              f"{'ok' if good else 'MISMATCH'}")
    return ok


def main() -> int:
    runs = [check("cpu"), check("cpu", torch.float32, tol=1e-4)]
    if torch.cuda.is_available() and sdm.gpu_available():
        runs += [check("cuda"), check("cuda", torch.float32, tol=1e-4)]
    else:
        print("  (no CUDA device: CPU only)")
    ok = all(runs)
    print("torch autograd check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
