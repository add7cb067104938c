// The CTA model of the CPU emulator of device code: per-thread fibers, warp and block barriers, thread
// scheduling and shared memory. Test support only (python_tests/test_unmask_emu.py, test_rms_norm.py,
// test_silu_mul.py, test_kv_cache.py, test_grpo_loss_emu.py (and _random), test_block_attn_emu.py, test_linear.py,
// test_emu.py);
// never part of the package build (csrc/sources.txt does not list csrc/emu/).
//
// The emulator runs the real kernel headers (csrc/kernels/*.cuh) as host C++, one CTA at a time, so their index
// math, warp-uniform control flow, masking and pipeline ordering are tested without a GPU. Two front-ends sit on
// this core, each included by the driver of the kernels it runs:
//   cuda_builtins.h  the CUDA names device code uses directly (threadIdx, __syncthreads, __shfl_xor_sync,
//                    __ballot_sync, ...): csrc/kernels/unmask*.cuh, rms_norm.cuh, silu_mul.cuh, kv_cache.cuh,
//                    grpo_loss.cuh and group_normalize.cuh, driven by unmask_emu.cpp, rms_norm_emu.cpp,
//                    silu_mul_emu.cpp, kv_cache_emu.cpp and grpo_loss_emu.cpp (and selfcheck_emu.cpp)
//   warp_ops.h       the functions of csrc/kernels/warp_ops.cuh (ldmatrix, mma.m16n8k16, cp.async, shuffles,
//                    block_sync): csrc/kernels/block_attn.cuh and linear.cuh, driven by block_attn_emu.cpp and
//                    linear_emu.cpp (and wgmma_selfcheck_emu.cpp)
// Both build with -DLRF_KERNEL_EMULATION, which makes the kernel headers take their host-emulation branches.
//
// Model:
//  * Each thread of a CTA is a fiber on the one OS thread (a 6-register stack switch on x86-64, ucontext
//    elsewhere). A fiber runs until it reaches a warp collective or a block barrier, then the scheduler picks
//    the next runnable fiber: in launch order (round robin over thread ids) or at random from a seeded
//    generator, so warps interleave differently from seed to seed. No fiber is preempted between barriers:
//    atomics are plain read-modify-writes, fences are no-ops.
//  * Collectives are strict. All 32 lanes of a warp must reach the SAME warp collective (a block barrier: all
//    threads of the CTA the same barrier) before any lane continues. Lanes of one warp at different
//    collectives, or at a warp collective and a block barrier, abort with "divergent collective"; a thread that
//    exits while others wait for it, or waits nobody can end, aborts with "deadlock". So the emulator doubles
//    as a checker of warp-uniform control flow.
//  * warp_collective(kind, mine, all): every lane gives an operand; the last lane to arrive computes all 32
//    results at once, as the warp executes the instruction together (an ldmatrix reads shared memory at one
//    moment for the whole warp). The front-ends build shuffles, votes, ldmatrix and mma on it.
//  * Shared memory is one byte array per CTA (128-byte aligned), filled with a poison byte on entry (0xFF:
//    NaN in fp32 / bf16 / fp16, -1 in integers), as real shared memory is uninitialized. Global memory is host
//    memory.
//
// What it does NOT check: the hardware memory model (no reordering, every store is visible at once), bank
// conflicts, occupancy, ptxas behaviour, fast-math intrinsics' exact ulps.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#if defined(__x86_64__) && !defined(LRF_EMU_UCONTEXT)  // -DLRF_EMU_UCONTEXT tests the portable fallback
// lrf_emu_switch(&save_sp, load_sp): push the callee-saved registers, save rsp, switch stacks, pop, return.
// Weak, so that two translation units including this header link into one program.
extern "C" void lrf_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .weak lrf_emu_switch
  .hidden lrf_emu_switch
  .type lrf_emu_switch, @function
