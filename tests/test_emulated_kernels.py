"""The CUDA kernels themselves, run on the CPU by the emulator of ``tests/emu`` (marker
``emu``; no GPU needed, so CI runs them).

``kernels/gpu.py`` launches ``kernels/*.cu`` here exactly as on a device (same plans, instances,
arguments, block sizes and shared memory), with every CUDA thread a fiber and the blocks and
threads in a seeded random order. Checked: the float64 reference (readings, final bank, every
gradient, the bank rewound bit for bit) over the launcher's paths; quantized snapshots against
the CPU backend; bad ids skipped, flagged and kept inside the bank; the forward bitwise the same
whatever the order of blocks and threads. ``test_kernels_under_address_sanitizer`` runs a set of
these again in a child process with AddressSanitizer watching every global and shared access;
``test_no_unknown_race_under_thread_sanitizer`` runs ``tests/emu/racecheck.py`` (ThreadSanitizer:
any unordered pair of accesses inside a block that is not a known harmless race fails).
The emulator's own checks (a barrier not every thread reaches, a cp.async read before its
wait) have tests of their own at the end. Not covered here: speed, and float32 subnormals under
the device's ``-ftz`` (the GPU suite covers both)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import early
import emu
import sdm_cupy as sdm
from helpers import (BF16, assert_close, make_problem, near_key_limit, reference_bwd,
                     reference_fwd, spread_magnitudes)

_why = emu.available()
pytestmark = [pytest.mark.emu, pytest.mark.skipif(_why is not None, reason=str(_why))]

GRADS = ("bank", "write_w", "values", "beta", "read_w")
TOL = {np.dtype(np.float64): (1e-9, 1e-9), np.dtype(np.float32): (1e-4, 1e-4),
       np.dtype(np.float16): (3e-2, 5e-2), BF16: (3e-2, 5e-2)}   # (forward, gradients)


@pytest.fixture(scope="module", autouse=True)
def _prebuilt():
    """Every module these tests launch, compiled side by side before the first test (under
    AddressSanitizer: those of its subset)."""
    if _why is not None or emu.tsan():
        return
    combos = [(np.float64, np.float64), (np.float32, np.float32), (BF16, BF16)]
    if not emu.asan():
        combos += [(np.float16, np.float16), (BF16, np.float64)]
    pairs = [p for b, v in combos for p in emu.module_keys(b, v)]
    if not emu.asan():
        pairs += emu.module_keys(np.float32, np.float32, np.int64)
        pairs += [("batch", (np.dtype(d),)) for d in (np.float64, np.float32, np.float16, BF16)]
    emu.prebuild(pairs)


@pytest.fixture
def emulated(monkeypatch):
    """gpu.* launching on the emulator; returns (the knob setter, the error word).
    SDM_EMU_MACROS="-DNAME ..." builds every kernel with those compile-time options: the
    tests on this fixture then check a variant against the reference (stop 49: both solo
    forms of the backward, 74 passed)."""
    from sdm_cupy.kernels import gpu
    err = emu.patch(monkeypatch, seed=int.from_bytes(os.urandom(4), "little"),
                    macros=tuple(os.environ.get("SDM_EMU_MACROS", "").split()))

    def knobs(**kw):
        for k, v in kw.items():
            monkeypatch.setattr(gpu, k, v)
    yield knobs, err
    gpu._PLANS.clear()


def _inputs(pb, lay):
    """The op's inputs in the layout's index and weight dtypes (what sdm.forward passes on)."""
    wd, idx = lay.weight_dtype, lay.index_dtype
    return (pb.write_idx.astype(idx), pb.write_w.astype(wd), pb.values,
            pb.beta.astype(wd), pb.read_idx.astype(idx), pb.read_w.astype(wd))


@contextlib.contextmanager
def _gpu_knobs(**kw):
    """gpu knobs set for the block only (plans forgotten on the way out)."""
    from sdm_cupy.kernels import gpu
    old = {k: getattr(gpu, k) for k in kw}
    try:
        for k, v in kw.items():
            setattr(gpu, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(gpu, k, v)
        gpu._PLANS.clear()


def _run(pb, cfg, dr, dM, bank=None, saved=None):
    """gpu.sdm_fwd with snapshots, then gpu.sdm_bwd: (readings, final bank, grads, rewound).
    A list ``saved`` receives the snapshots (copies of the arrays, and their chunk)."""
    from sdm_cupy.kernels import gpu
    lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
    inputs = _inputs(pb, lay)
    if bank is None:
        bank = pb.bank.copy()
    gpu.check_config(lay, cfg)
    r, snaps = gpu.sdm_fwd(lay, cfg, bank, *inputs, save_snapshots=True)
    fin = bank.copy()
    if saved is not None:
        saved.append(([None if a is None else a.copy() for a in snaps], snaps.chunk))
    gpu.check_backward(lay, cfg, snaps)
    g = gpu.sdm_bwd(lay, cfg, bank, inputs, snaps, dr.astype(lay.value_dtype),
                    None if dM is None else dM.astype(lay.grad_bank_dtype))
    return r, fin, g, bank


def _cfg(pb, C=64, **kw):
    return sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size=C, **kw)


SMALL = dict(B=2, T=70, P=2, hd=32, S=40, W=5)
CASES = {   # name: (make_problem arguments, SDMConfig arguments, gpu knobs)
    "f64-C16-tile6": (dict(B=2, T=37, P=2, hd=20, S=40, W=5), dict(C=16), dict(TILE_WIDTH=6)),
    "f64-C5-repeated": (dict(B=2, T=37, P=2, hd=20, S=6, W=4), dict(C=5), {}),
    "f64-C1": (dict(B=2, T=9, P=2, hd=20, S=40, W=5), dict(C=1), {}),
    "f64-B1-P1-W1": (dict(B=1, T=45, P=1, hd=8, S=7, W=1), dict(C=16), {}),
    "f32": (dict(SMALL, dtype=np.float32), {}, {}),
    "f32-bwd-ranges-256": (dict(SMALL, dtype=np.float32), dict(C=8),
                           dict(BWD_SCRATCH=1, BWD_THREADS=256)),
    "f32-bwd-tile4-96": (dict(SMALL, dtype=np.float32), dict(C=8),
                         dict(BWD_THREADS=96, BWD_TILE_WIDTH=4)),
    "bf16-staged": (dict(SMALL, dtype=BF16), {}, dict(STAGE_READS=True)),
    "bf16-kept": (dict(SMALL, dtype=BF16), {}, dict(STAGE_READS=False)),
    "bf16-hd20-partial": (dict(B=1, T=50, P=3, hd=20, S=64, W=4, dtype=BF16), dict(C=16), {}),
    "f16-reread": (dict(SMALL, dtype=np.float16), {}, dict(STAGE_READS=False, KEEP_ROWS=False)),
    "f32-bank-bf16-values": (dict(SMALL, dtype=np.float32, value_dtype=BF16), {}, {}),
    "bf16-bank-f64-values": (dict(SMALL, dtype=BF16, value_dtype=np.float64), {}, {}),
    "f32-hd36-tile8": (dict(SMALL, hd=36, dtype=np.float32), {}, dict(TILE_WIDTH=8)),
    "f32-int64-ids": (dict(SMALL, dtype=np.float32, index_dtype=np.int64), {}, {}),
    "f32-decode-W40": (dict(B=2, T=3, P=2, hd=24, S=20, W=40, dtype=np.float32), dict(C=1), {}),
    "f32-decode-W80": (dict(B=2, T=3, P=2, hd=24, S=20, W=80, dtype=np.float32), dict(C=1), {}),
    "bf16-grad-bank-bf16": (dict(SMALL, dtype=BF16), dict(grad_bank_fp32=False), {}),
    "bf16-W16-hd128": (dict(B=1, T=80, P=2, hd=128, S=300, W=16, dtype=BF16), {}, {}),
    # sub-chunk snapshots (the forward keeps its chunk, the backward walks halves of it) with
    # the backward's dM stage (gpu.BWD_DM_HALVE, off by default): T not a multiple of either
    # chunk
    "f32-W32-sub": (dict(B=1, T=101, P=2, hd=32, S=300, W=32, dtype=np.float32), {},
                    dict(BWD_DM_HALVE=True)),
    "f64-W32-sub": (dict(B=1, T=70, P=1, hd=32, S=200, W=32), {}, dict(BWD_DM_HALVE=True)),
    "bf16-W16-hd64-sub": (dict(B=2, T=75, P=1, hd=64, S=40, W=16, dtype=BF16), {},
                          dict(BWD_DM_HALVE=True)),
    # the same without kept rows: the scatter re-reads the bank rows (its other form)
    "f32-W32-sub-reread": (dict(B=1, T=101, P=2, hd=32, S=300, W=32, dtype=np.float32), {},
                           dict(STAGE_READS=False, KEEP_ROWS=False, BWD_DM_HALVE=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_reference(rng, emulated, case):
    knobs, err = emulated
    pkw, ckw, kn = CASES[case]
    knobs(**kn)
    pb = make_problem(rng, **pkw)
    # the coarser of the bank's and the values' dtypes (readings come in the values' dtype)
    ftol, gtol = max(TOL[pb.bank.dtype], TOL[pb.values.dtype])
    cfg = _cfg(pb, **ckw)
    if "-sub" in case:   # the case exists for this path: it must take it
        from sdm_cupy.kernels import gpu
        lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
        assert gpu.plan(lay, cfg, quant=None, saves=True).sub, f"{case}: no sub-chunks"
    dr = rng.normal(size=pb.values.shape)
    dM = rng.normal(size=pb.bank.shape) if "grad_bank_fp32" not in ckw else None
    _assert_reference(pb, cfg, dr, dM, ftol, gtol, err)


def _assert_reference(pb, cfg, dr, dM, ftol, gtol, err):
    """The emulated forward and backward of ``pb`` against the float64 reference: readings,
    final bank, gradients, the bank rewound bitwise, and no error flagged."""
    r, fin, g, rewound = _run(pb, cfg, dr, dM)
    r_ref, fin_ref = reference_fwd(pb)
    assert_close(r, r_ref, ftol, "readings")
    assert_close(fin, fin_ref, ftol, "final bank")
    for name, got, want in zip(GRADS, g, reference_bwd(pb, dr, dM)):
        assert_close(got, want, gtol, f"grad {name}")
    assert np.array_equal(rewound.view(np.uint8), pb.bank.view(np.uint8)), "rewound bank"
    assert err[0] == 0, f"error word {err[0]} with valid ids"


@pytest.mark.parametrize("S", [262143, 263144], ids=["32bit-keys", "64bit-keys"])
def test_prepass_key_widths_match_reference(rng, emulated, S):
    """The pre-pass instance with 32-bit sort keys (S <= 262143) and the one with 64-bit keys
    (above), on slots next to the limit repeated within and across tokens (the pool also holds
    262143 and 262144 where S allows: the first slots whose keys need more than 32 bits)."""
    _, err = emulated
    pb = near_key_limit(rng, S)
    dr = rng.normal(size=pb.values.shape)
    dM = rng.normal(size=pb.bank.shape)
    _assert_reference(pb, _cfg(pb, 16), dr, dM, *TOL[pb.bank.dtype], err)


QUANT = {"f32-bf16": (np.float32, "bf16"), "f32-fp8": (np.float32, "fp8_e4m3"),
         "f32-int8": (np.float32, "int8"), "bf16-fp8": (BF16, "fp8_e4m3"),
         "bf16-int8-hd20": (BF16, "int8")}


@pytest.mark.parametrize("case", list(QUANT))
def test_quantized_snapshots_match_the_cpu_backend(rng, emulated, case):
    """The rewind through bf16 / fp8 / int8 snapshots: the emulated kernels' gradients and
    rewound bank against the CPU backend's (same quantization, SPEC §5).

    The two backends' banks differ in last bits (their sums run in other orders), so a
    snapshot value on a rounding boundary may take the neighbouring code: one int8 code in
    44,800 at seed 54121494, which moved a read-weight grad by 0.03 (stop 35). So the codes
    must agree to one step (or, for a value that cancels to near zero, whose steps are finer
    than the banks' differences, in value to a bank rounding of its row's largest: 2^-17 of
    it for a float32 bank, 2^-7 for a bfloat16 one), in at most one entry in a thousand, and
    the scales to float rounding; then both backwards run on the emulated kernels' codes,
    which the CPU backend's saved snapshots take over."""
    dtype, mode = QUANT[case]
    hd = 20 if case.endswith("hd20") else 32
    pb = make_problem(rng, **dict(SMALL, hd=hd, dtype=dtype))
    cfg = _cfg(pb, 16, snapshot_quant=mode)
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    saved = []
    r, fin, g, rewound = _run(pb, cfg, dr, None, saved=saved)
    (codes, scales), chunk = saved[0]
    res = sdm.forward(*pb.args(), cfg)   # NumPy arrays: the CPU backend
    cs = res.saved.snapshots
    assert cs.chunk == chunk, "the backends saved snapshots for other chunks"
    cpu_codes = np.swapaxes(cs[0], 1, 2)   # [B, P, T, W, hd] -> the kernels' [B, T, P, W, hd]

    def steps(a):   # codes as integers whose neighbours differ by one
        return a.astype(np.int64) if a.dtype.kind == "i" else \
            a.view(f"u{a.dtype.itemsize}").astype(np.int64)

    d = np.abs(steps(codes) - steps(cpu_codes))

    def values(x):   # what the codes stand for, both backends' codes decoded alike
        if mode == "bf16":
            v = x.view(np.uint16).view(BF16).astype(np.float64)
        elif mode == "fp8_e4m3":
            v = x.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        else:
            v = x.view(np.int8).astype(np.float64)
        return v if scales is None else v * scales[..., None].astype(np.float64)

    # a value that cancels to near zero has steps far finer than the banks' differences:
    # 3e-6 in a row of 1.6 at seed 681237192 (bf16 codes of a float32 bank); -0.0023 against
    # -0.0034 in a row of 1.7 at seed 2550351141 (fp8 codes of a bfloat16 bank, whose rows
    # the two backends round from float32 sums in other orders: 2^-8 of 1.7 is 0.0066). There
    # the values must agree to a bank rounding of their row's largest: 2^-17 of it for a
    # float32 bank (2^9 times finer than a bf16 step there), 2^-7 for a bfloat16 bank
    a, b = values(codes), values(cpu_codes)
    row = np.abs(a).max(axis=-1, keepdims=True)
    tol = 2.0 ** -17 if np.dtype(dtype) == np.float32 else 2.0 ** -7
    far = (d > 1) & (np.abs(a - b) > tol * row)
    assert not far.any(), \
        f"snapshot codes differ by {d[far].max()} steps at {np.argwhere(far)[:3].tolist()}"
    assert np.count_nonzero(d) <= d.size // 1000, f"{np.count_nonzero(d)} codes of {d.size} differ"
    if scales is not None:
        assert_close(scales, np.swapaxes(cs[1], 1, 2), 1e-6, "snapshot scales gpu vs cpu")
        cs[1][...] = np.swapaxes(scales, 1, 2)
    u = f"u{codes.dtype.itemsize}"   # the bits (the backends may name fp8 codes differently)
    cs[0].view(u)[...] = np.swapaxes(codes.view(u), 1, 2)
    gc = sdm.backward(res.saved, dr)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    assert_close(r, res.readings, tol, "readings gpu vs cpu")
    for name, got in zip(GRADS, g):
        assert_close(got, getattr(gc, name), tol, f"grad {name} gpu vs cpu")
    assert_close(rewound, res.bank, tol, "rewound bank gpu vs cpu")


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float64])
@pytest.mark.parametrize("mode", ["fp8_e4m3", "int8", "bf16"])
def test_snapshot_codes_are_the_cpu_backends_at_every_magnitude(rng, emulated, dtype, mode):
    """The stored snapshot rows (codes and scales) of the first chunk, bit for bit the CPU
    backend's, for slots from 1e-44 (float32 subnormal) to 1e30 in magnitude: the rule of
    cpu_formats holds for tiny rows (a float32 qmax / absmax would overflow) and float64 rows
    round to bfloat16 once. The rewound bank (each written slot decoded from the snapshot of
    its first write) is the CPU's bit for bit too, except that the GPU decodes bytes in
    float32, so a float64 bank's agrees to float32 rounding."""
    if mode == "bf16" and dtype == BF16:
        pytest.skip("bf16 snapshots do not shrink a bfloat16 bank")
    pb = make_problem(rng, **dict(SMALL, dtype=dtype))
    spread_magnitudes(pb)
    C = 16
    cfg = _cfg(pb, C, snapshot_quant=mode)
    lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
    from sdm_cupy.kernels import gpu
    gpu.check_config(lay, cfg)
    bank, inputs = pb.bank.copy(), _inputs(pb, lay)
    _, snaps = gpu.sdm_fwd(lay, cfg, bank, *inputs, save_snapshots=True)
    res = sdm.forward(*pb.args(), cfg)
    rows, scales = (None if a is None else a.copy() for a in res.saved.snapshots)
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    gpu.check_backward(lay, cfg, snaps)
    gpu.sdm_bwd(lay, cfg, bank, inputs, snaps, dr, None)
    sdm.backward(res.saved, dr)
    if dtype == np.float64 and mode != "bf16":
        assert_close(bank, res.bank, 1e-7, "rewound bank")
    else:
        assert np.array_equal(bank.view(np.uint8), res.bank.view(np.uint8)), "rewound bank"
    grow = np.asarray(snaps[0]).transpose(0, 2, 1, 3, 4)[:, :, :C]   # [B, T, P, W, hd] -> P, T
    crow = rows[:, :, :C]
    assert np.array_equal(grow.view(np.uint8), crow.view(np.uint8)), f"{mode}: codes differ"
    if mode != "bf16":
        gsc = np.asarray(snaps[1]).transpose(0, 2, 1, 3)[:, :, :C]
        assert np.array_equal(gsc.view(np.uint32), scales[:, :, :C].view(np.uint32)), "scales"
        assert (scales[:, :, :C] > 0).mean() > 0.5


