"""How many kernel bugs does the emulated suite catch? Mutation runs of tests/test_emulated_kernels.

Each mutant is a copy of kernels/ with one barrier (`__syncthreads();`) or one cp.async wait
(`cp_wait<K>();`) removed; a set of the emulated tests runs against it in a child process
(SDM_EMU_KERNELS points the emulator at the copy). A mutant is killed when a test fails, the
emulator refuses the launch, the kernel never ends, or (unless --no-racecheck) ThreadSanitizer
finds an unordered pair of accesses that is not a known harmless race. Lines inside `#ifdef
SDM_...` blocks (benchmark-only variants) are skipped. Some removals are harmless by design (a
barrier that only orders reads after reads, say): a surviving mutant is a question to look at,
not always a gap.

    python tests/emu/mutants.py [--only fwd,bwd,prepass] [--limit N] [--skip N] [--timeout S]
                                [--no-racecheck]

prints one line per mutant and a table per source last."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KERNELS = os.path.join(ROOT, "kernels")
FILES = {"fwd": "sdm_fwd.cu", "bwd": "sdm_bwd.cu", "prepass": "sdm_prepass.cu"}
SUBSET = ("test_kernels_match_reference and (f64-C16-tile6 or f64-C1 or f32-bwd-ranges-256 or "
          "bf16-staged or bf16-kept or f32-decode-W80 or f32-hd36-tile8) or "
          "test_forward_is_bitwise or test_bad_ids and C64-f32 or "
          "test_quantized_snapshots_match_the_cpu_backend and f32-int8")
PATTERN = re.compile(r"__syncthreads\(\);|cp_wait<\w+>\(\);")


def _dead_lines(text: str) -> set:
    """Lines inside `#ifdef SDM_...` blocks (benchmark-only variants the tests never build)."""
    dead, stack = set(), []
    for i, ln in enumerate(text.split("\n"), 1):
        d = ln.strip()
        if d.startswith("#if"):
            stack.append(d.startswith("#ifdef SDM_"))
        elif d.startswith("#else") and stack:
            stack[-1] = False if stack[-1] else stack[-1]
        elif d.startswith("#endif") and stack:
            stack.pop()
        elif any(stack):
            dead.add(i)
    return dead


def mutants(only):
    for src in only:
        text = open(os.path.join(KERNELS, FILES[src])).read()
        dead = _dead_lines(text)
        for m in PATTERN.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            if text[text.rfind("\n", 0, m.start()) + 1:m.start()].lstrip().startswith("//"):
                continue
            if line in dead:
                continue
            yield src, line, m.group(0), text[:m.start()] + ";" + text[m.end():]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="fwd,bwd,prepass")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--skip", type=int, default=0, help="start after this many mutants")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per mutant")
    # on by default: the emulator runs a fiber to its next barrier or warp operation in one
    # go, so a race between straight-line code and code after a warp operation never shows in
    # the results (stop 25: sdm_prepass.cu's barrier after step 4); TSan sees it
    ap.add_argument("--no-racecheck", dest="racecheck", action="store_false",
                    help="skip tests/emu/racecheck.py on the mutants the tests let through")
    a = ap.parse_args()
    results = []
    todo = list(mutants(a.only.split(",")))[:a.limit or None]
    for i, (src, line, what, text) in enumerate(todo, 1):
        if i <= a.skip:
            continue
        d = tempfile.mkdtemp(prefix="sdm-mutant-")
        try:
            for f in os.listdir(KERNELS):
                if f.endswith((".cu", ".cuh")):
                    shutil.copy(os.path.join(KERNELS, f), d)
            with open(os.path.join(d, FILES[src]), "w") as f:
                f.write(text)
            env = dict(os.environ, SDM_EMU_KERNELS=d)
            t = time.time()
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p",
                                    "no:cacheprovider", os.path.join(ROOT, "tests",
                                                                     "test_emulated_kernels.py"),
                                    "-k", SUBSET], env=env, capture_output=True, text=True,
                                   timeout=a.timeout)
                out = r.stdout.strip().splitlines()
                killed = r.returncode != 0
                why = next((ln for ln in out if ln.startswith("FAILED")), out[-1] if out else "")
            except subprocess.TimeoutExpired:   # a kernel that never ends: a hang on a GPU too
                killed, why = True, f"hung (no end after {a.timeout} s)"
            if not killed and a.racecheck:   # second chance: an unordered pair under TSan
                r = subprocess.run([sys.executable, os.path.join(HERE, "racecheck.py")],
                                   env=env, capture_output=True, text=True, timeout=1800)
                if r.returncode:
                    new = [ln for ln in r.stdout.splitlines() if ln.endswith("NEW: look at it")]
                    killed, why = True, "racecheck: " + "; ".join(x.split()[0] + " " + x.split()[2]
                                                              for x in new)[:150]
            results.append((src, line, what, killed))
            print(f"[{i}/{len(todo)}] {src}:{line} {what:18s} {'killed' if killed else 'SURVIVED'} "
                  f"({time.time() - t:.0f} s) {why[:150]}", flush=True)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    print(f"\n{'source':8s} {'mutants':>8s} {'killed':>7s}  survivors")
    for src in a.only.split(","):
        rows = [r for r in results if r[0] == src]
        surv = [f"{r[1]}:{r[2]}" for r in rows if not r[3]]
        print(f"{src:8s} {len(rows):8d} {sum(r[3] for r in rows):7d}  {', '.join(surv) or '-'}")


if __name__ == "__main__":
    main()
