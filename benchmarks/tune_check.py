"""What ``sdm.tune`` chooses, shape by shape, beside what the interleaved graph A/B of
``sub_rule.sh`` measured (RESULTS, stop 28): does the eager measurement pick the faster plan?

    cd benchmarks && python3 tune_check.py [--reps 5]

Prints one row per shape: whether the two plans differ, the median eager forward+backward ms
under each (False: the backward keeps its chunk; True: it halves it for its dM stage) and
the kept choice. bf16 bank and values, float32 weights, B = 4, T = 4096, P = 8, C = 64.
"""

from __future__ import annotations

import argparse

import sdm_cupy as sdm
from bench_gpu import make_inputs
from sdm_cupy.kernels import gpu

SHAPES = [dict(hd=128, W=16), dict(hd=128, W=8), dict(hd=128, W=12), dict(hd=128, W=32),
          dict(hd=64, W=16), dict(hd=64, W=24), dict(hd=128, W=4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    B, T, P, S, C = 4, 4096, 8, 16384, 64
    print("| hd | W | plans differ | ms, keep the chunk | ms, halve it | kept |")
    print("| ---: | ---: | --- | ---: | ---: | --- |")
    for sh in SHAPES:
        bank, wi, ww, v, beta, ri, rw, _ = make_inputs(B, T, P, sh["hd"], S, sh["W"])
        cfg = sdm.SDMConfig(num_memory_slots=S, num_parallel=P, chunk_size=C)
        t = sdm.tune(bank, wi, ww, v, beta, ri, rw, cfg, reps=args.reps)
        ms = [f"{t.ms[h]:.3f}" if t.ms else "-" for h in (False, True)]
        print(f"| {sh['hd']} | {sh['W']} | {t.plans_differ} | {ms[0]} | {ms[1]} | "
              f"{'halve' if t.halve else 'keep'} |", flush=True)
    gpu.clear_tuning()


if __name__ == "__main__":
    main()
