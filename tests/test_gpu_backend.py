"""The CUDA backend on its own terms (marker ``gpu``; skipped without a device).

Agreement with the float64 reference and with the CPU backend across the knobs that only change
speed (tile width, chunk size), the device error flag of ``check_indices=False`` (bad ids are
skipped, reported, and never touch memory outside the bank), NaN-poisoned scratch, and the
absence of host synchronisation: forward+backward captured into a CUDA graph replays to the
eager result.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import sdm_cupy as sdm
from helpers import (BF16, assert_close, make_problem, near_key_limit, reference_bwd,
                     reference_fwd, spread_magnitudes, to_numpy)

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
GRADS = ("bank", "write_w", "values", "beta", "read_w")


def _cfg(pb, C, **kw):
    return sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size=C, **kw)


def _run(pb, cfg, dr, dM, **kw):
    x = pb.to(cp)
    res = sdm.forward(x.bank, *x.inputs, cfg, **kw)
    out = (to_numpy(res.readings), to_numpy(res.bank))
    g = sdm.backward(res.saved, cp.asarray(dr), None if dM is None else cp.asarray(dM))
    return out, tuple(to_numpy(getattr(g, n)) for n in GRADS), to_numpy(res.bank)


def _assert_float64_reference(pb, dr, dM, r, fin, grads):
    """Readings, final bank and every gradient against the float64 reference to 1e-9."""
    r_ref, fin_ref = reference_fwd(pb)
    assert_close(r, r_ref, 1e-9, "readings")
    assert_close(fin, fin_ref, 1e-9, "final bank")
    for name, got, want in zip(GRADS, grads, reference_bwd(pb, dr, dM)):
        assert_close(got, want, 1e-9, f"grad {name}")


@pytest.fixture
def tile_width():
    from sdm_cupy.kernels import gpu
    old = gpu.TILE_WIDTH
    yield lambda w: setattr(gpu, "TILE_WIDTH", w)
    gpu.TILE_WIDTH = old


@pytest.mark.parametrize("tw", [None, 2, 6, 20], ids=lambda w: f"tile{w}")
@pytest.mark.parametrize("C", [1, 5, 16, 64])
def test_float64_tiles_and_chunks_match_reference(rng, tile_width, tw, C):
    tile_width(tw)
    pb = make_problem(rng, B=2, T=37, P=2, hd=20, S=40, W=5)
    dr = rng.normal(size=pb.values.shape)
    dM = rng.normal(size=pb.bank.shape)
    (r, fin), grads, rewound = _run(pb, _cfg(pb, C), dr, dM)
    _assert_float64_reference(pb, dr, dM, r, fin, grads)
    assert np.array_equal(rewound, pb.bank), "rewound bank differs from the initial bank"


@pytest.mark.parametrize("knobs", [
    dict(BWD_SCRATCH=1),                                   # one chunk per backward range
    dict(BWD_SCRATCH=40_000),                              # a few chunks per range
    dict(BWD_THREADS=256), dict(BWD_THREADS=96, BWD_TILE_WIDTH=4),
    dict(BWD_TILE_WIDTH=20)], ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
@pytest.mark.parametrize("S", [6, 200], ids=lambda s: f"S{s}")   # 6: most slots repeat
def test_backward_ranges_threads_and_tiles_match_reference(rng, monkeypatch, knobs, S):
    """The backward split into ranges of chunks (each its own pre-pass and kernel launch),
    other block sizes and tile widths: the same gradients and the same rewound bank."""
    from sdm_cupy.kernels import gpu
    for k, v in knobs.items():
        monkeypatch.setattr(gpu, k, v)
    pb = make_problem(rng, B=2, T=53, P=2, hd=20, S=S, W=4)
    dr = rng.normal(size=pb.values.shape)
    dM = rng.normal(size=pb.bank.shape)
    (r, fin), grads, rewound = _run(pb, _cfg(pb, 8), dr, dM)
    _assert_float64_reference(pb, dr, dM, r, fin, grads)
    assert np.array_equal(rewound, pb.bank), "rewound bank differs from the initial bank"


@pytest.mark.parametrize("shape", [
    dict(T=70, S=6, W=4, C=16),          # most slots repeat within a chunk
    dict(T=45, S=5000, W=20, C=32),      # the backward's form sorts (its hash table won't fit)
    dict(T=40, S=300_000, W=3, C=8),     # 64-bit sort keys
], ids=lambda d: f"S{d['S']}-W{d['W']}")
def test_prepass_block_size_changes_no_bit(rng, monkeypatch, shape):
    """The pre-pass's block size (gpu.PREPASS_THREADS) changes neither the readings, the final
    bank, the snapshots nor the bank and value gradients by a bit, in both of its forms; the
    weight gradients (atomics) match the float64 reference."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=2, T=shape["T"], P=2, hd=12, S=shape["S"], W=shape["W"])
    dr = rng.normal(size=pb.values.shape)
    dM = rng.normal(size=pb.bank.shape)
    cfg = _cfg(pb, shape["C"])
    outs = []
    for threads in (512, 96, 128, 256, 384):
        monkeypatch.setattr(gpu, "PREPASS_THREADS", threads)
        x = pb.to(cp)
        res = sdm.forward(x.bank, *x.inputs, cfg)
        got = [to_numpy(res.readings), to_numpy(res.bank)]
        got += [to_numpy(a) for a in res.saved.snapshots if a is not None]
        g = sdm.backward(res.saved, cp.asarray(dr), cp.asarray(dM))
        grads = tuple(to_numpy(getattr(g, n)) for n in GRADS)
        got += [grads[0], grads[2], to_numpy(res.bank)]
        _assert_float64_reference(pb, dr, dM, got[0], got[1], grads)
        outs.append((threads, got))
    for threads, got in outs[1:]:
        for i, (a, b) in enumerate(zip(outs[0][1], got)):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (
                f"{threads} threads: result {i} differs from 512 threads'")


@pytest.mark.parametrize("S", [262143, 263144], ids=["S262143-32bit-keys", "S263144-64bit-keys"])
def test_prepass_sort_keys_at_both_sides_of_the_32_bit_limit(rng, S):
    """The pre-pass sorts (slot, entry) keys in 32 bits while S <= 2^18 - 1 (262143) and in
    64 bits above: slots next to the limit, repeated within and across tokens, give the float64
    reference's readings, final bank and gradients either way."""
    pb = near_key_limit(rng, S)
    dr = rng.normal(size=pb.values.shape)
    dM = rng.normal(size=pb.bank.shape)
    (r, fin), grads, rewound = _run(pb, _cfg(pb, 8), dr, dM)
    _assert_float64_reference(pb, dr, dM, r, fin, grads)
    assert np.array_equal(rewound, pb.bank), "rewound bank differs from the initial bank"


