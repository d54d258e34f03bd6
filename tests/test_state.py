"""sdm.LayerState: the bank a layer carries across calls (SPEC §7)."""

from __future__ import annotations

import numpy as np
import pytest

import sdm_cupy as sdm
from helpers import assert_close, make_problem, reference_fwd, to_numpy


def test_defaults():
    bank = np.zeros((6, 4))
    state = sdm.LayerState(bank)
    assert state.memory is bank
    assert state.seq_len == 0


def test_update_replaces_memory_advances_seq_len_and_returns_self():
    first, second, third = np.zeros((6, 4)), np.ones((6, 4)), np.full((6, 4), 2.0)
    state = sdm.LayerState(first, seq_len=5)
    assert state.update_(second, seq_len=3) is state
    assert state.memory is second, "update_ replaces the memory object, it does not copy"
    assert state.seq_len == 8
    assert state.update_(third) is state     # one token by default (decoding)
    assert state.memory is third and state.seq_len == 9
    assert state.update_(third, seq_len=0).seq_len == 9
    assert np.all(first == 0) and np.all(second == 1), "old memories are left alone"


def test_seq_len_is_a_python_int():
    state = sdm.LayerState(np.zeros((2, 2)), seq_len=np.int64(4))
    assert type(state.seq_len) is int and state.seq_len == 4
    state.update_(np.zeros((2, 2)), seq_len=np.int32(2))
    assert type(state.seq_len) is int and state.seq_len == 6


def test_negative_seq_len_is_refused_and_changes_nothing():
    old, new = np.zeros((2, 2)), np.ones((2, 2))
    state = sdm.LayerState(old, seq_len=3)
    with pytest.raises(ValueError, match="seq_len"):
        state.update_(new, seq_len=-1)
    assert state.memory is old and state.seq_len == 3


def test_repr_names_shape_and_seq_len():
    state = sdm.LayerState(np.zeros((12, 8), np.float32), seq_len=7)
    text = repr(state)
    assert text.startswith("LayerState(")
    assert "(12, 8)" in text and "seq_len=7" in text
    assert "seq_len=8" in repr(state.update_(np.zeros((12, 8))))


def test_carries_the_bank_through_decoding(xp, rng):
    # a layer decoding two tokens at a time: the carried bank equals the reference's
    pb = make_problem(rng, B=2, T=6, P=2, hd=4, S=8, W=2)
    r_ref, M_ref = reference_fwd(pb)
    x = pb.to(xp)
    cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size=2)
    state = sdm.LayerState(x.bank.copy())
    readings = []
    for t in range(0, pb.T, 2):
        res = sdm.forward(state.memory, *(a[:, t:t + 2] for a in x.inputs), cfg,
                          needs_backward=False)
        state.update_(res.bank, seq_len=2)
        readings.append(to_numpy(res.readings))
    assert state.seq_len == pb.T
    assert type(state.memory) is type(x.bank)
    assert_close(state.memory, M_ref, 1e-9, "carried bank")
    assert_close(np.concatenate(readings, axis=1), r_ref, 1e-9, "readings")
