"""Zero-copy exchange with PyTorch, JAX and any other DLPack producer or consumer.

``from_dlpack(x)`` gives the NumPy (CPU producers) or CuPy (CUDA producers) view of ``x`` that
``sdm.forward``/``sdm.backward`` take; ``to_dlpack(y)`` gives an object that
``torch.from_dlpack`` and ``jax.dlpack.from_dlpack`` turn into a tensor over the same memory.

bfloat16 on the CPU
-------------------
NumPy's DLPack import and export refuse bfloat16 (NumPy 2.4: "Unsupported dtype in DLTensor";
"DLPack only supports signed/unsigned integers, float and complex dtypes"), although
``ml_dtypes.bfloat16`` arrays are ordinary 2-byte arrays. Both directions therefore go through
NumPy's own DLPack code with the element type relabelled in the capsule's ``DLTensor``
(``ctypes`` over the DLPack 0.x/1.x ABI):

* import: the producer's capsule is taken, its dtype field rewritten from (kDLBfloat, 16, 1) to
  (kDLUInt, 16, 1), and handed to ``numpy.from_dlpack``, which builds the array over the
  producer's memory and calls the producer's deleter when the array dies (so the producer's
  buffer stays alive exactly as long as the view); the uint16 array is then viewed as
  ``ml_dtypes.bfloat16`` (same bits, no copy).
* export: a bfloat16 array is exported as its uint16 view through ``ndarray.__dlpack__``, whose
  deleter releases NumPy's reference to the view (and through it the array), and the capsule's
  dtype is rewritten to kDLBfloat before the consumer sees it.

Only a single field of a struct that the producer allocated and has not yet handed to anyone
is changed; deleters never read it. CUDA arrays need none of this: CuPy >= 14 exchanges
bfloat16 itself when ``ml_dtypes`` is installed.

Streams (CUDA)
--------------
``from_dlpack`` calls ``cupy.from_dlpack``, which passes CuPy's *current* stream to the
producer's ``__dlpack__`` (1 for the legacy default stream, 2 for the per-thread default, else
the stream pointer); the producer makes that stream wait for its pending work on the array
(PyTorch and JAX record an event and wait on it). Use the view on that stream — run
``sdm.forward`` under the same ``with stream:`` — or synchronise before using it on another.
In the other direction the consumer passes its stream to ``cupy.ndarray.__dlpack__`` and CuPy
makes it wait for the work queued on CuPy's current stream. To avoid the cross-stream waits
altogether, run CuPy on the framework's stream: ``with sdm.external_stream(s):``, where ``s``
is the framework's stream object (``torch.cuda.current_stream()``: anything with the CUDA
stream protocol's ``__cuda_stream__``) or its raw ``cudaStream_t`` as an int (JAX's
``ctx.stream``). It wraps the stream with ``cupy.cuda.Stream.from_external`` (CuPy 14.2
deprecated ``cupy.cuda.ExternalStream`` for it), or with ``ExternalStream`` on a CuPy that lacks
it.

JAX
---
JAX arrays are immutable; DLPack cannot say so to CuPy, and CuPy ignores DLPack's read-only
flag: a CuPy view of a JAX buffer is writable and writing it is undefined behaviour for JAX.
Never pass a view of a JAX array as a buffer that is written (``inplace=True``'s bank, or any
output). On the CPU, ``from_dlpack`` marks NumPy views of JAX arrays read-only so that such a
write fails loudly (the output ``Buffer`` objects of ``jax.experimental.buffer_callback`` say
``writeable=True`` and stay writable: they are meant to be written).

JAX takes a CPU buffer without a copy only if its address is 64-byte aligned (jaxlib 0.10;
NumPy's default allocations are only 16-byte aligned): it copies otherwise, and
``jax.dlpack.from_dlpack(y, copy=False)`` raises instead of copying silently. float64 needs
``jax.config.update("jax_enable_x64", True)``; without it JAX converts float64 imports to
float32 (a copy).
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

__all__ = ["from_dlpack", "to_dlpack", "external_stream"]

_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13
_KDL_UINT, _KDL_BFLOAT = 1, 4
_BF16 = np.dtype(ml_dtypes.bfloat16)


# ------------------------------------------------------------------ DLPack ABI (dlpack.h 1.x)

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):           # capsule name "dltensor" (DLPack < 1.0)
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):  # capsule name "dltensor_versioned"
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", _DLTensor)]


_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype, _capsule_is_valid.argtypes = ctypes.c_int, [ctypes.py_object,
                                                                         ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object,
                                                                         ctypes.c_char_p]


def _dl_tensor(capsule) -> _DLTensor:
    """The DLTensor inside an unconsumed DLPack capsule (either ABI version)."""
    for name, struct in ((b"dltensor_versioned", _DLManagedTensorVersioned),
                         (b"dltensor", _DLManagedTensor)):
        if _capsule_is_valid(capsule, name):
            managed = struct.from_address(_capsule_pointer(capsule, name))
            return managed.dl_tensor
    raise BufferError("expected an unconsumed DLPack capsule ('dltensor' or "
                      "'dltensor_versioned')")


def _relabel(capsule, want: tuple, new_code: int) -> bool:
    """Rewrites the capsule's dtype code to ``new_code`` if its (code, bits, lanes) is ``want``."""
    dt = _dl_tensor(capsule).dtype
    if (dt.code, dt.bits, dt.lanes) != want:
        return False
    dt.code = new_code
    return True


