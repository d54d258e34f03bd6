"""The GPU launcher's plan on a described device (no GPU needed): tile widths, the backward's
ranges of chunks and its shared memory, for the headline shape of SPEC §10 on an H200."""

from __future__ import annotations

import numpy as np
import pytest

import sdm_cupy as sdm
from sdm_cupy._validate import Layout
from sdm_cupy.kernels import _build as K
from sdm_cupy.kernels import gpu

H200 = (132, 232448, "90")   # multiprocessors, opt-in shared memory per block, compute capability


def _layout(**kw):
    base = dict(B=4, T=4096, P=8, hd=128, S=16384, W=16, C=64, bank_dtype=K.BFLOAT16,
                value_dtype=K.BFLOAT16, compute_dtype=np.dtype(np.float32),
                grad_bank_dtype=np.dtype(np.float32), index_dtype=np.dtype(np.int32))
    base.update(kw)
    return Layout(**base)


def _cfg(lay):
    return sdm.SDMConfig(num_memory_slots=lay.S, num_parallel=lay.P, chunk_size=lay.C)


def _per_chunk(lay, pl):
    acc = K.compute_dtype(lay.bank_dtype, lay.value_dtype).itemsize
    return (3 * pl.C * lay.W + 4 * pl.C + 1) * 4 + 2 * pl.C * pl.C * acc + gpu._r16(2 * pl.C * pl.C)


@pytest.mark.parametrize("halve", [False, True])
def test_headline_backward_is_one_wave_with_bounded_scratch(monkeypatch, halve):
    """The headline backward: one wave of blocks, bounded pre-pass scratch. By default its
    64-token chunk with the snapshot stage (the dM stage does not fit beside it); with
    gpu.BWD_DM_HALVE a 32-token chunk with the dM stage, for which the saving forward keeps
    its 64-token chunk and saves snapshots at each 32-token sub-chunk."""
    monkeypatch.setattr(gpu, "BWD_DM_HALVE", halve)
    lay = _layout()
    pl = gpu.plan(lay, _cfg(lay), limits=H200, backward=True)
    C = 32 if halve else 64
    assert (pl.C, pl.TW, pl.ntile) == (C, 32, 4) and pl.smem_bwd_snap > 0
    assert (pl.smem_bwd_dm > 0) == halve
    assert gpu.backward_plan(lay, _cfg(lay), limits=H200) == pl
    saving = gpu.plan(lay, _cfg(lay), limits=H200, saves=True)
    assert (saving.C, saving.sub) == (64, 32 if halve else 0)
    assert lay.B * lay.P * pl.ntile <= H200[0]            # one block per multiprocessor
    assert max(pl.smem_bwd, pl.smem_bwd_snap, pl.smem_bwd_dm) <= H200[1]
    assert 1 <= pl.seg <= pl.Nt
    assert lay.B * lay.P * pl.seg * _per_chunk(lay, pl) <= gpu.BWD_SCRATCH
    fwd = gpu.plan(lay, _cfg(lay), limits=H200)
    assert (fwd.TW, fwd.ntile) == (32, 4) and fwd.CS == gpu._r16(64 * 64)   # read rows staged
    assert pl.CS == gpu._r16(2 * C * C)   # the backward's CSR holds four triangles


@pytest.mark.parametrize("kw, bwd_C, dm, fwd_C, sub", [
    (dict(W=4), 64, True, 64, 0),             # the dM stage fits beside the 64-token chunk
    (dict(W=8, hd=64), 64, True, 64, 0),
    (dict(W=8), 64, False, 64, 0),            # it does not: snapshots alone, as before
    (dict(W=64, hd=64), 16, True, 32, 16),    # the saving forward keeps its own 32 tokens
    (dict(W=48), 16, False, 16, 0),           # the forward's own chunk is 16 too
])
def test_default_plans_stage_dm_where_it_fits_and_keep_the_forwards_chunk(kw, bwd_C, dm, fwd_C,
                                                                        sub):
    """The default rule (stop 28's measurements): the backward stages its dM rows only where
    they fit beside its own chunk (it never halves its chunk for them), and a saving forward
    whose own chunk is longer than the backward's keeps it, saving snapshots at each of the
    backward's sub-chunks."""
    lay = _layout(**kw)
    bwd = gpu.plan(lay, _cfg(lay), limits=H200, backward=True)
    assert (bwd.C, bwd.smem_bwd_dm > 0) == (bwd_C, dm)
    saving = gpu.plan(lay, _cfg(lay), limits=H200, saves=True)
    assert (saving.C, saving.sub) == (fwd_C, sub)
    assert (saving.sub or saving.C) == gpu.backward_plan(lay, _cfg(lay), limits=H200).C


