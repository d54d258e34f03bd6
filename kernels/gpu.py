"""The GPU backend: CUDA C++ kernels (kernels/*.cu) launched through CuPy.

Implements docs/BACKEND_CONTRACT.md. The op is three named launches (SPEC §3-§4):

    forward : sdm_prepass<SPARSE=1> (CSR rows of Ainv and H and the write-run links of every
              chunk, in parallel) -> sdm_fwd (one block per (b, p, column tile), chunks in
              order, the next chunk's bank-independent data copied ahead with cp.async);
              one-token chunks (C = 1, decoding) skip the pre-pass: sdm_fwd finds their overlaps
    backward: per range of chunks, last range first: sdm_prepass<SPARSE=2> (sorted runs, read
              links and CSR rows of Ainv, H^T, Ainv^T and G: recomputed instead of stored) ->
              sdm_bwd (chunks last to first, rewinding the bank in place, the next chunk's
              bank-independent data copied ahead with cp.async). The ranges bound the scratch
              to about ``BWD_SCRATCH`` bytes.

Every launch runs on the current CuPy stream; nothing here synchronises with the host or calls
cuBLAS, so ``sdm_fwd``/``sdm_bwd`` can be captured into a CUDA graph. Scratch comes from
CuPy's memory pool. Grid sizes are checked against the device limits before any launch.

Safety: ids outside [0, S) are skipped by every kernel (they never address memory) and
recorded in one host-mapped int; ``check_device_errors()`` synchronises and reports it.

Process-wide settings the kernels read (a graph runner keys on ``settings()``). They may change
between a forward and its backward: the snapshots carry the forward's chunk
(``SavedSnapshots``), and the backward walks those chunks with its own tiles; where it cannot
(a setting leaves it too little shared memory), ``check_backward`` refuses before anything runs:
``TILE_WIDTH`` (None: automatic) forces the width of the column tiles, ``THREADS`` the block size,
``KEEP_ROWS`` (None: automatic) whether the forward keeps its gathered rows in shared memory,
``FUSE_THREADS`` (None: automatic) the block size of one-token (decoding) forwards,
``BWD_TILE_WIDTH`` (None: automatic) the backward's tile width, ``BWD_SCRATCH`` the backward's
pre-pass scratch per range of chunks, ``STAGE_READS`` (None: automatic) whether the forward
stages its read rows in shared memory (wider tiles, one block of ``STAGE_THREADS`` per
multiprocessor), ``BWD_DM_STAGE`` whether the backward also stages the dM rows of its writes
and the bank rows of its reads beside its exact snapshots, ``STAGE_MIN_CHUNK`` the shortest
chunk the forward and the backward halve their chunk to for a stage that fits, ``FWD_CHUNK`` and ``BWD_CHUNK`` (None: no bound) upper bounds of the forward's
and the backward's internal chunk (benchmarks).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import operator
import threading

import numpy as np

from .._validate import Layout
from ..config import UnsupportedConfigurationError
from . import _build as K
from .saved import SavedSnapshots

__all__ = ["check_config", "check_backward", "sdm_fwd", "sdm_bwd", "expand_memory_batch",
           "sum_memory_batch", "check_device_errors", "settings", "plan", "backward_plan",
           "SavedSnapshots"]

THREADS = 256               # threads per block (a multiple of 32, at most 512)
PREPASS_THREADS = 512       # threads per pre-pass block (independent chunks: no order to keep)
BWD_THREADS = 512           # threads per backward block (None: THREADS)
BWD_TILE_WIDTH = None       # override of the backward's column-tile width
BWD_SCRATCH = 56 << 20      # bytes of pre-pass output per range of chunks of the backward
                            # (56 MiB: two ranges at the headline, 1.4% faster than three
                            # at 48 MiB; one range, 111 MB, would break the memory target)
MAX_ENTRIES = 4096          # write (or read) entries of one chunk: C*W, sorted in shared memory
TILE_WIDTH = None           # override of the column-tile width (tests and benchmarks)
KEEP_ROWS = None            # forward keeps gathered write rows in shared memory (None: when
                            # that still lets two blocks share a multiprocessor)
KEEP_SMEM = 110 * 1024      # shared memory per block under which two blocks fit an SM (H100/H200)
FWD_CHUNK = None            # upper bound of the forward's internal chunk (None: 64, 32 for
                            # double; benchmarks)
BWD_CHUNK = None            # the same for the backward (benchmarks)
BWD_DM_STAGE = True         # the backward also stages the dM rows of its writes and the bank
                            # rows of its reads beside its exact snapshots, where they fit
                            # (stop 28, H100: W = 4 -3%, hd = 64 W = 8 -6%; H200 W = 4: 0%)
SUB_SNAPSHOTS = True        # a forward that saves exact snapshots keeps its longer chunk where
                            # the backward's is a power-of-two divisor of it, and saves them for
                            # the backward's sub-chunks (stop 28, H100: hd = 64 W = 64 -17%)
BWD_DM_HALVE = False        # the backward halves its chunk (down to STAGE_MIN_CHUNK) for a dM
                            # stage that does not fit at its own; needs SUB_SNAPSHOTS. Off: it
                            # loses at most shapes (H200 stop 28: W = 8 +8%, W = 32 +4%, hd = 64
                            # +4%) though it wins at the headline (H200 -6.1%, H100 -0.3 to -1.6%)
STAGE_READS = None          # forward: wider column tiles, one block per SM of STAGE_THREADS,
                            # the read rows staged in shared memory beside the kept write rows
                            # (None: where it fits and widens the tile or runs one wave; true:
                            # where it fits; false or 0: never; "fits" after halving the chunk
                            # down to STAGE_MIN_CHUNK where needed)
STAGE_THREADS = 512         # threads per forward block when its read rows are staged (<= 512)
STAGE_MIN_CHUNK = 16        # the forward (read rows) and the backward (exact snapshots) halve
                            # their chunk, down to this, for a stage that fits
E_STAGE = 512               # CSR entries staged per chunk (kernels/sdm_fwd.cu)
BE_STAGE = 1024             # the same for the backward (kernels/sdm_bwd.cu)
FUSE_MAX_W = 64             # one-token chunks with W <= this skip the pre-pass launch
FUSE_THREADS = None         # block size of those one-token launches (None: sized to their
                            # gather, at least 64; fewer registers per block, so that the
                            # decode shape's blocks run in one wave: benchmarks/RESULTS.md)

_ERRORS = {1: "write_idx values must lie in [0, num_memory_slots)",
           2: "read_idx values must lie in [0, num_memory_slots)"}


_SETTING_NAMES = ("TILE_WIDTH", "THREADS", "KEEP_ROWS", "PREPASS_THREADS", "BWD_THREADS",
                  "FUSE_THREADS", "BWD_TILE_WIDTH", "BWD_SCRATCH", "STAGE_READS", "STAGE_THREADS",
                  "STAGE_MIN_CHUNK", "BWD_CHUNK", "BWD_DM_STAGE", "SUB_SNAPSHOTS", "BWD_DM_HALVE",
                  "FWD_CHUNK")
_get_settings = operator.itemgetter(*_SETTING_NAMES)


def settings() -> tuple:
    """The process-wide knobs the kernels read (part of a graph runner's key), in the order of
    ``_SETTING_NAMES``."""
    return _get_settings(globals())


_DEFAULTS = dict(zip(_SETTING_NAMES, settings()))


# ---- the device error word ------------------------------------------------------------------
_err_lock = threading.Lock()
_err_ptr = None


def _error_word() -> int:
    """Address of a host-mapped, portable int that kernels set when they skip a bad id. It is
    zeroed by the host (no device work), so it can be created even while a stream captures."""
    global _err_ptr
    if _err_ptr is None:
        import cupy
        with _err_lock:
            if _err_ptr is None:
                rt = cupy.cuda.runtime
                ptr = rt.hostAlloc(4, rt.hostAllocMapped | rt.hostAllocPortable)
                ctypes.c_int.from_address(ptr).value = 0
                _err_ptr = ptr
    return _err_ptr


def check_device_errors(reset: bool = True) -> None:
    """Synchronises the current device and raises ValueError if a kernel met a slot id outside
    [0, S) since the last check (a call made with ``check_indices=False``)."""
    if _err_ptr is None:
        return
    import cupy
    cupy.cuda.runtime.deviceSynchronize()
    word = ctypes.c_int.from_address(_err_ptr)
    code = word.value
    if code and reset:
        word.value = 0
    if code:
        raise ValueError(f"sdm_cupy: a GPU kernel skipped ids that broke the rule "
                         f"'{_ERRORS.get(code, 'slot ids must lie in [0, num_memory_slots)')}' "
                         "(a call with check_indices=False); those entries were treated as weight "
                         "0, so that call's results are not the op's")


# ---- launch plan ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    C: int              # internal chunk size (<= config.chunk_size)
    Nt: int
    TW: int             # column-tile width (multiple of the piece width N, or hd)
    ntile: int
    N: int              # elements per 16-byte piece of a bank row
    smem_pre: int
    smem_fwd: int       # including the kept rows when keep
    smem_bwd: int
    keep: bool          # the forward keeps its gathered write rows in shared memory
    CS: int             # bytes per chunk of the CSR column array (C*C, or 2*C*C for the
                        # backward's form, rounded up to 16)
    seg: int            # chunks per range of the backward (its pre-pass scratch)
    smem_bwd_snap: int = 0   # the backward with its chunk's exact snapshot rows staged in
                             # shared memory (0: they do not fit beside the rest)
    smem_bwd_dm: int = 0     # ... and its dM rows and read rows too (0: off, or no fit)
    sub: int = 0             # a saving forward: the backward's chunk, a divisor of C, for which
                             # it saves exact snapshots (0: C itself)
    rstage: bool = False     # the forward stages its read rows too (smem_fwd includes them)
    fwd_threads: int = 0     # the forward's block size (0: THREADS)


def _device_limits():
    import cupy
    return _limits_of(cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _limits_of(dev_id: int):
    import cupy
    rt = cupy.cuda.runtime
    return (rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, dev_id),
            rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev_id),
            cupy.cuda.Device(dev_id).compute_capability)


def _r16(x: int) -> int:
    return (x + 15) & ~15


def _smem(C, W, TW, N, acc_size, quant, idx_size=4, val_size=4, bank_size=4, form=1):
    """Shared memory per block of the pre-pass (``form`` 1: the forward's, 2: the
    backward's; kernels/sdm_prepass.cu's layout), the forward (without, then with the kept
    rows) and the backward; those two mirror FwdStage::carve (kernels/sdm_fwd.cu) and
    BwdStage::carve (kernels/sdm_bwd.cu) and the regions after them."""
    twp = -(-TW // N) * N
    tvp = (twp + 7) & ~7
    ld = C + 1
    m2 = 1
    while m2 < 2 * C * W:
        m2 <<= 1
    dead = m2 * 8 + 2 * C * W * (acc_size + 4)   # the pre-pass's Ai reuses it when it fits
    tri = C * (C + 1) // 2 * acc_size              # a packed lower triangle with its diagonal
    ai = 0 if tri + 16 * C <= dead else tri
    gh = C * C if form == 1 else 2 * C * ld        # Gs and Hs (the backward's hash table)
    pre = dead + 4 * C * 8 + gh * acc_size + ai
    cw = C * W
    stage = (2 * _r16(cw * acc_size) + _r16(C * acc_size) + _r16(E_STAGE * acc_size)
             + 2 * _r16(cw * idx_size) + _r16(C * tvp * val_size) + _r16((2 * C + 1) * 4)
             + _r16(cw * 4) + _r16(E_STAGE))
    fwd = 2 * stage + 3 * _r16(C * twp * acc_size) + (_r16(cw * 4) if quant else 0)
    fwd_keep = fwd + cw * twp * bank_size
    npt = twp // N
    bstage = (2 * _r16(cw * acc_size) + _r16(C * acc_size) + _r16(BE_STAGE * acc_size)
              + 2 * _r16(cw * idx_size) + 2 * _r16(C * tvp * val_size) + _r16((4 * C + 1) * 4)
              + _r16(2 * cw * 4) + _r16(cw * 4) + _r16(BE_STAGE))
    bwd = (2 * bstage + 5 * _r16(C * twp * acc_size) + 2 * _r16(cw * npt * acc_size)
           + C * npt * acc_size)
    return pre, fwd, fwd_keep, bwd


def _forced_width(backward: bool):
    """The tile width a knob forces (None: automatic)."""
    return BWD_TILE_WIDTH if backward and BWD_TILE_WIDTH is not None else TILE_WIDTH


def _tile_width(lay: Layout, N: int, nsm: int, per_sm: int = 2, backward: bool = False,
                one_wave: bool | None = None) -> int:
    """Column-tile width. ``one_wave`` (default: ``backward``): the widest tiles that still fit
    one wave of ``per_sm`` blocks per multiprocessor (the backward; the forward that stages
    its read rows, per_sm = 1); else enough blocks for ``per_sm`` per multiprocessor."""
    force = _forced_width(backward)
    if force is not None:   # rounded up to whole pieces: tiles start 16-byte aligned
        return min(lay.hd, -(-max(1, int(force)) // N) * N)
    pieces = -(-lay.hd // N)
    ntile = 1
    if backward if one_wave is None else one_wave:
        # as many tiles as still fit one wave of `per_sm` blocks per multiprocessor (a block
        # walks all chunks: a second wave would double the time), at least 2 pieces a tile
        while (lay.B * lay.P * ntile * 2 <= per_sm * nsm
               and -(-pieces // (ntile * 2)) >= 2):
            ntile *= 2
        return min(lay.hd, -(-pieces // ntile) * N)
    # enough blocks for `per_sm` per multiprocessor, while a tile keeps at least 2 pieces
    while lay.B * lay.P * ntile < per_sm * nsm and -(-pieces // (ntile * 2)) >= 2:
        ntile *= 2
    return min(lay.hd, -(-pieces // ntile) * N)


_PLANS: dict = {}
_PLANS_MAX = 256
_TUNED: dict = {}   # (Layout, device limits) -> the BWD_DM_HALVE that tune_layout found faster


def halve_for(lay: Layout, limits) -> bool:
    """Whether the backward of this layout halves its chunk for its dM stage: the choice
    ``tune_layout`` measured for it on a device of these limits, else ``BWD_DM_HALVE``."""
    return bool(_TUNED.get((lay, limits), BWD_DM_HALVE))


def clear_tuning() -> None:
    """Forgets every choice ``tune_layout`` made (plans go back to ``BWD_DM_HALVE``)."""
    _TUNED.clear()


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What ``tune_layout`` found for one layout."""
    halve: bool              # the choice now in effect for the layout
    plans_differ: bool       # False: both choices plan the same kernels, nothing was timed
    ms: dict                 # {False: median ms, True: median ms} of the timed call; {} if not


def tune_layout(lay: Layout, config, run_once, *, reps: int = 5, limits=None) -> Tuning:
    """Chooses ``BWD_DM_HALVE`` for one layout by measurement, and remembers the choice for it
    (``halve_for``; ``clear_tuning`` forgets). No rule of the plan's quantities separates the
    layouts where halving the backward's chunk for its dM stage wins from those where it loses
    (RESULTS, stop 28), so the caller times both.

    ``run_once()`` runs one forward that saves snapshots and its backward and returns their
    time in seconds; the plans it asks for see the choice under test. Where both choices plan
    the same kernels nothing runs. Otherwise one untimed call per choice (compilation), then
    ``reps`` rounds of one call per choice, interleaved; the lower median wins, and a tie keeps
    the default."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    limits = limits or _device_limits()
    key = (lay, limits)
    kept = _TUNED.pop(key, None)   # what the layout has when this returns (None: nothing)

    def plans(h):
        _TUNED[key] = h
        return (plan(lay, config, limits=limits, saves=True),
                plan(lay, config, limits=limits, backward=True))

    try:
        if plans(False) == plans(True):
            return Tuning(halve=bool(BWD_DM_HALVE if kept is None else kept),
                          plans_differ=False, ms={})
        times = {False: [], True: []}
        for rnd in range(reps + 1):
            for h in (False, True):
                _TUNED[key] = h
                t = float(run_once())
                if rnd:
                    times[h].append(t)
        ms = {h: 1e3 * float(np.median(v)) for h, v in times.items()}
        default = bool(BWD_DM_HALVE)
        kept = (not default) if ms[not default] < ms[default] else default
        return Tuning(halve=kept, plans_differ=True, ms=ms)
    finally:
        if kept is None:
            _TUNED.pop(key, None)
        else:
            _TUNED[key] = kept


def plan(lay: Layout, config, *, quant=None, limits=None, backward=False,
         exact_snapshots=True, saves=False, chunk=None) -> Plan:
    """Chunk and tile sizes of a call; raises UnsupportedConfigurationError when nothing fits.
    ``exact_snapshots`` (the backward): whether its snapshots are exact, so that staging them
    in shared memory can decide its chunk. ``saves`` (the forward): it saves snapshots, so its
    chunk is one the backward can run too (snapshots hold the rows at the start of the
    forward's chunks: the backward must walk the same chunks). ``chunk`` (the backward): run
    exactly this chunk, the saving forward's (``backward_plan``). Plans are remembered per
    layout, mode, device limits and knob values (an eager forward asked for up to two, about
    a tenth of a decode step's host time); a refusal is not."""
    limits = limits or _device_limits()
    exact = bool(exact_snapshots) if backward else True
    saves = bool(saves) and not backward
    chunk = int(chunk) if backward and chunk is not None else None
    key = (lay, quant, limits, backward, exact, saves, chunk, settings(), MAX_ENTRIES,
           KEEP_SMEM, E_STAGE, BE_STAGE, _TUNED.get((lay, limits)))
    pl = _PLANS.get(key)
    if pl is None:
        if saves:   # the chunk the backward takes by itself, or a multiple of it
            cb = plan(lay, config, limits=limits, backward=True,
                      exact_snapshots=quant is None).C
            own = _plan(lay, quant, limits, False)
            # (a power of two: the kernel shifts by its log)
            if (SUB_SNAPSHOTS and quant is None and own.C > cb >= 2 and own.C % cb == 0
                    and cb & (cb - 1) == 0):
                pl = dataclasses.replace(own, sub=cb)
            else:
                pl = _plan(lay, quant, limits, False, cmax=cb)
        else:
            pl = _plan(lay, quant, limits, backward, exact_snapshots=exact, chunk=chunk)
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = pl
    return pl


class _ChunkDoesNotFit(RuntimeError):
    """The backward's shared memory does not fit the saving forward's chunk at any tile the
    knobs allow (``_plan`` with ``chunk``)."""


def backward_plan(lay: Layout, config, *, limits=None, chunk=None, fwd_settings=None) -> Plan:
    """The backward's plan: the chunk of the forward that saved its snapshots, the backward's
    own tiles and stages (narrower tiles where the chunk needs them). ``chunk``: that forward's
    chunk, as its snapshots carry it (``SavedSnapshots.chunk``); None recomputes it from the
    layout, config and current knobs. ``fwd_settings``: ``settings()`` when the forward ran (for
    the error message).

    Raises:
        RuntimeError: the backward cannot run that chunk with the current knobs (a forced tile
            width set since the forward made its snapshots leaves too little shared memory).
    """
    mode = config.snapshot_quant
    if chunk is None:   # a sub-chunk where the forward saved its snapshots for those
        fwd = plan(lay, config, quant=mode, limits=limits, saves=True)
        chunk = fwd.sub or fwd.C
    try:
        return plan(lay, config, limits=limits, backward=True, exact_snapshots=mode is None,
                    chunk=int(chunk))
    except _ChunkDoesNotFit:
        now = settings()
        if fwd_settings is not None:
            changed = ", ".join(f"{k}={v!r} (the forward's: {f!r})" for k, v, f in
                                zip(_SETTING_NAMES, now, fwd_settings) if v != f)
            since = "since the forward"
        else:
            changed = ", ".join(f"{k}={v!r}" for k, v in zip(_SETTING_NAMES, now)
                                if v != _DEFAULTS[k])
            since = "from their defaults"
        raise RuntimeError(
            f"sdm_cupy.backward: the snapshots were saved by a forward that ran {int(chunk)}-token "
            f"chunks, and the backward must walk the same chunks, but with the current settings "
            f"of sdm_cupy.kernels.gpu (changed {since}: {changed or 'none'}) its shared memory "
            f"at that chunk is more than this device has. Restore the settings the forward ran "
            f"with, or run the forward again") from None


def _saved_plan(lay: Layout, config, snapshots) -> Plan:
    """``backward_plan`` at the chunk (and with the settings) the snapshots carry."""
    return backward_plan(lay, config, chunk=getattr(snapshots, "chunk", None),
                         fwd_settings=getattr(snapshots, "settings", None) or None)


def check_backward(lay: Layout, config, snapshots) -> None:
    """Refusals of a backward, before the saved state is consumed: its chunks (those its
    snapshots were saved for) must still fit the backward (RuntimeError otherwise)."""
    _saved_plan(lay, config, snapshots)


def _plan(lay: Layout, quant, limits, backward, cmax=None, exact_snapshots=True,
          chunk=None) -> Plan:
    nsm, smem_max, _ = limits
    if lay.W > MAX_ENTRIES:
        raise UnsupportedConfigurationError(
            f"the GPU backend sorts a chunk's C*W slot ids in shared memory and supports W <= "
            f"{MAX_ENTRIES}; got W={lay.W}")
    acc = K.compute_dtype(lay.bank_dtype, lay.value_dtype)
    vk = K.kernel_value_dtype(lay.bank_dtype, lay.value_dtype)
    N = K.vec_width(lay.bank_dtype)
    C = min(lay.C, 64 if acc.itemsize == 4 else 32, MAX_ENTRIES // lay.W, lay.T)
    bound = BWD_CHUNK if backward else FWD_CHUNK
    if bound is not None:
        C = max(1, min(C, int(bound)))
    if cmax is not None:
        C = min(C, cmax)
    if chunk is not None:   # the saving forward's (backward_plan refuses one that no longer fits)
        C = chunk
    # the backward runs one wave: one block per multiprocessor at 512 threads, two at 256
    bwd_per_sm = 2 if (BWD_THREADS or THREADS) <= 256 else 1
    TW = lay.hd if quant in ("fp8_e4m3", "int8") else _tile_width(
        lay, N, nsm, bwd_per_sm if backward else 2, backward)
    sizes = dict(idx_size=np.dtype(lay.index_dtype).itemsize, val_size=vk.itemsize,
                 bank_size=np.dtype(lay.bank_dtype).itemsize)
    forced = _forced_width(backward) is not None
    while True:
        pre, fwd, fwd_keep, bwd = _smem(C, lay.W, TW, N, acc.itemsize,
                                        quant in ("fp8_e4m3", "int8"), **sizes,
                                        form=2 if backward else 1)
        need = max(pre, fwd) if TW == lay.hd and quant in ("fp8_e4m3", "int8") else max(pre, fwd, bwd)
        if need <= smem_max:
            break
        if chunk is not None and not forced and TW > N:
            # the chunk is the saving forward's: narrower tiles instead (a knob that narrowed
            # them when the forward ran may have changed back since)
            TW = max(1, -(-TW // N) // 2) * N
            continue
        if C == 1:
            break
        C = max(1, C // 2)
    if chunk is not None and (C != chunk or need > smem_max):
        raise _ChunkDoesNotFit(f"the backward cannot run the forward's chunk {chunk} ({lay})")
    if need > smem_max:
        raise UnsupportedConfigurationError(
            f"head width hd={lay.hd} with snapshot_quant={quant!r} needs {need} "
            f"bytes of shared memory per block, more than this device's {smem_max}: the "
            "quantized kernels cannot tile it (one block holds a whole row to find its scale)")
    Nt = -(-lay.T // C)
    if KEEP_ROWS is None:
        keep = fwd_keep <= (KEEP_SMEM if fwd <= KEEP_SMEM else smem_max)
    else:
        keep = bool(KEEP_ROWS) and fwd_keep <= smem_max
    smem_fwd = fwd_keep if keep else fwd
    rstage, fwd_threads = False, 0
    if (not backward and (STAGE_READS is None or STAGE_READS) and C > 1
            and KEEP_ROWS is not False and quant not in ("fp8_e4m3", "int8")):
        # kernels/sdm_fwd.cu's read-row stage: the kept write rows and the read rows of a
        # chunk, both in shared memory, at tiles sized for one block per multiprocessor
        TWs = _tile_width(lay, N, nsm, per_sm=1, one_wave=True)
        _, _, keep_s, _ = _smem(C, lay.W, TWs, N, acc.itemsize, False, **sizes)
        staged = keep_s + C * lay.W * (-(-TWs // N) * N) * sizes["bank_size"]
        # automatic: where the stage widens the tiles, or keeps them and its blocks run in one
        # wave (stop 20, hd = 64 at 16 columns either way: forward -5 to -11%)
        auto = TWs > TW or lay.B * lay.P * -(-lay.hd // TWs) <= nsm
        if staged <= smem_max and (STAGE_READS is not None or auto):
            TW, keep, smem_fwd, rstage, fwd_threads = TWs, True, staged, True, STAGE_THREADS
        elif staged > smem_max and FWD_CHUNK is None and C // 2 >= STAGE_MIN_CHUNK:
            # the stage does not fit this chunk: a shorter one whose stage fits beats the
            # register form (stop 20, H200, W = 32: 3.80 ms at C = 64 unstaged, 2.05 at 32
            # staged, 2.72 at 16 staged)
            alt = _plan(lay, quant, limits, backward, cmax=C // 2)
            if alt.rstage:
                return alt
    ntile = -(-lay.hd // TW)
    per_chunk = sum(n * np.dtype(dt).itemsize for n, dt in _bwd_scratch_rows(lay.W, C, acc))
    seg = max(1, min(Nt, BWD_SCRATCH // (lay.B * lay.P * per_chunk)))
    # kernels/sdm_bwd.cu's snapshot stage: C*W rows of the tile after the other regions; only
    # where it costs no block per multiprocessor
    cap = smem_max if bwd_per_sm == 1 else min(smem_max, KEEP_SMEM)
    rows = C * lay.W * (-(-TW // N) * N)
    snap_rows = rows * np.dtype(lay.bank_dtype).itemsize
    bwd_snap = _r16(bwd) + snap_rows
    if bwd_snap > cap or not exact_snapshots:   # quantized snapshots: nothing to stage
        bwd_snap = 0
    # ... and with it the dM rows of the chunk's writes and the bank rows of its reads (round 1
    # copies them all with cp.async, then reads shared memory only)
    bwd_dm = 0
    if bwd_snap and BWD_DM_STAGE:
        bwd_dm = (_r16(bwd) + _r16(snap_rows)
                  + _r16(rows * np.dtype(lay.grad_bank_dtype).itemsize) + snap_rows)
        if bwd_dm > cap:
            bwd_dm = 0
    if (backward and not bwd_snap and exact_snapshots and BWD_CHUNK is None
            and chunk is None and C // 2 >= STAGE_MIN_CHUNK):
        # exact snapshots that do not fit beside this chunk: a shorter chunk whose snapshot
        # stage fits is faster (stop 20, H200: W = 24 bf16 8.16 -> 6.68 ms forward+backward,
        # C = 64 -> 32; float32 bank at W = 16 6.17 -> 6.13)
        alt = _plan(lay, quant, limits, backward, cmax=C // 2)
        if alt.smem_bwd_snap:
            return alt
    if (backward and bwd_snap and not bwd_dm and BWD_DM_STAGE and SUB_SNAPSHOTS
            and halve_for(lay, limits)
            and exact_snapshots and BWD_CHUNK is None and chunk is None
            and C // 2 >= STAGE_MIN_CHUNK and C & (C - 1) == 0):
        # the same for the dM stage (gpu.BWD_DM_HALVE), from a power-of-two chunk only, so that
        # the saving forward keeps its chunk and saves sub-chunk snapshots (Plan.sub)
        alt = _plan(lay, quant, limits, backward, cmax=C // 2, exact_snapshots=exact_snapshots)
        if alt.smem_bwd_dm:
            return alt
    return Plan(C=C, Nt=Nt, TW=TW, ntile=ntile, N=N, smem_pre=pre, smem_fwd=smem_fwd,
                smem_bwd=bwd, keep=keep, CS=_r16((2 if backward else 1) * C * C), seg=seg,
                smem_bwd_snap=bwd_snap, rstage=rstage, fwd_threads=fwd_threads,
                smem_bwd_dm=bwd_dm)


def check_config(lay: Layout, config) -> None:
    """Refusals of a call that saves snapshots (before anything runs)."""
    mode = config.snapshot_quant
    _, _, cc = _device_limits()
    if mode is not None and int(cc) < 80:
        raise UnsupportedConfigurationError(
            f"snapshot_quant={mode!r} needs bfloat16/fp8 conversions of compute capability "
            f">= 8.0; this device has {cc}")
    plan(lay, config, quant=mode, saves=True)


# ---- launches ---------------------------------------------------------------------------------
def _grid(n: int) -> tuple:
    if not 1 <= n <= 2 ** 31 - 1:
        raise ValueError(f"sdm_cupy: grid of {n} blocks is outside the device limit")
    return (n,)


def _launch(src, key, name, grid, smem, args, threads=None):
    fn = K.get_function(src, key, name)
    if smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    fn(_grid(grid), (threads or THREADS,), args, shared_mem=smem)


def _magic(d: int) -> np.uint32:
    """The multiplier of kernels' FastDiv for divisor d: ceil(2^32 / d), 0 for d = 1."""
    return np.uint32((2 ** 32 + d - 1) // d if d > 1 else 0)


def _div_params(lay, pl) -> tuple:
    """The forward's and backward's last kernel arguments: FastDiv's multipliers of W and of
    NPC (16-byte pieces per row), for a full column tile and for the last one."""
    npc = -(-pl.TW // pl.N)
    npc_last = -(-(lay.hd - (pl.ntile - 1) * pl.TW) // pl.N)
    return _magic(lay.W), _magic(npc), _magic(npc_last)


def _aligned(x, N) -> bool:
    return x.data.ptr % (N * x.dtype.itemsize) == 0


def _rows16(x, lay, pl) -> bool:
    """A [B, T, D] array whose tile rows the kernels may stage in 16-byte copies."""
    sv = x.dtype.itemsize
    return x.data.ptr % 16 == 0 and (lay.hd * sv) % 16 == 0 and (pl.TW * sv) % 16 == 0


def _err_array():
    # the host-mapped word's address (unified addressing: the same pointer on the device)
    return np.uint64(_error_word())


def _prepass_sparse(lay, pl, acc, wi, aw, ri, cw, beta):
    """sdm_prepass<SPARSE=1>: the forward's compact form of every chunk: write-run links
    [nchunk, C*W], CSR row pointers [nchunk, 2C+1], columns [nchunk, CS] (uint8) and values
    [nchunk, C*C] (rows: strictly lower Ainv, then H)."""
    import cupy
    nchunk = lay.B * lay.P * pl.Nt
    wrun = cupy.empty((nchunk, pl.C * lay.W), dtype=np.int32)
    ptr = cupy.empty((nchunk, 2 * pl.C + 1), dtype=np.int32)
    col = cupy.empty((nchunk, pl.CS), dtype=np.uint8)
    val = cupy.empty((nchunk, pl.C * pl.C), dtype=acc)
    key = (acc, lay.index_dtype)
    _launch("prepass", key, K.prepass_name(acc, lay.index_dtype, 1, lay.S), nchunk, pl.smem_pre,
            (wi, aw, ri, cw, beta, np.int32(lay.T), np.int32(lay.P), np.int32(lay.W),
             np.int64(lay.S), np.int32(pl.C), np.int32(0), np.int32(pl.Nt),
             val, wrun, ptr, col, np.int32(pl.CS), _err_array()), PREPASS_THREADS)
    return wrun, ptr, col, val


def _bwd_scratch_rows(W, C, acc):
    """(elements, dtype) per (b, p, chunk) of the backward pre-pass's outputs: sorted runs and
    read links, CSR row pointers, columns (the plan's CS), values."""
    return ((3 * C * W, np.int32), (4 * C + 1, np.int32), (_r16(2 * C * C), np.uint8),
            (2 * C * C, acc))


def _bwd_scratch(lay, pl, acc):
    """The backward pre-pass's output for one range of pl.seg chunks: srt, ptr, col, val."""
    import cupy
    n = lay.B * lay.P * pl.seg
    return tuple(cupy.empty((n, k), dtype=dt) for k, dt in _bwd_scratch_rows(lay.W, pl.C, acc))


def _snapshot_arrays(lay, mode):
    import cupy
    shape = (lay.B, lay.T, lay.P, lay.W, lay.hd)
    if mode is None:
        return cupy.empty(shape, dtype=lay.bank_dtype), None
    if mode == "bf16":
        return cupy.empty(shape, dtype=K.BFLOAT16), None
    store = np.uint8 if mode == "fp8_e4m3" else np.int8
    return (cupy.empty(shape, dtype=store),
            cupy.empty((lay.B, lay.T, lay.P, lay.W), dtype=np.float32))


def sdm_fwd(lay: Layout, config, bank, write_idx, write_w, values, beta, read_idx, read_w, *,
            save_snapshots: bool):
    """SPEC §3: updates ``bank`` in place; returns (readings [B, T, D], snapshots or None).
    Snapshots are (rows [B, T, P, W, hd] in the bank dtype, or bf16 / fp8 bytes / int8, and
    float32 scales [B, T, P, W] for the 1-byte modes, else None)."""
    import cupy
    mode = config.snapshot_quant if save_snapshots else None
    pl = plan(lay, config, quant=mode, saves=save_snapshots)
    acc = K.compute_dtype(lay.bank_dtype, lay.value_dtype)
    vk = K.kernel_value_dtype(lay.bank_dtype, lay.value_dtype)
    v = values if values.dtype == vk else values.astype(vk)
    out = cupy.empty((lay.B, lay.T, lay.D), dtype=vk)
    fuse = pl.C == 1 and lay.W <= FUSE_MAX_W
    if fuse:   # the forward kernel finds a one-token chunk's overlaps itself
        wrun = sp_ptr = sp_col = sp_val = out
    else:
        wrun, sp_ptr, sp_col, sp_val = _prepass_sparse(lay, pl, acc, write_idx, write_w,
                                                       read_idx, read_w, beta)
    if save_snapshots:
        snap, scale = _snapshot_arrays(lay, mode)
    else:  # never written (save=0); any typed array of the right dtype will do
        snap, scale = _snapshot_arrays(dataclasses.replace(lay, B=1, T=1, W=1, hd=1), mode)
    N = pl.N
    # bits: 1 bank, 4 readings, 8 snapshots (16-byte pieces); 32 values (16-byte staging)
    vecmask = (int(_aligned(bank, N)) | int(_aligned(out, N)) << 2
               | int(_aligned(snap, N)) << 3) if lay.hd % N == 0 else 0
    vecmask |= int(_rows16(v, lay, pl)) << 5
    q = K.QUANT_CODE[mode]
    key = (lay.bank_dtype, vk, lay.index_dtype)
    threads = pl.fwd_threads or THREADS
    if fuse:   # one token: its gather has NPC * WS tasks (kernels/sdm_fwd.cu)
        threads = FUSE_THREADS or _fuse_threads(-(-pl.TW // N), lay.W)
    # the staged instance holds only the fast path: whole 16-byte pieces of an aligned bank
    # (and snapshots); elsewhere the plan's tiles run the other instance's general gather
    rs = int(pl.rstage and bool(vecmask & 1) and (bool(vecmask & 8) or not save_snapshots)
             and not fuse)
    cb = pl.sub.bit_length() - 1 if pl.sub and save_snapshots and mode is None else 0
    _launch("fwd", key, K.fwd_name(lay.bank_dtype, vk, lay.index_dtype, q, rs, int(cb > 0)),
            lay.B * lay.P * pl.ntile, pl.smem_fwd,
            (bank, write_idx, write_w, v, beta, read_idx, read_w, sp_ptr, sp_col, sp_val, wrun,
             out, snap, scale if scale is not None else out, np.int32(lay.T), np.int32(lay.P),
             np.int32(lay.hd), np.int32(lay.W), np.int64(lay.S), np.int32(pl.C),
             np.int32(pl.Nt), np.int32(pl.TW), np.int32(pl.ntile), np.int32(int(save_snapshots)),
             np.int32(vecmask), np.int32(int(pl.keep)), np.int32(pl.CS), np.int32(int(fuse)),
             np.int32(cb), _err_array()) + _div_params(lay, pl), threads)
    readings = out if vk == lay.value_dtype else out.astype(lay.value_dtype)
    return readings, (SavedSnapshots((snap, scale), pl.sub or pl.C, settings())
                      if save_snapshots else None)


def _fuse_threads(npc: int, W: int) -> int:
    ws = 1
    while ws < 2 and ws * 2 <= W:   # WS_MAX of kernels/sdm_fwd.cu
        ws *= 2
    return min(THREADS, max(64, -(-npc * ws // 32) * 32))


def sdm_bwd(lay: Layout, config, bank, inputs, snapshots, dr, dM):
    """SPEC §4: rewinds ``bank`` in place; returns (d_bank, d_write_w, d_values, d_beta,
    d_read_w), d_bank in lay.grad_bank_dtype (``dM`` itself when given), d_values in
    lay.value_dtype, the weight gradients in the compute dtype."""
    import cupy
    write_idx, write_w, values, beta, read_idx, read_w = inputs
    mode = config.snapshot_quant
    # the chunks of the forward that saved the snapshots; tiles freely (scales are stored);
    # stages where they fit
    pl = _saved_plan(lay, config, snapshots)   # a remembered plan after check_backward
    acc = K.compute_dtype(lay.bank_dtype, lay.value_dtype)
    vk = K.kernel_value_dtype(lay.bank_dtype, lay.value_dtype)
    v = values if values.dtype == vk else values.astype(vk)
    g = dr if dr.dtype == vk else dr.astype(vk)
    gt = lay.grad_bank_dtype
    if dM is None:
        dM = cupy.zeros((lay.B * lay.S, lay.D), dtype=gt)
    snap, scale = snapshots
    srt, ptr, col, val = _bwd_scratch(lay, pl, acc)
    d_aw = cupy.zeros(write_w.shape, dtype=acc)
    d_cw = cupy.zeros(read_w.shape, dtype=acc)
    d_beta = cupy.zeros(beta.shape, dtype=acc)
    d_v = cupy.empty((lay.B, lay.T, lay.D), dtype=vk)
    N = pl.N
    # bits: 1 bank, 8 snapshots, 16 dM, 64 d_values (16-byte pieces); 2 values, 4 dr (16-byte
    # staging)
    vecmask = (int(_aligned(bank, N)) | int(_aligned(snap, N)) << 3 | int(_aligned(dM, N)) << 4
               | int(_aligned(d_v, N)) << 6) if lay.hd % N == 0 else 0
    vecmask |= int(_rows16(v, lay, pl)) << 1 | int(_rows16(g, lay, pl)) << 2
    q = K.QUANT_CODE[mode]
    # exact snapshots staged in shared memory (the kernel also needs its fast path)
    ssnap = mode is None and pl.smem_bwd_snap > 0
    dmst = ssnap and pl.smem_bwd_dm > 0
    key = (lay.bank_dtype, vk, lay.index_dtype)
    pkey = (acc, lay.index_dtype)
    pre_name = K.prepass_name(acc, lay.index_dtype, 2, lay.S)
    bwd_name = K.bwd_name(lay.bank_dtype, vk, gt, lay.index_dtype, q, int(dmst))
    for hi in range(pl.Nt, 0, -pl.seg):   # ranges of chunks, the last first
        lo = max(0, hi - pl.seg)
        _launch("prepass", pkey, pre_name, lay.B * lay.P * (hi - lo), pl.smem_pre,
                (write_idx, write_w, read_idx, read_w, beta, np.int32(lay.T), np.int32(lay.P),
                 np.int32(lay.W), np.int64(lay.S), np.int32(pl.C), np.int32(lo),
                 np.int32(hi - lo), val, srt, ptr, col, np.int32(pl.CS), _err_array()),
                PREPASS_THREADS)
        _launch("bwd", key, bwd_name, lay.B * lay.P * pl.ntile,
                pl.smem_bwd_dm if dmst else pl.smem_bwd_snap if ssnap else pl.smem_bwd,
                (bank, write_idx, write_w, v, beta, read_idx, read_w, ptr, col, val, srt, snap,
                 scale if scale is not None else d_beta, g, dM, d_aw, d_v, d_beta, d_cw,
                 np.int32(lay.T), np.int32(lay.P), np.int32(lay.hd), np.int32(lay.W),
                 np.int64(lay.S), np.int32(pl.C), np.int32(lo), np.int32(hi), np.int32(pl.TW),
                 np.int32(pl.ntile), np.int32(pl.CS), np.int32(vecmask),
                 np.int32(2 if dmst else int(ssnap)))
                + _div_params(lay, pl), BWD_THREADS)
    if vk != lay.value_dtype:
        d_v = d_v.astype(lay.value_dtype)
    return dM, d_aw, d_v, d_beta, d_cw


# ---- SPEC §6 ----------------------------------------------------------------------------------
def _stride_grid(n: int) -> int:
    nsm = _device_limits()[0]
    return max(1, min(-(-n // THREADS), nsm * 16))


def expand_memory_batch(param, B: int):
    """[S, D] -> [B*S, D] (B copies), one kernel on the current stream."""
    import cupy
    S, D = param.shape
    out = cupy.empty((B * S, D), dtype=param.dtype)
    bank = np.dtype(param.dtype)
    fn = K.get_function("batch", (bank,), K.batch_names(bank)[0])
    fn((_stride_grid(B * S * D),), (THREADS,), (param, out, np.int64(S * D), np.int32(B)))
    return out


def sum_memory_batch(grad_bank, S: int):
    """[B*S, D] -> [S, D], the sum over the B copies (float32 at least), grad_bank's dtype."""
    import cupy
    rows, D = grad_bank.shape
    B = rows // S
    out = cupy.empty((S, D), dtype=grad_bank.dtype)
    dt = np.dtype(grad_bank.dtype)
    fn = K.get_function("batch", (dt,), K.batch_names(dt)[1])
    fn((_stride_grid(S * D),), (THREADS,), (grad_bank, out, np.int64(S * D), np.int32(B)))
    return out
