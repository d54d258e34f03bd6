// Chunked forward of SPEC §3. One block per (b, p, column tile); it walks the chunks of its
// (b, p) in order and owns its tile of the bank rows, so its scatter needs no atomics.
// Per chunk (L <= C tokens, matrices from sdm_prepass.cu):
//   gather   X_t = sum_w a_{t,w} M0[i_{t,w}],  Y_t = sum_w c_{t,w} M0[j_{t,w}]   (16-byte pieces)
//            and, when saving, the snapshot rows M0[i_{t,w}] (quantized for Q > 0)
//   w0_t     = beta_t (v_t - X_t)
//   u        = Ainv w0                        (sparse rows of Ainv, built in shared memory)
//   r_t      = Y_t + sum_{tau<=t} H[t,tau] u_tau  -> readings
//   scatter  M[slot] = M0[slot] + sum over the slot's write entries of a_{t,w} u_t, one thread
//            per (slot, piece): the run head of the slot's sorted entries.
// Ids outside [0, S) are skipped (the pre-pass flags them).

#include "sdm_common.cuh"

namespace sdm {

// threads splitting a token's W entries: fixed (not from the tile), so that the summation
// order, hence the readings, do not depend on the tiling or the snapshot mode
constexpr int WS_MAX = 4;
constexpr int SB = 4;   // scatter tasks per thread whose loads are in flight together
constexpr int F_RUN_HEAD = 1 << 30, F_RUN_BAD = 1 << 29, F_QMASK = (1 << 14) - 1;

template <typename T, typename V, typename A, typename I, int Q, int N>
__global__ void __launch_bounds__(512)
sdm_fwd_kernel(T* __restrict__ bank, const I* __restrict__ wi, const A* __restrict__ aw,
               const V* __restrict__ vals, const A* __restrict__ beta,
               const I* __restrict__ ri, const A* __restrict__ cw,
               const A* __restrict__ Ainv_g, const A* __restrict__ H_g,
               const int* __restrict__ srt_g, V* __restrict__ out,
               typename Snap<T, Q>::type* __restrict__ snap, float* __restrict__ scale,
               int T_, int P, int hd, int W, long long S, int C, int Nt, int TW, int ntile,
               int save, int vecmask) {
  typedef typename Snap<T, Q>::type ST;
  const int tile = blockIdx.x % ntile, bp = blockIdx.x / ntile, p = bp % P, b = bp / P;
  const int D = P * hd, c0 = tile * TW, tw = min(TW, hd - c0);
  const int NPC = (tw + N - 1) / N, TWP = ((TW + N - 1) / N) * N, ld = C + 1;
  const bool vb = vecmask & 1, vv = vecmask & 2, vo = vecmask & 4, vs = vecmask & 8;

  extern __shared__ __align__(16) unsigned char smem[];
  A* Ai_s = reinterpret_cast<A*>(smem);
  A* H_s = Ai_s + C * ld;
  A* X_s = H_s + C * ld;            // X, then w0 = beta (v - X)
  A* Y_s = X_s + C * TWP;
  A* U_s = Y_s + C * TWP;
  A* beta_s = U_s + C * TWP;
  A* aw_s = beta_s + C;             // the chunk's weights and ids, staged once (-1: a bad id)
  A* cw_s = aw_s + C * W;
  float* amax_s = reinterpret_cast<float*>(cw_s + C * W);     // C*W (quantized modes)
  int* srt_s = reinterpret_cast<int*>(amax_s + (Q > 1 ? C * W : 0));
  int* pos_s = srt_s + 2 * C * W;
  int* wid_s = pos_s + C * W;
  int* rid_s = wid_s + C * W;
  int* a_cnt = rid_s + C * W;
  int* h_cnt = a_cnt + C;
  unsigned char* a_idx = reinterpret_cast<unsigned char*>(h_cnt + C);
  unsigned char* h_idx = a_idx + C * C;

  T* bank_b = bank + (long long)b * S * D + p * hd + c0;
  for (int n = 0; n < Nt; ++n) {
    const int t0 = n * C, L = min(C, T_ - t0), Ne = L * W;
    const long long chunk = (long long)bp * Nt + n;
    const long long tokb = ((long long)b * T_ + t0) * P + p;     // [B, T, P] row of token t0
#pragma unroll 4
    for (int i = threadIdx.x; i < L * C; i += blockDim.x) {
      const int r = i / C, c = i % C;
      Ai_s[r * ld + c] = Ainv_g[chunk * C * C + i];
      H_s[r * ld + c] = H_g[chunk * C * C + i];
    }
#pragma unroll 4
    for (int i = threadIdx.x; i < 2 * Ne; i += blockDim.x) {
      const int code = srt_g[chunk * 2 * C * W + i];
      srt_s[i] = code;
      const int q = code & F_QMASK;
      if (q < Ne) pos_s[q] = i;
    }
    for (int t = threadIdx.x; t < L; t += blockDim.x) beta_s[t] = beta[tokb + (long long)t * P];
#pragma unroll 4
    for (int i = threadIdx.x; i < Ne; i += blockDim.x) {
      const long long off = (tokb + (long long)(i / W) * P) * W + i % W;
      const I iw = wi[off], ir = ri[off];
      const bool okw = valid_id(iw, S), okr = valid_id(ir, S);
      wid_s[i] = okw ? (int)iw : -1;
      aw_s[i] = okw ? aw[off] : A(0);
      rid_s[i] = okr ? (int)ir : -1;
      cw_s[i] = okr ? cw[off] : A(0);
    }
    if (Q > 1)
      for (int i = threadIdx.x; i < Ne; i += blockDim.x) amax_s[i] = 0.f;
    __syncthreads();
    build_lists(Ai_s, ld, L, C, a_idx, a_cnt, false);
    build_lists(H_s, ld, L, C, h_idx, h_cnt, false);

    // gather (every write row once: X and the snapshot; every read row once: Y). WS threads
    // share a (token, piece) and split its W entries, so that a block keeps many independent
    // 16-byte loads in flight; their partial sums meet through warp shuffles.
    {
      const int TP = L * NPC;
      int WS = 1;
      while (WS < WS_MAX && WS * 2 <= W) WS *= 2;
      const int total = TP * WS;
      for (int base = 0; base < total; base += blockDim.x) {
        const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
        const bool act = task < total;
        const int t = tp / NPC, cc = (tp % NPC) * N, nv = min(N, tw - cc);
        const long long tok = tokb + (long long)t * P;
        A x[N], y[N];
#pragma unroll
        for (int i = 0; i < N; ++i) { x[i] = A(0); y[i] = A(0); }
        if (act) {
#pragma unroll 4
          for (int w = ws; w < W; w += WS) {
            const long long off = tok * W + w;
            const int id = wid_s[t * W + w];
            T m[N];
            if (id >= 0) load_raw<N>(m, bank_b + (long long)id * D + cc, nv, vb);
            else {
#pragma unroll
              for (int i = 0; i < N; ++i) m[i] = From<T>::cvt(0.0f);
            }
            const A a = aw_s[t * W + w];
#pragma unroll
            for (int i = 0; i < N; ++i) x[i] = fma_(a, to_acc(m[i], A()), x[i]);
            if (save) {
              if constexpr (Q == 0) {
                store_raw<N>(snap + off * hd + c0 + cc, m, nv, vs);
              } else if constexpr (Q == 1) {
                A mv[N];
#pragma unroll
                for (int i = 0; i < N; ++i) mv[i] = to_acc(m[i], A());
                store_piece<N>(snap + off * hd + c0 + cc, mv, nv, vs);
              } else {
                float mx = 0.f;
#pragma unroll
                for (int i = 0; i < N; ++i) mx = fmaxf(mx, fabsf((float)to_acc(m[i], A())));
                if (id >= 0) atomicMax(reinterpret_cast<int*>(amax_s + t * W + w), __float_as_int(mx));
              }
            }
          }
#pragma unroll 4
          for (int w = ws; w < W; w += WS) {
            const int id = rid_s[t * W + w];
            if (id < 0) continue;
            A m[N];
            load_piece<N>(m, bank_b + (long long)id * D + cc, nv, vb);
            const A c = cw_s[t * W + w];
#pragma unroll
            for (int i = 0; i < N; ++i) y[i] = fma_(c, m[i], y[i]);
          }
        }
        for (int o = 1; o < WS; o <<= 1) {
#pragma unroll
          for (int i = 0; i < N; ++i) {
            x[i] = add_(x[i], __shfl_xor_sync(0xffffffffu, x[i], o));
            y[i] = add_(y[i], __shfl_xor_sync(0xffffffffu, y[i], o));
          }
        }
        if (act && ws == 0) {
#pragma unroll
          for (int i = 0; i < N; ++i) { X_s[t * TWP + cc + i] = x[i]; Y_s[t * TWP + cc + i] = y[i]; }
        }
      }
    }
    __syncthreads();

    if constexpr (Q > 1) if (save) {  // second pass over the write rows (still M0): absmax-scaled bytes
      for (int task = threadIdx.x; task < L * NPC; task += blockDim.x) {
        const int t = task / NPC, cc = (task % NPC) * N, nv = min(N, tw - cc);
        const long long tok = tokb + (long long)t * P;
        for (int w = 0; w < W; ++w) {
          const long long off = tok * W + w;
          const int id = wid_s[t * W + w];
          const float mx = amax_s[t * W + w];
          const float inv = mx > 0.f ? QMax<Q>::v / mx : 0.f;
          A m[N];
          if (id >= 0) load_piece<N>(m, bank_b + (long long)id * D + cc, nv, vb);
          else {
#pragma unroll
            for (int i = 0; i < N; ++i) m[i] = A(0);
          }
          ST qv[N];
#pragma unroll
          for (int i = 0; i < N; ++i) qv[i] = quant1((float)m[i], inv, ST());
          store_raw<N>(snap + off * hd + c0 + cc, qv, nv, vs);
          if (cc == 0 && tile == 0) scale[off] = mx / QMax<Q>::v;
        }
      }
    }

    // w0 = beta (v - X)
    for (int task = threadIdx.x; task < L * NPC; task += blockDim.x) {
      const int t = task / NPC, cc = (task % NPC) * N, nv = min(N, tw - cc);
      A v[N];
      load_piece<N>(v, vals + ((long long)b * T_ + t0 + t) * D + p * hd + c0 + cc, nv, vv);
      const A bt = beta_s[t];
#pragma unroll
      for (int i = 0; i < N; ++i) X_s[t * TWP + cc + i] = mul_(bt, sub_(v[i], X_s[t * TWP + cc + i]));
    }
    __syncthreads();
    // u = Ainv w0
    for (int task = threadIdx.x; task < L * NPC; task += blockDim.x) {
      const int t = task / NPC, cc = (task % NPC) * N;
      A u[N];
#pragma unroll
      for (int i = 0; i < N; ++i) u[i] = A(0);
      for (int k = 0; k < a_cnt[t]; ++k) {
        const int tau = a_idx[t * C + k];
        const A g = Ai_s[t * ld + tau];
#pragma unroll
        for (int i = 0; i < N; ++i) u[i] = fma_(g, X_s[tau * TWP + cc + i], u[i]);
      }
#pragma unroll
      for (int i = 0; i < N; ++i) U_s[t * TWP + cc + i] = u[i];
    }
    __syncthreads();
    // readings r = Y + H u
    for (int task = threadIdx.x; task < L * NPC; task += blockDim.x) {
      const int t = task / NPC, cc = (task % NPC) * N, nv = min(N, tw - cc);
      A r[N];
#pragma unroll
      for (int i = 0; i < N; ++i) r[i] = Y_s[t * TWP + cc + i];
      for (int k = 0; k < h_cnt[t]; ++k) {
        const int tau = h_idx[t * C + k];
        const A h = H_s[t * ld + tau];
#pragma unroll
        for (int i = 0; i < N; ++i) r[i] = fma_(h, U_s[tau * TWP + cc + i], r[i]);
      }
      store_piece<N>(out + ((long long)b * T_ + t0 + t) * D + p * hd + c0 + cc, r, nv, vo);
    }
    // scatter: the run head of each written slot rewrites the row once. A thread takes SB
    // tasks at a time and issues their row loads before any store (distinct rows: no alias).
    for (int base = threadIdx.x; base < Ne * NPC; base += SB * blockDim.x) {
      A m[SB][N];
      T* row[SB];
      int pss[SB], ccs[SB], nvs[SB];
#pragma unroll
      for (int j = 0; j < SB; ++j) {
        const int task = base + j * blockDim.x;
        pss[j] = -1;
        if (task < Ne * NPC) {
          const int e = task / NPC, ps = pos_s[e], code = srt_s[ps];
          ccs[j] = (task % NPC) * N;
          nvs[j] = min(N, tw - ccs[j]);
          if ((code & F_RUN_HEAD) && !(code & F_RUN_BAD)) {
            pss[j] = ps;
            row[j] = bank_b + (long long)wid_s[e] * D + ccs[j];
            load_piece<N>(m[j], row[j], nvs[j], vb);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < SB; ++j) {
        if (pss[j] < 0) continue;
        const int ps = pss[j], cc = ccs[j];
        for (int p2 = ps; p2 < 2 * Ne; ++p2) {
          const int code2 = srt_s[p2];
          if (p2 > ps && (code2 & F_RUN_HEAD)) break;
          const int q2 = code2 & F_QMASK;
          if (q2 >= Ne) break;                    // the slot's reads follow its writes
          const int t2 = q2 / W;
          const A a2 = aw_s[q2];
#pragma unroll
          for (int i = 0; i < N; ++i) m[j][i] = fma_(a2, U_s[t2 * TWP + cc + i], m[j][i]);
        }
        store_piece<N>(row[j], m[j], nvs[j], vb);
      }
    }
    __syncthreads();
  }
}

}  // namespace sdm
