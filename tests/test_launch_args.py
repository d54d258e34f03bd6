"""The GPU launcher's arguments against the kernels' C++ parameter lists, without a device.

NVRTC compiles every kernel in CI (tests/test_nvrtc.py), but nothing there checks that
``kernels/gpu.py`` passes each kernel what its signature asks: an argument added to a kernel
and not to its launch (or the other way round), an ``int`` passed where the kernel reads a
``long long``, an array of the wrong element type. On a GPU any of these reads garbage or
faults. Here ``gpu.sdm_fwd`` / ``sdm_bwd`` / the batch functions run with CuPy replaced by
NumPy and every launch recorded instead of run; each recorded launch is then checked against
the signature parsed from the ``.cu`` source: the instance is one its module builds, the
argument count, each scalar's exact C type, each array's element type (from the instance's
template arguments), the block size (at most the kernels' ``__launch_bounds__(512)``), the grid
and the shared memory (at most an H200's opt-in limit). With NumPy standing in for CuPy it
cannot tell a host array passed by mistake from a device one: the GPU suite covers that."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import sdm_cupy as sdm
from sdm_cupy._validate import BFLOAT16
from sdm_cupy.kernels import _build as K
from sdm_cupy.kernels import gpu

import emu
from helpers import make_problem

H200 = emu.H200
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CTYPES = {"float": np.dtype(np.float32), "double": np.dtype(np.float64),
          "__half": np.dtype(np.float16), "__nv_bfloat16": BFLOAT16,
          "int": np.dtype(np.int32), "long long": np.dtype(np.int64),
          "unsigned char": np.dtype(np.uint8), "signed char": np.dtype(np.int8),
          "unsigned": np.dtype(np.uint32)}
SNAP = {0: None, 1: "__nv_bfloat16", 2: "unsigned char", 3: "signed char"}   # Snap<T, Q>::type


def _split(text: str) -> list:
    """Comma-separated items, commas inside <...> kept."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return items + [cur]


def _signatures() -> dict:
    """kernel name -> (template parameter names with defaults, [(C type, is_pointer, name)])."""
    out = {}
    pat = re.compile(r"template\s*<([^>]*)>\s*__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?"
                     r"(?:[A-Z_]+\s+)?(\w+)\s*\(([^{]*?)\)\s*\{", re.S)
    for fname in K.SOURCES.values():
        text = open(os.path.join(ROOT, "kernels", fname)).read()
        text = re.sub(r"//[^\n]*", "", text)
        for tparams, name, params in pat.findall(text):
            tps = []
            for tp in tparams.split(","):
                m = re.match(r"\s*(typename|int)\s+(\w+)(?:\s*=\s*(\w+))?", tp)
                tps.append((m.group(2), m.group(3)))
            plist = []
            for p in _split(params):
                p = " ".join(p.replace("__restrict__", "").replace("const ", "").split())
                ptr = "*" in p
                ctype, pname = p.replace("*", " ").rsplit(None, 1)
                plist.append((" ".join(ctype.split()), ptr, pname))
            out[name] = (tps, plist)
    return out


SIGS = _signatures()


def _instance(name: str):
    """'sdm::sdm_fwd_kernel<float,float,float,int,0,4>' -> ('sdm_fwd_kernel', {T: 'float', ...})."""
    m = re.match(r"sdm::(\w+)<(.*)>$", name)
    kernel, targs = m.group(1), [a.strip() for a in m.group(2).split(",")]
    tps, _ = SIGS[kernel]
    assert len(targs) <= len(tps), name
    binding = {}
    for i, (tp, default) in enumerate(tps):
        binding[tp] = targs[i] if i < len(targs) else default
        assert binding[tp] is not None, f"{name}: template parameter {tp} has no value"
    return kernel, binding


def _pointee(ctype: str, binding: dict):
    """The element dtype a pointer parameter of this C type points to, in this instance."""
    m = re.match(r"typename Snap<(\w+), (\w+)>::type$", ctype)
    if m:
        q = int(binding[m.group(2)])
        ctype = SNAP[q] or binding[m.group(1)]
    else:
        ctype = binding.get(ctype, ctype)
    return CTYPES[ctype]


