"""Memory-level parallelism of a kernel, read from its machine code (no GPU needed).

Compiles one kernel instance with NVRTC for sm_90 (the backend's own source and options) and
disassembles it with ``cuobjdump``; then, for every global load, counts how many more global
loads a thread issues before it first uses the loaded registers. A gather whose loads all show
0 waits for each row before it asks for the next one (latency-bound whatever the occupancy).
Also flags loads on the read-only path (``LDG...CONSTANT``), which must not read memory the
kernel writes.

    python benchmarks/sass_loads.py bwd "sdm::sdm_bwd_kernel<__nv_bfloat16,__nv_bfloat16,float,float,int,0,8>"
    python benchmarks/sass_loads.py fwd "sdm::sdm_fwd_kernel<__nv_bfloat16,__nv_bfloat16,float,int,0,8>"

``cuobjdump`` comes with the CUDA toolkit, or with NVIDIA's wheels (``pip install -e
".[sass]"``: ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``, which it calls; without
nvdisasm beside it, it prints no instructions), found there by default; else pass it as
``--cuobjdump PATH``. ``--dump FILE`` also writes the whole listing.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

from sdm_cupy.kernels import _build as K


def cubin(src: str, name: str, arch: str = "sm_90") -> bytes:
    return K.nvrtc_compile(src, K.source(src), K.options(), [name], arch)[2]


def instructions(sass: str):
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            yield m.group(1), m.group(2)


def load_report(ins):
    """(address, load, loads issued before its first use, why the scan stopped) per LDG."""
    ins = list(ins)
    out = []
    for i, (addr, op) in enumerate(ins):
        m = re.search(r"LDG\S*\s+R(\d+)", op)
        if not m:
            continue
        width = 4 if ".128" in op else 2 if ".64" in op else 1
        dst = {str(int(m.group(1)) + k) for k in range(width)}
        n, why = 0, "end"
        for _, op2 in ins[i + 1:i + 400]:
            parts = op2.split(None, 1)
            operands = parts[1] if len(parts) > 1 else ""
            srcs = set(re.findall(r"\bR(\d+)\b", operands.split(",", 1)[1] if "," in operands else ""))
            if re.search(r"\b(STG|STS|ST)\b", op2):
                srcs = set(re.findall(r"\bR(\d+)\b", operands))
            if "LDG" in op2:
                n += 1
            if dst & srcs:
                why = "use"
                break
            if re.search(r"\b(BRA|BAR|EXIT)\b", op2):
                why = "branch"
                break
        out.append((addr, op, n, why))
    return out


def find_cuobjdump() -> str:
    """cuobjdump as cuda.pathfinder finds it (NVIDIA's wheels first: the ``sass`` extra), else
    the PATH's."""
    try:
        from cuda import pathfinder
        return pathfinder.find_nvidia_binary_utility("cuobjdump") or "cuobjdump"
    except Exception:  # noqa: BLE001 - pathfinder missing or too old: the PATH's
        return "cuobjdump"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src", choices=sorted(K.SOURCES))
    ap.add_argument("name", help="a name expression, as kernels/_build.py writes them")
    ap.add_argument("--cuobjdump", default=None, help="default: find_cuobjdump()")
    ap.add_argument("--all", action="store_true", help="list every load, not only 16-byte ones")
    ap.add_argument("--dump", metavar="FILE", help="also write the whole SASS listing there")
    args = ap.parse_args()
    args.cuobjdump = args.cuobjdump or find_cuobjdump()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin(args.src, args.name))
        sass = subprocess.run([args.cuobjdump, "-sass", path], check=True, capture_output=True,
                              text=True).stdout
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(sass)
    rows = load_report(instructions(sass))
    hist = collections.Counter(n for _, op, n, why in rows if ".128" in op)
    for addr, op, n, why in rows:
        if args.all or ".128" in op:
            flag = "  READ-ONLY PATH" if "CONSTANT" in op else ""
            print(f"{addr:>6}  {op[:58]:58s} {n} more loads before its {why}{flag}")
    print("16-byte loads by the number of loads issued before their first use:",
          dict(sorted(hist.items())))


if __name__ == "__main__":
    main()
