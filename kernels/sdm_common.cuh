// Shared device helpers of the SDM kernels: dtype conversions, row pieces (16-byte loads and
// stores of N consecutive columns), snapshot quantization, and the per-chunk lists that the
// main kernels build from the pre-pass matrices. Inlined into every source by kernels/_build.py
// (so that CuPy's compile cache, keyed on the source text, sees changes here).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace sdm {

// ---- conversions: storage dtype <-> accumulation dtype (float or double) -----------------
// Exact float32 -> float64 and round-to-nearest-even float64 -> float32 with subnormals kept
// (CuPy compiles with -ftz=true, under which the plain conversions flush them: a bfloat16
// snapshot of 1e-40 would rewind a float64 bank to 0).
__device__ __forceinline__ double widen(float x) {
  const unsigned b = __float_as_uint(x);
  if (b & 0x7f800000u) return (double)x;                       // normal, inf, NaN
  const double m = (double)(b & 0x7fffffu) * 0x1p-149;          // zero or subnormal
  return (b >> 31) ? -m : m;
}
__device__ __forceinline__ double widen(double x) { return x; }
__device__ __forceinline__ float narrow(double d) {
  if (!(fabs(d) < 0x1p-126)) return (float)d;                   // normal, inf, NaN
  const unsigned k = (unsigned)rint(fabs(d) * 0x1p149);         // subnormal units, <= 2^23
  return __uint_as_float((signbit(d) ? 0x80000000u : 0u) | k);
}
__device__ __forceinline__ float to_acc(float x, float) { return x; }
__device__ __forceinline__ double to_acc(float x, double) { return widen(x); }
__device__ __forceinline__ float to_acc(double x, float) { return narrow(x); }
__device__ __forceinline__ double to_acc(double x, double) { return x; }
__device__ __forceinline__ float to_acc(__half x, float) { return __half2float(x); }
__device__ __forceinline__ double to_acc(__half x, double) { return (double)__half2float(x); }  // normal in float
__device__ __forceinline__ float to_acc(__nv_bfloat16 x, float) { return __bfloat162float(x); }
__device__ __forceinline__ double to_acc(__nv_bfloat16 x, double) { return widen(__bfloat162float(x)); }

template <typename T> struct From;
template <> struct From<float> {
  __device__ static float cvt(float x) { return x; }
  __device__ static float cvt(double x) { return narrow(x); }
};
template <> struct From<double> {
  __device__ static double cvt(float x) { return widen(x); }
  __device__ static double cvt(double x) { return x; }
};
template <> struct From<__half> {
  __device__ static __half cvt(float x) { return __float2half_rn(x); }
  __device__ static __half cvt(double x) { return __double2half(x); }
};
template <> struct From<__nv_bfloat16> {
  __device__ static __nv_bfloat16 cvt(float x) { return __float2bfloat16_rn(x); }
  __device__ static __nv_bfloat16 cvt(double x) { return __double2bfloat16(x); }
};

template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

// Loads `nv` (<= N) consecutive elements starting at p into acc registers (zeros past nv).
// `vec` says the caller checked that p is aligned to the whole pack (host-side check of the
// base pointer plus hd % N == 0); the wide path is then one (or a few) 16-byte loads.
template <int N, typename A, typename T>
__device__ __forceinline__ void load_piece(A (&out)[N], const T* __restrict__ p, int nv, bool vec) {
  if (vec && nv == N) {
    Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_acc(pk.v[i], A());
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = i < nv ? to_acc(p[i], A()) : A(0);
  }
}

template <int N, typename A, typename T>
__device__ __forceinline__ void store_piece(T* __restrict__ p, const A (&in)[N], int nv, bool vec) {
  if (vec && nv == N) {
    Pack<T, N> pk;
#pragma unroll
    for (int i = 0; i < N; ++i) pk.v[i] = From<T>::cvt(in[i]);
    *reinterpret_cast<Pack<T, N>*>(p) = pk;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < nv) p[i] = From<T>::cvt(in[i]);
  }
}

