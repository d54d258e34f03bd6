// Backward of SPEC §4, rewinding the bank in place. One block per (b, p, column tile), walking
// the chunks n_hi-1 down to n_lo (the launcher splits a long sequence into ranges of chunks, so
// that the pre-pass scratch stays small); dM (the grad of the bank at the chunk's end) lives in
// global memory and the block owns its tile of it, like the bank.
//
// Everything of a chunk that does not depend on the bank (ids, weights, beta, the values and
// dr tiles, the sorted runs, the read links and the CSR rows of sdm_prepass.cu's SPARSE = 2
// form) is copied into shared memory with cp.async one chunk ahead. A chunk then costs two
// round trips to global memory:
//   1  per write entry: the snapshot row M0[i] and dM[i]; per read entry: M0[j] = the
//      snapshot of the write that heads j's run, or the bank row (not written in this chunk,
//      so already M0); X = sum_w a M0[i], D = sum_w a dM[i], e0 = v - X, and dr_t . M0[j] (dc)
//      u = Ainv diag(beta) e0;  e = e0 - tril(G,-1) u;  du = D + H^T dr;  z = Ainv^T du
//      (with exact snapshots these rows are staged in shared memory where they fit: ssnap 1
//      the snapshot rows, ssnap 2 all of them, copied with cp.async at once)
//   2  per write entry again (L2): u_t . dM[i] + dX_t . M0[i] (da), dX = -beta z, and the
//      rewind (the bank row gets its snapshot back); dv = beta z, dbeta_t = z_t . e_t
// then the overlap terms of step 5 from the runs of equal slots, with dG[t,tau] = -beta_t
// z_t . u_tau (tau < t) and dH[s,t] = dr_s . u_t (t <= s), and the scatter dM[slot] += sum over
// the slot's entries of a dX_t (writes) and c dr_t (reads): one thread per (slot, piece) sums
// its run in entry order and adds it with one atomic per element (float and double grads; the
// block owns the address, so the result is the plain sum) or a read-modify-write (16-bit).
// Partial dot products go through shared arrays written by exactly one thread each and summed
// in a fixed order; da, dc, dbeta then get one global atomicAdd per tile (so their last bits
// depend on the order of the tiles); dv, the bank and dM are exact.

#include "sdm_common.cuh"

namespace sdm {

// Threads splitting a token's W entries: at most 2 up to W = 16, at most 4 above. Stop 15, H200
// forward+backward against a cap of 4 for every W: this rule -1.3% at W = 16 and -4.6% at W = 8;
// a fixed cap of 2 -1.9% at W = 16 (the compiler then knows WS <= 2: no spills, where the rule
// keeps 8/24 bytes) but +9% at W = 32; a cap of 8 +5% at W = 16.
// -DSDM_BWD_WS_MAX=n (benchmarks) caps it at n for every W.
#ifdef SDM_BWD_WS_MAX
__device__ __forceinline__ int bws_max(int) { return SDM_BWD_WS_MAX; }
#else
__device__ __forceinline__ int bws_max(int W) { return W > 16 ? 4 : 2; }
#endif
// Entries whose global rows a thread loads before it uses any, in round 1 with staged
// snapshots and in round 2 (-DSDM_BWD_GB=n, benchmarks; 1: entry by entry, as before stop 20).
// Stop 20, H200, forward+backward against entry by entry (bitwise equal): 2 saves 0.5% at the
// headline, 2.6% at W = 32, 1.2% with a float32 bank, 0-0.3% at W = 4, 8 and S = 4096; 4 spills
// (32/84 bytes) and costs up to 2.3%.
#ifndef SDM_BWD_GB
#define SDM_BWD_GB 2
#endif
constexpr int BG = SDM_BWD_GB;
// -DSDM_BWD_SOLO (stop 48, not yet timed on a GPU): solo entries (the only valid entry of
// their slot in a chunk) skip the scatter. Round 2 adds a write's term to the dM piece it has
// just loaded, the reads' terms go out in the phase after u (-DSDM_BWD_SOLO_READS=2) or in
// round 2 (=1), and the scatter walks only the runs of two or more. Only on the fast path
// (whole, aligned pieces: one form of each store); elsewhere, and without the macro, the
// scatter adds every run's sum
#ifndef SDM_BWD_SOLO_READS
#define SDM_BWD_SOLO_READS 2
#endif
// Diagnostics (benchmarks/bwd_bound.sh; wrong results, never in the product): what the
// backward would gain if the grouped loads of round 1's pass A (-DSDM_BWD_PROBE_A) or of
// round 2 (-DSDM_BWD_PROBE_R2) cost less: =1 loads the same number of pieces from 256 rows
// that stay in L2 (row e mod 256 for entry e; min(that, S - 1)), =2 loads nothing (zeros).
// And of the last phase: -DSDM_BWD_PROBE_PE drops the per-entry sums (da, dc with the overlap
// terms), -DSDM_BWD_PROBE_SC=1 keeps the scatter's run walks but not its adds to dM (each
// add is called with no element to add: S > 0, which the compiler cannot know), =2 drops
// the scatter.
constexpr int BE_STAGE = 1024; // CSR entries of a chunk staged in shared memory (more: from L2)
constexpr int B_RUN_HEAD = 1 << 30, B_RUN_BAD = 1 << 29, B_QMASK = (1 << 14) - 1;

template <int N, typename A, typename T, typename ST, int Q>
struct SnapIO {
  // dequantized snapshot piece (acc values) and the bank-dtype values the rewind writes
  __device__ static void load(A (&m)[N], T (&raw)[N], const ST* __restrict__ p, float sc, int nv,
                              bool vec) {
    if constexpr (Q == 0) {
      if (vec && nv == N) load_row<N>(raw, p);
      else load_raw<N>(raw, p, nv, vec);
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
        m[i] = to_acc(dequant1(q[i], sc), A());
        raw[i] = From<T>::cvt(m[i]);
      }
    }
  }
  // M0 as the rewound bank holds it (rounded to the bank dtype): what a read of the slot sees
  __device__ static void load_m0(A (&m)[N], const ST* __restrict__ p, float sc, int nv, bool vec) {
    T raw[N];
    load(m, raw, p, sc, nv, vec);
    if constexpr (Q != 0) {
#pragma unroll
      for (int i = 0; i < N; ++i) m[i] = to_acc(raw[i], A());
    }
  }
};

