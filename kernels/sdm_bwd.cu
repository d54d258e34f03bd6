// Backward of SPEC §4, rewinding the bank in place. One block per (b, p, column tile), walking
// the chunks last to first; dM (the grad of the bank at the chunk's end) lives in global memory
// and the block owns its tile of it, like the bank. Per chunk:
//   A  rewind M[i] <- snapshot (dequantized), X = sum_w a M0[i], D = sum_w a dM[i], dr, e0 = v - X
//   B  (after the rewind) dc_{t,w} += dr_t . M0[j_{t,w}]
//   u = Ainv diag(beta) e0;  e = e0 - tril(G,-1) u;  du = D + H^T dr;  z = Ainv^T du
//   dv = beta z;  dbeta_t += z_t . e_t;  dX = -beta z
//   C  da_{t,w} += u_t . dM[i] + dX_t . M0[i]
//      overlap terms of step 5 from the runs of equal slots (pre-pass sort), with
//      dG[t,tau] = -beta_t z_t . u_tau (tau < t) and dH[s,t] = dr_s . u_t (t <= s)
//   scatter dM[slot] += sum over the slot's entries of a dX_t (writes) and c dr_t (reads)
// da, dc, dbeta are dot products over hd: each tile adds its part with one atomicAdd per entry
// (so their last bits depend on the order of the tiles); dv, the bank and dM are exact owners.

#include "sdm_common.cuh"

namespace sdm {

constexpr int SB = 4;   // scatter tasks per thread whose loads are in flight together
constexpr int B_RUN_HEAD = 1 << 30, B_RUN_BAD = 1 << 29, B_QMASK = (1 << 14) - 1;

template <int N, typename A, typename T, typename ST, int Q>
struct SnapIO {
  // dequantized snapshot piece (acc values) and the bank-dtype values the rewind writes
  __device__ static void load(A (&m)[N], T (&raw)[N], const ST* __restrict__ p, float sc, int nv,
                              bool vec) {
    if constexpr (Q == 0) {
      load_raw<N>(raw, p, nv, vec);
#pragma unroll
      for (int i = 0; i < N; ++i) m[i] = to_acc(raw[i], A());
    } else if constexpr (Q == 1) {
      load_piece<N>(m, p, nv, vec);
#pragma unroll
      for (int i = 0; i < N; ++i) raw[i] = From<T>::cvt(m[i]);
    } else {
      ST q[N];
      load_raw<N>(q, p, nv, vec);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        m[i] = (A)dequant1(q[i], sc);
        raw[i] = From<T>::cvt(m[i]);
      }
    }
  }
};

