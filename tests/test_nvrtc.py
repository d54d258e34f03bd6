"""Every CUDA kernel instance of the GPU backend compiles for sm_90 with NVRTC (no GPU needed).

Uses NVRTC from ``cuda-bindings`` (``_build.nvrtc_compile``) with the very sources, options
and name expressions that ``sdm_cupy.kernels._build.module_specs()`` hands to
``cupy.RawModule`` (plus the ``-arch`` and ``-ftz=true`` that CuPy adds itself): one NVRTC
program per module, as the backend builds them, compiled in parallel processes (one per core).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import re

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

import early  # noqa: E402
from sdm_cupy.kernels import _build  # noqa: E402

pytestmark = pytest.mark.nvrtc


def _bench_module(name: str):
    """benchmarks/<name>.py imported by path (with benchmarks/ on sys.path meanwhile, for its
    own imports of its neighbours)."""
    import importlib.util
    import sys
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "benchmarks")
    sys.path.insert(0, bench)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(bench, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(bench)
    return mod


def _per_source():
    merged = {}
    for src, text, opts, names in _build.module_specs():
        entry = merged.setdefault(src, (text, opts, []))
        entry[2].extend(n for n in names if n not in entry[2])
    return merged


def test_every_instance_is_listed():
    specs = _per_source()
    assert set(specs) == set(_build.SOURCES)
    # 9 (bank, values) kinds x 2 index dtypes, each with its snapshot modes, the forward's
    # read-row stage (RS = 1) for the exact and bf16 modes, and its sub-chunk snapshots
    # (SUB = 1) for the exact mode, with and without the stage
    args = [n.split("<", 1)[1].rstrip(">").split(",") for n in specs["fwd"][2]]
    staged = [a for a in args if a[6:7] == ["1"] and a[7:] in ([], ["0"])]
    sub = [a for a in args if a[7:] == ["1"]]
    assert len(args) - len(staged) - len(sub) == 60 and len(staged) == 24 and len(sub) == 36
    assert all(a[4] in ("0", "1") for a in staged)   # Q <= 1
    assert all(a[4] == "0" for a in sub) and sorted({a[6] for a in sub}) == ["0", "1"]
    # the backward's modes per grad dtype, and its dM stage (DS = 1) for exact snapshots
    dms = [n for n in specs["bwd"][2] if n.endswith(",1>")]
    assert len(specs["bwd"][2]) - len(dms) == 84 and len(dms) == 26
    assert all(n.split(",")[5] == "0" for n in dms)   # Q == 0
    # the forward's and the backward's forms, each with 32-bit and with 64-bit sort keys
    assert len(specs["prepass"][2]) == 16
    assert sum(n.count(",") == 3 and n.endswith(",1>") for n in specs["prepass"][2]) == 8


def test_prepass_key_limit_matches_the_kernel():
    """The launcher's KEY32_MAX_S (which instance it takes) is the kernel's: 2^(32 - QBITS) - 1."""
    text = _build.source("prepass")
    qbits = int(re.search(r"constexpr int QBITS = (\d+);", text).group(1))
    assert "KEY32_MAX_S = (1ll << (32 - QBITS)) - 1;" in text
    assert _build.KEY32_MAX_S == (1 << (32 - qbits)) - 1 == 262143


def test_headers_are_found():
    d = _build.include_dir()
    for h in ("cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h"):
        assert os.path.isfile(os.path.join(d, h)), h


def _compile_all() -> None:
    """The child process of test_all_kernels_compile_for_sm90: every module of
    ``_build.module_specs()`` through NVRTC, one process per core, biggest first (so that the
    pool ends evenly); one JSON line per module on stdout: source, first name, how many names
    it asked for and got lowered, the cubin's size, whether the whole log has a
    warning, and the log's start."""
    specs = _build.module_specs()
    specs.sort(key=lambda s: -len(s[3]) * (2 if s[0] == "bwd" else 1))
    workers = max(1, min(len(specs), os.cpu_count() or 1))
    # fresh interpreters, not forks (safe whatever threads the calling process holds)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [(src, names, pool.submit(_build.nvrtc_compile, src, text, opts, names))
                   for src, text, opts, names in specs]
        for src, names, fut in futures:
            log, lowered, cubin = fut.result()
            print(json.dumps({"src": src, "first": names[0], "names": len(names),
                              "lowered": len(lowered), "cubin": len(cubin),
                              "warning": "warning" in log.lower(), "log": log[:3000]}),
                  flush=True)


def _compile_all_cmd():
    return early.python_call("test_nvrtc", "_compile_all()")


def _start_compile_all():
    return {"nvrtc-all": early.Child(_compile_all_cmd())}