@pytest.mark.parametrize("case", [(1, np.float64, 40, 16, 4), (8, np.float64, 40, 16, 4),
                                  (64, np.float32, 150, 32, 12), (64, BF16, 150, 32, 12)],
                         ids=["C1-f64", "C8-f64", "C64-f32", "C64-bf16"])
def test_bad_ids_are_skipped_flagged_and_stay_in_bounds(rng, emulated, case):
    """Ids outside [0, S) (what check_indices=False lets through): the error word is set, the
    entry counts as weight 0, and nothing outside the bank is read into or written."""
    _, err = emulated
    C, dtype, T, hd, W = case
    pb = make_problem(rng, B=2, T=T, P=2, hd=hd, S=32 if W == 4 else 300, W=W, dtype=dtype)
    bad_w, bad_r = pb.write_idx.copy(), pb.read_idx.copy()
    bad_w[0, 3, 1, 2] = pb.S
    bad_w[1, 7, 0, 0] = -5
    bad_r[1, 30, 1, 3] = 10 ** 6
    bad_r[0, T - 1, 0, W - 1] = pb.S + 7
    bad_w[1, T - 2, 1, W - 1] = 10 ** 6
    bad_r[1, T // 2, 0, 0] = -1
    pad = 8
    big = rng.normal(size=(2 * pad + pb.B * pb.S, pb.P * pb.hd)).astype(dtype)
    big[pad:pad + pb.B * pb.S] = pb.bank
    guard = big.copy()
    bank = big[pad:pad + pb.B * pb.S]
    bad = dataclasses.replace(pb, write_idx=bad_w, read_idx=bad_r)
    dr = rng.normal(size=pb.values.shape)
    r, fin, g, rewound = _run(bad, _cfg(pb, C), dr, None, bank=bank)
    assert err[0] != 0, "bad ids did not set the error word"
    mask_w, mask_r = (bad_w < 0) | (bad_w >= pb.S), (bad_r < 0) | (bad_r >= pb.S)
    fixed = dataclasses.replace(pb, write_idx=np.where(mask_w, 0, bad_w),
                                read_idx=np.where(mask_r, 0, bad_r),
                                write_w=np.where(mask_w, 0, pb.write_w),
                                read_w=np.where(mask_r, 0, pb.read_w))
    ftol, gtol = TOL[np.dtype(dtype)]
    r_ref, fin_ref = reference_fwd(fixed)
    assert_close(r, r_ref, ftol, "readings with skipped ids")
    assert_close(fin, fin_ref, ftol, "final bank with skipped ids")
    outside = np.r_[0:pad, pad + pb.B * pb.S:2 * pad + pb.B * pb.S]
    assert np.array_equal(big[outside].view(np.uint8), guard[outside].view(np.uint8)), \
        "rows outside the bank were written"
    assert np.array_equal(rewound.view(np.uint8), pb.bank.view(np.uint8)), "rewound bank"
    want = reference_bwd(fixed, dr, None)
    assert_close(g[2], want[2], gtol, "grad values with skipped ids")
    assert_close(g[0], want[0], gtol, "grad bank with skipped ids")
    assert float(abs(g[1][mask_w]).max()) == 0.0 and float(abs(g[4][mask_r]).max()) == 0.0


@pytest.mark.parametrize("case", [c for c in CASES if "-sub" in c])
def test_sub_chunk_snapshots_in_the_scatter_are_the_separate_passes(rng, monkeypatch, case):
    """The forward stores a sub-chunk's snapshots during its scatter's walk of each run; the
    separate pass before the scatter (-DSDM_FWD_SUB_SEPARATE, its benchmark form) walks the
    same runs in the same order. Readings, final bank and every snapshot bit for bit the same,
    with and without kept rows."""
    from sdm_cupy.kernels import gpu
    pkw, ckw, kn = CASES[case]
    for k, v in kn.items():
        monkeypatch.setattr(gpu, k, v)
    # S small against C * W: slots repeat across the backward's sub-chunks and within them
    pb = make_problem(rng, **dict(pkw, S=min(pkw["S"], 24)))
    cfg = _cfg(pb, **ckw)
    lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
    emu.patch(monkeypatch)
    pl = gpu.plan(lay, cfg, quant=None, saves=True)
    assert pl.sub, f"{case}: no sub-chunks"
    assert pl.keep == ("reread" not in case), f"{case}: kept rows {pl.keep}"
    inputs = _inputs(pb, lay)
    outs = []
    for macros in ((), ("-DSDM_FWD_SUB_SEPARATE",), ("-DSDM_FWD_NO_SUB_PASS",)):
        emu.patch(monkeypatch, seed=len(outs) * 7919 + 1, macros=macros)
        bank = pb.bank.copy()
        r, snaps = gpu.sdm_fwd(lay, cfg, bank, *inputs, save_snapshots=True)
        outs.append([a.view(np.uint8).copy() for a in (r, bank, snaps[0])])
    gpu._PLANS.clear()
    for name, a, b in zip(("readings", "final bank", "snapshots"), outs[0], outs[1]):
        assert np.array_equal(a, b), f"{name}: the scatter's form and the separate pass differ"
    # not vacuous: without either, the snapshots of slots written in earlier sub-chunks are M0
    assert not np.array_equal(outs[0][2], outs[2][2]), "no snapshot of a later sub-chunk"


def _staged_forward_against(rng, monkeypatch, case, macros, seed, what, knobs=None):
    """The staged forward of CASES[case] (slots repeated within a chunk; ``knobs`` set more
    gpu knobs) built as it is and with ``macros``: readings, final bank and snapshots bit for
    bit the same, and the first build's readings and final bank against the float64
    reference. Returns the plan and the problem."""
    from sdm_cupy.kernels import gpu
    pkw, ckw, kn = CASES[case]
    for k, v in dict(kn, **(knobs or {})).items():
        monkeypatch.setattr(gpu, k, v)
    pb = make_problem(rng, **dict(pkw, S=min(pkw["S"], 24)))
    cfg = _cfg(pb, **ckw)
    lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
    emu.patch(monkeypatch)
    pl = gpu.plan(lay, cfg, quant=None, saves=True)
    assert pl.rstage and pl.keep, f"{case}: not the staged plan"
    inputs = _inputs(pb, lay)
    outs = []
    for ms in ((), macros):
        emu.patch(monkeypatch, seed=len(outs) * 7919 + seed, macros=ms)
        bank = pb.bank.copy()
        r, snaps = gpu.sdm_fwd(lay, cfg, bank, *inputs, save_snapshots=True)
        outs.append([a.copy() for a in (r, bank, snaps[0])])
    gpu._PLANS.clear()
    for name, a, b in zip(("readings", "final bank", "snapshots"), *outs):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{name}: {what} differ"
    r_ref, fin_ref = reference_fwd(pb)
    ftol = TOL[np.dtype(pb.bank.dtype)][0]
    assert_close(outs[0][0], r_ref, ftol, "readings")
    assert_close(outs[0][1], fin_ref, ftol, "final bank")
    return pl, pb


@pytest.mark.parametrize("case", ["bf16-staged", "bf16-W16-hd128"])
def test_split_wait_is_bitwise_one_wait(rng, monkeypatch, case):
    """The staged forward copies its write rows and its read rows as two commit groups and sums
    X after the first has landed, Y after the second; -DSDM_FWD_ONE_WAIT copies both as one
    group and sums both in one pass. The emulator lands a copy only at the wait that covers
    it, so a pass that read a row before its group's wait would read a stale one. Readings,
    final bank and snapshots bit for bit the same, with repeated slots, on a staged plan."""
    _staged_forward_against(rng, monkeypatch, case, ("-DSDM_FWD_ONE_WAIT",), 3,
                            "the split wait and one wait")


@pytest.mark.parametrize("case,macro", [("bf16-staged", "-DSDM_FWD_EARLY_PF"),
                                        ("bf16-W16-hd128", "-DSDM_FWD_EARLY_PF"),
                                        ("f32", "-DSDM_FWD_LATE_WIDE")])
def test_late_copies_are_bitwise_the_early_ones(rng, monkeypatch, case, macro):
    """The staged forward with a 2-byte bank issues chunk n+1's bank-independent copies after
    chunk n's row copies, as a third commit group, and waits for them at chunk n+1's start;
    -DSDM_FWD_EARLY_PF issues them before the row copies, as the first group. With a float32
    bank the early copies are the default and -DSDM_FWD_LATE_WIDE builds the late ones. The
    emulator lands a copy at once or at the wait that covers it, so a wait that counted the
    groups wrong would read stale rows or stage data (a pass-0 wait or a chunk-start wait one
    group short fails this test; both checked by hand). Readings, final bank and snapshots
    bit for bit the same, with repeated slots and a last chunk shorter than C, on staged
    plans; both match the float64 reference."""
    pl, pb = _staged_forward_against(rng, monkeypatch, case, (macro,), 5,
                                     "the late copies and the early ones",
                                     knobs=dict(STAGE_READS=True))
    assert pl.Nt > 1 and pb.T % pl.C, f"{case}: one chunk, or whole chunks only"


@pytest.mark.parametrize("W", [5, 40])
def test_prepass_hash_tables_and_live_walks_are_bitwise_the_sort(rng, monkeypatch, W):
    """The pre-pass's hashed forms (and, for W <= 32, step 4 walking only the entries that step
    3 marked) against the bitonic sort they replace (-DSDM_PREPASS_SORT_WRITES): readings,
    final bank and snapshots of the forward, the value gradients and the rewound bank of the
    backward bit for bit the same. At W = 5 both forms hash (C = 64); at W = 40 the forward's
    does, without the marks."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=1, T=70, P=2, hd=16, S=20, W=W, dtype=np.float32)
    cfg = _cfg(pb)
    lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
    emu.patch(monkeypatch)
    pl = gpu.plan(lay, cfg, quant=None, saves=True)
    # not vacuous: some chunk writes a slot twice (G) and reads a slot it writes (H)
    first = pb.write_idx[0, :pl.C, 0].reshape(-1)
    assert len(np.unique(first)) < first.size
    assert np.isin(pb.read_idx[0, :pl.C, 0], first).any()
    dr = rng.normal(size=pb.values.shape).astype(np.float32)
    inputs = _inputs(pb, lay)
    outs = []
    for macros in ((), ("-DSDM_PREPASS_SORT_WRITES",)):
        emu.patch(monkeypatch, seed=7919, macros=macros)
        bank = pb.bank.copy()
        r, snaps = gpu.sdm_fwd(lay, cfg, bank, *inputs, save_snapshots=True)
        fin = bank.copy()
        g = gpu.sdm_bwd(lay, cfg, bank, inputs, snaps, dr, None)
        outs.append([a.view(np.uint8).copy() for a in (r, fin, snaps[0], g[2], bank)])
    gpu._PLANS.clear()
    for name, a, b in zip(("readings", "final bank", "snapshots", "value gradients",
                           "rewound bank"), *outs):
        assert np.array_equal(a, b), f"{name}: the hashed pre-pass and the sort differ"


MIXED = dict(B=2, T=70, P=2, hd=32, S=300, W=5)   # a chunk's slots: solo ones and repeated ones
SOLO_CASES = {
    "f32": (dict(MIXED, dtype=np.float32), {}, {}),
    "f64-C5": (dict(B=2, T=37, P=2, hd=20, S=40, W=4), dict(C=5), {}),
    "bf16-hd20-partial": (dict(B=1, T=50, P=3, hd=20, S=64, W=4, dtype=BF16), dict(C=16), {}),
    "bf16-grad-bank-bf16": (dict(MIXED, dtype=BF16), dict(grad_bank_fp32=False), {}),
    "f32-bwd-ranges-256": (dict(MIXED, dtype=np.float32), dict(C=8),
                           dict(BWD_SCRATCH=1, BWD_THREADS=256)),
}


@pytest.mark.parametrize("case", list(SOLO_CASES))
def test_backward_solo_entries_are_bitwise_the_scatter(rng, monkeypatch, case):
    """-DSDM_BWD_SOLO: the backward adds a solo entry's term (the only valid entry of its slot
    in the chunk) outside the scatter: a write's in round 2, to the dM piece it has just
    loaded; the reads' in the phase after u (or, -DSDM_BWD_SOLO_READS=1, in round 2); its flags
    overwrite the chunk's read links. Against the default build, where the scatter adds every
    run: the grad bank (from a nonzero incoming one), the value gradients and the rewound bank
    bit for bit the same (one column tile: the weight grads' atomics add in one order, so they
    are compared too), with solo and repeated slots in one chunk, partial pieces (off the fast
    path, where the solo form leaves every run to the scatter), a 16-bit grad bank and backward
    ranges; all match the reference."""
    from sdm_cupy.kernels import gpu
    pkw, ckw, kn = SOLO_CASES[case]
    pb = make_problem(rng, **pkw)
    cfg = _cfg(pb, **ckw)
    dr = rng.normal(size=pb.values.shape)
    dM = None if "grad_bank_fp32" in ckw else rng.normal(size=pb.bank.shape)
    lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
    outs = []
    with _gpu_knobs(**kn, BWD_TILE_WIDTH=pb.hd):
        # the other two forms for float32 only (each macro set is a build of its own)
        forms = ((), ("-DSDM_BWD_SOLO",)) + (
            (("-DSDM_BWD_SOLO", "-DSDM_BWD_SOLO_READS=1"),) if case == "f32" else ())
        for k, macros in enumerate(forms):
            err = emu.patch(monkeypatch, seed=k * 7919 + 11, macros=macros)
            if k == 0:   # not vacuous: chunk 0 holds a solo slot and a repeated one
                C = gpu.backward_plan(lay, cfg).C
                ids = np.concatenate([pb.write_idx[0, :C, 0].ravel(), pb.read_idx[0, :C, 0].ravel()])
                counts = np.unique(ids, return_counts=True)[1]
                assert (counts == 1).any() and (counts > 1).any(), f"{case}: no mix of runs"
            r, fin, g, rewound = _run(pb, cfg, dr, dM)
            assert err[0] == 0
            outs.append([np.asarray(a).view(np.uint8).copy() for a in (*g, rewound)])
    for out, name in zip(outs[1:], ("the solo form", "its solo reads in round 2")):
        for what, a, b in zip(GRADS + ("rewound bank",), outs[0], out):
            assert np.array_equal(a, b), f"{case}: {what} differs from {name}"
    _, gtol = max(TOL[pb.bank.dtype], TOL[pb.values.dtype])
    for name, got, want in zip(GRADS, g, reference_bwd(pb, dr, dM)):
        assert_close(got, want, gtol, f"grad {name}")


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_forward_is_bitwise_the_same_in_any_block_and_thread_order(rng, monkeypatch, dtype):
    """Three seeds, three orders of blocks and of threads between barriers: readings, final
    bank and snapshots bit for bit the same (a race inside a block would show here), and of
    the backward, the value gradients and the rewound bank (its weight and bank gradients are
    sums of atomics, whose last bits may follow the order)."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, **dict(SMALL, S=12, dtype=dtype))   # S = 12: slots repeat
    cfg = _cfg(pb, 16)
    lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    outs = []
    for seed in (1, 2, 3):
        emu.patch(monkeypatch, seed=seed * 7919)
        bank = pb.bank.copy()
        r, snaps = gpu.sdm_fwd(lay, cfg, bank, *pb.inputs, save_snapshots=True)
        fin = bank.copy()
        g = gpu.sdm_bwd(lay, cfg, bank, pb.inputs, snaps, dr, None)
        outs.append([a.view(np.uint8).copy() for a in (r, fin, snaps[0], g[2], bank)])
    for other in outs[1:]:
        for name, a, b in zip(("readings", "final bank", "snapshots", "value gradients",
                               "rewound bank"), outs[0], other):
            assert np.array_equal(a, b), f"{name} differ between block/thread orders"


