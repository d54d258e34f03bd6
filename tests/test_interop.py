"""sdm.from_dlpack / sdm.to_dlpack with PyTorch and JAX: zero-copy both ways, all four dtypes
(bfloat16 included), lifetimes, CUDA stream ordering (gpu), and the op fed through DLPack."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

import sdm_cupy as sdm
from helpers import BF16, DTYPES, make_problem, assert_close, reference_fwd

DTYPE_IDS = list(DTYPES)

# JAX grabs 75% of GPU memory at its first GPU use unless told not to: leave it to CuPy and
# the rest of the suite (read when JAX initialises its backends, so set at collection).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def aligned_empty(shape, dtype, align=64):
    """A NumPy array whose data starts on an ``align``-byte boundary (JAX needs 64 on the CPU
    to take a buffer without copying)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


def _fill(a, rng):
    a[...] = rng.normal(size=a.shape).astype(np.float32).astype(a.dtype)
    return a


# ---------------------------------------------------------------------------------- PyTorch

@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _torch_dtype(torch, name):
    return {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16,
            "bf16": torch.bfloat16}[name]


@pytest.mark.parametrize("dt", DTYPE_IDS)
def test_torch_cpu_to_numpy_is_a_view(torch, dt):
    t = torch.randn(5, 7, dtype=torch.float32).to(_torch_dtype(torch, dt))
    v = sdm.from_dlpack(t)
    assert isinstance(v, np.ndarray)
    assert v.dtype == np.dtype(DTYPES[dt]), f"dtype {v.dtype}"
    assert v.shape == (5, 7)
    assert v.ctypes.data == t.data_ptr(), "from_dlpack copied (data pointers differ)"
    np.testing.assert_array_equal(v.astype(np.float32), t.float().numpy())
    v[2, 3] = 4.0                       # a write through the view is seen by torch
    assert float(t[2, 3]) == 4.0
    t[0, 0] = -2.0                      # and the other way
    assert float(v[0, 0]) == -2.0


@pytest.mark.parametrize("dt", DTYPE_IDS)
def test_numpy_to_torch_cpu_is_a_view(torch, rng, dt):
    a = _fill(np.empty((4, 6), DTYPES[dt]), rng)
    t = torch.from_dlpack(sdm.to_dlpack(a))
    assert t.dtype == _torch_dtype(torch, dt)
    assert t.data_ptr() == a.ctypes.data, "to_dlpack copied (data pointers differ)"
    np.testing.assert_array_equal(t.float().numpy(), a.astype(np.float32))
    t[1, 2] = 3.0
    assert float(a[1, 2]) == 3.0


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_torch_strided_and_odd_shapes(torch, dt):
    base = torch.arange(60, dtype=torch.float32).reshape(5, 12).to(_torch_dtype(torch, dt))
    t = base[1:, ::3]                       # non-contiguous
    v = sdm.from_dlpack(t)
    assert v.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(v.astype(np.float32), t.float().numpy())
    scalar = sdm.from_dlpack(torch.tensor(1.5, dtype=_torch_dtype(torch, dt)))
    assert scalar.shape == () and float(scalar) == 1.5
    assert sdm.from_dlpack(torch.zeros(0, 3, dtype=_torch_dtype(torch, dt))).shape == (0, 3)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_view_keeps_torch_memory_alive(torch, dt):
    t = torch.arange(4096, dtype=torch.float32).to(_torch_dtype(torch, dt))
    want = t.float().numpy().copy()
    v = sdm.from_dlpack(t)
    del t
    gc.collect()
    junk = [torch.full((4096,), -1.0, dtype=torch.float32) for _ in range(8)]  # reuse freed memory
    np.testing.assert_array_equal(v.astype(np.float32), want)
    del junk


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_torch_releases_exported_numpy_array(torch, dt):
    a = np.arange(16, dtype=np.float32).astype(DTYPES[dt])
    alive = weakref.ref(a)
    t = torch.from_dlpack(sdm.to_dlpack(a))
    del a
    gc.collect()
    assert alive() is not None, "the array died while torch still used its memory"
    assert float(t[5]) == 5.0
    del t
    gc.collect()
    assert alive() is None, "the DLPack deleter did not release the exported array"


