"""Validation and layout of the op's arguments: the one place both backends rely on.

Everything here runs before any kernel, and raises before anything is modified. The checks
follow SPEC §1 and §7; each message names the argument and the rule it broke.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from .config import SNAPSHOT_QUANT_MODES, SDMConfig, UnsupportedConfigurationError

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))

# The argument order of forward(); used in messages and by the backends.
INPUT_NAMES = ("write_idx", "write_w", "values", "beta", "read_idx", "read_w")


def is_cupy_array(x) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


def array_module(x, name: str | None = None):
    """numpy for NumPy arrays, cupy for CuPy arrays; TypeError for anything else (its message
    starts with ``name`` when given)."""
    if isinstance(x, np.ndarray):
        return np
    if is_cupy_array(x):
        import cupy
        return cupy
    prefix = f"{name}: " if name else ""
    raise TypeError(f"{prefix}expected a numpy.ndarray or cupy.ndarray, got {type(x).__module__}."
                    f"{type(x).__name__} (use sdm_cupy.from_dlpack for torch/JAX arrays)")


def common_module(named: dict, allow_none: bool = True):
    """The array module shared by every non-None array in ``named``; TypeError when NumPy and
    CuPy arrays are mixed or when CuPy arrays live on different devices, and for a None entry
    when ``allow_none`` is False."""
    xp, first, device = None, None, None
    for name, x in named.items():
        if x is None:
            if not allow_none:
                raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, got None")
            continue
        try:
            m = array_module(x)
        except TypeError as exc:
            raise TypeError(f"{name}: {exc}") from None
        if xp is None:
            xp, first = m, name
        elif m is not xp:
            raise TypeError(f"{name} is a {m.__name__} array but {first} is a {xp.__name__} "
                            "array: pass all arrays as NumPy (CPU) or all as CuPy (GPU)")
        if m is not np:
            if device is None:
                device = x.device.id
            elif x.device.id != device:
                raise TypeError(f"{name} is on CUDA device {x.device.id} but {first} is on "
                                f"device {device}: pass all arrays on one device")
    return xp


@dataclasses.dataclass(frozen=True)
class Layout:
    """Sizes and dtypes of one call (SPEC §1)."""

    B: int
    T: int
    P: int
    hd: int
    S: int
    W: int
    C: int
    bank_dtype: np.dtype
    value_dtype: np.dtype
    compute_dtype: np.dtype   # float64 when the bank or the values are float64, else float32
    grad_bank_dtype: np.dtype
    index_dtype: np.dtype

    @property
    def D(self) -> int:
        return self.P * self.hd

    @property
    def Nt(self) -> int:
        return -(-self.T // self.C)

    @property
    def weight_dtype(self) -> np.dtype:
        """dtype the weights (write_w, read_w, beta) are handed to the kernels in."""
        return self.compute_dtype


def _dtype_of(name, x, allowed, what):
    dt = np.dtype(x.dtype)
    if dt not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have a {what} dtype ({names}), got {dt}")
    return dt


def _shape(name, x, shape, meaning):
    if x.ndim != len(shape):
        raise ValueError(f"{name} must have rank {len(shape)} {meaning}, got shape {tuple(x.shape)}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {meaning} = {tuple(shape)}, got {tuple(x.shape)}")


def validate_config(config) -> SDMConfig:
    if not isinstance(config, SDMConfig):
        raise TypeError(f"config must be an sdm_cupy.SDMConfig, got {type(config).__name__}")
    return config


def layout(bank, write_idx, write_w, values, beta, read_idx, read_w, config: SDMConfig) -> Layout:
    """Checks ranks, shapes and dtypes of a forward call and returns its Layout. Raises
    TypeError (wrong array type or dtype) or ValueError (wrong shape); indices are range-checked
    separately (``check_index_ranges``) because on the GPU that needs a host sync."""
    config = validate_config(config)
    S, P, C = config.num_memory_slots, config.num_parallel, config.chunk_size
    if write_idx.ndim != 4:
        raise ValueError(f"write_idx must have rank 4 [B, T, P, W], got shape {tuple(write_idx.shape)}")
    B, T, P_in, W = (int(n) for n in write_idx.shape)
    if P_in != P:
        raise ValueError(f"write_idx.shape[2] (P) must equal config.num_parallel = {P}, got {P_in}")
    for n, name in ((B, "B"), (T, "T"), (W, "W")):
        if n < 1:
            raise ValueError(f"write_idx [B, T, P, W] must have {name} >= 1, got shape {tuple(write_idx.shape)}")
    if bank.ndim != 2:
        raise ValueError(f"bank must have rank 2 [B*S, D], got shape {tuple(bank.shape)}")
    rows, D = (int(n) for n in bank.shape)
    if D % P:
        raise ValueError(f"bank.shape[1] (D = {D}) must be divisible by config.num_parallel (P = {P})")
    if D < 1:
        raise ValueError(f"bank.shape[1] (D) must be >= 1, got {D}")
    if rows != B * S:
        raise ValueError(f"bank must have B*S = {B}*{S} = {B * S} rows (batch-major), got {rows}")
    hd = D // P
    bank_dt = _dtype_of("bank", bank, FLOAT_DTYPES, "float")
    idx_dt = _dtype_of("write_idx", write_idx, INDEX_DTYPES, "integer")
    _dtype_of("read_idx", read_idx, INDEX_DTYPES, "integer")
    _shape("read_idx", read_idx, (B, T, P, W), "[B, T, P, W]")
    _shape("write_w", write_w, (B, T, P, W), "[B, T, P, W]")
    _shape("read_w", read_w, (B, T, P, W), "[B, T, P, W]")
    _shape("values", values, (B, T, D), "[B, T, D]")
    _shape("beta", beta, (B, T, P), "[B, T, P]")
    floats = {"bank": bank_dt}
    for name, x in (("write_w", write_w), ("values", values), ("beta", beta), ("read_w", read_w)):
        floats[name] = _dtype_of(name, x, FLOAT_DTYPES, "float")
    # The big arrays (bank, values) choose the arithmetic; the weights are cast to it.
    f64 = np.dtype(np.float64)
    compute = f64 if f64 in (bank_dt, floats["values"]) else np.dtype(np.float32)
    if compute == f64:
        grad_bank = f64
    else:
        grad_bank = np.dtype(np.float32) if config.grad_bank_fp32 else bank_dt
    return Layout(B=B, T=T, P=P, hd=hd, S=S, W=W, C=C, bank_dtype=bank_dt,
                  value_dtype=floats["values"], compute_dtype=compute,
                  grad_bank_dtype=grad_bank, index_dtype=idx_dt)


def index_range_error(name: str, S: int, lo: int, hi: int) -> ValueError:
    return ValueError(f"{name} values must lie in [0, num_memory_slots) = [0, {S}), "
                      f"found values in [{lo}, {hi}]")


def check_index_range(name: str, idx, S: int) -> None:
    """Raises when an index lies outside [0, S). On CuPy arrays this synchronises with the
    host (one reduction and a copy of two scalars): it is the eager check that capturable
    paths skip (``check_indices=False``)."""
    if idx.size == 0:
        return
    lo, hi = idx.min(), idx.max()
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= S:
        raise index_range_error(name, S, lo, hi)


_RANGE_KERNEL = None


def _range_kernel():
    """An elementwise pass over two index arrays of one shape that sets bit 0 of ``flag[0]``
    when the first holds an id outside [0, S) and bit 1 when the second does (an atomic OR
    from the threads that find one; CuPy compiles it once per dtype pair). Not a CuPy
    reduction: a reduction to one value runs in a single block, 2.9 ms for two arrays of
    524,288 ids on an H200 (stop 17)."""
    global _RANGE_KERNEL
    if _RANGE_KERNEL is None:
        import cupy
        _RANGE_KERNEL = cupy.ElementwiseKernel(
            "X ia, Y ib, int64 nslot", "raw int32 flag",
            "const int bad = ((ia < 0 || (long long)ia >= nslot) ? 1 : 0)"
            " | ((ib < 0 || (long long)ib >= nslot) ? 2 : 0);"
            " if (bad) atomicOr(&flag[0], bad);",
            "sdm_index_range")
    return _RANGE_KERNEL


def check_index_ranges(S: int, first: tuple, second: tuple) -> None:
    """``check_index_range`` for two (name, array) pairs of one shape, the first checked
    first. On CuPy arrays both go through one elementwise pass and one host sync (the
    per-array minimum and maximum, four reductions and four syncs, only run to word the
    error)."""
    (name_a, a), (name_b, b) = first, second
    if not is_cupy_array(a) or a.shape != b.shape or a.size == 0:
        check_index_range(name_a, a, S)
        check_index_range(name_b, b, S)
        return
    import cupy
    flag = cupy.zeros(1, dtype=cupy.int32)
    _range_kernel()(a, b, np.int64(S), flag)
    bad = int(flag[0])
    if bad & 1:
        check_index_range(name_a, a, S)
    if bad & 2:
        check_index_range(name_b, b, S)
    if bad:   # the pass saw a bad id that the minimum and maximum did not: never expected
        raise RuntimeError(f"the range check of {name_a}/{name_b} disagreed with their minimum "
                           "and maximum; please report this")


def check_snapshot_quant(lay: Layout, mode) -> None:
    """Backend-independent refusals of SPEC §5: a mode must shrink the bank dtype."""
    if mode is None:
        return
    if mode not in SNAPSHOT_QUANT_MODES:
        raise UnsupportedConfigurationError(
            f"snapshot_quant must be None or one of {SNAPSHOT_QUANT_MODES}, got {mode!r}")
    row_bytes = lay.hd * lay.bank_dtype.itemsize
    if mode == "bf16":
        quant_bytes = lay.hd * 2
    else:  # one byte per value plus one float32 scale per row of hd
        quant_bytes = lay.hd + 4
    if quant_bytes >= row_bytes:
        raise UnsupportedConfigurationError(
            f"snapshot_quant={mode!r} does not shrink snapshot rows of a {lay.bank_dtype} bank "
            f"with head width hd={lay.hd} ({quant_bytes} bytes per row instead of {row_bytes}); "
            "use snapshot_quant=None")


def check_grad(name: str, x, shape, meaning, xp) -> np.dtype:
    if x is None:
        return None
    if array_module(x, name) is not xp:
        raise TypeError(f"{name} is a {array_module(x).__name__} array but the saved state is "
                        f"on {xp.__name__}: pass gradients of the same array type")
    _shape(name, x, shape, meaning)
    return _dtype_of(name, x, FLOAT_DTYPES, "float")
