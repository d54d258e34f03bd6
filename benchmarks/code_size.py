"""How large is each GPU kernel instance, and does it spill? Compiles the template instances
for sm_90 with NVRTC from ``cuda-bindings`` (no GPU needed) and prints, per instance, its
machine instructions (the ELF ``.text`` section's bytes / 16: an sm_90 instruction is 16
bytes), registers, and spill stores/loads in bytes (``ptxas -v``).

Stop 19 found the kernels' speed following their code size, not only their instruction counts
on the hot path: the staged forward compiled with its fast path alone ran 5.9% faster
(RESULTS.md). This is the quick look before a device run.

    python benchmarks/code_size.py [fwd bwd prepass batch] [--match TEXT]
        [--variant LABEL=FILE[:OPTIONS]] ...

``--match`` keeps the instances whose name contains TEXT (e.g. ``__nv_bfloat16,__nv_bfloat16``);
``--variant`` adds a column set for a copy of the (single) named source with other text or
NVRTC options, e.g. ``--variant fast=/tmp/sdm_bwd.cu`` or ``--variant nostage=kernels/sdm_bwd.cu:-DSDM_BWD_NO_SNAP_STAGE``.
"""

from __future__ import annotations

import argparse
import re

from same_machine_code import text_sections
from sdm_cupy.kernels import _build as K

INSTR_BYTES = 16


def ptxas_info(log: str) -> dict:
    """Mangled name -> (registers, spill store bytes, spill load bytes) from a ``-v`` log."""
    out, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            cur = m.group(1)
            out[cur] = [None, None, None]
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            out[cur][1:] = [int(m.group(1)), int(m.group(2))]
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            out[cur][0] = int(m.group(1))
    return {k: tuple(v) for k, v in out.items()}


def sizes(src: str, text: str, opts, names) -> dict:
    """name -> (instructions, registers, spill stores, spill loads) of each instance."""
    log, lowered, cubin = K.nvrtc_compile(src, text, (*opts, "-Xptxas=-v"), names)
    secs, info = text_sections(cubin), ptxas_info(log)
    lowered = [low.decode() if isinstance(low, bytes) else low for low in lowered]
    return {n: (len(secs.get(".text." + low, b"")) // INSTR_BYTES,
                *info.get(low, (None, None, None))) for n, low in zip(names, lowered)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sources", nargs="*", default=sorted(K.SOURCES))
    ap.add_argument("--match", default="")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=FILE[:OPTIONS]")
    args = ap.parse_args()
    if args.variant and len(args.sources) != 1:
        raise SystemExit("--variant needs exactly one source name (fwd, bwd, prepass or batch)")
    variants = [("current", None, ())]
    for spec in args.variant:
        label, rest = spec.split("=", 1)
        path, _, opts = rest.partition(":")
        variants.append((label, K.inline_header(open(path).read()), tuple(opts.split())))
    head = " | ".join(f"{v[0]}: instr, regs, spills" for v in variants)
    print(f"| instance | {head} |")
    print("|---" * (1 + len(variants)) + "|")
    for src in args.sources:
        for key in K.module_keys(src):
            names = [n for n in K._names(src, key) if args.match in n]
            if not names:
                continue
            cols = [sizes(src, text if text is not None else K.source(src),
                          (*K.options(), *opts), names) for _, text, opts in variants]
            for n in names:
                cells = " | ".join(f"{c[n][0]}, {c[n][1]}, {c[n][2]}/{c[n][3]}" for c in cols)
                print(f"| `{n}` | {cells} |", flush=True)


if __name__ == "__main__":
    main()