def test_backward_stages_snapshots_only_where_they_fit(monkeypatch):
    """The headline backward stages its chunk's exact snapshot rows (C*W rows of the 32-wide
    bf16 tile) beside everything else. A float32 bank's rows do not fit beside a 64-token
    chunk: the backward halves its chunk to 32, where they do, unless its snapshots are
    quantized (nothing to stage) or gpu.STAGE_MIN_CHUNK forbids the shorter chunk. With two
    256-thread blocks per multiprocessor the stage must not cost one of them."""
    monkeypatch.setattr(gpu, "BWD_DM_STAGE", False)
    lay = _layout()
    pl = gpu.plan(lay, _cfg(lay), limits=H200, backward=True)
    assert pl.C == 64
    assert pl.smem_bwd_snap == gpu._r16(pl.smem_bwd) + 64 * 16 * 32 * 2
    assert pl.smem_bwd_snap <= H200[1]
    f32 = _layout(bank_dtype=np.dtype(np.float32), value_dtype=np.dtype(np.float32))
    pl32 = gpu.plan(f32, _cfg(f32), limits=H200, backward=True)
    assert pl32.C == 32 and pl32.Nt == 128
    assert pl32.smem_bwd_snap == gpu._r16(pl32.smem_bwd) + 32 * 16 * 32 * 4 <= H200[1]
    quant = gpu.plan(f32, _cfg(f32), limits=H200, backward=True, exact_snapshots=False)
    assert quant.C == 64 and quant.smem_bwd_snap == 0
    monkeypatch.setattr(gpu, "STAGE_MIN_CHUNK", 64)
    assert gpu.plan(f32, _cfg(f32), limits=H200, backward=True).smem_bwd_snap == 0


def test_chunk_halves_for_a_stage_that_fits(monkeypatch):
    """Where a chunk's stage does not fit in shared memory, the forward (read rows) and the
    backward (exact snapshots) halve their chunk until it does, down to gpu.STAGE_MIN_CHUNK:
    W = 32 stages at C = 32, W = 48 at C = 16; below the minimum, or under a chunk bound
    (FWD_CHUNK, BWD_CHUNK), nothing halves and the register form runs."""
    monkeypatch.setattr(gpu, "BWD_DM_STAGE", False)
    for W, C in ((24, 32), (32, 32), (48, 16), (64, 16)):
        lay = _layout(W=W)
        fwd = gpu.plan(lay, _cfg(lay), limits=H200)
        bwd = gpu.plan(lay, _cfg(lay), limits=H200, backward=True)
        assert (fwd.C, fwd.rstage, fwd.TW) == (C, True, 32), W
        assert fwd.smem_fwd <= H200[1] and bwd.smem_bwd_snap <= H200[1]
        assert bwd.C == C and bwd.smem_bwd_snap > 0, W
        monkeypatch.setattr(gpu, "STAGE_MIN_CHUNK", 2 * C)
        fwd2 = gpu.plan(lay, _cfg(lay), limits=H200)
        assert not fwd2.rstage and fwd2.C > C and fwd2.TW == 16, W
        monkeypatch.setattr(gpu, "STAGE_MIN_CHUNK", 16)
    lay = _layout(W=32)
    monkeypatch.setattr(gpu, "FWD_CHUNK", 64)
    monkeypatch.setattr(gpu, "BWD_CHUNK", 64)
    fwd, bwd = (gpu.plan(lay, _cfg(lay), limits=H200, backward=b) for b in (False, True))
    assert (fwd.C, fwd.rstage) == (64, False)
    assert bwd.C == 32   # the backward's own shared-memory bound, not the halving


LAYOUTS = [dict(), dict(W=1), dict(W=3, hd=256), dict(W=8, hd=256), dict(W=32, hd=8),
           dict(W=48), dict(W=64, hd=32), dict(hd=100), dict(T=70, C=16), dict(T=1),
           dict(B=64, T=1, W=4)]
DTYPES = {"bf16": K.BFLOAT16, "f16": np.dtype(np.float16), "f32": np.dtype(np.float32),
          "f64": np.dtype(np.float64)}


