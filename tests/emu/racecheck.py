"""Data races inside a block, found by ThreadSanitizer on the emulated kernels.

The kernels are built with -fsanitize=thread (SDM_EMU_TSAN=1): every CUDA thread of a block is
a TSan fiber, barriers order memory and nothing else does (tests/emu/sdm_emu.h). A child
process per case runs gpu.sdm_fwd then gpu.sdm_bwd under libtsan; the reports are reduced to
their pairs of kernel source lines, and each pair is compared with KNOWN below: races that are
there by design, each with the reason it is harmless on the GPU. A pair not in KNOWN fails
the run (exit status 1).

    python tests/emu/racecheck.py   # the cases of CASES; up to 2 min a case, cold build cache
    SDM_RACECHECK_MACROS="-DSDM_FWD_PIPE" SDM_RACECHECK_KNOBS="BWD_DM_STAGE=0" python ...
                                    # a compile-time variant, with gpu knobs set

TSan sees only the interleavings that the emulator runs, and only pairs of accesses that no
barrier orders; it cannot tell a harmless same-value store from a harmful one, hence KNOWN."""

from __future__ import annotations

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, TESTS)

import emu  # noqa: E402

# Harmless races, by the source text of the two accesses' lines (whitespace removed; a
# pair matches in either order), so that the list survives code moving around:
# (file, text of one line, text of the other) -> why the race is harmless
_REWIND_GROUPED = "if(okk[k])store_raw<N>(bank_b+(longlong)idk[k]*D+cc,raw,N,true);"
_REWIND = "if(ok)store_raw<N>(bank_b+(longlong)id*D+cc,raw,nv,F||vb);"
_LINK_WALK = "for(intm=tab_top[h];m>=0&&m!=0xFFFF;m=pos[m]&0xFFFF){"
_LINK_WALK_LAST = "for(intm=tab_top[h];m>=0&&m!=0xFFFF;m=pos[m]&0xFFFF)"
KNOWN = {
    # the backward's rewind: two entries of one token with the same slot both store their
    # snapshot piece; both hold the row as it was before that token, so the stores agree
    ("sdm_bwd.cu", _REWIND, _REWIND): "rewind: same-slot entries of a token store equal rows",
    ("sdm_bwd.cu", _REWIND_GROUPED, _REWIND_GROUPED): "rewind (grouped loads): equal rows",
    ("sdm_bwd.cu", _REWIND_GROUPED, _REWIND): "rewind: the grouped and the plain loop, equal rows",
    # the pre-pass's slot lists: a thread rewrites bits 16-31 of its own word pos[i] while
    # other threads walk the list links in bits 0-15 of the same word; a 4-byte aligned store
    # is one access on the GPU and leaves the link bits as they were (the kernel's comment)
    ("sdm_prepass.cu", _LINK_WALK, "pos[i]=((link+1)<<16)|(code&0xFFFF);"):
        "pre-pass list links: upper bits rewritten",
    ("sdm_prepass.cu", _LINK_WALK, "pos[i]=((bad?0:prev+1)<<16)|(code&0xFFFF);"):
        "pre-pass list links: upper bits rewritten",
    ("sdm_prepass.cu", "pos[i]=((bad?0:prev+1)<<16)|(code&0xFFFF);", _LINK_WALK_LAST):
        "pre-pass list links: upper bits rewritten",
}


def _text(site: str) -> tuple:
    """'sdm_bwd.cu:662' -> ('sdm_bwd.cu', that line's text without whitespace)."""
    f, _, line = site.rpartition(":")
    d = os.environ.get("SDM_EMU_KERNELS") or os.path.join(os.path.dirname(TESTS), "kernels")
    try:
        with open(os.path.join(d, f)) as fh:
            text = fh.read().split("\n")[int(line) - 1]
    except (OSError, ValueError, IndexError):
        return f, site
    return f, "".join(text.split())


def known(pair) -> str | None:
    (fa, ta), (fb, tb) = (_text(x) for x in pair)
    if fa != fb:
        return None
    return KNOWN.get((fa, ta, tb)) or KNOWN.get((fa, tb, ta))

CASES = [   # (dtype, chunk, B, T, P, hd, S, W): S small so that slots repeat
    ("f32", 16, 1, 40, 2, 32, 12, 5),
    ("bf16", 64, 1, 70, 2, 32, 12, 5),
    ("f64", 1, 1, 9, 2, 16, 12, 5),
]

# a compile-time variant and gpu knobs for every case (benchmark macros, plan choices):
#   SDM_RACECHECK_MACROS="-DSDM_FWD_PIPE -DSDM_BWD_PIPE" SDM_RACECHECK_KNOBS="BWD_DM_STAGE=0"
MACROS = tuple(os.environ.get("SDM_RACECHECK_MACROS", "").split())
KNOBS = {k: bool(int(v)) if v in ("0", "1") else int(v)
         for k, _, v in (x.partition("=") for x in os.environ.get("SDM_RACECHECK_KNOBS", "").split(","))
         if k}

