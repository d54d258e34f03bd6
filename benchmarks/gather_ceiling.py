"""How fast can the forward's row traffic go at all? A kernel with no chunk order, no
substitution and no dependencies moves exactly the bytes of the forward's byte floor at the
headline shape (SPEC §10): per (b, t, p) it reads the W write rows and W read rows of the bank,
writes the W snapshot rows and the W written rows back, reads the values and writes the
readings. Its time over the floor is the ceiling that the random gathers themselves allow.

    python3 benchmarks/gather_ceiling.py [--reps 20]

Orders (one thread per 16-byte piece of a token's rows):
  rows        the 16 pieces of a 256-byte row side by side (one block reads whole rows)
  tiles=K     the row cut into K column tiles and the tile the slowest index, so the pieces of a
              row are read at very different times
  tiles=K, in step   the same tiles, one block per (group of tokens, tile) and the tiles of a
              group in consecutive blocks, as the forward's blocks of one (b, p) run
  + L2::256B  the row loads carry the L2 prefetch-size hint that kernels/sdm_common.cuh uses
  all (b, p)  tokens in time order across every (b, p) at once, as the forward's blocks walk
              them: the whole 128 MiB bank is in use, more than L2. Without it the tokens go
              batch element by batch element, and one element's 32 MiB of bank stays in L2,
              which flatters the whole-row orders (first recorded runs: 0.58-0.80x the floor).
"""

from __future__ import annotations

import argparse

import numpy as np

import cupy as cp

from bench_gpu import copy_bandwidth, floors, make_inputs, timeit

SRC = r"""
__device__ __forceinline__ uint4 ld_row(const uint4* p) {
  uint4 r;
  asm volatile("ld.global" HINT ".v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y),
               "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
extern "C" __global__ void __launch_bounds__(256)
traffic(uint4* __restrict__ bank, const int* __restrict__ wi, const int* __restrict__ ri,
        const uint4* __restrict__ vals, uint4* __restrict__ snap, uint4* __restrict__ out,
        long long ntok, int T, int P, int NP, int W, long long S, int ntile, int tile_major,
        int t_major) {
  const int ppt = NP / ntile;                       // 16-byte pieces per tile
  const long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (q >= ntok * NP) return;
  long long tok; int piece;
  if (tile_major == 2) {       // block = (group, tile), thread = (token of the group, j)
    const int tile = blockIdx.x % ntile, tpb = blockDim.x / ppt;
    tok = (long long)(blockIdx.x / ntile) * tpb + threadIdx.x / ppt;
    piece = tile * ppt + threadIdx.x % ppt;
    if (tok >= ntok) return;
  } else if (tile_major) {     // q = (tile, tok, j)
    const long long per = ntok * ppt;
    const int tile = (int)(q / per);
    const long long r = q - tile * per;
    tok = r / ppt;
    piece = tile * ppt + (int)(r - tok * ppt);
  } else {                     // q = (tok, piece)
    tok = q / NP;
    piece = (int)(q - tok * NP);
  }
  if (t_major) {               // the k-th token in time order over every (b, p): (t, b, p)
    const long long BP = ntok / T, t = tok / BP, r = tok - t * BP;
    tok = ((r / P) * T + t) * P + r % P;
  }
  const long long bt = tok / P;          // b * T + t
  const int p = (int)(tok - bt * P);
  const long long D16 = (long long)P * NP;   // a bank row of all heads, in 16-byte pieces
  const long long b = bt / T;                 // batch element: bank rows [b S, (b + 1) S)
  uint4* bank_b = bank + b * S * D16 + (long long)p * NP + piece;
  unsigned acc0 = 0, acc1 = 0, acc2 = 0, acc3 = 0;
#pragma unroll 8
  for (int w = 0; w < W; ++w) {
    const int id = wi[tok * W + w], jd = ri[tok * W + w];
    const uint4 x = ld_row(bank_b + (long long)id * D16);
    const uint4 y = ld_row(bank_b + (long long)jd * D16);
    snap[(tok * W + w) * NP + piece] = x;
    bank_b[(long long)id * D16] = x;
    acc0 ^= y.x; acc1 ^= y.y; acc2 ^= y.z; acc3 ^= y.w;
  }
  const uint4 v = vals[tok * NP + piece];
  out[tok * NP + piece] = make_uint4(acc0 ^ v.x, acc1 ^ v.y, acc2 ^ v.z, acc3 ^ v.w);
}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    B, T, P, hd, S, W, C = 4, 4096, 8, 128, 16384, 16, 64
    bw = copy_bandwidth()
    bank, wi, ww, v, beta, ri, rw, dr = make_inputs(B, T, P, hd, S, W)
    f_fwd, _ = floors(B, T, P, hd, S, W, C, wi.get(), ri.get())
    NP = hd * 2 // 16
    ntok = B * T * P
    snap = cp.empty((B * T * P * W, NP * 8), dtype=bank.dtype)
    out = cp.empty_like(v)
    kerns = {h: cp.RawKernel(SRC, "traffic", options=(f'-DHINT="{h}"',))
             for h in ("", ".L2::256B")}
    threads = 256
    blocks = -(-ntok * NP // threads)
    rows = []
    cases = [("rows", 1, 0, "", 0), ("tiles=2", 2, 1, "", 0), ("tiles=4", 4, 1, "", 0),
             ("tiles=8", 8, 1, "", 0), ("tiles=8 + L2::256B", 8, 1, ".L2::256B", 0),
             ("tiles=8, in step", 8, 2, "", 0),
             ("tiles=8, in step + L2::256B", 8, 2, ".L2::256B", 0),
             ("tiles=4, in step", 4, 2, "", 0), ("tiles=4, in step + L2::256B", 4, 2, ".L2::256B", 0),
             ("rows, all (b, p)", 1, 0, "", 1),
             ("tiles=8, in step, all (b, p) + L2::256B", 8, 2, ".L2::256B", 1),
             ("tiles=4, in step, all (b, p) + L2::256B", 4, 2, ".L2::256B", 1)]
    for name, ntile, tile_major, hint, t_major in cases:
        kern = kerns[hint]

        def call():
            kern((blocks,), (threads,), (bank, wi, ri, v, snap, out, np.int64(ntok), np.int32(T),
                                         np.int32(P), np.int32(NP), np.int32(W), np.int64(S),
                                         np.int32(ntile), np.int32(tile_major),
                                         np.int32(t_major)))
        t = timeit(call, reps=args.reps, warmup=3)
        rows.append((name, t * 1e3, f_fwd / t / 1e12, t / (f_fwd / bw)))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; forward floor {f_fwd / 1e9:.3f} GB = "
          f"{f_fwd / bw * 1e3:.3f} ms")
    print("| order | ms | TB/s | time / floor |")
    print("|---|---|---|---|")
    for name, ms, tbs, ratio in rows:
        print(f"| {name} | {ms:.3f} | {tbs:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