@pytest.mark.parametrize("tw", [None, 8, 24], ids=lambda w: f"tile{w}")
def test_bf16_partial_pieces_match_reference(rng, tile_width, tw):
    """hd = 20 is not a multiple of the 8-element bf16 piece: masked piece loads/stores."""
    tile_width(tw)
    pb = make_problem(rng, B=1, T=50, P=3, hd=20, S=64, W=4, dtype=BF16)
    dr = rng.normal(size=pb.values.shape).astype(BF16)
    (r, fin), grads, rewound = _run(pb, _cfg(pb, 16), dr, None)
    r_ref, fin_ref = reference_fwd(pb)
    assert_close(r, r_ref, 3e-2, "readings")
    assert_close(fin, fin_ref, 3e-2, "final bank")
    for name, got, want in zip(GRADS, grads, reference_bwd(pb, dr, None)):
        assert_close(got, want, 5e-2, f"grad {name}")
    assert np.array_equal(rewound.view(np.uint16), pb.bank.view(np.uint16))


@pytest.fixture
def keep_rows():
    from sdm_cupy.kernels import gpu
    old = gpu.KEEP_ROWS
    yield lambda k: setattr(gpu, "KEEP_ROWS", k)
    gpu.KEEP_ROWS = old


def _forwards_bitwise_equal(pb, cfg, settings):
    """Forward-only results of ``pb`` under each of ``settings`` (callables that set a kernel
    knob): asserts they are bitwise equal and returns the first (readings, final bank)."""
    outs = []
    for apply in settings:
        apply()
        x = pb.to(cp)
        res = sdm.forward(x.bank, *x.inputs, cfg, needs_backward=False)
        outs.append((to_numpy(res.readings), to_numpy(res.bank)))
    for a, b_ in zip(*outs):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b_).view(np.uint8))
    return outs[0]


@pytest.mark.parametrize("S", [4, 48, 5000], ids=lambda s: f"S{s}")   # 4: repeated slots
@pytest.mark.parametrize("dtype", [np.float64, BF16], ids=["f64", "bf16"])
def test_forward_kept_rows_and_staged_entries(rng, keep_rows, S, dtype):
    """The forward's two scatter sources (rows kept in shared memory, rows re-read from the
    bank) give bitwise the same results; S = 4 makes a chunk's CSR rows of Ainv and H hold more
    entries than the kernel stages (they are then read from global memory), S = 5000 few."""
    pb = make_problem(rng, B=2, T=150, P=2, hd=24, S=S, W=12, dtype=dtype, repeat=S == 4)
    r, fin = _forwards_bitwise_equal(pb, _cfg(pb, 64), [lambda k=k: keep_rows(k)
                                                        for k in (True, False)])
    r_ref, fin_ref = reference_fwd(pb)
    tol = 1e-9 if dtype == np.float64 else 5e-2
    assert_close(r, r_ref, tol, "readings")
    assert_close(fin, fin_ref, tol, "final bank")


@pytest.mark.parametrize("case", [
    (BF16, 150, 32, 12, 300, False),    # 16-column tiles, the last chunk 22 tokens
    (BF16, 130, 48, 16, 4, True),       # repeated slots; 48 columns: three 16-column tiles
    (np.float32, 100, 16, 8, 40, False),
    (np.float64, 70, 12, 5, 30, True)], ids=["bf16", "bf16-repeats", "f32", "f64"])
def test_forward_read_row_stage_is_bitwise_the_register_gather(rng, monkeypatch, case):
    """The forward's read rows staged in shared memory (gpu.STAGE_READS, automatic at the
    headline: wider tiles, one 512-thread block per SM) give bitwise the readings, final bank
    and snapshots of the register gather, with ids outside [0, S) among them (skipped, flagged,
    nothing outside the bank touched); the backward after it rewinds the bank exactly. Forced
    on with its wider tiles and off with the default ones, whatever this device's plan is."""
    from sdm_cupy.kernels import gpu
    dtype, T, hd, W, S, repeat = case
    pb = make_problem(rng, B=2, T=T, P=2, hd=hd, S=S, W=W, dtype=dtype, repeat=repeat)
    bad_w, bad_r = pb.write_idx.copy(), pb.read_idx.copy()
    bad_w[0, 5, 1, 1], bad_r[1, T - 1, 0, W - 1], bad_r[0, 9, 1, 0] = S, -3, 10 ** 6
    mask_w, mask_r = (bad_w < 0) | (bad_w >= S), (bad_r < 0) | (bad_r >= S)
    ww, rw = pb.write_w.copy(), pb.read_w.copy()
    ww[mask_w], rw[mask_r] = 0, 0
    fixed = type(pb)(**{**pb.__dict__, "write_idx": np.where(mask_w, 0, bad_w),
                        "read_idx": np.where(mask_r, 0, bad_r), "write_w": ww, "read_w": rw})
    cfg = _cfg(pb, 64)
    dr = cp.asarray(rng.normal(size=pb.values.shape).astype(dtype))
    outs, pad = [], 4
    for stage in (False, True):
        monkeypatch.setattr(gpu, "STAGE_READS", stage)
        lay = sdm._validate.layout(*(cp.asarray(a) for a in (pb.bank, bad_w, pb.write_w,
                                                              pb.values, pb.beta, bad_r,
                                                              pb.read_w)), cfg)
        assert gpu.plan(lay, cfg).rstage == stage
        x = pb.to(cp)
        big = cp.asarray(rng.normal(size=(2 * pad + pb.B * pb.S, pb.P * hd)).astype(dtype))
        guard = big.copy()
        bank = big[pad:pad + pb.B * pb.S]
        bank[...] = x.bank
        guard[pad:pad + pb.B * pb.S] = bank
        sdm.check_device_errors()
        res = sdm.forward(bank, cp.asarray(bad_w), x.write_w, x.values, x.beta,
                          cp.asarray(bad_r), x.read_w, cfg, inplace=True, check_indices=False)
        snap = to_numpy(res.saved.snapshots[0])
        r, fin = to_numpy(res.readings), to_numpy(bank)
        with pytest.raises(ValueError, match="num_memory_slots"):
            sdm.check_device_errors()
        outside = np.r_[0:pad, pad + pb.B * pb.S:2 * pad + pb.B * pb.S]
        assert bool(cp.array_equal(big[outside].view(cp.uint8), guard[outside].view(cp.uint8)))
        g = sdm.backward(res.saved, dr)
        with pytest.raises(ValueError):
            sdm.check_device_errors()
        assert np.array_equal(to_numpy(bank).view(np.uint8), pb.bank.view(np.uint8))
        outs.append((r, fin, snap, to_numpy(g.bank), to_numpy(g.values)))
    for name, a, b_ in zip(("readings", "final bank", "snapshots", "grad bank", "grad values"),
                           *outs):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b_).view(np.uint8)), name
    r_ref, fin_ref = reference_fwd(fixed)
    tol = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4}.get(np.dtype(dtype), 5e-2)
    assert_close(outs[1][0], r_ref, tol, "readings")
    assert_close(outs[1][1], fin_ref, tol, "final bank")


