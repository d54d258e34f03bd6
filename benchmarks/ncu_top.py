"""Top stall locations from an Nsight Compute source-page CSV (``ncu --page source --csv
--print-source sass``): the instructions with the most warp-stall samples, with context.

    python3 benchmarks/ncu_top.py FILE [--top 25] [--segments]

``--segments`` sums the samples and the executed warp instructions between block barriers
(a kernel's phases, in machine-code order), with each phase's most executed opcodes, and lists
the blocks of straight-line code that execute the most instructions.
"""

from __future__ import annotations

import argparse
import csv
import io


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--segments", action="store_true",
                    help="also sum the samples between barriers (a kernel's phases)")
    args = ap.parse_args()
    text = open(args.file, errors="replace").read()
    # one CSV table per kernel; each starts with a header line holding "Source"
    blocks, cur = [], None
    for line in text.splitlines():
        if line.startswith('"') and "Source" in line and ("Address" in line or "#" in line):
            cur = [line]
            blocks.append(cur)
        elif cur is not None and line.startswith('"'):
            cur.append(line)
        elif cur is not None and not line.strip():
            cur = None
        else:
            if cur is None and line.strip() and not line.startswith("=="):
                print("|", line[:200])
    for b in blocks:
        rows = list(csv.reader(io.StringIO("\n".join(b))))
        head, rows = rows[0], rows[1:]
        print("columns:", head[:12])
        col = next((i for i, h in enumerate(head) if "Warp Stall Sampling (All" in h), None)
        src = next((i for i, h in enumerate(head) if h == "Source"), 1)
        if col is None:
            print("no stall column")
            continue

        def val(r):
            try:
                return float(r[col].replace(",", ""))
            except (ValueError, IndexError):
                return 0.0

        total = sum(val(r) for r in rows) or 1.0
        print(f"kernel table: {len(rows)} instructions, {total:.0f} samples")
        if args.segments:
            ex = next((i for i, h in enumerate(head) if h == "Instructions Executed"), None)

            def count(r):
                try:
                    return float(r[ex].replace(",", "")) if ex is not None else 0.0
                except (ValueError, IndexError):
                    return 0.0

            def opcode(text):
                words = text.split()
                return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]

            n_all = sum(count(r) for r in rows) or 1.0
            print(f"  {n_all / 1e6:.1f}M warp instructions executed")
            start, acc = 0, 0.0
            for i, r in enumerate(rows):
                acc += val(r)
                if "BAR.SYNC" in r[src] or i == len(rows) - 1:
                    n = sum(count(x) for x in rows[start:i + 1])
                    if acc / total > 0.01 or n / n_all > 0.01:
                        mix = {}
                        for x in rows[start:i + 1]:
                            if x[src].strip():
                                op = opcode(x[src])
                                mix[op] = mix.get(op, 0.0) + count(x)
                        ops = " ".join(f"{o} {c / 1e6:.1f}M" for o, c in
                                       sorted(mix.items(), key=lambda kv: -kv[1])[:6])
                        print(f"  phase [{start}-{i}] {100 * acc / total:5.1f}% of samples, "
                              f"{n / 1e6:6.1f}M instructions: {ops}")
                    start, acc = i + 1, 0.0
            # straight-line blocks: consecutive instructions executed equally often
            runs, i = [], 0
            while i < len(rows):
                j = i
                while j + 1 < len(rows) and count(rows[j + 1]) == count(rows[i]):
                    j += 1
                runs.append((i, j))
                i = j + 1
            runs.sort(key=lambda ij: -count(rows[ij[0]]) * (ij[1] - ij[0] + 1))
            print("  most executed straight-line blocks:")
            for i, j in runs[:args.top // 2]:
                c, k = count(rows[i]), j - i + 1
                sm = sum(val(x) for x in rows[i:j + 1])
                print(f"  [{i}-{j}] {k} x {c / 1e6:.3f}M = {k * c / 1e6:.1f}M instructions, "
                      f"{100 * sm / total:.1f}% of samples: "
                      f"{rows[i][src][:50]} ... {rows[j][src][:40]}")
        top = sorted(range(len(rows)), key=lambda i: -val(rows[i]))[:args.top]
        for i in sorted(top):
            ctx = " | ".join(rows[j][src][:40] for j in range(max(0, i - 2), i))
            print(f"{100 * val(rows[i]) / total:5.1f}%  [{i}] {rows[i][src][:70]:70s}  <- {ctx}")


if __name__ == "__main__":
    main()