// dM pieces (and bank rows) bypass L1 (.cg): the scatter's atomics update dM in L2, and a
// load the compiler may give the read-only path must not serve rows this kernel writes
template <int N, typename A, typename T>
__device__ __forceinline__ void load_grad(A (&out)[N], const T* __restrict__ p, int nv, bool vec) {
  constexpr int NB = (int)sizeof(T) * N;
  if constexpr (NB % 16 == 0) {
    if (vec && nv == N) {
      union { int4 q[NB / 16]; T v[N]; } u;
#pragma unroll
      for (int j = 0; j < NB / 16; ++j) u.q[j] = ld_row16<true>(reinterpret_cast<const int4*>(p) + j);
#pragma unroll
      for (int i = 0; i < N; ++i) out[i] = to_acc(u.v[i], A());
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = i < nv ? to_acc(__ldcg(p + i), A()) : A(0);
}

// The raw 16-byte words of a whole, aligned row piece of N elements of E (sizeof(E) * N a
// multiple of 16), loaded through L2 (.cg) with the prefetch-size hint: a round issues the
// loads of BG entries into these before it converts or uses any (stop 20: the compiler kept
// at most two loads in flight per thread in per-entry loops)
template <int N, typename E>
struct RawPiece {
  static constexpr int NQ = (int)sizeof(E) * N / 16;
  union { int4 q[NQ]; E v[N]; } u;
  __device__ __forceinline__ void load(const E* p) {
#pragma unroll
    for (int j = 0; j < NQ; ++j) u.q[j] = ld_row16<true>(reinterpret_cast<const int4*>(p) + j);
  }
};

// dM[row piece] += g: atomics for float/double grads (one per element; float4 on sm_90), a
// plain read-modify-write for 16-bit grads (the block is the address's only writer)
template <int N, typename A, typename Gt>
__device__ __forceinline__ void add_grad(Gt* __restrict__ p, const A (&g)[N], int nv, bool vec) {
  if constexpr (sizeof(Gt) >= 4) {
#if __CUDA_ARCH__ >= 900
    if constexpr (sizeof(Gt) == 4 && N % 4 == 0) {
      if (vec && nv == N) {
#pragma unroll
        for (int i = 0; i < N; i += 4)
          atomicAdd(reinterpret_cast<float4*>(p + i),
                    make_float4((float)g[i], (float)g[i + 1], (float)g[i + 2], (float)g[i + 3]));
        return;
      }
    }
#endif
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < nv) atomicAdd(p + i, From<Gt>::cvt(g[i]));
  } else {
    A m[N];
    load_grad<N>(m, p, nv, vec);
#pragma unroll
    for (int i = 0; i < N; ++i) m[i] += g[i];
    store_piece<N>(p, m, nv, vec);
  }
}

// f x as the scatter's sum of a run of one: accumulated from zero (the same bits)
template <int N, typename A>
__device__ __forceinline__ void solo_term(A (&acc)[N], A f, const A* x) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    acc[i] = A(0);
    acc[i] += f * x[i];
  }
}

// dM[row piece] of a solo write entry (round 2 holds the piece, `old`, and no other entry of
// the chunk touches the row): old + the term f z that the scatter would add, with the same
// bits as add_grad's atomic or read-modify-write (the atomic flushes subnormals, this does not)
template <int N, typename A, typename Gt>
__device__ __forceinline__ void solo_grad(Gt* __restrict__ p, const A (&old)[N], A f,
                                          const A* z, int nv, bool vec) {
  A acc[N];
  solo_term<N>(acc, f, z);
  if constexpr (sizeof(Gt) >= 4) {
    Gt v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = From<Gt>::cvt(old[i]) + From<Gt>::cvt(acc[i]);
    store_raw<N>(p, v, nv, vec);
  } else {
    A m[N];
#pragma unroll
    for (int i = 0; i < N; ++i) m[i] = old[i] + acc[i];
    store_piece<N>(p, m, nv, vec);
  }
}

template <bool B> struct BoolC { static constexpr bool value = B; };

// dot product of two tile rows of `np` whole pieces (zero past the tile's width)
template <int N, typename A>
__device__ __forceinline__ A dot_aa(const A* x, const A* y, int np) {
  A s = A(0);
#pragma unroll 1
  for (int c = 0; c < np * N; c += N) {
#pragma unroll
    for (int i = 0; i < N; ++i) s += x[c + i] * y[c + i];
  }
  return s;
}

// Shared-memory layout of the backward's per-chunk stage (kernels/gpu.py's _smem mirrors it:
// every region rounded up to 16 bytes, in this order).
template <typename V, typename A, typename I>
struct BwdStage {
  A* aw; A* cw; A* beta; A* ev; I* wid; I* rid; V* val; V* drv; int* ptr; int* srt; int* rl;
  unsigned char* ec;
  __device__ unsigned char* carve(unsigned char* p, int C, int W, int TVP) {
    aw = reinterpret_cast<A*>(p);     p += r16((long long)C * W * sizeof(A));
    cw = reinterpret_cast<A*>(p);     p += r16((long long)C * W * sizeof(A));
    beta = reinterpret_cast<A*>(p);   p += r16((long long)C * sizeof(A));
    ev = reinterpret_cast<A*>(p);     p += r16((long long)BE_STAGE * sizeof(A));
    wid = reinterpret_cast<I*>(p);    p += r16((long long)C * W * sizeof(I));
    rid = reinterpret_cast<I*>(p);    p += r16((long long)C * W * sizeof(I));
    val = reinterpret_cast<V*>(p);    p += r16((long long)C * TVP * sizeof(V));
    drv = reinterpret_cast<V*>(p);    p += r16((long long)C * TVP * sizeof(V));
    ptr = reinterpret_cast<int*>(p);  p += r16((long long)(4 * C + 1) * 4);
    srt = reinterpret_cast<int*>(p);  p += r16((long long)2 * C * W * 4);
    rl = reinterpret_cast<int*>(p);   p += r16((long long)C * W * 4);
    ec = p;                           p += r16(BE_STAGE);
    return p;
  }
};