@pytest.mark.parametrize("mode", [None, "bf16", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_backward_walks_the_saving_forwards_chunks(monkeypatch, dtype, mode):
    """Snapshots hold a written row as it was at the start of the forward's chunk, so the
    backward must walk the very chunks of the forward that saved them. Stop 21 found plans
    where the two differed (102 of 1320 layouts: float64 at hd = 128, bf16 at hd = 256 and
    W = 8, float32 at W = 32), with wrong weight gradients. Over awkward layouts, dtypes,
    snapshot modes and chunk knobs: the saving forward's chunk is the backward's, at most the
    chunk the backward would take by itself, and the backward's shared memory fits."""
    dt = DTYPES[dtype]
    acc = np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)
    if mode is not None and dt == np.float64:
        pytest.skip("snapshot modes are for 16- and 32-bit banks")
    for knobs in ({}, {"FWD_CHUNK": 16}, {"BWD_CHUNK": 8}, {"STAGE_MIN_CHUNK": 64},
                  {"BWD_THREADS": 256}):
        for k, v in knobs.items():
            monkeypatch.setattr(gpu, k, v)
        for kw in LAYOUTS:
            lay = _layout(**{**dict(bank_dtype=dt, value_dtype=dt, compute_dtype=acc,
                                    grad_bank_dtype=acc), **kw})
            cfg = sdm.SDMConfig(num_memory_slots=lay.S, num_parallel=lay.P, chunk_size=lay.C,
                                snapshot_quant=mode)
            try:
                fwd = gpu.plan(lay, cfg, quant=mode, limits=H200, saves=True)
            except sdm.UnsupportedConfigurationError:
                continue   # a quantized row wider than shared memory: refused before any run
            bwd = gpu.backward_plan(lay, cfg, limits=H200)
            free = gpu.plan(lay, cfg, limits=H200, backward=True, exact_snapshots=mode is None)
            assert bwd.C == (fwd.sub or fwd.C) <= free.C, (knobs, kw)
            assert fwd.C % bwd.C == 0 and (fwd.sub == 0 or mode is None), (knobs, kw)
            assert max(bwd.smem_bwd, bwd.smem_bwd_snap) <= H200[1], (knobs, kw)
        monkeypatch.undo()


@pytest.mark.parametrize("fwd_knobs, bwd_knobs", [
    ({"FWD_CHUNK": 16}, {}),                    # forward at 16; a recomputation would say 64
    ({}, {"FWD_CHUNK": 16}),                    # forward at 64; a recomputation would say 16
    ({"FWD_CHUNK": 8}, {"BWD_THREADS": 256}),     # two blocks per SM, their own chunk 32
    ({"FWD_CHUNK": 16}, {"BWD_TILE_WIDTH": 8}),
    ({"BWD_DM_HALVE": True}, {"BWD_DM_HALVE": False}),   # saved for 32-token sub-chunks
])
def test_backward_walks_the_chunk_its_snapshots_carry(monkeypatch, fwd_knobs, bwd_knobs):
    """Knobs may change between a forward and its backward: the backward's plan takes the chunk
    the snapshots carry (the forward's), not one recomputed from the knobs of the moment, and
    its tiles from those knobs; its shared memory fits."""
    lay = _layout()
    cfg = _cfg(lay)
    for k, v in fwd_knobs.items():
        monkeypatch.setattr(gpu, k, v)
    fwd = gpu.plan(lay, cfg, limits=H200, saves=True)
    C = fwd.sub or fwd.C   # what sdm_fwd's SavedSnapshots carry
    monkeypatch.undo()
    for k, v in bwd_knobs.items():
        monkeypatch.setattr(gpu, k, v)
    recomputed = gpu.backward_plan(lay, cfg, limits=H200)
    assert recomputed.C != C                    # what walking the knobs' chunk would do wrong
    bwd = gpu.backward_plan(lay, cfg, limits=H200, chunk=C)
    assert bwd.C == C and bwd.Nt == -(-lay.T // C)
    assert max(bwd.smem_bwd, bwd.smem_bwd_snap) <= H200[1]
    if "BWD_TILE_WIDTH" in bwd_knobs:
        assert bwd.TW == bwd_knobs["BWD_TILE_WIDTH"]


def test_backward_refuses_a_chunk_it_can_no_longer_fit(monkeypatch):
    """A knob changed after the forward can leave the backward too little shared memory for the
    forward's chunk (here a whole-row backward tile for a 64-token forward): a clear
    RuntimeError naming the chunk, not a backward that walks other chunks (wrong gradients)."""
    lay = _layout()
    cfg = _cfg(lay)
    C = gpu.plan(lay, cfg, limits=H200, saves=True).C
    assert C == 64
    monkeypatch.setattr(gpu, "BWD_TILE_WIDTH", lay.hd)
    assert gpu.backward_plan(lay, cfg, limits=H200).C < C     # its own plan would fit
    with pytest.raises(RuntimeError, match=r"forward that ran 64-token chunks.*defaults: "
                                           r"BWD_TILE_WIDTH=128\).*Restore the settings"):
        gpu.backward_plan(lay, cfg, limits=H200, chunk=C)


def test_backward_narrows_its_tiles_for_the_forwards_chunk(monkeypatch):
    """A forward planned under a knob that narrowed the tiles (here TILE_WIDTH = 8: float32,
    hd = 256, W = 8 runs 64-token chunks) and the knob reset before the backward: the backward's
    automatic tiles do not fit that chunk, so it takes narrower ones (not a refusal, and not
    another chunk)."""
    lay = _layout(bank_dtype=np.dtype(np.float32), value_dtype=np.dtype(np.float32), T=256,
                  hd=256, W=8)
    cfg = _cfg(lay)
    monkeypatch.setattr(gpu, "TILE_WIDTH", 8)
    C = gpu.plan(lay, cfg, limits=H200, saves=True).C
    monkeypatch.setattr(gpu, "TILE_WIDTH", None)
    own = gpu.plan(lay, cfg, limits=H200, backward=True)
    assert own.C < C == 64                    # by itself the backward would take a shorter chunk
    bwd = gpu.backward_plan(lay, cfg, limits=H200, chunk=C)
    assert bwd.C == C and bwd.TW < own.TW and bwd.TW % bwd.N == 0
    assert bwd.ntile == -(-lay.hd // bwd.TW)
    assert max(bwd.smem_bwd, bwd.smem_bwd_snap) <= H200[1]


def test_refusal_names_the_knobs_changed_since_the_forward(monkeypatch):
    """With the forward's settings at hand (``SavedSnapshots.settings``), the refusal names
    the knobs that changed since the forward, with both values."""
    lay = _layout()
    cfg = _cfg(lay)
    fwd_settings = gpu.settings()
    C = gpu.plan(lay, cfg, limits=H200, saves=True).C
    monkeypatch.setattr(gpu, "BWD_TILE_WIDTH", lay.hd)
    with pytest.raises(RuntimeError, match=r"changed since the forward: BWD_TILE_WIDTH=128 "
                                           r"\(the forward's: None\)\)"):
        gpu.backward_plan(lay, cfg, limits=H200, chunk=C, fwd_settings=fwd_settings)


KNOB_CHANGES = [{}, {"TILE_WIDTH": 8}, {"BWD_TILE_WIDTH": 8}, {"BWD_THREADS": 256},
                {"FWD_CHUNK": 16}, {"STAGE_MIN_CHUNK": 64}, {"SUB_SNAPSHOTS": False},
                {"BWD_DM_STAGE": False}, {"BWD_DM_HALVE": True}]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_knob_changes_between_forward_and_backward_never_strand_a_backward(monkeypatch, dtype):
    """Every pair of knob settings, one for the forward and one for its backward, over awkward
    layouts (H200 limits): the backward plans the forward's chunk and fits in shared memory,
    or, only where a tile width is forced for the backward, refuses with the RuntimeError."""
    dt = DTYPES[dtype]
    acc = np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)
    planned = refused = 0
    for W in (1, 8, 16, 48):
        for hd in (8, 36, 128, 256):
            lay = _layout(bank_dtype=dt, value_dtype=dt, compute_dtype=acc, grad_bank_dtype=acc,
                          W=W, hd=hd, T=300)
            cfg = _cfg(lay)
            for fwd_knobs in KNOB_CHANGES:
                for k, v in fwd_knobs.items():
                    monkeypatch.setattr(gpu, k, v)
                fwd = gpu.plan(lay, cfg, limits=H200, saves=True)
                C = fwd.sub or fwd.C   # what sdm_fwd's SavedSnapshots carry
                monkeypatch.undo()
                for bwd_knobs in KNOB_CHANGES:
                    for k, v in bwd_knobs.items():
                        monkeypatch.setattr(gpu, k, v)
                    try:
                        pl = gpu.backward_plan(lay, cfg, limits=H200, chunk=C)
                    except RuntimeError:
                        assert "TILE_WIDTH" in bwd_knobs or "BWD_TILE_WIDTH" in bwd_knobs, (
                            W, hd, fwd_knobs, bwd_knobs)
                        refused += 1
                    else:
                        assert pl.C == C and pl.Nt == -(-lay.T // C)
                        assert max(pl.smem_bwd, pl.smem_bwd_snap) <= H200[1]
                        planned += 1
                    monkeypatch.undo()
    assert planned > 10 * refused


def test_saved_snapshots_read_as_a_tuple_and_carry_the_chunk():
    """``SavedSnapshots`` unpacks, counts and iterates as the plain (rows, scales) tuple every
    reader expects (SavedState.nbytes, the graph runner's leaves), and survives a pickle."""
    import pickle

    from sdm_cupy.graphs.capture import leaves
    rows, scales = np.zeros((2, 3, 1, 4, 8), np.float32), None
    snaps = gpu.SavedSnapshots((rows, scales), 32, gpu.settings())
    a, b = snaps
    assert a is rows and b is None and len(snaps) == 2 and snaps == (rows, scales)
    assert snaps.chunk == 32 and isinstance(snaps, tuple)
    assert leaves(snaps) == [rows]
    back = pickle.loads(pickle.dumps(snaps))
    assert back.chunk == 32 and np.array_equal(back[0], rows) and back[1] is None
    assert back.settings == snaps.settings == gpu.settings()


def test_backward_snapshot_stage_keeps_two_blocks_per_sm(monkeypatch):
    monkeypatch.setattr(gpu, "BWD_THREADS", 256)
    lay = _layout()
    pl = gpu.plan(lay, _cfg(lay), limits=H200, backward=True)
    assert pl.smem_bwd_snap == 0 or pl.smem_bwd_snap <= gpu.KEEP_SMEM
    small = _layout(W=4)
    pls = gpu.plan(small, _cfg(small), limits=H200, backward=True)
    assert 0 < pls.smem_bwd_snap <= gpu.KEEP_SMEM


@pytest.mark.parametrize("scratch", [1, 10 ** 7, 10 ** 12])
def test_backward_ranges_cover_every_chunk_once(monkeypatch, scratch):
    monkeypatch.setattr(gpu, "BWD_SCRATCH", scratch)
    lay = _layout(T=1000)
    pl = gpu.plan(lay, _cfg(lay), limits=H200, backward=True)
    ranges = [(max(0, hi - pl.seg), hi) for hi in range(pl.Nt, 0, -pl.seg)]   # as sdm_bwd
    covered = sorted(n for lo, hi in ranges for n in range(lo, hi))
    assert covered == list(range(pl.Nt))
    if scratch == 1:
        assert pl.seg == 1
    elif scratch == 10 ** 7:
        assert 1 < pl.seg < pl.Nt   # several ranges of several chunks
    else:
        assert pl.seg == pl.Nt      # one range
    if pl.seg > 1:
        assert lay.B * lay.P * pl.seg * _per_chunk(lay, pl) <= scratch


@pytest.mark.parametrize("threads,per_sm", [(512, 1), (256, 2)])
def test_backward_tiles_fill_one_wave(monkeypatch, threads, per_sm):
    monkeypatch.setattr(gpu, "BWD_THREADS", threads)
    for B, P in ((1, 1), (1, 8), (4, 8), (64, 8)):
        lay = _layout(B=B, P=P)
        pl = gpu.plan(lay, _cfg(lay), limits=H200, backward=True)
        blocks = B * P * pl.ntile
        pieces = -(-lay.hd // pl.N)
        # doubling the tiles once more would overflow the wave or leave a tile one piece
        assert blocks <= per_sm * H200[0] or pl.ntile == 1
        assert (2 * blocks > per_sm * H200[0]) or -(-pieces // (2 * pl.ntile)) < 2


@pytest.mark.parametrize("bound", [None, 32, 16, 1])
def test_forward_chunk_bound_applies_to_the_forward_only(monkeypatch, bound):
    """gpu.FWD_CHUNK (a benchmark knob, part of the graph runner's key through settings())
    bounds the forward's internal chunk and leaves the backward's alone."""
    monkeypatch.setattr(gpu, "FWD_CHUNK", bound)
    lay = _layout()
    fwd = gpu.plan(lay, _cfg(lay), limits=H200)
    bwd = gpu.plan(lay, _cfg(lay), limits=H200, backward=True)
    assert fwd.C == (64 if bound is None else bound)
    assert fwd.Nt == -(-lay.T // fwd.C)
    assert bwd.C == 64   # its own choice (its snapshot stage fits; BWD_DM_HALVE is off)
    saving = gpu.plan(lay, _cfg(lay), limits=H200, saves=True)
    assert saving.C == fwd.C
    assert (saving.sub or saving.C) == gpu.backward_plan(lay, _cfg(lay), limits=H200).C
    assert gpu.settings()[-1] == bound   # FWD_CHUNK stays the last knob


def test_launcher_passes_exact_fastdiv_multipliers():
    """The forward and backward get FastDiv's multipliers of W and of NPC (full tile, last
    tile) as their last arguments, and each multiplier gives the exact quotient over FastDiv's
    range (n < 2^16, d < 2^15)."""
    lay = _layout(hd=100)   # TW 16 -> 7 tiles, the last one 4 columns wide: NPC 2 and 1
    pl = gpu.plan(lay, _cfg(lay), limits=H200)
    npc = -(-pl.TW // pl.N)
    npc_last = -(-(lay.hd - (pl.ntile - 1) * pl.TW) // pl.N)
    assert npc_last < npc   # the case the second multiplier exists for
    assert gpu._div_params(lay, pl) == (gpu._magic(lay.W), gpu._magic(npc), gpu._magic(npc_last))
    n = np.arange(1 << 16, dtype=np.uint64)
    for d in [2, 3, 5, 7, 12, 16, 100, 255, 1000, 4097, 32767]:
        m = np.uint64(gpu._magic(d))
        assert np.array_equal((n * m) >> np.uint64(32), n // np.uint64(d)), d
    assert gpu._magic(1) == 0   # FastDiv returns n itself for d = 1


def test_headline_forward_stages_its_read_rows_in_one_wave():
    """At the headline the forward stages its read rows: 32-column tiles (one 512-thread
    block per multiprocessor, 128 blocks), the kept write rows and the read rows of a chunk
    (2 * 64 * 16 rows of 64 bytes) in shared memory beside the rest. Without the stage the
    tiles are 16 columns, two blocks per multiprocessor. A float32 bank's rows do not fit, nor
    do the 1-byte snapshot modes (one block holds whole rows), nor one-token chunks."""
    lay = _layout()
    pl = gpu.plan(lay, _cfg(lay), limits=H200)
    assert pl.rstage and pl.keep and pl.fwd_threads == gpu.STAGE_THREADS == 512
    assert (pl.TW, pl.ntile) == (32, 4) and lay.B * lay.P * pl.ntile <= H200[0]
    _, _, keep, _ = gpu._smem(64, 16, 32, 8, 4, False, idx_size=4, val_size=2, bank_size=2)
    assert pl.smem_fwd == keep + 64 * 16 * 32 * 2 <= H200[1]
    lay32 = _layout(bank_dtype=np.dtype(np.float32), value_dtype=np.dtype(np.float32))
    for lay_, quant in ((lay, "int8"), (lay, "fp8_e4m3"), (_layout(C=1), None)):
        assert not gpu.plan(lay_, _cfg(lay_), limits=H200, quant=quant).rstage, (lay_, quant)
    # a float32 bank's rows fit only beside a 32-token chunk: the forward halves its chunk
    pl32 = gpu.plan(lay32, _cfg(lay32), limits=H200)
    assert pl32.rstage and (pl32.C, pl32.TW) == (32, 32) and pl32.smem_fwd <= H200[1]
    for stage, want in ((False, (False, 16)), (True, (True, 32)), (None, (True, 32))):
        old = gpu.STAGE_READS
        try:
            gpu.STAGE_READS = stage
            pl = gpu._plan(lay, None, H200, False)
        finally:
            gpu.STAGE_READS = old
        assert (pl.rstage, pl.TW) == want, stage
    assert not gpu.plan(lay, _cfg(lay), limits=H200, backward=True).rstage


def test_forward_read_stage_only_where_it_widens_the_tile_or_runs_one_wave():
    """Automatic staging needs a wider tile than the two-blocks-per-SM plan, or the same tile
    in one wave of blocks: at the headline with hd = 64 both plans cut 16-column tiles (128
    blocks) and the forward stages; with B * P = 512 (more than an H200's blocks from whole
    rows already) both plans use whole 64-column rows in several waves, so the forward keeps
    its register gather; gpu.STAGE_READS = True stages wherever it fits.
    Whole 128-column rows of W = 16 entries fit only beside a 16-token chunk; with
    gpu.STAGE_MIN_CHUNK above that nothing stages."""
    narrow = _layout(hd=64)
    pl = gpu.plan(narrow, _cfg(narrow), limits=H200)
    assert pl.rstage and (pl.C, pl.TW, pl.ntile) == (64, 16, 4) and pl.fwd_threads == 512
    assert gpu._tile_width(narrow, pl.N, H200[0]) == 16   # the register form's tile
    lay = _layout(B=64, T=512, hd=64, W=4)
    pl = gpu.plan(lay, _cfg(lay), limits=H200)
    assert not pl.rstage and pl.TW == 64
    old = gpu.STAGE_READS
    try:
        gpu.STAGE_READS = True
        forced = gpu._plan(lay, None, H200, False)
        big = _layout(B=64, T=512)
        halved = gpu._plan(big, None, H200, False)
        gpu.STAGE_MIN_CHUNK = 32
        assert not gpu._plan(big, None, H200, False).rstage
    finally:
        gpu.STAGE_READS = old
        gpu.STAGE_MIN_CHUNK = 16
    assert halved.rstage and (halved.C, halved.TW) == (16, 128) and halved.smem_fwd <= H200[1]
    assert forced.rstage and forced.TW == 64 and forced.smem_fwd <= H200[1]
    assert forced.fwd_threads == 512


KNOBS = {"STAGE_READS": False, "STAGE_THREADS": 256, "THREADS": 512, "BWD_THREADS": 256, "TILE_WIDTH": 32, "BWD_TILE_WIDTH": 64,
         "BWD_SCRATCH": 10 ** 7, "FWD_CHUNK": 16, "BWD_CHUNK": 16, "STAGE_MIN_CHUNK": 64,
         "KEEP_ROWS": False, "KEEP_SMEM": 64 * 1024, "MAX_ENTRIES": 512, "E_STAGE": 256,
         "BE_STAGE": 512, "SUB_SNAPSHOTS": False, "BWD_DM_STAGE": False, "BWD_DM_HALVE": True}
# a layout whose plan the knob changes
KNOB_LAYOUT = {"STAGE_MIN_CHUNK": dict(W=32), "BWD_DM_STAGE": dict(W=4)}


@pytest.mark.parametrize("knob", list(KNOBS))
def test_remembered_plans_follow_every_knob(monkeypatch, knob):
    """gpu.plan remembers its plans; a knob set after a plan was remembered still decides the
    next plan (it differs), which equals one computed afresh, and the old plan comes back with
    the old value."""
    if knob == "THREADS":   # the backward's block size, when BWD_THREADS leaves it to THREADS
        monkeypatch.setattr(gpu, "BWD_THREADS", None)
    if knob == "SUB_SNAPSHOTS":   # it decides the backward's plan only where that halves
        monkeypatch.setattr(gpu, "BWD_DM_HALVE", True)
    lay = _layout(T=1000, **KNOB_LAYOUT.get(knob, {}))
    before = [gpu.plan(lay, _cfg(lay), limits=H200, backward=b) for b in (False, True)]
    assert [gpu.plan(lay, _cfg(lay), limits=H200, backward=b) for b in (False, True)] == before
    old = getattr(gpu, knob)
    monkeypatch.setattr(gpu, knob, KNOBS[knob])
    after = [gpu.plan(lay, _cfg(lay), limits=H200, backward=b) for b in (False, True)]
    assert after == [gpu._plan(lay, None, H200, b) for b in (False, True)]
    assert after != before, f"{knob} changes no plan of this layout: the test proves nothing"
    monkeypatch.setattr(gpu, knob, old)
    assert [gpu.plan(lay, _cfg(lay), limits=H200, backward=b) for b in (False, True)] == before


def test_a_refused_plan_is_not_remembered(monkeypatch):
    lay = _layout(W=100)
    monkeypatch.setattr(gpu, "MAX_ENTRIES", 64)
    n = len(gpu._PLANS)
    for _ in range(2):
        with pytest.raises(sdm.UnsupportedConfigurationError, match="W <= 64"):
            gpu.plan(lay, _cfg(lay), limits=H200)
    assert len(gpu._PLANS) == n
