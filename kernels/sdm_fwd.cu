// Chunked forward of SPEC §3. One block per (b, p, column tile); it walks the chunks of its
// (b, p) in order and owns its tile of the bank rows, so its scatter needs no atomics.
//
// Everything of a chunk that does not depend on the bank (ids, weights, beta, the values tile,
// the write-run links and the CSR rows of Ainv and H from sdm_prepass.cu with SPARSE = 1) is
// copied into shared memory with cp.async one chunk ahead, while the previous chunk computes;
// a chunk then costs one round trip to global memory (its gathers) and fire-and-forget stores.
// Per chunk (L <= C tokens):
//   gather   X_t = sum_w a_{t,w} M0[i_{t,w}],  Y_t = sum_w c_{t,w} M0[j_{t,w}]   (16-byte pieces)
//            and, when saving, the snapshot rows M0[i_{t,w}] (quantized for Q > 0); the rows
//            that head their slot's writes stay in shared memory for the scatter (`keep`)
//   w0_t     = beta_t (v_t - X_t)
//   u_t      = sum_{tau<t} Ainv[t,tau] w0_tau + w0_t        (CSR rows)
//   r_t      = Y_t + sum_{tau<=t} H[t,tau] u_tau  -> readings
//   scatter  M[slot] = M0[slot] + sum over the slot's write entries of a_{t,w} u_t (ascending
//            entries), one thread per (slot, piece): the entry that heads the slot's writes.
// Ids outside [0, S) are skipped (the pre-pass flags them). With `fuse` (C == 1, decoding) the
// kernel finds the token's write-run links and H[0][0] itself and no pre-pass runs.

#include "sdm_common.cuh"