CHILD = r"""
import sys
sys.path.insert(0, {tests!r})
import numpy as np, pytest, emu, sdm_cupy as sdm
from sdm_cupy.kernels import gpu
from helpers import make_problem, BF16
dt = {{"f32": np.float32, "bf16": BF16, "f64": np.float64}}[{dt!r}]
mp = pytest.MonkeyPatch(); emu.patch(mp, seed=3, macros={macros!r})
for k, v in {knobs!r}.items():
    mp.setattr(gpu, k, v)
rng = np.random.default_rng(0)
pb = make_problem(rng, B={B}, T={T}, P={P}, hd={hd}, S={S}, W={W}, dtype=dt)
cfg = sdm.SDMConfig(num_memory_slots=pb.S, num_parallel=pb.P, chunk_size={C})
lay = sdm._validate.layout(pb.bank, *pb.inputs, cfg)
bank = pb.bank.copy()
r, snaps = gpu.sdm_fwd(lay, cfg, bank, *pb.inputs, save_snapshots=True)
g = gpu.sdm_bwd(lay, cfg, bank, pb.inputs, snaps, rng.normal(size=pb.values.shape).astype(dt), None)
assert np.array_equal(bank.view(np.uint8), pb.bank.view(np.uint8)), "rewound bank"
print("CHILD DONE")
"""

FRAME = re.compile(r"#\d+ .*?(?:(\S+\.cuh?):(\d+)|\((\S+\.so)\+(0x[0-9a-f]+)\))")
ACCESS = re.compile(r"(?:Write|Read|Atomic \w+|Previous \w+(?: \w+)?) of size \d+")


def _lines(m) -> list:
    """file:line of a frame, innermost first (addr2line -i for the frames TSan left bare)."""
    if m.group(1):
        return [f"{os.path.basename(m.group(1))}:{m.group(2)}"]
    so = m.group(3)
    if not os.path.isabs(so):
        so = os.path.join(emu.cache_dir(), so)
    out = subprocess.run(["addr2line", "-i", "-e", so, m.group(4)], capture_output=True,
                         text=True).stdout.split("\n")
    res = []
    for ln in out:
        f, _, line = ln.strip().rpartition(":")
        if f and f != "??":
            res.append(f"{os.path.basename(f)}:{line.split()[0]}")
    return res or [f"{os.path.basename(so)}+{m.group(4)}"]


def _site(section: str) -> str:
    """An access's place: the first kernel-source (.cu) line of its stack."""
    lines = [x for m in FRAME.finditer(section) for x in _lines(m)]
    return next((x for x in lines if x.split(":")[0].endswith(".cu")), lines[0] if lines else "?")


def reports(log: str):
    """Each TSan report's pair of accesses (kernel file:line), sorted."""
    for block in log.split("WARNING: ThreadSanitizer: data race")[1:]:
        block = block.split("SUMMARY")[0].split("Location is")[0]
        parts = ACCESS.split(block)[1:3]
        if len(parts) == 2:
            yield tuple(sorted(_site(p) for p in parts))


def _prebuild(env) -> None:
    """The cases' modules, built with ThreadSanitizer side by side before the cases run."""
    code = (f"import sys; sys.path.insert(0, {TESTS!r}); import emu, numpy as np; "
            "from helpers import BF16; "
            "emu.prebuild([p for d in (np.float32, BF16, np.float64) "
            "for p in emu.module_keys(d, d)], load=False)")
    env = dict(env)
    env.pop("LD_PRELOAD")   # compiling needs no sanitizer runtime
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd="/")


def main() -> int:
    env = emu.tsan_env()
    _prebuild(env)
    env["TSAN_OPTIONS"] = env["TSAN_OPTIONS"].replace("halt_on_error=1", "halt_on_error=0")
    found = {}
    ok = True
    for dt, C, B, T, P, hd, S, W in CASES:
        code = CHILD.format(tests=TESTS, dt=dt, C=C, B=B, T=T, P=P, hd=hd, S=S, W=W,
                            macros=MACROS, knobs=KNOBS)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           cwd="/", timeout=1800)
        log = r.stdout + r.stderr
        if "CHILD DONE" not in log:
            print(f"{dt} C={C}: the run did not finish\n{log[-3000:]}")
            ok = False
            continue
        pairs = list(reports(log))
        for p in pairs:
            found.setdefault(p, set()).add(f"{dt}-C{C}")
        print(f"{dt} C={C}: {len(pairs)} reports, {len(set(pairs))} source pairs", flush=True)
    print(f"\n{'pair of source lines':44s} {'cases':22s} verdict")
    for p, cases in sorted(found.items()):
        why = known(p)
        ok &= why is not None
        print(f"{' / '.join(p):44s} {','.join(sorted(cases)):22s} {why or 'NEW: look at it'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
