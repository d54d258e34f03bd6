// Pre-pass of SPEC §3/§4: everything of a chunk that depends on ids and weights only, not on
// the bank, for all chunks at once (one block per (b, p, chunk)). Two output forms:
//
// SPARSE = 0 (the backward):
//   srt  : the chunk's write entries q = t*W + w (q < N) and read entries q = N + t*W + w,
//          sorted by (slot, q); bit 30 marks the first entry of a run of equal slots, bit 29 a
//          slot id outside [0, S) (those sort last and are skipped by every kernel).
//   G    : G[t][tau] = k_t . k_tau for tau < t (strictly lower), from the runs of equal slots,
//   H    : H[t][tau] = q_t . k_tau for tau <= t,
//   Ainv : (I + diag(beta) tril(G, -1))^{-1}, unit lower triangular (the WY form: u = Ainv *
//          diag(beta) (v - X)).
// SPARSE = 1 (the forward): only what the forward reads, compact:
//   wrun : per write entry q = t*W + w: bits 0-15 = 1 + the next write entry of the same slot
//          (0: none; ascending q), bit 16 = q heads its slot's writes, bit 17 = a bad slot id,
//   sp_ptr, sp_col, sp_val : CSR rows of the strictly lower part of Ainv (rows 0..C-1; its unit
//          diagonal is implied) and of H (rows C..2C-1); sp_ptr[2C] = the chunk's entry count
//          (at most L*L <= C*C: the arrays hold the worst case), columns ascending.
// Overlaps come from the sort (bitonic, in shared memory), never from the C^2 W^2 pairs.
// Each token row of G and H is accumulated by one thread in a fixed order: deterministic.

#include "sdm_common.cuh"

