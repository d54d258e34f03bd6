"""The Numba CPU backend of sdm_cupy (contract: docs/BACKEND_CONTRACT.md).

Kernels and the SPEC steps they implement
-----------------------------------------
``sdm_fwd_seq_kernel`` (``cpu_fwd``, SPEC §2), the forward of float32/float64 banks: the
recurrence itself, token by token, with no G, H or substitution. Blocks of (b, group of heads),
run on ``cpu_threads``' threads (see Threads below): one group holds all P heads of b unless the
B blocks do not split evenly over the threads (``_groups``). A worker owns its heads' S×hd
blocks, so it needs no atomics, and per token it runs each phase over all heads of the group:
pred_t = k_t·M (the W rows summed 8 at a time per pass over the columns, in w order), u_t =
β_t(v_t − pred_t) and the scatter M[i] += a u_t in w order, then r_t = q_t·M. With snapshots,
each chunk of C tokens first copies the rows its write entries will change (the bank holds M0
then: exactly the rows of step 1 below, so the backward is the same); without
(``needs_backward=False``) there is no snapshot work at all. Rows of token t+2 are prefetched
(``PREFETCH_SEQ``, to L2: ``PREFETCH_LOC``). On a CPU the chunked form costs more than it saves:
one worker walks the tokens of a head in order anyway, and the recurrence touches each row while
it is hot (the scatter hits rows just gathered) with no slot table or overlap matrices (SPEC
§3's chunk is for parallel tokens; §2 says C changes results only by rounding). It is bitwise
the same with and without snapshots and for every snapshot mode.

``sdm_fwd_kernel`` (``cpu_fwd``, SPEC §3), the chunked forward, used for 16-bit banks (it
rounds each written row once per chunk, not once per token). Blocks of the B·P (batch,
head) pairs, on the same threads; the worker of a head owns its S×hd block (bank columns
p*hd:(p+1)*hd, rows b*S:(b+1)*S) and walks the chunks in order, so its scatters need no
atomics. Per chunk of L <= C tokens starting at t0 (n = L·W entries; the helpers live in
``cpu_chunk``):

1. ``gather_writes``: reads a, i and each row M0[i_{t,w}] once into ``R`` (n rows of hd, compute
   dtype) and forms X_t = k_t·M0 in the same pass. Those rows are the snapshot, stored per
   (b, p, t, w) in ``snapshot[B, P, T, W, hd]`` (the bank's own bits for
   ``snapshot_quant=None``, else ``cpu_formats.quantize_row``, with ``scales[B, P, T, W]`` for
   fp8/int8). Only the T real tokens are stored.
   Reads: write ids/weights, bank rows. Writes: R, X, snapshots.
2. ``gather_reads``: Y_t = q_t·M0 = Σ_w c_{t,w} M0[j_{t,w}]. Reads: read ids/weights, bank rows.
3. ``hash_build`` + ``build_overlaps``: G[t,τ] = k_t·k_τ (τ<t) and H[t,τ] = q_t·k_τ (τ<=t) from a
   small hash of the chunk's write slots (cost: the matching pairs, not C²W²).
4. ``substitute``: e_t = v_t − X_t − Σ_{τ<t} G[t,τ] u_τ, u_t = β_t e_t. Reads v, β.
5. r_t = Y_t + Σ_{τ<=t} H[t,τ] u_τ. Writes ``readings[b, t, p*hd:(p+1)*hd]``.
6. M_end = M0 + Σ_t k_t u_tᵀ: each written slot's row is summed in the compute dtype from R and
   stored to the bank once (one rounding per row for 16-bit banks). Writes bank rows.

``sdm_bwd_kernel`` (``cpu_bwd``, SPEC §4), same workers, chunks last to first, dM (the grad-bank
accumulator, compute dtype) as it is at the chunk's end:

1. Rewind: the snapshot rows are written back into the bank (M[i_{t,w}] <- snapshot), then
   steps 1-4 above run again on the rewound bank (recompute instead of store), without Y;
   ``gather_reads`` forms dc_{t,w} = dr_t·M0[j_{t,w}] instead. Reads snapshots, writes bank rows.
2. du_t = Σ_{s>=t} H[s,t] dr_s + Σ_w a_{t,w} dM[i_{t,w}]  (dM rows gathered once into ``DR``).
3. z = (I + diag(β) tril(G,−1))⁻ᵀ du by back substitution, in place in ``Z``.
4. dv_t = β_t z_t, dβ_t = z_t·e_t, dX_t = −β_t z_t, dG[t,τ] = −β_t z_t·u_τ, dH[t,τ] = dr_t·u_τ
   (only where G, H have entries). Writes dv, dβ.
5. da from u_t·dM[i], dX_t·M0[i] and the slot chains (dG, dH, ``overlap_grads``); dc += the dH
   terms. Writes da, dc.
6. dM[i_{t,w}] += a_{t,w} dX_t, dM[j_{t,w}] += c_{t,w} dr_t (after 2 and 5 read the old dM).

Speed: the kernels are bound by rows gathered at random slots (most of them cold in cache:
on the benchmark shape the 16 MiB bank does not stay cached between touches, and a head's
256-B pieces 1 KiB apart use a quarter of the L2's sets);
``cpu_prefetch`` requests the rows of token t+2 while token t is processed. Hot loops index
rows (``A[i, k]``) instead of slicing them: every array view costs atomic reference-count
updates, which the two workers then fight over. The column index of every row loop is
unsigned (``for k in range(uhd)``, ``A[i, uc0 + k]`` with ``uhd, uc0 = np.uint64(...)``): Numba
fixes up negative signed indices element by element, which kept LLVM from vectorising these
loops (the forward went from ~11 to ~6 ms on the benchmark shape; results are bitwise the
same). Mixing uint64 with int64 makes Numba compute in float64: keep both operands unsigned.
Per-entry token numbers come from a table (``etok[e] = e // W``), not integer divisions. The
forward does not copy gathered rows into ``R`` when nothing needs them (native bank, exact or
no snapshots): its scatter then adds to the bank rows, which hold M0 until then. A per-head
contiguous copy of the S×hd block (gathers from L2) was measured slower: copying the block in
and out costs more than it saves. Dot products use eight fixed partial sums
(``cpu_chunk.dot``): vectorisable without fastmath and bitwise reproducible. Memory per worker:
O(C·W·hd + C²) scratch; C is capped at ``CHUNK_CAP`` (a speed knob only, SPEC §2). The
snapshots carry the forward's C (``kernels.saved.SavedSnapshots``) and the backward walks it,
so a cap changed in between cannot make it rewind to other chunks' rows. Column
tiles inside a head are not used: B·P workers already fill a small CPU.

Formats: 16-bit banks reach the kernels as uint16 bits plus a format code (``cpu_formats``);
values, dr and weights are handed over in the compute dtype (float32, float64 for float64 calls),
so each kernel compiles for at most (bank storage: f64/f32/u16) × (compute: f32/f64) types. A
16-bit grad bank (``grad_bank_fp32=False``) is accumulated in float32 and rounded once at the
end. Bank rows of a float16/bfloat16 bank are rounded from the compute dtype with RNE (from
float64 through float32 when the values are float64: double rounding in that rare mix).

Safety: Numba does no bounds checks. Every slot id is tested against [0, S) before it is used;
an id outside is skipped (weight 0) and counted (ids are int32 or int64, as given), and the host wrapper raises ValueError after
the kernel (``check_indices=False`` in the API skips the up-front check, never this one).
Threads (``cpu_threads``): up to 2 threads (``numba.get_num_threads()``) the blocks run on the
calling thread and a pool of Python threads, calling kernels compiled ``nogil=True``; with
more, on a ``prange`` wrapper of the same kernels, which Numba compiles per argument types at
about half the kernel's cost again (the pool's threads each take the GIL to start, which costs
too much at 16). Calls run one at a time under ``_LOCK``: Numba's default workqueue threading
layer is not safe when several Python threads launch parallel functions at once, and two
calls at once would oversubscribe the cores anyway.
"""