def test_expand_and_sum_memory_batch(rng, emulated):
    from sdm_cupy.kernels import gpu
    for dt in (np.float64, np.float32, np.float16, BF16):
        param = rng.normal(size=(37, 12)).astype(dt)
        out = gpu.expand_memory_batch(param, 3)
        assert np.array_equal(out.view(np.uint8), np.tile(param, (3, 1)).view(np.uint8))
        g = rng.normal(size=(3 * 37, 12)).astype(dt)
        want = g.astype(np.float64).reshape(3, 37, 12).sum(0)
        assert_close(gpu.sum_memory_batch(g, 37), want, 1e-12 if dt == np.float64 else 1e-2,
                     f"sum_memory_batch {np.dtype(dt)}")


def _random_case(rng):
    """A random layout, dtype, snapshot mode and set of launcher knobs that the GPU backend
    accepts: ids drawn from a small S (repeats), T not a multiple of the chunk, a few bad ids
    now and then (the launcher then gets what check_indices=False lets through)."""
    from sdm_cupy.kernels import gpu
    while True:
        dtype = [np.float64, np.float32, BF16][rng.integers(3)]
        hd = int(rng.choice([4, 8, 12, 20, 32, 36, 64]))
        pb = make_problem(rng, B=int(rng.integers(1, 4)), T=int(rng.integers(1, 91)),
                          P=int(rng.integers(1, 4)), hd=hd, S=int(rng.integers(1, 50)),
                          W=int(rng.integers(1, 21)), dtype=dtype)
        quant = [None, None, "bf16", "fp8_e4m3", "int8"][rng.integers(5)]
        if quant == "bf16" and dtype == BF16:
            quant = None
        C = int(rng.choice([1, 2, 5, 8, 16, 32, 64]))
        knobs = dict(TILE_WIDTH=[None, None, 4, 8, 12][rng.integers(5)],
                     BWD_THREADS=[512, 256, 96][rng.integers(3)],
                     KEEP_ROWS=[None, False][rng.integers(2)],
                     STAGE_READS=[None, False, True][rng.integers(3)],
                     BWD_SCRATCH=[56 << 20, 1][rng.integers(2)])
        cfg = _cfg(pb, C, snapshot_quant=quant)
        lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
        try:
            with _gpu_knobs(**knobs):
                sdm._validate.check_snapshot_quant(lay, quant)   # what sdm.forward checks first
                gpu.check_config(lay, cfg)
                gpu.backward_plan(lay, cfg, chunk=gpu.plan(lay, cfg, quant=quant, saves=True).C)
        except (ValueError, RuntimeError):
            continue
        if pb.S > 1 and rng.random() < 0.3:   # a few ids outside [0, S)
            # the reference runs redirect them to slot 0 with weight 0; a redirected write
            # still takes a snapshot of its row, so slot 0 is kept for them (no valid id, a
            # zero row, whose 1-byte and bf16 snapshots are exact) and the GPU, which skips
            # them, restores the same bank
            for arr in (pb.write_idx, pb.read_idx):
                arr[arr == 0] = rng.integers(1, pb.S, size=int((arr == 0).sum()))
            pb.bank.reshape(pb.B, pb.S, -1)[:, 0] = 0
            for arr in (pb.write_idx, pb.read_idx):
                flat = arr.reshape(-1)
                k = rng.integers(0, flat.size, size=min(3, flat.size))
                flat[k] = rng.choice([-1, pb.S, pb.S + 7, 10 ** 6], size=k.size)
        return pb, cfg, knobs