template <typename A>
__device__ __forceinline__ A dot_rows(const A* x, const A* y, int n) {
  A s = A(0);
  for (int i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}

template <typename T, typename V, typename A, typename Gt, typename I, int Q, int N>
__global__ void __launch_bounds__(512)
sdm_bwd_kernel(T* __restrict__ bank, const I* __restrict__ wi, const A* __restrict__ aw,
               const V* __restrict__ vals, const A* __restrict__ beta,
               const I* __restrict__ ri, const A* __restrict__ cw,
               const A* __restrict__ Ainv_g, const A* __restrict__ H_g,
               const A* __restrict__ G_g, const int* __restrict__ srt_g,
               const typename Snap<T, Q>::type* __restrict__ snap,
               const float* __restrict__ scale, const V* __restrict__ dr,
               Gt* __restrict__ dM, A* __restrict__ d_aw, V* __restrict__ d_vals,
               A* __restrict__ d_beta, A* __restrict__ d_cw,
               int T_, int P, int hd, int W, long long S, int C, int Nt, int TW, int ntile,
               int vecmask) {
  typedef typename Snap<T, Q>::type ST;
  const int tile = blockIdx.x % ntile, bp = blockIdx.x / ntile, p = bp % P, b = bp / P;
  const int D = P * hd, c0 = tile * TW, tw = min(TW, hd - c0);
  const int NPC = (tw + N - 1) / N, TWP = ((TW + N - 1) / N) * N, ld = C + 1;
  const bool vb = vecmask & 1, vv = vecmask & 2, vr = vecmask & 4, vs = vecmask & 8,
             vg = vecmask & 16;

  extern __shared__ __align__(16) unsigned char smem[];
  A* Ai_s = reinterpret_cast<A*>(smem);
  A* H_s = Ai_s + C * ld;
  A* G_s = H_s + C * ld;
  A* E_s = G_s + C * ld;      // e0, then e
  A* U_s = E_s + C * TWP;
  A* R_s = U_s + C * TWP;     // dr
  A* D_s = R_s + C * TWP;     // sum_w a dM[i], then du
  A* Z_s = D_s + C * TWP;
  A* beta_s = Z_s + C * TWP;
  A* da_s = beta_s + C;
  A* dc_s = da_s + C * W;
  A* db_s = dc_s + C * W;
  A* aw_s = db_s + C;               // the chunk's weights and ids, staged once (-1: a bad id)
  A* cw_s = aw_s + C * W;
  int* srt_s = reinterpret_cast<int*>(cw_s + C * W);
  int* wid_s = srt_s + 2 * C * W;
  int* rid_s = wid_s + C * W;
  int* cnt = rid_s + C * W;                                       // 4 lists x C
  unsigned char* idx = reinterpret_cast<unsigned char*>(cnt + 4 * C);   // 4 lists x C*C
  int *ar_cnt = cnt, *ac_cnt = cnt + C, *hc_cnt = cnt + 2 * C, *gr_cnt = cnt + 3 * C;
  unsigned char *ar_idx = idx, *ac_idx = idx + C * C, *hc_idx = idx + 2 * C * C,
                *gr_idx = idx + 3 * C * C;

  T* bank_b = bank + (long long)b * S * D + p * hd + c0;
  Gt* dM_b = dM + (long long)b * S * D + p * hd + c0;
  for (int n = Nt - 1; n >= 0; --n) {
    const int t0 = n * C, L = min(C, T_ - t0), Ne = L * W;
    const long long chunk = (long long)bp * Nt + n;
    const long long tokb = ((long long)b * T_ + t0) * P + p;
#pragma unroll 4
    for (int i = threadIdx.x; i < L * C; i += blockDim.x) {
      const int r = i / C, c = i % C;
      Ai_s[r * ld + c] = Ainv_g[chunk * C * C + i];
      H_s[r * ld + c] = H_g[chunk * C * C + i];
      G_s[r * ld + c] = G_g[chunk * C * C + i];
    }
#pragma unroll 4
    for (int i = threadIdx.x; i < 2 * Ne; i += blockDim.x) srt_s[i] = srt_g[chunk * 2 * C * W + i];
#pragma unroll 4
    for (int i = threadIdx.x; i < Ne; i += blockDim.x) {
      da_s[i] = A(0);
      dc_s[i] = A(0);
      const long long off = (tokb + (long long)(i / W) * P) * W + i % W;
      const I iw = wi[off], ir = ri[off];
      const bool okw = valid_id(iw, S), okr = valid_id(ir, S);
      wid_s[i] = okw ? (int)iw : -1;
      aw_s[i] = okw ? aw[off] : A(0);
      rid_s[i] = okr ? (int)ir : -1;
      cw_s[i] = okr ? cw[off] : A(0);
    }
    for (int t = threadIdx.x; t < L; t += blockDim.x) {
      beta_s[t] = beta[tokb + (long long)t * P];
      db_s[t] = A(0);
    }
    __syncthreads();
    build_lists(Ai_s, ld, L, C, ar_idx, ar_cnt, false);
    build_lists(Ai_s, ld, L, C, ac_idx, ac_cnt, true);
    build_lists(H_s, ld, L, C, hc_idx, hc_cnt, true);
    build_lists(G_s, ld, L, C, gr_idx, gr_cnt, false);

    // WS threads share a (token, piece) and split its W entries (many loads in flight)
    int WS = 1;
    while (WS < 4 && WS * 2 <= W) WS *= 2;   // fixed, as in the forward
    const int total = L * NPC * WS;
    // A: rewind, X, D, dr, e0
    for (int base = 0; base < total; base += blockDim.x) {
      const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
      const bool act = task < total;
      const int t = tp / NPC, cc = (tp % NPC) * N, nv = min(N, tw - cc);
      const long long tok = tokb + (long long)t * P;
      A x[N], d[N];
#pragma unroll
      for (int i = 0; i < N; ++i) { x[i] = A(0); d[i] = A(0); }
      if (act) {
#pragma unroll 2
        for (int w = ws; w < W; w += WS) {
          const long long off = tok * W + w;
          const int id = wid_s[t * W + w];
          if (id < 0) continue;
          A m[N], g[N];
          T raw[N];
          SnapIO<N, A, T, ST, Q>::load(m, raw, snap + off * hd + c0 + cc,
                                       Q > 1 ? scale[off] : 0.f, nv, vs);
          store_raw<N>(bank_b + (long long)id * D + cc, raw, nv, vb);
          load_piece<N>(g, dM_b + (long long)id * D + cc, nv, vg);
          const A a = aw_s[t * W + w];
#pragma unroll
          for (int i = 0; i < N; ++i) { x[i] += a * m[i]; d[i] += a * g[i]; }
        }
      }
      for (int o = 1; o < WS; o <<= 1) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
          x[i] += __shfl_xor_sync(0xffffffffu, x[i], o);
          d[i] += __shfl_xor_sync(0xffffffffu, d[i], o);
        }
      }
      if (act && ws == 0) {
        A v[N], r[N];
        const long long vo = ((long long)b * T_ + t0 + t) * D + p * hd + c0 + cc;
        load_piece<N>(v, vals + vo, nv, vv);
        load_piece<N>(r, dr + vo, nv, vr);
#pragma unroll
        for (int i = 0; i < N; ++i) {
          E_s[t * TWP + cc + i] = v[i] - x[i];
          D_s[t * TWP + cc + i] = d[i];
          R_s[t * TWP + cc + i] = r[i];
        }
      }
    }
    __syncthreads();
    // B: read rows of the rewound bank (dc); u = Ainv diag(beta) e0
    for (int task = threadIdx.x; task < total; task += blockDim.x) {
      const int ws = task % WS, tp = task / WS;
      const int t = tp / NPC, cc = (tp % NPC) * N, nv = min(N, tw - cc);
      for (int w = ws; w < W; w += WS) {
        const int id = rid_s[t * W + w];
        if (id < 0) continue;
        A m[N];
        load_piece<N>(m, bank_b + (long long)id * D + cc, nv, vb);
        A s = A(0);
#pragma unroll
        for (int i = 0; i < N; ++i) s += m[i] * R_s[t * TWP + cc + i];
        atomic_add(dc_s + t * W + w, s);
      }
    }
    for (int task = threadIdx.x; task < L * NPC; task += blockDim.x) {
      const int t = task / NPC, cc = (task % NPC) * N;
      A u[N];
#pragma unroll
      for (int i = 0; i < N; ++i) u[i] = A(0);
      for (int k = 0; k < ar_cnt[t]; ++k) {
        const int tau = ar_idx[t * C + k];
        const A g = Ai_s[t * ld + tau] * beta_s[tau];
#pragma unroll
        for (int i = 0; i < N; ++i) u[i] += g * E_s[tau * TWP + cc + i];
      }
#pragma unroll
      for (int i = 0; i < N; ++i) U_s[t * TWP + cc + i] = u[i];
    }
    __syncthreads();
    // e = e0 - tril(G,-1) u ; du = D + H^T dr   (each in place on its own (t, piece))
    for (int task = threadIdx.x; task < L * NPC; task += blockDim.x) {
      const int t = task / NPC, cc = (task % NPC) * N;
      for (int k = 0; k < gr_cnt[t]; ++k) {
        const int tau = gr_idx[t * C + k];
        const A g = G_s[t * ld + tau];
#pragma unroll
        for (int i = 0; i < N; ++i) E_s[t * TWP + cc + i] -= g * U_s[tau * TWP + cc + i];
      }
      for (int k = 0; k < hc_cnt[t]; ++k) {
        const int s = hc_idx[t * C + k];
        const A h = H_s[s * ld + t];
#pragma unroll
        for (int i = 0; i < N; ++i) D_s[t * TWP + cc + i] += h * R_s[s * TWP + cc + i];
      }
    }
    __syncthreads();
    // z = Ainv^T du
    for (int task = threadIdx.x; task < L * NPC; task += blockDim.x) {
      const int t = task / NPC, cc = (task % NPC) * N;
      A z[N];
#pragma unroll
      for (int i = 0; i < N; ++i) z[i] = A(0);
      for (int k = 0; k < ac_cnt[t]; ++k) {
        const int s = ac_idx[t * C + k];
        const A g = Ai_s[s * ld + t];
#pragma unroll
        for (int i = 0; i < N; ++i) z[i] += g * D_s[s * TWP + cc + i];
      }
#pragma unroll
      for (int i = 0; i < N; ++i) Z_s[t * TWP + cc + i] = z[i];
    }
    __syncthreads();
    // dv, dbeta; C: da from dM and M0 rows
    for (int task = threadIdx.x; task < total; task += blockDim.x) {
      const int ws = task % WS, tp = task / WS;
      const int t = tp / NPC, cc = (tp % NPC) * N, nv = min(N, tw - cc);
      const long long tok = tokb + (long long)t * P;
      const A bt = beta_s[t];
      A zu[N], dx[N];
#pragma unroll
      for (int i = 0; i < N; ++i) {
        dx[i] = -bt * Z_s[t * TWP + cc + i];
        zu[i] = U_s[t * TWP + cc + i];
      }
      if (ws == 0) {
        A dv[N];
        A sb = A(0);
#pragma unroll
        for (int i = 0; i < N; ++i) {
          dv[i] = -dx[i];
          sb += Z_s[t * TWP + cc + i] * E_s[t * TWP + cc + i];
        }
        store_piece<N>(d_vals + ((long long)b * T_ + t0 + t) * D + p * hd + c0 + cc, dv, nv, vr);
        atomic_add(db_s + t, sb);
      }
      for (int w = ws; w < W; w += WS) {
        const long long off = tok * W + w;
        const int id = wid_s[t * W + w];
        if (id < 0) continue;
        A m[N], g[N];
        T raw[N];
        SnapIO<N, A, T, ST, Q>::load(m, raw, snap + off * hd + c0 + cc,
                                     Q > 1 ? scale[off] : 0.f, nv, vs);
        load_piece<N>(g, dM_b + (long long)id * D + cc, nv, vg);
        A s = A(0);
#pragma unroll
        for (int i = 0; i < N; ++i) s += zu[i] * g[i] + dx[i] * m[i];
        atomic_add(da_s + t * W + w, s);
      }
    }
    // overlap terms of step 5 (runs of length > 1 only)
    for (int ps = threadIdx.x; ps < 2 * Ne; ps += blockDim.x) {
      const int code = srt_s[ps];
      if (code & B_RUN_BAD) continue;
      const bool last = ps + 1 == 2 * Ne || (srt_s[ps + 1] & B_RUN_HEAD);
      if ((code & B_RUN_HEAD) && last) continue;
      int st = ps;
      while (!(srt_s[st] & B_RUN_HEAD)) --st;
      const int q = code & B_QMASK;
      const bool isw = q < Ne;
      const int t = (isw ? q : q - Ne) / W;
      A acc = A(0);
      for (int p2 = st; p2 < 2 * Ne; ++p2) {
        const int c2 = srt_s[p2];
        if (p2 > st && (c2 & B_RUN_HEAD)) break;
        const int q2 = c2 & B_QMASK;
        if (q2 < Ne) {                                   // a write entry (tau, w')
          const int tau = q2 / W;
          const A a2 = aw_s[q2];
          if (isw) {
            if (tau == t) continue;
            const int hi = tau > t ? tau : t, lo = tau > t ? t : tau;
            acc -= a2 * beta_s[hi] * dot_rows(Z_s + hi * TWP, U_s + lo * TWP, NPC * N);
          } else if (tau <= t) {
            acc += a2 * dot_rows(R_s + t * TWP, U_s + tau * TWP, NPC * N);
          }
        } else if (isw) {                                // a read entry (s, w'') of a write
          const int s = (q2 - Ne) / W;
          if (s < t) continue;
          const A c2w = cw_s[q2 - Ne];
          acc += c2w * dot_rows(R_s + s * TWP, U_s + t * TWP, NPC * N);
        }
      }
      atomic_add((isw ? da_s + q : dc_s + q - Ne), acc);
    }
    __syncthreads();
    // per-tile partial sums -> global; dM scatter (after every read of dM in this chunk)
    for (int i = threadIdx.x; i < Ne; i += blockDim.x) {
      const long long off = (tokb + (long long)(i / W) * P) * W + i % W;
      if (wid_s[i] >= 0) atomic_add(d_aw + off, da_s[i]);
      if (rid_s[i] >= 0) atomic_add(d_cw + off, dc_s[i]);
    }
    for (int t = threadIdx.x; t < L; t += blockDim.x) atomic_add(d_beta + tokb + (long long)t * P, db_s[t]);
    // (SB tasks per thread, their dM row loads issued before any store; distinct rows)
    for (int base = threadIdx.x; base < 2 * Ne * NPC; base += SB * blockDim.x) {
      A g[SB][N];
      Gt* row[SB];
      int pss[SB], ccs[SB], nvs[SB];
#pragma unroll
      for (int j = 0; j < SB; ++j) {
        const int task = base + j * blockDim.x;
        pss[j] = -1;
        if (task < 2 * Ne * NPC) {
          const int ps = task / NPC, code = srt_s[ps];
          ccs[j] = (task % NPC) * N;
          nvs[j] = min(N, tw - ccs[j]);
          if ((code & B_RUN_HEAD) && !(code & B_RUN_BAD)) {
            const int q = code & B_QMASK;
            pss[j] = ps;
            row[j] = dM_b + (long long)(q < Ne ? wid_s[q] : rid_s[q - Ne]) * D + ccs[j];
            load_piece<N>(g[j], row[j], nvs[j], vg);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < SB; ++j) {
        if (pss[j] < 0) continue;
        const int ps = pss[j], cc = ccs[j];
        for (int p2 = ps; p2 < 2 * Ne; ++p2) {
          const int c2 = srt_s[p2];
          if (p2 > ps && (c2 & B_RUN_HEAD)) break;
          const int q2 = c2 & B_QMASK;
          if (q2 < Ne) {
            const int t2 = q2 / W;
            const A f = -aw_s[q2] * beta_s[t2];
#pragma unroll
            for (int i = 0; i < N; ++i) g[j][i] += f * Z_s[t2 * TWP + cc + i];
          } else {
            const int t2 = (q2 - Ne) / W;
            const A f = cw_s[q2 - Ne];
#pragma unroll
            for (int i = 0; i < N; ++i) g[j][i] += f * R_s[t2 * TWP + cc + i];
          }
        }
        store_piece<N>(row[j], g[j], nvs[j], vg);
      }
    }
    __syncthreads();
  }
}

}  // namespace sdm