namespace sdm {

constexpr unsigned long long KEY_BAD = 1ull << 40;   // slot key of an out-of-range id
constexpr int QBITS = 14;                           // 2 * C * W <= 8192 < 2^14
constexpr int RUN_HEAD = 1 << 30, RUN_BAD = 1 << 29, QMASK = (1 << QBITS) - 1;

constexpr int WRUN_HEAD = 1 << 16, WRUN_BAD = 1 << 17;

// SPARSE = 1 reuses srt_g for wrun (C * W ints per chunk) and Ainv_g for the CSR values.
__device__ __forceinline__ int* sp_wrun(int* srt_g, int blk, int C, int W) {
  return srt_g + (long long)blk * C * W;
}

template <typename A, typename I, int SPARSE>
__global__ void __launch_bounds__(512)
sdm_prepass_kernel(const I* __restrict__ wi, const A* __restrict__ aw, const I* __restrict__ ri,
                   const A* __restrict__ cw, const A* __restrict__ beta,
                   int T, int P, int W, long long S, int C, int Nt, int want_G,
                   A* __restrict__ Ainv_g, A* __restrict__ H_g, A* __restrict__ G_g,
                   int* __restrict__ srt_g, int* __restrict__ sp_ptr,
                   unsigned char* __restrict__ sp_col, int CS, int* err) {
  const int blk = blockIdx.x;                // ((b * P + p) * Nt + n)
  const int n = blk % Nt, bp = blk / Nt, p = bp % P, b = bp / P;
  const int t0 = n * C, L = min(C, T - t0), N = L * W, N2 = 2 * N;
  const int NS = SPARSE ? N : N2;   // entries sorted: the sparse form sorts the writes only
  int M2 = 1;
  while (M2 < NS) M2 <<= 1;
  const int ld = C + 1;

  extern __shared__ __align__(16) unsigned char smem[];
  unsigned long long* keys = reinterpret_cast<unsigned long long*>(smem);
  // layout: keys[M2max] | Gs, Hs, Ai [C * ld] | wq[2CW] | beta[C] | pos[2CW] | lcnt[C] | rptr[2C + 1]
  //         | nzr[C + 1] | lidx[C * C] (u8). The sparse form keeps its read slots in the upper
  //         half of keys (M2 <= M2max / 2 there).
  int M2max = 1;
  while (M2max < 2 * C * W) M2max <<= 1;
  A* Gs = reinterpret_cast<A*>(keys + M2max);
  A* Hs = Gs + C * ld;
  A* Ai = Hs + C * ld;
  A* wq_s = Ai + C * ld;            // the chunk's write weights, then its read weights
  A* bet_s = wq_s + 2 * C * W;      // the chunk's beta
  int* pos = reinterpret_cast<int*>(bet_s + C);
  int* lcnt = pos + 2 * C * W;
  int* rptr = lcnt + C;
  int* nzr = rptr + 2 * C + 1;      // rows of G with entries, ascending; nzr[C] = their count
  unsigned char* lidx = reinterpret_cast<unsigned char*>(nzr + C + 1);
  unsigned long long* rslot = keys + M2max / 2;

  const long long tok0 = ((long long)b * T + t0) * P + p;   // (b, t0, p) row of [B, T, P, W]
  // 1. keys
  for (int i = threadIdx.x; i < max(M2, N2); i += blockDim.x) {
    unsigned long long key = ~0ull;
    if (i < N2) {
      const int e = i < N ? i : i - N, t = e / W, w = e % W;
      const long long off = (tok0 + (long long)t * P) * W + w;
      const I id = i < N ? wi[off] : ri[off];
      wq_s[i] = i < N ? aw[off] : cw[off];
      unsigned long long slot;
      if (valid_id(id, S)) {
        slot = (unsigned long long)id;
      } else {
        slot = KEY_BAD;
        flag_error(err, i < N ? 1 : 2);
      }
      key = (slot << QBITS) | (unsigned long long)i;
      if (SPARSE && i >= N) rslot[i - N] = slot;
    }
    if (i < M2) keys[i] = i < NS ? key : ~0ull;
  }
  for (int i = threadIdx.x; i < C * ld; i += blockDim.x) { Gs[i] = A(0); Hs[i] = A(0); Ai[i] = A(0); }
  for (int t = threadIdx.x; t < L; t += blockDim.x) bet_s[t] = beta[((long long)b * T + t0 + t) * P + p];
  __syncthreads();
  // 2. bitonic sort of M2 keys (ascending)
  for (int k = 2; k <= M2; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < M2; i += blockDim.x) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const unsigned long long x = keys[i], y = keys[ixj];
          const bool up = (i & k) == 0;
          if ((x > y) == up) { keys[i] = y; keys[ixj] = x; }
        }
      }
      __syncthreads();
    }
  }
  // 3. runs and the inverse permutation
  for (int i = threadIdx.x; i < NS; i += blockDim.x) {
    const unsigned long long key = keys[i], slot = key >> QBITS;
    const int q = (int)(key & QMASK);
    const bool head = i == 0 || (keys[i - 1] >> QBITS) != slot;
    if (SPARSE) {
      if (q < N) {   // a write entry: link it to the next write entry of its slot
        int nxt = 0;
        if (i + 1 < NS && (keys[i + 1] >> QBITS) == slot) {
          const int q2 = (int)(keys[i + 1] & QMASK);
          if (q2 < N) nxt = q2 + 1;
        }
        sp_wrun(srt_g, blk, C, W)[q] =
            nxt | (head ? WRUN_HEAD : 0) | (slot == KEY_BAD ? WRUN_BAD : 0);
      }
    } else {
      const int code = q | (head ? RUN_HEAD : 0) | (slot == KEY_BAD ? RUN_BAD : 0);
      srt_g[(long long)blk * 2 * C * W + i] = code;
    }
    pos[q] = i;
  }
  if (SPARSE) {
    // each read entry's run of writes to its slot (binary search of the sorted writes):
    // pos[N + e] = first position | count << 16 (count 0: no write shares the slot)
    for (int e = threadIdx.x; e < N; e += blockDim.x) {
      const unsigned long long slot = rslot[e];
      int code = 0;
      if (slot != KEY_BAD) {
        int lo = 0, hi = N;
        while (lo < hi) {
          const int mid = (lo + hi) >> 1;
          if ((keys[mid] >> QBITS) < slot) lo = mid + 1; else hi = mid;
        }
        int end = lo;
        while (end < N && (keys[end] >> QBITS) == slot) ++end;
        code = lo | (end - lo) << 16;
      }
      pos[N + e] = code;
    }
  }
  __syncthreads();
  // 4. G rows (threads 0..L-1) and H rows (threads L..2L-1): walk back through the run of each
  //    of the token's entries. Writes sort before reads within a slot, in token order.
  for (int task = threadIdx.x; task < 2 * L; task += blockDim.x) {
    const bool isH = task >= L;
    const int t = isH ? task - L : task;
    for (int w = 0; w < W; ++w) {
      const int q = (isH ? N : 0) + t * W + w;
      if (SPARSE && isH) {   // walk the read's run of writes back (the dense form's order)
        const int code = pos[q], start = code & 0xFFFF;
        const A wq = wq_s[q];
        for (int p2 = start + (code >> 16) - 1; p2 >= start; --p2) {
          const int q2 = (int)(keys[p2] & QMASK);
          const int tau = q2 / W;
          if (tau > t) continue;
          Hs[t * ld + tau] += wq * wq_s[q2];
        }
        continue;
      }
      const int ps = pos[q];
      const unsigned long long slot = keys[ps] >> QBITS;
      if (slot == KEY_BAD) continue;
      const A wq = wq_s[q];
      for (int p2 = ps - 1; p2 >= 0 && (keys[p2] >> QBITS) == slot; --p2) {
        const int q2 = (int)(keys[p2] & QMASK);
        if (q2 >= N) continue;                       // a read entry (only before reads)
        const int tau = q2 / W;
        if (isH ? tau > t : tau >= t) continue;
        (isH ? Hs : Gs)[t * ld + tau] += wq * wq_s[q2];
      }
    }
  }
  __syncthreads();
  // 5. Ainv by forward substitution on the sparse rows of diag(beta) G, one column per thread
  //    (rows of G without entries leave their row of Ainv at the identity's: only the others
  //    are visited)
  build_lists(Gs, ld, L, C, lidx, lcnt, false);
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int base = 0;
    for (int h = 0; h < C; h += 32) {
      const int r = h + lane;
      const bool nz = r < L && lcnt[r] > 0;
      const unsigned m = __ballot_sync(0xffffffffu, nz);
      if (nz) nzr[base + __popc(m & ((1u << lane) - 1u))] = r;
      base += __popc(m);
    }
    if (lane == 0) nzr[C] = base;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < L; j += blockDim.x) {
    Ai[j * ld + j] = A(1);
    for (int kr = 0, nr = nzr[C]; kr < nr; ++kr) {
      const int t = nzr[kr];
      if (t <= j) continue;
      A s = A(0);
      for (int k = 0; k < lcnt[t]; ++k) {
        const int tau = lidx[t * C + k];
        if (tau >= j) s += Gs[t * ld + tau] * Ai[tau * ld + j];
      }
      Ai[t * ld + j] = -bet_s[t] * s;
    }
  }
  __syncthreads();
  const long long mo = (long long)blk * C * C;
  if (!SPARSE) {
    // 6. dense C x C outputs (rows/cols >= L are zero)
    for (int i = threadIdx.x; i < C * C; i += blockDim.x) {
      const int r = i / C, c = i % C;
      Ainv_g[mo + i] = Ai[r * ld + c];
      H_g[mo + i] = Hs[r * ld + c];
      if (want_G) G_g[mo + i] = Gs[r * ld + c];
    }
    return;
  }
  // 6'. CSR rows: r < C the strictly lower part of Ainv, r >= C row r - C of H (tau <= t).
  //     One warp per row; counts, an exclusive scan, then the entries (columns ascending).
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
  for (int pass = 0; pass < 2; ++pass) {
    for (int r = warp; r < 2 * C; r += nwarp) {
      const bool isH = r >= C;
      const int row = isH ? r - C : r;
      const A* M = isH ? Hs : Ai;
      int base = pass ? rptr[r] : 0;
      if (row < L) {
        for (int h = 0; h < C; h += 32) {
          const int k = h + lane;
          const bool in = k < L && (isH ? k <= row : k < row);
          const A v = in ? M[row * ld + k] : A(0);
          const unsigned nz = __ballot_sync(0xffffffffu, v != A(0));
          if (pass && v != A(0)) {
            const int at = base + __popc(nz & ((1u << lane) - 1u));
            sp_col[(long long)blk * CS + at] = (unsigned char)k;
            Ainv_g[mo + at] = v;
          }
          base += __popc(nz);
        }
      }
      if (!pass && lane == 0) rptr[r + 1] = base;   // the row's count, scanned below
    }
    __syncthreads();
    if (!pass) {
      if (threadIdx.x == 0) {
        rptr[0] = 0;
        for (int r = 0; r < 2 * C; ++r) rptr[r + 1] += rptr[r];
      }
      __syncthreads();
      for (int r = threadIdx.x; r <= 2 * C; r += blockDim.x)
        sp_ptr[(long long)blk * (2 * C + 1) + r] = rptr[r];
    }
  }
}

}  // namespace sdm