lrf_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size lrf_emu_switch, .-lrf_emu_switch
)");
#define LRF_EMU_FAST_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace lrf {
namespace emu {

constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 2048;  // a CTA, or a cluster run as one (warp_ops.h run_cluster)

// How one CTA runs.
struct Launch {
  int nthreads = 0;               // a multiple of 32
  size_t smem_bytes = 0;          // shared memory of the CTA
  int block = 0;                  // blockIdx.x
  unsigned grid = 1;              // gridDim.x
  bool random_order = false;      // false: fibers run in launch order; true: picked at random from `seed`
  bool warp_greedy = false;       // with random_order: warps in a seeded priority order, and the runnable fiber
                                  // of the first warp always runs next (one warp as far ahead of the others as
                                  // the barriers allow: a missing __syncthreads between one warp's shared-memory
                                  // write and another's read shows, which uniform picks rarely reach)
  uint64_t seed = 0;
  unsigned char smem_poison = 0xFF;  // every shared-memory byte on entry
  size_t stack_bytes = 256 << 10;    // per fiber (lazily committed pages, one guard page below)
};

enum Wait : int { kRunnable = 0, kAtWarp = 1, kAtBlock = 2 };

struct Fiber {
  char* stack = nullptr;  // pooled across CTAs
  size_t stack_bytes = 0;
#ifdef LRF_EMU_FAST_SWITCH
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  bool done = false;
  int wait = kRunnable;
};

struct WarpState {
  int arrived = 0;              // lanes waiting at the current warp collective
  int at_block = 0;             // lanes waiting at a block barrier
  int exited = 0;               // lanes that have returned
  const char* kind = nullptr;   // the collective those lanes reached
};

struct Cta {
  Launch launch;
  std::vector<Fiber> fibers;    // grows, never shrinks: stacks are reused by the next CTA
  std::vector<WarpState> warps;
  int current = -1;             // the running fiber; -1 in the scheduler
  int bar_arrived = 0;
  int exited = 0;               // threads that have returned
  const char* bar_kind = nullptr;
  uint32_t bar_or = 0, bar_res = 0;
  std::vector<int> runq;        // runnable fibers
  std::vector<int> slot;        // a fiber's index in runq, -1 when absent
  std::mt19937_64 rng;
  std::vector<char> smem_store;
  char* smem = nullptr;         // 128-byte aligned into smem_store
  const std::function<void()>* body = nullptr;
#ifdef LRF_EMU_FAST_SWITCH
  void* sched_sp = nullptr;
#else
  ucontext_t sched;
#endif
};

inline Cta& cta() {
  static Cta c;
  return c;
}

[[noreturn]] inline void fail(const char* what) {
  const Cta& c = cta();
  if (c.current >= 0) {
    std::fprintf(stderr, "emulator: %s (block %d, thread %d)\n", what, c.launch.block, c.current);
  } else {
    std::fprintf(stderr, "emulator: %s\n", what);
  }
  std::fflush(stderr);
  std::abort();
}

[[noreturn]] inline void fail_divergent(const char* a, const char* b, const char* who = "one warp") {
  char msg[256];
  std::snprintf(msg, sizeof(msg), "divergent collective: threads of %s reached %s and %s", who, a, b);
  fail(msg);
}

// ------------------------------------------------------------------------------------ the running CTA

inline int tid() { return cta().current; }
inline int lane() { return cta().current % kWarpSize; }
inline int warp() { return cta().current / kWarpSize; }
inline int nthreads() { return cta().launch.nthreads; }
inline int block() { return cta().launch.block; }
inline unsigned grid() { return cta().launch.grid; }

inline char* smem() { return cta().smem; }
inline size_t smem_bytes() { return cta().launch.smem_bytes; }

// ------------------------------------------------------------------------------------ fibers

inline void make_runnable(Cta& c, int t) {
  if (c.slot[t] < 0) {
    c.slot[t] = static_cast<int>(c.runq.size());
    c.runq.push_back(t);
  }
}

inline void remove_runnable(Cta& c, int t) {
  const int i = c.slot[t];
  if (i < 0) return;
  c.runq[i] = c.runq.back();
  c.slot[c.runq[i]] = i;
  c.runq.pop_back();
  c.slot[t] = -1;
}

// Back to the scheduler; the fiber resumes here when the scheduler picks it again.
inline void yield() {
  Cta& c = cta();
#ifdef LRF_EMU_FAST_SWITCH
  lrf_emu_switch(&c.fibers[c.current].sp, c.sched_sp);
#else
  swapcontext(&c.fibers[c.current].ctx, &c.sched);
#endif
}

inline void trampoline() {
  Cta& c = cta();
  (*c.body)();
  const int t = c.current;
  c.fibers[t].done = true;
  remove_runnable(c, t);
  WarpState& w = c.warps[t / kWarpSize];
  ++w.exited;
  ++c.exited;
  if (w.arrived > 0) fail("deadlock: a thread exited while lanes of its warp wait for it at a warp collective");
  if (c.bar_arrived > 0) fail("deadlock: a thread exited while other threads wait for it at a block barrier");
#ifdef LRF_EMU_FAST_SWITCH
  void* dead = nullptr;
  lrf_emu_switch(&dead, c.sched_sp);  // never resumed
  std::abort();
#endif
  // ucontext: returning switches to uc_link (the scheduler)
}

inline char* stack_alloc(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail("cannot map a fiber stack");
  mprotect(p, page, PROT_NONE);  // guard page: an overflow faults instead of corrupting the next stack
  return static_cast<char*>(p) + page;
}

inline void stack_free(char* stack, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  munmap(stack - page, bytes + page);
}

inline void switch_to(Cta& c, int t) {
  c.current = t;
#ifdef LRF_EMU_FAST_SWITCH
  lrf_emu_switch(&c.sched_sp, c.fibers[t].sp);
#else
  swapcontext(&c.sched, &c.fibers[t].ctx);
#endif
  c.current = -1;
}

// Runs one CTA: body() on each of launch.nthreads fibers (the thread id is tid()), until every fiber has
// returned. Shared memory starts as launch.smem_bytes poison bytes.
inline void run_cta(const Launch& launch, const std::function<void()>& body) {
  Cta& c = cta();
  if (c.current >= 0) fail("run_cta called from inside a CTA");
  const int n = launch.nthreads;
  if (n <= 0 || n % kWarpSize != 0 || n > kMaxThreads) fail("the block size must be a multiple of 32, 32..2048");
  c.launch = launch;
  c.body = &body;
  c.warps.assign(n / kWarpSize, WarpState{});
  c.bar_arrived = 0;
  c.exited = 0;
  c.bar_kind = nullptr;
  c.bar_or = c.bar_res = 0;
  c.rng.seed(launch.seed);
  c.smem_store.assign(launch.smem_bytes + 128 + 16, static_cast<char>(launch.smem_poison));
  c.smem = c.smem_store.data() + (128 - reinterpret_cast<uintptr_t>(c.smem_store.data()) % 128) % 128;
  if (static_cast<int>(c.fibers.size()) < n) c.fibers.resize(n);
  for (int t = 0; t < n; ++t) {
    Fiber& f = c.fibers[t];
    if (f.stack_bytes < launch.stack_bytes) {
      if (f.stack) stack_free(f.stack, f.stack_bytes);
      f.stack = stack_alloc(launch.stack_bytes);
      f.stack_bytes = launch.stack_bytes;
    }
    f.done = false;
    f.wait = kRunnable;
#ifdef LRF_EMU_FAST_SWITCH
    // initial frame: six zero registers, then the "return address" trampoline in a 16-byte aligned slot,
    // so that rsp % 16 == 8 on entry, as after a call
    const uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + f.stack_bytes - 64) & ~uintptr_t(15);
    void** frame = reinterpret_cast<void**>(top) - 8;
    for (int i = 0; i < 6; ++i) frame[i] = nullptr;
    frame[6] = reinterpret_cast<void*>(&trampoline);
    f.sp = frame;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = f.stack_bytes;
    f.ctx.uc_link = &c.sched;
    makecontext(&f.ctx, trampoline, 0);
#endif
  }
  c.runq.clear();
  c.slot.assign(n, -1);
  for (int t = 0; t < n; ++t) make_runnable(c, t);
  if (launch.random_order && launch.warp_greedy) {
    std::vector<int> prio(n / kWarpSize);
    for (int w = 0; w < static_cast<int>(prio.size()); ++w) prio[w] = w;
    std::shuffle(prio.begin(), prio.end(), c.rng);
    while (!c.runq.empty()) {
      int best = c.runq[0];
      auto rank = [&](int t) { return prio[t / kWarpSize] * kWarpSize + t % kWarpSize; };
      for (int t : c.runq) best = rank(t) < rank(best) ? t : best;
      switch_to(c, best);
    }
  } else if (launch.random_order) {
    while (!c.runq.empty()) switch_to(c, c.runq[c.rng() % c.runq.size()]);
  } else {
    for (bool ran = true; ran;) {  // passes over the threads in launch order
      ran = false;
      for (int t = 0; t < n; ++t) {
        if (c.slot[t] < 0) continue;
        ran = true;
        switch_to(c, t);
      }
    }
  }
  for (int t = 0; t < n; ++t) {
    if (!c.fibers[t].done) fail("deadlock: every live thread waits at a collective that cannot complete");
  }
  c.body = nullptr;
}