def _check_launch(rec, fuse_dummies: bool):
    src, key, name, grid, smem, args, threads = rec
    assert name in K._names(src, key), f"{name}: not among its module's instances"
    kernel, binding = _instance(name)
    _, params = SIGS[kernel]
    assert len(args) == len(params), (f"{name}: {len(args)} arguments for {len(params)} "
                                      f"parameters {[p[2] for p in params]}")
    for (ctype, ptr, pname), arg in zip(params, args):
        where = f"{kernel}({pname})"
        if ptr:
            if pname == "err":   # the host-mapped error word's device address
                assert type(arg) is np.uint64, where
                continue
            assert isinstance(arg, np.ndarray), f"{where}: {type(arg).__name__}, not an array"
            dummy = ((pname == "scale" and int(binding.get("Q", 0)) < 2)   # 1-byte modes only
                     or (fuse_dummies and pname in ("sp_ptr", "sp_col", "sp_val", "wrun_g")))
            if not dummy:
                want = _pointee(ctype, binding)
                assert arg.dtype == want, \
                    f"{where}: an array of {arg.dtype}, the kernel reads {want}"
        else:
            want = CTYPES[binding.get(ctype, ctype)]
            assert isinstance(arg, np.generic) and arg.dtype == want, \
                f"{where}: {type(arg).__name__}, the kernel reads {ctype}"
    a = {pname: arg for (_, _, pname), arg in zip(params, args)}
    if kernel == "sdm_fwd_kernel" and int(binding["RS"]):
        # RS = 1 instances hold the fast path alone and check nothing on the device: the
        # launcher's rule is their only guard (kernels/sdm_fwd.cu)
        N = int(binding["N"])
        assert a["vecmask"] & 1 and (a["vecmask"] & 8 or not a["save"]), f"{name}: unaligned"
        assert a["keep"] == 1 and a["fuse"] == 0 and int(binding["Q"]) <= 1, name
        assert a["hd"] % N == 0 and a["TW"] % N == 0, f"{name}: partial pieces"
    if kernel == "sdm_prepass_kernel":
        # 32-bit sort keys only while the slot ids fit them (the 32-bit instance traps above)
        assert int(binding["K64"]) == int(a["S"] > K.KEY32_MAX_S), f"{name}: S = {a['S']}"
    if kernel == "sdm_bwd_kernel":
        # the launcher's own arrays (snapshots, dM, d_values) start 256-byte aligned on a GPU
        # (CuPy's allocator) and in tests/emu.py's stand-ins: whole pieces, the 16-byte paths
        # (a bf16 bank's float32 dM pieces want 32 bytes; malloc's 16 took them in half the
        # runs before stop 30)
        if a["hd"] % int(binding["N"]) == 0:
            assert a["vecmask"] & (8 | 16 | 64) == 8 | 16 | 64, f"{name}: {a['vecmask']:#x}"
    assert 1 <= grid <= 2 ** 31 - 1, f"{name}: grid {grid}"
    assert threads % 32 == 0 and 32 <= threads <= 512, f"{name}: {threads} threads"
    assert 0 <= smem <= H200[1], f"{name}: {smem} bytes of shared memory"


@pytest.fixture
def recorded(monkeypatch):
    """CuPy replaced by NumPy, the device's limits by an H200's, and every launch recorded."""
    fake = emu.fake_cupy()
    # zeros for empty too: nothing runs, and casting uninitialised memory warns
    fake.empty = fake.zeros
    emu.host_arrays(monkeypatch, fake)
    monkeypatch.setattr(gpu, "_err_array", lambda: np.uint64(1 << 40))
    calls = []

    def launch(src, key, name, grid, smem, args, threads=None):
        calls.append((src, key, name, grid, smem, args, threads or gpu.THREADS))

    def get_function(src, key, name):
        def fn(grid, block, args, shared_mem=0):
            calls.append((src, key, name, grid[0], shared_mem, args, block[0]))
        return fn

    monkeypatch.setattr(gpu, "_launch", launch)
    monkeypatch.setattr(K, "get_function", get_function)
    gpu._PLANS.clear()
    yield calls
    gpu._PLANS.clear()


SMALL = dict(B=2, T=70, P=2, hd=32, S=40, W=5)
CASES = {   # name: (make_problem arguments, SDMConfig arguments, gpu knobs)
    "f64": (dict(SMALL), {}, {}),
    "f32": (dict(SMALL, dtype=np.float32), {}, {}),
    "bf16-staged": (dict(SMALL, dtype=BFLOAT16), {}, {"STAGE_READS": True}),
    "bf16-kept": (dict(SMALL, dtype=BFLOAT16), {}, {"STAGE_READS": False}),
    "f16-reread": (dict(SMALL, dtype=np.float16), {}, {"STAGE_READS": False,
                                                       "KEEP_ROWS": False}),
    "f32-bank-bf16-values": (dict(SMALL, dtype=np.float32, value_dtype=BFLOAT16), {}, {}),
    "bf16-bank-f64-values": (dict(SMALL, dtype=BFLOAT16, value_dtype=np.float64), {}, {}),
    "hd36-tile8": (dict(SMALL, hd=36, dtype=np.float32), {}, {"TILE_WIDTH": 8}),
    "int64-ids": (dict(SMALL, dtype=np.float32, index_dtype=np.int64), {}, {}),
    "decode-W40": (dict(B=2, T=1, P=2, hd=24, S=20, W=40), {"chunk_size": 1}, {}),
    "decode-W80": (dict(B=2, T=1, P=2, hd=24, S=20, W=80), {"chunk_size": 1}, {}),
    "quant-bf16": (dict(SMALL, dtype=np.float32), {"snapshot_quant": "bf16"}, {}),
    "quant-fp8": (dict(SMALL, dtype=BFLOAT16), {"snapshot_quant": "fp8_e4m3"}, {}),
    "quant-int8": (dict(SMALL, dtype=np.float32), {"snapshot_quant": "int8"}, {}),
    "grad-bank-bf16": (dict(SMALL, dtype=BFLOAT16), {"grad_bank_fp32": False}, {}),
    "bwd-256": (dict(SMALL, dtype=np.float32), {}, {"BWD_THREADS": 256}),
    "headline-bf16": (dict(B=4, T=128, P=8, hd=128, S=1024, W=16, dtype=BFLOAT16), {}, {}),
    # the pre-pass's 64-bit sort keys (S above K.KEY32_MAX_S)
    "S-key64": (dict(B=1, T=20, P=1, hd=8, S=K.KEY32_MAX_S + 1, W=4, dtype=np.float32), {}, {}),
}


