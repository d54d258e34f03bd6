// Pre-pass of SPEC §3/§4: everything of a chunk that depends on ids and weights only, not on
// the bank, for a range of chunks at once (one block per (b, p, chunk): chunk n0 + blk % nseg
// of (b, p) = blk / nseg). Two compact output forms, both CSR rows (sp_ptr, sp_col, sp_val)
// of a few C x C matrices with the columns of each row ascending:
//
// SPARSE = 1 (the forward):
//   wrun : per write entry q = t*W + w: bits 0-15 = 1 + the next write entry of the same slot
//          (0: none; ascending q), bit 16 = q heads its slot's writes, bit 17 = a bad slot id,
//   rows 0..C-1 the strictly lower part of Ainv (its unit diagonal is implied), rows C..2C-1
//          those of H (tau <= t); sp_ptr[2C] = the chunk's entry count (<= C*C).
// SPARSE = 2 (the backward):
//   srt  : the chunk's write entries q = t*W + w (q < N) and read entries q = N + t*W + w,
//          in runs of equal slots, q ascending within a run (runs by slot when sorted, by
//          their first entry when hashed); bit 30 marks the first entry of a run, bit 29 a
//          slot id outside [0, S) (one run, skipped by every kernel); then, per
//          read entry, 1 + the write entry that heads its slot's run (0: the chunk does not
//          write that slot),
//   rows 0..C-1 the strictly lower rows of Ainv, C..2C-1 the columns of H (H[s][t], s >= t),
//          2C..3C-1 the strictly lower columns of Ainv (Ainv[s][t], s > t), 3C..4C-1 the
//          strictly lower rows of G; sp_ptr[4C] = the entry count (<= 2*C*C).
// with G[t][tau] = k_t . k_tau (tau < t), H[t][tau] = q_t . k_tau (tau <= t), both from the runs
// of equal slots, and Ainv = (I + diag(beta) tril(G, -1))^{-1} (the WY form: u = Ainv diag(beta)
// (v - X)). Overlaps come from the sort (bitonic, in shared memory), never from the C^2 W^2
// pairs. Each token row of G and H is accumulated by one thread in a fixed order: deterministic.
// The forward's form, while slot ids fit the 32-bit keys (S <= KEY32_MAX_S), sorts nothing: a
// hash table of the chunk's write slots (steps 1h-3h) gives each write entry its previous and
// next write of the same slot and each read entry its slot's last write; the walks of step 4
// follow those links in the sort's order (descending entries), so the outputs are the same bits
// (-DSDM_PREPASS_SORT_WRITES compiles the sort back in; stop 16: forward -1.5%). The
// backward's form, where its table fits (steps 1b-3b), hashes all its entries the same way
// and lays the runs of srt out in the order of their first entries instead of by slot (stop
// 17; the same macro sorts it again). Either way the cost follows the entries plus the square
// of each slot's repeats, as step 4's walks already do.

#include "sdm_common.cuh"

namespace sdm {

constexpr int QBITS = 14;                           // 2 * C * W <= 8192 < 2^14
// Sort keys are (slot << QBITS) | entry, 64-bit in general; 32-bit when S <= KEY32_MAX_S (half
// the shared-memory traffic, shuffles and compares of the sort; the same order, so the same
// outputs). An out-of-range id gets the slot KeyBad<K>, above every valid slot.
template <typename K> struct KeyBad;
template <> struct KeyBad<unsigned long long> { static constexpr unsigned long long v = 1ull << 40; };
template <> struct KeyBad<unsigned> { static constexpr unsigned v = (1u << (32 - QBITS)) - 1; };
constexpr long long KEY32_MAX_S = (1ll << (32 - QBITS)) - 1;
constexpr int RUN_HEAD = 1 << 30, RUN_BAD = 1 << 29, QMASK = (1 << QBITS) - 1;

constexpr int WRUN_HEAD = 1 << 16, WRUN_BAD = 1 << 17;
constexpr int ENTRY_GROUP = 4;   // entries whose ids a thread loads before it pushes any


// One compare-exchange step (k, j) of a bitonic sort for the element at index i (value x)
// whose partner i ^ j (j < 32) sits in lane ^ j of the same warp.
template <typename K>
__device__ __forceinline__ K bitonic_lane(K x, int i, int k, int j) {
  const K y = __shfl_xor_sync(0xffffffffu, x, j);
  const bool lower = (i & j) == 0, up = (i & k) == 0;
  return (lower == up) ? (x < y ? x : y) : (x < y ? y : x);
}

// The stages j <= 32 of merge size k (kmin = 2: every stage of a sort up to k = 64) on the
// 64-element segments of keys[0, M2), one segment per warp at a time: lane l holds elements
// l and l + 32, so j = 32 is within a thread and j < 32 a shuffle; no block barrier inside.
template <typename K>
__device__ __forceinline__ void bitonic_warp(K* keys, int M2, int kmin, int kmax) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
  for (int base = warp * 64; base < M2; base += nwarp * 64) {
    K a = keys[base + lane], b = keys[base + lane + 32];
    const int ia = base + lane, ib = ia + 32;
    for (int k = kmin; k <= kmax; k <<= 1) {
      for (int j = min(k >> 1, 32); j > 0; j >>= 1) {
        if (j == 32) {
          const bool up = (ia & k) == 0;
          if ((a > b) == up) { const K t = a; a = b; b = t; }
        } else {
          a = bitonic_lane(a, ia, k, j);
          b = bitonic_lane(b, ib, k, j);
        }
      }
    }
    keys[base + lane] = a;
    keys[base + lane + 32] = b;
  }
}