def test_random_layouts_knobs_and_modes(emulated):
    """Six random cases a run (fresh each run, the seed printed): readings, final bank, every
    gradient and the rewind against the float64 reference (exact snapshots) or the CPU backend
    (quantized ones), the bad ids of a case skipped and flagged."""
    knobs_set, err = emulated
    seed = int(os.environ.get("SDM_RANDOM_CASES_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"random cases seed={seed} (SDM_RANDOM_CASES_SEED={seed} repeats them)")
    rng = np.random.default_rng(seed)
    for i in range(6):
        pb, cfg, knobs = _random_case(rng)
        knobs_set(**knobs)
        what = (f"case {i} of seed {seed}: B={pb.B} T={pb.T} P={pb.P} hd={pb.hd} S={pb.S} "
                f"W={pb.W} {pb.bank.dtype} C={cfg.chunk_size} {cfg.snapshot_quant} {knobs}")
        bad_w = (pb.write_idx < 0) | (pb.write_idx >= pb.S)
        bad_r = (pb.read_idx < 0) | (pb.read_idx >= pb.S)
        fixed = dataclasses.replace(pb, write_idx=np.where(bad_w, 0, pb.write_idx),
                                    read_idx=np.where(bad_r, 0, pb.read_idx),
                                    write_w=np.where(bad_w, 0, pb.write_w),
                                    read_w=np.where(bad_r, 0, pb.read_w))
        dr = rng.normal(size=pb.values.shape)
        err[0] = 0
        r, fin, g, rewound = _run(pb, cfg, dr, None)
        assert (err[0] != 0) == bool(bad_w.any() or bad_r.any()), f"error word: {what}"
        ftol, gtol = TOL[pb.bank.dtype]
        # a skipped entry's weight gradient is 0 (its id has no row); elsewhere the reference's
        # (whose 0 weight at id 0 would give that entry a gradient of its own)
        g = list(g)
        for j, bad in ((1, bad_w), (4, bad_r)):
            assert not np.abs(g[j][bad]).any(), f"{GRADS[j]} gradient at a bad id, {what}"
        if cfg.snapshot_quant is None:
            assert np.array_equal(rewound.view(np.uint8), pb.bank.view(np.uint8)), what
            r_ref, fin_ref = reference_fwd(fixed)
            want = list(reference_bwd(fixed, dr, None))
            tol = (ftol, gtol)
        else:
            # the CPU backend with the GPU's chunk: a quantized rewind restores each chunk's
            # start, so its weight gradients follow the chunking (docs/CHOOSING.md)
            from sdm_cupy.kernels import cpu, gpu
            lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
            cap = cpu.CHUNK_CAP
            cpu.CHUNK_CAP = gpu.plan(lay, cfg, quant=cfg.snapshot_quant, saves=True).C
            try:
                res = sdm.forward(*fixed.args(), cfg)
                gc = sdm.backward(res.saved, dr.astype(pb.values.dtype))
            finally:
                cpu.CHUNK_CAP = cap
            r_ref, fin_ref, want = res.readings, fin, [getattr(gc, n) for n in GRADS]
            # both backends quantize by one rule (cpu_formats), so a float64 bank's results
            # agree to the GPU's float32 decoding of the 1-byte modes (before stop 24 the CPU
            # rounded float64 to bf16 through float32 and scaled in another precision: 1e-3)
            # A float32 bank differs from the CPU's by its rounding (other summation orders),
            # enough now and then to move a value across a rounding boundary of the snapshot
            # format: one code apart, 1/16 of the value in fp8, 1/254 of the row's absmax in
            # int8 (seen: seed 328, 5.0e-4 in a read-weight gradient after 38 fp8 chunks)
            tol = {BF16: (2e-2, 2e-2), np.dtype(np.float64): (1e-6, 1e-6)}.get(
                pb.bank.dtype, (2e-3, 2e-3))
            assert_close(rewound, res.bank, tol[0], f"rewound bank gpu vs cpu, {what}")
        for j, bad in ((1, bad_w), (4, bad_r)):
            want[j] = np.where(bad, 0, want[j])
        assert_close(r, r_ref, tol[0], f"readings, {what}")
        assert_close(fin, fin_ref, tol[0], f"final bank, {what}")
        for name, got, w in zip(GRADS, g, want):
            assert_close(got, w, tol[1], f"grad {name}, {what}")


# ---- the emulator's own checks ----------------------------------------------------------------
SELF = r"""
#include "sdm_common.cuh"
namespace sdm {
// mode 0: copies row `blockIdx.x` of src into shared memory with cp.async, waits, syncs, and
//         writes it back reversed; 1: the same without the wait; 2: a barrier only even
//         threads reach; 3: one warp's shuffle with half its lanes; 4: writes one past the end;
//         5: reads a neighbour's shared word with no barrier in between
template <typename T>
__global__ void selftest_kernel(const T* src, T* dst, int n, int mode) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* s = reinterpret_cast<T*>(smem);
  const int t = threadIdx.x;
  if (mode <= 1) {
    if (t < n) cp_async<sizeof(T)>(s + t, src + blockIdx.x * n + t);
    cp_commit();
    if (mode == 0) cp_wait<0>();
    __syncthreads();
    if (t < n) dst[blockIdx.x * n + t] = s[n - 1 - t];
  } else if (mode == 2) {
    if (t % 2 == 0) __syncthreads();
  } else if (mode == 3) {
    if (t % 32 < 16) dst[t] = __shfl_xor_sync(0xffffffffu, src[t], 1);
  } else if (mode == 4) {
    if (t == 0) dst[gridDim.x * n] = T(1);
  } else if (mode == 5) {   // a neighbour's shared word read without a barrier: a race
    if (t < n) s[t] = src[blockIdx.x * n + t];
    if (t < n) dst[blockIdx.x * n + t] = s[t ^ 1];
  }
}
}  // namespace sdm
"""


def _selftest(mode, n=32, grid=3):
    name = "sdm::selftest_kernel<float>"
    text = emu.K.inline_header(SELF)
    fn = emu.Function("selftest", (), name, text=text, names=(name,))
    src = np.arange(grid * n, dtype=np.float32)
    dst = np.zeros(grid * n, np.float32)
    fn((grid,), (64,), (src, dst, np.int32(n), np.int32(mode)), shared_mem=4 * n)
    return src, dst


def test_emulator_lands_cp_async_at_its_wait():
    src, dst = _selftest(0)
    assert np.array_equal(dst.reshape(3, -1), src.reshape(3, -1)[:, ::-1])
    _, dst = _selftest(1)   # read before the wait: some poisoned shared memory, not the rows
    assert not np.array_equal(dst.reshape(3, -1), src.reshape(3, -1)[:, ::-1])


@pytest.mark.parametrize("mode, message", [(2, "deadlock|at __syncthreads|__syncthreads after"),
                                           (3, "warp operation|deadlock")])
def test_emulator_refuses_divergent_barriers_and_partial_warps(mode, message):
    with pytest.raises(emu.EmulatorError, match=message):
        _selftest(mode)


# ---- AddressSanitizer -------------------------------------------------------------------------
ASAN_CASES = ["f64-C16-tile6", "f64-C1", "f32-bwd-ranges-256", "bf16-staged", "bf16-kept",
              "bf16-hd20-partial", "f32-hd36-tile8", "f32-decode-W80",
              "bf16-W16-hd128", "f32-W32-sub", "bf16-W16-hd64-sub"]   # -sub: stop 28's paths


def _asan_spec():
    """(command, environment) of the AddressSanitizer child; raises where there is no libasan."""
    env = emu.asan_env()
    env["SDM_EMU_CACHE"] = os.environ.get("SDM_EMU_CACHE", "") or emu.cache_dir()
    sel = " or ".join([f"test_kernels_match_reference[{c}]" for c in ASAN_CASES]
                      + ["test_bad_ids", "test_random_layouts", "test_asan_catches",
                         "test_quantized_snapshots_match_the_cpu_backend[bf16-fp8]"])
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           os.path.join(here, "test_emulated_kernels.py"), "-k", sel]
    return cmd, env


def _tsan_specs():
    """(command, environment, cwd) of the two ThreadSanitizer children: a kernel with a known
    race, and tests/emu/racecheck.py; raises where there is no libtsan."""
    env = emu.tsan_env()
    here = os.path.dirname(os.path.abspath(__file__))
    return {"tsan-selftest": (early.python_call("test_emulated_kernels", "_selftest(5)"), env,
                              "/"),
            "tsan-racecheck": ([sys.executable, os.path.join(here, "emu", "racecheck.py")],
                               None, None)}


# (conftest calls these only for tests that would not skip, so their skipif conditions hold)
def _start_asan():
    try:
        cmd, env = _asan_spec()
    except (subprocess.CalledProcessError, OSError):
        return {}   # the test skips, saying why
    return {"asan": early.Child(cmd, env=env)}


def _start_tsan():
    try:
        specs = _tsan_specs()
    except (subprocess.CalledProcessError, OSError):
        return {}
    return {k: early.Child(cmd, env=env, cwd=cwd) for k, (cmd, env, cwd) in specs.items()}


@pytest.mark.skipif(emu.asan(), reason="the driver of the AddressSanitizer run")
def test_kernels_under_address_sanitizer():
    """A child process runs a set of the tests above (all four bad-id cases included) with the
    kernels built with AddressSanitizer: any read or write outside an array, global or shared,
    fails it; and a kernel that writes one element past its array is caught. (Started right
    after collection where it can be: tests/early.py.)"""
    try:
        cmd, env = _asan_spec()
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"no libasan for {emu.compiler()}: {e}")
    r = early.take("asan", cmd, env=env).wait(timeout=1200)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, f"AddressSanitizer run failed:\n{tail}"
    assert "passed" in r.stdout and "AddressSanitizer" not in r.stdout + r.stderr, tail