def _bitwise_under_options(monkeypatch, pb, dr, options):
    """Forward (readings, final bank), the exact-owner gradients (bank, values) and the rewound
    bank of ``pb`` compiled with no extra NVRTC options and with ``options``: asserts they are
    bitwise equal and that the bank rewinds exactly; returns the second run's gradients."""
    from sdm_cupy.kernels import _build as K
    outs = []
    for extra in ("", options):
        monkeypatch.setenv("SDM_CUPY_NVRTC_OPTIONS", extra)
        monkeypatch.setattr(K, "_modules", {})   # compile again, with these options
        (r, fin), grads, rewound = _run(pb, _cfg(pb, 64), dr, None)
        outs.append((r, fin, grads[0], grads[2], rewound))
    for name, a, b_ in zip(("readings", "final bank", "grad bank", "grad values",
                            "rewound bank"), *outs):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b_).view(np.uint8)), name
    assert np.array_equal(outs[0][4].view(np.uint8), pb.bank.view(np.uint8))
    return grads


_VARIANTS = {"general_gather": "-DSDM_FWD_GENERAL_GATHER",
             "register_gather": "-DSDM_FWD_REG_GATHER", "plain_sort": "-DSDM_PREPASS_PLAIN_SORT",
             "key64": "-DSDM_PREPASS_KEY64", "sorted_writes": "-DSDM_PREPASS_SORT_WRITES",
             "both_key_bodies": "-DSDM_PREPASS_BOTH_BODIES", "one_wait": "-DSDM_FWD_ONE_WAIT",
             "rows_each": "-DSDM_FWD_ROWS_EACH", "early_copies": "-DSDM_FWD_EARLY_PF",
             "late_wide": "-DSDM_FWD_LATE_WIDE", "unstaged_snapshots": "-DSDM_BWD_NO_SNAP_STAGE",
             "no_l2_prefetch": "-DSDM_L2_PREFETCH=0", "l2_prefetch_64": "-DSDM_L2_PREFETCH=64",
             "stagger": "-DSDM_FWD_STAGGER=5000 -DSDM_BWD_STAGGER=20000",
             "stagger_4": "-DSDM_FWD_STAGGER=5000 -DSDM_BWD_STAGGER=20000 -DSDM_STAGGER_PHASES=4",
             "solo": "-DSDM_BWD_SOLO",
             "solo_reads_in_round_2": "-DSDM_BWD_SOLO -DSDM_BWD_SOLO_READS=1"}
# the late copies are the default for 2-byte banks only: the early-copies variant changes
# nothing for float32 banks and the late-for-every-type one nothing for bfloat16 banks
_SAME_BUILD = {("early_copies", "f32"), ("late_wide", "bf16")}


@pytest.mark.parametrize("variant,dtype", [
    pytest.param(v, d, id=f"{v}-{n}") for v in _VARIANTS
    for d, n in ((np.float32, "f32"), (BF16, "bf16")) if (v, n) not in _SAME_BUILD])
def test_compile_time_variants_leave_results_bitwise_equal(rng, monkeypatch, variant, dtype):
    """The benchmarks' compile-time variants (the forward's general gather instead of its
    fast path for full aligned pieces; its write rows loaded through registers instead of
    copied into shared memory with cp.async; the pre-pass's shared-memory-only sort, its
    64-bit sort keys where 32 bits suffice, the slots of both its forms sorted instead
    of hashed, and both key widths' bodies in one instance; the staged forward's write and
    read rows as one commit group, summed in one pass; its ids and weights staged array by
    array; its next chunk's copies issued before the row copies (bfloat16) or after them
    (float32); the backward's snapshots read from global memory instead of staged; the row
    gathers' L2 prefetch size; the blocks of odd (b, p), or of (b, p) mod 4 > 0, sleeping before
    their first chunk; the backward's solo entries added to dM outside its scatter, their reads
    after u or in round 2)
    change no bit of the forward (with snapshots), of the backward's exact-owner gradients
    (bank, values) or of the rewound bank."""
    pb = make_problem(rng, B=2, T=150, P=2, hd=32, S=300, W=12, dtype=dtype)
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    _bitwise_under_options(monkeypatch, pb, dr, _VARIANTS[variant])


@pytest.mark.parametrize("W", [3, 7, 12], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_backward_dm_stage_is_bitwise_the_snapshot_stage(rng, monkeypatch, dtype, W):
    """The dM stage (gpu.BWD_DM_STAGE): the backward copies the dM rows of its writes and the
    bank rows of its reads into shared memory beside the snapshots. Against the snapshot stage
    alone at the same chunk, with repeated slots and a nonzero incoming grad bank: the forward,
    every gradient (one column tile, so the weight grads' atomics add in one order) and the
    rewound bank are bitwise equal, and the launches took the stage's shared memory."""
    from sdm_cupy.kernels import gpu
    monkeypatch.setattr(gpu, "BWD_TILE_WIDTH", 32)
    pb = make_problem(rng, B=2, T=90, P=2, hd=32, S=40, W=W, dtype=dtype)
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    dM = rng.normal(size=pb.bank.shape).astype(np.float32)
    cfg = _cfg(pb, 16)   # six chunks, the last one 10 tokens; every stage fits one 32-column tile
    smem = []
    launch = gpu._launch
    monkeypatch.setattr(gpu, "_launch", lambda src, key, name, grid, sm, *a, **k: (
        smem.append(sm) if src == "bwd" else None, launch(src, key, name, grid, sm, *a, **k)))
    outs = []
    for dm in (False, True):
        monkeypatch.setattr(gpu, "BWD_DM_STAGE", dm)
        x = pb.to(cp)
        lay = sdm._validate.layout(x.bank, *x.inputs, cfg)
        pl = gpu.backward_plan(lay, cfg)
        assert pl.ntile == 1 and pl.smem_bwd_snap > 0 and (pl.smem_bwd_dm > 0) == bool(dm)
        smem.clear()
        (r, fin), grads, rewound = _run(pb, cfg, dr, dM)
        assert smem and set(smem) == {pl.smem_bwd_dm if dm else pl.smem_bwd_snap}
        outs.append((r, fin) + grads + (rewound,))
    for name, a, b_ in zip(("readings", "final bank") + GRADS + ("rewound bank",), *outs):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b_).view(np.uint8)), name
    assert np.array_equal(outs[0][-1].view(np.uint8), pb.bank.view(np.uint8))
    tol = 1e-4 if np.dtype(dtype) == np.float32 else 5e-2
    for name, got, want in zip(GRADS, outs[1][2:7], reference_bwd(pb, dr.astype(np.float64), dM)):
        assert_close(got, want, tol, f"grad {name}")


