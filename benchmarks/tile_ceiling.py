"""What could the forward's column tiles reach with every row piece of a chunk in flight at
once? A timing skeleton, the companion of owner_ceiling.py, at the headline shape (SPEC §10).

kernels/sdm_fwd.cu copies a chunk's write-row pieces into shared memory with cp.async (all in
flight, no registers held) but loads its read-row pieces into registers, four at a time per
thread, and runs two blocks of 16 columns per SM (the register file is full). Here one block per
(b, p, column tile of TW columns) walks its chunks in order and, per chunk,

  1. copies every write-row and read-row piece of the chunk into shared memory with cp.async
     (2 C W pieces of 2 TW bytes in flight per block) and waits for them once;
  2. writes the snapshots from shared memory;
  3. sums X and Y per (token, 16-byte piece) from shared memory in float32 (WS threads per
     task split the W entries, then shuffles), u = beta (v - X), readings r = Y + u (no Ainv
     and H: the skeleton's arithmetic is owner_ceiling.py's, checked the same way);
  4. rewrites every written row piece, kept row + a u_t (no merging of repeated slots).

The chunk's ids, weights, beta and values tile are staged one chunk ahead. Wider tiles mean
wider pieces (stop 13: 32-byte pieces alone cost 1.66x the floor, 64-byte 1.18x, whole rows
1.00x) but fewer blocks: 16 columns make 256 blocks, 32 make 128 (one per SM), 64 make 64.
Thread 0 of each block adds up the clock cycles of each phase.

    python3 benchmarks/tile_ceiling.py [--reps 20]

Results: benchmarks/RESULTS.md, stop 18.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import cupy as cp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import timeit  # noqa: E402
from owner_ceiling import check_and_time, headline_setup, sdm_forward_time  # noqa: E402

import sdm_cupy as sdm  # noqa: E402
from sdm_cupy.kernels import _build, gpu  # noqa: E402

SRC = r"""
#include "sdm_common.cuh"
using namespace sdm;
constexpr int TWC = TC_TW, C = TC_C, W = TC_W, NT = TC_NT, HD = 128;
constexpr int NPC = TWC / 8;               // 16-byte pieces of a row's tile
constexpr int CW = C * W, NTILE = HD / TWC;
constexpr int TASKS = C * NPC;             // (token, piece)
constexpr int WS = NT / TASKS >= 16 ? 16 : (NT / TASKS >= 1 ? NT / TASKS : 1);   // threads per task
static_assert((WS & (WS - 1)) == 0 && WS <= 32, "WS a power of two");

struct alignas(16) Stage { int wid[CW]; int rid[CW]; float aw[CW]; float cw[CW]; float beta[C];
                           __nv_bfloat16 v[C][TWC]; };