class _Capsule:
    """Hands one already-taken capsule to ``numpy.from_dlpack`` (which wants an object with
    ``__dlpack__``/``__dlpack_device__``)."""

    def __init__(self, capsule, device):
        self._capsule, self._device = capsule, device

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise BufferError("this DLPack capsule was consumed already")
        return capsule


def _take_capsule(x):
    """``x.__dlpack__()`` for a CPU consumer: DLPack 1.x if the producer speaks it."""
    try:
        return x.__dlpack__(max_version=(1, 0))
    except TypeError:  # a producer from before the keyword (DLPack < 1.0)
        return x.__dlpack__()


def _read_only(x) -> bool:
    """JAX arrays are immutable; a producer that says ``writeable`` (JAX's buffer_callback
    ``Buffer``: False for inputs, True for outputs) is taken at its word."""
    writeable = getattr(x, "writeable", None)
    if isinstance(writeable, bool):
        return not writeable
    return type(x).__module__.split(".")[0] in ("jax", "jaxlib")


def _cpu_view(x):
    device = x.__dlpack_device__()
    capsule = _take_capsule(x)
    bf16 = _relabel(capsule, (_KDL_BFLOAT, 16, 1), _KDL_UINT)
    view = np.from_dlpack(_Capsule(capsule, device))
    if bf16:
        view = view.view(_BF16)
    if _read_only(x) and view.flags.writeable:
        view.flags.writeable = False   # JAX buffers are immutable (see module docstring)
    return view


def from_dlpack(x):
    """A NumPy (CPU) or CuPy (CUDA) view of a DLPack-capable array, without a copy.

    Args:
        x: a torch tensor, JAX array, or any object with ``__dlpack__`` and
            ``__dlpack_device__``; NumPy and CuPy arrays are returned as they are. Dtypes:
            everything NumPy/CuPy take, plus bfloat16 (as ``ml_dtypes.bfloat16``) on both.

    Returns:
        numpy.ndarray for CPU (and CUDA-pinned host) producers, cupy.ndarray for CUDA and
        CUDA-managed producers. The view shares the producer's memory and keeps it alive.

    Stream semantics (CUDA): the view is ready on CuPy's *current* stream (CuPy passes it to
    the producer, which orders its pending work before it); run the op on that stream.

    Never write into a view of a JAX array (JAX buffers are immutable; CuPy ignores the
    read-only flag). CPU views of JAX arrays are marked read-only.

    Raises:
        TypeError: no ``__dlpack__``, or a device type other than CPU/CUDA.
        BufferError / RuntimeError: the producer refused (e.g. a torch tensor that requires
            grad: pass ``t.detach()``).

    Example:
        >>> bank = sdm.from_dlpack(torch_bank.detach())
    """
    if isinstance(x, np.ndarray) or type(x).__module__.split(".")[0] == "cupy":
        return x
    if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        raise TypeError(f"from_dlpack: {type(x).__name__} does not implement __dlpack__ and "
                        "__dlpack_device__")
    device_type, _ = x.__dlpack_device__()
    if device_type in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        import cupy   # current-stream handshake: see the module docstring
        return cupy.from_dlpack(x)
    if device_type in (_KDL_CPU, _KDL_CUDA_HOST):
        return _cpu_view(x)
    raise TypeError(f"from_dlpack: unsupported DLPack device type {int(device_type)} "
                    "(CPU=1, CUDA=2, CUDA host=3, CUDA managed=13 are taken)")