// Ascending bitonic sort of keys[0, M2) (M2 a power of two) by the whole block. Stages with
// j >= 64 go through shared memory with a barrier each; the others run warp by warp in
// registers (bitonic_warp), so a sort of 2048 keys takes 21 barriers instead of 66.
template <typename K>
__device__ void sort_keys(K* keys, int M2) {
#ifdef SDM_PREPASS_PLAIN_SORT   // benchmarks: every stage through shared memory, for comparison
  if (true) {
#else
  if (M2 < 64) {
#endif
    for (int k = 2; k <= M2; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = threadIdx.x; i < M2; i += blockDim.x) {
          const int ixj = i ^ j;
          if (ixj > i) {
            const K x = keys[i], y = keys[ixj];
            if ((x > y) == ((i & k) == 0)) { keys[i] = y; keys[ixj] = x; }
          }
        }
        __syncthreads();
      }
    }
    return;
  }
  bitonic_warp(keys, M2, 2, 64);
  __syncthreads();
  for (int k = 128; k <= M2; k <<= 1) {
    for (int j = k >> 1; j >= 64; j >>= 1) {
      for (int i = threadIdx.x; i < M2; i += blockDim.x) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const K x = keys[i], y = keys[ixj];
          if ((x > y) == ((i & k) == 0)) { keys[i] = y; keys[ixj] = x; }
        }
      }
      __syncthreads();
    }
    bitonic_warp(keys, M2, k, k);   // its stages j = 32 .. 1
    __syncthreads();
  }
}

// Entry i of a chunk (writes q < N, then reads N + q): stores its weight in wq_s[i] and returns
// its slot id, or `bad` (recorded in the error word) when the id lies outside [0, S).
template <typename K, typename A, typename I>
__device__ __forceinline__ K entry_slot(int i, int N, int W, int P, long long tok0,
                                        const I* __restrict__ wi, const A* __restrict__ aw,
                                        const I* __restrict__ ri, const A* __restrict__ cw,
                                        long long S, K bad, A* wq_s, int* err) {
  const int e = i < N ? i : i - N, t = e / W, w = e % W;
  const long long off = (tok0 + (long long)t * P) * W + w;
  const I id = i < N ? wi[off] : ri[off];
  wq_s[i] = i < N ? aw[off] : cw[off];
  if (valid_id(id, S)) return (K)id;
  flag_error(err, i < N ? 1 : 2);
  return bad;
}

// Every entry i < N2 of the chunk through entry_slot, then `take(i, slot)`, in groups: a thread
// loads the ids of ENTRY_GROUP entries before it hands any on (the hash tables' pushes are
// shared-memory atomics, which would otherwise wait for one global round trip per entry).
template <typename A, typename I, typename F>
__device__ __forceinline__ void entry_slots(int N2, int N, int W, int P, long long tok0,
                                            const I* __restrict__ wi, const A* __restrict__ aw,
                                            const I* __restrict__ ri, const A* __restrict__ cw,
                                            long long S, unsigned bad, A* wq_s, int* err,
                                            F take) {
  for (int i0 = threadIdx.x; i0 < N2; i0 += ENTRY_GROUP * blockDim.x) {
    unsigned slot[ENTRY_GROUP];
#pragma unroll
    for (int u = 0; u < ENTRY_GROUP; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < N2) slot[u] = entry_slot(i, N, W, P, tok0, wi, aw, ri, cw, S, bad, wq_s, err);
    }
#pragma unroll
    for (int u = 0; u < ENTRY_GROUP; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < N2) take(i, slot[u]);
    }
  }
}

// Step 3 of the hashed forms marks the entries whose walk in step 4 is not empty (a write with
// an earlier write of its slot, a read whose slot the chunk writes): bit w of word 2(2C + t)
// for write (t, w), of word 2(2C + t) + 1 for read (t, w), in rm's section 2 (zeroed with the
// masks; step 5 writes it only after step 4's barrier). Step 4 then walks only those, in the
// same ascending order, so every sum keeps its terms and their order. For W <= LIVE_MAX_W.
constexpr int LIVE_MAX_W = 32;
__device__ __forceinline__ void mark_live(unsigned* rm32, int C, int W, int e, bool read) {
  if (W <= LIVE_MAX_W) atomicOr(rm32 + 2 * (2 * C + e / W) + (read ? 1 : 0), 1u << (e % W));
}