from __future__ import annotations

import threading

import ml_dtypes
import numba
import numpy as np

from .cpu_bwd import sdm_bwd_kernel
from .cpu_formats import FMT_BF16, FMT_F16, FMT_NATIVE, SNAP_CODES, SNAP_EXACT, SNAP_OFF
from .cpu_fwd import sdm_fwd_kernel, sdm_fwd_seq_kernel
from . import cpu_cache
from .saved import SavedSnapshots

# Kernels load their on-disk cache at their first call, so this still comes first.
cpu_cache.drop_stale()

__all__ = ["check_config", "sdm_fwd", "sdm_bwd", "expand_memory_batch", "sum_memory_batch",
           "sdm_fwd_kernel", "sdm_fwd_seq_kernel", "sdm_bwd_kernel", "CHUNK_CAP"]

#: Chunks longer than this are split: the per-worker L×L overlap matrices stay small.
CHUNK_CAP = 256

#: Which forward kernel runs. "auto": 32/64-bit banks run the recurrence of SPEC §2 token by
#: token (``sdm_fwd_seq_kernel``: faster on a CPU, see the module docstring), 16-bit banks the
#: chunked form of §3 (``sdm_fwd_kernel``). "chunked": every bank dtype runs §3's chunked
#: kernel. Both give the same results up to rounding and the same snapshots to the backward.
FORWARD = "auto"