@pytest.mark.parametrize("W", [3, 7, 12], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_backward_grouped_row_loads_are_bitwise_entry_by_entry(rng, monkeypatch, dtype, W):
    """The backward's rounds load the rows of SDM_BWD_GB entries (2) before using any, whole
    groups first and the rest entry by entry (W = 3 and 7 leave a rest per thread: two
    threads share a token's entries). Against -DSDM_BWD_GB=1 (every entry on its own): the
    forward, the bank and values gradients and the rewound bank are bitwise equal, with
    repeated slots and the chunk's snapshots staged."""
    pb = make_problem(rng, B=2, T=90, P=2, hd=32, S=40, W=W, dtype=dtype)
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    grads = _bitwise_under_options(monkeypatch, pb, dr, "-DSDM_BWD_GB=1")
    tol = 1e-4 if np.dtype(dtype) == np.float32 else 5e-2
    for name, got, want in zip(GRADS, grads, reference_bwd(pb, dr.astype(np.float64))):
        assert_close(got, want, tol, f"grad {name}")


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_staged_plan_with_a_misaligned_bank_runs_the_general_gather(rng, monkeypatch, dtype):
    """The staged forward instance (RS = 1) holds only the fast path: whole 16-byte pieces of
    an aligned bank. A bank one element off 16-byte alignment, under a plan that stages, runs
    the other instance's general gather instead, with bitwise the results of the staged run
    from an aligned bank (same entries, same order), and the backward rewinds it exactly."""
    from sdm_cupy.kernels import gpu
    monkeypatch.setattr(gpu, "STAGE_READS", True)
    pb = make_problem(rng, B=2, T=100, P=2, hd=32, S=200, W=8, dtype=dtype)
    cfg = _cfg(pb, 64)
    dr = cp.asarray(rng.normal(size=pb.values.shape).astype(dtype))
    names = []
    launch = gpu._launch
    monkeypatch.setattr(gpu, "_launch", lambda src, key, name, *a, **k: (
        names.append(name), launch(src, key, name, *a, **k)))
    outs = []
    for off in (0, 1):
        x = pb.to(cp)
        flat = cp.zeros(x.bank.size + 16, dtype=x.bank.dtype)
        bank = flat[off:off + x.bank.size].reshape(x.bank.shape)
        bank[...] = x.bank
        assert (bank.data.ptr % 16 == 0) == (off == 0)
        lay = sdm._validate.layout(bank, *x.inputs, cfg)
        assert gpu.plan(lay, cfg).rstage
        names.clear()
        res = sdm.forward(bank, *x.inputs, cfg, inplace=True)
        fwd = [n for n in names if "sdm_fwd_kernel" in n]
        assert len(fwd) == 1 and fwd[0].endswith(",1>") == (off == 0), fwd
        r, fin, snap = (to_numpy(res.readings), to_numpy(bank),
                        to_numpy(res.saved.snapshots[0]))
        g = sdm.backward(res.saved, dr)
        assert np.array_equal(to_numpy(bank).view(np.uint8), pb.bank.view(np.uint8))
        outs.append((r, fin, snap, to_numpy(g.bank)))
    for name, a, b_ in zip(("readings", "final bank", "snapshots", "grad bank"), *outs):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b_).view(np.uint8)), name
    r_ref, fin_ref = reference_fwd(pb)
    tol = 1e-4 if np.dtype(dtype) == np.float32 else 5e-2
    assert_close(outs[1][0], r_ref, tol, "readings")
    assert_close(outs[1][1], fin_ref, tol, "final bank")


@pytest.mark.parametrize("dtype, W, C", [(np.float32, 16, 32), (BF16, 48, 16)],
                         ids=["f32-W16", "bf16-W48"])
def test_chunks_halved_for_a_stage_that_fits_match_reference(rng, monkeypatch, dtype, W, C):
    """Where a 64-token chunk's stage does not fit in shared memory, the forward (read rows)
    and the backward (exact snapshots) run shorter chunks whose stage fits: 32 tokens for a
    float32 bank at W = 16, 16 for bf16 at W = 48 (a partial chunk last in T = 70). Readings,
    final bank and every gradient match the float64 reference, the bank rewinds exactly, and
    the plan kept unhalved (gpu.STAGE_MIN_CHUNK above 64) agrees within the same tolerance."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=4, T=70, P=8, hd=128, S=300, W=W, dtype=dtype)
    cfg = _cfg(pb, 64)
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    x = pb.to(cp)
    lay = sdm._validate.layout(x.bank, *x.inputs, cfg)
    del x
    tol = 1e-4 if np.dtype(dtype) == np.float32 else 5e-2
    r_ref, fin_ref = reference_fwd(pb)
    g_ref = reference_bwd(pb, dr.astype(np.float64))
    outs = []
    for floor, halved in ((16, True), (1000, False)):
        monkeypatch.setattr(gpu, "STAGE_MIN_CHUNK", floor)
        fwd, bwd = gpu.plan(lay, cfg, saves=True), gpu.backward_plan(lay, cfg)
        if halved and gpu._device_limits()[1] >= 227 * 1024:   # an H100/H200's shared memory
            assert (fwd.C, fwd.rstage) == (C, True) and bwd.smem_bwd_snap > 0
            assert bwd.C == (fwd.sub or fwd.C)
        (r, fin), grads, rewound = _run(pb, cfg, dr, None)
        assert np.array_equal(rewound.view(np.uint8), pb.bank.view(np.uint8)), "rewound bank"
        assert_close(r, r_ref, tol, "readings")
        assert_close(fin, fin_ref, tol, "final bank")
        for name, got, want in zip(GRADS, grads, g_ref):
            assert_close(got, want, tol, f"grad {name}")
        outs.append((r, fin) + grads)
    for name, a, b_ in zip(("readings", "final bank") + GRADS, *outs):
        assert_close(a, b_, tol, f"{name}: halved against unhalved")


@pytest.mark.parametrize("dtype, B, P, W, hd", [(np.float32, 4, 8, 3, 256), (np.float32, 2, 2, 32, 8),
                                               (np.float64, 4, 8, 8, 128)],
                         ids=["f32-W3-hd256", "f32-W32-hd8", "f64-W8-hd128"])
def test_backward_walks_the_forwards_chunks_match_reference(rng, dtype, B, P, W, hd):
    """Layouts where the backward by itself takes a shorter chunk than the forward (its shared
    memory, or a stage that fits only there): before stop 21 it did, and walked chunks that
    the snapshots were not taken at, so rows written twice in a forward chunk gave wrong weight
    gradients (relative error 1e-2 at float64). Now a forward that saves snapshots takes the
    backward's chunk and the backward walks the forward's: every output matches the float64
    reference, with many repeated slots (S = 40) and a partial last chunk (T = 70)."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=B, T=70, P=P, hd=hd, S=40, W=W, dtype=dtype)
    cfg = _cfg(pb, 64)
    x = pb.to(cp)
    lay = sdm._validate.layout(x.bank, *x.inputs, cfg)
    del x
    fwd_alone = gpu.plan(lay, cfg)
    saving, bwd = gpu.plan(lay, cfg, saves=True), gpu.backward_plan(lay, cfg)
    assert (saving.sub or saving.C) == bwd.C <= gpu.plan(lay, cfg, backward=True).C
    if gpu._device_limits()[1] >= 227 * 1024:   # an H100/H200: the case this test is for
        assert bwd.C < fwd_alone.C
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    dM = rng.normal(size=pb.bank.shape).astype(dtype)
    (r, fin), grads, rewound = _run(pb, cfg, dr, dM)
    assert np.array_equal(rewound.view(np.uint8), pb.bank.view(np.uint8)), "rewound bank"
    tol = 1e-4 if np.dtype(dtype) == np.float32 else 1e-9
    r_ref, fin_ref = reference_fwd(pb)
    assert_close(r, r_ref, tol, "readings")
    assert_close(fin, fin_ref, tol, "final bank")
    for name, got, want in zip(GRADS, grads, reference_bwd(pb, dr.astype(np.float64),
                                                           dM.astype(np.float64))):
        assert_close(got, want, tol, f"grad {name}")