// Raw copy of a piece without conversion (exact snapshots: bank dtype -> bank dtype).
template <int N, typename T>
__device__ __forceinline__ void load_raw(T (&out)[N], const T* __restrict__ p, int nv, bool vec) {
  if (vec && nv == N) {
    Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = pk.v[i];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = i < nv ? p[i] : T{};
  }
}
template <int N, typename T>
__device__ __forceinline__ void store_raw(T* __restrict__ p, const T (&in)[N], int nv, bool vec) {
  if (vec && nv == N) {
    Pack<T, N> pk;
#pragma unroll
    for (int i = 0; i < N; ++i) pk.v[i] = in[i];
    *reinterpret_cast<Pack<T, N>*>(p) = pk;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < nv) p[i] = in[i];
  }
}

// ---- snapshot quantization (SPEC §5) ------------------------------------------------------
// Q = 0: exact (bank dtype); 1: bfloat16; 2: fp8 e4m3 + float32 absmax scale per row;
// 3: int8 + float32 absmax scale per row.
template <typename T, int Q> struct Snap { typedef T type; };
template <typename T> struct Snap<T, 1> { typedef __nv_bfloat16 type; };
template <typename T> struct Snap<T, 2> { typedef unsigned char type; };
template <typename T> struct Snap<T, 3> { typedef signed char type; };

template <int Q> struct QMax { static constexpr float v = 1.0f; };
template <> struct QMax<2> { static constexpr float v = 448.0f; };
template <> struct QMax<3> { static constexpr float v = 127.0f; };

// ---- arithmetic that keeps subnormals ------------------------------------------------------
// CuPy compiles with -ftz=true (cupy/cuda/compiler.py appends it after the caller's options),
// which would flush float32 subnormals: bfloat16 entries below 2^-126 (and float32 values
// that round to them) would read as 0. The forward's value path uses these helpers instead:
// __fmaf_ieee_rn ignores -ftz (fma.rn.f32); a*b as fma(a, b, -0) and a-b as fma(b, -1, a)
// round exactly like the plain operations, signed zeros included.
__device__ __forceinline__ float fma_(float a, float b, float c) { return __fmaf_ieee_rn(a, b, c); }
__device__ __forceinline__ double fma_(double a, double b, double c) { return fma(a, b, c); }
__device__ __forceinline__ float mul_(float a, float b) { return __fmaf_ieee_rn(a, b, -0.0f); }
__device__ __forceinline__ double mul_(double a, double b) { return a * b; }
__device__ __forceinline__ float sub_(float a, float b) { return __fmaf_ieee_rn(b, -1.0f, a); }
__device__ __forceinline__ double sub_(double a, double b) { return a - b; }
__device__ __forceinline__ float add_(float a, float b) { return __fmaf_ieee_rn(a, 1.0f, b); }
__device__ __forceinline__ double add_(double a, double b) { return a + b; }

// |x| as float32 bits (ordered like the magnitudes; above 0x7f800000 means NaN).
__device__ __forceinline__ unsigned abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }
__device__ __forceinline__ unsigned abs_bits(double x) { return abs_bits(narrow(x)); }

// The row's absmax a is a float32 (NaN ignored), its scale the float32 nearest a / qmax, and
// a code the fp8 (RNE, saturating) of the float32 nearest x * (qmax / a), or the int8 nearest
// x * (qmax / a) (clamped to +-127), with x * (qmax / a) in float64; a row with a = 0 or
// a = inf stores zero codes. Working in float64 through the helpers above, rows of tiny
// values (subnormals included) quantize like any other despite -ftz: in float32, qmax / a
// overflows below a = 1.3e-36 and a subnormal scale flushes. kernels/cpu_formats.py computes
// the same numbers.
__device__ __forceinline__ unsigned char quant1(double y, unsigned char) {
  return (unsigned char)__nv_cvt_float_to_fp8((float)y, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ signed char quant1(double y, signed char) {
  const double q = fmin(127.0, fmax(-127.0, rint(y)));
  return (signed char)(int)q;
}
__device__ __forceinline__ float dequant1(unsigned char q, float scale) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q, __NV_E4M3);
  return mul_(__half2float(__half(h)), scale);
}
__device__ __forceinline__ float dequant1(signed char q, float scale) { return mul_((float)q, scale); }

// ---- small helpers ------------------------------------------------------------------------
template <typename I>
__device__ __forceinline__ bool valid_id(I id, long long S) {
  return (long long)id >= 0 && (long long)id < S;
}

