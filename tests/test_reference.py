"""The float64 reference against finite differences and against the chunked equations."""

import numpy as np
import pytest

from helpers import make_problem, reference_bwd, reference_fwd


def _loss(pb, dr, dM):
    r, M = reference_fwd(pb)
    return float((r * dr).sum() + (M * dM).sum())


@pytest.mark.parametrize("repeat", [False, True], ids=["distinct", "repeated-slots"])
def test_reference_gradients_match_finite_differences(rng, repeat):
    pb = make_problem(rng, B=2, T=7, P=2, hd=3, S=5 if not repeat else 4, W=3, repeat=repeat)
    dr = rng.normal(size=pb.values.shape)
    dM = rng.normal(size=pb.bank.shape)
    grads = reference_bwd(pb, dr, dM)
    names = ("bank", "write_w", "values", "beta", "read_w")
    eps = 1e-6
    for name, g in zip(names, grads):
        x = getattr(pb, name)
        flat = x.reshape(-1)
        picks = rng.choice(flat.size, size=min(flat.size, 12), replace=False)
        for k in picks:
            old = flat[k]
            flat[k] = old + eps
            up = _loss(pb, dr, dM)
            flat[k] = old - eps
            down = _loss(pb, dr, dM)
            flat[k] = old
            fd = (up - down) / (2 * eps)
            assert abs(fd - g.reshape(-1)[k]) <= 1e-6 * max(1.0, abs(fd)), (
                f"d loss / d {name}[{k}]: finite difference {fd} vs reference {g.reshape(-1)[k]}")


def test_reference_write_then_read_recalls_a_value(rng):
    # one token, one slot: the bank row becomes beta*a*(v - a*M) + M and the read sees it
    pb = make_problem(rng, B=1, T=1, P=1, hd=4, S=3, W=1)
    r, M = reference_fwd(pb)
    i, a, b, c, j = (pb.write_idx[0, 0, 0, 0], pb.write_w[0, 0, 0, 0], pb.beta[0, 0, 0],
                     pb.read_w[0, 0, 0, 0], pb.read_idx[0, 0, 0, 0])
    want = pb.bank.copy()
    want[i] += b * a * (pb.values[0, 0] - a * pb.bank[i])
    np.testing.assert_allclose(M, want, rtol=1e-12)
    np.testing.assert_allclose(r[0, 0], c * want[j], rtol=1e-12)
