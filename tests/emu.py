"""The SDM kernels run on the CPU: a build of ``kernels/*.cu`` with g++ against the CUDA
emulator of ``tests/emu/sdm_emu.h``, and a stand-in for CuPy that lets ``kernels/gpu.py``
launch them on NumPy arrays.

A kernel module is compiled once per (source, dtype key, compiler flags) into a shared library
cached under ``SDM_EMU_CACHE`` (default ``~/.cache/sdm-cupy-emu``), at ``-O0`` unless
``SDM_EMU_OPT`` names another g++ level (``EMU_OPT``); ``SDM_EMU_ASAN=1`` builds
with AddressSanitizer (the process must then run with libasan preloaded: ``asan_env()``).
``SDM_EMU_KERNELS`` names another directory to take the ``.cu`` sources from (the
mutation runs of ``tests/emu/mutants.py``); ``SDM_EMU_MACROS`` adds compile-time options to
the builds of test_emulated_kernels.py's ``emulated`` fixture (a variant against the
reference, e.g. ``SDM_EMU_MACROS=-DSDM_BWD_SOLO``). ``patch(monkeypatch)`` patches ``sdm_cupy.kernels.gpu`` so that ``gpu.sdm_fwd`` /
``gpu.sdm_bwd`` / the batch functions run here, every launch on the emulator with a seed that
orders its blocks and threads. The emulator checks barriers, warp operations and cp.async
waits (see the header); what it cannot see is anything about speed, the memory model between
warps that a barrier does not order, and the device's own float32 behaviour under ``-ftz``
(subnormals are kept here)."""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import re
import subprocess
import sys
import threading
import types

import numpy as np

from sdm_cupy.kernels import _build as K

HERE = os.path.dirname(os.path.abspath(__file__))
EMU_DIR = os.path.join(HERE, "emu")
H200 = (132, 232448, "90")   # SMs, opt-in shared memory per block, arch


def compiler() -> str | None:
    for c in (os.environ.get("CXX"), "g++", "c++"):
        if c:
            try:
                subprocess.run([c, "--version"], capture_output=True, check=True)
                return c
            except (OSError, subprocess.CalledProcessError):
                continue
    return None


def available() -> str | None:
    """None when the emulator can build here, else why not."""
    if sys.platform != "linux":
        return "the emulator's fibers need Linux (ucontext)"
    if compiler() is None:
        return "no C++ compiler (g++)"
    try:
        K.include_dir()
    except RuntimeError as e:
        return str(e)
    return None


def asan() -> bool:
    return os.environ.get("SDM_EMU_ASAN") == "1"


def tsan() -> bool:
    return os.environ.get("SDM_EMU_TSAN") == "1"


def tsan_env() -> dict:
    """The environment for a child process whose emulated kernels run under ThreadSanitizer
    (every unordered pair of accesses by two threads of a block is reported, and fails)."""
    lib = subprocess.run([compiler(), "-print-file-name=libtsan.so"], capture_output=True,
                         text=True, check=True).stdout.strip()
    return dict(os.environ, SDM_EMU_TSAN="1", LD_PRELOAD=lib,
                TSAN_OPTIONS="halt_on_error=1:report_signal_unsafe=0:report_thread_leaks=0:"
                             "exitcode=66")


def asan_env() -> dict:
    """The environment for a child process whose emulated kernels run under AddressSanitizer."""
    lib = subprocess.run([compiler(), "-print-file-name=libasan.so"], capture_output=True,
                         text=True, check=True).stdout.strip()
    env = dict(os.environ, SDM_EMU_ASAN="1", LD_PRELOAD=lib,
               ASAN_OPTIONS="detect_leaks=0:detect_stack_use_after_return=0:"
                            "allocator_may_return_null=1:abort_on_error=0:halt_on_error=1")
    return env


_SMEM = re.compile(r"extern\s+__shared__\s+__align__\(\d+\)\s+unsigned\s+char\s+(\w+)\[\];")