SUB_CASES = [(np.float64, 8, "staged"), (np.float64, 16, "reread"), (np.float32, 8, "kept"),
             (np.float32, 16, "staged"), (np.float32, 32, "reread"), (BF16, 16, "staged"),
             (BF16, 32, "kept"), (BF16, 16, "hd36")]


@pytest.mark.parametrize("dtype, sub, path", SUB_CASES,
                         ids=[f"{np.dtype(d).name}-sub{s}-{p}" for d, s, p in SUB_CASES])
def test_sub_chunk_snapshots_match_reference(rng, monkeypatch, dtype, sub, path):
    """gpu.SUB_SNAPSHOTS: a forward at its longest chunk (64 tokens, 32 for float64) saves
    exact snapshots for a backward that walks `sub`-token chunks (gpu.BWD_CHUNK bounds it
    here): a write entry whose slot was written in an earlier sub-chunk gets the row as it was
    at its sub-chunk's start. The forward's paths: read rows staged (the fast-path instance),
    kept rows without the stage, rows re-read from the bank, and a tile that is not whole
    pieces (hd = 36). With many repeated slots (S = 24, W = 4) and a last chunk of 40 tokens
    (T = 104, sub-chunk starts inside it): every output against the float64 reference, the bank
    rewound bitwise, and the snapshots equal (float64 to 1e-12, else to the bank dtype's
    rounding) to those of a forward that runs `sub`-token chunks, and not to those of a
    forward at the long chunk without them."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=2, T=104, P=2, hd=36 if path == "hd36" else 32, S=24, W=4,
                      dtype=dtype)
    cfg = _cfg(pb, 64)
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    dM = rng.normal(size=pb.bank.shape).astype(np.float64 if dtype == np.float64 else np.float32)
    x = pb.to(cp)
    lay = sdm._validate.layout(x.bank, *x.inputs, cfg)
    if path in ("kept", "reread"):
        monkeypatch.setattr(gpu, "STAGE_READS", False)
    if path == "reread":
        monkeypatch.setattr(gpu, "KEEP_ROWS", False)
    Cf = 32 if np.dtype(dtype) == np.float64 else 64
    monkeypatch.setattr(gpu, "BWD_CHUNK", sub)
    saving, bwd = gpu.plan(lay, cfg, saves=True), gpu.backward_plan(lay, cfg)
    assert (saving.C, saving.sub, bwd.C) == (Cf, sub, sub)
    if path == "staged":
        assert saving.rstage
    elif path in ("kept", "reread"):
        assert not saving.rstage and saving.keep == (path == "kept")
    res = sdm.forward(x.bank, *x.inputs, cfg)
    snaps = to_numpy(res.saved.snapshots[0]).astype(np.float64)
    r, fin = to_numpy(res.readings), to_numpy(res.bank)
    g = sdm.backward(res.saved, cp.asarray(dr), cp.asarray(dM))
    grads = tuple(to_numpy(getattr(g, n)) for n in GRADS)
    assert np.array_equal(to_numpy(res.bank).view(np.uint8), pb.bank.view(np.uint8)), "rewound"
    tol = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4}.get(np.dtype(dtype), 5e-2)
    r_ref, fin_ref = reference_fwd(pb)
    assert_close(r, r_ref, tol, "readings")
    assert_close(fin, fin_ref, tol, "final bank")
    for name, got, want in zip(GRADS, grads, reference_bwd(pb, dr.astype(np.float64),
                                                           dM.astype(np.float64))):
        assert_close(got, want, tol, f"grad {name}")
    # the same snapshots as a forward that walks the short chunks itself, and not those of a
    # forward at 64 without them (else no repeated slot crossed a sub-chunk: a void test)
    monkeypatch.setattr(gpu, "FWD_CHUNK", sub)
    y = pb.to(cp)
    assert gpu.plan(lay, cfg, saves=True).C == sub
    want = to_numpy(sdm.forward(y.bank, *y.inputs, cfg).saved.snapshots[0]).astype(np.float64)
    monkeypatch.setattr(gpu, "FWD_CHUNK", None)
    monkeypatch.setattr(gpu, "BWD_CHUNK", None)
    monkeypatch.setattr(gpu, "SUB_SNAPSHOTS", False)
    y = pb.to(cp)
    assert gpu.plan(lay, cfg, saves=True).sub == 0 and gpu.plan(lay, cfg, saves=True).C == Cf
    plain = to_numpy(sdm.forward(y.bank, *y.inputs, cfg).saved.snapshots[0]).astype(np.float64)
    scale = np.abs(want).max()
    rel = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}.get(np.dtype(dtype), 2 ** -6)
    assert np.abs(snaps - want).max() <= rel * scale
    assert (np.abs(plain - want) > 4 * rel * scale).any()


@pytest.mark.parametrize("fwd_chunk, bwd_chunk", [(16, None), (None, 16)])
def test_knobs_changed_between_forward_and_backward_match_reference(rng, monkeypatch, fwd_chunk,
                                                                     bwd_chunk):
    """``gpu.FWD_CHUNK`` changed between a forward and its backward: the snapshots carry the
    forward's chunk and the backward walks it, not the chunk the knobs give by then; every
    output matches the float64 reference (repeated slots, S = 40; partial last chunk, T = 70)
    and the bank rewinds exactly."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=2, T=70, P=2, hd=24, S=40, W=5)
    cfg = _cfg(pb, 64)
    dr = rng.normal(size=pb.values.shape)
    dM = rng.normal(size=pb.bank.shape)
    x = pb.to(cp)
    monkeypatch.setattr(gpu, "FWD_CHUNK", fwd_chunk)
    res = sdm.forward(x.bank, *x.inputs, cfg)
    assert res.saved._snapshots.chunk == (fwd_chunk or 32)
    monkeypatch.setattr(gpu, "FWD_CHUNK", bwd_chunk)
    lay = sdm._validate.layout(x.bank, *x.inputs, cfg)
    assert gpu.backward_plan(lay, cfg).C == (bwd_chunk or 32) != res.saved._snapshots.chunk
    r, fin = to_numpy(res.readings), to_numpy(res.bank)
    g = sdm.backward(res.saved, cp.asarray(dr), cp.asarray(dM))
    assert np.array_equal(to_numpy(res.bank), pb.bank), "rewound bank"
    _assert_float64_reference(pb, dr, dM, r, fin, tuple(to_numpy(getattr(g, n)) for n in GRADS))