class BF16Export:
    """DLPack producer for a NumPy bfloat16 array (which NumPy cannot export itself).

    ``__dlpack__`` exports the array's uint16 view through NumPy and relabels the capsule as
    bfloat16; the capsule's deleter is NumPy's and releases the reference to the view (and
    through it to ``array``). Each ``__dlpack__`` call gives a new capsule over the same
    memory. ``array`` is the exported array.
    """

    def __init__(self, array: np.ndarray):
        if np.dtype(array.dtype) != _BF16:
            raise TypeError(f"BF16Export takes a bfloat16 array, got {array.dtype}")
        self.array = array
        self._bits = array.view(np.uint16)

    shape = property(lambda self: self.array.shape)
    dtype = property(lambda self: self.array.dtype)

    def __dlpack_device__(self):
        return self._bits.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        kwargs = {k: v for k, v in (("stream", stream), ("max_version", max_version),
                                    ("dl_device", dl_device), ("copy", copy)) if v is not None}
        capsule = self._bits.__dlpack__(**kwargs)
        _relabel(capsule, (_KDL_UINT, 16, 1), _KDL_BFLOAT)
        return capsule

    def __repr__(self):
        return f"BF16Export(shape={self.shape})"


def to_dlpack(x):
    """An object that ``torch.from_dlpack`` / ``jax.dlpack.from_dlpack`` take without a copy.

    Args:
        x: a NumPy or CuPy array (e.g. ``res.readings``), or any DLPack producer.

    Returns:
        ``x`` itself (NumPy and CuPy arrays implement ``__dlpack__``), except for NumPy
        bfloat16 arrays, which come back wrapped in a ``BF16Export`` (NumPy's own export
        refuses bfloat16). Consumers keep the memory alive while their tensor lives.

    Stream semantics (CUDA): the consumer passes its stream; CuPy makes it wait for the work
    queued on CuPy's current stream (where the op ran).

    Notes: JAX (CPU) takes the memory without a copy only when it is 64-byte aligned; it
    copies otherwise (``copy=False`` makes that an error). The op rewinds ``res.bank`` in
    place during ``backward``: a tensor made from ``to_dlpack(res.bank)`` sees that rewind.

    Raises:
        TypeError: ``x`` has no ``__dlpack__``.

    Example:
        >>> readings = torch.from_dlpack(sdm.to_dlpack(res.readings))
    """
    if isinstance(x, np.ndarray) and np.dtype(x.dtype) == _BF16:
        return BF16Export(x)
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"to_dlpack: {type(x).__name__} does not implement __dlpack__")
    return x


# ------------------------------------------------------------------ streams (CUDA)

class _RawStream:
    """A raw ``cudaStream_t`` (an int) seen through the CUDA stream protocol (version 0)."""

    def __init__(self, ptr: int):
        self.ptr = int(ptr)

    def __cuda_stream__(self):
        return (0, self.ptr)


def external_stream(stream):
    """A CuPy stream over another library's CUDA stream, to run CuPy (and so ``forward`` and
    ``backward``) on it: ``with external_stream(torch.cuda.current_stream()): ...``.

    ``stream`` is an object with ``__cuda_stream__`` (PyTorch's streams, cuda.core's; a PyTorch
    stream without it is taken by its ``cuda_stream``) or a raw ``cudaStream_t`` as an int
    (``torch.cuda.Stream.cuda_stream``, JAX's ``ctx.stream``). The caller keeps the stream
    alive while CuPy uses it. Raises TypeError for anything else."""
    import cupy

    if not hasattr(stream, "__cuda_stream__") and isinstance(
            getattr(stream, "cuda_stream", None), int):
        stream = stream.cuda_stream          # a PyTorch stream from before the protocol
    raw = isinstance(stream, (int, np.integer)) and not isinstance(stream, bool)
    if not raw and not hasattr(stream, "__cuda_stream__"):
        raise TypeError("stream: expected an object with __cuda_stream__ or a cudaStream_t "
                        f"as an int, got {type(stream).__name__}")
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_RawStream(stream) if raw else stream)
    return cupy.cuda.ExternalStream(int(stream) if raw else stream.__cuda_stream__()[1])
