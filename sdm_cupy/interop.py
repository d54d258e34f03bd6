"""Zero-copy exchange with PyTorch, JAX and any other DLPack producer or consumer."""

from __future__ import annotations

import numpy as np

__all__ = ["from_dlpack", "to_dlpack"]

_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13


def from_dlpack(x):
    """A NumPy (CPU) or CuPy (CUDA) view of a DLPack-capable array, without a copy.

    CUDA producers are read on the current CuPy stream: the producer orders its pending work
    before it (DLPack's stream handshake). Never write into a view of a JAX array: JAX buffers
    are immutable, and CuPy ignores the read-only flag.
    """
    if isinstance(x, np.ndarray) or type(x).__module__.split(".")[0] == "cupy":
        return x
    device_type, _ = x.__dlpack_device__()
    if device_type in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        import cupy
        return cupy.from_dlpack(x)
    if device_type in (_KDL_CPU, _KDL_CUDA_HOST):
        return np.from_dlpack(x)
    raise TypeError(f"from_dlpack: unsupported DLPack device type {device_type}")


def to_dlpack(x):
    """An object that ``torch.from_dlpack`` / ``jax.dlpack.from_dlpack`` take without a copy
    (the array itself: NumPy and CuPy arrays implement ``__dlpack__``)."""
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"to_dlpack: {type(x).__name__} does not implement __dlpack__")
    return x