def test_backward_narrows_its_tiles_for_the_forwards_chunk_match_reference(rng, monkeypatch):
    """A forward run under ``gpu.TILE_WIDTH = 8`` (float32, hd = 256, W = 8: 64-token chunks),
    the knob reset before its backward: the backward's automatic tiles do not fit that chunk
    in shared memory, so it takes narrower ones and still walks the forward's chunks; every
    output against the float64 reference, the bank rewound exactly."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=4, T=150, P=8, hd=256, S=64, W=8, dtype=np.float32)
    cfg = _cfg(pb, 64)
    x = pb.to(cp)
    lay = sdm._validate.layout(x.bank, *x.inputs, cfg)
    monkeypatch.setattr(gpu, "TILE_WIDTH", 8)
    res = sdm.forward(x.bank, *x.inputs, cfg)
    monkeypatch.setattr(gpu, "TILE_WIDTH", None)
    C = res.saved._snapshots.chunk
    own = gpu.plan(lay, cfg, backward=True)
    bwd = gpu.backward_plan(lay, cfg, chunk=C)
    if gpu._device_limits()[1] >= 227 * 1024:   # an H100/H200: the case this test is for
        assert own.C < C == 64 and bwd.TW < own.TW
    assert bwd.C == C
    r, fin = to_numpy(res.readings), to_numpy(res.bank)
    dr = rng.normal(size=pb.values.shape).astype(np.float32)
    g = sdm.backward(res.saved, cp.asarray(dr))
    assert np.array_equal(to_numpy(res.bank), pb.bank), "rewound bank"
    r_ref, fin_ref = reference_fwd(pb)
    assert_close(r, r_ref, 1e-4, "readings")
    assert_close(fin, fin_ref, 1e-4, "final bank")
    for name, want in zip(GRADS, reference_bwd(pb, dr.astype(np.float64))):
        assert_close(to_numpy(getattr(g, name)), want, 1e-4, f"grad {name}")


def test_backward_refused_for_a_chunk_it_no_longer_fits_then_runs(rng, monkeypatch):
    """A backward tile set after the forward that leaves too little shared memory for the
    forward's chunk: ``backward`` refuses with a clear RuntimeError before anything runs (the
    final bank untouched, the state unconsumed); with the knob restored it runs and matches
    the reference."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=1, T=40, P=1, hd=256, S=30, W=8, dtype=np.float32)
    cfg = _cfg(pb, 64)
    x = pb.to(cp)
    res = sdm.forward(x.bank, *x.inputs, cfg)
    C = res.saved._snapshots.chunk
    final = to_numpy(res.bank)
    monkeypatch.setattr(gpu, "BWD_TILE_WIDTH", pb.hd)
    # (a whole 256-column row at C = 40 needs about 570 KB of shared memory: no GPU has that)
    dr = rng.normal(size=pb.values.shape).astype(np.float32)
    with pytest.raises(RuntimeError, match=f"forward that ran {C}-token chunks.*changed since "
                                           f"the forward: BWD_TILE_WIDTH={pb.hd}"):
        sdm.backward(res.saved, cp.asarray(dr))
    assert not res.saved.consumed
    assert np.array_equal(to_numpy(res.bank), final)
    monkeypatch.setattr(gpu, "BWD_TILE_WIDTH", None)
    g = sdm.backward(res.saved, cp.asarray(dr))
    assert np.array_equal(to_numpy(res.bank), pb.bank), "rewound bank"
    want = reference_bwd(pb, dr.astype(np.float64))
    for name, want_x in zip(GRADS, want):
        assert_close(to_numpy(getattr(g, name)), want_x, 1e-4, f"grad {name}")


@pytest.mark.parametrize("W", [3, 40, 64, 80], ids=lambda w: f"W{w}")
def test_one_token_chunks_match_reference(rng, W):
    """C = 1 (decoding): up to W = 64 the forward finds a token's overlaps itself (W > 32 puts
    two read entries on a lane of its H[0][0] sum); W = 80 goes through the pre-pass."""
    pb = make_problem(rng, B=2, T=6, P=2, hd=12, S=20, W=W)
    dr = rng.normal(size=pb.values.shape)
    (r, fin), grads, rewound = _run(pb, _cfg(pb, 1), dr, None)
    _assert_float64_reference(pb, dr, None, r, fin, grads)
    assert np.array_equal(rewound, pb.bank)


