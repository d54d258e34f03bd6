"""Tests specific to the Numba CPU backend (sdm_cupy.kernels.cpu): the number formats on bits,
bitwise determinism, the out-of-range id path with check_indices=False, thread safety and the
thread pool, measured snapshot-quantization error bounds, and odd sizes. Everything is held to
the float64 reference (sdm_cupy.reference); the backend-agnostic suite is tests/test_op.py."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import sdm_cupy as sdm
from helpers import (BF16, MAGNITUDE_EXPONENTS, assert_close, make_problem, reference_bwd,
                     reference_fwd, rel_err)
from sdm_cupy.kernels import cpu
from sdm_cupy.kernels import cpu_formats as F

F64_RTOL = 1e-9


def cfg_for(pb, C=8, **kw):
    return sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size=C, **kw)


def run_fwd_bwd(pb, cfg, dr, dM=None, check_indices=True):
    res = sdm.forward(*pb.args(), cfg, check_indices=check_indices)
    readings, final = res.readings.copy(), res.bank.copy()
    g = sdm.backward(res.saved, dr, dM)
    return res, readings, final, g


def assert_matches_reference(pb, cfg, rng, rtol=F64_RTOL, with_dM=True):
    r_ref, M_ref = reference_fwd(pb)
    dr = rng.normal(size=r_ref.shape)
    dM = rng.normal(size=M_ref.shape) if with_dM else None
    res, readings, final, g = run_fwd_bwd(pb, cfg, dr, dM)
    want = reference_bwd(pb, dr, dM)
    assert_close(readings, r_ref, rtol, "readings")
    assert_close(final, M_ref, rtol, "final bank")
    for name, got, ref in zip(("d_bank", "d_write_w", "d_values", "d_beta", "d_read_w"),
                              (g.bank, g.write_w, g.values, g.beta, g.read_w), want):
        assert_close(got, ref, rtol, name)
    return res


# ------------------------------------------------------------------------- number formats

@njit
def _apply(fn, x, out):
    for i in range(x.size):
        out[i] = fn(x[i])


def _f32_samples(rng, n=200_000):
    raw = rng.integers(0, 2 ** 32, size=n, dtype=np.uint64).astype(np.uint32)
    scaled = (rng.normal(size=n) * np.exp(rng.uniform(-40, 15, size=n))).astype(np.float32)
    edge = np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 65536, 6.1e-5,
                     5.96e-8, 2.98e-8, 2.99e-8, 1e-45], np.float32)
    return np.concatenate([raw, scaled.view(np.uint32), edge.view(np.uint32)])


def test_float16_decode_is_exact_for_every_bit_pattern():
    bits = np.arange(2 ** 16, dtype=np.uint16)
    out = np.empty(bits.size, np.int64)
    _apply(F.f16_to_f32_bits, bits, out)
    got = out.astype(np.uint32).view(np.float32)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_float_to_16bit_rounds_like_numpy(rng, fmt):
    x = _f32_samples(rng)
    out = np.empty(x.size, np.int64)
    fn, dt = (F.f32_bits_to_f16, np.float16) if fmt == "f16" else (F.f32_bits_to_bf16, BF16)
    _apply(fn, x, out)
    xf = x.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = xf.astype(dt).view(np.uint16)
    nan = np.isnan(xf)
    got = out.astype(np.uint16)
    assert np.array_equal(got[~nan], want[~nan]), f"{fmt}: round-to-nearest-even mismatch"
    assert np.isnan(got[nan].view(dt).astype(np.float32)).all()


def test_fp8_e4m3_codes_match_ml_dtypes(rng):
    y = (rng.normal(size=200_000) * np.exp(rng.uniform(-16, 6, size=200_000))).astype(np.float32)
    edge = np.float32([0, -0.0, 448, -448, 2 ** -9, 2 ** -10])
    y = np.concatenate([np.clip(y, -448, 448), edge])
    out = np.empty(y.size, np.int64)
    _apply(F.fp8_e4m3_encode, y.view(np.uint32), out)
    assert np.array_equal(out.astype(np.uint8), y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    big = np.float32([449, 464, 1e30, np.inf, -1e30]).view(np.uint32)
    out = np.empty(big.size, np.int64)
    _apply(F.fp8_e4m3_encode, big, out)
    assert list(out & 0x7F) == [0x7E] * 5, "out-of-range values must saturate at 448"
    codes = np.arange(256, dtype=np.uint8)
    dec = np.empty(256)
    _apply(F.fp8_e4m3_decode, codes, dec)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    ok = ~np.isnan(want)
    assert np.array_equal(dec[ok], want[ok]) and np.isnan(dec[~ok]).all()


# ----------------------------------------------------------------- determinism and sizes

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_bitwise_deterministic_across_calls(rng, dtype):
    dt = {"f32": np.float32, "bf16": BF16}[dtype]
    pb = make_problem(rng, B=3, T=77, P=2, hd=16, S=40, W=4, dtype=dt, repeat=False)
    cfg = cfg_for(pb, C=16)
    dr = rng.normal(size=(pb.B, pb.T, pb.P * pb.hd)).astype(dt)
    outs = []
    for _ in range(2):
        res, readings, final, g = run_fwd_bwd(pb, cfg, dr)
        outs.append((readings, final, res.bank.copy(), g.bank, g.write_w, g.values, g.beta,
                     g.read_w))
    for name, x, y in zip(("readings", "final", "rewound", "d_bank", "d_write_w", "d_values",
                           "d_beta", "d_read_w"), *outs):
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_bits_do_not_depend_on_the_snapshot_mode(rng, dtype):
    """The forward keeps the gathered M0 rows in scratch only when a quantized snapshot needs
    them, else its scatter adds to the bank rows: both paths must give the same bits."""
    pb = make_problem(rng, B=2, T=70, P=2, hd=24, S=48, W=4, dtype=dtype)
    outs = []
    for quant, backward in ((None, False), (None, True), ("int8", True), ("fp8_e4m3", True)):
        res = sdm.forward(*pb.args(), cfg_for(pb, C=16, snapshot_quant=quant),
                          needs_backward=backward)
        outs.append((res.readings, res.bank))
    for readings, bank in outs[1:]:
        assert np.array_equal(readings.view(np.uint8), outs[0][0].view(np.uint8))
        assert np.array_equal(bank.view(np.uint8), outs[0][1].view(np.uint8))


def test_results_do_not_depend_on_the_thread_count(rng, monkeypatch):
    import numba
    from sdm_cupy.kernels import cpu_threads
    monkeypatch.setattr(cpu_threads, "SERIAL_BELOW", 0)   # this small call on the pool too
    pb = make_problem(rng, B=2, T=40, P=3, hd=16, S=30, W=4, dtype=np.float32)
    dr = rng.normal(size=(pb.B, pb.T, pb.P * pb.hd)).astype(np.float32)
    n = numba.get_num_threads()
    outs = []
    try:
        for threads in (1, n):
            numba.set_num_threads(threads)
            _, readings, final, g = run_fwd_bwd(pb, cfg_for(pb, C=8), dr)
            outs.append((readings, final, g.bank, g.write_w, g.read_w, g.beta, g.values))
    finally:
        numba.set_num_threads(n)
    for x, y in zip(*outs):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_prange_and_pool_paths_give_the_same_bits(rng, monkeypatch, dtype):
    """Above POOL_MAX_THREADS the blocks run on Numba's prange wrappers instead of the pool
    (cpu_threads): the float32 bank takes the token-by-token forward, the bfloat16 one the
    chunked forward, both the backward; every path gives the same bits."""
    import numba
    from sdm_cupy.kernels import cpu_threads
    monkeypatch.setattr(cpu_threads, "SERIAL_BELOW", 0)
    pb = make_problem(rng, B=2, T=40, P=3, hd=16, S=30, W=4, dtype=dtype, repeat=True)
    dr = rng.normal(size=(pb.B, pb.T, pb.P * pb.hd)).astype(np.float32)
    n = numba.get_num_threads()
    outs = []
    for pool_max in (n, 0, n):          # the pool, the prange, the pool again
        monkeypatch.setattr(cpu_threads, "POOL_MAX_THREADS", pool_max)
        assert cpu_threads.on_pool() == (pool_max == n)
        _, readings, final, g = run_fwd_bwd(pb, cfg_for(pb, C=8), dr)
        outs.append((readings, final, g.bank, g.write_w, g.read_w, g.beta, g.values))
    for other in outs[1:]:
        for x, y in zip(outs[0], other):
            assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("case", [
    dict(B=1, T=5, P=3, hd=60, S=50, W=4, C=2, id="hd60"),
    dict(B=2, T=9, P=2, hd=8, S=1, W=3, C=4, id="S1"),
    dict(B=2, T=13, P=2, hd=8, S=16, W=2, C=1, id="C1"),
    dict(B=1, T=1, P=1, hd=1, S=3, W=1, C=64, id="T1_hd1"),
    dict(B=2, T=40, P=1, hd=4, S=20, W=5, C=300, id="C_above_cap_and_T"),
], ids=lambda c: c["id"])
def test_odd_sizes_float64(rng, case):
    case = {k: v for k, v in case.items() if k != "id"}
    C = case.pop("C")
    pb = make_problem(rng, **case, repeat=case["S"] <= 3)
    res = assert_matches_reference(pb, cfg_for(pb, C), rng)
    assert np.array_equal(res.bank, pb.bank), "bank after backward must equal the input bank"


def test_repeated_slots_within_and_across_tokens(rng):
    pb = make_problem(rng, B=2, T=30, P=2, hd=8, S=64, W=4)
    pb.write_idx[:, :, :, 1] = pb.write_idx[:, :, :, 0]          # repeat within a token
    pb.write_idx[:, 1::2] = pb.write_idx[:, 0:-1:2]               # and across tokens
    pb.read_idx[:, :, :, 2] = pb.write_idx[:, :, :, 3]            # read what was just written
    pb.beta /= 4
    res = assert_matches_reference(pb, cfg_for(pb, C=7), rng)
    assert np.array_equal(res.bank, pb.bank)


def test_large_S(rng):
    pb = make_problem(rng, B=2, T=50, P=2, hd=8, S=100_000, W=4)
    pb.write_idx[:, :, :, 0] = pb.S - 1                            # the last slot, repeated
    pb.read_idx[:, ::3, :, 0] = pb.S - 1
    res = assert_matches_reference(pb, cfg_for(pb, C=16), rng)
    assert np.array_equal(res.bank, pb.bank)


@pytest.mark.parametrize("S,T,W", [(1, 6, 2), (2, 9, 3), (7, 5, 2), (64, 30, 4),
                                   (4096, 6, 2), (2 ** 17, 8, 3)],
                         ids=["S1", "S2", "S7", "S64_direct", "S4096_hash", "S2^17_hash"])
def test_slot_table_modes(rng, S, T, W):
    """Both overlap tables: direct (slot-indexed, when the call touches >= S/2 addresses) and
    hashed, with power-of-two and other S, ids crowded onto few slots."""
    assert (2 * T * W >= S) == (S in (1, 2, 7, 64))
    pb = make_problem(rng, B=2, T=T, P=2, hd=4, S=S, W=W)
    pool = rng.integers(0, S, size=3)
    pb.write_idx[:, ::2] = rng.choice(pool, size=pb.write_idx[:, ::2].shape)
    pb.read_idx[:, 1::2] = rng.choice(pool, size=pb.read_idx[:, 1::2].shape)
    pb.beta /= W
    res = assert_matches_reference(pb, cfg_for(pb, C=4), rng)
    assert np.array_equal(res.bank, pb.bank)


def test_chunk_cap_splits_long_chunks(rng):
    T = cpu.CHUNK_CAP + 30
    pb = make_problem(rng, B=1, T=T, P=1, hd=4, S=12, W=2)
    r_ref, _ = reference_fwd(pb)
    res = sdm.forward(*pb.args(), cfg_for(pb, C=10 * T), needs_backward=False)
    assert_close(res.readings, r_ref, F64_RTOL, "readings")


# ------------------------------------------------------------------ out-of-range ids path

@pytest.mark.parametrize("which,bad", [("write_idx", -1), ("write_idx", 10 ** 9),
                                       ("read_idx", -(2 ** 40)), ("read_idx", 7)])
def test_out_of_range_ids_raise_and_never_touch_memory(rng, which, bad):
    pb = make_problem(rng, B=2, T=12, P=2, hd=8, S=7, W=3, index_dtype=np.int64)
    getattr(pb, which)[1, 5, 0, 2] = bad
    guard = np.full((3, pb.P * pb.hd), 1234.5)
    store = np.concatenate([guard, pb.bank, guard])              # rows around the bank
    bank = store[3:-3]
    before = pb.bank.copy()
    with pytest.raises(ValueError, match=rf"{which}.*\[0, {pb.S}\)"):
        sdm.forward(bank, *pb.inputs, cfg_for(pb, C=4), check_indices=False)
    assert np.array_equal(bank, before), "inplace=False must leave the caller's bank alone"
    with pytest.raises(ValueError, match=rf"{which}.*\[0, {pb.S}\)"):
        sdm.forward(bank, *pb.inputs, cfg_for(pb, C=4), check_indices=False, inplace=True,
                    needs_backward=False)
    assert (store[:3] == 1234.5).all() and (store[-3:] == 1234.5).all(), "wrote out of bounds"


@pytest.mark.parametrize("which,bad", [("write_idx", -1), ("write_idx", 2 ** 31 - 1),
                                       ("read_idx", -(2 ** 31)), ("read_idx", 7)])
def test_out_of_range_int32_ids_never_touch_memory(rng, which, bad):
    """The int32 kernels (ids are not widened to int64) skip bad ids the same way."""
    pb = make_problem(rng, B=2, T=12, P=2, hd=8, S=7, W=3, index_dtype=np.int32)
    getattr(pb, which)[1, 5, 0, 2] = bad
    guard = np.full((3, pb.P * pb.hd), 1234.5)
    store = np.concatenate([guard, pb.bank, guard])
    bank = store[3:-3]
    for nb in (True, False):
        with pytest.raises(ValueError, match=rf"{which}.*\[0, {pb.S}\)"):
            sdm.forward(bank, *pb.inputs, cfg_for(pb, C=4), check_indices=False, inplace=True,
                        needs_backward=nb)
    assert (store[:3] == 1234.5).all() and (store[-3:] == 1234.5).all(), "wrote out of bounds"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_int32_and_int64_ids_give_the_same_bits(rng, dtype):
    pb = make_problem(rng, B=2, T=37, P=3, hd=16, S=40, W=4, dtype=dtype)
    dr = rng.normal(size=(pb.B, pb.T, pb.P * pb.hd)).astype(dtype)
    outs = []
    for it in (np.int32, np.int64):
        args = list(pb.args())
        args[1], args[5] = args[1].astype(it), args[5].astype(it)
        res = sdm.forward(*args, cfg_for(pb, C=8))
        r, M = res.readings.copy(), res.bank.copy()
        g = sdm.backward(res.saved, dr)
        outs.append((r, M, g.bank, g.write_w, g.values, g.beta, g.read_w))
    for x, y in zip(*outs):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_out_of_range_ids_are_skipped_like_zero_weights(rng):
    """What the kernels compute for a skipped id: the op with that address's weight set to 0
    (its slot is never read or written)."""
    pb = make_problem(rng, B=1, T=10, P=1, hd=4, S=5, W=2, index_dtype=np.int64)
    pb.write_idx[0, 3, 0, 1] = 99
    pb.read_idx[0, 6, 0, 0] = -3
    bank = pb.bank.copy()
    with pytest.raises(ValueError):
        sdm.forward(bank, *pb.inputs, cfg_for(pb, C=4), check_indices=False, inplace=True,
                    needs_backward=False)
    pb.write_w[0, 3, 0, 1] = 0
    pb.write_idx[0, 3, 0, 1] = 0
    pb.read_w[0, 6, 0, 0] = 0
    pb.read_idx[0, 6, 0, 0] = 0
    _, M_ref = reference_fwd(pb)
    assert_close(bank, M_ref, F64_RTOL, "bank with skipped ids")


# ------------------------------------------------------------------------- thread safety

def test_concurrent_calls_from_four_threads(rng):
    problems = [make_problem(rng, B=2, T=60, P=2, hd=16, S=64, W=4, dtype=np.float32)
                for _ in range(4)]
    drs = [rng.normal(size=(p.B, p.T, p.P * p.hd)).astype(np.float32) for p in problems]
    cfgs = [cfg_for(p, C=16) for p in problems]
    serial = [run_fwd_bwd(p, c, d) for p, c, d in zip(problems, cfgs, drs)]
    results = [None] * 4
    errors = []

    def work(i):
        try:
            for _ in range(5):
                results[i] = run_fwd_bwd(problems[i], cfgs[i], drs[i])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (_, r0, f0, g0), (_, r1, f1, g1) in zip(serial, results):
        assert np.array_equal(r0, r1) and np.array_equal(f0, f1)
        assert np.array_equal(g0.bank, g1.bank) and np.array_equal(g0.write_w, g1.write_w)


def _record_blocks(n, nthreads, work=None, fail_at=None):
    """parallel_for over n blocks on nthreads Numba threads: (block, thread ident) per call."""
    import numba
    from sdm_cupy.kernels import cpu_threads
    seen = []
    lock = threading.Lock()

    def body(i):
        if i == fail_at:
            raise RuntimeError(f"block {i} failed")
        x = 0.0
        for k in range(20000):   # long enough for the pool's threads to take blocks too
            x += k
        with lock:
            seen.append((i, threading.get_ident()))

    old = numba.get_num_threads()
    numba.set_num_threads(nthreads)
    try:
        cpu_threads.parallel_for(n, body, work=work)
    finally:
        numba.set_num_threads(old)
    return seen


def test_thread_pool_runs_every_block_once():
    import numba
    n = numba.config.NUMBA_NUM_THREADS
    seen = _record_blocks(64, n)
    assert sorted(i for i, _ in seen) == list(range(64))
    me = threading.get_ident()
    if n >= 2:   # the caller works too, beside the pool
        assert me in {t for _, t in seen}
    # one thread (numba.set_num_threads(1)), or a call below SERIAL_BELOW: the caller alone
    from sdm_cupy.kernels import cpu_threads
    for seen in (_record_blocks(16, 1),
                 _record_blocks(16, n, work=cpu_threads.SERIAL_BELOW - 1)):
        assert sorted(i for i, _ in seen) == list(range(16))
        assert {t for _, t in seen} == {me}


def test_thread_pool_reraises_a_blocks_error():
    import numba
    n = numba.config.NUMBA_NUM_THREADS
    for threads in sorted({1, n}):
        with pytest.raises(RuntimeError, match="block 5 failed"):
            _record_blocks(40, threads, fail_at=5)
    # the pool is still usable afterwards
    assert sorted(i for i, _ in _record_blocks(8, n)) == list(range(8))


# ------------------------------------------------------------------ snapshot quantization

# Measured (six seeds, B=2 T=48 P=2 hd=32 S=24 W=4 C=8, float32 bank): relative RMS error
# against the exact-snapshot run of d_write_w / d_beta / d_read_w, and of the rewound bank
# against the initial bank:
#   bf16      1.2e-3 / 9.5e-4 / 1.7e-3, bank 1.7e-3
#   fp8_e4m3  1.7e-2 / 1.6e-2 / 2.4e-2, bank 2.4e-2
#   int8      3.5e-3 / 2.9e-3 / 5.6e-3, bank 5.5e-3
# d_bank and d_values do not depend on the bank's content (the op is affine in M), so they are
# exact whatever the snapshots. The bounds below leave a margin of about 2.5x.
QUANT_BOUNDS = {
    # mode: (max relative RMS of the weight gradients, of the rewound bank)
    "bf16": (5e-3, 4e-3),
    "fp8_e4m3": (6e-2, 5e-2),
    "int8": (1.5e-2, 1.2e-2),
}


@pytest.mark.parametrize("mode", list(QUANT_BOUNDS))
def test_quantized_snapshot_error_bounds(rng, mode):
    pb = make_problem(rng, B=2, T=48, P=2, hd=32, S=24, W=4, dtype=np.float32)
    dr = rng.normal(size=(pb.B, pb.T, pb.P * pb.hd)).astype(np.float32)
    dM = rng.normal(size=pb.bank.shape).astype(np.float32)
    _, r_x, f_x, g_x = run_fwd_bwd(pb, cfg_for(pb, C=8), dr, dM)
    res, r_q, f_q, g_q = run_fwd_bwd(pb, cfg_for(pb, C=8, snapshot_quant=mode), dr, dM)
    # the forward does not depend on how snapshots are stored
    assert np.array_equal(r_x, r_q) and np.array_equal(f_x, f_q)
    g_bound, bank_bound = QUANT_BOUNDS[mode]
    assert np.array_equal(g_q.bank, g_x.bank) and np.array_equal(g_q.values, g_x.values)
    errs = {name: rel_err(q, x) for name, q, x in zip(
        ("write_w", "beta", "read_w"), (g_q.write_w, g_q.beta, g_q.read_w),
        (g_x.write_w, g_x.beta, g_x.read_w))}
    bank_err = rel_err(res.bank, pb.bank)
    print(mode, {k: f"{v:.1e}" for k, v in errs.items()}, f"rewound bank {bank_err:.1e}")
    for name, e in errs.items():
        assert e <= g_bound, f"{mode}: d_{name} relative RMS {e:.2e} > {g_bound:.0e}"
        assert np.isfinite(e)
    assert 0 < bank_err <= bank_bound, f"{mode}: rewound bank relative RMS {bank_err:.2e}"


@pytest.mark.parametrize("mode,per_value", [("bf16", 2 ** -8), ("fp8_e4m3", 2 ** -4),
                                            ("int8", 1 / 254)])
def test_quantized_snapshot_rows_within_format_error(rng, mode, per_value):
    """Every stored row decodes within the format's error: relative 2^-8 (bf16), 2^-4 of the
    value or 2^-10 of the scale (fp8), half a step of absmax/127 (int8)."""
    pb = make_problem(rng, B=2, T=20, P=2, hd=24, S=1000, W=3, dtype=np.float32)
    pb.bank *= np.exp(rng.uniform(-6, 6, size=(pb.bank.shape[0], 1))).astype(np.float32)
    for b in range(pb.B):          # every slot written at most once: snapshots = initial rows
        for p in range(pb.P):
            pb.write_idx[b, :, p] = rng.permutation(pb.S)[:pb.T * pb.W].reshape(pb.T, pb.W)
    res = sdm.forward(*pb.args(), cfg_for(pb, C=8, snapshot_quant=mode))
    rows, scales = res.saved.snapshots
    assert rows.shape == (pb.B, pb.P, pb.T, pb.W, pb.hd)
    M = pb.bank.reshape(pb.B, pb.S, pb.P, pb.hd).astype(np.float64)
    bI = np.arange(pb.B)[:, None, None, None]
    pI = np.arange(pb.P)[None, None, :, None]
    want = M[bI, pb.write_idx, pI].transpose(0, 2, 1, 3, 4)      # [B, P, T, W, hd]
    if mode == "bf16":
        err = np.abs(rows.astype(np.float64) - want)
        bound = per_value * np.abs(want)
    else:
        scale = scales[..., None].astype(np.float64)
        err = np.abs(rows.astype(np.float64) * scale - want)
        if mode == "fp8_e4m3":
            bound = np.maximum(per_value * np.abs(want), 2 ** -10 * scale)
        else:
            bound = per_value * np.abs(want).max(axis=-1, keepdims=True)
    ratio = float((err / np.maximum(bound, 1e-300)).max())
    print(f"{mode}: max error / format bound = {ratio:.3f}")
    assert ratio <= 1.0 + 1e-5, f"{mode}: a decoded row exceeds the format's error bound"


def _quantize_rows(vals, mode):
    """cpu_formats.quantize_row over every row of vals: (bf16 bits, 1-byte codes, scales)."""
    rows, hd = vals.shape
    u16, u8 = np.zeros((rows, hd), np.uint16), np.zeros((rows, hd), np.uint8)
    scales, u32 = np.zeros(rows, np.float32), np.zeros(hd, np.uint32)
    for r in range(rows):
        F.quantize_row(vals, r, hd, F.SNAP_CODES[mode], r, u16, u8, scales, u32, u32.view(np.float32))
    return u16, u8, scales


def _rows_of_every_magnitude(rng, dtype, hd=16):
    """Rows from float32-subnormal to 1e30 in magnitude (float64: some below float32's range)."""
    exps = list(MAGNITUDE_EXPONENTS) + ([-50, -46] if dtype == np.float64 else [])
    rows = [rng.normal(size=hd) * 10.0 ** e for e in exps for _ in range(3)]
    return np.array(rows).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", ["fp8_e4m3", "int8"])
def test_byte_quantization_follows_its_rule_at_every_magnitude(rng, dtype, mode):
    """SPEC §5's rule as cpu_formats and the GPU's quant1 state it: a = the row's absmax in
    float32, scale = float32(a / qmax), y = x * (qmax / a) in float64, code = e4m3(float32(y))
    or clamp(rint(y)), zero codes where a = 0. Tiny rows (subnormal float32 included) quantize
    like any other and decode within the format's error plus the float32 rounding of their
    scale (at most qmax * 2^-150 once the scale is subnormal)."""
    x = _rows_of_every_magnitude(rng, dtype)
    _, codes, scales = _quantize_rows(x, mode)
    qmax = 448.0 if mode == "fp8_e4m3" else 127.0
    a = np.abs(x).max(axis=1).astype(np.float32).astype(np.float64)
    assert np.array_equal(scales, (a / qmax).astype(np.float32))
    live = a > 0
    y = x.astype(np.float64) * np.where(live, qmax / np.where(live, a, 1), 0)[:, None]
    exact = (a / qmax)[:, None]
    if mode == "fp8_e4m3":
        want = np.clip(y.astype(np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        dec = want.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        step = 2 ** -4 * np.abs(x) + 2 ** -10 * exact   # relative, or fp8's subnormal step
    else:
        want = np.clip(np.rint(y), -127, 127).astype(np.int8).view(np.uint8)
        dec = want.view(np.int8).astype(np.float64)
        step = 0.5 * exact
    want[~live] = 0
    assert np.array_equal(codes, want), f"{mode}: codes differ from the rule"
    err = np.abs(dec * scales[:, None] - x)
    bound = step * (1 + 2 ** -20) + qmax * 2.0 ** -150
    assert (err <= bound)[live].all(), f"{mode}: a row decodes too far off"
    normal = (exact >= 2.0 ** -126)[:, 0]              # a normal scale: the format's error alone
    assert (err <= step * (1 + 2 ** -20) + 2 ** -23 * np.abs(x))[normal].all()
    assert normal.sum() >= 15                          # the rows of 1e-30 and above
    assert live[:30].all() and not live[-6:].any() if dtype == np.float64 else live.all()


def test_bf16_snapshots_of_float64_round_once(rng):
    """A float64 value rounds to bfloat16 directly (as ml_dtypes and the GPU's __double2bfloat16
    do), not through float32, whose rounding can land on a bfloat16 tie."""
    base = rng.normal(size=(64, 16)).astype(BF16).astype(np.float64)
    ulp = np.abs(base) * 2 ** -8                       # half a bfloat16 step (above a power of 2)
    x = np.concatenate([base + ulp * (1 + 2 ** -30), base + ulp * (1 - 2 ** -30), base + ulp,
                        rng.normal(size=(64, 16)) * 10.0 ** rng.integers(-40, 30, size=(64, 1)),
                        np.array([[2 ** -133 + 2 ** -160, -1e-300, 1e300, -np.inf] * 4])])
    bits, _, _ = _quantize_rows(x, "bf16")
    with np.errstate(over="ignore"):
        want = x.astype(BF16).view(np.uint16)
    assert np.array_equal(bits, want)


def test_zero_rows_quantize_to_exact_zeros(rng):
    pb = make_problem(rng, B=1, T=6, P=1, hd=8, S=4, W=2, dtype=np.float32)
    pb.bank[:] = 0
    for mode in ("fp8_e4m3", "int8"):
        res = sdm.forward(*pb.args(), cfg_for(pb, C=2, snapshot_quant=mode))
        g = sdm.backward(res.saved, np.ones((pb.B, pb.T, pb.hd), np.float32))
        assert np.isfinite(g.write_w).all()
        assert np.array_equal(res.bank, pb.bank), f"{mode}: zero rows must rewind exactly"


# ------------------------------------------------------------- grad bank and batch helpers

def test_low_precision_grad_bank_is_rounded_once(rng):
    pb = make_problem(rng, B=2, T=30, P=2, hd=8, S=16, W=3, dtype=BF16)
    dr = rng.normal(size=(pb.B, pb.T, pb.P * pb.hd)).astype(BF16)
    g32 = run_fwd_bwd(pb, cfg_for(pb, grad_bank_fp32=True), dr)[3].bank
    g16 = run_fwd_bwd(pb, cfg_for(pb, grad_bank_fp32=False), dr)[3].bank
    assert g32.dtype == np.float32 and g16.dtype == BF16
    assert np.array_equal(g16, g32.astype(BF16)), "bf16 grad bank = float32 sum rounded once"


def test_sum_memory_batch_accumulates_in_float32(rng):
    g = np.full((64 * 3, 5), 1 / 3, np.float16)
    out = cpu.sum_memory_batch(g, 3)
    assert out.dtype == np.float16
    assert np.allclose(out.astype(np.float64), 64 * np.float64(np.float16(1 / 3)), rtol=1e-3)


def test_needs_backward_false_saves_nothing(rng):
    pb = make_problem(rng, B=1, T=4, P=1, hd=4, S=8, W=2)
    res = sdm.forward(*pb.args(), cfg_for(pb), needs_backward=False)
    assert res.saved is None


# ---- reused snapshot buffers ----------------------------------------------------------------
def _addr(a):
    return a.__array_interface__["data"][0]


@pytest.fixture
def spare():
    cpu.release_spare_buffers()
    yield
    cpu.release_spare_buffers()


@pytest.mark.parametrize("mode", [None, "int8"])
def test_snapshot_buffers_are_reused_after_backward_with_the_same_results(rng, spare, mode):
    """A consumed forward's snapshot buffers (rows, and scales for fp8/int8) serve the next
    forward of the same shape; its readings, bank and gradients equal those of a forward in
    fresh memory, bit for bit."""
    pb = make_problem(rng, B=2, T=30, P=2, hd=12, S=40, W=4, dtype=np.float32)
    cfg = cfg_for(pb, snapshot_quant=mode)
    dr = rng.normal(size=pb.values.shape).astype(np.float32)
    first = sdm.forward(*pb.args(), cfg)
    held = [a for a in first.saved._snapshots if a is not None]   # (alive: no address reuse)
    sdm.backward(first.saved, dr)
    assert all(any(a is b_ for b_ in cpu._spare[(a.shape, a.dtype)]) for a in held)
    res = sdm.forward(*pb.args(), cfg)
    got = [a for a in res.saved._snapshots if a is not None]
    assert len(got) == len(held) and all(a is b_ for a, b_ in zip(got, held))
    g = sdm.backward(res.saved, dr)
    cpu.release_spare_buffers()
    old = cpu.SPARE_BYTES
    cpu.SPARE_BYTES = 0
    try:
        want = sdm.forward(*pb.args(), cfg)
        assert not any(a is b_ for a in want.saved._snapshots for b_ in held)
        gw = sdm.backward(want.saved, dr)
        assert cpu._spare == {}
    finally:
        cpu.SPARE_BYTES = old
    assert np.array_equal(res.readings, want.readings)
    assert np.array_equal(res.bank, want.bank)
    for name in ("bank", "write_w", "values", "beta", "read_w"):
        assert np.array_equal(getattr(g, name), getattr(gw, name)), name


def test_snapshot_buffers_someone_can_hold_are_never_reused(rng, spare):
    """Buffers read through ``saved.snapshots`` or shared by ``rearmed()`` copies stay the
    caller's: a later forward of the same shape gets other memory and they keep their bits."""
    pb = make_problem(rng, B=1, T=20, P=2, hd=8, S=30, W=3, dtype=np.float32)
    cfg = cfg_for(pb)
    dr = rng.normal(size=pb.values.shape).astype(np.float32)
    res = sdm.forward(*pb.args(), cfg)
    rows = res.saved.snapshots[0]
    kept = rows.copy()
    sdm.backward(res.saved, dr)
    template = sdm.forward(*pb.args(), cfg).saved
    assert _addr(template._snapshots[0]) != _addr(rows)
    shared = template._snapshots[0]
    kept2 = shared.copy()
    sdm.backward(template.rearmed(), dr)
    nxt = sdm.forward(*pb.args(), cfg)
    assert _addr(nxt.saved._snapshots[0]) not in (_addr(rows), _addr(shared))
    assert np.array_equal(rows, kept) and np.array_equal(shared, kept2)
    assert not template.consumed and template.nbytes == shared.nbytes
    # the template itself, once rearmed, keeps its buffers out of reuse too
    t2 = sdm.forward(*pb.args(), cfg).saved
    copy = t2.rearmed()
    sdm.backward(t2, dr)
    assert _addr(sdm.forward(*pb.args(), cfg).saved._snapshots[0]) != _addr(copy._snapshots[0])


def test_spare_snapshot_memory_is_bounded_and_releasable(rng, spare, monkeypatch):
    """At most SPARE_BYTES wait for reuse (the oldest go first); release_spare_buffers()
    frees them all."""
    pb = make_problem(rng, B=1, T=16, P=1, hd=8, S=20, W=2, dtype=np.float32)
    one = pb.T * pb.W * pb.hd * 4
    monkeypatch.setattr(cpu, "SPARE_BYTES", 2 * one)
    for T in (16, 15, 14):   # three shapes of about `one` bytes each
        sub = make_problem(rng, B=1, T=T, P=1, hd=8, S=20, W=2, dtype=np.float32)
        r = sdm.forward(*sub.args(), cfg_for(sub))
        sdm.backward(r.saved, np.zeros_like(sub.values))
    kept = sorted(k[0][2] for k in cpu._spare)
    assert kept == [14, 15]
    assert cpu.release_spare_buffers() == (14 + 15) * pb.W * pb.hd * 4
    assert cpu._spare == {}


# ---- the chunked forward of SPEC §3 for every dtype (kernels.cpu.FORWARD) -------------------
def _not_called(*args):
    raise AssertionError("the recurrence kernel ran although FORWARD = 'chunked'")


@pytest.mark.parametrize("C", [1, 7, 64])
def test_chunked_forward_for_32_and_64_bit_banks_matches_reference(rng, monkeypatch, C):
    """``FORWARD = "chunked"`` runs §3's chunked kernel for float64 banks too (the default runs
    the §2 recurrence there): readings, final bank and every gradient match the float64
    reference to 1e-9, repeated slots and T not a multiple of C included, and the backward
    rewinds the bank exactly."""
    monkeypatch.setattr(cpu, "FORWARD", "chunked")
    monkeypatch.setattr(cpu, "sdm_fwd_seq_kernel", _not_called)
    pb = make_problem(rng, B=2, T=23, P=2, hd=6, S=9, W=4, repeat=True)
    dr = rng.normal(size=pb.values.shape)
    res = sdm.forward(*pb.args(), cfg_for(pb, C=C))
    r_ref, fin_ref = reference_fwd(pb)
    assert rel_err(res.readings, r_ref) < F64_RTOL
    assert rel_err(res.bank, fin_ref) < F64_RTOL
    g = sdm.backward(res.saved, dr)
    for name, want in zip(("bank", "write_w", "values", "beta", "read_w"),
                          reference_bwd(pb, dr, None)):
        assert rel_err(getattr(g, name), want) < F64_RTOL, name
    assert np.array_equal(res.bank, pb.bank)


def test_chunked_and_recurrence_forwards_agree_in_float32(rng, monkeypatch):
    """The two forward kernels of float32 banks agree to float32 rounding (readings, bank)."""
    pb = make_problem(rng, B=2, T=130, P=3, hd=16, S=200, W=5, dtype=np.float32)
    cfg = cfg_for(pb, C=64)
    auto = sdm.forward(*pb.args(), cfg, needs_backward=False)
    monkeypatch.setattr(cpu, "FORWARD", "chunked")
    monkeypatch.setattr(cpu, "sdm_fwd_seq_kernel", _not_called)
    chunked = sdm.forward(*pb.args(), cfg, needs_backward=False)
    assert rel_err(chunked.readings, auto.readings) < 1e-5
    assert rel_err(chunked.bank, auto.bank) < 1e-5
    monkeypatch.setattr(cpu, "FORWARD", "token")
    with pytest.raises(ValueError, match="FORWARD"):
        sdm.forward(*pb.args(), cfg, needs_backward=False)


# ---- the chunk the snapshots carry (kernels/saved.py) -------------------------------------------
@pytest.mark.parametrize("forward", ["auto", "chunked"])
@pytest.mark.parametrize("fwd_cap, bwd_cap", [(8, 256), (256, 8)])
def test_backward_walks_the_chunks_its_snapshots_carry(monkeypatch, forward, fwd_cap, bwd_cap):
    """``cpu.CHUNK_CAP`` changed between a forward and its backward: the snapshots hold rows
    at the starts of the forward's chunks and carry that chunk, and the backward walks it, not
    the chunk the cap gives by then. Many repeated slots (S = 5), so that other chunks would
    give other rows: the bank rewinds exactly and every gradient matches the float64 reference."""
    monkeypatch.setattr(cpu, "FORWARD", forward)
    rng = np.random.default_rng(11)
    pb = make_problem(rng, B=2, T=50, P=2, hd=6, S=5, W=3)
    cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size=64)
    dr = rng.normal(size=pb.values.shape)
    dM = rng.normal(size=pb.bank.shape)
    monkeypatch.setattr(cpu, "CHUNK_CAP", fwd_cap)
    res = sdm.forward(pb.bank.copy(), *pb.inputs, cfg)
    assert res.saved._snapshots.chunk == min(fwd_cap, 50)
    monkeypatch.setattr(cpu, "CHUNK_CAP", bwd_cap)
    g = sdm.backward(res.saved, dr, dM.copy())
    np.testing.assert_array_equal(res.bank, pb.bank)
    for name, want in zip(("bank", "write_w", "values", "beta", "read_w"),
                          reference_bwd(pb, dr, dM)):
        assert_close(getattr(g, name), want, 1e-9, f"grad {name}")