// ------------------------------------------------------------------------------------ barriers

// Registers the calling lane at the warp collective `kind` (pointer identity: one static string per
// collective); lanes of one warp reaching different ones diverge. Returns true for the 32nd lane, which
// releases the others: they run again once it has yielded, so it can finish the collective for the whole warp
// first.
inline bool warp_arrive(const char* kind) {
  Cta& c = cta();
  const int t = c.current;
  WarpState& w = c.warps[t / kWarpSize];
  if (w.at_block > 0) fail_divergent(kind, "a block barrier");
  if (w.exited > 0) fail("deadlock: a warp collective that a lane of the warp has exited before reaching");
  if (w.arrived == 0) {
    w.kind = kind;
  } else if (w.kind != kind) {
    fail_divergent(w.kind, kind);
  }
  if (++w.arrived < kWarpSize) {
    c.fibers[t].wait = kAtWarp;
    remove_runnable(c, t);
    return false;
  }
  w.arrived = 0;
  w.kind = nullptr;
  const int lo = t / kWarpSize * kWarpSize;
  for (int i = lo; i < lo + kWarpSize; ++i) {
    if (c.fibers[i].wait == kAtWarp) {
      c.fibers[i].wait = kRunnable;
      make_runnable(c, i);
    }
  }
  return true;
}