def test_unconsumed_bf16_capsule_is_freed(torch):
    a = np.zeros(8, BF16)
    alive = weakref.ref(a)
    capsule = sdm.to_dlpack(a).__dlpack__()
    del a, capsule
    gc.collect()
    assert alive() is None, "an unconsumed capsule leaked the array"


def test_requires_grad_tensor_is_refused_clearly(torch):
    t = torch.zeros(3, requires_grad=True)
    with pytest.raises((RuntimeError, BufferError), match="(?i)grad"):
        sdm.from_dlpack(t)
    assert sdm.from_dlpack(t.detach()).shape == (3,)


def test_non_dlpack_objects_are_refused():
    with pytest.raises(TypeError, match="__dlpack__"):
        sdm.from_dlpack([1.0, 2.0])
    with pytest.raises(TypeError, match="__dlpack__"):
        sdm.to_dlpack([1.0, 2.0])
    a = np.zeros(3)
    assert sdm.from_dlpack(a) is a and sdm.to_dlpack(a) is a


@pytest.mark.parametrize("dt", DTYPE_IDS)
def test_op_through_torch_cpu(torch, rng, dt):
    """Inputs as torch tensors, outputs back to torch: no copies at the boundary."""
    pb = make_problem(rng, B=2, T=9, P=2, hd=8, S=16, W=2, dtype=DTYPES[dt])
    tens = [torch.from_dlpack(sdm.to_dlpack(x)) for x in pb.args()]
    views = [sdm.from_dlpack(t) for t in tens]
    for t, v in zip(tens, views):
        assert v.ctypes.data == t.data_ptr()
    cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size=4)
    res = sdm.forward(*views, cfg, needs_backward=False)
    r = torch.from_dlpack(sdm.to_dlpack(res.readings))
    assert r.data_ptr() == res.readings.ctypes.data
    r_ref, _ = reference_fwd(pb)
    tol = {"f64": 1e-12, "f32": 1e-5, "f16": 2e-2, "bf16": 5e-2}[dt]
    assert_close(r.double().numpy(), r_ref, tol, f"readings via torch ({dt})")


# -------------------------------------------------------------------------------------- JAX

@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)   # float64 stays float64 (else a float32 copy)
    return jax


def _jnp_dtype(jax, name):
    jnp = jax.numpy
    return {"f64": jnp.float64, "f32": jnp.float32, "f16": jnp.float16,
            "bf16": jnp.bfloat16}[name]


@pytest.mark.parametrize("dt", DTYPE_IDS)
def test_jax_cpu_to_numpy_is_a_readonly_view(jax, dt):
    x = jax.numpy.arange(24, dtype=_jnp_dtype(jax, dt)).reshape(4, 6)
    v = sdm.from_dlpack(x)
    assert isinstance(v, np.ndarray)
    assert v.dtype == np.dtype(DTYPES[dt])
    assert v.ctypes.data == x.unsafe_buffer_pointer(), "from_dlpack copied a JAX array"
    np.testing.assert_array_equal(v.astype(np.float32), np.asarray(x, dtype=np.float32))
    assert not v.flags.writeable, "a NumPy view of a JAX array must be read-only"
    with pytest.raises(ValueError):
        v[0, 0] = 1


@pytest.mark.parametrize("dt", DTYPE_IDS)
def test_numpy_to_jax_cpu_is_zero_copy(jax, rng, dt):
    a = _fill(aligned_empty((8, 16), DTYPES[dt]), rng)
    x = jax.dlpack.from_dlpack(sdm.to_dlpack(a), copy=False)
    assert x.dtype == np.dtype(DTYPES[dt])
    assert x.unsafe_buffer_pointer() == a.ctypes.data, "JAX copied the buffer"
    np.testing.assert_array_equal(np.asarray(x, dtype=np.float32), a.astype(np.float32))