_LOCK = threading.Lock()
_BF16 = np.dtype(ml_dtypes.bfloat16)
_SNAP_VIEW = {"bf16": _BF16, "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
              "int8": np.dtype(np.int8)}


# ------------------------------------------------------------------------------- host side

# ---- reused snapshot buffers -----------------------------------------------------------------
# A forward that saves snapshots fills B*T*P*W*hd fresh elements. Fresh memory of that size is
# a new mapping whose pages the OS zeroes at first touch, inside the kernel; with NumPy's
# huge-page advice that can cost several times the forward itself (benchmarks/RESULTS.md,
# `benchmarks/cpu_snapshot_memory.py`). The backward is the snapshots' last reader, so
# ``sdm_cupy.backward`` hands them back here (only when nothing else can refer to them: see
# ``SavedState``) and the next forward of the same shape takes them instead of new memory.
SPARE_BYTES = 1 << 30       # at most this many bytes of snapshot buffers wait for reuse
_spare: dict = {}           # (shape, dtype) -> [arrays]; insertion order = age
_spare_lock = threading.Lock()


def _snapshot_empty(shape, dtype):
    key = (tuple(shape), np.dtype(dtype))
    with _spare_lock:
        arrays = _spare.get(key)
        if arrays:
            a = arrays.pop()
            if not arrays:
                del _spare[key]
            return a
    return np.empty(shape, dtype)


def recycle_snapshots(snapshots) -> None:
    """Keeps a consumed forward's snapshot buffers (rows, scales) for the next forward of the
    same shape, dropping the oldest beyond ``SPARE_BYTES``. The caller guarantees that no one
    else refers to them."""
    with _spare_lock:
        for a in snapshots:
            if a is None or a.base is not None or a.nbytes > SPARE_BYTES:
                continue
            _spare.setdefault((a.shape, a.dtype), []).append(a)
        total = sum(a.nbytes for arrays in _spare.values() for a in arrays)
        while total > SPARE_BYTES:
            key = next(iter(_spare))
            total -= _spare[key].pop(0).nbytes
            if not _spare[key]:
                del _spare[key]


def release_spare_buffers() -> int:
    """Frees the snapshot buffers kept for reuse; returns the bytes released."""
    with _spare_lock:
        n = sum(a.nbytes for arrays in _spare.values() for a in arrays)
        _spare.clear()
    return n


def _storage(x):
    """(array the kernels take, format code): 16-bit floats travel as uint16 bits."""
    if x.dtype == np.float16:
        return x.view(np.uint16), FMT_F16
    if x.dtype == _BF16:
        return x.view(np.uint16), FMT_BF16
    return x, FMT_NATIVE


def _blocks(heads: int) -> int:
    """Blocks of heads for the threads: a few per thread (balance) but not one per head (each
    block allocates its scratch once: decode calls have many heads and little work each)."""
    return max(1, min(heads, 4 * numba.get_num_threads()))