def emu_source(src: str, names, text: str | None = None) -> str:
    """The kernel source made into one C++ translation unit for the emulator: its dynamic
    shared memory taken from the emulator, one extern "C" launcher per instance."""
    if text is None:
        # another copy of kernels/ (tests/emu/mutants.py), else ours; the header inlined between
        # #line marks, so that compiler and sanitizer reports name the .cu/.cuh file and line
        d = os.environ.get("SDM_EMU_KERNELS") or os.path.dirname(K.__file__)
        with open(os.path.join(d, K.SOURCES[src])) as f, open(os.path.join(d, K._HEADER)) as h:
            body, header = f.read(), h.read()
        inc = f'#include "{K._HEADER}"'
        at = body.count("\n", 0, body.index(inc)) + 1
        cu = os.path.join(d, K.SOURCES[src])
        text = (f'#line 1 "{cu}"\n' + body.replace(
            inc, f'#line 1 "{os.path.join(d, K._HEADER)}"\n{header}\n#line {at + 1} "{cu}"', 1))
    text = _SMEM.sub(r"unsigned char* \1 = sdm_emu::S.smem;", text)
    if "__shared__" in re.sub(r"//[^\n]*", "", text):
        raise ValueError(f"{src}: a __shared__ declaration the emulator does not know (it "
                         "takes `extern __shared__ __align__(16) unsigned char name[];`)")
    out = ['#include "sdm_emu.h"', text, ""]
    for i, name in enumerate(names):
        out.append(f'extern "C" int sdm_emu_launch_{i}(void** a, int g, int b, long long s, '
                   f'unsigned long long seed) {{ return sdm_emu::launch(&{name}, a, g, b, s, seed); }}')
    out.append('extern "C" const char* sdm_emu_error() { return sdm_emu::S.error.c_str(); }')
    return "\n".join(out) + "\n"


# g++'s optimisation level for the emulator's builds (``SDM_EMU_OPT`` overrides; the flags
# are part of the cache key). -O0 compiles faster and runs no slower, since the emulated runs
# spend their time switching fibers: tests/test_emulated_kernels.py on a 2-core machine took
# 303 s instead of -O1's 421 s from a cold cache (as CI starts) and 170 s instead of 199 s
# from a warm one, every test passing both ways (stop 42). The values do not depend on the
# level: the kernels' FMAs are fmaf calls.
EMU_OPT = "-O0"


def _flags(macros=()) -> list:
    f = ["-std=c++17", os.environ.get("SDM_EMU_OPT", EMU_OPT), "-fPIC", "-shared", "-w",
         "-DSDM_EMULATE=1", f"-I{EMU_DIR}", f"-I{K.include_dir()}", *macros]
    if asan():
        f += ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]
    if tsan():
        f += ["-fsanitize=thread", "-g"]
    return f


_lock = threading.Lock()
_libs: dict = {}
_key_locks: dict = {}


def cache_dir() -> str:
    d = os.environ.get("SDM_EMU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "sdm-cupy-emu")
    os.makedirs(d, exist_ok=True)
    return d


def build(src: str, key: tuple, macros=(), text: str | None = None, names=None, load=True):
    """The emulator's build of module (src, key): (ctypes library, instance names). ``text``
    and ``names`` replace the source's text and instances (the emulator's own tests);
    ``load=False`` only compiles it into the cache (a sanitizer build loads only in a process
    that runs with the sanitizer's runtime)."""
    names = tuple(K._names(src, key) if names is None else names)
    k = (src, key, tuple(macros), asan(), tsan(), text, names)
    with _lock:
        if k in _libs:
            return _libs[k]
        key_lock = _key_locks.setdefault(k, threading.Lock())
    with key_lock:   # one compile per module; other modules compile meanwhile (prebuild)
        if k in _libs:
            return _libs[k]
        code = emu_source(src, names, text)
        hdr = open(os.path.join(EMU_DIR, "sdm_emu.h")).read()
        flags = _flags(macros)
        h = hashlib.sha256("\0".join([code, hdr, compiler(), *flags]).encode()).hexdigest()[:24]
        so = os.path.join(cache_dir(), f"{src}-{h}.so")
        if not os.path.exists(so):
            cpp = so[:-3] + ".cpp"
            with open(cpp, "w") as f:
                f.write(code)
            tmp = f"{so}.{os.getpid()}.tmp"
            r = subprocess.run([compiler(), *flags, cpp, "-o", tmp], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"emulator build of {src} {key} failed:\n{r.stderr[:6000]}")
            os.replace(tmp, so)
        if not load:
            return None, names
        lib = ctypes.CDLL(so)
        lib.sdm_emu_error.restype = ctypes.c_char_p
        with _lock:
            _libs[k] = (lib, names)
        return lib, names


def module_keys(bank, values, index=np.int32) -> list:
    """The (source, key) pairs a forward+backward with these dtypes launches."""
    bank, values, index = np.dtype(bank), np.dtype(values), np.dtype(index)
    vk = K.kernel_value_dtype(bank, values)
    acc = K.compute_dtype(bank, vk)
    return [("prepass", (acc, index)), ("fwd", (bank, vk, index)), ("bwd", (bank, vk, index))]


def prebuild(pairs, workers: int | None = None, load: bool = True) -> None:
    """Builds these (source, key) modules side by side (g++ runs one core each), so that a
    cold cache costs the longest chain of compiles rather than their sum."""
    from concurrent.futures import ThreadPoolExecutor
    pairs = list(dict.fromkeys(pairs))
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as ex:
        list(ex.map(lambda sk: build(*sk, load=load), pairs))


class EmulatorError(RuntimeError):
    pass


class Function:
    """One kernel instance, called like a CuPy RawKernel: fn(grid, block, args, shared_mem)."""

    def __init__(self, src, key, name, macros=(), seeds=None, log=None, text=None, names=None):
        self.lib, names = build(src, key, macros, text, names)
        self.name = name
        self.fn = getattr(self.lib, f"sdm_emu_launch_{names.index(name)}")
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int,
                            ctypes.c_longlong, ctypes.c_ulonglong]
        self.seeds = seeds
        self.log = log
        self.max_dynamic_shared_size_bytes = 48 * 1024

    def __call__(self, grid, block, args, shared_mem=0):
        # each argument's value in memory of its own: an array's data pointer, a scalar's
        # bytes (for `err`, the word's address)
        cells = []
        for a in args:
            if isinstance(a, np.ndarray):
                cells.append(np.array(a.ctypes.data, np.uintp))
            elif isinstance(a, np.generic):
                cells.append(np.array(a))
            else:
                raise TypeError(f"{self.name}: argument of type {type(a).__name__}")
        ptrs = [c.ctypes.data for c in cells]
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise EmulatorError(f"{self.name}: {shared_mem} bytes of shared memory above the "
                                f"function's limit {self.max_dynamic_shared_size_bytes}")
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        seed = next(self.seeds) if self.seeds is not None else 0
        if self.log is not None:
            self.log.append((self.name, int(grid[0]), int(block[0]), int(shared_mem)))
        rc = self.fn(arr, int(grid[0]), int(block[0]), int(shared_mem), seed)
        if rc:
            raise EmulatorError(f"{self.name}: {self.lib.sdm_emu_error().decode()}")