// valid_id by one unsigned compare, its bound computed once: an int id is valid below
// min(S, 2^31) (a negative one reads as 2^31 or more), a long long id below S.
template <typename I> struct IdCheck;
template <> struct IdCheck<int> {
  unsigned lim;
  __device__ explicit IdCheck(long long S) : lim((unsigned)max(0ll, min(S, 0x80000000ll))) {}
  __device__ __forceinline__ bool operator()(int id) const { return (unsigned)id < lim; }
};
template <> struct IdCheck<long long> {
  unsigned long long lim;
  __device__ explicit IdCheck(long long S) : lim((unsigned long long)max(0ll, S)) {}
  __device__ __forceinline__ bool operator()(long long id) const {
    return (unsigned long long)id < lim;
  }
};

// Records a rule violation in the host-mapped error word (a plain store: idempotent, needs no
// system-scope atomics, and costs nothing unless an id is bad).
__device__ __forceinline__ void flag_error(volatile int* err, int code) {
#ifdef SDM_EMULATE   // tests/emu: the same store, marked as the intended race it is
  if (err) __atomic_store_n(const_cast<int*>(err), code, __ATOMIC_RELAXED);
#else
  if (err) *err = code;
#endif
}

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }

// ---- asynchronous global -> shared copies (sm_80+; a plain copy before) -------------------
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(src), "n"(BYTES));
#elif defined(SDM_EMULATE)   // tests/emu: the copy lands at the wait that covers it
  sdm_emu::cp_issue(dst, src, BYTES);
#else
  if constexpr (BYTES == 16) *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(src);
  else if constexpr (BYTES == 8) *reinterpret_cast<long long*>(dst) = *reinterpret_cast<const long long*>(src);
  else *reinterpret_cast<int*>(dst) = *reinterpret_cast<const int*>(src);
#endif
}
__device__ __forceinline__ void cp_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#elif defined(SDM_EMULATE)
  sdm_emu::cp_commit();
#endif
}
template <int K>
__device__ __forceinline__ void cp_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(K));
#elif defined(SDM_EMULATE)
  sdm_emu::cp_wait(K);
#endif
}
// ---- gathers of row pieces ----------------------------------------------------------------
// A block owns a column tile, so it reads only a 16- to 64-byte piece of each 256-byte (bf16,
// hd = 128) row it gathers; the blocks of the other tiles read the rest of the same rows at about
// the same time. Without a hint each piece is its own 32-byte DRAM access, which random rows
// make several times slower than whole rows (benchmarks/gather_ceiling.py). The L2 prefetch-size
// qualifier makes the first miss bring SDM_L2_PREFETCH bytes around the piece into L2, where the
// other tiles' loads then hit. 0 compiles the plain loads (for comparison).
#ifndef SDM_L2_PREFETCH
#define SDM_L2_PREFETCH 256
#endif
#if SDM_L2_PREFETCH == 256
#define SDM_L2PF ".L2::256B"
#elif SDM_L2_PREFETCH == 128
#define SDM_L2PF ".L2::128B"
#elif SDM_L2_PREFETCH == 64
#define SDM_L2PF ".L2::64B"
#elif SDM_L2_PREFETCH == 0
#define SDM_L2PF ""
#else
#error "SDM_L2_PREFETCH must be 0, 64, 128 or 256"
#endif