def _groups(B: int, P: int) -> int:
    """Head groups per batch element for the native forward: one group (all P heads of b,
    interleaved token by token) when the B blocks split evenly over the threads, else the
    fewest groups that do (or one per head)."""
    n = numba.get_num_threads()
    for ng in range(1, P + 1):
        if (B * ng) % n == 0:
            return ng
    return P


def _chunk(lay) -> int:
    return int(min(lay.C, CHUNK_CAP, lay.T))


def _kernel_inputs(lay, inputs):
    wi, a, v, beta, ri, c = inputs
    cd = lay.compute_dtype
    # int32 ids are taken as they are (no int64 copy: ~0.13 ms per forward on the benchmark
    # shape); the kernels compile once per id dtype, and both id arrays share one dtype
    i32 = np.dtype(np.int32)
    idt = i32 if wi.dtype == i32 and ri.dtype == i32 else np.dtype(np.int64)
    return (_readonly(wi, idt), _readonly(a, cd), _readonly(v, cd), _readonly(beta, cd),
            _readonly(ri, idt), _readonly(c, cd))


def _readonly(x, dtype):
    """A read-only C-contiguous view of ``x`` in ``dtype`` (a copy only where the dtype or the
    layout differs). Numba compiles a kernel once per argument type, and a read-only array is
    a type of its own: the inputs always go in read-only (a caller's frozen array, JAX's
    through DLPack, or ours alike), so that each kernel compiles once per dtype, not twice."""
    view = np.ascontiguousarray(x, dtype=dtype).view()
    view.flags.writeable = False
    return view


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
    if FORWARD not in ("auto", "chunked"):
        raise ValueError("sdm_cupy.kernels.cpu.FORWARD must be 'auto' or 'chunked', got "
                         f"{FORWARD!r}")
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
            snapshots = (_snapshot_empty(nrows, bank.dtype), None)
        elif quant == "bf16":
            snapshots = (_snapshot_empty(nrows, _BF16), None)
        else:
            snapshots = (_snapshot_empty(nrows, _SNAP_VIEW[quant]),
                         _snapshot_empty((B, P, T, W), np.float32))
    C = _chunk(lay)
    if snapshots is not None:   # they carry the chunk their backward must walk
        snapshots = SavedSnapshots(snapshots, C)
    nat, u16, u8, sc = _snapshot_arrays(lay, bank_k, snapshots, mode)
    bad = np.zeros((B * P, 2), np.int64)
    with _LOCK:
        if fmt == FMT_NATIVE and FORWARD == "auto":
            sdm_fwd_seq_kernel(bank_k, wi, a, v.reshape(B * T, lay.D), be, ri, c,
                               r.reshape(B * T, lay.D), S, P, hd, C, mode, nat, u16,
                               u8, sc, bad, _groups(B, P))
        else:
            sdm_fwd_kernel(bank_k, fmt, wi, a, v.reshape(B * T, lay.D), be, ri, c,
                           r.reshape(B * T, lay.D), S, P, hd, C, mode, nat, u16, u8,
                           sc, bad, _blocks(B * P))
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
    drk = _readonly(dr, cd)
    if dM is None:
        dMk = np.zeros((B * S, lay.D), cd)
    else:
        dMk = np.ascontiguousarray(dM, dtype=cd)   # no copy when dM is already cd
    mode = SNAP_CODES[config.snapshot_quant]
    # the chunks of the forward that saved the snapshots (CHUNK_CAP may have changed since)
    C = getattr(snapshots, "chunk", None) or _chunk(lay)
    nat, u16, u8, sc = _snapshot_arrays(lay, bank_k, snapshots, mode)
    da = np.empty((B, T, P, W), cd)
    dv = np.empty((B, T, lay.D), cd)
    dbeta = np.empty((B, T, P), cd)
    dc = np.empty((B, T, P, W), cd)
    bad = np.zeros((B * P, 2), np.int64)
    with _LOCK:
        sdm_bwd_kernel(bank_k, fmt, wi, a, v.reshape(B * T, lay.D), be, ri, c,
                       drk.reshape(B * T, lay.D), dMk, S, P, hd, C, mode, nat, u16,
                       u8, sc, da, dv.reshape(B * T, lay.D), dbeta, dc, bad, _blocks(B * P))
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