# CuPy's allocations start 256-byte aligned (its pool rounds them to 512 bytes); malloc's
# only promise 16 bytes. The launcher picks a kernel's 16-byte paths from its arrays' alignment
# (a bf16 bank's float32 dM pieces want 32 bytes), so its stand-ins align the same way:
# otherwise an emulated call took the GPU's path in about half the runs (stop 30).
CUPY_ALIGN = 256


def _device_like(shape, dtype, fill: int):
    dtype = np.dtype(dtype)
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + CUPY_ALIGN, np.uint8)
    at = -raw.ctypes.data % CUPY_ALIGN
    raw[at:at + n] = fill
    return raw[at:at + n].view(dtype).reshape(shape)


def _poisoned_empty(shape, dtype=float):
    """cupy.empty's stand-in: memory that is not zero (all bits set: NaN for floats, -1 for
    ints), so that a kernel reading what nobody wrote is seen."""
    return _device_like(shape, dtype, 0xFF)


def fake_cupy() -> types.ModuleType:
    m = types.ModuleType("cupy")
    m.empty = _poisoned_empty
    m.zeros = lambda shape, dtype=float: _device_like(shape, dtype, 0)
    m.asarray = np.asarray
    m.ndarray = np.ndarray
    m.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(deviceSynchronize=lambda: None))
    return m


def host_arrays(monkeypatch, cupy=None):
    """``sdm_cupy.kernels.gpu`` on NumPy arrays: CuPy replaced by ``cupy`` (default
    fake_cupy()), the device limits an H200's, alignment read from the arrays' data pointers.
    Shared by the emulator and tests/test_launch_args.py (which records launches instead)."""
    from sdm_cupy.kernels import gpu
    monkeypatch.setitem(sys.modules, "cupy", cupy or fake_cupy())
    monkeypatch.setattr(gpu, "_device_limits", lambda: H200)
    monkeypatch.setattr(gpu, "_aligned", lambda x, N: x.ctypes.data % (N * x.itemsize) == 0)
    monkeypatch.setattr(gpu, "_rows16", lambda x, lay, pl: (
        x.ctypes.data % 16 == 0 and (lay.hd * x.itemsize) % 16 == 0
        and (pl.TW * x.itemsize) % 16 == 0))
    gpu._PLANS.clear()


def patch(monkeypatch, seed: int = 0, macros=(), log=None):
    """Makes ``sdm_cupy.kernels.gpu`` launch on the emulator (host_arrays, every launch with
    the next seed from ``seed``). Returns the error word (a NumPy int32 the kernels set)."""
    from sdm_cupy.kernels import gpu
    seeds = itertools.count(seed)
    err = np.zeros(1, np.int32)
    host_arrays(monkeypatch)
    monkeypatch.setattr(gpu, "_error_word", lambda: err.ctypes.data)
    monkeypatch.setattr(gpu, "_err_ptr", err.ctypes.data)
    monkeypatch.setattr(K, "get_function",
                        lambda src, key, name: Function(src, key, name, macros, seeds, log))
    return err
