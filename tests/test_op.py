"""The op through the public API, held to the float64 reference (SPEC §1, §2, §4, §5, §7).

Every test takes the ``xp`` fixture (numpy -> the Numba CPU backend, cupy -> the CUDA backend)
unless it says otherwise, so the same assertions hold both backends to ``sdm_cupy.reference``.
Float64 calls must match the reference to 1e-9 relative RMS; lower precisions to the measured
tolerances stated next to each test.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sdm_cupy as sdm
from helpers import (BF16, assert_close, make_problem, reference_bwd, reference_fwd, rel_err,
                     to_numpy)

GRAD_NAMES = ("bank", "write_w", "values", "beta", "read_w")
ARG_NAMES = ("bank", "write_idx", "write_w", "values", "beta", "read_idx", "read_w")
F64_RTOL = 1e-9
F32_RTOL = 1e-4


# ----------------------------------------------------------------------------- helpers

def assert_bitwise(got, want, name):
    """Same shape, dtype and bytes (NaN-safe, works for bfloat16)."""
    g, w = to_numpy(got), to_numpy(want)
    assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != {w.dtype}"
    assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape}"
    gb = np.ascontiguousarray(g).view(np.uint8)
    wb = np.ascontiguousarray(w).view(np.uint8)
    if not np.array_equal(gb, wb):
        diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
        pytest.fail(f"{name}: not bitwise equal ({int((diff != 0).sum())} entries differ, "
                    f"max abs {float(np.nanmax(diff)):.3e})")


def random_grads(rng, pb, grad_bank=True):
    """dr in the values' dtype (so the reference sees the very values the backend gets) and
    dM in float64 for float64 calls, else float32."""
    dr = rng.normal(size=pb.values.shape).astype(pb.values.dtype)
    if not grad_bank:
        return dr, None
    f64 = np.dtype(np.float64) in (pb.bank.dtype, pb.values.dtype)
    dM = rng.normal(size=pb.bank.shape).astype(np.float64 if f64 else np.float32)
    return dr, dM


def run_op(xp, pb, cfg, dr, dM=None, **kw):
    """forward then backward on ``xp``. Returns (res, readings, final bank, grads, initial
    bank), the arrays in between as NumPy copies taken before the backward rewinds res.bank."""
    p = pb.to(xp)
    bank0 = to_numpy(p.bank).copy()
    res = sdm.forward(p.bank, *p.inputs, cfg, **kw)
    readings, final = to_numpy(res.readings).copy(), to_numpy(res.bank).copy()
    g = sdm.backward(res.saved, xp.asarray(dr), None if dM is None else xp.asarray(dM))
    return res, readings, final, g, bank0


def check_vs_reference(xp, pb, cfg, dr, dM, rtol):
    """Readings, final bank and every gradient against the reference; the bank after backward
    bitwise equal to the initial bank (exact snapshots)."""
    res, readings, final, g, bank0 = run_op(xp, pb, cfg, dr, dM)
    r_ref, M_ref = reference_fwd(pb)
    assert_close(readings, r_ref, rtol, "readings")
    assert_close(final, M_ref, rtol, "final bank")
    for name, w in zip(GRAD_NAMES, reference_bwd(pb, dr, dM)):
        assert_close(getattr(g, name), w, rtol, f"grad {name}")
    assert_bitwise(res.bank, bank0, "bank after backward (rewound)")


def cfg_for(pb, C=64, **kw):
    return sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size=C, **kw)


# ----------------------------------------------------------------------------- float64 cases

@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 2
    T: int = 20
    P: int = 2
    hd: int = 8
    S: int = 32
    W: int = 3
    C: int = 8
    repeat: bool = False
    index_dtype: type = np.int32


CASES = {
    "base-T20-C8": Case(),
    "T1": Case(T=1, C=64),
    "T1-C1": Case(T=1, C=1),
    "T63-C64-partial-chunk": Case(B=1, T=63, C=64),
    "T64-C64-one-full-chunk": Case(B=1, T=64, C=64),
    "T100-C64-full-plus-partial": Case(B=1, T=100, C=64),
    "T100-C16": Case(B=1, T=100, C=16),
    "C1": Case(T=20, C=1),
    "C7-not-a-divisor": Case(T=20, C=7),
    "C-larger-than-T": Case(T=5, C=64),
    "C-huge-1e6-T5": Case(T=5, C=10 ** 6),
    "C1000-T300-longer-than-any-cap": Case(B=1, P=1, hd=4, S=64, W=2, T=300, C=1000),
    "W1": Case(W=1),
    "W16-many-overlaps": Case(W=16, S=24, T=16, C=8),
    "repeated-slots": Case(W=4, S=16, T=30, C=8, repeat=True),
    "repeated-slots-C1": Case(W=4, S=16, T=12, C=1, repeat=True),
    "repeated-slots-one-chunk": Case(W=3, S=8, T=24, C=64, repeat=True),
    "B1-P1": Case(B=1, P=1),
    "S1": Case(S=1, W=2, repeat=True),
    "hd1": Case(hd=1),
    "hd60": Case(hd=60, T=24),
    "hd130-wider-than-a-tile": Case(B=1, P=1, hd=130, T=20),
    "P4-hd4": Case(P=4, hd=4),
    "S50000-large": Case(S=50000, T=6, W=4, C=4),
    "decode-shape-B64-T1": Case(B=64, T=1, P=2, hd=8, S=64, W=4, C=64),
    "C64-W32-T70-wide-chunks": Case(B=1, P=1, T=70, S=4096, W=32, C=64),
    "int64-indices": Case(index_dtype=np.int64),
    "int64-indices-repeated": Case(W=4, S=16, repeat=True, index_dtype=np.int64),
}


def problem(rng, case: Case, **kw):
    return make_problem(rng, B=case.B, T=case.T, P=case.P, hd=case.hd, S=case.S, W=case.W,
                        repeat=case.repeat, index_dtype=case.index_dtype, **kw)


@pytest.mark.parametrize("grad_bank", [True, False], ids=["with-grad-bank", "no-grad-bank"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_float64_matches_reference(xp, rng, case, grad_bank):
    pb = problem(rng, case)
    dr, dM = random_grads(rng, pb, grad_bank)
    check_vs_reference(xp, pb, cfg_for(pb, case.C), dr, dM, F64_RTOL)


def test_mixed_index_dtypes(xp, rng):
    # int32 write ids with int64 read ids (and the reverse): one index dtype is picked inside
    pb = make_problem(rng, T=12, index_dtype=np.int32)
    dr, dM = random_grads(rng, pb)
    for wdt, rdt in ((np.int32, np.int64), (np.int64, np.int32)):
        mixed = dataclasses.replace(pb, write_idx=pb.write_idx.astype(wdt),
                                    read_idx=pb.read_idx.astype(rdt))
        check_vs_reference(xp, mixed, cfg_for(pb, 4), dr, dM, F64_RTOL)


def test_non_contiguous_inputs(xp, rng):
    # strided views made on the array's own device (every other token of a longer problem)
    # and a Fortran-order bank are accepted and give the same result
    big = make_problem(rng, B=2, T=24, P=2, hd=6, S=16, W=3)
    names = ("write_idx", "write_w", "values", "beta", "read_idx", "read_w")
    pb = dataclasses.replace(big, T=12, **{f: getattr(big, f)[:, ::2].copy() for f in names})
    on_dev = big.to(xp)
    views = [getattr(on_dev, f)[:, ::2] for f in names]
    bank = xp.asfortranarray(on_dev.bank)
    assert not views[2].flags.c_contiguous and not bank.flags.c_contiguous
    dr, dM = random_grads(rng, pb)
    res = sdm.forward(bank, *views, cfg_for(pb, 5))
    r_ref, M_ref = reference_fwd(pb)
    assert_close(res.readings, r_ref, F64_RTOL, "readings")
    assert_close(res.bank, M_ref, F64_RTOL, "final bank")
    g = sdm.backward(res.saved, xp.asarray(dr), xp.asarray(dM))
    for name, w in zip(GRAD_NAMES, reference_bwd(pb, dr, dM)):
        assert_close(getattr(g, name), w, F64_RTOL, f"grad {name}")
    assert_bitwise(res.bank, pb.bank, "rewound bank")
    assert_bitwise(bank, pb.bank, "the Fortran-order input bank is left alone")


def test_read_only_inputs_cpu(rng):
    # NumPy views of JAX CPU buffers are read-only; the op only reads its inputs and dr, dM
    pb = make_problem(rng, T=12)
    dr, dM = random_grads(rng, pb)
    for a in (*pb.inputs, dr, dM):
        a.flags.writeable = False
    check_vs_reference(np, pb, cfg_for(pb, 4), dr, dM, F64_RTOL)


def test_gradients_of_other_dtypes_and_layouts(xp, rng):
    # dr and dM are cast to the call's dtypes: a float64 strided dr and a bfloat16 or float64
    # dM for a float32 call give the reference gradients of those (exactly representable) values
    pb = make_problem(rng, T=16, dtype=np.float32)
    dr = rng.normal(size=(pb.B, 2 * pb.T, pb.P * pb.hd))[:, ::2]
    dr32 = dr.astype(np.float32)
    for dM in (rng.normal(size=pb.bank.shape).astype(BF16), rng.normal(size=pb.bank.shape),
               np.asfortranarray(rng.normal(size=pb.bank.shape).astype(np.float32))):
        x = pb.to(xp)
        res = sdm.forward(x.bank, *x.inputs, cfg_for(pb, 4))
        g = sdm.backward(res.saved, xp.asarray(dr), xp.asarray(dM))
        for name, w in zip(GRAD_NAMES, reference_bwd(pb, dr32, dM.astype(np.float32))):
            assert_close(getattr(g, name), w, F32_RTOL, f"dM {dM.dtype}: grad {name}")
        assert to_numpy(g.bank).dtype == np.float32


# ----------------------------------------------------------------------------- float32

F32_CASES = {k: CASES[k] for k in ("base-T20-C8", "T100-C64-full-plus-partial", "repeated-slots",
                                    "hd60", "S1")}


@pytest.mark.parametrize("case", list(F32_CASES.values()), ids=list(F32_CASES))
def test_float32_matches_reference(xp, rng, case):
    pb = problem(rng, case, dtype=np.float32)
    dr, dM = random_grads(rng, pb)
    check_vs_reference(xp, pb, cfg_for(pb, case.C), dr, dM, F32_RTOL)


def test_chunk_size_invariance_float32(xp, rng):
    # C is a speed knob only: C in 1, 7, 16, 64 agree with each other (and the reference)
    pb = make_problem(rng, B=1, T=100, P=2, hd=8, S=48, W=4, dtype=np.float32)
    dr, dM = random_grads(rng, pb)
    outs = {}
    for C in (1, 7, 16, 64):
        res, readings, final, g, bank0 = run_op(xp, pb, cfg_for(pb, C), dr, dM)
        outs[C] = (readings, final, *(to_numpy(getattr(g, n)) for n in GRAD_NAMES))
        assert_bitwise(res.bank, bank0, f"C={C}: bank after backward")
    names = ("readings", "final bank", *(f"grad {n}" for n in GRAD_NAMES))
    for C in (1, 7, 16):
        for name, got, want in zip(names, outs[C], outs[64]):
            assert_close(got, want, F32_RTOL, f"C={C} vs C=64: {name}")
    r_ref, _ = reference_fwd(pb)
    assert_close(outs[64][0], r_ref, F32_RTOL, "C=64 readings vs reference")


# ----------------------------------------------------------------------------- low precision

# 16-bit banks and values, tolerance on the relative RMS vs the float64 reference of the same
# rounded inputs. Worst error measured on the CPU backend over 20 seeds (B=2 T=40 P=2 hd=16 S=32
# W=3 C=16), grad_bank_fp32 True / False:
#   float16:  readings 2.8e-4 / 2.8e-4, final bank 3.0e-4 / 3.1e-4, grads <= 2.1e-4 / 2.6e-4
#   bfloat16: readings 2.2e-3 / 2.2e-3, final bank 2.4e-3 / 2.4e-3, grads <= 1.8e-3 / 2.0e-3
# (the grad bank is 6.6e-8 with grad_bank_fp32=True: it does not depend on the bank's values).
# The bounds are about 4x the worst measured error.
LOWP_RTOL = {np.dtype(np.float16): 1.2e-3, BF16: 1e-2}


@pytest.mark.parametrize("grad_bank_fp32", [True, False],
                         ids=["grad-bank-fp32", "grad-bank-native"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_bank_and_values(xp, rng, dtype, grad_bank_fp32):
    dt = BF16 if dtype == "bfloat16" else np.dtype(np.float16)
    pb = make_problem(rng, B=2, T=40, P=2, hd=16, S=32, W=3, dtype=dt)
    dr, dM = random_grads(rng, pb)
    cfg = cfg_for(pb, 16, grad_bank_fp32=grad_bank_fp32)
    res, readings, final, g, bank0 = run_op(xp, pb, cfg, dr, dM)
    assert readings.dtype == dt and final.dtype == dt
    assert to_numpy(g.bank).dtype == (np.float32 if grad_bank_fp32 else dt)
    for name in ("write_w", "beta", "read_w"):
        assert to_numpy(getattr(g, name)).dtype == np.float32, name
    assert to_numpy(g.values).dtype == dt
    r_ref, M_ref = reference_fwd(pb)
    tol = LOWP_RTOL[dt]
    assert_close(readings, r_ref, tol, f"{dtype} readings")
    assert_close(final, M_ref, tol, f"{dtype} final bank")
    for name, w in zip(GRAD_NAMES, reference_bwd(pb, dr, dM)):
        assert_close(getattr(g, name), w, tol, f"{dtype} grad {name}")
    assert_bitwise(res.bank, bank0, "bank after backward (rewound)")


def _one_token_per_row(T, S, hd, bank, write_rows, a, beta, values, read_rows, c):
    """B = P = W = 1 inputs: token t writes row write_rows[t] and reads row read_rows[t]."""
    shape = (1, T, 1, 1)
    return (bank, np.asarray(write_rows, np.int32).reshape(shape),
            np.full(shape, a, np.float32), values.reshape(1, T, hd).astype(np.float32),
            np.full((1, T, 1), beta, np.float32), np.asarray(read_rows, np.int32).reshape(shape),
            np.full(shape, c, np.float32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_bank_entries_are_read_exactly(xp, dtype):
    # every 16-bit pattern (subnormals, the largest finite, inf, NaN) as a bank entry, read back
    # with weight 1 and 0.75 into float32 readings: exact (c*x is exact in float32). The
    # pattern rows are never written, so they stay bitwise as they were.
    dt = BF16 if dtype == "bfloat16" else np.dtype(np.float16)
    hd, rows = 256, 256
    patterns = np.arange(2 ** 16, dtype=np.uint16).view(dt).reshape(rows, hd)
    S = rows + 1                                   # row 0: a clean row the tokens "write"
    bank = np.concatenate([np.zeros((1, hd), dt), patterns])
    for c in (1.0, 0.75):
        args = _one_token_per_row(rows, S, hd, bank.copy(), np.zeros(rows), 0.0, 0.0,
                                  np.zeros((rows, hd)), np.arange(1, S), c)
        x = [xp.asarray(a) for a in args]
        res = sdm.forward(*x, sdm.SDMConfig(S, 1, 64), needs_backward=False)
        got = to_numpy(res.readings).reshape(rows, hd)
        assert got.dtype == np.float32
        with np.errstate(invalid="ignore"):
            want = np.float32(c) * patterns.astype(np.float32)
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (f"{dtype} entries read wrong at c={c}: {int((~same).sum())} of "
                            f"{same.size}, e.g. bits {patterns.view(np.uint16)[~same][:4]}")
        assert_bitwise(to_numpy(res.bank)[1:], patterns, f"{dtype} pattern rows after the call")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_bank_rows_round_to_nearest_even(xp, rng, dtype):
    # token t writes a fresh zero row with a = beta = 1, so the new row is exactly v_t in
    # float32; storing it in a 16-bit bank must round like numpy / ml_dtypes (to nearest, ties
    # to even), subnormals and overflow to inf included
    dt = BF16 if dtype == "bfloat16" else np.dtype(np.float16)
    T, hd = 48, 64
    finfo = ml_dtypes.finfo(dt) if dt == BF16 else np.finfo(dt)
    lo = np.log2(float(finfo.smallest_subnormal)) - 2
    hi = min(np.log2(float(finfo.max)) + 1, 127.9)          # finite in float32
    mag = 2.0 ** rng.uniform(lo, hi, size=(T, hd))
    v = (mag * rng.choice([-1.0, 1.0], size=(T, hd))).astype(np.float32)
    tiny = float(finfo.smallest_subnormal)
    if dt == BF16:   # beyond the largest bfloat16 + half an ulp: inf; half the smallest: 0
        edges = [np.finfo(np.float32).max, -np.finfo(np.float32).max, 3.3961776e38]
    else:            # 65520 is halfway between 65504 and 2^16: ties to even -> inf
        edges = [65519.0, 65520.0, -65520.0, 65504.0]
    edges += [tiny / 2, -tiny / 2, 1.5 * tiny, 2.5 * tiny, tiny]
    # a third of the entries exactly halfway between two neighbouring 16-bit values (the
    # bit pattern + 1 is the next value away from zero, for either sign)
    k = rng.random((T, hd)) < 1 / 3
    with np.errstate(over="ignore", invalid="ignore"):
        near = v.astype(dt)
        nxt = (near.view(np.uint16) + np.uint16(1)).view(dt)
        mid = ((near.astype(np.float64) + nxt.astype(np.float64)) / 2).astype(np.float32)
    ok = np.isfinite(mid) & np.isfinite(nxt.astype(np.float64))
    v = np.where(k & ok, mid, v).astype(np.float32)
    assert (k & ok).sum() > T * hd // 5
    v[0, :len(edges)] = np.array(edges, np.float32)
    S = T + 1
    args = _one_token_per_row(T, S, hd, np.zeros((S, hd), dt), np.arange(T), 1.0, 1.0, v,
                              np.full(T, T), 0.0)
    res = sdm.forward(*[xp.asarray(a) for a in args], sdm.SDMConfig(S, 1, 16),
                      needs_backward=False)
    got = to_numpy(res.bank)
    with np.errstate(over="ignore"):
        want = v.astype(dt)
    assert np.isinf(want.astype(np.float64)).any(), "the test covers overflow to inf"
    assert (np.abs(want.astype(np.float64)) < float(finfo.smallest_normal)).any(), "subnormals"
    bad = got[:T].view(np.uint16) != want.view(np.uint16)
    assert not bad.any(), (f"{dtype} rounding differs at {int(bad.sum())} of {bad.size}: "
                           f"float32 {v[bad][:3]} -> {got[:T][bad][:3]}, want {want[bad][:3]}")
    assert (got[T].view(np.uint16) == 0).all(), "the read-only row stays zero"


# Mixed dtypes: the 16-bit bounds above, float32 / float64 ones where no 16-bit array is
# involved. Worst measured on the CPU backend (20 seeds): 16-bit bank or values 2.4e-3
# (bfloat16) and 3.2e-4 (float16); float32 storage with float64 arithmetic 3.7e-8; gradients
# of bfloat16 weights (rounded to bfloat16) 2.2e-3.
F16_RTOL, BF16_RTOL = LOWP_RTOL[np.dtype(np.float16)], LOWP_RTOL[BF16]
MIXED = {
    # bank, values, weights, (forward tolerance, gradient tolerance)
    "bank-f32-values-bf16": (np.float32, BF16, np.float32, (BF16_RTOL, BF16_RTOL)),
    "bank-bf16-values-f32": (BF16, np.float32, np.float32, (BF16_RTOL, BF16_RTOL)),
    "bank-f16-values-f32-weights-f16": (np.float16, np.float32, np.float16, (F16_RTOL, F16_RTOL)),
    "bank-bf16-values-f16": (BF16, np.float16, np.float32, (BF16_RTOL, BF16_RTOL)),
    # bfloat16 weights are exact in float32; their gradients come back rounded to bfloat16
    "bank-f32-values-f32-weights-bf16": (np.float32, np.float32, BF16, (F32_RTOL, BF16_RTOL)),
    "bank-f32-values-f32-weights-f64": (np.float32, np.float32, np.float64, (F32_RTOL, F32_RTOL)),
    # a float64 operand makes the arithmetic float64; the float32 storage bounds the error
    "bank-f64-values-f32": (np.float64, np.float32, np.float32, (1e-6, 1e-6)),
    "bank-f32-values-f64": (np.float32, np.float64, np.float64, (1e-6, 1e-6)),
    "bank-f64-values-bf16": (np.float64, BF16, np.float64, (BF16_RTOL, BF16_RTOL)),
}


@pytest.mark.parametrize("combo", list(MIXED.values()), ids=list(MIXED))
def test_mixed_dtypes(xp, rng, combo):
    bank_dt, value_dt, weight_dt = (np.dtype(d) for d in combo[:3])
    rtol, grad_rtol = combo[3]
    pb = make_problem(rng, B=2, T=24, P=2, hd=8, S=24, W=3, dtype=bank_dt,
                      value_dtype=value_dt, weight_dtype=weight_dt)
    dr, dM = random_grads(rng, pb)
    res, readings, final, g, bank0 = run_op(xp, pb, cfg_for(pb, 8), dr, dM)
    f64 = np.dtype(np.float64) in (bank_dt, value_dt)
    assert readings.dtype == value_dt, "readings take the values' dtype"
    assert final.dtype == bank_dt, "the final bank keeps the bank dtype"
    assert to_numpy(g.bank).dtype == (np.float64 if f64 else np.float32)
    assert to_numpy(g.values).dtype == value_dt
    for name in ("write_w", "beta", "read_w"):
        assert to_numpy(getattr(g, name)).dtype == weight_dt, f"grad {name} dtype"
    r_ref, M_ref = reference_fwd(pb)
    assert_close(readings, r_ref, rtol, "readings")
    assert_close(final, M_ref, rtol, "final bank")
    for name, w in zip(GRAD_NAMES, reference_bwd(pb, dr, dM)):
        assert_close(getattr(g, name), w, grad_rtol, f"grad {name}")
    assert_bitwise(res.bank, bank0, "bank after backward (rewound)")


# ----------------------------------------------------------------------------- snapshot_quant

# Quantized snapshots. Worst relative RMS error measured on the CPU backend over 20 seeds
# (B=2 T=48 P=2 hd=32 S=64 W=4 C=16); "rewound" is over the bank entries some token wrote
# (the others are restored bitwise); the grads of write_w, beta and read_w carry the error:
#   float32 bank,  bf16:     grads <= 1.5e-3, rewound 1.7e-3
#   float32 bank,  fp8_e4m3: grads <= 2.3e-2, rewound 2.5e-2
#   float32 bank,  int8:     grads <= 5.2e-3, rewound 5.5e-3
#   bfloat16 bank, fp8_e4m3: grads <= 2.4e-2, rewound 2.4e-2
#   bfloat16 bank, int8:     grads <= 5.6e-3, rewound 5.7e-3
# The bounds below are 2.3-2.9x those. The grads of the bank and of the values do not depend on
# the bank's content (the op is linear in M0 and v), so they must equal the exact-snapshot ones.
QUANT = {
    "f32-bank-bf16": (np.float32, "bf16"),
    "f32-bank-fp8_e4m3": (np.float32, "fp8_e4m3"),
    "f32-bank-int8": (np.float32, "int8"),
    "bf16-bank-fp8_e4m3": (BF16, "fp8_e4m3"),
    "bf16-bank-int8": (BF16, "int8"),
}
QUANT_BOUNDS = {  # mode: (gradient bound, rewound-entries bound)
    "bf16": (4e-3, 4e-3),
    "fp8_e4m3": (6e-2, 6e-2),
    "int8": (1.5e-2, 1.5e-2),
}
QUANT_PAYLOAD = {"bf16": 2, "fp8_e4m3": 1, "int8": 1}   # bytes per value (+4 per row for a scale)


@pytest.mark.parametrize("combo", list(QUANT.values()), ids=list(QUANT))
def test_snapshot_quant(xp, rng, combo):
    bank_dt, mode = combo
    pb = make_problem(rng, B=2, T=48, P=2, hd=32, S=64, W=4, dtype=bank_dt)
    dr, dM = random_grads(rng, pb)
    cfg_q = cfg_for(pb, 16, snapshot_quant=mode)
    # the saved state shrinks as the mode promises
    x = pb.to(xp)
    nbytes_exact = sdm.forward(x.bank, *x.inputs, cfg_for(pb, 16)).saved.nbytes
    nbytes_q = sdm.forward(x.bank, *x.inputs, cfg_q).saved.nbytes
    row = pb.hd * np.dtype(bank_dt).itemsize
    row_q = pb.hd * QUANT_PAYLOAD[mode] + (0 if mode == "bf16" else 4)
    assert 0 < nbytes_q <= nbytes_exact * (row_q / row + 0.05), (
        f"{mode}: saved state {nbytes_q} bytes vs {nbytes_exact} exact (expected ratio "
        f"{row_q / row:.3f})")
    exact = run_op(xp, pb, cfg_for(pb, 16), dr, dM)
    quant = run_op(xp, pb, cfg_q, dr, dM)
    res_q, readings_q, final_q, g_q, bank0 = quant
    # the forward is untouched by the snapshot mode
    assert_bitwise(readings_q, exact[1], f"{mode}: readings")
    assert_bitwise(final_q, exact[2], f"{mode}: final bank")
    grad_bound, rewind_bound = QUANT_BOUNDS[mode]
    want = reference_bwd(pb, dr, dM)
    base_tol = F32_RTOL if bank_dt == np.float32 else LOWP_RTOL[BF16]
    for name, w in zip(GRAD_NAMES, want):
        assert_close(getattr(exact[3], name), w, base_tol, f"exact snapshots: grad {name}")
        assert_close(getattr(g_q, name), w, grad_bound, f"{mode}: grad {name}")
    for name in ("bank", "values"):
        assert_close(getattr(g_q, name), getattr(exact[3], name), 1e-5,
                     f"{mode}: grad {name} vs exact snapshots (independent of the bank)")
    # the rewound bank: rows no token wrote are bitwise the initial ones; written rows are
    # the initial ones up to the quantisation error
    rewound = to_numpy(res_q.bank)
    assert rewound.dtype == bank_dt
    written = np.zeros(pb.bank.shape, dtype=bool)
    hd = pb.hd
    for b in range(pb.B):
        for p in range(pb.P):
            rows = b * pb.S + np.unique(pb.write_idx[b, :, p, :])
            written[rows, p * hd:(p + 1) * hd] = True
    assert written.any() and not written.all()
    assert_bitwise(rewound[~written], bank0[~written], f"{mode}: rewound unwritten rows")
    err = rel_err(rewound[written], bank0[written])
    assert err <= rewind_bound, f"{mode}: rewound written rows rel RMS {err:.3e} > {rewind_bound}"
    assert np.isfinite(rewound.astype(np.float64)).all()


ODD_QUANT = {
    "f32-bank-int8-hd60": (np.float32, "int8", 60),
    "f32-bank-fp8_e4m3-hd6": (np.float32, "fp8_e4m3", 6),
    "f32-bank-bf16-hd3": (np.float32, "bf16", 3),
    "bf16-bank-int8-hd60": (BF16, "int8", 60),
}


@pytest.mark.parametrize("combo", list(ODD_QUANT.values()), ids=list(ODD_QUANT))
def test_snapshot_quant_odd_head_width(xp, rng, combo):
    # an hd the quantized kernels may not tile: either served within the bounds above, or
    # refused with UnsupportedConfigurationError before anything is modified (SPEC §5)
    bank_dt, mode, hd = combo
    pb = make_problem(rng, B=1, T=30, P=2, hd=hd, S=32, W=3, dtype=bank_dt)
    dr, dM = random_grads(rng, pb)
    x = pb.to(xp)
    before = [to_numpy(a).copy() for a in x.args()]
    cfg = cfg_for(pb, 8, snapshot_quant=mode)
    try:
        res = sdm.forward(x.bank, *x.inputs, cfg, inplace=True)
    except sdm.UnsupportedConfigurationError as exc:
        assert "snapshot_quant" in str(exc) or "hd" in str(exc), str(exc)
        for name, b, now in zip(ARG_NAMES, before, x.args()):
            assert_bitwise(now, b, f"{name} after the refusal")
        res = None
    r_ref, M_ref = reference_fwd(dataclasses.replace(pb, bank=before[0]))
    want = reference_bwd(dataclasses.replace(pb, bank=before[0]), dr, dM)
    if res is None:   # the refusal left everything usable: an exact-snapshot call works
        res = sdm.forward(x.bank, *x.inputs, cfg_for(pb, 8), inplace=True)
        bound = F32_RTOL if bank_dt == np.float32 else LOWP_RTOL[BF16]
    else:
        bound = QUANT_BOUNDS[mode][0]
    fwd_tol = F32_RTOL if bank_dt == np.float32 else LOWP_RTOL[BF16]
    assert_close(res.readings, r_ref, fwd_tol, "readings")
    assert_close(res.bank, M_ref, fwd_tol, "final bank")
    g = sdm.backward(res.saved, xp.asarray(dr), xp.asarray(dM))
    for name, w in zip(GRAD_NAMES, want):
        assert_close(getattr(g, name), w, bound, f"{mode} hd={hd}: grad {name}")
    assert_close(x.bank, before[0], QUANT_BOUNDS[mode][1], "rewound bank")


# ----------------------------------------------------------------------------- API semantics

def test_needs_backward_false(xp, rng):
    pb_np = make_problem(rng, T=20)
    pb = pb_np.to(xp)
    cfg = cfg_for(pb, 8)
    with_bwd = sdm.forward(pb.bank, *pb.inputs, cfg, needs_backward=True)
    without = sdm.forward(pb.bank, *pb.inputs, cfg, needs_backward=False)
    assert without.saved is None
    assert isinstance(with_bwd.saved, sdm.SavedState)
    assert_bitwise(without.readings, with_bwd.readings, "readings")
    assert_bitwise(without.bank, with_bwd.bank, "final bank")
    r_ref, M_ref = reference_fwd(pb_np)
    assert_close(without.readings, r_ref, F64_RTOL, "readings")
    assert_close(without.bank, M_ref, F64_RTOL, "final bank")
    with pytest.raises(TypeError, match="saved"):
        sdm.backward(without.saved, xp.zeros_like(without.readings))


def test_inplace_true_updates_the_callers_bank(xp, rng):
    pb_np = make_problem(rng, T=20)
    pb = pb_np.to(xp)
    bank = pb.bank
    initial = to_numpy(bank).copy()
    dr, dM = random_grads(rng, pb_np)
    r_ref, M_ref = reference_fwd(pb_np)   # before: on the CPU pb_np.bank is `bank` itself
    want = reference_bwd(pb_np, dr, dM)
    res = sdm.forward(bank, *pb.inputs, cfg_for(pb, 8), inplace=True)
    assert res.bank is bank, "inplace=True returns the caller's bank object"
    assert_close(bank, M_ref, F64_RTOL, "caller's bank after the forward")
    assert_close(res.readings, r_ref, F64_RTOL, "readings")
    g = sdm.backward(res.saved, xp.asarray(dr), xp.asarray(dM))
    assert_bitwise(bank, initial, "caller's bank after backward (rewound in place)")
    for name, w in zip(GRAD_NAMES, want):
        assert_close(getattr(g, name), w, F64_RTOL, f"grad {name}")


def test_inplace_false_leaves_the_input_bank(xp, rng):
    pb_np = make_problem(rng, T=20)
    pb = pb_np.to(xp)
    inputs_before = [to_numpy(a).copy() for a in pb.args()]
    res = sdm.forward(pb.bank, *pb.inputs, cfg_for(pb, 8), inplace=False)
    assert res.bank is not pb.bank
    assert not xp.shares_memory(res.bank, pb.bank)
    for name, before, now in zip(ARG_NAMES, inputs_before, pb.args()):
        assert_bitwise(now, before, f"{name} after forward(inplace=False)")
    _, M_ref = reference_fwd(pb_np)
    assert_close(res.bank, M_ref, F64_RTOL, "final bank")
    dr, _ = random_grads(rng, pb_np)
    sdm.backward(res.saved, xp.asarray(dr))
    assert_bitwise(res.bank, inputs_before[0], "res.bank after backward")
    assert_bitwise(pb.bank, inputs_before[0], "input bank after backward")


def test_outputs_have_the_inputs_array_type(xp, rng):
    pb = make_problem(rng, T=10, dtype=np.float32).to(xp)
    res = sdm.forward(pb.bank, *pb.inputs, cfg_for(pb, 4))
    g = sdm.backward(res.saved, xp.ones_like(res.readings), xp.ones_like(pb.bank))
    outs = {"readings": res.readings, "bank": res.bank,
            **{f"grad {n}": getattr(g, n) for n in GRAD_NAMES}}
    for name, out in outs.items():
        assert type(out) is type(pb.bank), f"{name} is a {type(out)}, not {type(pb.bank)}"
        if xp is not np:
            assert out.device == pb.bank.device, f"{name} on another device"
    shapes = {"readings": pb.values.shape, "bank": pb.bank.shape, "grad bank": pb.bank.shape,
              "grad write_w": pb.write_w.shape, "grad values": pb.values.shape,
              "grad beta": pb.beta.shape, "grad read_w": pb.read_w.shape}
    for name, shape in shapes.items():
        assert tuple(outs[name].shape) == tuple(shape), f"{name} shape"


def test_second_backward_raises(xp, rng):
    pb_np = make_problem(rng, T=12)
    pb = pb_np.to(xp)
    initial = to_numpy(pb.bank).copy()
    res = sdm.forward(pb.bank, *pb.inputs, cfg_for(pb, 4))
    dr, dM = random_grads(rng, pb_np)
    g = sdm.backward(res.saved, xp.asarray(dr), xp.asarray(dM))
    first = {n: to_numpy(getattr(g, n)).copy() for n in GRAD_NAMES}
    assert res.saved.consumed
    with pytest.raises(RuntimeError, match="consumed"):
        sdm.backward(res.saved, xp.asarray(dr), xp.asarray(dM))
    # the refused call touched nothing: the bank is still the rewound initial bank
    assert_bitwise(res.bank, initial, "bank after the refused second backward")
    for n, w in zip(GRAD_NAMES, reference_bwd(pb_np, dr, dM)):
        assert_bitwise(getattr(g, n), first[n], f"first grad {n} after the refused backward")
        assert_close(first[n], w, F64_RTOL, f"grad {n}")


def test_backend_refusal_of_a_backward_leaves_the_state_unconsumed(rng):
    """A backend's ``check_backward`` (GPU: the snapshots' chunk no longer fits the backward)
    runs before the saved state is consumed: after its error, nothing is modified and the
    same state still runs its backward."""
    from sdm_cupy.kernels import cpu

    class Refusing:
        def __init__(self):
            self.refuse = True

        def __getattr__(self, name):
            return getattr(cpu, name)

        def check_backward(self, lay, config, snapshots):
            assert snapshots is not None
            if self.refuse:
                raise RuntimeError("refused by the backend")

    pb = make_problem(rng, B=2, T=9, P=2, hd=4, S=10, W=3)
    cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size=4)
    res = sdm.forward(pb.bank, *pb.inputs, cfg)
    final = res.bank.copy()
    res.saved.backend = backend = Refusing()
    dr = rng.normal(size=pb.values.shape)
    with pytest.raises(RuntimeError, match="refused by the backend"):
        sdm.backward(res.saved, dr)
    assert not res.saved.consumed and np.array_equal(res.bank, final)
    backend.refuse = False
    g = sdm.backward(res.saved, dr)
    assert res.saved.consumed and np.array_equal(res.bank, pb.bank)
    want = reference_bwd(pb, dr, None)
    assert_close(g.write_w, want[1], 1e-9, "grad write_w")


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_expand_and_sum_memory_batch(xp, rng, dtype):
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    S, D, B = 7, 12, 3
    param = rng.normal(size=(S, D)).astype(dt)
    p = xp.asarray(param)
    out = sdm.expand_memory_batch(p, B)
    assert type(out) is type(p)
    assert_bitwise(out, np.tile(param, (B, 1)), "expand_memory_batch vs numpy.tile")
    # the expanded bank is handed to forward(inplace=True): it must never alias the parameter
    one = sdm.expand_memory_batch(p, 1)
    assert not xp.shares_memory(out, p) and not xp.shares_memory(one, p)
    assert_bitwise(one, param, "expand_memory_batch(param, 1)")
    grad = rng.normal(size=(B * S, D)).astype(dt)
    g = xp.asarray(grad)
    summed = sdm.sum_memory_batch(g, S)
    assert not xp.shares_memory(summed, g)
    single = sdm.sum_memory_batch(g[:S], S)
    assert not xp.shares_memory(single, g)
    assert_bitwise(single, grad[:S], "sum_memory_batch of one copy")
    want = grad.astype(np.float64).reshape(B, S, D).sum(axis=0)
    assert to_numpy(summed).dtype == dt and tuple(summed.shape) == (S, D)
    # accumulated in float32 at least, then rounded once to the grad's dtype
    tol = {"float64": 1e-12, "float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    assert_close(summed, want, tol, "sum_memory_batch vs numpy sum")


def test_expand_then_sum_is_b_times_param(xp, rng):
    param = rng.normal(size=(5, 8))
    out = sdm.sum_memory_batch(sdm.expand_memory_batch(xp.asarray(param), 4), 5)
    assert_close(out, 4 * param, 1e-12, "sum(expand(param, 4))")


# ----------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_decode_token_by_token_equals_one_call(xp, rng, inplace):
    pb_np = make_problem(rng, B=2, T=12, P=2, hd=8, S=16, W=3, repeat=False)
    pb = pb_np.to(xp)
    cfg = cfg_for(pb, 4)
    whole = sdm.forward(pb.bank, *pb.inputs, cfg, needs_backward=False)
    state = sdm.LayerState(pb.bank.copy(), 0)
    readings = []
    for t in range(pb.T):
        step = [x[:, t:t + 1] for x in pb.inputs]
        res = sdm.forward(state.memory, *step, cfg, needs_backward=False, inplace=inplace)
        if inplace:
            assert res.bank is state.memory
        assert state.update_(res.bank, seq_len=1) is state
        readings.append(to_numpy(res.readings))
    assert state.seq_len == pb.T
    assert_close(np.concatenate(readings, axis=1), whole.readings, F64_RTOL,
                 "token-by-token readings vs one call")
    assert_close(state.memory, whole.bank, F64_RTOL, "token-by-token bank vs one call")
    r_ref, M_ref = reference_fwd(pb_np)
    assert_close(whole.readings, r_ref, F64_RTOL, "one-call readings vs reference")
    assert_close(state.memory, M_ref, F64_RTOL, "decoded bank vs reference")


# ----------------------------------------------------------------------------- properties (CPU)

@st.composite
def small_problems(draw):
    B = draw(st.integers(1, 2))
    T = draw(st.integers(1, 12))
    P = draw(st.integers(1, 3))
    hd = draw(st.integers(1, 6))
    S = draw(st.integers(1, 20))
    W = draw(st.integers(1, 4))
    C = draw(st.integers(1, 8))
    repeat = draw(st.booleans())
    index_dtype = draw(st.sampled_from([np.int32, np.int64]))
    grad_bank = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    return dict(B=B, T=T, P=P, hd=hd, S=S, W=W, repeat=repeat, index_dtype=index_dtype), C, \
        grad_bank, seed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems())
def test_property_cpu_forward_and_gradients_match_reference(drawn):
    shape, C, grad_bank, seed = drawn
    rng = np.random.default_rng(seed)
    pb = make_problem(rng, **shape)
    if not shape["repeat"]:
        # small S collides often: keep beta*|k|^2 < 2 so the recurrence stays bounded
        pb = dataclasses.replace(pb, beta=pb.beta / shape["W"])
    dr, dM = random_grads(rng, pb, grad_bank)
    check_vs_reference(np, pb, cfg_for(pb, C), dr, dM, F64_RTOL)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems(), st.integers(1, 9))
def test_property_cpu_float32_any_two_chunk_sizes_agree(drawn, other_C):
    shape, C, grad_bank, seed = drawn
    rng = np.random.default_rng(seed)
    pb = make_problem(rng, dtype=np.float32, **shape)
    if not shape["repeat"]:
        pb = dataclasses.replace(pb, beta=(pb.beta / shape["W"]).astype(np.float32))
    dr, dM = random_grads(rng, pb, grad_bank)
    one = run_op(np, pb, cfg_for(pb, C), dr, dM)
    two = run_op(np, pb, cfg_for(pb, other_C), dr, dM)
    names = ("readings", "final bank", *(f"grad {n}" for n in GRAD_NAMES))
    for name, a, b in zip(names, (one[1], one[2], *(getattr(one[3], n) for n in GRAD_NAMES)),
                          (two[1], two[2], *(getattr(two[3], n) for n in GRAD_NAMES))):
        assert_close(a, b, F32_RTOL, f"C={C} vs C={other_C}: {name}")
    r_ref, _ = reference_fwd(pb)
    assert_close(one[1], r_ref, F32_RTOL, "float32 readings vs reference")


def test_concurrent_calls_from_threads(xp, rng):
    # the CPU backend serialises its parallel sections; calls from several threads must each
    # get their own correct result
    from concurrent.futures import ThreadPoolExecutor
    problems = [make_problem(rng, B=2, T=16, P=2, hd=8, S=16, W=3) for _ in range(6)]
    wants = [reference_fwd(pb) for pb in problems]

    def one(pb):
        x = pb.to(xp)
        res = sdm.forward(x.bank, *x.inputs, cfg_for(pb, 4))
        g = sdm.backward(res.saved, xp.ones_like(res.readings))
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()
        return to_numpy(res.readings), to_numpy(g.values), to_numpy(res.bank)

    with ThreadPoolExecutor(max_workers=3) as pool:
        outs = list(pool.map(one, problems))
    for k, (pb, (r_ref, _), (readings, dv, rewound)) in enumerate(zip(problems, wants, outs)):
        assert_close(readings, r_ref, F64_RTOL, f"thread call {k}: readings")
        dv_ref = reference_bwd(pb, np.ones(pb.values.shape))[2]
        assert_close(dv, dv_ref, F64_RTOL, f"thread call {k}: grad values")
        assert_bitwise(rewound, pb.bank, f"thread call {k}: rewound bank")


# ----------------------------------------------------------------------------- memory hygiene

def test_untouched_rows_are_never_read(xp, rng):
    # NaN in every bank row (and grad-bank row) that no index names: a backend that reads
    # memory it does not own (a dense pass over all slots, an unwritten scratch row) spreads
    # the NaN into readings or gradients.
    pb = make_problem(rng, B=2, T=16, P=2, hd=8, S=40, W=2)
    touched = np.zeros(pb.bank.shape, dtype=bool)
    for b in range(pb.B):
        for p in range(pb.P):
            ids = np.unique(np.concatenate([pb.write_idx[b, :, p].ravel(),
                                            pb.read_idx[b, :, p].ravel()]))
            touched[b * pb.S + ids, p * pb.hd:(p + 1) * pb.hd] = True
    assert not touched.all()
    clean_bank = pb.bank.copy()
    pb.bank[~touched] = np.nan
    dr, dM = random_grads(rng, pb)
    clean_dM = dM.copy()
    dM[~touched] = np.nan
    ref = dataclasses.replace(pb, bank=clean_bank)
    res, readings, final, g, bank0 = run_op(xp, pb, cfg_for(pb, 4), dr, dM)
    r_ref, M_ref = reference_fwd(ref)
    assert_close(readings, r_ref, F64_RTOL, "readings with NaN in untouched rows")
    assert np.isnan(final[~touched]).all(), "untouched rows of the final bank are left alone"
    assert_close(final[touched], M_ref[touched], F64_RTOL, "touched rows of the final bank")
    want = reference_bwd(ref, dr, clean_dM)
    for name, w in zip(GRAD_NAMES[1:], want[1:]):
        assert_close(getattr(g, name), w, F64_RTOL, f"grad {name} with NaN in untouched rows")
    gb = to_numpy(g.bank)
    assert np.isnan(gb[~touched]).all(), "untouched rows of grad bank are the given grad bank"
    assert_close(gb[touched], want[0][touched], F64_RTOL, "touched rows of grad bank")
    assert_bitwise(res.bank, bank0, "rewound bank")


def test_forward_is_deterministic(xp, rng):
    # a graph replay of a forward (SPEC §8.5) must give "the same result": two identical calls
    # agree bitwise, repeated slots (the order-sensitive sums) included
    pb = make_problem(rng, B=2, T=30, P=2, hd=8, S=16, W=4, dtype=np.float32, repeat=True).to(xp)
    cfg = cfg_for(pb, 8)
    one = sdm.forward(pb.bank, *pb.inputs, cfg, needs_backward=False)
    two = sdm.forward(pb.bank, *pb.inputs, cfg, needs_backward=False)
    assert_bitwise(one.readings, two.readings, "readings of two identical calls")
    assert_bitwise(one.bank, two.bank, "final banks of two identical calls")