namespace sdm {

// threads splitting a token's W entries: fixed (not from the tile), so that the summation
// order, hence the readings, do not depend on the tiling or the snapshot mode. 2 rather than 4
// (stop 15, H200 headline: forward -2.2%; 8: +31%); benchmarks may override it (another
// summation order: readings not bitwise equal). kernels/gpu.py's _fuse_threads follows it.
#ifndef SDM_FWD_WS_MAX
#define SDM_FWD_WS_MAX 2
#endif
constexpr int WS_MAX = SDM_FWD_WS_MAX;
constexpr int SB = 4;        // scatter tasks per thread whose loads are in flight together
#ifndef SDM_FWD_GU
#define SDM_FWD_GU 2
#endif
constexpr int GU = SDM_FWD_GU;  // entries per step of the gather's fast path
// entries per step of the staged X/Y loop (1: rolled; stop 33, NVRTC sm_90: the headline
// instance 4,424 instructions rolled, 4,648 as the compiler unrolled it; benchmarks may
// override it)
#ifndef SDM_FWD_XY_UNROLL
#define SDM_FWD_XY_UNROLL 1
#endif
constexpr int GR = 4;           // read rows per step when the write rows go through cp.async
constexpr int E_STAGE = 512; // CSR entries of a chunk staged in shared memory (more: read from L2)
constexpr int W_HEAD = 1 << 16, W_BAD = 1 << 17, W_NEXT = 0xFFFF;

// Shared-memory layout of the forward (kernels/gpu.py's _smem mirrors it: every region is
// rounded up to 16 bytes, in this order).
// One piece of a snapshot row in the exact (Q = 0) or bf16 (Q = 1) mode; the 1-byte modes
// need their row's absmax first and are written by a second pass.
template <int Q, typename A, typename ST, typename T, int N>
__device__ __forceinline__ void save_piece(ST* __restrict__ p, const T (&m)[N], int nv, bool vec) {
  if constexpr (Q == 0) {
    store_raw<N>(p, m, nv, vec);
  } else if constexpr (Q == 1) {
    A mv[N];
#pragma unroll
    for (int i = 0; i < N; ++i) mv[i] = to_acc(m[i], A());
    store_piece<N>(p, mv, nv, vec);
  }
}

template <typename T, typename V, typename A, typename I>
struct FwdStage {
  A* aw; A* cw; A* beta; A* ev; I* wid; I* rid; V* val; int* ptr; int* wrun; unsigned char* ec;
  __device__ unsigned char* carve(unsigned char* p, int C, int W, int TVP) {
    aw = reinterpret_cast<A*>(p);    p += r16((long long)C * W * sizeof(A));
    cw = reinterpret_cast<A*>(p);    p += r16((long long)C * W * sizeof(A));
    beta = reinterpret_cast<A*>(p);  p += r16((long long)C * sizeof(A));
    ev = reinterpret_cast<A*>(p);    p += r16((long long)E_STAGE * sizeof(A));
    wid = reinterpret_cast<I*>(p);   p += r16((long long)C * W * sizeof(I));
    rid = reinterpret_cast<I*>(p);   p += r16((long long)C * W * sizeof(I));
    val = reinterpret_cast<V*>(p);   p += r16((long long)C * TVP * sizeof(V));
    ptr = reinterpret_cast<int*>(p); p += r16((long long)(2 * C + 1) * 4);
    wrun = reinterpret_cast<int*>(p); p += r16((long long)C * W * 4);
    ec = p;                          p += r16(E_STAGE);
    return p;
  }
};

// Experiment (benchmarks/fwd_ab.py only, -DSDM_FWD_CLUSTER=ntile): the ntile blocks of one
// (b, p) form a thread-block cluster; block `rank` gathers whole rows for the tokens
// t = rank (mod ntile), computes their X, Y and snapshots over the full width with the same
// per-column arithmetic, and the blocks read their tile's pieces (w0, Y, kept rows) from the
// owners' shared memory. Traps unless every tile is whole and C is a multiple of ntile.
#ifdef SDM_FWD_CLUSTER
#define SDM_FWD_CLUSTER_ATTR __cluster_dims__(SDM_FWD_CLUSTER, 1, 1)
#else
#define SDM_FWD_CLUSTER_ATTR
#endif

// mW, mNPC, mNPC_last: FastDiv's multipliers of W and of NPC (a full tile, the last tile),
// computed by the launcher. As kernel parameters they sit in the constant bank; computed here
// they took registers that the kernel, at its 128-register cap, spilled (NVRTC, headline
// instance: 20/76 bytes of spill stores/loads before, 4/12 now). Measured on an H200 (stop 15,
// RESULTS.md): forward 1.391 -> 1.376 ms, forward+backward 5.136 -> 4.977 ms, bitwise equal.
// RS = 1: the read rows of a chunk go through shared memory too (cp.async, every piece in
// flight at once, beside the kept write rows), on the fast path; the launcher sizes the tiles
// for one 512-thread block per SM (gpu.STAGE_READS). A template parameter rather than a flag:
// the register gather's code in the same instance cost registers and spills (stop 18).
// SUB = 1 (Q = 0 only): the instance that writes sub-chunk snapshots (CB > 0; the launcher
// passes CB = 0 to every other instance). Its code in every instance cost the forward 2.8%
// where no sub-chunk runs (H100, stop 27).
template <typename T, typename V, typename A, typename I, int Q, int N, int RS = 0, int SUB = 0>
__global__ void __launch_bounds__(512) SDM_FWD_CLUSTER_ATTR
sdm_fwd_kernel(T* __restrict__ bank, const I* __restrict__ wi, const A* __restrict__ aw,
               const V* __restrict__ vals, const A* __restrict__ beta,
               const I* __restrict__ ri, const A* __restrict__ cw,
               const int* __restrict__ sp_ptr, const unsigned char* __restrict__ sp_col,
               const A* __restrict__ sp_val, const int* __restrict__ wrun_g,
               V* __restrict__ out, typename Snap<T, Q>::type* __restrict__ snap,
               float* __restrict__ scale,
               int T_, int P, int hd, int W, long long S, int C, int Nt, int TW, int ntile,
               int save, int vecmask, int keep, int CS, int fuse, int CB, int* err,
               unsigned mW, unsigned mNPC, unsigned mNPC_last) {
  typedef typename Snap<T, Q>::type ST;
  const int tile = blockIdx.x % ntile, bp = blockIdx.x / ntile, p = bp % P, b = bp / P;
#ifdef SDM_FWD_STAGGER
  SDM_STAGGER(bp, SDM_FWD_STAGGER);
#endif
  const int D = P * hd, c0 = tile * TW, tw = min(TW, hd - c0);
  const int NPC = (tw + N - 1) / N, TWP = ((TW + N - 1) / N) * N, TVP = (TWP + 7) & ~7;
  const bool vb = vecmask & 1, vo = vecmask & 4, vs = vecmask & 8, v16 = vecmask & 32;
  constexpr int NV = 16 / sizeof(V);   // values per 16-byte copy
  // RS = 1 instances hold the fast path alone: kernels/gpu.py's sdm_fwd picks them only for
  // an aligned bank (and snapshots) cut into whole 16-byte pieces, with kept rows, Q <= 1 and
  // no fuse. Without the general gather's code the instance is a fifth smaller and spills 4/4
  // bytes instead of 12/52 (stop 19, H200 headline: forward 1.078 -> 1.014 ms, bitwise equal).
  // A device-side check of those conditions (__trap) let the compiler specialize further and
  // cost half of that gain (1.034 ms), so the launcher's rule is the only guard.
  constexpr bool FIX = RS != 0;
  // ... and kept rows without the one-token fusion: tests/test_launch_args.py asserts keep = 1
  // and fuse = 0 for every RS = 1 launch, so these instances take both as compile-time facts
  // (the scatter that re-reads its rows and the fused link search are not compiled there)
  const bool kept = FIX || keep, fused = !FIX && fuse;
#ifdef SDM_FWD_GENERAL_GATHER   // benchmarks: the general path only, for comparison
  const bool fast = false;
#else
  const bool fast = FIX || (vb && (vs || !save) && tw % N == 0);
#endif
#ifdef SDM_FWD_REG_GATHER   // benchmarks: write rows through registers too, for comparison
  const bool rowcp = false;
#else
  const bool rowcp = FIX ? fast : fast && kept && Q <= 1;
#endif
  const bool rstage = RS && rowcp;
  // LATE (the staged instance's split-wait gather): chunk n+1's bank-independent copies are
  // issued after chunk n's row copies instead of before them, so that the row copies, which
  // every later step waits on, leave first; chunk n+1 waits for its copies at its start
  // (issued a whole gather earlier). Stop 35, H100 headline, graph replays: forward 0.945 ->
  // 0.935 ms at W = 16, 0.567 -> 0.534 at W = 8, bitwise equal; -DSDM_FWD_EARLY_PF: before.
  // Only for 2-byte banks: with float32 rows (twice the bytes per row copy) the late copies
  // cost 3% (stop 36, H100, W = 16: 1.670 ms early, 1.720 late), while 2-byte banks gained at
  // every shape tried (W = 4: -11%, W = 32: -2.4%, S = 4096: -0.5%); -DSDM_FWD_LATE_WIDE: late
  // for every bank type (the stop 35 form)
#if !defined(SDM_FWD_EARLY_PF) && !defined(SDM_FWD_ONE_WAIT) && !defined(SDM_FWD_REG_GATHER) && \
    !defined(SDM_FWD_GENERAL_GATHER) && !defined(SDM_FWD_CLUSTER)
#ifdef SDM_FWD_LATE_WIDE
  constexpr bool LATE = FIX;
#else
  constexpr bool LATE = FIX && sizeof(T) == 2;
#endif
#else
  constexpr bool LATE = false;
#endif
#ifdef SDM_FWD_CLUSTER
  constexpr int CL = SDM_FWD_CLUSTER;
  if (CB > 0) __trap();   // its kept rows are whole rows: the sub-chunk pass reads tiles
  if (!(rowcp && !fused && ntile == CL && TW * CL == hd && C % CL == 0 &&
        (int)cluster_rank() == tile))
    __trap();
#endif

  extern __shared__ __align__(16) unsigned char smem[];
  FwdStage<T, V, A, I> st;
  const long long stage_bytes = st.carve(smem, C, W, TVP) - smem;
  unsigned char* sp = smem + 2 * stage_bytes;
  A* X_s = reinterpret_cast<A*>(sp);  sp += r16((long long)C * TWP * sizeof(A));  // w0
  A* Y_s = reinterpret_cast<A*>(sp);  sp += r16((long long)C * TWP * sizeof(A));
  A* U_s = reinterpret_cast<A*>(sp);  sp += r16((long long)C * TWP * sizeof(A));
  float* amax_s = reinterpret_cast<float*>(sp);
  sp += Q > 1 ? r16((long long)C * W * 4) : 0;
  T* keep_s = reinterpret_cast<T*>(sp);   // C*W rows of TWP (only when keep)
  T* rkeep_s = keep_s + (long long)C * W * TWP;   // the read rows, C*W rows of TWP (rstage)

  T* bank_b = bank + (long long)b * S * D + p * hd + c0;
  const FastDiv divW(W, mW), divNPC(NPC, tile == ntile - 1 ? mNPC_last : mNPC);
  const int E_cap = min(E_STAGE, C * C);

  // issue the copies of chunk n's bank-independent data into stage s (one commit group)
  auto stage = [&](int n) {
    FwdStage<T, V, A, I> g;
    g.carve(smem + (n & 1) * stage_bytes, C, W, TVP);
    return g;
  };
  auto prefetch = [&](int n) {
    const FwdStage<T, V, A, I> g = stage(n);
    const int t0 = n * C, L = min(C, T_ - t0), Ne = L * W;
    const long long chunk = (long long)bp * Nt + n;
    const long long tokb = ((long long)b * T_ + t0) * P + p;
    // a token's W entries are contiguous in [B, T, P, W]: one row per token, P * W apart
    // the staged instances copy the four arrays together (cp_rows4_pow2; in the RS = 0
    // instances the joint form raised NVRTC's spills, e.g. 12/52 -> 108/300 bytes with
    // sub-chunk snapshots); -DSDM_FWD_ROWS_EACH: one cp_rows_pow2 per array everywhere
#ifndef SDM_FWD_ROWS_EACH
    if constexpr (sizeof(I) == sizeof(A) && RS != 0) {
      cp_rows4_pow2(g.wid, wi + tokb * W, g.rid, ri + tokb * W, g.aw, aw + tokb * W, g.cw,
                    cw + tokb * W, L, W, (long long)P * W);
    } else
#endif
    {
      cp_rows_pow2(g.wid, wi + tokb * W, L, W, (long long)P * W);
      cp_rows_pow2(g.rid, ri + tokb * W, L, W, (long long)P * W);
      cp_rows_pow2(g.aw, aw + tokb * W, L, W, (long long)P * W);
      cp_rows_pow2(g.cw, cw + tokb * W, L, W, (long long)P * W);
    }
    for (int j = threadIdx.x; j < L; j += blockDim.x) cp_elem(g.beta + j, beta + tokb + (long long)j * P);
    if (!fused) {
      cp_rows_pow2(g.wrun, wrun_g + chunk * C * W, 1, Ne, 0);
      cp_rows_pow2(g.ptr, sp_ptr + chunk * (2 * C + 1), 1, 2 * C + 1, 0);
      cp_rows_pow2(g.ev, sp_val + chunk * C * C, 1, E_cap, 0);
      // whole 16-byte pieces: r16(E_cap) <= CS, inside the chunk's columns and the stage
      cp_rows_pow2(g.ec, sp_col + chunk * CS, 1, (int)r16(E_cap), 0);
    }
    const V* vrow = vals + ((long long)b * T_ + t0) * D + p * hd + c0;
    if (v16) {
      const int pcs = tw / NV, sh = log2_if_pow2(pcs);
      for (int i = threadIdx.x; i < L * pcs; i += blockDim.x) {
        const int tt = sh >= 0 ? i >> sh : i / pcs, j = (i - tt * pcs) * NV;
        cp_async<16>(g.val + tt * TVP + j, vrow + (long long)tt * D + j);
      }
    } else {
      for (int i = threadIdx.x; i < L * tw; i += blockDim.x) {
        const int tt = i / tw, j = i % tw;
        cp_elem(g.val + tt * TVP + j, vrow + (long long)tt * D + j);
      }
    }
    cp_commit();
  };

  int WS = 1;
  while (WS < WS_MAX && WS * 2 <= W) WS *= 2;

  prefetch(0);
  for (int n = 0; n < Nt; ++n) {
    const FwdStage<T, V, A, I> g = stage(n);
    const int t0 = n * C, L = min(C, T_ - t0), Ne = L * W;
    const long long chunk = (long long)bp * Nt + n;
    const long long tokb = ((long long)b * T_ + t0) * P + p;     // [B, T, P] row of token t0
    if (LATE) {   // chunk n's copies: the last group chunk n - 1 (or the launch) issued
      cp_wait<0>();
    } else if (n + 1 < Nt) {   // the other stage was released by the barrier that ended chunk n - 1
      prefetch(n + 1);
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    if (Q > 1)
      for (int i = threadIdx.x; i < Ne; i += blockDim.x) amax_s[i] = 0.f;
    __syncthreads();
    if (fused) {
      // C == 1 (decoding): the one token's write-run links and H[0][0] = q . k, found here
      // instead of by a pre-pass launch (W <= 64: W^2 comparisons). No G: Ainv = I.
      for (int e = threadIdx.x; e < W; e += blockDim.x) {
        const I id = g.wid[e];
        int code = W_BAD;
        if (valid_id(id, S)) {
          bool head = true;
          int nxt = 0;
          for (int e2 = 0; e2 < W; ++e2) {
            if (e2 == e || g.wid[e2] != id) continue;
            if (e2 < e) head = false;
            else if (nxt == 0) nxt = e2 + 1;
          }
          code = nxt | (head ? W_HEAD : 0);
        } else {
          flag_error(err, 1);
        }
        g.wrun[e] = code;
      }
      if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        A h = A(0);
        for (int w = lane; w < W; w += 32) {
          const I jd = g.rid[w];
          if (!valid_id(jd, S)) { flag_error(err, 2); continue; }
          const A c = g.cw[w];
          for (int e2 = W - 1; e2 >= 0; --e2)
            if (g.wid[e2] == jd) h += c * g.aw[e2];
        }
        for (int o = 16; o > 0; o >>= 1) h += __shfl_xor_sync(0xffffffffu, h, o);
        if (lane == 0) {
          const int nz = h != A(0);
          g.ptr[0] = 0;
          g.ptr[1] = 0;
          g.ptr[2] = nz;
          g.ev[0] = h;
          g.ec[0] = 0;
        }
      }
      __syncthreads();
    }
    const int nnz = g.ptr[2 * C];
    const A* ev = nnz <= E_STAGE ? g.ev : sp_val + chunk * C * C;
    const unsigned char* ec = nnz <= E_STAGE ? g.ec : sp_col + chunk * CS;

    // gather (every write row once: X, the snapshot and the kept row; every read row once: Y).
    // WS threads share a (token, piece) and split its W entries, so that a block keeps many
    // independent 16-byte loads in flight; their partial sums meet through warp shuffles.
    // With kept rows on the fast path (`rowcp`), every write row is copied into keep_s with
    // cp.async first (all of them in flight at once, no registers held), the read rows are
    // loaded into registers meanwhile, and X and the snapshots are then read from shared
    // memory: same entries, same order, so the same bits as the register gather.
    const int TP = L * NPC, total = TP * WS;
#ifdef SDM_FWD_CLUSTER
    if (true) {
      const int rank = tile, NP = hd / N;
      const int LO = (L - rank + CL - 1) / CL;   // owned tokens t = rank + lt * CL < L
      T* full_w = keep_s;   // their write rows, whole: [LO * W][hd]
      A* Y_full = Y_s;      // their Y, whole: [LO][hd]
      A* X_full = U_s;      // their w0, whole: [LO][hd]
      const T* bank_f = bank + (long long)b * S * D + p * hd;
      for (int i = threadIdx.x; i < LO * W * NP; i += blockDim.x) {
        const int le = i / NP, cc = (i - le * NP) * N, lt = le / W, w = le - lt * W;
        const I id = g.wid[(rank + lt * CL) * W + w];
        cp_async_row(full_w + (long long)le * hd + cc,
                     bank_f + (long long)(valid_id(id, S) ? id : 0) * D + cc);
      }
      cp_commit();
      const int totalo = LO * NP * WS;
      for (int base = 0; base < totalo; base += blockDim.x) {
        const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
        const bool act = task < totalo;
        const int lt = tp / NP, cc = (tp % NP) * N, t = rank + lt * CL;
        A y[N];
#pragma unroll
        for (int i = 0; i < N; ++i) y[i] = A(0);
        if (act) {
          int w = ws;
          for (; w + (GR - 1) * WS < W; w += GR * WS) {
            T mr[GR][N];
            bool okr[GR];
#pragma unroll
            for (int j = 0; j < GR; ++j) {
              const I jd = g.rid[t * W + w + j * WS];
              okr[j] = valid_id(jd, S);
              load_row<N>(mr[j], bank_f + (long long)(okr[j] ? jd : 0) * D + cc);
            }
#pragma unroll
            for (int j = 0; j < GR; ++j) {
              const A c = g.cw[t * W + w + j * WS];
#pragma unroll
              for (int i = 0; i < N; ++i) y[i] = okr[j] ? fma_(c, to_acc(mr[j][i], A()), y[i]) : y[i];
            }
          }
          for (; w < W; w += WS) {
            const I jd = g.rid[t * W + w];
            const bool okr = valid_id(jd, S);
            T mr[N];
            load_row<N>(mr, bank_f + (long long)(okr ? jd : 0) * D + cc);
            const A c = g.cw[t * W + w];
#pragma unroll
            for (int i = 0; i < N; ++i) y[i] = okr ? fma_(c, to_acc(mr[i], A()), y[i]) : y[i];
          }
        }
        for (int o = 1; o < WS; o <<= 1) {
#pragma unroll
          for (int i = 0; i < N; ++i) y[i] = add_(y[i], __shfl_xor_sync(0xffffffffu, y[i], o));
        }
        if (act && ws == 0) {
#pragma unroll
          for (int i = 0; i < N; ++i) Y_full[lt * hd + cc + i] = y[i];
        }
      }
      cp_wait<0>();
      __syncthreads();
      for (int base = 0; base < totalo; base += blockDim.x) {
        const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
        const bool act = task < totalo;
        const int lt = tp / NP, cc = (tp % NP) * N, t = rank + lt * CL;
        const long long tok = tokb + (long long)t * P;
        A x[N];
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] = A(0);
        if (act) {
          for (int w = ws; w < W; w += WS) {
            const int e = t * W + w;
            const bool ok = valid_id(g.wid[e], S);
            const A a = g.aw[e];
            T m[N];
            load_raw<N>(m, full_w + ((long long)lt * W + w) * hd + cc, N, true);
#pragma unroll
            for (int i = 0; i < N; ++i) {
              m[i] = ok ? m[i] : From<T>::cvt(0.0f);
              x[i] = ok ? fma_(a, to_acc(m[i], A()), x[i]) : x[i];
            }
            if (save) save_piece<Q, A>(snap + (tok * W + w) * hd + cc, m, N, true);
          }
        }
        for (int o = 1; o < WS; o <<= 1) {
#pragma unroll
          for (int i = 0; i < N; ++i) x[i] = add_(x[i], __shfl_xor_sync(0xffffffffu, x[i], o));
        }
        if (act && ws == 0) {   // w0 = beta (v - X), over the whole width
          const A bt = g.beta[t];
          const V* vr = vals + ((long long)b * T_ + t0 + t) * D + p * hd + cc;
#pragma unroll
          for (int i = 0; i < N; ++i)
            X_full[lt * hd + cc + i] = mul_(bt, sub_(to_acc(vr[i], A()), x[i]));
        }
      }
      cluster_sync();   // every owner's w0, Y and rows are in place
      for (int task = threadIdx.x; task < L * NPC; task += blockDim.x) {
        const int t = task / NPC, cc = (task % NPC) * N;
        A xv[N];
        ld_dsmem_piece<N>(xv, dsmem_addr(X_full + (t / CL) * hd + c0 + cc, t % CL));
#pragma unroll
        for (int i = 0; i < N; ++i) X_s[t * TWP + cc + i] = xv[i];
      }
      cluster_sync();   // the owners' U_s (X_full) is free again
    } else
#endif
    if (rowcp) {
      // SPLIT (the staged instance): the read rows are a commit group of their own, issued
      // after every write row, and X is summed while they arrive (stop 34, H100 headline:
      // forward 1.036 -> 0.977 ms at W = 16, 0.622 -> 0.610 at W = 8, bitwise equal;
      // -DSDM_FWD_ONE_WAIT: one group, one pass)
#ifdef SDM_FWD_ONE_WAIT
      constexpr bool SPLIT = false;
#else
      constexpr bool SPLIT = FIX;
#endif
      for (int i = threadIdx.x; i < Ne * NPC; i += blockDim.x) {
        const int e = divNPC.div(i), cc = (i - e * NPC) * N;
        const I id = g.wid[e];
        cp_async_row(keep_s + (long long)e * TWP + cc,
                     bank_b + (long long)(valid_id(id, S) ? id : 0) * D + cc);
        if (rstage && !SPLIT) {
          const I jd = g.rid[e];
          cp_async_row(rkeep_s + (long long)e * TWP + cc,
                       bank_b + (long long)(valid_id(jd, S) ? jd : 0) * D + cc);
        }
      }
      cp_commit();
      if (SPLIT) {
        for (int i = threadIdx.x; i < Ne * NPC; i += blockDim.x) {
          const int e = divNPC.div(i), cc = (i - e * NPC) * N;
          const I jd = g.rid[e];
          cp_async_row(rkeep_s + (long long)e * TWP + cc,
                       bank_b + (long long)(valid_id(jd, S) ? jd : 0) * D + cc);
        }
        cp_commit();
        // LATE: chunk n+1's copies as a third group (an empty one after the last chunk, so
        // that the passes' waits count three groups every time)
        if (LATE) {
          if (n + 1 < Nt) prefetch(n + 1);
          else cp_commit();
        }
      }
      for (int base = 0; base < (rstage ? 0 : total); base += blockDim.x) {
        const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
        const bool act = task < total;
        const int t = tp / NPC, cc = (tp % NPC) * N;
        A y[N];
#pragma unroll
        for (int i = 0; i < N; ++i) y[i] = A(0);
        if (act) {
          int w = ws;
          for (; w + (GR - 1) * WS < W; w += GR * WS) {
            T mr[GR][N];
            bool okr[GR];
#pragma unroll
            for (int j = 0; j < GR; ++j) {
              const I jd = g.rid[t * W + w + j * WS];
              okr[j] = valid_id(jd, S);
              load_row<N>(mr[j], bank_b + (long long)(okr[j] ? jd : 0) * D + cc);
            }
#pragma unroll
            for (int j = 0; j < GR; ++j) {
              const A c = g.cw[t * W + w + j * WS];
#pragma unroll
              for (int i = 0; i < N; ++i) y[i] = okr[j] ? fma_(c, to_acc(mr[j][i], A()), y[i]) : y[i];
            }
          }
          for (; w < W; w += WS) {
            const I jd = g.rid[t * W + w];
            const bool okr = valid_id(jd, S);
            T mr[N];
            load_row<N>(mr, bank_b + (long long)(okr ? jd : 0) * D + cc);
            const A c = g.cw[t * W + w];
#pragma unroll
            for (int i = 0; i < N; ++i) y[i] = okr ? fma_(c, to_acc(mr[i], A()), y[i]) : y[i];
          }
        }
        for (int o = 1; o < WS; o <<= 1) {
#pragma unroll
          for (int i = 0; i < N; ++i) y[i] = add_(y[i], __shfl_xor_sync(0xffffffffu, y[i], o));
        }
        if (act && ws == 0) {
#pragma unroll
          for (int i = 0; i < N; ++i) Y_s[t * TWP + cc + i] = y[i];
        }
      }
      // X (and with staged reads Y) from the rows in shared memory, entries w = ws, ws + WS,
      // ... as the register gather sums them. A bad id's row and weight are zeroed as words
      // instead of skipped: x + 0 * 0 = x, as x is never -0 (it starts at +0 and an exact zero
      // sum rounds to +0), so the same bits; its snapshot is the zero row, as before. The
      // entries' rows, weights, ids and snapshot pieces are walked by pointers. With SPLIT, a
      // first pass sums X (the write rows' group waited for) and a second Y.
      const IdCheck<I> idok(S);
      constexpr int NPASS = SPLIT ? 2 : 1;
#pragma unroll
      for (int pass = 0; pass < NPASS; ++pass) {
      const bool dx = pass == 0, dy = rstage && pass == NPASS - 1;
      if (LATE) {   // the newest group (chunk n+1's copies) stays in flight
        if (pass == 0) cp_wait<2>();
        else cp_wait<1>();
      } else if (SPLIT && pass == 0) {
        cp_wait<1>();
      } else {
        cp_wait<0>();
      }
      __syncthreads();
      for (int base = 0; base < total; base += blockDim.x) {
        const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
        const bool act = task < total;
        const int t = tp / NPC, cc = (tp % NPC) * N;
        A x[N], y[N];
#pragma unroll
        for (int i = 0; i < N; ++i) { x[i] = A(0); y[i] = A(0); }
        if (act) {
          const int e0 = t * W + ws, ne = (W - ws + WS - 1) / WS;
          const int4* kp = reinterpret_cast<const int4*>(keep_s + (long long)e0 * TWP + cc);
          const int4* rp = reinterpret_cast<const int4*>(rkeep_s + (long long)e0 * TWP + cc);
          const int kstep = WS * TWP / N;   // in pieces
          ST* sq = snap + ((tokb + (long long)t * P) * W + ws) * hd + c0 + cc;
          const long long sstep = (long long)WS * hd;
          const I* wp = g.wid + e0;
          const I* rq = g.rid + e0;
          const A* ap = g.aw + e0;
          const A* cp = g.cw + e0;
#pragma unroll SDM_FWD_XY_UNROLL
          for (int k = 0; k < ne; ++k) {
            const int4 z = make_int4(0, 0, 0, 0);
            if (dx) {
              const bool ok = idok(*wp);
              const int4 mw = ok ? *kp : z;
              const A a = ok ? *ap : A(0);
              A m[N];
              piece_acc<N, T>(m, mw);
#pragma unroll
              for (int i = 0; i < N; ++i) x[i] = fma_(a, m[i], x[i]);
              if (save) {
                if constexpr (Q == 0) *reinterpret_cast<int4*>(sq) = mw;
                else if constexpr (Q == 1) store_piece<N>(sq, m, N, true);
              }
            }
            if (dy) {
              const bool okr = idok(*rq);
              const int4 rw = okr ? *rp : z;
              const A c = okr ? *cp : A(0);
              A mr[N];
              piece_acc<N, T>(mr, rw);
#pragma unroll
              for (int i = 0; i < N; ++i) y[i] = fma_(c, mr[i], y[i]);
            }
            kp += kstep; rp += kstep; sq += sstep;
            wp += WS; rq += WS; ap += WS; cp += WS;
          }
        }
        for (int o = 1; o < WS; o <<= 1) {
          if (dx) {
#pragma unroll
            for (int i = 0; i < N; ++i) x[i] = add_(x[i], __shfl_xor_sync(0xffffffffu, x[i], o));
          }
          if (dy) {
#pragma unroll
            for (int i = 0; i < N; ++i) y[i] = add_(y[i], __shfl_xor_sync(0xffffffffu, y[i], o));
          }
        }
        if (act && ws == 0) {   // w0 = beta (v - X)
          const A bt = g.beta[t];
          if (dx) {
#pragma unroll
            for (int i = 0; i < N; ++i)
              X_s[t * TWP + cc + i] = mul_(bt, sub_(to_acc(g.val[t * TVP + cc + i], A()), x[i]));
          }
          if (dy) {
#pragma unroll
            for (int i = 0; i < N; ++i) Y_s[t * TWP + cc + i] = y[i];
          }
        }
      }
      }
    } else {
      for (int base = 0; base < total; base += blockDim.x) {
        const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
        const bool act = task < total;
        const int t = tp / NPC, cc = (tp % NPC) * N, nv = min(N, tw - cc);
        const long long tok = tokb + (long long)t * P;
        A x[N], y[N];
#pragma unroll
        for (int i = 0; i < N; ++i) { x[i] = A(0); y[i] = A(0); }
        // one entry's rows, loaded: accumulate X and Y, keep the head row, save the snapshot
        auto use = [&](int w, bool ok, bool okr, const T (&m)[N], const T (&mr)[N]) {
          const int e = t * W + w;
          const A a = g.aw[e], c = g.cw[e];
#pragma unroll
          for (int i = 0; i < N; ++i) {
            x[i] = ok ? fma_(a, to_acc(m[i], A()), x[i]) : x[i];
            y[i] = okr ? fma_(c, to_acc(mr[i], A()), y[i]) : y[i];
          }
          if (kept && (g.wrun[e] & (W_HEAD | W_BAD)) == W_HEAD)
            store_raw<N>(keep_s + (long long)e * TWP + cc, m, N, true);
          if (save) {
            if constexpr (Q <= 1) {
              save_piece<Q, A>(snap + (tok * W + w) * hd + c0 + cc, m, nv, vs);
            } else {
              unsigned mx = 0;   // |m| as float32 bits, NaN skipped (-ftz would flush fabsf)
#pragma unroll
              for (int i = 0; i < N; ++i) {
                const unsigned b = abs_bits(to_acc(m[i], A()));
                mx = b > 0x7f800000u ? mx : max(mx, b);
              }
              if (ok) atomicMax(reinterpret_cast<int*>(amax_s + e), (int)mx);
            }
          }
        };
        if (act && fast) {
          // every piece full and aligned: the rows of GU entries (ids clamped to row 0, bad
          // ones zeroed by a select) are loaded before any of them is used, so 2 GU 16-byte
          // loads are in flight per thread; same entries, same order as the general path
          int w = ws;
          for (; w + (GU - 1) * WS < W; w += GU * WS) {
            T m[GU][N], mr[GU][N];
            bool ok[GU], okr[GU];
#pragma unroll
            for (int j = 0; j < GU; ++j) {
              const int e = t * W + w + j * WS;
              const I id = g.wid[e], jd = g.rid[e];
              ok[j] = valid_id(id, S);
              okr[j] = valid_id(jd, S);
              load_row<N>(m[j], bank_b + (long long)(ok[j] ? id : 0) * D + cc);
              load_row<N>(mr[j], bank_b + (long long)(okr[j] ? jd : 0) * D + cc);
            }
#pragma unroll
            for (int j = 0; j < GU; ++j) {
#pragma unroll
              for (int i = 0; i < N; ++i) m[j][i] = ok[j] ? m[j][i] : From<T>::cvt(0.0f);
              use(w + j * WS, ok[j], okr[j], m[j], mr[j]);
            }
          }
          for (; w < W; w += WS) {
            const int e = t * W + w;
            const I id = g.wid[e], jd = g.rid[e];
            const bool ok = valid_id(id, S), okr = valid_id(jd, S);
            T m[N], mr[N];
            load_row<N>(m, bank_b + (long long)(ok ? id : 0) * D + cc);
            load_row<N>(mr, bank_b + (long long)(okr ? jd : 0) * D + cc);
#pragma unroll
            for (int i = 0; i < N; ++i) m[i] = ok ? m[i] : From<T>::cvt(0.0f);
            use(w, ok, okr, m, mr);
          }
        } else if (act) {
          // general path (a partial piece, or rows not 16-byte aligned)
#pragma unroll 4
          for (int w = ws; w < W; w += WS) {
            const int e = t * W + w;
            const I id = g.wid[e], jd = g.rid[e];
            const bool ok = valid_id(id, S), okr = valid_id(jd, S);
            T m[N], mr[N];
            if (ok) load_raw<N>(m, bank_b + (long long)id * D + cc, nv, vb);
            else {
#pragma unroll
              for (int i = 0; i < N; ++i) m[i] = From<T>::cvt(0.0f);
            }
            if (okr) load_raw<N>(mr, bank_b + (long long)jd * D + cc, nv, vb);
            else {
#pragma unroll
              for (int i = 0; i < N; ++i) mr[i] = From<T>::cvt(0.0f);
            }
            use(w, ok, okr, m, mr);
          }
        }
        for (int o = 1; o < WS; o <<= 1) {
#pragma unroll
          for (int i = 0; i < N; ++i) {
            x[i] = add_(x[i], __shfl_xor_sync(0xffffffffu, x[i], o));
            y[i] = add_(y[i], __shfl_xor_sync(0xffffffffu, y[i], o));
          }
        }
        if (act && ws == 0) {   // w0 = beta (v - X)
          const A bt = g.beta[t];
#pragma unroll
          for (int i = 0; i < N; ++i) {
            const A v = i < nv ? to_acc(g.val[t * TVP + cc + i], A()) : A(0);
            X_s[t * TWP + cc + i] = mul_(bt, sub_(v, x[i]));
            Y_s[t * TWP + cc + i] = y[i];
          }
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
          const I id = g.wid[t * W + w];
          const float mx = amax_s[t * W + w];
          const bool live = abs_bits(mx) - 1u < 0x7f800000u - 1u;   // 0 < a < inf
          const double inv = live ? (double)QMax<Q>::v / widen(mx) : 0.0;
          A m[N];
          if (valid_id(id, S)) load_piece<N>(m, bank_b + (long long)id * D + cc, nv, vb);
          else {
#pragma unroll
            for (int i = 0; i < N; ++i) m[i] = A(0);
          }
          ST qv[N];
#pragma unroll
          for (int i = 0; i < N; ++i) qv[i] = live ? quant1(widen(m[i]) * inv, ST()) : ST(0);
          store_raw<N>(snap + off * hd + c0 + cc, qv, nv, vs);
          if (cc == 0 && tile == 0) scale[off] = narrow(widen(mx) / QMax<Q>::v);
        }
      }
    }

    // u = Ainv w0 (unit diagonal last, as a sum in ascending tau)
    for (int task = threadIdx.x; task < L * NPC; task += blockDim.x) {
      const int t = task / NPC, cc = (task % NPC) * N;
      A u[N];
#pragma unroll
      for (int i = 0; i < N; ++i) u[i] = A(0);
      for (int k = g.ptr[t], ke = g.ptr[t + 1]; k < ke; ++k) {
        const int tau = ec[k];
        const A a = ev[k];
#pragma unroll
        for (int i = 0; i < N; ++i) u[i] = fma_(a, X_s[tau * TWP + cc + i], u[i]);
      }
#pragma unroll
      for (int i = 0; i < N; ++i) U_s[t * TWP + cc + i] = add_(u[i], X_s[t * TWP + cc + i]);
    }
    __syncthreads();
    // readings r = Y + H u
    for (int task = threadIdx.x; task < L * NPC; task += blockDim.x) {
      const int t = task / NPC, cc = (task % NPC) * N, nv = FIX ? N : min(N, tw - cc);
      A r[N];
#ifdef SDM_FWD_CLUSTER
      ld_dsmem_piece<N>(r, dsmem_addr(Y_s + (t / CL) * hd + c0 + cc, t % CL));
#else
#pragma unroll
      for (int i = 0; i < N; ++i) r[i] = Y_s[t * TWP + cc + i];
#endif
      for (int k = g.ptr[C + t], ke = g.ptr[C + t + 1]; k < ke; ++k) {
        const int tau = ec[k];
        const A h = ev[k];
#pragma unroll
        for (int i = 0; i < N; ++i) r[i] = fma_(h, U_s[tau * TWP + cc + i], r[i]);
      }
      store_piece<N>(out + ((long long)b * T_ + t0 + t) * D + p * hd + c0 + cc, r, nv, vo);
    }
    // CB > 0 (exact snapshots for a backward that walks 2^CB-token sub-chunks of this chunk): a
    // write entry whose slot was written in an earlier sub-chunk gets, as its snapshot, the row
    // as it was at its sub-chunk's start (rounded to the bank dtype, as a store would round
    // it), where the gather saved M0. A run lists its entries in ascending order, so that row
    // is M0 plus the run's prefix, summed in the scatter's order: the scatter's own walk of the
    // run has it in registers when it reaches the sub-chunk's first entry, and stores it there
    // (later entries of the same sub-chunk copy that piece back: the same thread stored it).
    // -DSDM_FWD_SUB_SEPARATE (benchmarks/fwd_ab.py) runs the same walks in a pass of their own
    // before the scatter instead (the same bits; stop 24's form, +11% on the forward): without
    // kept rows the row is read from the bank, which only the scatter task of the same (entry,
    // piece) rewrites, and the scatter gives that task to this same thread, later in program
    // order. Its diagnostics (wrong snapshots, never in the product): -DSDM_FWD_NO_SUB_PASS
    // compiles the snapshots of later sub-chunks out, -DSDM_FWD_SUB_SCAN_ONLY keeps the pass's
    // scan of the tasks and skips every run (what the scan costs, what the runs cost).
#if defined(SDM_FWD_SUB_SEPARATE) && !defined(SDM_FWD_NO_SUB_PASS)
    if constexpr (Q == 0 && SUB != 0) {
      if (CB > 0 && save) {
#pragma unroll 1
        for (int task = threadIdx.x; task < Ne * NPC; task += blockDim.x) {
          const int e = divNPC.div(task), wr = g.wrun[e];
          if ((wr & (W_HEAD | W_BAD)) != W_HEAD || (wr & W_NEXT) == 0) continue;
#ifdef SDM_FWD_SUB_SCAN_ONLY
          if (wr != -1) continue;   // (never -1: keeps the loads and the test)
#endif
          // the staged instance (FIX) runs whole aligned pieces and kept rows only
          const int cc = (task - e * NPC) * N, nv = FIX ? N : min(N, tw - cc), hs = divW.div(e) >> CB;
          const bool vec = FIX || vs;
          T raw[N];
          if (kept) load_raw<N>(raw, keep_s + (long long)e * TWP + cc, N, true);
          else load_raw<N>(raw, bank_b + (long long)g.wid[e] * D + cc, nv, vb);
          A m[N];
#pragma unroll
          for (int i = 0; i < N; ++i) m[i] = to_acc(raw[i], A());
          int cs = hs;
          long long sb = 0;   // the snapshot piece of the run's first entry in sub-chunk cs
#pragma unroll 1
          for (int q = e;;) {
            const int t2 = divW.div(q), s2 = t2 >> CB;
            const long long so = ((tokb + (long long)t2 * P) * W + (q - t2 * W)) * hd + c0 + cc;
            if (s2 != cs) {   // the first entry of a later sub-chunk: m is that sub-chunk's start
              store_piece<N>(snap + so, m, nv, vec);
              cs = s2;
              sb = so;
            } else if (s2 != hs) {   // the same start again
              load_raw<N>(raw, snap + sb, nv, vec);
              store_raw<N>(snap + so, raw, nv, vec);
            }
            const A a2 = g.aw[q];
#pragma unroll
            for (int i = 0; i < N; ++i) m[i] = fma_(a2, U_s[t2 * TWP + cc + i], m[i]);
            const int nx = g.wrun[q] & W_NEXT;
            if (nx == 0) break;
            q = nx - 1;
          }
        }
      }
    }
#endif
    // scatter: the entry heading each written slot rewrites the row once, adding its run's
    // a u in ascending entry order. With kept rows a task reads shared memory only; without,
    // a thread takes SB tasks at a time and issues their row loads before any store (distinct
    // rows: no alias).
#if defined(SDM_FWD_SUB_SEPARATE) || defined(SDM_FWD_NO_SUB_PASS)
    constexpr bool SUB_HERE = false;
#else
    constexpr bool SUB_HERE = Q == 0 && SUB != 0;
#endif
    const bool sub = SUB_HERE && CB > 0 && save;
    auto add_run = [&](A (&m)[N], int e, int cc) {
      const int hs = sub ? divW.div(e) >> CB : 0;
      int cs = hs;
      long long sb = 0;   // the snapshot piece of the run's first entry in sub-chunk cs
      for (int q = e;;) {
        const A a2 = g.aw[q];
        const int t2 = divW.div(q);
        if constexpr (SUB_HERE) {
          const int s2 = t2 >> CB;
          if (sub && s2 != hs) {   // m is the row before entry q: at s2's start if q is its first
            const int nv = FIX ? N : min(N, tw - cc);
            const bool vec = FIX || vs;
            const long long so = ((tokb + (long long)t2 * P) * W + (q - t2 * W)) * hd + c0 + cc;
            if (s2 != cs) {
              store_piece<N>(snap + so, m, nv, vec);
              cs = s2;
              sb = so;
            } else {
              T raw[N];
              load_raw<N>(raw, snap + sb, nv, vec);
              store_raw<N>(snap + so, raw, nv, vec);
            }
          }
        }
#pragma unroll
        for (int i = 0; i < N; ++i) m[i] = fma_(a2, U_s[t2 * TWP + cc + i], m[i]);
        const int nx = g.wrun[q] & W_NEXT;
        if (nx == 0) break;
        q = nx - 1;
      }
    };
    if (kept) {
      for (int task = threadIdx.x; task < Ne * NPC; task += blockDim.x) {
        const int e = divNPC.div(task);
        if ((g.wrun[e] & (W_HEAD | W_BAD)) != W_HEAD) continue;
        const int cc = (task - e * NPC) * N;
        T kr[N];
#ifdef SDM_FWD_CLUSTER
        {
          const int te = divW.div(e), w = e - te * W;
          ld_dsmem_piece<N>(kr, dsmem_addr(keep_s + ((long long)(te / CL) * W + w) * hd + c0 + cc,
                                           te % CL));
        }
#else
        load_raw<N>(kr, keep_s + (long long)e * TWP + cc, N, true);
#endif
        A m[N];
#pragma unroll
        for (int i = 0; i < N; ++i) m[i] = to_acc(kr[i], A());
        add_run(m, e, cc);
        store_piece<N>(bank_b + (long long)g.wid[e] * D + cc, m, FIX ? N : min(N, tw - cc),
                       FIX || vb);
      }
    } else {
      for (int base = threadIdx.x; base < Ne * NPC; base += SB * blockDim.x) {
        A m[SB][N];
        T* row[SB];
        int es[SB], ccs[SB];
#pragma unroll
        for (int j = 0; j < SB; ++j) {
          const int task = base + j * blockDim.x;
          es[j] = -1;
          if (task < Ne * NPC) {
            const int e = divNPC.div(task);
            if ((g.wrun[e] & (W_HEAD | W_BAD)) == W_HEAD) {
              es[j] = e;
              ccs[j] = (task - e * NPC) * N;
              row[j] = bank_b + (long long)g.wid[e] * D + ccs[j];
              load_piece<N>(m[j], row[j], min(N, tw - ccs[j]), vb);
            }
          }
        }
#pragma unroll
        for (int j = 0; j < SB; ++j) {
          if (es[j] < 0) continue;
          add_run(m[j], es[j], ccs[j]);
          store_piece<N>(row[j], m[j], min(N, tw - ccs[j]), vb);
        }
      }
    }
#ifdef SDM_FWD_CLUSTER
    cluster_sync();   // the owners' rows and Y are read: the next chunk may overwrite them
#else
    __syncthreads();
#endif
  }
}

}  // namespace sdm