@pytest.mark.parametrize("case", list(CASES) + ["bf16-staged-misaligned-bank"])
def test_every_launch_matches_its_kernels_signature(recorded, monkeypatch, case):
    """Also: a forward's fast-path-only instance (RS = 1) only where its conditions hold; a
    bank that starts one element past a 16-byte boundary gets the general instance."""
    misaligned = case.endswith("-misaligned-bank")
    pkw, ckw, knobs = CASES[case.replace("-misaligned-bank", "")]
    for k, v in knobs.items():
        monkeypatch.setattr(gpu, k, v)
    pb = make_problem(np.random.default_rng(0), **pkw)
    cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, **{"chunk_size": 64, **ckw})
    lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
    wd, idx = lay.weight_dtype, lay.index_dtype
    inputs = (pb.write_idx.astype(idx), pb.write_w.astype(wd), pb.values,
              pb.beta.astype(wd), pb.read_idx.astype(idx), pb.read_w.astype(wd))
    bank = pb.bank.copy()
    if misaligned:   # the same values, one element past a 16-byte boundary
        buf = np.empty(bank.size + 1, bank.dtype)
        bank = buf[1:].reshape(bank.shape)
        bank[...] = pb.bank
        assert bank.flags.c_contiguous and bank.ctypes.data % 16 != 0
    gpu.check_config(lay, cfg)
    _, snaps = gpu.sdm_fwd(lay, cfg, bank, *inputs, save_snapshots=True)
    gpu.check_backward(lay, cfg, snaps)
    dr = np.zeros(pb.values.shape, lay.value_dtype)
    gpu.sdm_bwd(lay, cfg, bank, inputs, snaps, dr, None)
    gpu.sdm_fwd(lay, cfg, bank, *inputs, save_snapshots=False)
    fuse = cfg.chunk_size == 1 and lay.W <= gpu.FUSE_MAX_W
    kinds = [rec[0] for rec in recorded]
    assert kinds.count("fwd") == 2 and kinds.count("bwd") >= 1, kinds
    for rec in recorded:
        _check_launch(rec, fuse_dummies=fuse and rec[0] == "fwd")
    # the staged instances: template argument RS (the 7th) is 1
    staged = [n.split("<", 1)[1].rstrip(">").split(",")[6:7] == ["1"]
              for n in (rec[2] for rec in recorded if rec[0] == "fwd")]
    if misaligned:
        assert not any(staged), recorded
    elif case == "bf16-staged":   # the fast path where it holds (else this test checks nothing)
        assert any(staged), recorded
    k64 = {_instance(n)[1]["K64"] == "1" for src, _, n, *_ in recorded if src == "prepass"}
    assert k64 == {case == "S-key64"}, k64


def test_batch_launches_match_their_kernels_signature(recorded):
    for dt in (np.float64, np.float32, np.float16, BFLOAT16):
        param = np.zeros((5, 8), dt)
        gpu.expand_memory_batch(param, 3)
        gpu.sum_memory_batch(np.zeros((15, 8), dt), 5)
    assert len(recorded) == 8
    for rec in recorded:
        _check_launch(rec, fuse_dummies=False)


def test_a_wrong_launch_is_caught(recorded):
    """The checker itself: a launch with one argument missing, an int where the kernel reads a
    long long, and an array of the wrong element type are each refused."""
    name = K.batch_names(np.dtype(np.float32))[0]
    key = (np.dtype(np.float32),)
    good = ("batch", key, name, 4, 0, (np.zeros(3, np.float32), np.zeros(3, np.float32),
                                      np.int64(3), np.int32(1)), 256)
    _check_launch(good, False)
    bad = [good[:5] + (good[5][:3],) + good[6:],
           good[:5] + (good[5][:2] + (np.int32(3), np.int32(1)),) + good[6:],
           good[:5] + ((np.zeros(3, np.float64),) + good[5][1:],) + good[6:]]
    for b in bad:
        with pytest.raises(AssertionError):
            _check_launch(b, False)
