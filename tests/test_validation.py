"""Bad input is refused with a clear exception naming the argument, before anything is modified
(SPEC §5, §7), on both backends (the ``xp`` fixture). After every refusal the same arrays still
give the reference result in a good call."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import sdm_cupy as sdm
from helpers import BF16, assert_close, make_problem, reference_bwd, reference_fwd, to_numpy

ARG_NAMES = ("bank", "write_idx", "write_w", "values", "beta", "read_idx", "read_w")
GRAD_NAMES = ("bank", "write_w", "values", "beta", "read_w")
F64_RTOL = 1e-9

# The base problem every bad call is derived from.
B, T, P, HD, S, W = 2, 6, 2, 4, 8, 2
D = P * HD


def base_problem(rng, **kw):
    args = dict(B=B, T=T, P=P, hd=HD, S=S, W=W)
    args.update(kw)
    return make_problem(rng, **args)


def bitwise_equal(a, b) -> bool:
    a, b = to_numpy(a), to_numpy(b)
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                               np.ascontiguousarray(b).view(np.uint8)))


def on(xp, x):
    """NumPy arrays moved to ``xp``; anything else (lists, None, scalars) as it is."""
    return xp.asarray(x) if isinstance(x, np.ndarray) and xp is not np else x


def with_index(a, pos, value):
    a = a.copy()
    a[pos] = value
    return a


def bump(a, axis, by=1):
    """``a`` grown (by > 0) or shrunk (by < 0) along ``axis``."""
    if by < 0:
        sl = [slice(None)] * a.ndim
        sl[axis] = slice(0, a.shape[axis] + by)
        return a[tuple(sl)].copy()
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, by)
    return np.pad(a, pad)


# id -> (overrides of the base call as a function of the problem, exception, match)
BAD_FORWARD = {
    # bank
    "bank-rank-1": (lambda pb: dict(bank=pb.bank.reshape(-1)), ValueError, r"bank.*rank 2"),
    "bank-rank-3": (lambda pb: dict(bank=pb.bank.reshape(B, S, D)), ValueError, r"bank.*rank 2"),
    "bank-rows-fewer-than-B*S": (lambda pb: dict(bank=bump(pb.bank, 0, -1)), ValueError,
                                 r"bank.*B\*S"),
    "bank-rows-more-than-B*S": (lambda pb: dict(bank=bump(pb.bank, 0, S)), ValueError,
                                r"bank.*B\*S"),
    "bank-rows-S-not-B*S": (lambda pb: dict(bank=pb.bank[:S].copy()), ValueError, r"bank.*B\*S"),
    "D-not-divisible-by-P": (lambda pb: dict(bank=bump(pb.bank, 1), values=bump(pb.values, 2)),
                             ValueError, r"bank.*divisible.*num_parallel"),
    "bank-int32": (lambda pb: dict(bank=pb.bank.astype(np.int32)), TypeError, r"bank.*dtype"),
    "bank-complex": (lambda pb: dict(bank=pb.bank.astype(np.complex64)), TypeError,
                     r"bank.*dtype"),
    "bank-bool": (lambda pb: dict(bank=pb.bank > 0), TypeError, r"bank.*dtype"),
    # write_idx: defines B, T, P, W
    "write_idx-rank-3": (lambda pb: dict(write_idx=pb.write_idx[..., 0].copy()), ValueError,
                         r"write_idx.*rank 4"),
    "write_idx-rank-5": (lambda pb: dict(write_idx=pb.write_idx[..., None]), ValueError,
                         r"write_idx.*rank 4"),
    "write_idx-float": (lambda pb: dict(write_idx=pb.write_idx.astype(np.float32)), TypeError,
                        r"write_idx.*integer"),
    "write_idx-uint32": (lambda pb: dict(write_idx=pb.write_idx.astype(np.uint32)), TypeError,
                         r"write_idx.*integer"),
    "write_idx-int16": (lambda pb: dict(write_idx=pb.write_idx.astype(np.int16)), TypeError,
                        r"write_idx.*integer"),
    "write_idx-P-not-num_parallel": (lambda pb: dict(write_idx=bump(pb.write_idx, 2)), ValueError,
                                     r"write_idx.*num_parallel"),
    "write_idx-T0": (lambda pb: dict(write_idx=pb.write_idx[:, :0].copy()), ValueError,
                     r"write_idx.*T >= 1"),
    "write_idx-W0": (lambda pb: dict(write_idx=pb.write_idx[..., :0].copy()), ValueError,
                     r"write_idx.*W >= 1"),
    "write_idx-negative": (lambda pb: dict(write_idx=with_index(pb.write_idx, (1, 3, 1, 0), -1)),
                           ValueError, r"write_idx.*\[0, 8\)"),
    "write_idx-equal-S": (lambda pb: dict(write_idx=with_index(pb.write_idx, (0, 5, 0, 1), S)),
                          ValueError, r"write_idx.*\[0, 8\)"),
    "write_idx-huge-int64": (lambda pb: dict(
        write_idx=with_index(pb.write_idx.astype(np.int64), (0, 0, 0, 0), 2 ** 40),
        read_idx=pb.read_idx.astype(np.int64)), ValueError, r"write_idx.*\[0, 8\)"),
    # read_idx
    "read_idx-T-mismatch": (lambda pb: dict(read_idx=bump(pb.read_idx, 1, -1)), ValueError,
                            r"read_idx.*\[B, T, P, W\]"),
    "read_idx-W-mismatch": (lambda pb: dict(read_idx=bump(pb.read_idx, 3)), ValueError,
                            r"read_idx.*\[B, T, P, W\]"),
    "read_idx-B-mismatch": (lambda pb: dict(read_idx=bump(pb.read_idx, 0)), ValueError,
                            r"read_idx.*\[B, T, P, W\]"),
    "read_idx-rank-3": (lambda pb: dict(read_idx=pb.read_idx[..., 0].copy()), ValueError,
                        r"read_idx.*rank 4"),
    "read_idx-float": (lambda pb: dict(read_idx=pb.read_idx.astype(np.float64)), TypeError,
                       r"read_idx.*integer"),
    "read_idx-negative": (lambda pb: dict(read_idx=with_index(pb.read_idx, (0, 2, 1, 1), -3)),
                          ValueError, r"read_idx.*\[0, 8\)"),
    "read_idx-equal-S": (lambda pb: dict(read_idx=with_index(pb.read_idx, (1, 0, 0, 0), S)),
                         ValueError, r"read_idx.*\[0, 8\)"),
    # write_w / read_w
    "write_w-W-mismatch": (lambda pb: dict(write_w=bump(pb.write_w, 3)), ValueError,
                           r"write_w.*\[B, T, P, W\]"),
    "write_w-B-mismatch": (lambda pb: dict(write_w=bump(pb.write_w, 0)), ValueError,
                           r"write_w.*\[B, T, P, W\]"),
    "write_w-rank-3": (lambda pb: dict(write_w=pb.write_w[..., 0].copy()), ValueError,
                       r"write_w.*rank 4"),
    "write_w-int": (lambda pb: dict(write_w=pb.write_w.astype(np.int64)), TypeError,
                    r"write_w.*float"),
    "read_w-P-mismatch": (lambda pb: dict(read_w=bump(pb.read_w, 2, -1)), ValueError,
                          r"read_w.*\[B, T, P, W\]"),
    "read_w-T-mismatch": (lambda pb: dict(read_w=bump(pb.read_w, 1)), ValueError,
                          r"read_w.*\[B, T, P, W\]"),
    "read_w-int": (lambda pb: dict(read_w=pb.read_w.astype(np.int32)), TypeError,
                   r"read_w.*float"),
    "read_w-rank-5": (lambda pb: dict(read_w=pb.read_w[None]), ValueError, r"read_w.*rank 4"),
    # values
    "values-D-mismatch": (lambda pb: dict(values=bump(pb.values, 2, -1)), ValueError,
                          r"values.*\[B, T, D\]"),
    "values-T-mismatch": (lambda pb: dict(values=bump(pb.values, 1)), ValueError,
                          r"values.*\[B, T, D\]"),
    "values-B-mismatch": (lambda pb: dict(values=bump(pb.values, 0, -1)), ValueError,
                          r"values.*\[B, T, D\]"),
    "values-rank-2": (lambda pb: dict(values=pb.values.reshape(B * T, D)), ValueError,
                      r"values.*rank 3"),
    "values-int": (lambda pb: dict(values=pb.values.astype(np.int32)), TypeError,
                   r"values.*float"),
    # beta
    "beta-rank-2": (lambda pb: dict(beta=pb.beta[..., 0].copy()), ValueError, r"beta.*rank 3"),
    "beta-P-mismatch": (lambda pb: dict(beta=bump(pb.beta, 2)), ValueError,
                        r"beta.*\[B, T, P\]"),
    "beta-int": (lambda pb: dict(beta=pb.beta.astype(np.int8)), TypeError, r"beta.*float"),
    # not arrays
    "bank-None": (lambda pb: dict(bank=None), TypeError, r"bank"),
    "bank-list": (lambda pb: dict(bank=pb.bank.tolist()), TypeError, r"bank"),
    "write_idx-list": (lambda pb: dict(write_idx=pb.write_idx.tolist()), TypeError, r"write_idx"),
    "values-list": (lambda pb: dict(values=pb.values.tolist()), TypeError, r"values"),
    "beta-float": (lambda pb: dict(beta=0.5), TypeError, r"beta"),
    "beta-numpy-scalar": (lambda pb: dict(beta=np.float32(0.5)), TypeError, r"beta"),
    "read_w-tuple": (lambda pb: dict(read_w=tuple(pb.read_w.ravel())), TypeError, r"read_w"),
    "read_idx-None": (lambda pb: dict(read_idx=None), TypeError, r"read_idx"),
    # config
    "config-None": (lambda pb: dict(config=None), TypeError, r"config"),
    "config-dict": (lambda pb: dict(config=dict(num_memory_slots=S, num_parallel=P)), TypeError,
                    r"config"),
    "config-num_parallel-mismatch": (
        lambda pb: dict(config=sdm.SDMConfig(num_memory_slots=S, num_parallel=2 * P)),
        ValueError, r"num_parallel"),
    "config-num_memory_slots-mismatch": (
        lambda pb: dict(config=sdm.SDMConfig(num_memory_slots=S + 1, num_parallel=P)),
        ValueError, r"bank.*B\*S"),
}


def good_config():
    return sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=4)


def call_forward(xp, pb_args, overrides, **kw):
    args = {name: on(xp, a) for name, a in pb_args.items()}
    args.update({k: on(xp, v) for k, v in overrides.items()})
    config = args.pop("config", good_config())
    return sdm.forward(*(args[n] for n in ARG_NAMES), config, **kw)


def problem_args(pb):
    return {name: getattr(pb, name) for name in ARG_NAMES}


def assert_good_call_matches_reference(xp, args, pristine, what):
    """The arrays of a refused call, in a good in-place call, give the reference result."""
    r_ref, M_ref = reference_fwd(pristine)
    dr = np.ones((pristine.B, pristine.T, pristine.P * pristine.hd))
    want = reference_bwd(pristine, dr)
    res = sdm.forward(*(args[n] for n in ARG_NAMES), good_config(), inplace=True)
    assert res.bank is args["bank"]
    assert_close(res.readings, r_ref, F64_RTOL, f"after {what}: readings")
    assert_close(res.bank, M_ref, F64_RTOL, f"after {what}: final bank")
    g = sdm.backward(res.saved, xp.asarray(dr))
    for name, w in zip(GRAD_NAMES, want):
        assert_close(getattr(g, name), w, F64_RTOL, f"after {what}: grad {name}")
    assert bitwise_equal(args["bank"], pristine.bank), f"after {what}: rewound bank"


@pytest.mark.parametrize("case", list(BAD_FORWARD.values()), ids=list(BAD_FORWARD))
def test_bad_forward_input_is_refused_before_anything_changes(xp, rng, case):
    make_overrides, exc, match = case
    pb = base_problem(rng)
    pristine = dataclasses.replace(pb, **{n: getattr(pb, n).copy() for n in ARG_NAMES})
    overrides = make_overrides(pb)
    args = {n: on(xp, a) for n, a in problem_args(pb).items()}
    bad = {k: on(xp, v) for k, v in overrides.items()}
    bad_before = {k: to_numpy(v).copy() for k, v in bad.items() if hasattr(v, "shape")}
    for inplace in (False, True):
        for needs_backward in (True, False):
            with pytest.raises(exc, match=match):
                call_forward(xp, args, bad, inplace=inplace, needs_backward=needs_backward)
            for n in ARG_NAMES:
                assert bitwise_equal(args[n], getattr(pristine, n)), (
                    f"{n} modified by a refused call (inplace={inplace})")
            for k, before in bad_before.items():
                assert bitwise_equal(bad[k], before), f"bad {k} modified by the refused call"
    assert_good_call_matches_reference(xp, args, pristine, "a refused forward")


def test_foreign_arrays_are_refused_with_a_pointer_to_from_dlpack(rng):
    # a torch tensor is not taken implicitly: the message names the argument and the helper
    torch = pytest.importorskip("torch")
    pb = base_problem(rng)
    before = {n: getattr(pb, n).copy() for n in ARG_NAMES}
    for name in ("bank", "values", "read_w"):
        args = {n: getattr(pb, n) for n in ARG_NAMES}
        args[name] = torch.from_numpy(args[name].copy())
        with pytest.raises(TypeError, match=rf"{name}.*from_dlpack"):
            sdm.forward(*(args[n] for n in ARG_NAMES), good_config(), inplace=True)
    for n in ARG_NAMES:
        assert bitwise_equal(getattr(pb, n), before[n])
    # through sdm.from_dlpack the same tensors work, zero-copy
    tensors = {n: torch.from_numpy(getattr(pb, n).copy()) for n in ARG_NAMES}
    views = {n: sdm.from_dlpack(t) for n, t in tensors.items()}
    res = sdm.forward(*(views[n] for n in ARG_NAMES), good_config(), inplace=True)
    _, M_ref = reference_fwd(pb)
    assert res.bank is views["bank"]
    assert_close(tensors["bank"].numpy(), M_ref, F64_RTOL, "torch bank updated in place")


# ----------------------------------------------------------------------------- SDMConfig

BAD_CONFIG = {
    "chunk_size-0": (dict(chunk_size=0), ValueError, r"chunk_size.*>= 1"),
    "chunk_size-negative": (dict(chunk_size=-4), ValueError, r"chunk_size.*>= 1"),
    "chunk_size-float": (dict(chunk_size=2.5), TypeError, r"chunk_size.*int"),
    "chunk_size-bool": (dict(chunk_size=True), TypeError, r"chunk_size.*int"),
    "chunk_size-str": (dict(chunk_size="8"), TypeError, r"chunk_size.*int"),
    "chunk_size-None": (dict(chunk_size=None), TypeError, r"chunk_size.*int"),
    "num_memory_slots-0": (dict(num_memory_slots=0), ValueError, r"num_memory_slots.*>= 1"),
    "num_memory_slots-float": (dict(num_memory_slots=8.0), TypeError, r"num_memory_slots.*int"),
    "num_parallel-0": (dict(num_parallel=0), ValueError, r"num_parallel.*>= 1"),
    "num_parallel-negative": (dict(num_parallel=-1), ValueError, r"num_parallel.*>= 1"),
    "snapshot_quant-unknown": (dict(snapshot_quant="fp4"), sdm.UnsupportedConfigurationError,
                               r"snapshot_quant.*'fp4'"),
    "snapshot_quant-wrong-case": (dict(snapshot_quant="BF16"), sdm.UnsupportedConfigurationError,
                                  r"snapshot_quant"),
    "snapshot_quant-empty": (dict(snapshot_quant=""), sdm.UnsupportedConfigurationError,
                             r"snapshot_quant"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIG.values()), ids=list(BAD_CONFIG))
def test_bad_config_is_refused(case):
    changes, exc, match = case
    kw = dict(num_memory_slots=S, num_parallel=P, chunk_size=4)
    kw.update(changes)
    with pytest.raises(exc, match=match):
        sdm.SDMConfig(**kw)
    # dataclasses.replace re-validates too
    with pytest.raises(exc, match=match):
        dataclasses.replace(good_config(), **changes)


def test_unsupported_configuration_error_is_a_value_error():
    assert issubclass(sdm.UnsupportedConfigurationError, ValueError)
    with pytest.raises(ValueError, match="snapshot_quant"):
        sdm.SDMConfig(num_memory_slots=S, num_parallel=P, snapshot_quant="int4")


def test_good_config_normalises_and_is_frozen():
    cfg = sdm.SDMConfig(num_memory_slots=np.int64(S), num_parallel=np.int32(P),
                        chunk_size=np.int16(4), grad_bank_fp32=0)
    assert (cfg.num_memory_slots, cfg.num_parallel, cfg.chunk_size) == (S, P, 4)
    assert all(type(v) is int for v in (cfg.num_memory_slots, cfg.num_parallel, cfg.chunk_size))
    assert cfg.grad_bank_fp32 is False
    assert cfg.snapshot_quant is None and sdm.SDMConfig(1, 1).chunk_size == 64
    for mode in sdm.SNAPSHOT_QUANT_MODES:
        assert sdm.SDMConfig(S, P, snapshot_quant=mode).snapshot_quant == mode
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 8


# ----------------------------------------------------------------------------- snapshot_quant

# (bank dtype, hd, mode): modes that would not shrink a snapshot row of that bank
NO_SHRINK = {
    "bf16-on-bf16-bank": (BF16, 8, "bf16"),
    "bf16-on-f16-bank": (np.float16, 8, "bf16"),
    "int8-f32-bank-hd1": (np.float32, 1, "int8"),          # 1 + 4 scale bytes >= 4
    "int8-bf16-bank-hd4": (BF16, 4, "int8"),               # 4 + 4 >= 8
    "fp8_e4m3-bf16-bank-hd4": (BF16, 4, "fp8_e4m3"),
    "fp8_e4m3-f16-bank-hd2": (np.float16, 2, "fp8_e4m3"),
}


@pytest.mark.parametrize("case", list(NO_SHRINK.values()), ids=list(NO_SHRINK))
def test_quant_mode_that_does_not_shrink_is_refused_only_for_backward(xp, rng, case):
    bank_dt, hd, mode = case
    pb = base_problem(rng, hd=hd, dtype=bank_dt)
    cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=4, snapshot_quant=mode)
    r_ref, M_ref = reference_fwd(pb)
    x = pb.to(xp)
    before = {n: to_numpy(getattr(x, n)).copy() for n in ARG_NAMES}
    for inplace in (False, True):
        with pytest.raises(sdm.UnsupportedConfigurationError, match=rf"snapshot_quant.*{mode}"):
            sdm.forward(x.bank, *x.inputs, cfg, needs_backward=True, inplace=inplace)
        for n in ARG_NAMES:
            assert bitwise_equal(getattr(x, n), before[n]), f"{n} modified by a refusal"
    # without a backward no snapshot is saved: the same config is fine
    res = sdm.forward(x.bank, *x.inputs, cfg, needs_backward=False)
    assert res.saved is None
    assert_close(res.readings, r_ref, 3e-2, "readings with needs_backward=False")
    assert_close(res.bank, M_ref, 3e-2, "final bank with needs_backward=False")
    # and the arrays of the refused call still serve an exact-snapshot forward + backward
    res = sdm.forward(x.bank, *x.inputs, dataclasses.replace(cfg, snapshot_quant=None),
                      inplace=True)
    sdm.backward(res.saved, xp.ones_like(res.readings))
    assert bitwise_equal(x.bank, before["bank"]), "rewound bank after the refusal"


# ----------------------------------------------------------------------------- backward

BAD_BACKWARD = {
    "grad_readings-D-mismatch": (lambda pb: dict(grad_readings=np.ones((B, T, D + 1))),
                                 ValueError, r"grad_readings.*\[B, T, D\]"),
    "grad_readings-T-mismatch": (lambda pb: dict(grad_readings=np.ones((B, T - 1, D))),
                                 ValueError, r"grad_readings.*\[B, T, D\]"),
    "grad_readings-rank-2": (lambda pb: dict(grad_readings=np.ones((B * T, D))), ValueError,
                             r"grad_readings.*rank 3"),
    "grad_readings-int": (lambda pb: dict(grad_readings=np.ones((B, T, D), np.int32)),
                          TypeError, r"grad_readings.*float"),
    "grad_readings-list": (lambda pb: dict(grad_readings=np.ones((B, T, D)).tolist()),
                           TypeError, r"grad_readings"),
    "grad_readings-None": (lambda pb: dict(grad_readings=None), TypeError, r"grad_readings"),
    "grad_bank-rows-mismatch": (lambda pb: dict(grad_bank=np.ones((B * S - 1, D))), ValueError,
                                r"grad_bank.*\[B\*S, D\]"),
    "grad_bank-transposed": (lambda pb: dict(grad_bank=np.ones((D, B * S))), ValueError,
                             r"grad_bank.*\[B\*S, D\]"),
    "grad_bank-rank-3": (lambda pb: dict(grad_bank=np.ones((B, S, D))), ValueError,
                         r"grad_bank.*rank 2"),
    "grad_bank-int": (lambda pb: dict(grad_bank=np.ones((B * S, D), np.int64)), TypeError,
                      r"grad_bank.*float"),
    "grad_bank-list": (lambda pb: dict(grad_bank=np.ones((B * S, D)).tolist()), TypeError,
                       r"grad_bank"),
    "saved-None": (lambda pb: dict(saved=None), TypeError, r"saved"),
    "saved-ForwardResult": (lambda pb: dict(saved="result"), TypeError, r"saved"),
}


@pytest.mark.parametrize("case", list(BAD_BACKWARD.values()), ids=list(BAD_BACKWARD))
def test_bad_backward_input_is_refused_before_anything_changes(xp, rng, case):
    make_overrides, exc, match = case
    pb = base_problem(rng)
    x = pb.to(xp)
    initial = to_numpy(x.bank).copy()
    res = sdm.forward(x.bank, *x.inputs, good_config())
    final = to_numpy(res.bank).copy()
    dr = rng.normal(size=(B, T, D))
    dM = rng.normal(size=(B * S, D))
    kw = dict(saved=res.saved, grad_readings=xp.asarray(dr), grad_bank=xp.asarray(dM))
    bad = make_overrides(pb)
    if bad.get("saved") == "result":
        bad["saved"] = res
    kw.update({k: on(xp, v) for k, v in bad.items()})
    with pytest.raises(exc, match=match):
        sdm.backward(kw["saved"], kw["grad_readings"], kw["grad_bank"])
    assert not res.saved.consumed, "a refused backward must not consume the saved state"
    assert bitwise_equal(res.bank, final), "a refused backward modified the bank"
    # the saved state still gives the reference gradients and the exact rewind
    g = sdm.backward(res.saved, xp.asarray(dr), xp.asarray(dM))
    for name, w in zip(GRAD_NAMES, reference_bwd(pb, dr, dM)):
        assert_close(getattr(g, name), w, F64_RTOL, f"after a refused backward: grad {name}")
    assert bitwise_equal(res.bank, initial), "rewound bank after a refused backward"


# ----------------------------------------------------------------------------- batch expansion

BAD_EXPAND = {
    "param-rank-1": (lambda: (np.ones(8), 2), ValueError, r"param.*rank 2"),
    "param-rank-3": (lambda: (np.ones((2, 3, 4)), 2), ValueError, r"param.*rank 2"),
    "param-int": (lambda: (np.ones((3, 4), np.int32), 2), TypeError, r"param.*float"),
    "param-list": (lambda: ([[1.0, 2.0]], 2), TypeError, r"param"),
    "batch-0": (lambda: (np.ones((3, 4)), 0), ValueError, r"batch"),
    "batch-float": (lambda: (np.ones((3, 4)), 1.5), ValueError, r"batch"),
    "batch-bool": (lambda: (np.ones((3, 4)), True), ValueError, r"batch"),
}
BAD_SUM = {
    "grad_bank-rank-1": (lambda: (np.ones(8), 2), ValueError, r"grad_bank.*rank 2"),
    "grad_bank-int": (lambda: (np.ones((6, 4), np.int64), 3), TypeError, r"grad_bank.*float"),
    "grad_bank-list": (lambda: ([[1.0]], 1), TypeError, r"grad_bank"),
    "rows-not-a-multiple-of-S": (lambda: (np.ones((7, 4)), 3), ValueError, r"num_memory_slots"),
    "S-0": (lambda: (np.ones((6, 4)), 0), ValueError, r"num_memory_slots"),
}


@pytest.mark.parametrize("case", list(BAD_EXPAND.values()), ids=list(BAD_EXPAND))
def test_bad_expand_memory_batch(xp, case):
    make, exc, match = case
    param, batch = make()
    with pytest.raises(exc, match=match):
        sdm.expand_memory_batch(on(xp, param), batch)


@pytest.mark.parametrize("case", list(BAD_SUM.values()), ids=list(BAD_SUM))
def test_bad_sum_memory_batch(xp, case):
    make, exc, match = case
    grad, S_ = make()
    with pytest.raises(exc, match=match):
        sdm.sum_memory_batch(on(xp, grad), S_)


# ----------------------------------------------------------------------------- mixing (GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("name", ARG_NAMES)
def test_mixing_numpy_and_cupy_is_a_type_error(rng, name):
    import cupy
    pb = base_problem(rng)
    x = pb.to(cupy)
    args = {n: getattr(x, n) for n in ARG_NAMES}
    args[name] = getattr(pb, name)          # one NumPy array among CuPy ones
    before = {n: to_numpy(a).copy() for n, a in args.items()}
    for inplace in (False, True):
        with pytest.raises(TypeError, match=name):
            sdm.forward(*(args[n] for n in ARG_NAMES), good_config(), inplace=inplace)
        for n in ARG_NAMES:
            assert bitwise_equal(args[n], before[n]), f"{n} modified by a refused call"
    pristine = dataclasses.replace(pb, **{n: before[n] for n in ARG_NAMES})
    assert_good_call_matches_reference(cupy, {n: getattr(x, n) for n in ARG_NAMES}, pristine,
                                       f"a refused mixed call ({name} on the host)")


@pytest.mark.gpu
def test_backward_with_host_gradients_of_a_device_forward_is_a_type_error(rng):
    import cupy
    pb = base_problem(rng)
    x = pb.to(cupy)
    res = sdm.forward(x.bank, *x.inputs, good_config())
    final = to_numpy(res.bank).copy()
    with pytest.raises(TypeError, match="grad_readings"):
        sdm.backward(res.saved, np.ones((B, T, D)))
    with pytest.raises(TypeError, match="grad_bank"):
        sdm.backward(res.saved, cupy.ones((B, T, D)), np.ones((B * S, D)))
    assert not res.saved.consumed and bitwise_equal(res.bank, final)
    sdm.backward(res.saved, cupy.ones((B, T, D)))
    assert bitwise_equal(res.bank, pb.bank)


def test_inplace_needs_a_c_contiguous_bank(xp, rng):
    pb = base_problem(rng)
    x = pb.to(xp)
    fbank = xp.asfortranarray(x.bank)
    before = to_numpy(fbank).copy()
    with pytest.raises(ValueError, match="bank.*C-contiguous"):
        sdm.forward(fbank, *x.inputs, good_config(), inplace=True)
    assert bitwise_equal(fbank, before)
    # the same bank without inplace is fine
    _, M_ref = reference_fwd(pb)
    res = sdm.forward(fbank, *x.inputs, good_config(), inplace=False)
    assert_close(res.bank, M_ref, F64_RTOL, "final bank from a Fortran-order bank")
    assert bitwise_equal(fbank, before)


# ----------------------------------------------------------------------------- check_indices=False

UNCHECKED = {
    "write_idx-minus-1": ("write_idx", (0, 1, 0, 1), -1),
    "write_idx-equal-S": ("write_idx", (1, 4, 1, 0), S),
    "write_idx-huge": ("write_idx", (1, 2, 0, 0), 2 ** 31 - 1),
    "read_idx-minus-1": ("read_idx", (0, 0, 1, 0), -1),
    "read_idx-equal-S": ("read_idx", (1, 5, 1, 1), S),
    "read_idx-very-negative": ("read_idx", (1, 3, 0, 1), -(2 ** 31)),
}


@pytest.mark.parametrize("case", list(UNCHECKED.values()), ids=list(UNCHECKED))
def test_unchecked_bad_ids_are_skipped_and_reported(xp, rng, case):
    # check_indices=False skips the API's range check, never the kernels' safety: an id outside
    # [0, S) is skipped (weight 0) and reported (CPU: ValueError after the call; GPU: the
    # device flag that sdm.check_device_errors() raises). The bank is a view into a buffer
    # with guard rows on both sides: an out-of-bounds write would land there.
    name, pos, bad_id = case
    pb = base_problem(rng)
    idx = getattr(pb, name).copy()
    idx[pos] = bad_id
    weights = "write_w" if name == "write_idx" else "read_w"
    # what the op must compute: the bad entry contributes nothing (weight 0, any valid id)
    skipped = dataclasses.replace(pb, **{name: with_index(idx, pos, 0),
                                         weights: with_index(getattr(pb, weights), pos, 0.0)})
    r_ref, M_ref = reference_fwd(skipped)
    guard = np.full((3, D), 12345.0)
    buf = xp.asarray(np.concatenate([guard, pb.bank, guard]))
    bank = buf[3:-3]
    assert bank.flags.c_contiguous
    args = {n: on(xp, getattr(pb, n)) for n in ARG_NAMES}
    args["bank"], args[name] = bank, on(xp, idx)
    if xp is not np:
        try:                                  # a clean flag before the call
            sdm.check_device_errors(reset=True)
        except ValueError:
            pass
    try:
        res = sdm.forward(*(args[n] for n in ARG_NAMES), good_config(), needs_backward=False,
                          inplace=True, check_indices=False)
        reported = None
    except ValueError as exc:
        res, reported = None, exc
    if reported is None:
        with pytest.raises(ValueError, match=rf"{name}.*\[0, "):
            sdm.check_device_errors()
        sdm.check_device_errors()           # reset by the previous check
        assert_close(res.readings, r_ref, F64_RTOL, "readings with the bad id skipped")
    else:
        assert name in str(reported), f"the report names {name}: {reported}"
    host = to_numpy(buf)
    assert np.all(host[:3] == 12345.0) and np.all(host[-3:] == 12345.0), (
        "an out-of-range id wrote outside the bank")
    assert_close(host[3:-3], M_ref, F64_RTOL, "bank updated with the bad id skipped")


def test_inplace_needs_a_writeable_bank_cpu(rng):
    pb = base_problem(rng)
    bank = pb.bank.copy()
    bank.flags.writeable = False
    with pytest.raises(ValueError, match="bank.*writeable"):
        sdm.forward(bank, *pb.inputs, good_config(), inplace=True)
    assert bitwise_equal(bank, pb.bank)
    _, M_ref = reference_fwd(pb)
    res = sdm.forward(bank, *pb.inputs, good_config(), inplace=False)
    assert_close(res.bank, M_ref, F64_RTOL, "final bank from a read-only bank")


# ----------------------------------------------------------------------------- the range check itself

@pytest.mark.parametrize("dtypes", [(np.int32, np.int32), (np.int32, np.int64), (np.int64, np.int32)],
                         ids=["i32-i32", "i32-i64", "i64-i32"])
def test_index_range_check_names_the_first_bad_array(xp, rng, dtypes):
    """``check_index_ranges`` (on CuPy one elementwise pass over both arrays, one host sync) raises
    exactly when an id lies outside [0, S), naming write_idx before read_idx, for every dtype
    pair, contiguous or strided, at both edges of the range, and changes neither array."""
    from sdm_cupy import _validate as V
    n_slots = 1000
    shape = (3, 17, 2, 5)
    ids_w = rng.integers(0, n_slots, size=shape).astype(dtypes[0])
    ids_r = rng.integers(0, n_slots, size=shape).astype(dtypes[1])
    ids_w[0, 0, 0, 0], ids_r[2, 16, 1, 4] = 0, n_slots - 1     # both edges, allowed
    big = 2 ** 40 if dtypes[1] == np.int64 else 2 ** 31 - 1
    cases = [(None, None, None),
             ("write_idx", (1, 3, 0, 2), -1), ("write_idx", (2, 16, 1, 4), n_slots),
             ("read_idx", (0, 9, 1, 0), n_slots), ("read_idx", (1, 0, 0, 0), big),
             ("read_idx", (2, 5, 1, 3), np.iinfo(dtypes[1]).min),
             ("both", (0, 1, 1, 1), -7)]
    for strided in (False, True):
        for which, pos, bad in cases:
            w, r = ids_w.copy(), ids_r.copy()
            if which in ("write_idx", "both"):
                w[pos] = bad
            if which in ("read_idx", "both"):
                r[pos] = bad
            if strided:   # the same ids seen through views of buffers twice as wide
                wd = xp.asarray(np.concatenate([w, w], axis=3))[:, :, :, :5]
                rd = xp.asarray(np.concatenate([r, r], axis=3))[:, :, :, :5]
                assert not wd.flags.c_contiguous
            else:
                wd, rd = xp.asarray(w), xp.asarray(r)
            before = (to_numpy(wd).copy(), to_numpy(rd).copy())
            if which is None:
                V.check_index_ranges(n_slots, ("write_idx", wd), ("read_idx", rd))
            else:
                name = "write_idx" if which == "both" else which
                with pytest.raises(ValueError, match=rf"^{name} values must lie in .*\[0, {n_slots}\)"):
                    V.check_index_ranges(n_slots, ("write_idx", wd), ("read_idx", rd))
            assert np.array_equal(to_numpy(wd), before[0]) and np.array_equal(to_numpy(rd), before[1])