// The hash tables of both forms: nb = 2^lg buckets, open addressing from a slot's home bucket;
// tab_key[h] holds the bucket's slot (~0u: empty), tab_top[h] the last entry pushed on its
// list (-1: none). table_clear empties the table and zeroes the CSR masks (the caller syncs).
__device__ __forceinline__ unsigned table_home(unsigned slot, int lg) {
  return (slot * 0x9E3779B1u) >> (32 - lg);
}

__device__ __forceinline__ void table_clear(unsigned* tab_key, int* tab_top, int nb,
                                            unsigned long long* rm, int nrm) {
  for (int h = threadIdx.x; h < nb; h += blockDim.x) { tab_key[h] = ~0u; tab_top[h] = -1; }
  for (int i = threadIdx.x; i < nrm; i += blockDim.x) rm[i] = 0ull;
}

// Entry i joins the table at its slot's bucket and pushes itself on the bucket's list. Returns
// bucket << 16 | the entry pushed before it (0xFFFF: none), the form pos[] keeps.
__device__ __forceinline__ int table_push(unsigned* tab_key, int* tab_top, int nb, int lg,
                                          unsigned slot, int i) {
  unsigned h = table_home(slot, lg);
  for (;;) {
    const unsigned old = atomicCAS(tab_key + h, ~0u, slot);
    if (old == ~0u || old == slot) break;
    h = (h + 1) & (nb - 1);
  }
  const int below = atomicExch(tab_top + h, i);
  return (int)(h << 16) | (below & 0xFFFF);
}