// mW, mNPC, mNPC_last: FastDiv's multipliers from the launcher, as in the forward. Stop 14's
// profile found a spilled multiplier reloaded (LDL) before each use in the second round, 6.5%
// of the stall samples; as parameters they come from the constant bank (NVRTC, headline
// instance: spills 32/36 -> 8/24 bytes; H200: forward+backward -3.1%, stop 15).
// DS = 1 instances (exact snapshots only) add the dM stage (ssnap == 2); DS = 0 instances
// compile without it, so that its code does not change theirs (stop 21 measured the other
// paths 1.5-9.5% slower with it compiled in, on the same plans)
template <typename T, typename V, typename A, typename Gt, typename I, int Q, int N, int DS = 0>
__global__ void __launch_bounds__(512)
sdm_bwd_kernel(T* __restrict__ bank, const I* __restrict__ wi, const A* __restrict__ aw,
               const V* __restrict__ vals, const A* __restrict__ beta,
               const I* __restrict__ ri, const A* __restrict__ cw,
               const int* __restrict__ sp_ptr, const unsigned char* __restrict__ sp_col,
               const A* __restrict__ sp_val, const int* __restrict__ srt_g,
               const typename Snap<T, Q>::type* __restrict__ snap,
               const float* __restrict__ scale, const V* __restrict__ dr,
               Gt* __restrict__ dM, A* __restrict__ d_aw, V* __restrict__ d_vals,
               A* __restrict__ d_beta, A* __restrict__ d_cw,
               int T_, int P, int hd, int W, long long S, int C, int n_lo, int n_hi, int TW,
               int ntile, int CS, int vecmask, int ssnap,
               unsigned mW, unsigned mNPC, unsigned mNPC_last) {
  typedef typename Snap<T, Q>::type ST;
  const int tile = blockIdx.x % ntile, bp = blockIdx.x / ntile, p = bp % P, b = bp / P;
#ifdef SDM_BWD_STAGGER
  SDM_STAGGER(bp, SDM_BWD_STAGGER);
#endif
  const int D = P * hd, c0 = tile * TW, tw = min(TW, hd - c0), nseg = n_hi - n_lo;
  const int NPC = (tw + N - 1) / N, TWP = ((TW + N - 1) / N) * N, TVP = (TWP + 7) & ~7;
  const int NPT = TWP / N;   // partial-sum slots per entry
  const bool vb = vecmask & 1, v16 = vecmask & 2, d16 = vecmask & 4, vs = vecmask & 8,
             vg = vecmask & 16, vd = vecmask & 64;
  constexpr int NV = 16 / sizeof(V);
  // whole grad and bank pieces are whole 16-byte words: the rounds may group their loads
  constexpr bool GROUPED = BG > 1 && (sizeof(Gt) * N) % 16 == 0;

  extern __shared__ __align__(16) unsigned char smem[];
  BwdStage<V, A, I> st;
  const long long stage_bytes = st.carve(smem, C, W, TVP) - smem;
  unsigned char* sp = smem + 2 * stage_bytes;
  A* E_s = reinterpret_cast<A*>(sp);  sp += r16((long long)C * TWP * sizeof(A));   // e0, then e
  A* U_s = reinterpret_cast<A*>(sp);  sp += r16((long long)C * TWP * sizeof(A));
  A* D_s = reinterpret_cast<A*>(sp);  sp += r16((long long)C * TWP * sizeof(A));   // D, then du
  A* Z_s = reinterpret_cast<A*>(sp);  sp += r16((long long)C * TWP * sizeof(A));
  A* R_s = reinterpret_cast<A*>(sp);  sp += r16((long long)C * TWP * sizeof(A));   // dr
  A* pa_s = reinterpret_cast<A*>(sp); sp += r16((long long)C * W * NPT * sizeof(A));  // da parts
  A* pc_s = reinterpret_cast<A*>(sp); sp += r16((long long)C * W * NPT * sizeof(A));  // dc parts
  A* pb_s = reinterpret_cast<A*>(sp);                                                 // dbeta
  sp += r16((long long)C * NPT * sizeof(A));
  T* SN_s = reinterpret_cast<T*>(sp);   // C*W snapshot rows of the tile (only when staged)
  // ssnap == 2 (the dM stage): after SN_s, the C*W dM rows of the chunk's write entries and the
  // C*W bank rows of its reads (row 0 where a write of the chunk links the read, or its id is bad)
  Gt* DM_s = reinterpret_cast<Gt*>(sp + r16((long long)C * W * TWP * sizeof(T)));
  T* BR_s = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(DM_s) +
                                 r16((long long)C * W * TWP * sizeof(Gt)));

  T* bank_b = bank + (long long)b * S * D + p * hd + c0;
  Gt* dM_b = dM + (long long)b * S * D + p * hd + c0;
  const FastDiv divW(W, mW), divNPC(NPC, tile == ntile - 1 ? mNPC_last : mNPC);
  // every piece full and every row aligned: the round trips take their plain 16-byte path
  const bool fast = vb && vs && vg && vd && tw % N == 0;
  // exact snapshots on the fast path: the chunk's snapshot rows are copied into SN_s with
  // cp.async (all in flight at once) and both round trips read them from there
#ifdef SDM_BWD_NO_SNAP_STAGE   // benchmarks: snapshots read from global memory, for comparison
  const bool sst = false;
#else
  const bool sst = ssnap && fast && Q == 0;
#endif
  // the dM stage: every row piece round 1 needs is copied with cp.async, all in flight at once,
  // and round 2 takes its dM rows from there too (whole 16-byte words of dM per piece)
  // (sm_80+: cp.async reads through L2, where the scatter's atomics update dM; a plain load
  // could find a stale L1 line)
#if __CUDA_ARCH__ >= 800
  constexpr bool DM16 = DS != 0 && Q == 0 && (sizeof(Gt) * N) % 16 == 0;
#else
  constexpr bool DM16 = false;
