"""``sdm.tune`` and ``gpu.tune_layout``: the backward's dM-stage halving chosen per layout by
measurement (no GPU needed: the timed call is a stand-in that reports what the plan it sees
would cost; the device-side test is in test_gpu_backend.py)."""

from __future__ import annotations

import numpy as np
import pytest

import sdm_cupy as sdm
from helpers import make_problem
from sdm_cupy.kernels import gpu
from test_gpu_plan import H200, _cfg, _layout


@pytest.fixture(autouse=True)
def _forget():
    gpu.clear_tuning()
    yield
    gpu.clear_tuning()


def _plans(lay):
    return (gpu.plan(lay, _cfg(lay), limits=H200, saves=True),
            gpu.plan(lay, _cfg(lay), limits=H200, backward=True))


def _timer(lay, ms_off, ms_on, calls):
    """A stand-in for one forward+backward: the time of the plan the call would take."""
    def run_once():
        bwd = gpu.plan(lay, _cfg(lay), limits=H200, backward=True)
        halved = bwd.smem_bwd_dm > 0
        calls.append(halved)
        return (ms_on if halved else ms_off) / 1e3
    return run_once


@pytest.mark.parametrize("ms_off, ms_on, want", [(4.6, 4.3, True), (2.4, 2.6, False),
                                                 (3.0, 3.0, False)])
def test_the_faster_plan_is_kept_for_the_layout(ms_off, ms_on, want):
    """The headline layout, where the two plans differ: reps + 1 calls of each, interleaved
    (the first of each untimed), the lower median wins, a tie keeps the default (off), and
    the layout's later plans are the winner's; clear_tuning() brings the default back."""
    lay = _layout()
    default = _plans(lay)
    calls = []
    t = gpu.tune_layout(lay, _cfg(lay), _timer(lay, ms_off, ms_on, calls), reps=3, limits=H200)
    assert calls == [False, True] * 4
    assert t == gpu.Tuning(halve=want, plans_differ=True, ms={False: ms_off, True: ms_on})
    saving, bwd = _plans(lay)
    assert gpu.halve_for(lay, H200) is want
    assert (saving.C, saving.sub, bwd.C, bwd.smem_bwd_dm > 0) == (
        (64, 32, 32, True) if want else (64, 0, 64, False))
    assert ((saving, bwd) == default) is not want
    other = _layout(W=8)   # another layout keeps the default
    assert gpu.halve_for(other, H200) is False
    gpu.clear_tuning()
    assert _plans(lay) == default


def test_the_median_decides_not_one_slow_call():
    lay = _layout()
    times = iter([9, 9, 5.0, 4.0, 5.0, 40.0, 5.0, 4.0])   # untimed pair, then 3 rounds
    t = gpu.tune_layout(lay, _cfg(lay), lambda: next(times) / 1e3, reps=3, limits=H200)
    assert t.halve is True and t.ms == {False: 5.0, True: 4.0}


def test_nothing_runs_where_both_plans_are_the_same():
    """hd = 64, W = 8: the dM stage fits beside the 64-token chunk, so there is nothing to
    halve; W = 48: the backward's chunk is 16 already (the floor)."""
    for lay in (_layout(hd=64, W=8), _layout(W=48)):
        calls = []
        t = gpu.tune_layout(lay, _cfg(lay), _timer(lay, 1, 2, calls), limits=H200)
        assert calls == [] and t == gpu.Tuning(halve=False, plans_differ=False, ms={})
        assert (lay, H200) not in gpu._TUNED


def test_a_failed_measurement_leaves_the_earlier_choice():
    lay = _layout()
    gpu.tune_layout(lay, _cfg(lay), _timer(lay, 5, 4, []), reps=1, limits=H200)
    assert gpu.halve_for(lay, H200) is True

    def broken():
        raise RuntimeError("device lost")
    with pytest.raises(RuntimeError, match="device lost"):
        gpu.tune_layout(lay, _cfg(lay), broken, limits=H200)
    assert gpu.halve_for(lay, H200) is True
    gpu.clear_tuning()
    with pytest.raises(RuntimeError, match="device lost"):
        gpu.tune_layout(lay, _cfg(lay), broken, limits=H200)
    assert (lay, H200) not in gpu._TUNED


def test_the_knob_is_the_default_a_tie_keeps(monkeypatch):
    """With gpu.BWD_DM_HALVE on, a tie keeps halving; a measured loss still turns it off for
    the layout (the choice outranks the knob)."""
    monkeypatch.setattr(gpu, "BWD_DM_HALVE", True)
    lay = _layout()
    assert gpu.tune_layout(lay, _cfg(lay), _timer(lay, 3, 3, []), reps=1, limits=H200).halve
    t = gpu.tune_layout(lay, _cfg(lay), _timer(lay, 3, 4, []), reps=1, limits=H200)
    assert t.halve is False and _plans(lay)[1].C == 64


def test_reps_below_one_is_refused():
    lay = _layout()
    with pytest.raises(ValueError, match="reps must be >= 1"):
        gpu.tune_layout(lay, _cfg(lay), lambda: 0.0, reps=0, limits=H200)


def test_tune_on_numpy_arrays_validates_and_returns_none(rng):
    """The CPU backend has one plan: nothing to tune, but the arguments are checked as
    forward checks them (an id outside [0, S) names read_idx), and nothing is modified."""
    pb = make_problem(rng, dtype=np.float32)
    cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size=8)
    assert sdm.tune(pb.bank, *pb.inputs, cfg) is None
    bad = pb.read_idx.copy()
    bad[0, 0, 0, 0] = pb.S
    before = pb.bank.copy()
    args = list(pb.inputs)
    args[4] = bad
    with pytest.raises(ValueError, match="read_idx"):
        sdm.tune(pb.bank, *args, cfg)
    with pytest.raises(ValueError, match="reps must be >= 1"):
        sdm.tune(pb.bank, *pb.inputs, cfg, reps=0)
    assert np.array_equal(pb.bank, before)