template <typename A, typename I, int SPARSE, typename K>
__device__ __forceinline__ void
prepass_body(const I* __restrict__ wi, const A* __restrict__ aw, const I* __restrict__ ri,
             const A* __restrict__ cw, const A* __restrict__ beta,
             int T, int P, int W, long long S, int C, int n0, int nseg,
             A* __restrict__ sp_val, int* __restrict__ srt_g, int* __restrict__ sp_ptr,
             unsigned char* __restrict__ sp_col, int CS, int* err) {
  constexpr K KEY_BAD = KeyBad<K>::v;
  static_assert(SPARSE == 1 || SPARSE == 2, "the pre-pass has two output forms");
  const int blk = blockIdx.x;                // (b * P + p) * nseg + n - n0
  const int n = n0 + blk % nseg, bp = blk / nseg, p = bp % P, b = bp / P;
  const int t0 = n * C, L = min(C, T - t0), N = L * W, N2 = 2 * N;
  const int NS = SPARSE == 1 ? N : N2;   // the forward's form sorts the writes only
  constexpr int NSEC = SPARSE == 1 ? 2 : 4;   // CSR sections
  int M2 = 1;
  while (M2 < NS) M2 <<= 1;
  const int ld = C + 1;

  extern __shared__ __align__(16) unsigned char smem[];
  K* keys = reinterpret_cast<K*>(smem);   // a region of M2max * 8 bytes whatever K is
  // layout: keys[M2max] | wq[2CW] | pos[2CW] | rm[4C] | Gs [C(C-1)/2], Hs [C(C+1)/2] |
  //         Ai [C(C+1)/2]. The three matrices are lower triangles packed by rows (G strictly
  //         lower: row t at t(t-1)/2; H and Ai with the diagonal: row t at t(t+1)/2), half the
  //         dense squares, so that four forward-form blocks share an SM. The backward's form
  //         keeps the dense squares' room for Gs and Hs (2C(C+1) values): its hash table
  //         (steps 1b-3b) lives there first. The forward's form keeps its read slots in the
  //         upper half of keys (M2 <= M2max / 2 there). keys, wq and pos are dead after step
  //         4: Ai (first written in step 5) and step 6's row offsets rend[4C] go there when
  //         they fit (kernels/gpu.py _smem mirrors the test), else Ai after Hs and rend in keys
  //         (M2max >= 2C).
  // rm[r]: bit k set iff entry k of CSR row r is non-zero (r < NSEC * C; rows past L stay 0),
  //         and rm[3C + t] that of row t of G in both forms; rm[2C + t] holds token t's
  //         entries to walk in step 4 (mark_live) until step 5 writes section 2. The matrices
  //         are never zeroed: every read of them goes through a mask or a row that was written.
  int M2max = 1;
  while (M2max < 2 * C * W) M2max <<= 1;
  A* wq_s = reinterpret_cast<A*>(smem + 8 * M2max);   // the chunk's write weights, then its reads'
  int* pos = reinterpret_cast<int*>(wq_s + 2 * C * W);
  unsigned long long* rm = reinterpret_cast<unsigned long long*>(pos + 2 * C * W);
  unsigned* rm32 = reinterpret_cast<unsigned*>(rm);   // word 2r + h: columns 32h .. 32h + 31
  A* Gs = reinterpret_cast<A*>(rm + 4 * C);
  A* Hs = Gs + C * (C - 1) / 2;
  const int tri = C * (C + 1) / 2;   // values of a packed triangle with its diagonal
  const int gh = SPARSE == 1 ? C * C : 2 * C * ld;   // the room of Gs and Hs, in values
  const bool ai_dead =
      tri * (int)sizeof(A) + 16 * C <= M2max * 8 + 2 * C * W * ((int)sizeof(A) + 4);
  A* Ai = ai_dead ? reinterpret_cast<A*>(smem) : Gs + gh;
  int* rend = ai_dead ? reinterpret_cast<int*>(Ai + tri) : reinterpret_cast<int*>(smem);
  K* rslot = keys + M2max / 2;   // the forward's form: M2 <= M2max / 2 keys

  const long long tok0 = ((long long)b * T + t0) * P + p;   // (b, t0, p) row of [B, T, P, W]
#ifdef SDM_PREPASS_SORT_WRITES   // benchmarks: both forms sort their slots, for comparison
  constexpr bool HASH = false, HASH2 = false;
#else
  constexpr bool HASH = SPARSE == 1 && sizeof(K) == 4, HASH2 = SPARSE == 2 && sizeof(K) == 4;
#endif
  // the backward's form hashes when its table (2 * M2max buckets: keys, list heads), the run
  // sizes and the entries' places fit the keys region and that of Gs and Hs (dead until step 4)
  const bool hash2 = HASH2 && 8 * M2max + 16 * N + 128 <= gh * (int)sizeof(A);
  if (hash2) {
    // The backward's form without a sort (steps 1b-3b): every entry, write or read, joins its
    // slot's list in a hash table; from the list each entry learns its rank in the slot's run
    // (entries ascending), the run's first entry, its previous write (writes: the G walk of
    // step 4), the slot's last and first write (reads: the H walk and the read link). Runs
    // are laid out in srt in the order of their first entries (a scan of the run sizes), not
    // by slot: the kernels only walk within a run, so every sum has the same terms in the same
    // order as with the sort.
    const int NB = 2 * M2max, lg = __ffs(NB) - 1;
    unsigned* tab_key = reinterpret_cast<unsigned*>(keys);          // NB
    int* tab_top = reinterpret_cast<int*>(Gs);                      // NB, then:
    int* run_off = tab_top + NB;      // 2N: the run's size at its first entry, then its offset
    int* place = run_off + N2;        // 2N: first entry of the run | rank << 14 | bad << 28
    int* wsum = place + N2;           // 32 warp totals of the scan
    int* out = srt_g + (long long)blk * 3 * C * W;
    // 1b. the table empty, the masks zero
    table_clear(tab_key, tab_top, NB, rm, 4 * C);
    __syncthreads();
    // 2b. weights; each entry claims its slot's bucket and pushes itself on the bucket's list:
    //     pos[i] = bucket << 16 | the entry pushed before it (0xFFFF: none). Bad ids share the
    //     bucket of KEY_BAD.
    entry_slots(N2, N, W, P, tok0, wi, aw, ri, cw, S, (unsigned)KEY_BAD, wq_s, err,
                [&](int i, unsigned slot) {
                  pos[i] = table_push(tab_key, tab_top, NB, lg, slot, i);
                });
    __syncthreads();
    // 3b. from the list's members (in any order): bits 16-31 of pos[i] become 1 + the
    //     previous write (a write) or 1 + the last write (a read) of the slot, 0 for none or a
    //     bad id (bits 0-15, the list link that other threads walk, stay); the read link goes
    //     out; the run's first entry holds the run's size for the scan.
    for (int i = threadIdx.x; i < N2; i += blockDim.x) {
      const int code = pos[i], h = code >> 16;
      int len = 0, rank = 0, first = i, prevw = -1, firstw = N, lastw = -1;
      for (int m = tab_top[h]; m >= 0 && m != 0xFFFF; m = pos[m] & 0xFFFF) {
        ++len;
        rank += m < i;
        first = min(first, m);
        if (m < N) {
          firstw = min(firstw, m);
          lastw = max(lastw, m);
          if (m < i) prevw = max(prevw, m);
        }
      }
      const bool bad = tab_key[h] == (unsigned)KEY_BAD;
      const int link = bad ? -1 : (i < N ? prevw : lastw);
      pos[i] = ((link + 1) << 16) | (code & 0xFFFF);
      if (link >= 0) mark_live(rm32, C, W, i < N ? i : i - N, i >= N);
      if (i >= N) out[2 * C * W + i - N] = !bad && firstw < N ? firstw + 1 : 0;
      run_off[i] = rank == 0 ? len : 0;
      place[i] = first | rank << 14 | (bad ? 1 << 28 : 0);
    }
    __syncthreads();
    // the runs' offsets: an exclusive scan of run_off over the entries
    {
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
      const int per = (N2 + blockDim.x - 1) / blockDim.x;
      const int lo = min(N2, (int)threadIdx.x * per), hi = min(N2, lo + per);
      int own = 0;
      for (int k = lo; k < hi; ++k) own += run_off[k];
      int incl = own;
      for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
      }
      if (lane == 31) wsum[warp] = incl;
      __syncthreads();
      if (warp == 0) {
        const int tot = lane < nwarp ? wsum[lane] : 0;
        int x = tot;
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, x, o);
          if (lane >= o) x += y;
        }
        if (lane < nwarp) wsum[lane] = x - tot;
      }
      __syncthreads();
      int run = wsum[warp] + incl - own;
      for (int k = lo; k < hi; ++k) {
        const int c = run_off[k];
        run_off[k] = run;
        run += c;
      }
    }
    __syncthreads();
    // each entry to its place: the run's offset + its rank
    for (int i = threadIdx.x; i < N2; i += blockDim.x) {
      const int pl = place[i], rank = (pl >> 14) & 0x3FFF;
      out[run_off[pl & 0x3FFF] + rank] =
          i | (rank == 0 ? RUN_HEAD : 0) | ((pl >> 28) & 1 ? RUN_BAD : 0);
    }
    __syncthreads();
  } else if constexpr (HASH) {
    // The forward's form without a sort: a hash table of the chunk's write slots in the keys
    // region (M2max >= 2N buckets: slot, then the last entry pushed on the bucket's list).
    // 1h. the table empty, the masks zero
    unsigned* tab_key = reinterpret_cast<unsigned*>(keys);
    int* tab_top = reinterpret_cast<int*>(tab_key + M2max);
    const int lg = __ffs(M2max) - 1;
    table_clear(tab_key, tab_top, M2max, rm, 4 * C);
    __syncthreads();
    // 2h. weights; each write entry claims its slot's bucket and pushes itself on the bucket's
    //     list: pos[q] = bucket << 16 | the entry pushed before it (0xFFFF: none); a read
    //     entry keeps its slot in pos[N + e]. Bad ids share the bucket of KEY_BAD.
    entry_slots(N2, N, W, P, tok0, wi, aw, ri, cw, S, (unsigned)KEY_BAD, wq_s, err,
                [&](int i, unsigned slot) {
                  pos[i] = i < N ? table_push(tab_key, tab_top, M2max, lg, slot, i) : (int)slot;
                });
    __syncthreads();
    // 3h. per write entry its neighbours of the same slot (from the list's members, in any
    //     order): the next goes to wrun, 1 + the previous to bits 16-31 of pos[q] (bits 0-15,
    //     the list link that other threads walk, stay); per read entry the last write of its
    //     slot replaces the slot in pos[N + e] (-1: none). Bad entries link to no previous.
    for (int i = threadIdx.x; i < N2; i += blockDim.x) {
      if (i < N) {
        const int code = pos[i], h = code >> 16;
        int prev = -1, next = N;
        for (int m = tab_top[h]; m >= 0 && m != 0xFFFF; m = pos[m] & 0xFFFF) {
          if (m < i) prev = max(prev, m);
          else if (m > i) next = min(next, m);
        }
        const bool bad = tab_key[h] == (unsigned)KEY_BAD;
        srt_g[(long long)blk * C * W + i] =
            (next < N ? next + 1 : 0) | (prev < 0 ? WRUN_HEAD : 0) | (bad ? WRUN_BAD : 0);
        pos[i] = ((bad ? 0 : prev + 1) << 16) | (code & 0xFFFF);
        if (!bad && prev >= 0) mark_live(rm32, C, W, i, false);
      } else {
        const unsigned slot = (unsigned)pos[i];
        int last = -1;
        if (slot != (unsigned)KEY_BAD) {
          for (unsigned h = table_home(slot, lg);; h = (h + 1) & (M2max - 1)) {
            const unsigned kk = tab_key[h];
            if (kk == slot) {
              for (int m = tab_top[h]; m >= 0 && m != 0xFFFF; m = pos[m] & 0xFFFF)
                last = max(last, m);
              break;
            }
            if (kk == ~0u) break;
          }
        }
        pos[i] = last;
        if (last >= 0) mark_live(rm32, C, W, i - N, true);
      }
    }
    __syncthreads();
  } else {
  // 1. keys
  for (int i = threadIdx.x; i < max(M2, N2); i += blockDim.x) {
    K key = ~K(0);
    if (i < N2) {
      const K slot = entry_slot(i, N, W, P, tok0, wi, aw, ri, cw, S, KEY_BAD, wq_s, err);
      key = (slot << QBITS) | (K)i;
      if (SPARSE == 1 && i >= N) rslot[i - N] = slot;
    }
    if (i < M2) keys[i] = i < NS ? key : ~K(0);
  }
  for (int i = threadIdx.x; i < 4 * C; i += blockDim.x) rm[i] = 0ull;
  __syncthreads();
  // 2. bitonic sort of M2 keys (ascending)
  sort_keys(keys, M2);
  // 3. runs and the inverse permutation
  for (int i = threadIdx.x; i < NS; i += blockDim.x) {
    const K key = keys[i], slot = key >> QBITS;
    const int q = (int)(key & QMASK);
    const bool head = i == 0 || (keys[i - 1] >> QBITS) != slot;
    if (SPARSE == 1) {
      if (q < N) {   // a write entry: link it to the next write entry of its slot
        int nxt = 0;
        if (i + 1 < NS && (keys[i + 1] >> QBITS) == slot) {
          const int q2 = (int)(keys[i + 1] & QMASK);
          if (q2 < N) nxt = q2 + 1;
        }
        srt_g[(long long)blk * C * W + q] =
            nxt | (head ? WRUN_HEAD : 0) | (slot == KEY_BAD ? WRUN_BAD : 0);
      }
    } else {
      int* out = srt_g + (long long)blk * 3 * C * W;
      out[i] = q | (head ? RUN_HEAD : 0) | (slot == KEY_BAD ? RUN_BAD : 0);
      if (q >= N) {   // a read entry: the write that heads its slot's run (binary search)
        int lo = 0, hi = i;
        while (lo < hi) {
          const int mid = (lo + hi) >> 1;
          if ((keys[mid] >> QBITS) < slot) lo = mid + 1; else hi = mid;
        }
        const int qh = (int)(keys[lo] & QMASK);
        out[2 * C * W + q - N] = slot != KEY_BAD && qh < N ? qh + 1 : 0;
      }
    }
    pos[q] = i;
  }
  if (SPARSE == 1) {
    // each read entry's run of writes to its slot (binary search of the sorted writes):
    // pos[N + e] = first position | count << 16 (count 0: no write shares the slot)
    for (int e = threadIdx.x; e < N; e += blockDim.x) {
      const K slot = rslot[e];
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
  }
  // 4. G rows (threads 0..L-1) and H rows (threads L..2L-1): walk back through the run of each
  //    of the token's entries. Writes sort before reads within a slot, in token order. An
  //    entry's first term is added to +0 (as to a zeroed row), later ones to the sum so far.
  for (int task = threadIdx.x; task < 2 * L; task += blockDim.x) {
    const bool isH = task >= L;
    const int t = isH ? task - L : task;
    A* row = isH ? Hs + t * (t + 1) / 2 : Gs + t * (t - 1) / 2;
    unsigned long long seen = 0;   // the row's entries written so far
    if (HASH || hash2) {   // the same walks along the previous-write links of step 3h/3b
      const auto walk = [&](int w) {
        const int q = (isH ? N : 0) + t * W + w;
        const A wq = wq_s[q];
        for (int q2 = isH && SPARSE == 1 ? pos[q] : (pos[q] >> 16) - 1; q2 >= 0;
             q2 = (pos[q2] >> 16) - 1) {
          const int tau = q2 / W;
          if (isH ? tau > t : tau >= t) continue;
          const unsigned long long bit = 1ull << tau;
          row[tau] = ((seen & bit) ? row[tau] : A(0)) + wq * wq_s[q2];
          seen |= bit;
        }
      };
      if (W <= LIVE_MAX_W) {   // only the entries that step 3 marked: a walk to take
        for (unsigned m = rm32[2 * (2 * C + t) + isH]; m; m &= m - 1) walk(__ffs(m) - 1);
      } else {
        for (int w = 0; w < W; ++w) walk(w);
      }
    } else {   // the sort's runs
      for (int w = 0; w < W; ++w) {
        const int q = (isH ? N : 0) + t * W + w;
        if (SPARSE == 1 && isH) {   // walk the read's run of writes back (same order as below)
          const int code = pos[q], start = code & 0xFFFF;
          const A wq = wq_s[q];
          for (int p2 = start + (code >> 16) - 1; p2 >= start; --p2) {
            const int q2 = (int)(keys[p2] & QMASK);
            const int tau = q2 / W;
            if (tau > t) continue;
            const unsigned long long bit = 1ull << tau;
            row[tau] = ((seen & bit) ? row[tau] : A(0)) + wq * wq_s[q2];
            seen |= bit;
          }
          continue;
        }
        const int ps = pos[q];
        const K slot = keys[ps] >> QBITS;
        if (slot == KEY_BAD) continue;
        const A wq = wq_s[q];
        for (int p2 = ps - 1; p2 >= 0 && (keys[p2] >> QBITS) == slot; --p2) {
          const int q2 = (int)(keys[p2] & QMASK);
          if (q2 >= N) continue;                       // a read entry (only before reads)
          const int tau = q2 / W;
          if (isH ? tau > t : tau >= t) continue;
          const unsigned long long bit = 1ull << tau;
          row[tau] = ((seen & bit) ? row[tau] : A(0)) + wq * wq_s[q2];
          seen |= bit;
        }
      }
    }
    unsigned long long nz = 0;   // sums that cancel to exactly 0 have no CSR entry
    for (unsigned long long m = seen; m; m &= m - 1) {
      const int k = __ffsll((long long)m) - 1;
      if (row[k] != A(0)) nz |= 1ull << k;
    }
    if (!isH) {
      rm[3 * C + t] = nz;
    } else if (SPARSE == 1) {
      rm[C + t] = nz;
    } else {   // the backward's H section is by columns: bit t of column k's mask
      for (unsigned long long m = nz; m; m &= m - 1) {
        const int k = __ffsll((long long)m) - 1;
        atomicOr(rm32 + 2 * (C + k) + (t >> 5), 1u << (t & 31));
      }
    }
  }
  __syncthreads();
  // 5. Ainv by forward substitution on the sparse rows of diag(beta) G, one column j per thread
  //    of warps 0 and 1 (rows of G without entries leave their row of Ainv at the identity's:
  //    only the others are visited, in ascending order, so every Ai[tau][j] read below was
  //    written before; the identity's zeros are selected, not stored). Each row's non-zero
  //    entries go to the masks: rows by ballot (section 0), columns per thread (section 2).
  //    The chunk's beta stays in registers, beta[t] in lane t % 32.
  if (threadIdx.x < (L > 32 ? 64 : 32)) {
    const int j = threadIdx.x, lane = j & 31;
    const long long bt0 = ((long long)b * T + t0) * P + p;
    const A bet_lo = lane < L ? beta[bt0 + (long long)lane * P] : A(0);
    const A bet_hi = lane + 32 < L ? beta[bt0 + (long long)(lane + 32) * P] : A(0);
    const unsigned long long gz =   // rows of G with entries
        (unsigned long long)__ballot_sync(0xffffffffu, lane < L && rm[3 * C + lane] != 0ull) |
        (unsigned long long)__ballot_sync(0xffffffffu, lane + 32 < L && rm[3 * C + 32 + lane] != 0ull) << 32;
    if (j < L) Ai[j * (j + 1) / 2 + j] = A(1);
    unsigned long long col = 0;   // rows t > j with Ai[t][j] != 0
    for (unsigned long long rows = gz; rows; rows &= rows - 1) {
      const int t = __ffsll((long long)rows) - 1;
      const bool on = j < t;
      const A* grow = Gs + t * (t - 1) / 2;
      A s = A(0);
      for (unsigned long long m = rm[3 * C + t]; m; m &= m - 1) {
        const int tau = __ffsll((long long)m) - 1;
        if (on && tau >= j)
          s += grow[tau] * (tau == j || (gz >> tau & 1ull) ? Ai[tau * (tau + 1) / 2 + j] : A(0));
      }
      const A v = -__shfl_sync(0xffffffffu, t < 32 ? bet_lo : bet_hi, t & 31) * s;
      if (on) Ai[t * (t + 1) / 2 + j] = v;
      const bool nz = on && v != A(0);
      const unsigned word = __ballot_sync(0xffffffffu, nz);
      if (lane == 0) rm32[2 * t + (j >> 5)] = word;
      if (nz) col |= 1ull << t;
    }
    if (SPARSE == 2 && j < L) rm[2 * C + j] = col;
  }
  __syncthreads();
  const long long mo = (long long)blk * (SPARSE == 1 ? 1 : 2) * C * C;
  // 6. CSR rows, section by section (the header lists them), from the masks: warp 0 scans the
  //    rows' counts into their end offsets, then one thread per half row writes its entries
  //    (columns ascending).
  const int R = NSEC * C, lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {   // inclusive scan of the counts: a run of rows per lane
    const int per = (R + 31) / 32, r0 = min(R, lane * per), r1 = min(R, r0 + per);
    int sum = 0;
    for (int r = r0; r < r1; ++r) sum += __popcll(rm[r]);
    int incl = sum;
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += x;
    }
    int run = incl - sum;
    for (int r = r0; r < r1; ++r) { run += __popcll(rm[r]); rend[r] = run; }
  }
  __syncthreads();
  for (int r = threadIdx.x; r <= R; r += blockDim.x)
    sp_ptr[(long long)blk * (R + 1) + r] = r ? rend[r - 1] : 0;
  for (int i = threadIdx.x; i < 2 * R; i += blockDim.x) {
    const int r = i >> 1, h = i & 1;
    const unsigned long long m64 = rm[r];
    unsigned m = h ? (unsigned)(m64 >> 32) : (unsigned)m64;
    if (!m) continue;
    const int sec = (r >= C) + (NSEC > 2 && r >= 2 * C) + (NSEC > 2 && r >= 3 * C), row = r - sec * C;
    // sections: 0 Ainv rows; SPARSE 1: 1 H rows; SPARSE 2: 1 H columns, 2 Ainv columns, 3 G rows
    // (row, k) of the section's matrix: M[row][k], or M[k][row] for the column sections;
    // packed row x of G starts at x(x-1)/2, of H and Ai at x(x+1)/2
    const bool tr = SPARSE == 2 && (sec == 1 || sec == 2);
    const A* M = sec == 0 || sec == 2 ? Ai : sec == 1 ? Hs : Gs;
    const int strict = sec == 3 ? 1 : 0;   // only G's rows leave out the diagonal
    const int at = (r ? rend[r - 1] : 0) + (h ? __popc((unsigned)m64) : 0);
    unsigned char* cp = sp_col + (long long)blk * CS + at;
    A* vp = sp_val + mo + at;
    if (tr) {
      for (; m; m &= m - 1) {
        const int k = 32 * h + __ffs(m) - 1;
        *cp++ = (unsigned char)k;
        *vp++ = M[k * (k + 1) / 2 + row];
      }
    } else {
      const A* Mr = M + row * (row + 1 - 2 * strict) / 2;
      for (; m; m &= m - 1) {
        const int k = 32 * h + __ffs(m) - 1;
        *cp++ = (unsigned char)k;
        *vp++ = Mr[k];
      }
    }
  }
}