@pytest.mark.skipif(emu.asan() or emu.tsan(), reason="runs in the parent process")
def test_no_unknown_race_under_thread_sanitizer():
    """tests/emu/racecheck.py: the kernels built with ThreadSanitizer (barriers order memory,
    nothing else does), three cases with repeated slots; every unordered pair of accesses
    inside a block must be one of its known harmless races. And a kernel that reads a
    neighbour's shared word without a barrier is reported. (Both started right after
    collection where they can be: tests/early.py.)"""
    try:
        specs = _tsan_specs()
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"no libtsan for {emu.compiler()}: {e}")
    r = early.take("tsan-selftest", *specs["tsan-selftest"]).wait(timeout=600)
    assert r.returncode != 0 and "data race" in r.stderr, r.stderr[-3000:]
    r = early.take("tsan-racecheck", *specs["tsan-racecheck"]).wait(timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


# Long children their tests start right after collection (conftest.py, tests/early.py)
EARLY = {"test_kernels_under_address_sanitizer": _start_asan,
         "test_no_unknown_race_under_thread_sanitizer": _start_tsan}


@pytest.mark.skipif(not emu.asan(), reason="runs inside test_kernels_under_address_sanitizer")
def test_asan_catches_a_write_past_the_end():
    r = subprocess.run(early.python_call("test_emulated_kernels", "_selftest(4)"),
                       capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert r.returncode != 0 and "heap-buffer-overflow" in r.stderr, r.stderr[-3000:]


# ---- a forward's chunk carried to its backward (stops 21-22; on the H200 since stop 24) ----------
def _forward(pb, cfg, **knobs_during):
    """gpu.sdm_fwd with snapshots on a copy of the bank, the gpu knobs `knobs_during` set for
    the forward only: (layout, inputs, bank after it, readings, snapshots, final bank)."""
    from sdm_cupy.kernels import gpu
    lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
    inputs = _inputs(pb, lay)
    bank = pb.bank.copy()
    with _gpu_knobs(**knobs_during):
        r, snaps = gpu.sdm_fwd(lay, cfg, bank, *inputs, save_snapshots=True)
    return lay, inputs, bank, r, snaps, bank.copy()


def _check_all(pb, r, fin, g, rewound, dr, dM, tol):
    assert np.array_equal(rewound.view(np.uint8), pb.bank.view(np.uint8)), "rewound bank"
    r_ref, fin_ref = reference_fwd(pb)
    assert_close(r, r_ref, tol, "readings")
    assert_close(fin, fin_ref, tol, "final bank")
    for name, got, want in zip(GRADS, g, reference_bwd(pb, dr, dM)):
        assert_close(got, want, tol, f"grad {name}")


@pytest.mark.parametrize("dtype, B, P, W, hd", [(np.float32, 4, 8, 3, 256),
                                                (np.float32, 2, 2, 32, 8),
                                                (np.float64, 4, 8, 8, 128)],
                         ids=["f32-W3-hd256", "f32-W32-hd8", "f64-W8-hd128"])
def test_backward_walks_the_forwards_chunks(rng, emulated, dtype, B, P, W, hd):
    """Layouts where the backward alone would take a shorter chunk than the forward (H200
    limits): the saving forward takes the backward's chunk, the backward walks it, and every
    output matches the float64 reference with repeated slots and a partial last chunk."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=B, T=70, P=P, hd=hd, S=40, W=W, dtype=dtype)
    cfg = _cfg(pb, 64)
    lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
    saving, bwd = gpu.plan(lay, cfg, saves=True), gpu.backward_plan(lay, cfg)
    # the chunk its snapshots are taken at (a sub-chunk of its own where a plan has `sub`)
    saved_at = getattr(saving, "sub", 0) or saving.C
    assert saved_at == bwd.C < gpu.plan(lay, cfg).C, "not the layout this test is for"
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    dM = rng.normal(size=pb.bank.shape).astype(dtype)
    r, fin, g, rewound = _run(pb, cfg, dr, dM)
    _check_all(pb, r, fin, g, rewound, dr.astype(np.float64), dM.astype(np.float64),
               1e-4 if dtype == np.float32 else 1e-9)


@pytest.mark.parametrize("fwd_chunk, bwd_chunk", [(16, None), (None, 16)])
def test_knobs_changed_between_forward_and_backward(rng, emulated, fwd_chunk, bwd_chunk):
    """gpu.FWD_CHUNK changed between a forward and its backward: the backward walks the chunk
    the snapshots carry, not the one the knobs give by then (float64 reference, exact rewind)."""
    from sdm_cupy.kernels import gpu
    knobs, _ = emulated
    pb = make_problem(rng, B=2, T=70, P=2, hd=24, S=40, W=5)
    cfg = _cfg(pb, 64)
    dr, dM = rng.normal(size=pb.values.shape), rng.normal(size=pb.bank.shape)
    lay, inputs, bank, r, snaps, fin = _forward(pb, cfg, FWD_CHUNK=fwd_chunk)
    knobs(FWD_CHUNK=bwd_chunk)
    assert snaps.chunk == (fwd_chunk or 32)
    assert gpu.backward_plan(lay, cfg).C == (bwd_chunk or 32) != snaps.chunk
    gpu.check_backward(lay, cfg, snaps)
    g = gpu.sdm_bwd(lay, cfg, bank, inputs, snaps, dr, dM.copy())
    _check_all(pb, r, fin, g, bank, dr, dM, 1e-9)


def test_backward_narrows_its_tiles_for_the_forwards_chunk(rng, emulated):
    """A forward under gpu.TILE_WIDTH = 8 (float32, hd = 256, W = 8: 64-token chunks), the knob
    reset before its backward: the backward takes narrower tiles than its own to fit that
    chunk and still walks it (float64 reference, exact rewind)."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=4, T=80, P=8, hd=256, S=64, W=8, dtype=np.float32)
    cfg = _cfg(pb, 64)
    lay, inputs, bank, r, snaps, fin = _forward(pb, cfg, TILE_WIDTH=8)
    own, bwd = gpu.plan(lay, cfg, backward=True), gpu.backward_plan(lay, cfg, chunk=snaps.chunk)
    assert own.C < snaps.chunk == bwd.C == 64 and bwd.TW < own.TW, (own, bwd)
    dr = rng.normal(size=pb.values.shape).astype(np.float32)
    gpu.check_backward(lay, cfg, snaps)
    g = gpu.sdm_bwd(lay, cfg, bank, inputs, snaps, dr, None)
    _check_all(pb, r, fin, g, bank, dr.astype(np.float64), None, 1e-4)


def test_backward_refused_for_a_chunk_it_no_longer_fits_then_runs(rng, emulated):
    """A backward tile width forced after the forward that leaves too little shared memory for
    the forward's chunk: check_backward refuses with the knob named, nothing ran; with the
    knob restored the backward runs and matches the reference."""
    from sdm_cupy.kernels import gpu
    knobs, _ = emulated
    pb = make_problem(rng, B=1, T=40, P=1, hd=256, S=30, W=8, dtype=np.float32)
    cfg = _cfg(pb, 64)
    lay, inputs, bank, r, snaps, fin = _forward(pb, cfg)
    knobs(BWD_TILE_WIDTH=pb.hd)
    gpu._PLANS.clear()
    with pytest.raises(RuntimeError, match=f"forward that ran {snaps.chunk}-token chunks.*"
                                           f"BWD_TILE_WIDTH={pb.hd}"):
        gpu.check_backward(lay, cfg, snaps)
    assert np.array_equal(bank, fin)
    knobs(BWD_TILE_WIDTH=None)
    gpu._PLANS.clear()
    dr = rng.normal(size=pb.values.shape).astype(np.float32)
    gpu.check_backward(lay, cfg, snaps)
    g = gpu.sdm_bwd(lay, cfg, bank, inputs, snaps, dr, None)
    _check_all(pb, r, fin, g, bank, dr.astype(np.float64), None, 1e-4)
