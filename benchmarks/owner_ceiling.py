"""What could a forward that owns whole bank rows reach? A skeleton of another decomposition,
timed at the headline shape (SPEC §10) against the forward's byte floor.

The forward of kernels/sdm_fwd.cu gives each block a column tile of its (b, p), so it gathers
16-column pieces (32 bytes of a bf16 row); stop 13's gather_ceiling.py measured that pattern
alone at 1.66x the floor, against 0.80x for whole rows. Here the K blocks of one thread-block
cluster share a (b, p) and split its *slots* instead: block `rank` owns the rows of slots
s = rank (mod K), whole, so every gather and every store is a whole 256-byte row, and no other
block ever reads or writes those rows. Per chunk of C tokens, each block

  1. lists its owned write and read entries (entry order);
  2. copies its owned write rows into shared memory (cp.async, whole rows) and writes them out
     as the snapshots;
  3. sums, per token and 16-byte piece, its partial X (owned write rows, weight a) and partial
     Y (owned read rows, loaded into registers, weight c) in float32, and stores each piece
     into the shared memory of the block that owns that piece's columns (DSMEM), one slot per
     sender, so the sum over senders later runs in a fixed order;
  4. cluster barrier; for its column slice: X and Y summed over the K senders in rank order,
     u = beta (v - X), readings r = Y + u (the skeleton leaves out the sparse Ainv and H
     products: in the sparse regime they touch few entries and no global memory); u kept in
     shared memory;
  5. cluster barrier; for every owned write row: the new row = kept row + a u_t, u_t read
     piece by piece from the slice owners (DSMEM), stored whole.

So the skeleton moves exactly the forward's floor bytes (every row once per entry, as the
floor counts distinct rows per chunk this is a little more) plus the exchange of float32
partials through DSMEM, with the forward's chunk order and barriers. Its results are not the
op's (no overlap terms; a slot written twice in a chunk is stored twice): it is a timing
skeleton, like gather_ceiling.py. PIPE = 1 issues the next chunk's write-row copies before step
4 into a second buffer (a real forward must then refresh the rows that the current chunk
rewrites, from its own shared memory: the owner is the same block).

    python3 benchmarks/owner_ceiling.py [--reps 20]

Cases: K (blocks per cluster: 2, 4, 8), C (tokens per chunk), PIPE, threads per block. The
shared memory per block decides blocks per SM: the receive buffers of X and Y are C * hd
floats each, whatever K.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import cupy as cp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import copy_bandwidth, floors, make_inputs, timeit  # noqa: E402

from sdm_cupy.kernels import _build  # noqa: E402


SRC = r"""
#include "sdm_common.cuh"
using namespace sdm;
constexpr int K = OWN_K, C = OWN_C, W = OWN_W, CAP = OWN_CAP, PIPE = OWN_PIPE, NT = OWN_NT;
constexpr int HD = 128, NP = 16;           // bf16 row: 16 pieces of 8 columns (16 bytes)
constexpr int CW = C * W, SLP = NP / K;    // pieces per column slice
constexpr int SL = SLP * 8;                // columns per slice

struct Lists { int w[CW]; int r[CW]; int wo[C + 1]; int ro[C + 1]; };

__device__ __forceinline__ void build_lists(Lists& l, const int* wi, const int* ri,
                                            long long tokb, int P, int L, int rank) {
  // thread t < L counts its token's owned entries; a serial scan over C by thread 0 (C <= 64)
  __shared__ int cw_[C], cr_[C];
  const int t = threadIdx.x;
  if (t < L) {
    int a = 0, b = 0;
    for (int w = 0; w < W; ++w) {
      a += (wi[(tokb + (long long)t * P) * W + w] % K) == rank;
      b += (ri[(tokb + (long long)t * P) * W + w] % K) == rank;
    }
    cw_[t] = a; cr_[t] = b;
  }
  __syncthreads();
  if (t == 0) {
    int a = 0, b = 0;
    for (int k = 0; k < L; ++k) { l.wo[k] = a; l.ro[k] = b; a += cw_[k]; b += cr_[k]; }
    l.wo[L] = min(a, CAP); l.ro[L] = b;
  }
  __syncthreads();
  if (t < L) {
    int a = l.wo[t], b = l.ro[t];
    for (int w = 0; w < W; ++w) {
      const int id = wi[(tokb + (long long)t * P) * W + w], jd = ri[(tokb + (long long)t * P) * W + w];
      if (id % K == rank && a < CAP) l.w[a++] = t * W + w;
      if (jd % K == rank) l.r[b++] = t * W + w;
    }
  }
  __syncthreads();
}