def test_all_kernels_compile_for_sm90():
    """Every module the backend builds compiles for sm_90 without a warning and lowers every
    name it asks for. A child process compiles them (one NVRTC process per core); in a plain
    pytest run it starts right after collection and runs beside the other tests
    (tests/early.py), since it takes minutes on a 2-core CI machine."""
    r = early.take("nvrtc-all", _compile_all_cmd()).wait(timeout=2400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    want = _build.module_specs()
    assert sorted((m["src"], m["first"], m["names"]) for m in got) == \
        sorted((src, names[0], len(names)) for src, _, _, names in want)
    for m in got:
        assert m["lowered"] == m["names"], m
        assert m["cubin"] > 0, m
        assert not m["warning"], f"{m['src']} {m['first']}: {m['log']}"


# Long children their tests start right after collection (conftest.py, tests/early.py)
EARLY = {"test_all_kernels_compile_for_sm90": _start_compile_all}


def _compiles_cleanly(src: str, key: tuple, *macros: str) -> None:
    """The module of (src, key) with extra compile-time options lowers every name, gives a
    cubin and no warning (sm_90)."""
    names = _build._names(src, key)
    log, lowered, cubin = _build.nvrtc_compile(src, _build.source(src),
                                               (*_build.options(), *macros), names)
    assert len(lowered) == len(names) and len(cubin) > 0
    assert "warning" not in log.lower(), log[:3000]


def test_forward_compiles_for_sm75_without_cp_async():
    """Before sm_80 the forward stages its next chunk with plain copies (no cp.async): that
    branch of sdm_fwd.cu and the sparse pre-pass compile too (one dtype key each)."""
    key = (_build.BFLOAT16, _build.BFLOAT16, _build.I32)
    for src, k in (("fwd", key), ("prepass", (_build.F32, _build.I32))):
        names = _build._names(src, k)
        log, lowered, cubin = _build.nvrtc_compile(src, _build.source(src), _build.options(),
                                                   names, arch="sm_75")
        assert len(lowered) == len(names) and len(cubin) > 0
        assert "warning" not in log.lower(), log[:3000]


def test_forward_cluster_experiment_compiles_for_sm90():
    """The forward's compile-time experiment (-DSDM_FWD_CLUSTER=8: the 8 column tiles of a
    (b, p) share their row gathers through distributed shared memory; benchmarks/fwd_ab.py
    only) still compiles, for the bf16 instances it was measured with."""
    _compiles_cleanly("fwd", (_build.BFLOAT16, _build.BFLOAT16, _build.I32),
                      "-DSDM_FWD_CLUSTER=8")


@pytest.mark.parametrize("macro", ["-DSDM_PREPASS_KEY64", "-DSDM_PREPASS_SORT_WRITES",
                                   "-DSDM_PREPASS_BOTH_BODIES"])
def test_prepass_variants_compile_for_sm90(macro):
    """-DSDM_PREPASS_KEY64 (the pre-pass sorts 64-bit keys whatever S is) and
    -DSDM_PREPASS_SORT_WRITES (both forms sort their slots instead of hashing them) and
    -DSDM_PREPASS_BOTH_BODIES (each instance holds both key widths' bodies, the form before
    stop 32); the bitwise compile-time-variant GPU test compares them with the default."""
    for key in _build.module_keys("prepass"):
        _compiles_cleanly("prepass", key, macro)


@pytest.mark.parametrize("macros", [("-DSDM_BWD_SOLO",),
                                    ("-DSDM_BWD_SOLO", "-DSDM_BWD_SOLO_READS=1")],
                         ids=["solo", "solo_reads_in_round_2"])
def test_backward_solo_forms_compile_for_sm90(macros):
    """The backward's solo-entry forms (benchmarks/solo_ab.sh; the emulator and GPU tests
    compare them bit for bit with the default build) compile without a warning, for the
    headline's module (bfloat16 bank and values, int32 ids: every grad and snapshot mode)."""
    _compiles_cleanly("bwd", (_build.BFLOAT16, _build.BFLOAT16, _build.I32), *macros)


@pytest.mark.parametrize("case", [(4, 32, 0, 512, 1), (4, 16, 1, 256, 2)])
def test_owner_ceiling_skeleton_compiles_for_sm90(case):
    """benchmarks/owner_ceiling.py's timing skeleton (slot-owning clusters, stop 18) still
    compiles without a warning, in both of its forms (PIPE 0 and 1), with the options and
    shared memory its launcher uses."""
    mod = _bench_module("owner_ceiling")
    K, C, pipe, nt, minb = case
    assert case in mod.CASES
    cap, opts = mod.options(K, C, 16, pipe, nt, minb)
    assert mod.smem_bytes(K, C, 16, cap, pipe) <= 227 * 1024
    log, _, cubin = _build.nvrtc_compile("owner", _build.inline_header(mod.SRC), opts, [])
    assert len(cubin) > 0
    assert "warning" not in log.lower(), log[:3000]


def test_staged_forward_instance_holds_its_fast_path_alone():
    """The forward's RS = 1 instances compile only the fast path (kernels/sdm_fwd.cu's FIX):
    at the headline's key the staged instance is far smaller than the RS = 0 one that keeps
    every path, and does not spill (stop 19: 6,808 against 8,824 instructions, 4/4 bytes;
    the smaller code ran 5.9% faster; stop 33, with kept rows and no fusion as compile-time
    facts there and the X/Y loop on words and pointers: 4,424, 0/0). benchmarks/code_size.py
    reads the instructions from the cubin and the spills from ptxas -v."""
    import ml_dtypes
    import numpy as np
    mod = _bench_module("code_size")
    bf16, i32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.int32)
    names = [_build.fwd_name(bf16, bf16, i32, 0, rs) for rs in (0, 1)]
    got = mod.sizes("fwd", _build.source("fwd"), _build.options(), names)
    (n0, r0, _, _), (n1, r1, st1, ld1) = got[names[0]], got[names[1]]
    assert n0 > 1000 and 0 < r0 <= 128 and 0 < r1 <= 128, got
    assert n1 < 0.6 * n0, got
    assert st1 == 0 and ld1 == 0, got
