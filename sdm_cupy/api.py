"""The functional op: ``forward`` and ``backward`` on NumPy (CPU) or CuPy (GPU) arrays.

``forward`` validates (``_validate``), normalises the arguments (contiguous arrays, weights in
the compute dtype, one index dtype), picks the backend from the array type and runs its
``sdm_fwd``; ``backward`` runs the backend's ``sdm_bwd``, which rewinds the bank in place.
The backends (``sdm_cupy.kernels.cpu``, ``sdm_cupy.kernels.gpu``) only compute.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from . import _validate as V
from .config import SDMConfig

__all__ = ["forward", "backward", "ForwardResult", "Gradients", "SavedState",
           "expand_memory_batch", "sum_memory_batch", "tune"]


def backend_for(xp):
    """The backend module for an array module (numpy -> Numba CPU, cupy -> CUDA)."""
    if xp is np:
        from .kernels import cpu
        return cpu
    from .kernels import gpu
    return gpu


@dataclasses.dataclass
class ForwardResult:
    """What ``forward`` returns.

    Attributes:
        readings: [B, T, D] in the dtype of ``values``.
        bank: [B*S, D], the final bank: the caller's ``bank`` itself when ``inplace=True``,
            else a new array. ``backward`` rewinds it in place to the initial bank.
        saved: the state ``backward`` consumes, or None when ``needs_backward=False``.
    """

    readings: object
    bank: object
    saved: "SavedState | None"


@dataclasses.dataclass
class Gradients:
    """Gradients returned by ``backward``; each in its input's dtype, except ``bank``, which
    is float32 with ``grad_bank_fp32=True`` (float64 for float64 calls), else the bank dtype."""

    bank: object
    write_w: object
    values: object
    beta: object
    read_w: object


class SavedState:
    """What a forward keeps for its backward: the layout, the config, the final bank (the very
    array in ``ForwardResult.bank``), the inputs and the snapshot rows. Consumed by the first
    ``backward``; the inputs must not be modified in between (they are read, not copied)."""

    def __init__(self, backend, lay, config, bank, inputs, snapshots, input_dtypes,
                 recyclable=True):
        self.backend, self.layout, self.config = backend, lay, config
        self.bank, self.inputs, self._snapshots = bank, inputs, snapshots
        self.input_dtypes = input_dtypes
        self._lock = threading.Lock()
        self._consumed = False
        # the backward may hand the snapshot buffers back to the backend for a later forward
        # (CPU: fresh memory costs more than the forward); only while nobody else can hold
        # them: reading ``snapshots`` or rearming turns this off
        self._recyclable = recyclable

    @property
    def snapshots(self):
        """The snapshot rows (and scales) the backward reads; None once consumed. Reading
        this keeps the buffers from being reused after the backward."""
        self._recyclable = False
        return self._snapshots

    @property
    def consumed(self) -> bool:
        return self._consumed

    def _take(self):
        with self._lock:
            if self._consumed:
                raise RuntimeError(
                    "sdm_cupy.backward: this saved state was already consumed by an earlier "
                    "backward (which rewound the bank in place); run forward again to get a "
                    "new one")
            self._consumed = True
        snapshots, self._snapshots = self._snapshots, None
        return snapshots

    def rearmed(self) -> "SavedState":
        """A new, unconsumed SavedState over the same arrays (final bank, inputs, snapshots).

        For a caller that restores those arrays' contents before each backward itself: the
        CUDA-graph runner replays a captured forward into them and runs every backward on a
        fresh ``rearmed()`` copy of one template that is never consumed. ``backward`` rewinds
        the bank, so a rearmed state is valid only until a backward on any of them ran.

        Raises:
            RuntimeError: this state was consumed already (its snapshots are gone).
        """
        if self._consumed:
            self._take()  # raises
        self._recyclable = False   # the copies share the snapshot buffers
        return SavedState(self.backend, self.layout, self.config, self.bank, self.inputs,
                          self._snapshots, self.input_dtypes, recyclable=False)

    @property
    def nbytes(self) -> int:
        """Device or host bytes held by the snapshots."""
        if self._snapshots is None:
            return 0
        return int(sum(a.nbytes for a in self._snapshots if a is not None))


def _contiguous(xp, x, dtype=None):
    if dtype is not None and np.dtype(x.dtype) != np.dtype(dtype):
        return xp.ascontiguousarray(x.astype(dtype))
    return xp.ascontiguousarray(x)


def _checked(bank, write_idx, write_w, values, beta, read_idx, read_w, config, needs_backward,
             check_indices):
    """``forward``'s checks of its arguments (before anything runs): the array module, the
    layout and the backend, which also refuses the snapshot mode where a backward needs it."""
    named = dict(bank=bank, write_idx=write_idx, write_w=write_w, values=values, beta=beta,
                 read_idx=read_idx, read_w=read_w)
    xp = V.common_module(named, allow_none=False)
    lay = V.layout(bank, write_idx, write_w, values, beta, read_idx, read_w, config)
    backend = backend_for(xp)
    if needs_backward:
        V.check_snapshot_quant(lay, config.snapshot_quant)
        backend.check_config(lay, config)
    if check_indices:
        V.check_index_ranges(lay.S, ("write_idx", write_idx), ("read_idx", read_idx))
    return xp, lay, backend


def forward(bank, write_idx, write_w, values, beta, read_idx, read_w, config: SDMConfig, *,
            needs_backward: bool = True, inplace: bool = False, check_indices: bool = True):
    """Runs the SDM write/read of SPEC §2 over T tokens.

    Args:
        bank: [B*S, D] initial memory, batch-major (float64/32/16 or bfloat16).
        write_idx, read_idx: [B, T, P, W] slot ids in [0, S) (int32 or int64).
        write_w, read_w: [B, T, P, W] address weights a and c.
        values: [B, T, D] values v; beta: [B, T, P] write strengths.
        config: an ``SDMConfig`` (S, P, chunk size, snapshot mode, grad-bank dtype).
        needs_backward: save the snapshot rows a ``backward`` needs; False saves nothing.
        inplace: write the final bank into ``bank`` itself (it must be C-contiguous); else
            the final bank is a new array and ``bank`` is left as it was.
        check_indices: range-check the indices first. On CuPy arrays this is one host sync
            (one elementwise pass over both index arrays);
            pass False in code that must be capturable. Kernels never touch memory out of
            bounds either way: an out-of-range id is skipped and recorded in a device-side
            flag that ``sdm_cupy.check_device_errors()`` reports.

    Returns:
        ForwardResult(readings [B, T, D] in the dtype of ``values``, bank, saved).

    Raises:
        TypeError: a non-array, mixed NumPy/CuPy arrays, a wrong dtype.
        ValueError: a wrong rank or shape, mismatched B/T/P/W, D not divisible by P, bank rows
            != B*S, a slot id outside [0, S).
        UnsupportedConfigurationError: a snapshot mode the backend cannot serve.
        Nothing is modified when any of these is raised.

    Example:
        >>> cfg = SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=64)
        >>> res = forward(bank, wi, ww, v, beta, ri, rw, cfg)
        >>> g = backward(res.saved, grad_readings)
    """
    xp, lay, backend = _checked(bank, write_idx, write_w, values, beta, read_idx, read_w, config,
                                needs_backward, check_indices)
    if inplace and not bank.flags.c_contiguous:
        raise ValueError("bank must be C-contiguous when inplace=True")
    if inplace and not getattr(bank.flags, "writeable", True):
        raise ValueError("bank must be writeable when inplace=True (it is a read-only array)")
    wd, idx = lay.weight_dtype, lay.index_dtype
    inputs = (_contiguous(xp, write_idx, idx), _contiguous(xp, write_w, wd),
              _contiguous(xp, values), _contiguous(xp, beta, wd),
              _contiguous(xp, read_idx, idx), _contiguous(xp, read_w, wd))
    out_bank = bank if inplace else xp.array(bank, order="C", copy=True)
    readings, snapshots = backend.sdm_fwd(lay, config, out_bank, *inputs,
                                          save_snapshots=needs_backward)
    saved = None
    if needs_backward:
        dtypes = tuple(np.dtype(x.dtype) for x in (write_w, values, beta, read_w))
        saved = SavedState(backend, lay, config, out_bank, inputs, snapshots, dtypes)
    return ForwardResult(readings=readings, bank=out_bank, saved=saved)


def backward(saved: SavedState, grad_readings, grad_bank=None) -> Gradients:
    """Gradients of a forward (SPEC §4), rewinding its final bank in place.

    Args:
        saved: ``ForwardResult.saved``. Consumed: a second backward on it raises.
        grad_readings: [B, T, D] gradient of the readings.
        grad_bank: optional [B*S, D] gradient of the final bank (zero when None).

    Returns:
        Gradients(bank, write_w, values, beta, read_w). Indices get none.
        ``ForwardResult.bank`` holds the initial bank again afterwards (exactly with
        ``snapshot_quant=None``, up to the quantization error otherwise).

    Raises:
        TypeError / ValueError: gradients of the wrong array type, shape or dtype;
        RuntimeError: the state was consumed already, or (GPU) a setting of
            ``sdm_cupy.kernels.gpu`` changed since the forward so that the backward cannot walk
            the forward's chunks. Nothing is modified then.
    """
    if not isinstance(saved, SavedState):
        raise TypeError("saved must be the ForwardResult.saved of a forward with "
                        f"needs_backward=True, got {type(saved).__name__}")
    lay = saved.layout
    xp = V.array_module(saved.bank)
    if grad_readings is None:
        raise TypeError("grad_readings is required: pass the [B, T, D] gradient of the readings "
                        "(zeros when only the final bank has a gradient)")
    V.check_grad("grad_readings", grad_readings, (lay.B, lay.T, lay.D), "[B, T, D]", xp)
    V.check_grad("grad_bank", grad_bank, (lay.B * lay.S, lay.D), "[B*S, D]", xp)
    if saved.consumed:
        saved._take()  # raises
    check = getattr(saved.backend, "check_backward", None)
    if check is not None:   # the backend's refusals, before the state is consumed
        check(lay, saved.config, saved._snapshots)
    dr = _contiguous(xp, grad_readings, lay.value_dtype)
    dM = None
    if grad_bank is not None:
        dM = xp.array(grad_bank, dtype=lay.grad_bank_dtype, order="C", copy=True)
    snapshots = saved._take()
    grads = saved.backend.sdm_bwd(lay, saved.config, saved.bank, saved.inputs, snapshots, dr, dM)
    recycle = getattr(saved.backend, "recycle_snapshots", None)
    if recycle is not None and saved._recyclable and snapshots is not None:
        recycle(snapshots)   # their last reader is done; no one else holds them
    d_bank, d_ww, d_v, d_beta, d_rw = grads
    dt_ww, dt_v, dt_beta, dt_rw = saved.input_dtypes
    saved.inputs = None
    return Gradients(bank=d_bank, write_w=_as(d_ww, dt_ww), values=_as(d_v, dt_v),
                     beta=_as(d_beta, dt_beta), read_w=_as(d_rw, dt_rw))


def _as(x, dtype):
    return x if np.dtype(x.dtype) == dtype else x.astype(dtype)


def tune(bank, write_idx, write_w, values, beta, read_idx, read_w, config: SDMConfig, *,
         reps: int = 5):
    """Times this call's forward+backward on its GPU under the two plans the backward can take
    where its dM stage does not fit beside its chunk (``gpu.BWD_DM_HALVE``: keep the chunk
    without the stage, or halve it with the stage and sub-chunk snapshots in the forward),
    and makes the faster one the plan of this layout (shapes, dtypes, chunk size) for the rest
    of the process. Neither wins everywhere and no rule we found predicts which (stop 28:
    −6.1% at the headline on an H200, +8% at W = 8), hence a measurement. Run it once per
    layout before training, with inputs like the real ones; it leaves them unmodified.

    Each timed call is an eager ``forward`` (a fresh final bank) and ``backward`` with
    ``grad_readings`` = ``values``, between CUDA events: one untimed call per plan, then
    ``reps`` rounds, interleaved; the lower median wins (a tie keeps the default). Where both
    plans are the same kernels nothing runs. Do not run calls of this layout on other threads
    meanwhile (they would see the plan under test). ``sdm_cupy.kernels.gpu.clear_tuning()``
    forgets every choice. A CUDA graph captured before keeps the plans it captured.

    Returns:
        ``sdm_cupy.kernels.gpu.Tuning(halve, plans_differ, ms)``; None for NumPy arrays (the
        CPU backend has one plan).

    Raises:
        what ``forward`` raises for these arguments, before anything runs; ValueError for
        reps < 1.
    """
    xp, lay, backend = _checked(bank, write_idx, write_w, values, beta, read_idx, read_w, config,
                                True, True)
    if int(reps) < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if xp is np:
        return None
    import cupy as cp

    def run_once():
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        res = forward(bank, write_idx, write_w, values, beta, read_idx, read_w, config,
                      check_indices=False)
        backward(res.saved, values)
        end.record()
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3

    return backend.tune_layout(lay, config, run_once, reps=int(reps))


def expand_memory_batch(param, batch: int):
    """[S, D] -> [B*S, D]: ``batch`` copies of a learned initial bank (SPEC §6)."""
    xp = V.array_module(param, "param")
    if param.ndim != 2:
        raise ValueError(f"param must have rank 2 [S, D], got shape {tuple(param.shape)}")
    V._dtype_of("param", param, V.FLOAT_DTYPES, "float")
    if isinstance(batch, bool) or int(batch) != batch or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    return backend_for(xp).expand_memory_batch(xp.ascontiguousarray(param), int(batch))


def sum_memory_batch(grad_bank, num_memory_slots: int):
    """[B*S, D] -> [S, D]: the sum over the B copies, the gradient of ``param`` (SPEC §6).
    The result has the dtype of ``grad_bank`` (accumulated in float32 at least)."""
    xp = V.array_module(grad_bank, "grad_bank")
    if grad_bank.ndim != 2:
        raise ValueError(f"grad_bank must have rank 2 [B*S, D], got shape {tuple(grad_bank.shape)}")
    V._dtype_of("grad_bank", grad_bank, V.FLOAT_DTYPES, "float")
    S = int(num_memory_slots)
    if S < 1 or grad_bank.shape[0] % S:
        raise ValueError(f"grad_bank rows ({grad_bank.shape[0]}) must be a positive multiple of "
                         f"num_memory_slots ({num_memory_slots})")
    return backend_for(xp).sum_memory_batch(xp.ascontiguousarray(grad_bank), S)
