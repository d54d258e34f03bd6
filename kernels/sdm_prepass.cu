// Pre-pass of SPEC §3/§4: everything of a chunk that depends on ids and weights only, not on
// the bank, for all chunks at once (one block per (b, p, chunk)).
//
//   srt  : the chunk's write entries q = t*W + w (q < N) and read entries q = N + t*W + w,
//          sorted by (slot, q); bit 30 marks the first entry of a run of equal slots, bit 29 a
//          slot id outside [0, S) (those sort last and are skipped by every kernel).
//   G    : G[t][tau] = k_t . k_tau for tau < t (strictly lower), from the runs of equal slots,
//   H    : H[t][tau] = q_t . k_tau for tau <= t,
//   Ainv : (I + diag(beta) tril(G, -1))^{-1}, unit lower triangular (the WY form: u = Ainv *
//          diag(beta) (v - X)).
// Overlaps come from the sort (bitonic, in shared memory), never from the C^2 W^2 pairs.
// Each token row of G and H is accumulated by one thread in a fixed order: deterministic.

#include "sdm_common.cuh"

namespace sdm {

constexpr unsigned long long KEY_BAD = 1ull << 40;   // slot key of an out-of-range id
constexpr int QBITS = 14;                           // 2 * C * W <= 8192 < 2^14
constexpr int RUN_HEAD = 1 << 30, RUN_BAD = 1 << 29, QMASK = (1 << QBITS) - 1;

template <typename A, typename I>
__global__ void __launch_bounds__(512)
sdm_prepass_kernel(const I* __restrict__ wi, const A* __restrict__ aw, const I* __restrict__ ri,
                   const A* __restrict__ cw, const A* __restrict__ beta,
                   int T, int P, int W, long long S, int C, int Nt, int want_G,
                   A* __restrict__ Ainv_g, A* __restrict__ H_g, A* __restrict__ G_g,
                   int* __restrict__ srt_g, int* err) {
  const int blk = blockIdx.x;                // ((b * P + p) * Nt + n)
  const int n = blk % Nt, bp = blk / Nt, p = bp % P, b = bp / P;
  const int t0 = n * C, L = min(C, T - t0), N = L * W, N2 = 2 * N;
  int M2 = 1;
  while (M2 < N2) M2 <<= 1;
  const int ld = C + 1;

  extern __shared__ __align__(16) unsigned char smem[];
  unsigned long long* keys = reinterpret_cast<unsigned long long*>(smem);
  // layout: keys[M2max] | Gs, Hs, Ai [C * ld] | pos[2CW] | lcnt[C] | lidx[C * C] (u8)
  int M2max = 1;
  while (M2max < 2 * C * W) M2max <<= 1;
  A* Gs = reinterpret_cast<A*>(keys + M2max);
  A* Hs = Gs + C * ld;
  A* Ai = Hs + C * ld;
  int* pos = reinterpret_cast<int*>(Ai + C * ld);
  int* lcnt = pos + 2 * C * W;
  unsigned char* lidx = reinterpret_cast<unsigned char*>(lcnt + C);

  const long long tok0 = ((long long)b * T + t0) * P + p;   // (b, t0, p) row of [B, T, P, W]
  // 1. keys
  for (int i = threadIdx.x; i < M2; i += blockDim.x) {
    unsigned long long key = ~0ull;
    if (i < N2) {
      const int e = i < N ? i : i - N, t = e / W, w = e % W;
      const long long off = (tok0 + (long long)t * P) * W + w;
      const I id = i < N ? wi[off] : ri[off];
      unsigned long long slot;
      if (valid_id(id, S)) {
        slot = (unsigned long long)id;
      } else {
        slot = KEY_BAD;
        flag_error(err, i < N ? 1 : 2);
      }
      key = (slot << QBITS) | (unsigned long long)i;
    }
    keys[i] = key;
  }
  for (int i = threadIdx.x; i < C * ld; i += blockDim.x) { Gs[i] = A(0); Hs[i] = A(0); Ai[i] = A(0); }
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
  int* srt_out = srt_g + (long long)blk * 2 * C * W;
  for (int i = threadIdx.x; i < N2; i += blockDim.x) {
    const unsigned long long key = keys[i], slot = key >> QBITS;
    const int q = (int)(key & QMASK);
    const bool head = i == 0 || (keys[i - 1] >> QBITS) != slot;
    const int code = q | (head ? RUN_HEAD : 0) | (slot == KEY_BAD ? RUN_BAD : 0);
    srt_out[i] = code;
    pos[q] = i;
  }
  __syncthreads();
  // 4. G rows (threads 0..L-1) and H rows (threads L..2L-1): walk back through the run of each
  //    of the token's entries. Writes sort before reads within a slot, in token order.
  for (int task = threadIdx.x; task < 2 * L; task += blockDim.x) {
    const bool isH = task >= L;
    const int t = isH ? task - L : task;
    for (int w = 0; w < W; ++w) {
      const int q = (isH ? N : 0) + t * W + w;
      const int ps = pos[q];
      const unsigned long long slot = keys[ps] >> QBITS;
      if (slot == KEY_BAD) continue;
      const long long off = (tok0 + (long long)t * P) * W + w;
      const A wq = isH ? cw[off] : aw[off];
      for (int p2 = ps - 1; p2 >= 0 && (keys[p2] >> QBITS) == slot; --p2) {
        const int q2 = (int)(keys[p2] & QMASK);
        if (q2 >= N) continue;                       // a read entry (only before reads)
        const int tau = q2 / W;
        if (isH ? tau > t : tau >= t) continue;
        const long long off2 = (tok0 + (long long)tau * P) * W + q2 % W;
        (isH ? Hs : Gs)[t * ld + tau] += wq * aw[off2];
      }
    }
  }
  __syncthreads();
  // 5. Ainv by forward substitution on the sparse rows of diag(beta) G, one column per thread
  build_lists(Gs, ld, L, C, lidx, lcnt, false);
  __syncthreads();
  const A* bet = beta + ((long long)b * T + t0) * P + p;
  for (int j = threadIdx.x; j < L; j += blockDim.x) {
    Ai[j * ld + j] = A(1);
    for (int t = j + 1; t < L; ++t) {
      A s = A(0);
      for (int k = 0; k < lcnt[t]; ++k) {
        const int tau = lidx[t * C + k];
        if (tau >= j) s += Gs[t * ld + tau] * Ai[tau * ld + j];
      }
      Ai[t * ld + j] = -bet[(long long)t * P] * s;
    }
  }
  __syncthreads();
  // 6. dense C x C outputs (rows/cols >= L are zero)
  const long long mo = (long long)blk * C * C;
  for (int i = threadIdx.x; i < C * C; i += blockDim.x) {
    const int r = i / C, c = i % C;
    Ainv_g[mo + i] = Ai[r * ld + c];
    H_g[mo + i] = Hs[r * ld + c];
    if (want_G) G_g[mo + i] = Gs[r * ld + c];
  }
}

}  // namespace sdm
