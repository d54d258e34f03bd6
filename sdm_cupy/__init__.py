"""sdm-cupy: the sparse delta memory write/read op and its hand-coded backward on CuPy (GPU)
and NumPy (CPU) arrays.

    import sdm_cupy as sdm
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=64)
    res = sdm.forward(bank, write_idx, write_w, values, beta, read_idx, read_w, cfg)
    g = sdm.backward(res.saved, grad_readings)
"""

from .api import (ForwardResult, Gradients, SavedState, backward, expand_memory_batch, forward,
                  sum_memory_batch, tune)
from .config import SNAPSHOT_QUANT_MODES, SDMConfig, UnsupportedConfigurationError
from .interop import external_stream, from_dlpack, to_dlpack
from .state import LayerState
from . import reference

__version__ = "0.1.0"

__all__ = ["SDMConfig", "forward", "backward", "ForwardResult", "Gradients", "SavedState",
           "expand_memory_batch", "sum_memory_batch", "LayerState",
           "UnsupportedConfigurationError", "SNAPSHOT_QUANT_MODES", "from_dlpack", "to_dlpack",
           "check_device_errors", "gpu_available", "external_stream", "tune"]


def gpu_available() -> bool:
    """True when CuPy is installed and sees a CUDA device (never raises)."""
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - no CuPy, no driver: no GPU
        return False


def _why_no_gpu() -> str:
    """Why gpu_available() is False, in words a user can act on."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed: pip install -e '.[cuda13]' (or cuda12)"
    except Exception as e:  # noqa: BLE001 - a broken install says what broke
        return f"CuPy does not import: {type(e).__name__}: {e}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, or a driver too old for this CuPy
        return f"CuPy {cupy.__version__} finds no CUDA driver or device: {type(e).__name__}: {e}"
    return f"CuPy {cupy.__version__} sees {n} CUDA devices"


def check_device_errors(reset: bool = True) -> None:
    """Raises ValueError if a GPU kernel met a slot id outside [0, S) since the last check
    (calls with ``check_indices=False`` skip such ids instead of touching memory out of
    bounds). Synchronises with the device. A no-op without CuPy."""
    import sys
    if "cupy" not in sys.modules or not gpu_available():
        return
    from .kernels import gpu
    gpu.check_device_errors(reset=reset)
