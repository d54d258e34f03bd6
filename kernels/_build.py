"""Building the CUDA C++ kernels: sources, NVRTC options, template instances, modules.

Every kernel is a template over dtypes; an instance is named by a C++ name expression such as
``sdm::sdm_fwd_kernel<__nv_bfloat16,__nv_bfloat16,float,int,0,8>``. ``module_specs()`` lists
every (source, options, name_expressions) that the GPU backend can ever build, so that
``tests/test_nvrtc.py`` compiles all of them with NVRTC on a machine without a GPU.

Modules are built lazily, one ``cupy.RawModule`` per source and dtype key (bank, values,
index dtype), holding that key's instances: a call compiles only what its dtypes can use
(about a tenth of a source's instances) instead of every instance of the source at its first
call. CuPy's compile cache (keyed on source text, options and name expressions) makes the
next process load them from disk. The shared header is inlined into each source so that the
cache key changes when the header does. CuPy adds ``-arch=sm_XX`` of the current device
itself (and ``-ftz=true``); the NVRTC test adds both explicitly.
"""

from __future__ import annotations

import functools
import os
import threading

import numpy as np

from .._validate import BFLOAT16

_HERE = os.path.dirname(os.path.abspath(__file__))
_HEADER = "sdm_common.cuh"
SOURCES = {"prepass": "sdm_prepass.cu", "fwd": "sdm_fwd.cu", "bwd": "sdm_bwd.cu",
           "batch": "sdm_batch.cu"}

F64, F32, F16 = np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16)
I32, I64 = np.dtype(np.int32), np.dtype(np.int64)
CTYPE = {F64: "double", F32: "float", F16: "__half", BFLOAT16: "__nv_bfloat16",
         I32: "int", I64: "long long"}
FLOATS = (F64, F32, F16, BFLOAT16)
QUANT_CODE = {None: 0, "bf16": 1, "fp8_e4m3": 2, "int8": 3}


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """The source text of ``SOURCES[name]`` with the shared header inlined."""
    with open(os.path.join(_HERE, SOURCES[name])) as f:
        return inline_header(f.read())


def inline_header(text: str, header: str | None = None) -> str:
    """A kernel source's text with the shared header (``header``'s text, else the file's) in
    place of its ``#include``."""
    if header is None:
        with open(os.path.join(_HERE, _HEADER)) as f:
            header = f.read()
    return text.replace(f'#include "{_HEADER}"', header.replace("#pragma once\n", ""))


@functools.lru_cache(maxsize=None)
def include_dir() -> str:
    """The directory holding cuda_fp16.h / cuda_bf16.h / cuda_fp8.h: the CUDA runtime wheel
    first (through cuda.pathfinder), then CUDA_PATH / CUDA_HOME / /usr/local/cuda."""
    candidates = []
    try:
        from cuda import pathfinder
        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            candidates.append(found)
    except Exception:  # noqa: BLE001 - pathfinder missing or too old: try the toolkit paths
        pass
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    for d in candidates:
        if os.path.isfile(os.path.join(d, "cuda_bf16.h")) and \
                os.path.isfile(os.path.join(d, "cuda_fp8.h")):
            return d
    raise RuntimeError(
        "sdm_cupy: cannot find the CUDA headers cuda_bf16.h/cuda_fp8.h (looked in "
        f"{candidates}); install cupy-cuda13x[ctk] (or nvidia-cuda-runtime) or set CUDA_PATH")


def options() -> tuple:
    """NVRTC options; ``SDM_CUPY_NVRTC_OPTIONS`` (space-separated, e.g. ``-lineinfo`` for a
    profiler's source view) is appended."""
    extra = tuple(os.environ.get("SDM_CUPY_NVRTC_OPTIONS", "").split())
    return ("-std=c++17", f"-I{include_dir()}") + extra


def compute_dtype(bank, values):
    return F64 if F64 in (bank, values) else F32


def kernel_value_dtype(bank, values):
    """The values dtype the kernels are instantiated for: the values' own when it equals the
    bank's or the compute dtype, else the compute dtype (the launcher casts)."""
    acc = compute_dtype(bank, values)
    return values if values in (bank, acc) else acc


def vec_width(bank) -> int:
    """Elements per 16-byte piece of a bank row."""
    return 16 // bank.itemsize


def quant_modes(bank):
    """Snapshot modes that shrink a bank dtype (SPEC §5)."""
    modes = [None]
    if bank.itemsize > 2:
        modes.append("bf16")
    modes += ["fp8_e4m3", "int8"]
    return modes


def grad_dtypes(bank, values):
    acc = compute_dtype(bank, values)
    return [F64] if acc == F64 else sorted({F32, bank}, key=lambda d: d.itemsize, reverse=True)


def _t(dt) -> str:
    return CTYPE[np.dtype(dt)]


def fwd_name(bank, vk, idx, q: int, rs: int = 0, sb: int = 0) -> str:
    """The forward's instance; ``rs`` 1: its read rows staged in shared memory (q <= 1);
    ``sb`` 1: it writes sub-chunk snapshots (q == 0)."""
    acc = compute_dtype(bank, vk)
    tail = f",{int(rs)},1" if sb else (",1" if rs else "")
    return (f"sdm::sdm_fwd_kernel<{_t(bank)},{_t(vk)},{_t(acc)},{_t(idx)},{q},"
            f"{vec_width(bank)}{tail}>")


