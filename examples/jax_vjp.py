"""The SDM op under ``jax.custom_vjp``, checked against ``jax.grad`` of a JAX recurrence.

Forward and backward are ``jax.experimental.buffer_callback`` calls (experimental in JAX;
checked with jax 0.10.2; it has no autodiff of its own, hence the ``custom_vjp``). XLA hands
the callback its buffers: the inputs (read-only) and the outputs, which the callback fills in
place. ``sdm.from_dlpack`` views them
without a copy — NumPy on the CPU, CuPy on the GPU, bfloat16 included — and on the GPU the op
runs on XLA's own stream (``ctx.stream``, through ``sdm.external_stream``), so the data
never goes through the host. The only copies are the op's results into XLA's output buffers
(``sdm.forward`` allocates its own outputs).

Residuals: the forward keeps the op's *inputs* (JAX arrays, immutable) and the backward
callback runs ``sdm.forward`` again with ``needs_backward=True`` before ``sdm.backward``: a
Python ``SavedState`` cannot live in a traced, jit-compiled function. The backward therefore
costs one extra forward (the recompute-instead-of-store trade the op makes inside a chunk too).

Never write into a buffer or array that came from JAX other than the callback's outputs (JAX
arrays are immutable; CuPy ignores DLPack's read-only flag). On the GPU the callbacks pass
``check_indices=False`` (the range check is a host sync on XLA's stream): out-of-range ids are
skipped by the kernels and reported by ``sdm.check_device_errors()``.

GPU status: the GPU path follows jax.experimental.buffer_callback's documented contract
(``ctx.stream``; ``Buffer`` with ``__dlpack__``/``__cuda_array_interface__``) and is run by the
GPU test session; ``command_buffer_compatible`` stays False (the op allocates its outputs and
scratch from CuPy's pool on every call, which a replayed command buffer would not redo).

    python examples/jax_vjp.py      # exits 1 if a gradient differs from jax.grad's
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

# JAX preallocates 75% of GPU memory at its first GPU use; CuPy needs its share for the op.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.buffer_callback import buffer_callback  # noqa: E402

import sdm_cupy as sdm  # noqa: E402

jax.config.update("jax_enable_x64", True)   # float64 stays float64 through DLPack


_KDL_CUDA = 2


def _on_gpu(buffer) -> bool:
    return int(buffer.__dlpack_device__()[0]) == _KDL_CUDA


def _on_stream(ctx, on_gpu: bool):
    """CuPy on XLA's stream (GPU); ``ctx.stream`` raises on the CPU, so only touch it there."""
    if not on_gpu:
        return contextlib.nullcontext()
    return sdm.external_stream(int(ctx.stream))


def _fill(out_buffer, value):
    """Copies the op's result into an XLA output buffer (writable by contract)."""
    view = sdm.from_dlpack(out_buffer)
    view[...] = value.astype(view.dtype, copy=False)


def _forward_call(config: sdm.SDMConfig, shapes):
    bank, _, _, values, *_ = shapes
    B, T, D = values.shape
    out = (jax.ShapeDtypeStruct((B, T, D), values.dtype),
           jax.ShapeDtypeStruct(bank.shape, bank.dtype))

    def callback(ctx, outs, *args):
        gpu = _on_gpu(args[0])
        with _on_stream(ctx, gpu):
            res = sdm.forward(*[sdm.from_dlpack(a) for a in args], config,
                              needs_backward=False, check_indices=not gpu)
            _fill(outs[0], res.readings)
            _fill(outs[1], res.bank)
    return buffer_callback(callback, out)


