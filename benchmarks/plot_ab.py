"""Plots the tables that ``fwd_ab.py`` prints (one panel per table): each variant's median
as a bar with its q25-q75 range, and its change against the table's reference, the mean of
the medians of the variants named ``base``/``base2`` (or ``c1``/``c2``, the controls of the
stagger probe) where the table has them, else of its first row.

    python benchmarks/plot_ab.py benchmarks/ab_stop47_h100.txt --out benchmarks/ab_stop47_h100.png

The input is any text holding the tables: a title line ending in ``(ms):`` (fwd_ab.py's own,
or one written by hand), then the ``| variant | median | q25 | q75 |`` header and one
``| label | median | q25 | q75 |`` line per variant. Other lines are ignored.
"""

from __future__ import annotations

import argparse
import re

REFERENCES = (("base", "base2"), ("c1", "c2"))
ROW = re.compile(r"^\|\s*([^|]+?)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*$")


def parse(text: str) -> list:
    """[(title, [(label, median, q25, q75), ...]), ...] in the order of the text."""
    tables, title, rows = [], None, None
    for line in text.splitlines():
        line = line.strip()
        if line.endswith("(ms):"):
            if rows:
                tables.append((title, rows))
            title, rows = line[:-len("(ms):")].strip(), []
            continue
        m = ROW.match(line)
        if m and rows is not None:
            rows.append((m.group(1), *(float(m.group(i)) for i in (2, 3, 4))))
    if rows:
        tables.append((title, rows))
    return tables


def reference(rows: list) -> float:
    """The mean median of the reference variants (see the module's docstring)."""
    med = {label: q50 for label, q50, _, _ in rows}
    for names in REFERENCES:
        found = [med[n] for n in names if n in med]
        if found:
            return sum(found) / len(found)
    return rows[0][1]


def plot(tables: list, out: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(tables)
    cols = 2 if n > 1 else 1
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 0.45 * max(len(r) for _, r in tables)
                                                    * nrows + 1.2 * nrows), squeeze=False)
    for ax, (name, rows) in zip(axes.flat, tables):
        ref = reference(rows)
        labels = [r[0] for r in rows][::-1]
        med = [r[1] for r in rows][::-1]
        lo = [r[1] - r[2] for r in rows][::-1]
        hi = [r[3] - r[1] for r in rows][::-1]
        colors = ["0.6" if l in sum(REFERENCES, ()) or l == "main" else "tab:blue" for l in labels]
        ax.barh(labels, med, xerr=[lo, hi], color=colors, capsize=3)
        ax.axvline(ref, color="k", lw=0.8, ls="--")
        span = max(r[3] for r in rows) - min(r[2] for r in rows)
        left = min(r[2] for r in rows) - 0.6 * span
        ax.set_xlim(left, max(r[3] for r in rows) + 1.1 * span)
        for y, (m, h) in enumerate(zip(med, hi)):   # the label right of the q75 whisker
            ax.text(m + h + 0.03 * span, y, f"{m:.3f} ({100 * (m / ref - 1):+.1f}%)",
                    va="center", fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("ms (median, q25-q75); dashed: reference")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="text files holding fwd_ab.py tables")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    tables = []
    for path in args.inputs:
        with open(path) as f:
            tables += parse(f.read())
    if not tables:
        raise SystemExit("no fwd_ab.py table found in " + ", ".join(args.inputs))
    plot(tables, args.out, args.title)
    for name, rows in tables:
        ref = reference(rows)
        print(name)
        for label, q50, _, _ in rows:
            print(f"  {label:8s} {q50:.3f} ms  {100 * (q50 / ref - 1):+.1f}%")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