// 16 bytes of a global row, cached in L1 and L2 (the bank: the block itself may have written
// it, so never the read-only path) or in L2 only (`cg`), with the prefetch-size hint
template <bool CG = false>
__device__ __forceinline__ int4 ld_row16(const void* p) {
#if __CUDA_ARCH__ >= 800
  int4 r;
  if constexpr (CG)
    asm volatile("ld.global.cg" SDM_L2PF ".v4.s32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  else
    asm volatile("ld.global" SDM_L2PF ".v4.s32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
#else
  return CG ? __ldcg(reinterpret_cast<const int4*>(p)) : *reinterpret_cast<const int4*>(p);
#endif
}

// A whole piece of N elements (16 bytes, aligned) of a gathered global row, raw.
template <int N, typename T>
__device__ __forceinline__ void load_row(T (&out)[N], const T* __restrict__ p) {
  static_assert(sizeof(T) * N == 16, "a row piece is 16 bytes");
  union { int4 q; T v[N]; } u;
  u.q = ld_row16(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = u.v[i];
}

// A 16-byte piece of N elements of type T, given as its words, in the accumulation type. A
// bfloat16 is the upper half of its float32: two shifts or masks per word instead of the
// unpacking and conversion of each element (the same bits).
template <typename T> struct IsBf16 { static constexpr bool v = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool v = true; };
template <int N, typename T, typename A>
__device__ __forceinline__ void piece_acc(A (&out)[N], int4 q) {
  static_assert(sizeof(T) * N == 16, "a row piece is 16 bytes");
  if constexpr (IsBf16<T>::v && sizeof(A) == 4) {
    const unsigned w[4] = {(unsigned)q.x, (unsigned)q.y, (unsigned)q.z, (unsigned)q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = __uint_as_float(w[k] << 16);
      out[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  } else {
    union { int4 q; T v[N]; } u;
    u.q = q;
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_acc(u.v[i], A());
  }
}

// cp.async of 16 bytes of a gathered global row into shared memory (L2 only), with the hint
__device__ __forceinline__ void cp_async_row(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global" SDM_L2PF " [%0], [%1], 16;\n" ::"r"(s), "l"(src));
#elif defined(SDM_EMULATE)
  sdm_emu::cp_issue(dst, src, 16);
#else
  *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(src);
#endif
}

// ---- thread-block clusters (sm_90): distributed shared memory -----------------------------
#if __CUDA_ARCH__ >= 900
// this block's shared address `p` as seen in the shared memory of cluster block `rank`
__device__ __forceinline__ unsigned dsmem_addr(const void* p, unsigned rank) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(s), "r"(rank));
  return r;
}
__device__ __forceinline__ int4 ld_dsmem16(unsigned a) {
  int4 v;
  asm volatile("ld.shared::cluster.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// a piece of N elements (a multiple of 16 bytes) from cluster shared address `a`
template <int N, typename E>
__device__ __forceinline__ void ld_dsmem_piece(E (&out)[N], unsigned a) {
  constexpr int NB = N * (int)sizeof(E);
  static_assert(NB % 16 == 0, "whole 16-byte pieces");
  union { int4 q[NB / 16]; E v[N]; } u;
#pragma unroll
  for (int j = 0; j < NB / 16; ++j) u.q[j] = ld_dsmem16(a + 16 * j);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = u.v[i];
}
// every thread of every block of the cluster: writes before it are visible to reads after it
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
#endif

// one element of 4 or 8 bytes (2-byte elements are copied synchronously)
template <typename E>
__device__ __forceinline__ void cp_elem(E* dst, const E* src) {
  if constexpr (sizeof(E) == 4 || sizeof(E) == 8) cp_async<sizeof(E)>(dst, src);
  else *dst = *src;
}

__host__ __device__ constexpr long long r16(long long x) { return (x + 15) & ~15ll; }

// log2(d) when d >= 1 is a power of two, else -1: lets a loop that splits an index by d use a
// shift instead of a division (about 25 instructions) in the common case
__device__ __forceinline__ int log2_if_pow2(int d) { return (d & (d - 1)) == 0 ? __ffs(d) - 1 : -1; }

// Copies `rows` rows of `n` elements into shared memory with cp.async, spread over the block:
// row r comes from src + r * gs (elements) and lands packed at dst + r * n. When every row
// start on both sides is 16-byte aligned and a row is whole 16-byte pieces, each thread keeps
// one piece of the row and steps over rows (no divisions in the loop); one row copies its
// 16-byte pieces and then any tail element by element; otherwise element by element.
template <typename E>
__device__ __forceinline__ void cp_rows(E* dst, const E* src, int rows, int n, long long gs) {
  if (rows <= 0 || n <= 0) return;
  const int nb = n * (int)sizeof(E), k16 = nb >> 4;
  const bool al = ((reinterpret_cast<unsigned long long>(dst) |
                    reinterpret_cast<unsigned long long>(src)) & 15) == 0;
  unsigned char* d = reinterpret_cast<unsigned char*>(dst);
  const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
  if (rows == 1 && al) {
    for (int k = threadIdx.x; k < k16; k += blockDim.x) cp_async<16>(d + 16 * k, s + 16 * k);
    for (int i = 16 * k16 / (int)sizeof(E) + threadIdx.x; i < n; i += blockDim.x)
      cp_elem(dst + i, src + i);
    return;
  }
  if (al && k16 > 0 && (nb & 15) == 0 && ((gs * (long long)sizeof(E)) & 15) == 0 &&
      (int)blockDim.x % k16 == 0) {
    const int j = threadIdx.x % k16, rstep = blockDim.x / k16;
    const long long gb = gs * (long long)sizeof(E);
    for (int r = threadIdx.x / k16; r < rows; r += rstep)
      cp_async<16>(d + (long long)r * nb + 16 * j, s + r * gb + 16 * j);
    return;
  }
  int r = threadIdx.x / n, c = threadIdx.x % n;   // element i = r * n + c, stepped
  const int dr = blockDim.x / n, dc = blockDim.x % n;
  for (int i = threadIdx.x; i < rows * n; i += blockDim.x) {
    cp_elem(dst + i, src + r * gs + c);
    r += dr;
    c += dc;
    if (c >= n) { c -= n; ++r; }
  }
}

// cp_rows, except that when a row's piece count k16 is a power of two (W = 16 float32 weights
// or int32 ids: k16 = 4) a thread finds its first row and piece with a shift and a mask instead
// of two divisions (about 25 instructions each, per warp and call; stop 14's profile). The
// forward's staging uses it (-2% forward time on the H200, bitwise the same copies); in the
// backward the same change cost 0.6%, so the backward keeps cp_rows. A whole copy rather than a
// shared helper: either sharing form tried changed the kernels' machine code (and the
// forward's spills) away from the builds that were measured and tested.
template <typename E>
__device__ __forceinline__ void cp_rows_pow2(E* dst, const E* src, int rows, int n, long long gs) {
  if (rows <= 0 || n <= 0) return;
  const int nb = n * (int)sizeof(E), k16 = nb >> 4;
  const bool al = ((reinterpret_cast<unsigned long long>(dst) |
                    reinterpret_cast<unsigned long long>(src)) & 15) == 0;
  unsigned char* d = reinterpret_cast<unsigned char*>(dst);
  const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
  if (rows == 1 && al) {
    for (int k = threadIdx.x; k < k16; k += blockDim.x) cp_async<16>(d + 16 * k, s + 16 * k);
    for (int i = 16 * k16 / (int)sizeof(E) + threadIdx.x; i < n; i += blockDim.x)
      cp_elem(dst + i, src + i);
    return;
  }
  if (al && k16 > 0 && (nb & 15) == 0 && ((gs * (long long)sizeof(E)) & 15) == 0) {
    int j = -1, r0 = 0, rstep = 0;
    if (const int sh = log2_if_pow2(k16); sh >= 0) {
      if ((blockDim.x & (k16 - 1)) == 0) {
        j = threadIdx.x & (k16 - 1);
        r0 = threadIdx.x >> sh;
        rstep = blockDim.x >> sh;
      }
    } else if ((int)blockDim.x % k16 == 0) {
      j = threadIdx.x % k16;
      r0 = threadIdx.x / k16;
      rstep = blockDim.x / k16;
    }
    if (j >= 0) {
      const long long gb = gs * (long long)sizeof(E);
      for (int r = r0; r < rows; r += rstep)
        cp_async<16>(d + (long long)r * nb + 16 * j, s + r * gb + 16 * j);
      return;
    }
  }
  int r = threadIdx.x / n, c = threadIdx.x % n;   // element i = r * n + c, stepped
  const int dr = blockDim.x / n, dc = blockDim.x % n;
  for (int i = threadIdx.x; i < rows * n; i += blockDim.x) {
    cp_elem(dst + i, src + r * gs + c);
    r += dr;
    c += dc;
    if (c >= n) { c -= n; ++r; }
  }
}

// cp_rows_pow2 for four arrays of rows of one shape and one element size (the forward's ids
// and weights of a chunk): one alignment test and one row plan for the four instead of one
// each (stop 34's profile: the forward's chunk start runs about 400 instructions per warp and
// chunk, most of them these tests). The same bytes land in the same places; where the joint
// row form does not apply, each array takes cp_rows_pow2.
template <typename E0, typename E1, typename E2, typename E3>
__device__ __forceinline__ void cp_rows4_pow2(E0* d0, const E0* s0, E1* d1, const E1* s1, E2* d2,
                                              const E2* s2, E3* d3, const E3* s3, int rows, int n,
                                              long long gs) {
  constexpr int ES = (int)sizeof(E0);
  static_assert(sizeof(E1) == ES && sizeof(E2) == ES && sizeof(E3) == ES, "one element size");
  if (rows <= 0 || n <= 0) return;
  const int nb = n * ES, k16 = nb >> 4, sh = log2_if_pow2(k16);
  const unsigned long long any =
      reinterpret_cast<unsigned long long>(d0) | reinterpret_cast<unsigned long long>(s0) |
      reinterpret_cast<unsigned long long>(d1) | reinterpret_cast<unsigned long long>(s1) |
      reinterpret_cast<unsigned long long>(d2) | reinterpret_cast<unsigned long long>(s2) |
      reinterpret_cast<unsigned long long>(d3) | reinterpret_cast<unsigned long long>(s3);
  const long long gb = gs * ES;
  if ((any & 15) == 0 && k16 > 0 && (nb & 15) == 0 && (gb & 15) == 0 && sh >= 0 &&
      (blockDim.x & (k16 - 1)) == 0) {
    const int j = threadIdx.x & (k16 - 1), rstep = blockDim.x >> sh;
    for (int r = threadIdx.x >> sh; r < rows; r += rstep) {
      const int dof = r * nb + 16 * j;
      const long long sof = r * gb + 16 * j;
      cp_async<16>(reinterpret_cast<unsigned char*>(d0) + dof,
                   reinterpret_cast<const unsigned char*>(s0) + sof);
      cp_async<16>(reinterpret_cast<unsigned char*>(d1) + dof,
                   reinterpret_cast<const unsigned char*>(s1) + sof);
      cp_async<16>(reinterpret_cast<unsigned char*>(d2) + dof,
                   reinterpret_cast<const unsigned char*>(s2) + sof);
      cp_async<16>(reinterpret_cast<unsigned char*>(d3) + dof,
                   reinterpret_cast<const unsigned char*>(s3) + sof);
    }
    return;
  }
  cp_rows_pow2(d0, s0, rows, n, gs);
  cp_rows_pow2(d1, s1, rows, n, gs);
  cp_rows_pow2(d2, s2, rows, n, gs);
  cp_rows_pow2(d3, s3, rows, n, gs);
}

// n / d by a multiply: exact for 0 <= n < 2^16 and 1 <= d < 2^15 (the error n * (m - 2^32 / d)
// / 2^32 < 2^-16 never carries past the next multiple of d); larger n divide plainly. The
// multiplier m = ceil(2^32 / d) (0 for d = 1) comes from the launcher (gpu._magic) as a kernel
// parameter: the constant bank holds it, where a register of its own would be spilled.
struct FastDiv {
  unsigned m;
  int d;
  __device__ FastDiv(int d_, unsigned m_) : m(m_), d(d_) {}
  __device__ __forceinline__ int div(int n) const {
    if (d == 1) return n;
    return n < 65536 && d < 32768 ? (int)__umulhi((unsigned)n, m) : n / d;
  }
};

// Benchmarks only (-DSDM_BWD_STAGGER=ns, -DSDM_FWD_STAGGER=ns): the blocks of odd (b, p) sleep
// about that long (the hardware takes it as a hint, up to 1 ms) before their first chunk, so
// that the blocks' phases (gathers, products) fall at different times across the SMs. With
// -DSDM_STAGGER_PHASES=k the blocks of (b, p) sleep (b, p) mod k times that instead
#if !defined(SDM_EMULATE)
#ifndef SDM_STAGGER_PHASES
#define SDM_STAGGER(bp, ns) do { if ((bp) & 1) __nanosleep(ns); } while (0)
#else
#define SDM_STAGGER(bp, ns) \
  do { if ((bp) % SDM_STAGGER_PHASES) __nanosleep((ns) * ((bp) % SDM_STAGGER_PHASES)); } while (0)
#endif
#else
#define SDM_STAGGER(bp, ns) do { } while (0)
#endif

}  // namespace sdm