def test_jax_copies_unaligned_buffers_unless_told_not_to(jax):
    a = aligned_empty((65,), np.float32)[1:]          # 4 bytes past a 64-byte boundary
    with pytest.raises(ValueError, match="aligned"):
        jax.dlpack.from_dlpack(sdm.to_dlpack(a), copy=False)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_jax_releases_exported_numpy_array(jax, dt):
    a = aligned_empty((64,), DTYPES[dt])
    a[...] = np.arange(64, dtype=np.float32).astype(a.dtype)
    owner = a.base
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    alive = weakref.ref(owner)
    x = jax.dlpack.from_dlpack(sdm.to_dlpack(a), copy=False)
    del a, owner
    gc.collect()
    assert alive() is not None
    assert float(x[5]) == 5.0
    del x
    gc.collect()
    assert alive() is None, "JAX's release did not free the exported array"


# -------------------------------------------------------------------------------------- GPU

def _spin_kernel():
    import cupy
    return cupy.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}''', "spin")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", DTYPE_IDS)
def test_torch_cuda_both_ways(torch, dt):
    import cupy
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    t = torch.randn(33, 17, device="cuda").to(_torch_dtype(torch, dt))
    v = sdm.from_dlpack(t)
    assert isinstance(v, cupy.ndarray) and v.dtype == np.dtype(DTYPES[dt])
    assert v.data.ptr == t.data_ptr(), "from_dlpack copied a CUDA tensor"
    v[3, 4] = 2.0
    cupy.cuda.get_current_stream().synchronize()
    assert float(t[3, 4]) == 2.0
    back = torch.from_dlpack(sdm.to_dlpack(v))
    assert back.data_ptr() == v.data.ptr and back.dtype == t.dtype


@pytest.mark.gpu
def test_torch_cuda_producer_stream_is_waited_for(torch):
    """torch fills the tensor on a side stream after a long spin; the CuPy view must see the
    fill (the handshake makes CuPy's stream wait for torch's)."""
    import cupy
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    n = 1 << 22
    x = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        x.fill_(3.0)
        consumer = cupy.cuda.Stream(non_blocking=True)
        with consumer:
            v = sdm.from_dlpack(x)
            total = float(v.sum())
    assert total == 3.0 * n, "CuPy read the tensor before torch's stream finished writing it"


@pytest.mark.gpu
def test_cupy_producer_stream_is_waited_for_by_torch(torch):
    import cupy
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    n = 1 << 22
    y = cupy.zeros(n, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    spin = _spin_kernel()
    producer = cupy.cuda.Stream(non_blocking=True)
    with producer:
        spin((1,), (1,), (np.int64(200_000_000),))
        y.fill(3.0)
        t = torch.from_dlpack(sdm.to_dlpack(y))     # torch's current stream waits on CuPy's
        total = float(t.sum())
    assert total == 3.0 * n, "torch read the array before CuPy's stream finished writing it"


@pytest.fixture(scope="module")
def jax_gpu(jax):
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", DTYPE_IDS)
def test_jax_cuda_both_ways(jax, jax_gpu, dt):
    import cupy
    x = jax.device_put(jax.numpy.arange(48, dtype=_jnp_dtype(jax, dt)).reshape(6, 8), jax_gpu)
    x.block_until_ready()
    v = sdm.from_dlpack(x)
    assert isinstance(v, cupy.ndarray) and v.dtype == np.dtype(DTYPES[dt])
    assert v.data.ptr == x.unsafe_buffer_pointer(), "from_dlpack copied a JAX GPU array"
    np.testing.assert_array_equal(cupy.asnumpy(v).astype(np.float32),
                                  np.asarray(x, dtype=np.float32))
    y = cupy.asarray(np.arange(48, dtype=np.float32).astype(DTYPES[dt]).reshape(6, 8))
    z = jax.dlpack.from_dlpack(sdm.to_dlpack(y), copy=False)
    assert z.unsafe_buffer_pointer() == y.data.ptr, "JAX copied a CuPy array"
    np.testing.assert_array_equal(np.asarray(z, dtype=np.float32),
                                  cupy.asnumpy(y).astype(np.float32))


@pytest.mark.parametrize("bad", [None, 1.5, "0x1", True, object()])
def test_external_stream_refuses_what_is_not_a_stream(bad):
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="stream: expected an object with __cuda_stream__"):
        sdm.external_stream(bad)


@pytest.mark.gpu
def test_external_stream_wraps_a_raw_handle_without_deprecation():
    import warnings

    import cupy
    own = cupy.cuda.Stream(non_blocking=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        s = sdm.external_stream(own.ptr)
        with s:
            assert cupy.cuda.get_current_stream().ptr == own.ptr
            x = cupy.arange(5, dtype=cupy.float32) * 2
        own.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(x), np.arange(5, dtype=np.float32) * 2)


@pytest.mark.gpu
def test_external_stream_takes_torch_streams(torch):
    import warnings

    import cupy
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    ts = torch.cuda.Stream()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with sdm.external_stream(ts):
            assert cupy.cuda.get_current_stream().ptr == ts.cuda_stream
        with sdm.external_stream(ts.cuda_stream):
            assert cupy.cuda.get_current_stream().ptr == ts.cuda_stream


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_op_through_torch_cuda(torch, rng, dt):
    import cupy
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    pb = make_problem(rng, B=2, T=9, P=2, hd=8, S=16, W=2, dtype=DTYPES[dt])
    tens = [torch.from_dlpack(sdm.to_dlpack(cupy.asarray(x))) for x in pb.args()]
    with sdm.external_stream(torch.cuda.current_stream()):
        views = [sdm.from_dlpack(t) for t in tens]
        cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size=4)
        res = sdm.forward(*views, cfg, needs_backward=False)
        r = torch.from_dlpack(sdm.to_dlpack(res.readings))
    r_ref, _ = reference_fwd(pb)
    tol = {"f32": 1e-5, "bf16": 5e-2}[dt]
    assert_close(r.double().cpu().numpy(), r_ref, tol, f"readings via torch CUDA ({dt})")


class _LegacyProducer:
    """A producer from before DLPack 1.0: no ``max_version`` keyword, unversioned capsules."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, stream=None):
        from torch.utils.dlpack import to_dlpack
        return to_dlpack(self.tensor)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_legacy_unversioned_producer(torch, dt):
    t = torch.arange(10, dtype=torch.float32).to(_torch_dtype(torch, dt))
    v = sdm.from_dlpack(_LegacyProducer(t))
    assert v.dtype == np.dtype(DTYPES[dt]) and v.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(v.astype(np.float32), np.arange(10, dtype=np.float32))


def test_bf16_export_speaks_both_dlpack_versions(torch):
    a = np.arange(6, dtype=np.float32).astype(BF16)
    exp = sdm.to_dlpack(a)
    assert exp.shape == (6,) and exp.dtype == BF16 and exp.array is a
    legacy = torch.utils.dlpack.from_dlpack(exp.__dlpack__())          # "dltensor"
    versioned = torch.from_dlpack(exp)                                 # asks for max_version
    for t in (legacy, versioned):
        assert t.dtype == torch.bfloat16 and t.data_ptr() == a.ctypes.data
    # NumPy itself takes the relabelled capsule back as bfloat16 via from_dlpack
    back = sdm.from_dlpack(exp)
    assert back.dtype == BF16 and back.ctypes.data == a.ctypes.data
