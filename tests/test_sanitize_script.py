"""benchmarks/sanitize.py, the compute-sanitizer run, checked without a device: its cases name
knobs that exist and build valid problems and configs, and its report parser attributes each
sanitizer report to the case that ran when it was printed."""

import numpy as np

import sdm_cupy as sdm
from helpers import load_benchmark
from sdm_cupy.kernels import gpu


def _script():
    return load_benchmark("sanitize")


def test_every_case_names_real_knobs_and_builds_a_valid_call():
    san = _script()
    assert len(san.CASES) >= 15
    for name, (pkw, ckw, knobs, kind) in san.CASES.items():
        for k in knobs:
            assert hasattr(gpu, k), f"{name}: gpu has no knob {k}"
        assert kind in ("fb", "fb-quant", "bad-ids", "batch"), name
        pb = san._problem(pkw)
        cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P,
                            **{"chunk_size": 64, **ckw})
        # the API's own checks accept the call (the CPU backend runs it here)
        res = sdm.forward(pb.bank, *pb.inputs, cfg, needs_backward=False)
        assert np.isfinite(np.asarray(res.readings, dtype=np.float64)).all(), name


def test_reports_are_attributed_to_the_case_that_printed_them():
    san = _script()
    log = "\n".join([
        "@@CASE a", "@@DONE a 0.1s",
        "@@CASE b",
        "========= Invalid __global__ write of size 16 bytes",
        "=========     at sdm::sdm_fwd_kernel+0x1a0",
        "========= Race reported between Write access at 0x10 and Read access at 0x20",
        "@@FAIL b: ValueError: x",
        "@@CASE c", "@@DONE c 0.2s",
        "========= ERROR SUMMARY: 2 errors"])
    got = san.per_case(log)
    assert got == {"a": {"reports": 0, "status": "ok"},
                   "b": {"reports": 2, "status": "failed"},
                   "c": {"reports": 0, "status": "ok"}}
    assert [m.group(1) for m in san._ERR.finditer(log)] == ["2"]


def test_halved_case_plans_the_dm_stage_at_half_chunk_and_sub_chunk_snapshots(monkeypatch):
    """The case named for the halved backward takes that path on an H200's limits: the
    backward at 32 tokens with its dM stage, the saving forward at 64 with 32-token sub-chunk
    snapshots; without its knob the same shape takes neither (so the case adds coverage)."""
    import emu
    from sdm_cupy._validate import layout

    san = _script()
    pkw, ckw, knobs, _ = san.CASES["one-wave-bf16-halved"]
    pb = san._problem(pkw)
    cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, **{"chunk_size": 64, **ckw})
    lay = layout(pb.bank, *pb.inputs, cfg)
    for on in (False, True):
        monkeypatch.setattr(gpu, "BWD_DM_HALVE", bool(knobs["BWD_DM_HALVE"]) if on else False)
        bwd = gpu.plan(lay, cfg, limits=emu.H200, backward=True)
        saving = gpu.plan(lay, cfg, limits=emu.H200, saves=True)
        got = (bwd.C, bwd.smem_bwd_dm > 0, saving.C, saving.sub)
        assert got == ((32, True, 64, 32) if on else (64, False, 64, 0)), (on, got)
