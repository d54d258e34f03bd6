"""Does the GPU machine code differ from an earlier commit's? Compiles every module of the GPU
backend (every template instance, sm_90, NVRTC from cuda-bindings: no GPU needed) from an
earlier commit's kernel sources and from the working tree's, and compares the cubins' code
(the ELF .text sections; other sections hold names and notes). Identical code means a GPU run
of the earlier commit's kernels stands for these.

    python benchmarks/same_machine_code.py REV [fwd bwd prepass batch]
"""

from __future__ import annotations

import argparse
import struct
import subprocess

from sdm_cupy.kernels import _build as K


def text_sections(cubin: bytes) -> dict:
    """ELF64 section name -> contents, for the .text sections."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_off = hdrs[shstrndx][4]
    out = {}
    for name, typ, _flags, _addr, off, size in hdrs:
        n = cubin[names_off + name: cubin.index(b"\0", names_off + name)].decode()
        if n.startswith(".text"):
            out[n] = cubin[off:off + size] if typ != 8 else b""   # 8: NOBITS
    return out


def source_at(rev: str, src: str) -> str:
    def show(path):
        return subprocess.check_output(["git", "show", f"{rev}:{path}"], text=True)
    return K.inline_header(show(f"kernels/{K.SOURCES[src]}"), show(f"kernels/{K._HEADER}"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rev")
    ap.add_argument("sources", nargs="*", default=sorted(K.SOURCES))
    args = ap.parse_args()
    modules = sections = differ = 0
    for src in args.sources:
        old, new = source_at(args.rev, src), K.source(src)
        for key in K.module_keys(src):
            names = K._names(src, key)
            a, b = (text_sections(K.nvrtc_compile(src, t, K.options(), names)[2])
                    for t in (old, new))
            bad = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
            modules += 1
            sections += len(a)
            differ += len(bad)
            if bad:
                print(f"{src} {key}: {len(bad)} of {len(a)} .text sections differ, e.g. {bad[0]}")
    print(f"{modules} modules, {sections} .text sections from {args.rev}; {differ} differ")


if __name__ == "__main__":
    main()