extern "C" __global__ void __cluster_dims__(OWN_K, 1, 1) __launch_bounds__(OWN_NT, OWN_MINB)
owner(__nv_bfloat16* __restrict__ bank, const int* __restrict__ wi, const float* __restrict__ aw,
      const __nv_bfloat16* __restrict__ vals, const float* __restrict__ beta,
      const int* __restrict__ ri, const float* __restrict__ cw, __nv_bfloat16* __restrict__ out,
      __nv_bfloat16* __restrict__ snap, int T, int P, long long S, int Nt) {
  const int rank = (int)cluster_rank(), bp = blockIdx.x / K, p = bp % P, b = bp / P;
  const int D = P * HD;
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int NB = 1 + PIPE;                                         // buffers
  Lists* lists = reinterpret_cast<Lists*>(smem);                      // [NB]
  int4* rows = reinterpret_cast<int4*>(smem + NB * sizeof(Lists));     // [NB][CAP][NP]
  float* xr = reinterpret_cast<float*>(rows + NB * CAP * NP);           // [K][C][SL]
  float* yr = xr + K * C * SL;                                          // [K][C][SL]
  float* us = yr + K * C * SL;                                          // [C][SL]
  const __nv_bfloat16* bank_b = bank + (long long)b * S * D + p * HD;
  __nv_bfloat16* bank_w = bank + (long long)b * S * D + p * HD;

  auto issue = [&](int n) {   // lists and write-row copies of chunk n into its buffer
    Lists& l = lists[PIPE ? n & 1 : 0];
    const int t0 = n * C, L = min(C, T - t0);
    const long long tokb = ((long long)b * T + t0) * P + p;
    build_lists(l, wi, ri, tokb, P, L, rank);
    int4* rb = rows + (PIPE ? n & 1 : 0) * CAP * NP;
    const int nw = l.wo[L];
    for (int i = threadIdx.x; i < nw * NP; i += NT) {
      const int k = i / NP, pc = i % NP, e = l.w[k], t = e / W, w = e % W;
      const int id = wi[(tokb + (long long)t * P) * W + w];
      cp_async_row(rb + i, bank_b + (long long)id * D + pc * 8);
    }
    cp_commit();
  };

  issue(0);
  for (int n = 0; n < Nt; ++n) {
    const Lists& l = lists[PIPE ? n & 1 : 0];
    const int t0 = n * C, L = min(C, T - t0);
    const long long tokb = ((long long)b * T + t0) * P + p;
    const int4* rb = rows + (PIPE ? n & 1 : 0) * CAP * NP;
    if (!PIPE && n > 0) issue(n);
    cp_wait<0>();
    __syncthreads();
    const int nw = l.wo[L];
    // snapshots of the owned write rows, whole rows
    for (int i = threadIdx.x; i < nw * NP; i += NT) {
      const int k = i / NP, pc = i % NP, e = l.w[k], t = e / W, w = e % W;
      reinterpret_cast<int4*>(snap)[(((tokb + (long long)t * P) * W + w) * HD + pc * 8) / 8] = rb[i];
    }
    // partial X and Y per (token, piece), pushed to the slice owner
    for (int task = threadIdx.x; task < L * NP; task += NT) {
      const int t = task / NP, pc = task % NP;
      float x[8], y[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) { x[i] = 0.f; y[i] = 0.f; }
#pragma unroll 4
      for (int k = l.ro[t]; k < l.ro[t + 1]; ++k) {
        const int e = l.r[k];
        const int jd = ri[tokb * W + (long long)(e / W) * P * W + e % W];
        __nv_bfloat16 m[8];
        load_row<8>(m, bank_b + (long long)jd * D + pc * 8);
        const float c = cw[tokb * W + (long long)(e / W) * P * W + e % W];
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = fmaf(c, __bfloat162float(m[i]), y[i]);
      }
      for (int k = l.wo[t]; k < min(l.wo[t + 1], CAP); ++k) {
        const int e = l.w[k];
        const float a = aw[tokb * W + (long long)(e / W) * P * W + e % W];
        union { int4 q; __nv_bfloat16 v[8]; } u;
        u.q = rb[k * NP + pc];
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = fmaf(a, __bfloat162float(u.v[i]), x[i]);
      }
      const int q = pc / SLP, off = ((rank * C + t) * SL + (pc % SLP) * 8) * 4;
      const unsigned ax = dsmem_addr(xr, q) + off, ay = dsmem_addr(yr, q) + off;
      asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(ax),
                   "f"(x[0]), "f"(x[1]), "f"(x[2]), "f"(x[3]) : "memory");
      asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(ax + 16),
                   "f"(x[4]), "f"(x[5]), "f"(x[6]), "f"(x[7]) : "memory");
      asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(ay),
                   "f"(y[0]), "f"(y[1]), "f"(y[2]), "f"(y[3]) : "memory");
      asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(ay + 16),
                   "f"(y[4]), "f"(y[5]), "f"(y[6]), "f"(y[7]) : "memory");
    }
    if (PIPE && n + 1 < Nt) issue(n + 1);
    cluster_sync();
    // this block's column slice: sums over senders in rank order, u, readings
    for (int task = threadIdx.x; task < L * SL; task += NT) {
      const int t = task / SL, c = task % SL;
      float x = 0.f, y = 0.f;
#pragma unroll
      for (int k = 0; k < K; ++k) { x += xr[(k * C + t) * SL + c]; y += yr[(k * C + t) * SL + c]; }
      const long long tok = tokb + (long long)t * P;
      const int col = rank * SL + c;
      const float v = __bfloat162float(vals[((long long)b * T + t0 + t) * D + p * HD + col]);
      const float u = beta[tok] * (v - x);
      us[t * SL + c] = u;
      out[((long long)b * T + t0 + t) * D + p * HD + col] = __float2bfloat16(y + u);
    }
    cluster_sync();
    // rewrite the owned rows: kept row + a u_t, u from the slice owners
    for (int i = threadIdx.x; i < nw * NP; i += NT) {
      const int k = i / NP, pc = i % NP, e = l.w[k], t = e / W, w = e % W;
      const long long ent = (tokb + (long long)t * P) * W + w;
      const int id = wi[ent];
      const float a = aw[ent];
      float uu[8];
      ld_dsmem_piece<8>(uu, dsmem_addr(us + t * SL + (pc % SLP) * 8, pc / SLP));
      union { int4 q; __nv_bfloat16 v[8]; } m;
      m.q = rb[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) m.v[j] = __float2bfloat16(fmaf(a, uu[j], __bfloat162float(m.v[j])));
      *reinterpret_cast<int4*>(bank_w + (long long)id * D + pc * 8) = m.q;
    }
    __syncthreads();
  }
  cluster_sync();   // no block leaves while others may still read its shared memory
}
"""


# (K, C, PIPE, threads, blocks per SM the registers must allow)
CASES = [(4, 64, 0, 512, 1), (4, 64, 0, 1024, 1), (4, 32, 0, 512, 1), (4, 32, 1, 512, 1),
         (4, 32, 1, 1024, 1), (8, 32, 0, 512, 2), (8, 32, 1, 512, 2), (2, 32, 1, 1024, 1),
         (8, 16, 1, 512, 2), (8, 16, 1, 256, 3)]


def smem_bytes(K, C, W, cap, pipe):
    nb = 1 + pipe
    lists = nb * (2 * C * W + 2 * (C + 1)) * 4
    return lists + nb * cap * 256 + 2 * K * C * (128 // K) * 4 + C * (128 // K) * 4


def options(K, C, W, pipe, nt, minb):
    cap = int(C * W / K * 1.25) + 16
    return cap, _build.options() + (f"-DOWN_K={K}", f"-DOWN_C={C}", f"-DOWN_W={W}",
                                    f"-DOWN_CAP={cap}", f"-DOWN_PIPE={pipe}", f"-DOWN_NT={nt}",
                                    f"-DOWN_MINB={minb}")


def build(K, C, W, pipe, nt, minb):
    cap, opts = options(K, C, W, pipe, nt, minb)
    mod = cp.RawModule(code=_build.inline_header(SRC), options=opts)
    kern = mod.get_function("owner")
    smem = smem_bytes(K, C, W, cap, pipe)
    kern.max_dynamic_shared_size_bytes = smem
    return kern, smem


def first_chunk_error(bank0, wi, ww, v, beta, ri, rw, out, snap, C):
    """The skeleton's own arithmetic on the first chunk (M0 = the initial bank there), in
    float64 on the host: its snapshots must be the gathered rows, its readings Y + beta (v - X).
    Returns the largest errors relative to each output's largest magnitude."""
    B, T, P, W = wi.shape
    hd = v.shape[-1] // P
    S = bank0.shape[0] // B
    M = bank0.get().astype(np.float64).reshape(B, S, P, hd)
    i, j = wi.get()[:, :C], ri.get()[:, :C]
    a, c = ww.get()[:, :C].astype(np.float64), rw.get()[:, :C].astype(np.float64)
    bi = np.arange(B)[:, None, None, None]
    pi = np.arange(P)[None, None, :, None]
    rows_w, rows_r = M[bi, i, pi], M[bi, j, pi]                     # [B, C, P, W, hd]
    X = (a[..., None] * rows_w).sum(3)
    Y = (c[..., None] * rows_r).sum(3)
    vv = v.get()[:, :C].astype(np.float64).reshape(B, C, P, hd)
    u = beta.get()[:, :C].astype(np.float64)[..., None] * (vv - X)
    r_ref = Y + u
    r = out.get()[:, :C].astype(np.float64).reshape(B, C, P, hd)
    sn = snap.get().astype(np.float64).reshape(B, T, P, W, hd)[:, :C]
    e_snap = np.abs(sn - rows_w).max() / np.abs(rows_w).max()
    e_read = np.abs(r - r_ref).max() / np.abs(r_ref).max()
    return e_snap, e_read


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    B, T, P, hd, S, W = 4, 4096, 8, 128, 16384, 16
    bw = copy_bandwidth()
    bank, wi, ww, v, beta, ri, rw, dr = make_inputs(B, T, P, hd, S, W)
    snap = cp.empty((B * T * P * W, hd), dtype=bank.dtype)
    out = cp.empty_like(v)
    rows = []
    for K, C, pipe, nt, minb in CASES:
        f_fwd, _ = floors(B, T, P, hd, S, W, C, wi.get(), ri.get())
        name = f"K={K}, C={C}, PIPE={pipe}, {nt} threads x {minb}"
        try:
            kern, smem = build(K, C, W, pipe, nt, minb)
        except Exception as exc:  # noqa: BLE001 - a case that does not build is reported
            rows.append((name, f"build failed: {type(exc).__name__}: {str(exc)[:120]}"))
            continue
        Nt = -(-T // C)
        grid = B * P * K

        def call():
            kern((grid,), (nt,), (bank, wi, ww, v, beta, ri, rw, out, snap, np.int32(T),
                                  np.int32(P), np.int64(S), np.int32(Nt)), shared_mem=smem)
        try:
            bank0 = bank.copy()
            call()
            err = first_chunk_error(bank0, wi, ww, v, beta, ri, rw, out, snap, C)
            bank[...] = bank0
            t = timeit(call, reps=args.reps, warmup=3)
        except Exception as exc:  # noqa: BLE001
            rows.append((name, f"launch failed: {type(exc).__name__}: {str(exc)[:120]}"))
            continue
        rows.append((name, f"{smem // 1024} KB | {t * 1e3:.3f} | {t / (f_fwd / bw):.2f} | "
                           f"{err[0]:.1e} / {err[1]:.1e}"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; C=64 forward floor "
          f"{floors(B, T, P, hd, S, W, 64, wi.get(), ri.get())[0] / bw * 1e3:.3f} ms")
    print("| case | smem/block | ms | time / floor (at its C) | first chunk: snapshots / "
          "readings, max rel. error |")
    print("|---|---|---|---|---|")
    for name, rest in rows:
        print(f"| {name} | {rest} |")


if __name__ == "__main__":
    main()
