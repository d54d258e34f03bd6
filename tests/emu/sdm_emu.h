// A CPU emulator for the SDM kernels (tests/emu.py builds and drives it; no GPU involved).
//
// Each CUDA thread of a block runs as a fiber (ucontext) on one OS thread. A fiber runs until
// it reaches a block barrier, a warp operation (shuffle, ballot) or its end, then yields;
// the scheduler resumes the fibers in a fresh random order every round, so code that leans on
// one interleaving between barriers shows up as a result that changes with the seed. Blocks
// run one after another, also in a random order. What is checked on the way (each a launch
// error with its message, never a hang):
//   - __syncthreads reached by only part of the block, or after some threads returned;
//   - a warp operation without all 32 lanes, lanes at different operations, a partial mask;
//   - each cp.async copy lands either at once or only at the cp.async.wait_group that covers
//     it (a coin toss per copy): a read before the wait may see the old bytes, and a write
//     issued before the other threads are done with the old bytes may overwrite them; copies
//     never waited for are dropped;
//   - __trap.
// Built with -fsanitize=thread (tests/emu.py, SDM_EMU_TSAN=1), unordered accesses of two
// threads of a block are reported by ThreadSanitizer (see below).
// Out-of-bounds accesses to global or shared memory are AddressSanitizer's job: shared memory
// is a fresh heap allocation of exactly the launch's size per block, filled with a poison byte.
#pragma once
#include <ucontext.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#if defined(__SANITIZE_ADDRESS__)
#define SDM_EMU_ASAN 1
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom,
                                               size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                                size_t* size_old);
#else
#define SDM_EMU_ASAN 0
#endif

// ThreadSanitizer: every CUDA thread is a TSan fiber, switched without synchronisation, and
// the barriers order memory (each thread releases on arrival, acquires on leaving), so a data
// race between two threads of a block that no barrier orders, in shared or in global memory,
// is reported. Warp shuffles and ballots exchange values but order no memory here.
#if defined(__SANITIZE_THREAD__)
#define SDM_EMU_TSAN 1
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#define SDM_EMU_INTERNAL __attribute__((no_sanitize_thread))
#else
#define SDM_EMU_TSAN 0
#define SDM_EMU_INTERNAL
#endif
// SDM_EMU_INTERNAL: the emulator's own bookkeeping (barrier counts, warp buffers, the current
// fiber), which its fibers share by design; the scheduler's writes reach a fiber through
// sched_sync, and nothing else the fibers do is ordered by a switch.

#ifndef SDM_EMULATE
#define SDM_EMULATE 1
#endif