@pytest.mark.parametrize("threads", [32, 64, 96, 256])
def test_one_token_block_size_leaves_results_bitwise_equal(rng, monkeypatch, threads):
    """The one-token forward's block size (gpu.FUSE_THREADS, automatic: sized to the gather)
    changes neither the readings nor the bank by a bit, with repeated slots and W > 32."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=3, T=1, P=2, hd=40, S=24, W=36, dtype=np.float32)
    r, fin = _forwards_bitwise_equal(pb, _cfg(pb, 1), [
        lambda t=t: monkeypatch.setattr(gpu, "FUSE_THREADS", t) for t in (threads, None)])
    r_ref, fin_ref = reference_fwd(pb)
    assert_close(r, r_ref, 1e-4, "readings")
    assert_close(fin, fin_ref, 1e-4, "final bank")


def test_gpu_agrees_with_cpu_float32(rng):
    pb = make_problem(rng, B=2, T=130, P=4, hd=32, S=512, W=8, dtype=np.float32)
    dr = rng.normal(size=pb.values.shape).astype(np.float32)
    dM = rng.normal(size=pb.bank.shape).astype(np.float32)
    cfg = _cfg(pb, 64)
    (r, fin), grads, _ = _run(pb, cfg, dr, dM)
    res = sdm.forward(pb.bank, *pb.inputs, cfg)
    assert_close(r, res.readings, 1e-5, "readings gpu vs cpu")
    assert_close(fin, res.bank, 1e-5, "final bank gpu vs cpu")
    g = sdm.backward(res.saved, dr, dM)
    for name, got in zip(GRADS, grads):
        assert_close(got, getattr(g, name), 1e-4, f"grad {name} gpu vs cpu")


@pytest.mark.parametrize("case", [
    (1, np.float64, 40, 16, 4),   # C = 1: the forward finds overlaps itself (no pre-pass)
    (8, np.float64, 40, 16, 4),   # the general gather
    (64, np.float32, 150, 32, 12),   # the fast path: whole aligned pieces, kept rows, cp.async
    (64, BF16, 150, 32, 12)], ids=["C1-f64", "C8-f64", "C64-f32", "C64-bf16"])
def test_bad_ids_are_skipped_flagged_and_stay_in_bounds(rng, case):
    C, dtype, T, hd, W = case
    pb = make_problem(rng, B=2, T=T, P=2, hd=hd, S=32 if W == 4 else 300, W=W, dtype=dtype)
    bad_w = pb.write_idx.copy()
    bad_r = pb.read_idx.copy()
    bad_w[0, 3, 1, 2] = pb.S          # one past the end of batch 0: would hit batch 1's rows
    bad_w[1, 7, 0, 0] = -5
    bad_r[1, 30, 1, 3] = 10 ** 6
    bad_r[0, T - 1, 0, W - 1] = pb.S + 7    # the last chunk, the last entry
    bad_w[1, T - 2, 1, W - 1] = 10 ** 6
    bad_r[1, T // 2, 0, 0] = -1
    tol = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4}.get(np.dtype(dtype), 5e-2)
    pad = 8
    big = cp.asarray(rng.normal(size=(2 * pad + pb.B * pb.S, pb.P * pb.hd)).astype(dtype))
    guard = big.copy()
    bank = big[pad:pad + pb.B * pb.S]
    bank[...] = cp.asarray(pb.bank)
    guard[pad:pad + pb.B * pb.S] = bank
    x = pb.to(cp)
    sdm.check_device_errors()      # start clean
    res = sdm.forward(bank, cp.asarray(bad_w), x.write_w, x.values, x.beta, cp.asarray(bad_r),
                      x.read_w, _cfg(pb, C), inplace=True, check_indices=False)
    with pytest.raises(ValueError, match="num_memory_slots"):
        sdm.check_device_errors()
    sdm.check_device_errors()      # reset=True cleared it
    # skipped == weight 0 at a valid id
    ref = pb.to(np)
    ww, rw = pb.write_w.copy(), pb.read_w.copy()
    mask_w, mask_r = (bad_w < 0) | (bad_w >= pb.S), (bad_r < 0) | (bad_r >= pb.S)
    ww[mask_w] = 0
    rw[mask_r] = 0
    fixed = type(pb)(**{**pb.__dict__, "write_idx": np.where(mask_w, 0, bad_w),
                        "read_idx": np.where(mask_r, 0, bad_r), "write_w": ww, "read_w": rw})
    r_ref, fin_ref = reference_fwd(fixed)
    assert_close(res.readings, r_ref, tol, "readings with skipped ids")
    assert_close(bank, fin_ref, tol, "final bank with skipped ids")
    outside = np.r_[0:pad, pad + pb.B * pb.S:2 * pad + pb.B * pb.S]
    same = lambda a, b_: bool(cp.array_equal(a.view(cp.uint8), b_.view(cp.uint8)))  # noqa: E731
    assert same(big[outside], guard[outside]), "rows outside the bank were written"
    dr = rng.normal(size=pb.values.shape)
    g = sdm.backward(res.saved, cp.asarray(dr))
    with pytest.raises(ValueError):
        sdm.check_device_errors()
    assert same(big[outside], guard[outside]), "backward wrote outside the bank"
    assert same(bank, cp.asarray(pb.bank)), "rewound bank"
    want = reference_bwd(fixed, dr, None)
    assert_close(g.values, want[2], tol, "grad values with skipped ids")
    assert_close(g.bank, want[0], tol, "grad bank with skipped ids")
    assert float(abs(to_numpy(g.write_w)[mask_w]).max()) == 0.0
    assert float(abs(to_numpy(g.read_w)[mask_r]).max()) == 0.0


def test_nan_poisoned_scratch(rng, monkeypatch):
    """Every fresh buffer the backend takes starts as NaN (floats) or -1 bytes (ints): a read of
    memory that no kernel wrote shows up as NaN or a wrong result."""
    empty = cp.empty

    def poisoned(shape, dtype=float, order="C"):
        a = empty(shape, dtype=dtype, order=order)
        if np.dtype(dtype) == BF16:
            a.view(np.uint16).fill(0x7FC0)
        elif np.dtype(dtype).kind == "f":
            a.fill(np.nan)
        else:
            a.view(np.uint8).fill(0xFF)
        return a

    monkeypatch.setattr(cp, "empty", poisoned)
    pb = make_problem(rng, B=2, T=45, P=2, hd=12, S=30, W=3)
    dr = rng.normal(size=pb.values.shape)
    dM = rng.normal(size=pb.bank.shape)
    (r, fin), grads, _ = _run(pb, _cfg(pb, 16), dr, dM)
    _assert_float64_reference(pb, dr, dM, r, fin, grads)


@pytest.mark.parametrize("mode", [None, "int8"])
def test_graph_capture_replays_to_the_eager_result(rng, mode):
    """forward + backward with check_indices=False contain no host sync: they capture (relaxed
    mode, private pool) and a replay gives the eager result."""
    pb = make_problem(rng, B=2, T=70, P=2, hd=16, S=48, W=4, dtype=np.float32)
    x = pb.to(cp)
    cfg = _cfg(pb, 32, snapshot_quant=mode)
    dr = cp.asarray(rng.normal(size=pb.values.shape).astype(np.float32))

    def step():
        res = sdm.forward(x.bank, *x.inputs, cfg, check_indices=False)
        g = sdm.backward(res.saved, dr)
        return (res.readings, res.bank) + tuple(getattr(g, n) for n in GRADS)

    stream = cp.cuda.Stream(non_blocking=True)
    # the inputs were uploaded on the legacy stream, which a non-blocking stream does not wait
    # for: without this, the eager step could read them before their copies land (stop 15's
    # one failure of this test, NaN in one of the two sides, fits that race)
    cp.cuda.Stream.null.synchronize()
    with stream:
        eager = [to_numpy(a) for a in step()]      # also compiles and loads every module
        pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            outs = step()
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            replay = [to_numpy(a) for a in outs]
    names = ("readings", "rewound bank") + GRADS
    # every output is checked before anything fails, so that a failure names all that differ
    # and on which side the NaN are
    bad = []
    for name, got, want in zip(names, replay, eager):
        # the weight grads sum tiles with atomics: equal up to float32 rounding
        try:
            assert_close(got, want, 1e-6, f"replay vs eager: {name}")
        except AssertionError as exc:
            bad.append(f"{exc} (NaN: {int(np.isnan(got).sum())} replayed, "
                       f"{int(np.isnan(want).sum())} eager, of {got.size})")
    assert not bad, "; ".join(bad)
    assert np.array_equal(replay[0], eager[0]), "forward readings are deterministic"


_POISON_SMEM = r"""
extern "C" __global__ void poison_smem(unsigned n, unsigned pattern) {
  extern __shared__ unsigned s[];
  volatile unsigned* v = s;   // stores a later kernel may find: not dead code
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x) v[i] = pattern;
}
"""


@functools.lru_cache(maxsize=None)
def _poison_kernel(smem: int):
    k = cp.RawKernel(_POISON_SMEM, "poison_smem")
    k.max_dynamic_shared_size_bytes = smem
    return k


def _poison_shared_memory(pattern: int):
    """Fills the shared memory of every multiprocessor with ``pattern`` (4 blocks per SM, each
    with the largest dynamic allocation a block may have). CUDA does not clear shared memory
    between kernels, so a kernel that computes with shared memory it did not write first sees
    this pattern instead of whatever ran before."""
    from sdm_cupy.kernels import gpu
    nsm, smem, _ = gpu._device_limits()
    _poison_kernel(smem)((4 * nsm,), (1024,), (np.uint32(smem // 4), np.uint32(pattern)),
                         shared_mem=smem)


@pytest.mark.parametrize("pattern", [0xFFFFFFFF, 0x7F807F80],
                         ids=["nan", "inf"])   # NaN in f32, bf16 and f64; +inf bf16 pairs
@pytest.mark.parametrize("case", [
    (np.float32, 70, 16, 4, 32, None),     # the graph test's shape: a 6-token last chunk
    (np.float32, 70, 16, 4, 32, "int8"),
    (BF16, 150, 32, 16, 64, None),         # the fast path (cp.async rows, staged snapshots)
    (np.float64, 45, 12, 3, 16, None),     # the general path
    (np.float32, 9, 20, 40, 1, None)],     # one-token chunks (the fused forward)
    ids=["f32-C32", "f32-C32-int8", "bf16-C64", "f64-C16", "f32-C1"])
def test_poisoned_shared_memory_changes_no_bit(rng, case, pattern):
    """Shared memory filled with NaN or inf patterns before each launch changes no bit of the
    forward (readings, final bank) or of the backward's exact outputs (grad bank, grad values,
    rewound bank): no kernel computes with shared memory it did not write."""
    dtype, T, hd, W, C, mode = case
    pb = make_problem(rng, B=2, T=T, P=2, hd=hd, S=48, W=W, dtype=dtype)
    dr = cp.asarray(rng.normal(size=pb.values.shape).astype(dtype))
    cfg = _cfg(pb, C, snapshot_quant=mode)
    outs = []
    for poison in (False, True):
        x = pb.to(cp)
        if poison:
            _poison_shared_memory(pattern)
        res = sdm.forward(x.bank, *x.inputs, cfg)
        r, fin = to_numpy(res.readings), to_numpy(res.bank)
        if poison:
            _poison_shared_memory(pattern)
        g = sdm.backward(res.saved, dr)
        outs.append((r, fin, to_numpy(g.bank), to_numpy(g.values), to_numpy(res.bank)))
    for name, a, b_ in zip(("readings", "final bank", "grad bank", "grad values",
                            "rewound bank"), *outs):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b_).view(np.uint8)), name
    if mode is None:   # exact snapshots rewind the bank bit for bit
        assert np.array_equal(outs[1][4].view(np.uint8), pb.bank.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float64])
@pytest.mark.parametrize("mode", ["fp8_e4m3", "int8", "bf16"])
def test_snapshots_of_tiny_rows_are_the_cpu_backends(rng, dtype, mode):
    """Under CuPy's -ftz, slots from 1e-44 (float32 subnormal) to 1e30 in magnitude: the first
    chunk's snapshot codes and scales are the CPU backend's bit for bit, and so is the rewound
    bank (a float64 bank's to float32 rounding: the GPU decodes bytes in float32). Before stop
    24 a row with absmax below 1.3e-36 stored saturated fp8 codes (448 / absmax overflowed)."""
    if mode == "bf16" and dtype == BF16:
        pytest.skip("bf16 snapshots do not shrink a bfloat16 bank")
    pb = make_problem(rng, B=2, T=70, P=2, hd=32, S=40, W=5, dtype=dtype)
    spread_magnitudes(pb)
    C = 16
    cfg = _cfg(pb, C, snapshot_quant=mode)
    x = pb.to(cp)
    res = sdm.forward(x.bank, *x.inputs, cfg)
    snaps = [None if a is None else to_numpy(a) for a in res.saved.snapshots]
    cres = sdm.forward(*pb.args(), cfg)
    rows, scales = (None if a is None else a.copy() for a in cres.saved.snapshots)
    grow = snaps[0].transpose(0, 2, 1, 3, 4)[:, :, :C]          # [B, T, P, ...] -> [B, P, T, ...]
    assert np.array_equal(grow.view(np.uint8), rows[:, :, :C].view(np.uint8)), "codes"
    if mode != "bf16":
        gsc = snaps[1].transpose(0, 2, 1, 3)[:, :, :C]
        assert np.array_equal(gsc.view(np.uint32), scales[:, :, :C].view(np.uint32)), "scales"
    dr = rng.normal(size=pb.values.shape).astype(dtype)
    sdm.backward(res.saved, cp.asarray(dr))
    sdm.backward(cres.saved, dr)
    if dtype == np.float64 and mode != "bf16":
        assert_close(to_numpy(res.bank), cres.bank, 1e-7, "rewound bank")
    else:
        assert np.array_equal(to_numpy(res.bank).view(np.uint8), cres.bank.view(np.uint8))


def test_expand_and_sum_memory_batch(rng):
    for dt in (np.float64, np.float32, BF16):
        param = rng.normal(size=(24, 10)).astype(dt)
        out = sdm.expand_memory_batch(cp.asarray(param), 3)
        assert out.shape == (72, 10) and out.dtype == param.dtype
        assert np.array_equal(to_numpy(out).astype(np.float64), np.tile(param, (3, 1)).astype(np.float64))
        grad = rng.normal(size=(72, 10)).astype(dt)
        s = sdm.sum_memory_batch(cp.asarray(grad), 24)
        want = grad.astype(np.float64).reshape(3, 24, 10).sum(0)
        assert_close(s, want, 1e-2 if dt == BF16 else 1e-6, f"sum_memory_batch {np.dtype(dt)}")


def test_tune_keeps_a_plan_and_both_match_reference(rng):
    """sdm.tune on a layout whose two plans differ on an H100/H200 (the headline's B, P, hd and
    W, so its tiles and shared memory; T = 130, a partial last chunk; repeated slots across
    sub-chunks, S = 300): it times both, keeps one for the layout and leaves its inputs as
    they were. Forward+backward under the kept plan and under the other (forced) match the
    float64 reference, and the bank rewinds bit for bit."""
    from sdm_cupy.kernels import gpu
    pb = make_problem(rng, B=4, T=130, P=8, hd=128, S=300, W=16, dtype=BF16)
    cfg = _cfg(pb, 64)
    x = pb.to(cp)
    lay = sdm._validate.layout(x.bank, *x.inputs, cfg)
    limits = gpu._device_limits()
    big = limits[1] >= 227 * 1024   # an H100/H200's shared memory: the plans differ there
    dr = rng.normal(size=pb.values.shape).astype(BF16)
    r_ref, fin_ref = reference_fwd(pb)
    g_ref = reference_bwd(pb, dr.astype(np.float64))
    gpu.clear_tuning()
    try:
        t = sdm.tune(x.bank, *x.inputs, cfg, reps=2)
        if big:
            assert t.plans_differ and set(t.ms) == {False, True}
            assert min(t.ms.values()) > 0
        for got, want in zip((x.bank, *x.inputs), pb.args()):
            assert np.array_equal(to_numpy(got).view(np.uint8), want.view(np.uint8))
        assert gpu.halve_for(lay, limits) is t.halve
        for forced in (t.halve, not t.halve):
            gpu._TUNED[(lay, limits)] = forced
            saving = gpu.plan(lay, cfg, saves=True)
            if big:
                assert (saving.C, saving.sub) == ((64, 32) if forced else (64, 0))
            (r, fin), grads, rewound = _run(pb, cfg, dr, None)
            assert np.array_equal(rewound.view(np.uint8), pb.bank.view(np.uint8))
            assert_close(r, r_ref, 5e-2, f"readings (halve={forced})")
            assert_close(fin, fin_ref, 5e-2, f"final bank (halve={forced})")
            for name, got, want in zip(GRADS, grads, g_ref):
                assert_close(got, want, 5e-2, f"grad {name} (halve={forced})")
    finally:
        gpu.clear_tuning()