def _backward_call(config: sdm.SDMConfig, shapes):
    bank, _, write_w, values, beta, _, read_w = shapes
    out = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype)
                for s in (bank, write_w, values, beta, read_w))

    def callback(ctx, outs, *args):
        gpu = _on_gpu(args[0])
        with _on_stream(ctx, gpu):
            *inputs, dr, dM = [sdm.from_dlpack(a) for a in args]
            res = sdm.forward(*inputs, config, needs_backward=True,
                              check_indices=not gpu)   # recompute (see the module docstring)
            g = sdm.backward(res.saved, dr, dM)
            for o, x in zip(outs, (g.bank, g.write_w, g.values, g.beta, g.read_w)):
                _fill(o, x)
    return buffer_callback(callback, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def sdm_op(bank, write_idx, write_w, values, beta, read_idx, read_w, config):
    """(readings [B, T, D], final bank [B*S, D]) of SPEC §2, differentiable w.r.t. bank,
    write_w, values, beta and read_w. ``config`` is static (an ``sdm.SDMConfig``)."""
    args = (bank, write_idx, write_w, values, beta, read_idx, read_w)
    return _forward_call(config, args)(*args)


def _sdm_op_fwd(bank, write_idx, write_w, values, beta, read_idx, read_w, config):
    args = (bank, write_idx, write_w, values, beta, read_idx, read_w)
    return _forward_call(config, args)(*args), args


def _sdm_op_bwd(config, args, cotangents):
    dr, dM = cotangents
    g_bank, g_ww, g_v, g_beta, g_rw = _backward_call(config, args)(
        *args, dr.astype(args[3].dtype), dM)
    return g_bank, None, g_ww, g_v, g_beta, None, g_rw


sdm_op.defvjp(_sdm_op_fwd, _sdm_op_bwd)


def jax_recurrence(bank, write_idx, write_w, values, beta, read_idx, read_w, S, P):
    """SPEC §2 in jax.numpy (``lax.scan`` over tokens, batch and heads vectorised)."""
    B, T, _, W = write_idx.shape
    D = bank.shape[1]
    hd = D // P
    M0 = bank.reshape(B, S, P, hd).transpose(0, 2, 1, 3)            # [B, P, S, hd]
    bi = jnp.arange(B)[:, None, None]
    pi = jnp.arange(P)[None, :, None]

    def step(M, tok):
        i, a, v, be, j, c = tok                                     # [B, P, W] ..., v [B, P, hd]
        pred = jnp.sum(a[..., None] * M[bi, pi, i], axis=2)         # k_t . M
        M = M.at[bi, pi, i].add(be[..., None, None] * a[..., None] * (v - pred)[:, :, None])
        return M, jnp.sum(c[..., None] * M[bi, pi, j], axis=2)      # read after the write

    toks = (write_idx, write_w, values.reshape(B, T, P, hd), beta, read_idx, read_w)
    M, r = jax.lax.scan(step, M0, tuple(jnp.moveaxis(x, 1, 0) for x in toks))
    return jnp.moveaxis(r, 0, 1).reshape(B, T, D), M.transpose(0, 2, 1, 3).reshape(B * S, D)


def make_inputs(rng, dtype, B=2, T=23, P=2, hd=8, S=16, W=3):
    """Random inputs of SPEC §1 (NumPy's generator: no per-op XLA compiles)."""
    D = P * hd
    as_j = lambda x: jnp.asarray(x).astype(dtype)                      # noqa: E731
    idx = lambda: jnp.asarray(rng.integers(0, S, (B, T, P, W)), jnp.int32)  # noqa: E731
    return dict(bank=as_j(rng.normal(size=(B * S, D))), write_idx=idx(),
                write_w=as_j(rng.uniform(-0.6, 0.6, (B, T, P, W))),
                values=as_j(rng.normal(size=(B, T, D))),
                beta=as_j(rng.uniform(0.1, 0.9, (B, T, P))), read_idx=idx(),
                read_w=as_j(rng.normal(size=(B, T, P, W)))), S, P


def check(dtype=jnp.float64, tol=1e-10, chunk_size=8, device=None) -> bool:
    """jax.grad of <readings, dr> + <final bank, dM>: sdm_op vs the JAX recurrence."""
    with jax.default_device(device) if device is not None else contextlib.nullcontext():
        rng = np.random.default_rng(0)
        inputs, S, P = make_inputs(rng, dtype)
        cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=chunk_size)
        dr = jnp.asarray(rng.normal(size=inputs["values"].shape)).astype(dtype)
        dM = jnp.asarray(rng.normal(size=inputs["bank"].shape)).astype(dtype)
        names = ("bank", "write_w", "values", "beta", "read_w")

        def loss(fn, bank, write_w, values, beta, read_w):
            r, m = fn(bank, inputs["write_idx"], write_w, values, beta, inputs["read_idx"],
                      read_w)
            return jnp.sum(r * dr) + jnp.sum(m * dM), (r, m)

        op = lambda *a: sdm_op(*a, cfg)                                  # noqa: E731
        ref = lambda *a: jax_recurrence(*a, S, P)                        # noqa: E731
        diff = [inputs[k] for k in names]
        results = [jax.jit(jax.grad(functools.partial(loss, fn), argnums=range(5),
                                    has_aux=True))(*diff) for fn in (op, ref)]
    (g_op, (r_op, m_op)), (g_ref, (r_ref, m_ref)) = results
    pairs = [("readings", r_op, r_ref), ("final bank", m_op, m_ref)]
    pairs += [(f"grad {k}", a, b) for k, a, b in zip(names, g_op, g_ref)]
    ok = True
    where = device.platform if device is not None else jax.default_backend()
    for name, got, want in pairs:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        good = err <= tol and not np.isnan(got).any()
        ok &= bool(good)
        print(f"  [{where} {np.dtype(dtype).name}] {name:12s} rel err {err:.2e} "
              f"{'ok' if good else 'MISMATCH'}")
    return ok


def main() -> int:
    cpu = jax.devices("cpu")[0]
    runs = [check(device=cpu), check(jnp.float32, tol=1e-4, device=cpu)]
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        gpu = None
    if gpu is not None and sdm.gpu_available():
        runs += [check(device=gpu), check(jnp.float32, tol=1e-4, device=gpu)]
    else:
        print("  (no JAX GPU backend with CuPy: CPU only)")
    ok = all(runs)
    print("jax custom_vjp check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