// Wait until all 32 lanes of the calling thread's warp have reached the warp collective `kind`.
inline void warp_barrier(const char* kind) {
  warp_arrive(kind);
  yield();  // a scheduling point for the last lane too
}

// Per-warp buffers of one payload type, Role 0 for operands and 1 for results (allocated once, never moved).
template <typename T, int Role>
inline std::vector<std::array<T, kWarpSize>>& warp_buffers() {
  static std::vector<std::array<T, kWarpSize>> bufs(kMaxThreads / kWarpSize);
  return bufs;
}

// A warp collective that moves data: every lane gives `mine`; when the last of the 32 lanes arrives (all at
// the same `kind`), all(in, out) computes every lane's result at once from every lane's operand, as the
// warp executes the instruction together; each lane returns out[lane]. One buffer of each suffices: a lane
// writes its next operand, and the warp's next results are written, only after it has read its result.
template <typename Out, typename In, typename F>
inline Out warp_collective(const char* kind, const In& mine, F&& all) {
  const int w = warp(), l = lane();
  std::array<In, kWarpSize>& in = warp_buffers<In, 0>()[w];
  std::array<Out, kWarpSize>& out = warp_buffers<Out, 1>()[w];
  in[l] = mine;
  if (warp_arrive(kind)) all(static_cast<const std::array<In, kWarpSize>&>(in), out);
  yield();
  return out[l];
}

// Wait until every thread of the CTA has reached this block barrier; returns the OR of their `pred`s.
inline uint32_t block_barrier(const char* kind, uint32_t pred = 0) {
  Cta& c = cta();
  const int t = c.current;
  WarpState& w = c.warps[t / kWarpSize];
  if (w.arrived > 0) fail_divergent(w.kind, kind);
  if (c.exited > 0) fail("deadlock: a block barrier that a thread of the block has exited before reaching");
  if (c.bar_arrived == 0) {
    c.bar_kind = kind;
  } else if (c.bar_kind != kind) {
    fail_divergent(c.bar_kind, kind, "the block");
  }
  c.bar_or |= pred ? 1u : 0u;
  if (++c.bar_arrived == c.launch.nthreads) {
    c.bar_res = c.bar_or;  // read by the released threads before any of them can reach the next barrier
    c.bar_or = 0;
    c.bar_arrived = 0;
    c.bar_kind = nullptr;
    for (WarpState& ws : c.warps) ws.at_block = 0;
    for (int i = 0; i < c.launch.nthreads; ++i) {
      if (c.fibers[i].wait == kAtBlock) {
        c.fibers[i].wait = kRunnable;
        make_runnable(c, i);
      }
    }
  } else {
    ++w.at_block;
    c.fibers[t].wait = kAtBlock;
    remove_runnable(c, t);
  }
  yield();
  return c.bar_res;
}

}  // namespace emu
}  // namespace lrf