def bwd_name(bank, vk, gt, idx, q: int, ds: int = 0) -> str:
    """The backward's instance; ``ds`` 1: with the dM stage (q == 0)."""
    acc = compute_dtype(bank, vk)
    return (f"sdm::sdm_bwd_kernel<{_t(bank)},{_t(vk)},{_t(acc)},{_t(gt)},{_t(idx)},{q},"
            f"{vec_width(bank)}{',1' if ds else ''}>")


# the largest S whose slot ids fit the pre-pass's 32-bit sort keys (kernels/sdm_prepass.cu's
# KEY32_MAX_S: 2^(32 - QBITS) - 1); above it the launcher takes the 64-bit-key instances
KEY32_MAX_S = (1 << (32 - 14)) - 1


def prepass_name(acc, idx, sparse: int, S: int = 0) -> str:
    """The pre-pass instance for ``sparse`` (1 the forward's form, 2 the backward's) and S slots:
    32-bit sort keys while S <= KEY32_MAX_S, else 64-bit."""
    k64 = ",1" if S > KEY32_MAX_S else ""
    return f"sdm::sdm_prepass_kernel<{_t(acc)},{_t(idx)},{int(sparse)}{k64}>"


def batch_names(bank) -> tuple:
    acc = F64 if bank == F64 else F32
    return (f"sdm::sdm_expand_kernel<{_t(bank)}>", f"sdm::sdm_sum_kernel<{_t(bank)},{_t(acc)}>")


def _value_kinds(bank):
    return sorted({kernel_value_dtype(bank, v) for v in FLOATS}, key=str)


def _names(src: str, key: tuple) -> list:
    if src == "prepass":
        acc, idx = key
        return [prepass_name(acc, idx, sp, S) for sp in (1, 2) for S in (0, KEY32_MAX_S + 1)]
    if src == "batch":
        (bank,) = key
        return list(batch_names(bank))
    bank, vk, idx = key
    if src == "fwd":
        return ([fwd_name(bank, vk, idx, QUANT_CODE[m]) for m in quant_modes(bank)]
                + [fwd_name(bank, vk, idx, QUANT_CODE[m], 1) for m in quant_modes(bank)
                   if QUANT_CODE[m] <= 1]
                + [fwd_name(bank, vk, idx, 0, rs, 1) for rs in (0, 1)])
    return ([bwd_name(bank, vk, gt, idx, QUANT_CODE[m])
             for gt in grad_dtypes(bank, vk) for m in quant_modes(bank)]
            + [bwd_name(bank, vk, gt, idx, 0, 1) for gt in grad_dtypes(bank, vk)])


def module_keys(src: str) -> list:
    if src == "prepass":
        return [(a, i) for a in (F64, F32) for i in (I32, I64)]
    if src == "batch":
        return [(b,) for b in FLOATS]
    return [(b, v, i) for b in FLOATS for v in _value_kinds(b) for i in (I32, I64)]


def module_specs():
    """Every (source name, source text, options, name_expressions) the backend can build."""
    return [(src, source(src), options(), tuple(_names(src, key)))
            for src in SOURCES for key in module_keys(src)]


def nvrtc_compile(src: str, text: str, opts, names, arch: str = "sm_90"):
    """Compiles ``text`` with NVRTC from ``cuda-bindings`` (no GPU needed), plus the ``-arch``
    and ``-ftz=true`` that CuPy adds itself; returns (log, lowered names, cubin bytes).
    Raises RuntimeError on any NVRTC failure (with the log when compilation failed)."""
    from cuda.bindings import nvrtc
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS

    def check(result, what):
        if result[0] != ok:
            raise RuntimeError(f"{src}: {what}: {result[0]}")
        return result[1:]

    (prog,) = check(nvrtc.nvrtcCreateProgram(text.encode(), f"{src}.cu".encode(), 0, [], []),
                    "create")
    try:
        for n in names:
            check(nvrtc.nvrtcAddNameExpression(prog, n.encode()), f"name {n}")
        o = [x.encode() for x in (*opts, f"-arch={arch}", "-ftz=true")]
        err = nvrtc.nvrtcCompileProgram(prog, len(o), o)[0]
        (size,) = check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip("\x00 ")
        if err != ok:
            raise RuntimeError(f"{src}: {err}\n{log[:6000]}")
        lowered = [check(nvrtc.nvrtcGetLoweredName(prog, n.encode()), f"lowered {n}")[0]
                   for n in names]
        (cubin_size,) = check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * cubin_size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return log, lowered, cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_modules: dict = {}
_lock = threading.Lock()


def get_function(src: str, key: tuple, name: str):
    """The compiled kernel ``name`` from the lazily built module of (src, key)."""
    import cupy
    dev = cupy.cuda.Device().id
    k = (dev, src, key)
    mod = _modules.get(k)
    if mod is None:
        with _lock:
            mod = _modules.get(k)
            if mod is None:
                mod = cupy.RawModule(code=source(src), options=options(),
                                     name_expressions=_names(src, key))
                _modules[k] = mod
    return mod.get_function(name)