extern "C" __global__ void __launch_bounds__(TC_NT, TC_MINB)
tile(__nv_bfloat16* __restrict__ bank, const int* __restrict__ wi, const float* __restrict__ aw,
     const __nv_bfloat16* __restrict__ vals, const float* __restrict__ beta,
     const int* __restrict__ ri, const float* __restrict__ cw, __nv_bfloat16* __restrict__ out,
     __nv_bfloat16* __restrict__ snap, int T, int P, long long S, int Nt,
     long long* __restrict__ prof) {
  long long ph[4] = {0, 0, 0, 0}, tc = clock64();
  auto mark = [&](int k) { const long long c = clock64(); ph[k] += c - tc; tc = c; };
  const int tile = blockIdx.x % NTILE, bp = blockIdx.x / NTILE, p = bp % P, b = bp / P;
  const int D = P * HD, c0 = tile * TWC;
  extern __shared__ __align__(16) unsigned char smem[];
  Stage* stages = reinterpret_cast<Stage*>(smem);                       // [2]
  int4* wrow = reinterpret_cast<int4*>(smem + 2 * sizeof(Stage));       // [CW][NPC]
  int4* rrow = wrow + CW * NPC;                                         // [CW][NPC]
  float* U = reinterpret_cast<float*>(rrow + CW * NPC);                 // [C][TWC]
  __nv_bfloat16* bank_b = bank + (long long)b * S * D + p * HD + c0;

  auto stage = [&](int n) {
    Stage& s = stages[n & 1];
    const int t0 = n * C, L = min(C, T - t0);
    const long long tokb = ((long long)b * T + t0) * P + p;
    constexpr int PPT = W * 4 / 16;
    for (int i = threadIdx.x; i < L * PPT; i += NT) {
      const int t = i / PPT, j = i % PPT;
      const long long g = (tokb + (long long)t * P) * W + j * 4;
      cp_async<16>(s.wid + t * W + j * 4, wi + g);
      cp_async<16>(s.rid + t * W + j * 4, ri + g);
      cp_async<16>(s.aw + t * W + j * 4, aw + g);
      cp_async<16>(s.cw + t * W + j * 4, cw + g);
    }
    for (int t = threadIdx.x; t < L; t += NT) cp_async<4>(s.beta + t, beta + tokb + (long long)t * P);
    for (int i = threadIdx.x; i < L * NPC; i += NT) {
      const int t = i / NPC, j = i % NPC;
      cp_async<16>(&s.v[t][j * 8], vals + ((long long)b * T + t0 + t) * D + p * HD + c0 + j * 8);
    }
    cp_commit();
  };

  stage(0);
  for (int n = 0; n < Nt; ++n) {
    const Stage& s = stages[n & 1];
    const int t0 = n * C, L = min(C, T - t0), Ne = L * W;
    const long long tokb = ((long long)b * T + t0) * P + p;
    if (n + 1 < Nt) { stage(n + 1); cp_wait<1>(); } else { cp_wait<0>(); }
    __syncthreads();
    mark(0);
    // every row piece of the chunk in flight at once: no registers held
    for (int i = threadIdx.x; i < Ne * NPC; i += NT) {
      const int e = i / NPC, pc = i % NPC;
      cp_async_row(wrow + i, bank_b + (long long)s.wid[e] * D + pc * 8);
      cp_async_row(rrow + i, bank_b + (long long)s.rid[e] * D + pc * 8);
    }
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    mark(1);
    for (int i = threadIdx.x; i < Ne * NPC; i += NT) {   // snapshots
      const int e = i / NPC, pc = i % NPC, t = e / W, w = e % W;
      reinterpret_cast<int4*>(snap)[(((tokb + (long long)t * P) * W + w) * HD + c0 + pc * 8) / 8] = wrow[i];
    }
    for (int base = 0; base < L * NPC * WS; base += NT) {
      const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
      const bool act = tp < L * NPC;
      const int t = act ? tp / NPC : 0, pc = tp % NPC;
      float x[8], y[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) { x[i] = 0.f; y[i] = 0.f; }
      if (act) {
#pragma unroll 4
        for (int w = ws; w < W; w += WS) {
          const int e = t * W + w;
          union { int4 q; __nv_bfloat16 v[8]; } m, mr;
          m.q = wrow[e * NPC + pc];
          mr.q = rrow[e * NPC + pc];
          const float a = s.aw[e], c = s.cw[e];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            x[i] = fmaf(a, __bfloat162float(m.v[i]), x[i]);
            y[i] = fmaf(c, __bfloat162float(mr.v[i]), y[i]);
          }
        }
      }
#pragma unroll
      for (int o = 1; o < WS; o <<= 1) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          x[i] += __shfl_xor_sync(0xffffffffu, x[i], o);
          y[i] += __shfl_xor_sync(0xffffffffu, y[i], o);
        }
      }
      if (act && ws == 0) {
        const float bt = s.beta[t];
        union { int4 q; __nv_bfloat16 v[8]; } r;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float u = bt * (__bfloat162float(s.v[t][pc * 8 + i]) - x[i]);
          U[t * TWC + pc * 8 + i] = u;
          r.v[i] = __float2bfloat16(y[i] + u);
        }
        *reinterpret_cast<int4*>(out + ((long long)b * T + t0 + t) * D + p * HD + c0 + pc * 8) = r.q;
      }
    }
    __syncthreads();
    mark(2);
    for (int i = threadIdx.x; i < Ne * NPC; i += NT) {   // scatter (no merging of repeats)
      const int e = i / NPC, pc = i % NPC, t = e / W;
      const float a = s.aw[e];
      union { int4 q; __nv_bfloat16 v[8]; } m;
      m.q = wrow[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) m.v[j] = __float2bfloat16(fmaf(a, U[t * TWC + pc * 8 + j], __bfloat162float(m.v[j])));
      *reinterpret_cast<int4*>(bank_b + (long long)s.wid[e] * D + pc * 8) = m.q;
    }
    __syncthreads();
    mark(3);
  }
  if (threadIdx.x == 0)
    for (int k = 0; k < 4; ++k) prof[(long long)blockIdx.x * 4 + k] = ph[k];
}
"""

# (TW, C, threads, blocks per SM that registers must allow)
CASES = [(16, 64, 256, 2), (16, 64, 512, 2), (16, 32, 256, 2), (32, 64, 512, 1),
         (32, 64, 1024, 1), (32, 32, 512, 1), (64, 32, 512, 1), (64, 32, 1024, 1)]


def smem_bytes(TW, C, W):
    """Dynamic shared memory: 2 stages, the write and read row pieces, u."""
    def r16(x):
        return -(-x // 16) * 16
    stage = r16(4 * C * W * 4 + C * 4 + C * TW * 2)
    return 2 * stage + 2 * C * W * TW * 2 + C * TW * 4


def options(TW, C, W, nt, minb):
    return _build.options() + (f"-DTC_TW={TW}", f"-DTC_C={C}", f"-DTC_W={W}", f"-DTC_NT={nt}",
                               f"-DTC_MINB={minb}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    (B, T, P, hd, S, W), bw, inputs, snap, out, floor_s = headline_setup()
    rows, phases = [], []
    for TW, C, nt, minb in CASES:
        name = f"TW={TW}, C={C}, {nt} threads x {minb}"
        smem = smem_bytes(TW, C, W)
        try:
            kern = cp.RawModule(code=_build.inline_header(SRC),
                                options=options(TW, C, W, nt, minb)).get_function("tile")
            kern.max_dynamic_shared_size_bytes = smem
        except Exception as exc:  # noqa: BLE001 - a case that does not build is reported
            rows.append((name, f"build failed: {type(exc).__name__}: {str(exc)[:120]}"))
            continue
        Nt = -(-T // C)
        grid = B * P * (hd // TW)
        prof = cp.zeros((grid, 4), dtype=np.int64)
        t, err = check_and_time(kern, grid, nt, smem, inputs, out, snap, Nt, C, prof, args.reps)
        cyc = prof.get().mean(0) / Nt / 1.98e3
        phases.append((name, cyc))
        rows.append((name, f"{smem // 1024} KB | {grid} | {t * 1e3:.3f} | {t / floor_s(C):.2f} | "
                           f"{err[0]:.1e} / {err[1]:.1e}"))
    t_ours, cfg = sdm_forward_time(inputs, S, P, args.reps)
    bank, wi, ww, v, beta, ri, rw = inputs
    lay = sdm._validate.layout(*inputs, cfg)
    pl = gpu.plan(lay, cfg)
    t_pre = timeit(lambda: gpu._prepass_sparse(lay, pl, np.dtype(np.float32), wi, ww, ri, rw,
                                               beta), args.reps)
    f64 = floor_s(64)
    rows.insert(0, ("sdm_cupy forward, C=64 (graph, pre-pass included)",
                    f"- | - | {t_ours * 1e3:.3f} | {t_ours / f64:.2f} | -"))
    rows.insert(1, ("sdm_cupy forward without its pre-pass (graph - pre-pass)",
                    f"- | - | {(t_ours - t_pre) * 1e3:.3f} | {(t_ours - t_pre) / f64:.2f} | -"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; C=64 forward floor {f64 * 1e3:.3f} ms")
    print("| case | smem/block | blocks | ms | time / floor (at its C) | first chunk: snapshots / "
          "readings, max rel. error |")
    print("|---|---|---|---|---|---|")
    for name, rest in rows:
        print(f"| {name} | {rest} |")
    print()
    print("Thread 0 of each block: us per chunk in each phase (clock64 at 1.98 GHz), mean")
    print("| case | stage wait | row gather | snapshots + X/Y + readings | scatter |")
    print("|---|---|---|---|---|")
    for name, cyc in phases:
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cyc) + " |")


if __name__ == "__main__":
    main()