namespace sdm_emu {

struct Dim3 {
  unsigned x, y, z;
};

struct Copy {
  void* dst;
  const void* src;
  int bytes;
};

struct Fiber {
  ucontext_t ctx;
  Dim3 tid;
  bool done = false;
  char* stack = nullptr;
  std::vector<Copy> copies;   // cp.async issued, not yet landed
  std::vector<size_t> groups; // end of each committed group in `copies`
  void* tsan = nullptr;
};

struct Warp {
  unsigned gen = 0;
  int arrived = 0;
  int op = 0;
  int done = 0;
  uint64_t buf[2][32];
};

// a fiber's stack (ThreadSanitizer builds overflowed 256 KiB; AddressSanitizer clears the
// shadow of the whole stack at every switch, so its stacks stay small)
constexpr size_t STACK = (SDM_EMU_TSAN ? 2048 : 256) * 1024;
constexpr size_t GUARD = 4096;

struct State {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Fiber* cur = nullptr;
  ucontext_t sched;
  Dim3 bid{0, 0, 0}, bdim{1, 1, 1}, gdim{1, 1, 1};
  unsigned char* smem = nullptr;
  int alive = 0;
  int bar_arrived = 0;
  unsigned bar_gen = 0;
  unsigned long long progress = 0;
  bool failed = false;
  std::string error;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  char* stacks = nullptr;
  size_t nstacks = 0;
  uint64_t coin = 1;      // where each cp.async lands (xorshift; its own code, not std's,
                          // so that ThreadSanitizer sees no emulator state)
  char bar_sync[2];   // TSan sync objects of the block barrier, by generation parity
  void* tsan_sched = nullptr;
  char sched_sync;    // TSan: the scheduler's writes (current fiber, block setup) -> fibers
  char end_sync;      // TSan: a fiber's whole life -> the scheduler once its block is done
#if SDM_EMU_ASAN
  void* fake_stack = nullptr;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
#endif
};

inline State S;

SDM_EMU_INTERNAL inline void to_sched() {
#if SDM_EMU_TSAN
  __tsan_switch_to_fiber(S.tsan_sched, 1);
#endif
#if SDM_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, S.sched_bottom, S.sched_size);
  swapcontext(&S.cur->ctx, &S.sched);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  swapcontext(&S.cur->ctx, &S.sched);
#endif
#if SDM_EMU_TSAN
  __tsan_acquire(&S.sched_sync);
#endif
}

SDM_EMU_INTERNAL inline void to_fiber(Fiber* f) {
  S.cur = f;
#if SDM_EMU_TSAN
  __tsan_release(&S.sched_sync);
  __tsan_switch_to_fiber(f->tsan, 1);
#endif
#if SDM_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f->stack, STACK);
  swapcontext(&S.sched, &f->ctx);
  __sanitizer_finish_switch_fiber(fake, &S.sched_bottom, &S.sched_size);
#else
  swapcontext(&S.sched, &f->ctx);
#endif
}

// Ends the launch with `msg` (the fiber is never resumed).
[[noreturn]] SDM_EMU_INTERNAL inline void fail(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
#if SDM_EMU_TSAN
  __tsan_release(&S.end_sync);
#endif
  if (!S.failed) {
    char where[128];
    snprintf(where, sizeof where, " (block %u, thread %u)", S.bid.x, S.cur ? S.cur->tid.x : 0u);
    S.error = std::string(buf) + where;
    S.failed = true;
  }
  for (;;) to_sched();
}

SDM_EMU_INTERNAL inline void yield() { to_sched(); }

SDM_EMU_INTERNAL inline void syncthreads() {
  if (S.alive != (int)S.fibers.size())
    fail("__syncthreads after %d of the block's %d threads returned",
         (int)S.fibers.size() - S.alive, (int)S.fibers.size());
  ++S.progress;
  const unsigned g = S.bar_gen;
#if SDM_EMU_TSAN
  __tsan_release(&S.bar_sync[g & 1]);
#endif
  if (++S.bar_arrived == S.alive) {
    S.bar_arrived = 0;
    ++S.bar_gen;
  } else {
    while (S.bar_gen == g) yield();
  }
#if SDM_EMU_TSAN
  __tsan_acquire(&S.bar_sync[g & 1]);
#endif
}

// Every lane of the calling warp contributes `v`; returns the 32 contributions.
SDM_EMU_INTERNAL inline const uint64_t* warp_gather(int op, unsigned mask, uint64_t v) {
  if (mask != 0xffffffffu) fail("warp operation with mask %08x (the emulator wants all lanes)", mask);
  const unsigned t = S.cur->tid.x;
  Warp& w = S.warps[t / 32];
  if (w.done) fail("warp operation after %d lanes of the warp returned", w.done);
  if (w.arrived == 0) w.op = op;
  else if (w.op != op) fail("lanes of one warp at different warp operations (%d, %d)", w.op, op);
  const unsigned g = w.gen;
  uint64_t* b = w.buf[g & 1];
  b[t % 32] = v;
  ++S.progress;
  if (++w.arrived == 32) {
    w.arrived = 0;
    ++w.gen;
  } else {
    while (w.gen == g) yield();
  }
  return b;
}

template <typename T>
inline uint64_t bits_of(T v) {
  static_assert(sizeof(T) <= 8, "a shuffled value fits 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T>
inline T of_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

// ---- cp.async: copies land at the wait that covers their group ------------------------------
SDM_EMU_INTERNAL inline void cp_issue(void* dst, const void* src, int bytes) {
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % bytes)
    fail("cp.async of %d bytes at a misaligned address", bytes);
  S.coin ^= S.coin << 13;
  S.coin ^= S.coin >> 7;
  S.coin ^= S.coin << 17;
  if (S.coin & 1)     // lands now: the earliest a GPU may complete it
    std::memcpy(dst, src, bytes);
  else                 // lands at the wait that covers it: the latest
    S.cur->copies.push_back({dst, src, bytes});
}
SDM_EMU_INTERNAL inline void cp_commit() { S.cur->groups.push_back(S.cur->copies.size()); }
SDM_EMU_INTERNAL inline void cp_wait(int k) {
  Fiber* f = S.cur;
  const int ng = (int)f->groups.size();
  if (ng <= k) return;
  const size_t upto = f->groups[ng - 1 - k];   // groups older than the k most recent land
  for (size_t i = 0; i < upto; ++i) std::memcpy(f->copies[i].dst, f->copies[i].src, f->copies[i].bytes);
  f->copies.erase(f->copies.begin(), f->copies.begin() + upto);
  f->groups.erase(f->groups.begin(), f->groups.begin() + (ng - k));
  for (auto& e : f->groups) e -= upto;
}

SDM_EMU_INTERNAL inline void trampoline() {
#if SDM_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &S.sched_bottom, &S.sched_size);
#endif
#if SDM_EMU_TSAN
  __tsan_acquire(&S.sched_sync);
#endif
  S.body(S.body_arg);
  Fiber* f = S.cur;
  f->done = true;
  f->copies.clear();   // never waited for: undefined on a GPU, dropped here
  f->groups.clear();
  --S.alive;
  ++S.warps[f->tid.x / 32].done;
  ++S.progress;
  if (S.bar_arrived > 0)
    fail("thread returned while %d threads of its block wait at __syncthreads", S.bar_arrived);
  Warp& w = S.warps[f->tid.x / 32];
  if (w.arrived > 0) fail("thread returned while %d lanes of its warp wait in a warp operation", w.arrived);
#if SDM_EMU_TSAN
  __tsan_release(&S.end_sync);
#endif
  for (;;) to_sched();
}

// Runs body(arg) as a grid of `grid` blocks of `block` threads. Returns 0, or 1 with S.error.
inline int run(void (*body)(void*), void* arg, int grid, int block, long long smem,
               unsigned long long seed) {
  S.failed = false;
  S.error.clear();
  if (block <= 0 || block % 32 || block > 1024) {
    S.error = "block size " + std::to_string(block) + " is not a multiple of 32 in [32, 1024]";
    return 1;
  }
  if (grid <= 0) {
    S.error = "grid of " + std::to_string(grid) + " blocks";
    return 1;
  }
  if ((size_t)block > S.nstacks) {
    if (S.stacks) munmap(S.stacks, S.nstacks * (STACK + GUARD));
    S.nstacks = block;
    S.stacks = static_cast<char*>(mmap(nullptr, S.nstacks * (STACK + GUARD), PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (S.stacks == MAP_FAILED) {
      S.stacks = nullptr;
      S.nstacks = 0;
      S.error = "cannot map the fibers' stacks";
      return 1;
    }
    for (size_t i = 0; i < S.nstacks; ++i)   // a guard page below each stack
      mprotect(S.stacks + i * (STACK + GUARD), GUARD, PROT_NONE);
  }
  S.body = body;
  S.body_arg = arg;
#if SDM_EMU_TSAN
  S.tsan_sched = __tsan_get_current_fiber();
#endif
  S.bdim = {(unsigned)block, 1, 1};
  S.gdim = {(unsigned)grid, 1, 1};
  std::mt19937_64 rng(seed);
  S.coin = (seed ^ 0x9e3779b97f4a7c15ull) | 1;
  std::vector<int> blocks(grid), order(block);
  for (int i = 0; i < grid; ++i) blocks[i] = i;
  std::shuffle(blocks.begin(), blocks.end(), rng);
  const unsigned char poison = (unsigned char)(rng() | 1);
  S.fibers.assign(block, Fiber());
  S.warps.assign(block / 32, Warp());
  for (int bi = 0; bi < grid && !S.failed; ++bi) {
    S.bid = {(unsigned)blocks[bi], 0, 0};
    S.smem = static_cast<unsigned char*>(std::malloc(smem > 0 ? smem : 1));
    std::memset(S.smem, poison, smem > 0 ? smem : 1);
    for (auto& w : S.warps) w = Warp();
    S.alive = block;
    S.bar_arrived = 0;
    for (int t = 0; t < block; ++t) {
      Fiber& f = S.fibers[t];
      f.tid = {(unsigned)t, 0, 0};
      f.done = false;
      f.copies.clear();
      f.groups.clear();
      f.stack = S.stacks + t * (STACK + GUARD) + GUARD;
#if SDM_EMU_TSAN
      f.tsan = __tsan_create_fiber(0);
#endif
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack;
      f.ctx.uc_stack.ss_size = STACK;
      f.ctx.uc_link = nullptr;
      makecontext(&f.ctx, trampoline, 0);
      order[t] = t;
    }
    while (S.alive > 0 && !S.failed) {
      const unsigned long long before = S.progress;
      std::shuffle(order.begin(), order.end(), rng);
      for (int t : order) {
        if (S.fibers[t].done) continue;
        to_fiber(&S.fibers[t]);
        if (S.failed) break;
      }
      if (!S.failed && S.alive > 0 && S.progress == before) {
        S.error = "deadlock: " + std::to_string(S.alive) + " threads wait (" +
                  std::to_string(S.bar_arrived) + " at __syncthreads) and none can go on (block " +
                  std::to_string(S.bid.x) + ")";
        S.failed = true;
      }
    }
#if SDM_EMU_TSAN
    __tsan_acquire(&S.end_sync);
#endif
    std::free(S.smem);
    S.smem = nullptr;
#if SDM_EMU_TSAN
    for (auto& f : S.fibers) {
      if (f.tsan) __tsan_destroy_fiber(f.tsan);
      f.tsan = nullptr;
    }
#endif
  }
  S.cur = nullptr;
  return S.failed ? 1 : 0;
}

// Calls kernel k with its arguments read from args[i] (a pointer to each argument's value).
template <typename... P, size_t... I>
inline void call(void (*k)(P...), void** args, std::index_sequence<I...>) {
  k(*static_cast<std::remove_cv_t<P>*>(args[I])...);
}

template <typename... P>
struct Launch {
  void (*k)(P...);
  void** args;
  static void body(void* self) {
    auto* l = static_cast<Launch*>(self);
    call(l->k, l->args, std::index_sequence_for<P...>{});
  }
};

template <typename... P>
inline int launch(void (*k)(P...), void** args, int grid, int block, long long smem,
                  unsigned long long seed) {
  Launch<P...> l{k, args};
  return run(&Launch<P...>::body, &l, grid, block, smem, seed);
}

}  // namespace sdm_emu

// ---- the CUDA names the kernels use ---------------------------------------------------------
#define threadIdx (sdm_emu::S.cur->tid)
#define blockIdx (sdm_emu::S.bid)
#define blockDim (sdm_emu::S.bdim)
#define gridDim (sdm_emu::S.gdim)
#define __launch_bounds__(...)

inline void __syncthreads() { sdm_emu::syncthreads(); }
[[noreturn]] inline void __trap() { sdm_emu::fail("__trap()"); }

template <typename T>
SDM_EMU_INTERNAL inline T __shfl_sync(unsigned mask, T v, int src) {
  const uint64_t* b = sdm_emu::warp_gather(1, mask, sdm_emu::bits_of(v));
  return sdm_emu::of_bits<T>(b[src & 31]);
}
template <typename T>
SDM_EMU_INTERNAL inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  const uint64_t* b = sdm_emu::warp_gather(2, mask, sdm_emu::bits_of(v));
  return sdm_emu::of_bits<T>(b[(threadIdx.x % 32) ^ (lane_mask & 31)]);
}
template <typename T>
SDM_EMU_INTERNAL inline T __shfl_up_sync(unsigned mask, T v, unsigned d) {
  const uint64_t* b = sdm_emu::warp_gather(3, mask, sdm_emu::bits_of(v));
  const int lane = threadIdx.x % 32;
  return lane >= (int)d ? sdm_emu::of_bits<T>(b[lane - d]) : v;
}
SDM_EMU_INTERNAL inline unsigned __ballot_sync(unsigned mask, int pred) {
  const uint64_t* b = sdm_emu::warp_gather(4, mask, pred != 0);
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= (unsigned)(b[i] & 1) << i;
  return r;
}

// Device atomics are relaxed read-modify-writes; done with the compiler's atomics so that
// ThreadSanitizer sees them as atomics (one OS thread runs every fiber: no retries happen).
namespace sdm_emu {
template <typename T, typename F>
inline T rmw(T* p, F f) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "4- or 8-byte atomics");
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  U* q = reinterpret_cast<U*>(p);
  U o = __atomic_load_n(q, __ATOMIC_RELAXED);
  for (;;) {
    const T ov = of_bits<T>(o);
    const U n = (U)bits_of<T>(f(ov));
    if (__atomic_compare_exchange_n(q, &o, n, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return ov;
  }
}
}  // namespace sdm_emu
template <typename T> inline T atomicAdd(T* p, T v) { return sdm_emu::rmw(p, [v](T o) { return o + v; }); }
template <typename T> inline T atomicMax(T* p, T v) { return sdm_emu::rmw(p, [v](T o) { return o > v ? o : v; }); }
template <typename T> inline T atomicExch(T* p, T v) { return sdm_emu::rmw(p, [v](T) { return v; }); }
template <typename T> inline T atomicOr(T* p, T v) { return sdm_emu::rmw(p, [v](T o) { return o | v; }); }
template <typename T> inline T atomicCAS(T* p, T cmp, T v) {
  return sdm_emu::rmw(p, [cmp, v](T o) { return o == cmp ? v : o; });
}

template <typename T> inline T __ldcg(const T* p) { return *p; }
inline float __fmaf_ieee_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline int __float_as_int(float x) { return sdm_emu::of_bits<int>(sdm_emu::bits_of(x)); }
inline float __int_as_float(int x) { return sdm_emu::of_bits<float>(sdm_emu::bits_of(x)); }
inline unsigned __float_as_uint(float x) { return sdm_emu::of_bits<unsigned>(sdm_emu::bits_of(x)); }
inline float __uint_as_float(unsigned x) { return sdm_emu::of_bits<float>(sdm_emu::bits_of(x)); }
using std::signbit;
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }

// CUDA's min/max take mixed integer types (to their common type)
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return (C)a < (C)b ? (C)a : (C)b;
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return (C)a < (C)b ? (C)b : (C)a;
}
