"""Shared test helpers: random problems, comparisons, array-module handling."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import ml_dtypes
import numpy as np

import sdm_cupy as sdm
from sdm_cupy.kernels._build import KEY32_MAX_S

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": BF16}


@dataclasses.dataclass
class Problem:
    B: int
    T: int
    P: int
    hd: int
    S: int
    W: int
    bank: np.ndarray
    write_idx: np.ndarray
    write_w: np.ndarray
    values: np.ndarray
    beta: np.ndarray
    read_idx: np.ndarray
    read_w: np.ndarray

    @property
    def inputs(self):
        return (self.write_idx, self.write_w, self.values, self.beta, self.read_idx, self.read_w)

    def args(self):
        return (self.bank, *self.inputs)

    def to(self, xp):
        """The same problem on another array module (cupy)."""
        conv = (lambda a: xp.asarray(a)) if xp is not np else (lambda a: a)
        return dataclasses.replace(self, **{f: conv(getattr(self, f)) for f in
                                            ("bank", "write_idx", "write_w", "values", "beta",
                                             "read_idx", "read_w")})


def make_problem(rng, B=2, T=20, P=2, hd=8, S=32, W=3, dtype=np.float64, weight_dtype=None,
                 index_dtype=np.int32, repeat=False, value_dtype=None) -> Problem:
    """Random inputs of SPEC §1. ``repeat`` forces repeated slots within and across tokens.
    Weights are scaled so that the recurrence stays bounded (|beta * |k|^2| < 2)."""
    dtype = np.dtype(dtype)
    wdt = np.dtype(weight_dtype or (np.float64 if dtype == np.float64 else np.float32))
    vdt = np.dtype(value_dtype or dtype)
    D = P * hd
    if repeat:
        pool = rng.integers(0, S, size=max(1, min(S, 3)))
        widx = rng.choice(pool, size=(B, T, P, W))
        ridx = rng.choice(pool, size=(B, T, P, W))
    else:
        widx = rng.integers(0, S, size=(B, T, P, W))
        ridx = rng.integers(0, S, size=(B, T, P, W))
    a = rng.uniform(-1, 1, size=(B, T, P, W)) / np.sqrt(W)
    c = rng.normal(size=(B, T, P, W))
    beta = rng.uniform(0.1, 0.9, size=(B, T, P))
    if repeat:
        beta = beta / W  # repeated slots add up in |k|^2
    return Problem(B, T, P, hd, S, W,
                   bank=rng.normal(size=(B * S, D)).astype(dtype),
                   write_idx=widx.astype(index_dtype), write_w=a.astype(wdt),
                   values=rng.normal(size=(B, T, D)).astype(vdt), beta=beta.astype(wdt),
                   read_idx=ridx.astype(index_dtype), read_w=c.astype(wdt))


# powers of ten from a float32 subnormal (1e-44) to 1e30: rows whose absmax / qmax or
# qmax / absmax leaves float32's normal range, and ordinary ones
MAGNITUDE_EXPONENTS = (-44, -40, -38, -37, -36, -30, -12, 0, 12, 30)


def spread_magnitudes(pb: Problem) -> None:
    """Scales bank slot s of every batch element by 10 ** MAGNITUDE_EXPONENTS[s % 10], in place
    (in float64, then rounded to the bank's dtype)."""
    exps = np.array(MAGNITUDE_EXPONENTS)
    mag = 10.0 ** exps[np.arange(pb.bank.shape[0]) % pb.S % exps.size]
    pb.bank[...] = (pb.bank.astype(np.float64) * mag[:, None]).astype(pb.bank.dtype)


# the pre-pass sorts (slot, entry) keys in 32 bits while S <= KEY_LIMIT (2^18 - 1), in 64 above
KEY_LIMIT = KEY32_MAX_S


def near_key_limit(rng, S: int) -> Problem:
    """A small float64 problem whose slots sit next to the pre-pass's 32-bit key limit and
    repeat within and across tokens (262143 and 262144, the first slots whose keys need more
    than 32 bits, where S allows), with beta scaled down as the repeats add up in |k|^2."""
    pb = make_problem(rng, B=1, T=40, P=2, hd=4, S=S, W=4)
    pool = np.array([S - 1, S - 2, KEY_LIMIT - 1, 131072, 5]
                    + ([KEY_LIMIT, KEY_LIMIT + 1] if S > KEY_LIMIT + 1 else []))
    pb.write_idx[...] = rng.choice(pool, size=pb.write_idx.shape)
    pb.read_idx[...] = rng.choice(pool, size=pb.read_idx.shape)
    pb.beta[...] = pb.beta / pb.W
    return pb


def to_numpy(x):
    if hasattr(x, "get"):
        x = x.get()
    return np.asarray(x)


def rel_err(got, want) -> float:
    """Relative RMS error ||got - want|| / ||want|| in float64."""
    got = to_numpy(got).astype(np.float64)
    want = to_numpy(want).astype(np.float64)
    denom = np.sqrt(np.mean(want ** 2))
    return float(np.sqrt(np.mean((got - want) ** 2)) / (denom if denom > 0 else 1.0))


SEED = None   # the rng fixture's seed of the running test


def _log_margin(name, err, rtol):
    """With SDM_TEST_MARGINS=<file>, one line per comparison: its error over its tolerance, the
    test, what was compared and the test's seed (SDM_TEST_SEED reruns it). ``tests/margins.py``
    ranks them: a comparison that uses most of its tolerance fails on some seed."""
    path = os.environ.get("SDM_TEST_MARGINS")
    if path and rtol > 0:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(path, "a") as f:
            f.write(f"{err / rtol:.4g}\t{test}\t{name}\t{SEED}\n")


def assert_close(got, want, rtol, name=""):
    """Relative RMS within ``rtol``, no NaN, with a message naming what was compared."""
    g = to_numpy(got).astype(np.float64)
    w = to_numpy(want).astype(np.float64)
    assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape}"
    assert not np.isnan(g).any(), f"{name}: NaN in result"
    err = rel_err(g, w)
    _log_margin(name, err, rtol)
    maxabs = float(np.max(np.abs(g - w))) if g.size else 0.0
    assert err <= rtol, f"{name}: relative RMS error {err:.3e} > {rtol:.1e} (max abs {maxabs:.3e})"


def reference_fwd(pb: Problem):
    return sdm.reference.forward(pb.bank, *pb.inputs, pb.S, pb.P)


def reference_bwd(pb: Problem, dr, dM=None):
    return sdm.reference.backward(pb.bank, *pb.inputs, pb.S, pb.P, dr, dM)


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the scripts are not a package)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
