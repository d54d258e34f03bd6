"""The hand-written backward of examples/associative_recall.py against finite differences."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ar():
    spec = importlib.util.spec_from_file_location(
        "associative_recall", os.path.join(ROOT, "examples", "associative_recall.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_task_batches_are_well_formed(ar, rng):
    task = ar.Task(keys=10, values=5, pairs=4, queries=6)
    keys, vals, targets = task.batch(rng, 7)
    assert keys.shape == vals.shape == (7, 10) and targets.shape == (7, 6)
    for b in range(7):
        pairs = dict(zip(keys[b, :4], vals[b, :4]))
        assert len(pairs) == 4, "pair keys must be distinct"
        assert (vals[b, 4:] == -1).all()
        assert [pairs[k] for k in keys[b, 4:]] == list(targets[b])


@pytest.mark.parametrize("chunk", [2, 16], ids=["C2", "C16"])
def test_backward_matches_finite_differences(ar, rng, chunk):
    task = ar.Task(keys=10, values=5, pairs=5, queries=4)
    mc = ar.ModelConfig(d_model=6, heads=2, head_dim=3, key_dim=4, slots=12, width=3,
                        chunk=chunk)
    params = ar.init_params(rng, task, mc, np.float64)
    params["beta_raw"] = rng.normal(size=params["beta_raw"].shape)
    params["bo"] = rng.normal(size=params["bo"].shape) * 0.1
    keys, vals, targets = task.batch(rng, 3)

    def loss_of(p):
        return ar.forward(np, p, mc, keys, vals, targets, task.pairs, needs_backward=False)[0]

    _, _, cache = ar.forward(np, params, mc, keys, vals, targets, task.pairs)
    grads = ar.backward(np, params, mc, cache)
    assert set(grads) == set(params)
    eps = 1e-6
    for name, p in params.items():
        flat = p.reshape(-1)
        # the entries that matter: those with a gradient, plus a few at random
        order = np.argsort(-np.abs(grads[name].reshape(-1)))
        picks = np.unique(np.concatenate([order[:4], rng.choice(flat.size, 4)]))
        for i in picks:
            old = flat[i]
            flat[i] = old + eps
            up = loss_of(params)
            flat[i] = old - eps
            down = loss_of(params)
            flat[i] = old
            fd = (up - down) / (2 * eps)
            got = grads[name].reshape(-1)[i]
            assert abs(got - fd) <= 1e-6 + 1e-5 * abs(fd), (
                f"d loss / d {name}[{i}]: backward {got:.8e}, finite difference {fd:.8e}")