// Blocks of 512 threads per SM that the registers must allow (<= 32 per thread for 4, <= 40
// for 3): as many as the shared memory allows at the headline (the forward's form 51 KB, the
// backward's 67 KB), and no more than the SM's threads allow (2048 on sm_80, sm_90 and sm_100,
// 1536 on sm_86, sm_87, sm_89 and sm_12x, 1024 on sm_75). Left free, the compiler takes 56
// registers: two blocks per SM. -DSDM_PREPASS_MINB=n (benchmarks) sets both forms.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
#define SDM_PREPASS_SM_THREADS 1024
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || \
                                 __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
#define SDM_PREPASS_SM_THREADS 1536
#else
#define SDM_PREPASS_SM_THREADS 2048
#endif

__host__ __device__ constexpr int prepass_blocks(int sparse) {
#ifdef SDM_PREPASS_MINB
  return SDM_PREPASS_MINB;
#else
  return (sparse == 1 ? 4 : 3) < SDM_PREPASS_SM_THREADS / 512 ? (sparse == 1 ? 4 : 3)
                                                              : SDM_PREPASS_SM_THREADS / 512;
#endif
}

// K64: the instance for 64-bit sort keys (S > KEY32_MAX_S); the launcher picks it by S. One
// body per instance: both bodies in each instance, chosen by S at run time, took registers and
// spilled (NVRTC sm_90, float32: the forward's form 5,112 instructions with 16/28 bytes of
// spill stores/loads, the backward's 6,304 with 4/16; one body: 2,176 and 3,680, no spills).
// The 32-bit instance stops the grid (__trap) if it is ever given a larger S: its keys would
// wrap. -DSDM_PREPASS_BOTH_BODIES compiles the earlier form back (benchmarks), and
// -DSDM_PREPASS_KEY64 gives every instance 64-bit keys.
template <typename A, typename I, int SPARSE, int K64 = 0>
__global__ void __launch_bounds__(512, prepass_blocks(SPARSE))
sdm_prepass_kernel(const I* __restrict__ wi, const A* __restrict__ aw, const I* __restrict__ ri,
                   const A* __restrict__ cw, const A* __restrict__ beta,
                   int T, int P, int W, long long S, int C, int n0, int nseg,
                   A* __restrict__ sp_val, int* __restrict__ srt_g, int* __restrict__ sp_ptr,
                   unsigned char* __restrict__ sp_col, int CS, int* err) {
#if defined(SDM_PREPASS_KEY64)
  constexpr bool k64 = true;
#else
  constexpr bool k64 = K64 != 0;
#endif
  auto body = [&](auto key) {   // the body for key type decltype(key)
    prepass_body<A, I, SPARSE, decltype(key)>(wi, aw, ri, cw, beta, T, P, W, S, C, n0, nseg,
                                              sp_val, srt_g, sp_ptr, sp_col, CS, err);
  };
#ifdef SDM_PREPASS_BOTH_BODIES
  if (!k64 && S <= KEY32_MAX_S) body(0u);
  else body(0ull);
#else
  if constexpr (k64) {
    body(0ull);
  } else {
    if (S > KEY32_MAX_S) __trap();
    body(0u);
  }
#endif
}

}  // namespace sdm
