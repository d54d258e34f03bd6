"""The comparisons of the test suite ranked by how much of their tolerance they use.

A comparison that uses most of its tolerance on the seeds seen fails on some other seed, and a
red CI stops everything that was to land with it (stop 39: a bf16 snapshot check that failed
once in many runs). Collect the margins over a few runs of the suite, then rank them:

    SDM_TEST_MARGINS=/tmp/margins.tsv python -m pytest -q -m "not gpu"   # as often as time allows
    python tests/margins.py /tmp/margins.tsv [--top 25] [--over 0.5]

Each line of the file is written by ``helpers.assert_close``: error / tolerance, the test, what it
compared and the test's seed (``SDM_TEST_SEED=<seed>`` reruns that test on it; "None": the test
draws no seed from the ``rng`` fixture). Printed per (test, comparison): the largest ratio, its
seed, the median ratio and how many times it ran.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys


def rank(lines):
    """{(test, what): [(ratio, seed), ...]} from the file's lines, ranked by the largest ratio."""
    seen = collections.defaultdict(list)
    for line in lines:
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 4:
            continue
        ratio, test, what, seed = parts
        seen[(test, what)].append((float(ratio), seed))
    return sorted(seen.items(), key=lambda kv: -max(r for r, _ in kv[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=25, help="rows to print (default 25)")
    ap.add_argument("--over", type=float, default=0.0,
                    help="only comparisons whose largest ratio exceeds this")
    a = ap.parse_args(argv)
    lines = []
    for f in a.files:
        with open(f) as fh:
            lines += fh.readlines()
    ranked = [kv for kv in rank(lines) if max(r for r, _ in kv[1]) > a.over]
    print(f"{len(lines)} comparisons, {len(ranked)} kinds shown of those over {a.over}")
    print("| largest | its seed | median | runs | test | compared |")
    print("| ---: | ---: | ---: | ---: | --- | --- |")
    for (test, what), runs in ranked[:a.top]:
        r, seed = max(runs)
        med = statistics.median(x for x, _ in runs)
        print(f"| {r:.3f} | {seed} | {med:.3f} | {len(runs)} | `{test}` | {what} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