#endif
  const bool dst = DM16 && sst && ssnap == 2;

  auto stage = [&](int n) {
    BwdStage<V, A, I> g;
    g.carve(smem + (n & 1) * stage_bytes, C, W, TVP);
    return g;
  };
  auto prefetch = [&](int n) {
    const BwdStage<V, A, I> g = stage(n);
    const int t0 = n * C, L = min(C, T_ - t0), Ne = L * W;
    const long long chunk = (long long)bp * nseg + (n - n_lo);
    const long long tokb = ((long long)b * T_ + t0) * P + p;
    // a token's W entries are contiguous in [B, T, P, W]: one row per token, P * W apart
    cp_rows(g.wid, wi + tokb * W, L, W, (long long)P * W);
    cp_rows(g.rid, ri + tokb * W, L, W, (long long)P * W);
    cp_rows(g.aw, aw + tokb * W, L, W, (long long)P * W);
    cp_rows(g.cw, cw + tokb * W, L, W, (long long)P * W);
    cp_rows(g.rl, srt_g + chunk * 3 * C * W + 2 * C * W, 1, Ne, 0);
    cp_rows(g.srt, srt_g + chunk * 3 * C * W, 1, 2 * Ne, 0);
    for (int j = threadIdx.x; j < L; j += blockDim.x) cp_elem(g.beta + j, beta + tokb + (long long)j * P);
    cp_rows(g.ptr, sp_ptr + chunk * (4 * C + 1), 1, 4 * C + 1, 0);
    const int E_cap = min(BE_STAGE, 2 * C * C);
    cp_rows(g.ev, sp_val + chunk * 2 * C * C, 1, E_cap, 0);
    // whole 16-byte pieces: r16(E_cap) <= CS, inside the chunk's columns and the stage
    cp_rows(g.ec, sp_col + chunk * CS, 1, (int)r16(E_cap), 0);
    const long long vrow0 = ((long long)b * T_ + t0) * D + p * hd + c0;
    if (v16) {
      const int pcs = tw / NV;
      for (int i = threadIdx.x; i < L * pcs; i += blockDim.x) {
        const int tt = i / pcs, j = (i % pcs) * NV;
        cp_async<16>(g.val + tt * TVP + j, vals + vrow0 + (long long)tt * D + j);
      }
    } else {
      for (int i = threadIdx.x; i < L * tw; i += blockDim.x) {
        const int tt = i / tw, j = i % tw;
        cp_elem(g.val + tt * TVP + j, vals + vrow0 + (long long)tt * D + j);
      }
    }
    if (d16) {
      const int pcs = tw / NV;
      for (int i = threadIdx.x; i < L * pcs; i += blockDim.x) {
        const int tt = i / pcs, j = (i % pcs) * NV;
        cp_async<16>(g.drv + tt * TVP + j, dr + vrow0 + (long long)tt * D + j);
      }
    } else {
      for (int i = threadIdx.x; i < L * tw; i += blockDim.x) {
        const int tt = i / tw, j = i % tw;
        cp_elem(g.drv + tt * TVP + j, dr + vrow0 + (long long)tt * D + j);
      }
    }
    cp_commit();
  };

  int WS = 1;
  while (WS < bws_max(W) && WS * 2 <= W) WS *= 2;

  prefetch(n_hi - 1);
  for (int n = n_hi - 1; n >= n_lo; --n) {
    const BwdStage<V, A, I> g = stage(n);
    const int t0 = n * C, L = min(C, T_ - t0), Ne = L * W;
    const long long chunk = (long long)bp * nseg + (n - n_lo);
    const long long tokb = ((long long)b * T_ + t0) * P + p;
    if (n > n_lo) {   // the other stage was released by the barrier that ended chunk n + 1
      prefetch(n - 1);
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const int nnz = g.ptr[4 * C];
    const A* ev = nnz <= BE_STAGE ? g.ev : sp_val + chunk * 2 * C * C;
    const unsigned char* ec = nnz <= BE_STAGE ? g.ec : sp_col + chunk * CS;
    const int TP = L * NPC, total = TP * WS;
#ifdef SDM_BWD_SOLO
    // per entry (writes, then reads): 1 where its slot has no other valid entry in the chunk;
    // 2*Ne bytes over the read links (Ne ints), which nothing reads after round 1
    unsigned char* const fl_s = reinterpret_cast<unsigned char*>(g.rl);
#endif

    // 1: snapshots and dM of the written rows, M0 of the read rows. Every load is issued
    // without a branch (a bad id reads row 0 and its result is discarded by a select), and
    // nothing is stored to global memory here, so a thread keeps several entries' loads in
    // flight; when every piece is full and aligned (F) the loads are plain 16-byte ones.
    auto round1 = [&](auto fc) {
      constexpr bool F = decltype(fc)::value;
      for (int base = 0; base < total; base += blockDim.x) {
        const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
        const bool act = task < total;
        const int t = divNPC.div(tp), pc = tp - t * NPC, cc = pc * N;
        const int nv = F ? N : min(N, tw - cc);
        const long long tok = tokb + (long long)t * P;
        A x[N], d[N], r[N];
#pragma unroll
        for (int i = 0; i < N; ++i) {
          x[i] = A(0);
          d[i] = A(0);
          r[i] = act && i < nv ? to_acc(g.drv[t * TVP + cc + i], A()) : A(0);
        }
        if (act) {
#pragma unroll 2
          for (int w = ws; w < W; w += WS) {
            const int e = t * W + w;
            const I id = g.wid[e], jd = g.rid[e];
            const bool ok = valid_id(id, S), okr = valid_id(jd, S);
            const int lk = g.rl[e], q = lk ? lk - 1 : 0, tq = divW.div(q);
            const long long off = tok * W + w, offl = (tokb + (long long)tq * P) * W + (q - tq * W);
            A m[N], gg[N], mr[N];
            T raw[N];
            SnapIO<N, A, T, ST, Q>::load(m, raw, snap + off * hd + c0 + cc,
                                         Q > 1 ? scale[off] : 0.f, nv, F || vs);
            load_grad<N>(gg, dM_b + (long long)(ok ? id : 0) * D + cc, nv, F || vg);
            // M0[j]: the snapshot of the slot's first write, or the bank row, read through L2
            // (.cg: this kernel writes bank rows, so the read-only path must not serve them)
            if constexpr (Q == 0) {
              const T* src = lk ? snap + offl * hd + c0 + cc : bank_b + (long long)(okr ? jd : 0) * D + cc;
              load_grad<N>(mr, src, nv, F || (lk ? vs : vb));
            } else if (lk) {
              SnapIO<N, A, T, ST, Q>::load_m0(mr, snap + offl * hd + c0 + cc, Q > 1 ? scale[offl] : 0.f,
                                              nv, vs);
            } else {
              load_grad<N>(mr, bank_b + (long long)(okr ? jd : 0) * D + cc, nv, vb);
            }
            const A a = g.aw[e];
            A sr = A(0);
#pragma unroll
            for (int i = 0; i < N; ++i) {
              x[i] = ok ? x[i] + a * m[i] : x[i];
              d[i] = ok ? d[i] + a * gg[i] : d[i];
              sr += r[i] * mr[i];
            }
            pc_s[e * NPT + pc] = okr ? sr : A(0);
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
#pragma unroll
          for (int i = 0; i < N; ++i) {
            const A v = i < nv ? to_acc(g.val[t * TVP + cc + i], A()) : A(0);
            E_s[t * TWP + cc + i] = i < nv ? v - x[i] : A(0);
            D_s[t * TWP + cc + i] = d[i];
            R_s[t * TWP + cc + i] = r[i];
          }
        }
      }
    };
    // 1 with staged snapshots: the snapshot copies go out first; pass A then loads the dM rows
    // of the writes and the bank rows of the reads no write of the chunk links (branch-free:
    // linked reads and bad ids load row 0); pass B, once the copies have landed, takes X and
    // the linked reads' M0 from SN_s. Same terms in the same order as round1.
    auto round1s = [&]() {
      for (int i = threadIdx.x; i < Ne * NPC; i += blockDim.x) {
        const int e = divNPC.div(i), cc = (i - e * NPC) * N, t = divW.div(e);
        cp_async_row(SN_s + (long long)e * TWP + cc,
                     snap + ((tokb + (long long)t * P) * W + (e - t * W)) * hd + c0 + cc);
      }
      cp_commit();
      for (int base = 0; base < total; base += blockDim.x) {
        const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
        const bool act = task < total;
        const int t = divNPC.div(tp), pc = tp - t * NPC, cc = pc * N;
        A d[N], r[N];
#pragma unroll
        for (int i = 0; i < N; ++i) {
          d[i] = A(0);
          r[i] = act ? to_acc(g.drv[t * TVP + cc + i], A()) : A(0);
        }
        if constexpr (GROUPED) {
          // whole groups of BG entries: their dM and bank row loads all go out before any is
          // used (straight-line code, no branch between them); the rest entry by entry
          if (act) {
            int w0 = ws;
            for (; w0 + (BG - 1) * WS < W; w0 += BG * WS) {
              RawPiece<N, Gt> gq[BG];
              RawPiece<N, T> bq[BG];
              bool okw[BG], okr[BG], lkk[BG];
#pragma unroll
              for (int k = 0; k < BG; ++k) {
                const int e = t * W + w0 + k * WS;
                const I id = g.wid[e], jd = g.rid[e];
                okw[k] = valid_id(id, S);
                okr[k] = valid_id(jd, S);
                lkk[k] = g.rl[e] != 0;
#if !defined(SDM_BWD_PROBE_A)
                gq[k].load(dM_b + (long long)(okw[k] ? id : 0) * D + cc);
                bq[k].load(bank_b + (long long)(okr[k] && !lkk[k] ? jd : 0) * D + cc);
#elif SDM_BWD_PROBE_A == 1   // diagnostic, wrong results: the same loads from 256 hot rows
                gq[k].load(dM_b + min((long long)(e & 255), S - 1) * D + cc);
                bq[k].load(bank_b + min((long long)(e & 255), S - 1) * D + cc);
#else                        // diagnostic, wrong results: no loads
#pragma unroll
                for (int j = 0; j < RawPiece<N, Gt>::NQ; ++j) gq[k].u.q[j] = make_int4(0, 0, 0, 0);
#pragma unroll
                for (int j = 0; j < RawPiece<N, T>::NQ; ++j) bq[k].u.q[j] = make_int4(0, 0, 0, 0);
#endif
              }
#pragma unroll
              for (int k = 0; k < BG; ++k) {
                const int e = t * W + w0 + k * WS;
                const A a = g.aw[e];
                A sr = A(0);
#pragma unroll
                for (int i = 0; i < N; ++i) {
                  d[i] = okw[k] ? d[i] + a * to_acc(gq[k].u.v[i], A()) : d[i];
                  sr += r[i] * to_acc(bq[k].u.v[i], A());
                }
                if (!lkk[k]) pc_s[e * NPT + pc] = okr[k] ? sr : A(0);
              }
            }
            for (int w = w0; w < W; w += WS) {
              const int e = t * W + w;
              const I id = g.wid[e], jd = g.rid[e];
              const bool ok = valid_id(id, S), okr = valid_id(jd, S);
              const int lk = g.rl[e];
              A gg[N], mr[N];
              load_grad<N>(gg, dM_b + (long long)(ok ? id : 0) * D + cc, N, true);
              load_grad<N>(mr, bank_b + (long long)(okr && !lk ? jd : 0) * D + cc, N, true);
              const A a = g.aw[e];
              A sr = A(0);
#pragma unroll
              for (int i = 0; i < N; ++i) {
                d[i] = ok ? d[i] + a * gg[i] : d[i];
                sr += r[i] * mr[i];
              }
              if (!lk) pc_s[e * NPT + pc] = okr ? sr : A(0);
            }
          }
        } else if (act) {
#pragma unroll 2
          for (int w = ws; w < W; w += WS) {
            const int e = t * W + w;
            const I id = g.wid[e], jd = g.rid[e];
            const bool ok = valid_id(id, S), okr = valid_id(jd, S);
            const int lk = g.rl[e];
            A gg[N], mr[N];
            load_grad<N>(gg, dM_b + (long long)(ok ? id : 0) * D + cc, N, true);
            load_grad<N>(mr, bank_b + (long long)(okr && !lk ? jd : 0) * D + cc, N, true);
            const A a = g.aw[e];
            A sr = A(0);
#pragma unroll
            for (int i = 0; i < N; ++i) {
              d[i] = ok ? d[i] + a * gg[i] : d[i];
              sr += r[i] * mr[i];
            }
            if (!lk) pc_s[e * NPT + pc] = okr ? sr : A(0);
          }
        }
        for (int o = 1; o < WS; o <<= 1) {
#pragma unroll
          for (int i = 0; i < N; ++i) d[i] += __shfl_xor_sync(0xffffffffu, d[i], o);
        }
        if (act && ws == 0) {
#pragma unroll
          for (int i = 0; i < N; ++i) {
            D_s[t * TWP + cc + i] = d[i];
            R_s[t * TWP + cc + i] = r[i];
          }
        }
      }
      cp_wait<0>();
      __syncthreads();
      for (int base = 0; base < total; base += blockDim.x) {
        const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
        const bool act = task < total;
        const int t = divNPC.div(tp), pc = tp - t * NPC, cc = pc * N;
        A x[N];
#pragma unroll
        for (int i = 0; i < N; ++i) x[i] = A(0);
        if (act) {
          for (int w = ws; w < W; w += WS) {
            const int e = t * W + w;
            const bool ok = valid_id(g.wid[e], S);
            const int lk = g.rl[e];
            const A a = g.aw[e];
            T raw[N];
            load_raw<N>(raw, SN_s + (long long)e * TWP + cc, N, true);
#pragma unroll
            for (int i = 0; i < N; ++i) x[i] = ok ? x[i] + a * to_acc(raw[i], A()) : x[i];
            if (lk) {   // M0[j] = the snapshot of the write heading j's run in this chunk
              load_raw<N>(raw, SN_s + (long long)(lk - 1) * TWP + cc, N, true);
              A sr = A(0);
#pragma unroll
              for (int i = 0; i < N; ++i) sr += R_s[t * TWP + cc + i] * to_acc(raw[i], A());
              pc_s[e * NPT + pc] = valid_id(g.rid[e], S) ? sr : A(0);
            }
          }
        }
        for (int o = 1; o < WS; o <<= 1) {
#pragma unroll
          for (int i = 0; i < N; ++i) x[i] += __shfl_xor_sync(0xffffffffu, x[i], o);
        }
        if (act && ws == 0) {
#pragma unroll
          for (int i = 0; i < N; ++i)
            E_s[t * TWP + cc + i] = to_acc(g.val[t * TVP + cc + i], A()) - x[i];
        }
      }
    };
    // 1 with the dM stage: the copies first, then one pass from shared memory, the same terms
    // in the same order as round1s
    auto round1d = [&]() {
      if constexpr (DM16) {
        constexpr int GQ = (int)sizeof(Gt) * N / 16;   // 16-byte words of a dM piece
        for (int i = threadIdx.x; i < Ne * NPC; i += blockDim.x) {
          const int e = divNPC.div(i), cc = (i - e * NPC) * N, t = divW.div(e);
          cp_async_row(SN_s + (long long)e * TWP + cc,
                       snap + ((tokb + (long long)t * P) * W + (e - t * W)) * hd + c0 + cc);
          const I id = g.wid[e], jd = g.rid[e];
          const long long rw = valid_id(id, S) ? (long long)id : 0;
          const long long rr = valid_id(jd, S) && !g.rl[e] ? (long long)jd : 0;
#pragma unroll
          for (int j = 0; j < GQ; ++j)
            cp_async_row(reinterpret_cast<int4*>(DM_s + (long long)e * TWP + cc) + j,
                         reinterpret_cast<const int4*>(dM_b + rw * D + cc) + j);
          cp_async_row(BR_s + (long long)e * TWP + cc, bank_b + rr * D + cc);
        }
        cp_commit();
        cp_wait<0>();
        __syncthreads();
        for (int base = 0; base < total; base += blockDim.x) {
          const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
          const bool act = task < total;
          const int t = divNPC.div(tp), pc = tp - t * NPC, cc = pc * N;
          A x[N], d[N], r[N];
#pragma unroll
          for (int i = 0; i < N; ++i) {
            x[i] = A(0);
            d[i] = A(0);
            r[i] = act ? to_acc(g.drv[t * TVP + cc + i], A()) : A(0);
          }
          if (act) {
#pragma unroll 2
            for (int w = ws; w < W; w += WS) {
              const int e = t * W + w;
              const bool ok = valid_id(g.wid[e], S), okr = valid_id(g.rid[e], S);
              const int lk = g.rl[e];
              const A a = g.aw[e];
              T raw[N], br[N];
              RawPiece<N, Gt> gw;   // 16-byte words: DM_s is only 16-byte aligned
#pragma unroll
              for (int j = 0; j < GQ; ++j)
                gw.u.q[j] = reinterpret_cast<const int4*>(DM_s + (long long)e * TWP + cc)[j];
              const Gt (&gr)[N] = gw.u.v;
              load_raw<N>(raw, SN_s + (long long)e * TWP + cc, N, true);
              load_raw<N>(br, (lk ? SN_s + (long long)(lk - 1) * TWP : BR_s + (long long)e * TWP) + cc,
                          N, true);
              A sr = A(0);
#pragma unroll
              for (int i = 0; i < N; ++i) {
                x[i] = ok ? x[i] + a * to_acc(raw[i], A()) : x[i];
                d[i] = ok ? d[i] + a * to_acc(gr[i], A()) : d[i];
                sr += r[i] * to_acc(br[i], A());
              }
              pc_s[e * NPT + pc] = okr ? sr : A(0);
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
#pragma unroll
            for (int i = 0; i < N; ++i) {
              E_s[t * TWP + cc + i] = to_acc(g.val[t * TVP + cc + i], A()) - x[i];
              D_s[t * TWP + cc + i] = d[i];
              R_s[t * TWP + cc + i] = r[i];
            }
          }
        }
      }
    };
    if (dst) round1d();
    else if (sst) round1s();
    else if (fast) round1(BoolC<true>());
    else round1(BoolC<false>());
    __syncthreads();
    // u = Ainv diag(beta) e0 (unit diagonal implied)
    for (int task = threadIdx.x; task < TP; task += blockDim.x) {
      const int t = divNPC.div(task), cc = (task - t * NPC) * N;
      A u[N];
      const A bt = g.beta[t];
#pragma unroll
      for (int i = 0; i < N; ++i) u[i] = bt * E_s[t * TWP + cc + i];
      for (int k = g.ptr[t], ke = g.ptr[t + 1]; k < ke; ++k) {
        const int tau = ec[k];
        const A f = ev[k] * g.beta[tau];
#pragma unroll
        for (int i = 0; i < N; ++i) u[i] += f * E_s[tau * TWP + cc + i];
      }
#pragma unroll
      for (int i = 0; i < N; ++i) U_s[t * TWP + cc + i] = u[i];
    }
#ifdef SDM_BWD_SOLO
    // solo entries: the only valid entry of their slot in the chunk (a run of one). Round 2
    // adds their terms to dM itself (a write's right after its own dM loads: no other entry
    // of the chunk reads that row), and the scatter skips them
    for (int ps = threadIdx.x; ps < 2 * Ne; ps += blockDim.x) {
      const int code = g.srt[ps];
      const bool last = ps + 1 == 2 * Ne || (g.srt[ps + 1] & B_RUN_HEAD);
      fl_s[code & B_QMASK] = fast && (code & B_RUN_HEAD) && last && !(code & B_RUN_BAD);
    }
#endif
    __syncthreads();
    // e = e0 - tril(G,-1) u ;  du = D + H^T dr   (each in place on its own (t, piece))
    for (int task = threadIdx.x; task < TP; task += blockDim.x) {
      const int t = divNPC.div(task), cc = (task - t * NPC) * N;
      for (int k = g.ptr[3 * C + t], ke = g.ptr[3 * C + t + 1]; k < ke; ++k) {
        const int tau = ec[k];
        const A f = ev[k];
#pragma unroll
        for (int i = 0; i < N; ++i) E_s[t * TWP + cc + i] -= f * U_s[tau * TWP + cc + i];
      }
      for (int k = g.ptr[C + t], ke = g.ptr[C + t + 1]; k < ke; ++k) {
        const int s = ec[k];
        const A f = ev[k];
#pragma unroll
        for (int i = 0; i < N; ++i) D_s[t * TWP + cc + i] += f * R_s[s * TWP + cc + i];
      }
    }
#if defined(SDM_BWD_SOLO) && SDM_BWD_SOLO_READS == 2
    // the solo reads' terms c dr_t: no entry of the chunk reads their dM rows, so they go out
    // now, one task per (entry, piece) (the threads with no task above start here)
    for (int task = threadIdx.x; fast && task < Ne * NPC; task += blockDim.x) {
      const int e = divNPC.div(task);
      if (!fl_s[Ne + e]) continue;
      const int cc = (task - e * NPC) * N, t = divW.div(e);
      A acc[N];
      solo_term<N>(acc, g.cw[e], R_s + t * TWP + cc);
      add_grad<N>(dM_b + (long long)g.rid[e] * D + cc, acc, N, true);
    }
#endif
    __syncthreads();
    // z = Ainv^T du
    for (int task = threadIdx.x; task < TP; task += blockDim.x) {
      const int t = divNPC.div(task), cc = (task - t * NPC) * N;
      A z[N];
#pragma unroll
      for (int i = 0; i < N; ++i) z[i] = D_s[t * TWP + cc + i];
      for (int k = g.ptr[2 * C + t], ke = g.ptr[2 * C + t + 1]; k < ke; ++k) {
        const int s = ec[k];
        const A f = ev[k];
#pragma unroll
        for (int i = 0; i < N; ++i) z[i] += f * D_s[s * TWP + cc + i];
      }
#pragma unroll
      for (int i = 0; i < N; ++i) Z_s[t * TWP + cc + i] = z[i];
    }
    __syncthreads();
    // 2: dv, dbeta parts; da parts from dM and M0 of the written rows (loads as in 1); the
    // rewind: each written row gets its snapshot back (no load of the bank follows in this chunk)
    auto round2 = [&](auto fc) {
      constexpr bool F = decltype(fc)::value;
      for (int base = 0; base < total; base += blockDim.x) {
        const int task = base + threadIdx.x, ws = task % WS, tp = task / WS;
        if (task >= total) break;
        const int t = divNPC.div(tp), pc = tp - t * NPC, cc = pc * N;
        const int nv = F ? N : min(N, tw - cc);
        const long long tok = tokb + (long long)t * P;
        const A bt = g.beta[t];
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
          store_piece<N>(d_vals + ((long long)b * T_ + t0 + t) * D + p * hd + c0 + cc, dv, nv,
                         F || vd);
          pb_s[t * NPT + pc] = sb;
        }
        int w_rest = ws;   // the entries left to the loop below
        if constexpr (F && GROUPED) {
          if (sst) {   // snapshots from SN_s; whole groups' dM loads go out first, as in round 1
            int w0 = ws;
            for (; w0 + (BG - 1) * WS < W; w0 += BG * WS) {
              RawPiece<N, Gt> gq[BG];
              I idk[BG];
              bool okk[BG];
#pragma unroll
              for (int k = 0; k < BG; ++k) {
                idk[k] = g.wid[t * W + w0 + k * WS];
                okk[k] = valid_id(idk[k], S);
                if (dst) {   // 16-byte words: DM_s is only 16-byte aligned
#pragma unroll
                  for (int j = 0; j < RawPiece<N, Gt>::NQ; ++j)
                    gq[k].u.q[j] = reinterpret_cast<const int4*>(
                        DM_s + (long long)(t * W + w0 + k * WS) * TWP + cc)[j];
                } else {
#if !defined(SDM_BWD_PROBE_R2)
                  gq[k].load(dM_b + (long long)(okk[k] ? idk[k] : 0) * D + cc);
#elif SDM_BWD_PROBE_R2 == 1   // diagnostic, wrong results: the same loads from 256 hot rows
                  gq[k].load(dM_b + min((long long)((t * W + w0 + k * WS) & 255), S - 1) * D + cc);
#else                         // diagnostic, wrong results: no loads
#pragma unroll
                  for (int j = 0; j < RawPiece<N, Gt>::NQ; ++j) gq[k].u.q[j] = make_int4(0, 0, 0, 0);
#endif
                }
              }
#pragma unroll
              for (int k = 0; k < BG; ++k) {
                const int e = t * W + w0 + k * WS;
                A m[N], gg[N];
                T raw[N];
                load_raw<N>(raw, SN_s + (long long)e * TWP + cc, N, true);
#pragma unroll
                for (int i = 0; i < N; ++i) {
                  m[i] = to_acc(raw[i], A());
                  gg[i] = to_acc(gq[k].u.v[i], A());
                }
                if (okk[k]) store_raw<N>(bank_b + (long long)idk[k] * D + cc, raw, N, true);
                A sa = A(0);
#pragma unroll
                for (int i = 0; i < N; ++i) sa += zu[i] * gg[i] + dx[i] * m[i];
                pa_s[e * NPT + pc] = okk[k] ? sa : A(0);
#ifdef SDM_BWD_SOLO
                if (okk[k] && fl_s[e])
                  solo_grad<N>(dM_b + (long long)idk[k] * D + cc, gg, -g.aw[e] * bt,
                               Z_s + t * TWP + cc, N, true);
#endif
              }
            }
            w_rest = w0;
          }
        }
#pragma unroll 2
        for (int w = w_rest; w < W; w += WS) {
          const int e = t * W + w;
          const I id = g.wid[e];
          const bool ok = valid_id(id, S);
          const long long off = tok * W + w;
          A m[N], gg[N];
          T raw[N];
          if (F && sst) {
            load_raw<N>(raw, SN_s + (long long)e * TWP + cc, N, true);
#pragma unroll
            for (int i = 0; i < N; ++i) m[i] = to_acc(raw[i], A());
          } else {
            SnapIO<N, A, T, ST, Q>::load(m, raw, snap + off * hd + c0 + cc,
                                         Q > 1 ? scale[off] : 0.f, nv, F || vs);
          }
          load_grad<N>(gg, dM_b + (long long)(ok ? id : 0) * D + cc, nv, F || vg);
          if (ok) store_raw<N>(bank_b + (long long)id * D + cc, raw, nv, F || vb);
          A sa = A(0);
#pragma unroll
          for (int i = 0; i < N; ++i) sa += zu[i] * gg[i] + dx[i] * m[i];
          pa_s[e * NPT + pc] = ok ? sa : A(0);
#ifdef SDM_BWD_SOLO
          if constexpr (F)
            if (ok && fl_s[e])
              solo_grad<N>(dM_b + (long long)id * D + cc, gg, -g.aw[e] * bt, Z_s + t * TWP + cc,
                           N, true);
#endif
        }
#if defined(SDM_BWD_SOLO) && SDM_BWD_SOLO_READS == 1
        // the solo reads' terms: their rows are not read in this chunk, so they go to dM now
        for (int w = ws; F && w < W; w += WS) {
          const int e = t * W + w;
          if (!fl_s[Ne + e]) continue;
          A acc[N];
          solo_term<N>(acc, g.cw[e], R_s + t * TWP + cc);
          add_grad<N>(dM_b + (long long)g.rid[e] * D + cc, acc, N, true);
        }
#endif
      }
    };
    if (fast) round2(BoolC<true>()); else round2(BoolC<false>());
    __syncthreads();
    // per entry (one thread per sorted position): its parts in piece order plus the overlap
    // terms of its run, then one atomicAdd per tile
#if defined(SDM_BWD_PROBE_PE)   // diagnostic, wrong results: no per-entry sums
    for (int ps = threadIdx.x; ps < 0; ps += blockDim.x) {
#else
    for (int ps = threadIdx.x; ps < 2 * Ne; ps += blockDim.x) {
#endif
      const int code = g.srt[ps];
      if (code & B_RUN_BAD) continue;
      const int q = code & B_QMASK;
      const bool isw = q < Ne;
      const int e = isw ? q : q - Ne, t = divW.div(e);
      const A* part = (isw ? pa_s : pc_s) + e * NPT;
      A acc = A(0);
      for (int k = 0; k < NPC; ++k) acc += part[k];
      const bool last = ps + 1 == 2 * Ne || (g.srt[ps + 1] & B_RUN_HEAD);
      if (!((code & B_RUN_HEAD) && last)) {   // a run of two or more entries
        int st0 = ps;
        while (!(g.srt[st0] & B_RUN_HEAD)) --st0;
        for (int p2 = st0; p2 < 2 * Ne; ++p2) {
          const int c2 = g.srt[p2];
          if (p2 > st0 && (c2 & B_RUN_HEAD)) break;
          const int q2 = c2 & B_QMASK;
          if (q2 < Ne) {                                   // a write entry (tau, w')
            const int tau = divW.div(q2);
            const A a2 = g.aw[q2];
            if (isw) {
              if (tau == t) continue;
              const int hi = tau > t ? tau : t, lo = tau > t ? t : tau;
              acc -= a2 * g.beta[hi] * dot_aa<N>(Z_s + hi * TWP, U_s + lo * TWP, NPC);
            } else if (tau <= t) {
              acc += a2 * dot_aa<N>(R_s + t * TWP, U_s + tau * TWP, NPC);
            }
          } else if (isw) {                                // a read entry (s, w'') of a write
            const int s = divW.div(q2 - Ne);
            if (s < t) continue;
            acc += g.cw[q2 - Ne] * dot_aa<N>(R_s + s * TWP, U_s + t * TWP, NPC);
          }
        }
      }
      const long long off = (tokb + (long long)t * P) * W + (e - t * W);
      atomic_add((isw ? d_aw : d_cw) + off, acc);
    }
    for (int t = threadIdx.x; t < L; t += blockDim.x) {
      A sb = A(0);
      for (int k = 0; k < NPC; ++k) sb += pb_s[t * NPT + k];
      atomic_add(d_beta + tokb + (long long)t * P, sb);
    }
    // scatter into dM: one thread per (run head, piece) sums its run in entry order
#if defined(SDM_BWD_PROBE_SC) && SDM_BWD_PROBE_SC == 2   // diagnostic, wrong results: none
    for (int task = threadIdx.x; task < 0; task += blockDim.x) {
#else
    for (int task = threadIdx.x; task < 2 * Ne * NPC; task += blockDim.x) {
#endif
      const int ps = divNPC.div(task), code = g.srt[ps];
      if (!(code & B_RUN_HEAD) || (code & B_RUN_BAD)) continue;
#ifdef SDM_BWD_SOLO
      if (fl_s[code & B_QMASK]) continue;   // round 2 added its term
#endif
      const int cc = (task - ps * NPC) * N, nv = min(N, tw - cc);
      const int q = code & B_QMASK;
      A acc[N];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = A(0);
      for (int p2 = ps; p2 < 2 * Ne; ++p2) {
        const int c2 = g.srt[p2];
        if (p2 > ps && (c2 & B_RUN_HEAD)) break;
        const int q2 = c2 & B_QMASK;
        const bool w2 = q2 < Ne;
        const int e2 = w2 ? q2 : q2 - Ne, t2 = divW.div(e2);
        const A f = w2 ? -g.aw[e2] * g.beta[t2] : g.cw[e2];
        const A* src = (w2 ? Z_s : R_s) + t2 * TWP + cc;
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] += f * src[i];
      }
      const long long slot = q < Ne ? (long long)g.wid[q] : (long long)g.rid[q - Ne];
#if defined(SDM_BWD_PROBE_SC) && SDM_BWD_PROBE_SC == 1   // diagnostic: the walks, no adds
      add_grad<N>(dM_b + slot * D + cc, acc, S < 0 ? nv : 0, vg);   // S > 0: nothing added
#else
      add_grad<N>(dM_b + slot * D + cc, acc, nv, vg);
#endif
    }
    __syncthreads();
  }
}

}  // namespace sdm
