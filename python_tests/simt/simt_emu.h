// A small SIMT emulator: runs CUDA device code (the torch-free headers of csrc/kernels) as host C++ so its
// logic can be tested without a GPU. Test support only; never part of the package build.
//
// Every CUDA thread of a block is a coroutine (a 6-register stack switch on x86-64, ucontext elsewhere); a thread runs until it reaches a warp collective
// (__syncwarp, __ballot_sync, __any_sync, __reduce_or_sync, __shfl_xor_sync) or a block barrier
// (__syncthreads, __syncthreads_or), where it waits until every thread that must take part has arrived.
// Collectives are strict: all 32 lanes of the warp (all threads of the block for a barrier) must reach
// the SAME kind of collective, else the run aborts with "divergent collective" or "deadlock" — the
// emulator doubles as a checker of warp-uniform control flow. Blocks run one after another, in any order
// the caller gives (the kernels must not depend on it). Memory is the host's; atomics are plain
// read-modify-writes (no preemption inside a coroutine); fences are no-ops.
//
// What it does NOT check: the hardware memory model, alignment faults, occupancy, ptxas behaviour, fast-math
// intrinsics' exact ulps (ex2.approx is exp2f here).
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <math.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>  // before the threadIdx / gridDim macros below
#include <vector_functions.h>
#include <vector_types.h>

#if defined(__x86_64__)
// simt_switch(&save_sp, load_sp): push the callee-saved registers, save rsp, switch stacks, pop, return.
extern "C" void simt_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl simt_switch
  .hidden simt_switch
  .type simt_switch, @function
simt_switch:
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
  .size simt_switch, .-simt_switch
)");
#define SIMT_FAST_SWITCH 1
#endif

namespace simt {

struct Idx3 {
  unsigned x, y, z;
};

enum Kind : int { kNone = 0, kSyncWarp, kBallot, kReduceOr, kShfl, kBarrier };

[[noreturn]] inline void fail(const char* what, int block, int thread) {
  std::fprintf(stderr, "simt emulator: %s (block %d, thread %d)\n", what, block, thread);
  std::fflush(stderr);
  std::abort();
}

struct WarpSlot {
  int arrived = 0;
  int kind = kNone;
  uint64_t gen = 0;
  uint32_t val[32];
  uint32_t arg[32];
  uint32_t res[32];
};

struct BlockState {
  int nthreads = 0;
  int block = 0;
  unsigned grid = 0;
  std::vector<ucontext_t> ctx;
  std::vector<void*> sp;  // fast switch: saved stack pointers
  void* sched_sp = nullptr;
  std::vector<char*> stacks;
  std::vector<char> done;
  std::vector<WarpSlot> warps;
  int bar_arrived = 0;
  uint64_t bar_gen = 0;
  uint32_t bar_or = 0, bar_res = 0;
  ucontext_t sched;
  int current = -1;
  uint64_t progress = 0;
  std::vector<char> smem;
  void (*body)() = nullptr;
};

inline BlockState*& state() {
  static BlockState* s = nullptr;
  return s;
}

inline Idx3 tidx() { return {unsigned(state()->current), 0u, 0u}; }
inline Idx3 bidx() { return {unsigned(state()->block), 0u, 0u}; }
inline Idx3 bdim() { return {unsigned(state()->nthreads), 1u, 1u}; }
inline Idx3 gdim() { return {state()->grid, 1u, 1u}; }
inline char* dynamic_smem() { return state()->smem.data(); }

// Coroutine stacks, allocated once (uninitialized) and reused by every block.
inline char* stack_for(int t, size_t bytes) {
  static std::vector<char*> pool;
  static size_t pool_bytes = 0;
  if (bytes > pool_bytes) {
    for (char* p : pool) delete[] p;
    pool.clear();
    pool_bytes = bytes;
  }
  while (int(pool.size()) <= t) pool.push_back(new char[pool_bytes]);
  return pool[t];
}

inline void yield() {
  BlockState* s = state();
  const int me = s->current;
#ifdef SIMT_FAST_SWITCH
  simt_switch(&s->sp[me], s->sched_sp);
#else
  swapcontext(&s->ctx[me], &s->sched);
#endif
}

// One warp collective: every lane deposits (val, arg); the last one to arrive computes every lane's result.
inline uint32_t warp_op(int kind, uint32_t mask, uint32_t val, uint32_t arg) {
  BlockState* s = state();
  const int t = s->current;
  if (mask != 0xffffffffu) fail("only full-warp masks are emulated", s->block, t);
  WarpSlot& w = s->warps[t / 32];
  const int lane = t % 32;
  if (w.arrived == 0) {
    w.kind = kind;
  } else if (w.kind != kind) {
    fail("divergent collective: lanes of one warp reached different warp collectives", s->block, t);
  }
  w.val[lane] = val;
  w.arg[lane] = arg;
  const uint64_t gen = w.gen;
  if (++w.arrived == 32) {
    uint32_t all = 0;
    for (int l = 0; l < 32; ++l) {
      if (kind == kBallot) all |= (w.val[l] ? 1u : 0u) << l;
      if (kind == kReduceOr) all |= w.val[l];
    }
    for (int l = 0; l < 32; ++l) {
      if (kind == kShfl) {
        if (w.arg[l] != w.arg[0]) fail("shfl_xor with a non-uniform lane mask", s->block, t);
        w.res[l] = w.val[l ^ int(w.arg[l])];
      } else {
        w.res[l] = all;
      }
    }
    w.arrived = 0;
    w.kind = kNone;
    ++w.gen;
    ++s->progress;
  } else {
    while (w.gen == gen) yield();
  }
  return w.res[lane];
}

inline uint32_t block_barrier(uint32_t pred) {
  BlockState* s = state();
  const uint64_t gen = s->bar_gen;
  s->bar_or |= pred ? 1u : 0u;
  if (++s->bar_arrived == s->nthreads) {
    s->bar_res = s->bar_or;
    s->bar_or = 0;
    s->bar_arrived = 0;
    ++s->bar_gen;
    ++s->progress;
  } else {
    while (s->bar_gen == gen) yield();
  }
  return s->bar_res;
}

inline void trampoline() {
  BlockState* s = state();
  s->body();
  s->done[s->current] = 1;
  ++s->progress;
#ifdef SIMT_FAST_SWITCH
  void* dead = nullptr;
  simt_switch(&dead, s->sched_sp);  // never resumed
  std::abort();
#endif
  // ucontext: returning switches to uc_link (the scheduler)
}

// Run `body` as block `block` of `grid` with `nthreads` threads and `smem_bytes` of dynamic shared memory
// (filled with 0xA5 garbage, as real shared memory is uninitialized).
inline void run_block(void (*body)(), int block, unsigned grid, int nthreads, size_t smem_bytes,
                      size_t stack_bytes = 1 << 16) {
  BlockState s;
  s.nthreads = nthreads;
  s.block = block;
  s.grid = grid;
  s.body = body;
  s.ctx.resize(nthreads);
  s.sp.resize(nthreads);
  s.stacks.resize(nthreads);
  s.done.assign(nthreads, 0);
  s.warps.resize((nthreads + 31) / 32);
  if (nthreads % 32 != 0) fail("block size must be a multiple of 32", block, -1);
  s.smem.assign(smem_bytes + 16, char(0xA5));
  state() = &s;
  for (int t = 0; t < nthreads; ++t) {
    s.stacks[t] = stack_for(t, stack_bytes);
#ifdef SIMT_FAST_SWITCH
    // initial frame: six zero registers, then the "return address" trampoline in a 16-byte aligned slot,
    // so that rsp % 16 == 8 on entry, as after a call
    uintptr_t top = (reinterpret_cast<uintptr_t>(s.stacks[t]) + stack_bytes - 64) & ~uintptr_t(15);
    void** frame = reinterpret_cast<void**>(top) - 8;
    for (int i = 0; i < 6; ++i) frame[i] = nullptr;
    frame[6] = reinterpret_cast<void*>(&trampoline);
    s.sp[t] = frame;
#else
    getcontext(&s.ctx[t]);
    s.ctx[t].uc_stack.ss_sp = s.stacks[t];
    s.ctx[t].uc_stack.ss_size = stack_bytes;
    s.ctx[t].uc_link = &s.sched;
    makecontext(&s.ctx[t], trampoline, 0);
#endif
  }
  int remaining = nthreads;
  while (remaining > 0) {
    const uint64_t before = s.progress;
    for (int t = 0; t < nthreads; ++t) {
      if (s.done[t]) continue;
      s.current = t;
#ifdef SIMT_FAST_SWITCH
      simt_switch(&s.sched_sp, s.sp[t]);
#else
      swapcontext(&s.sched, &s.ctx[t]);
#endif
      if (s.done[t]) --remaining;
    }
    if (remaining > 0 && s.progress == before) {
      fail("deadlock: threads wait at a collective that not every thread reaches", block, -1);
    }
  }
  state() = nullptr;
}

inline uint4 load16(const void* p) {
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}

}  // namespace simt

// ------------------------------------------------------------------ CUDA names the device code uses

#define threadIdx (::simt::tidx())
#define blockIdx (::simt::bidx())
#define blockDim (::simt::bdim())
#define gridDim (::simt::gdim())
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

inline void __syncwarp(unsigned mask = 0xffffffffu) { simt::warp_op(simt::kSyncWarp, mask, 0, 0); }
inline unsigned __ballot_sync(unsigned mask, int pred) { return simt::warp_op(simt::kBallot, mask, pred != 0, 0); }
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0u; }
inline unsigned __reduce_or_sync(unsigned mask, unsigned v) { return simt::warp_op(simt::kReduceOr, mask, v, 0); }
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = simt::warp_op(simt::kShfl, mask, bits, uint32_t(lane_mask));
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
inline int __shfl_xor_sync(unsigned mask, int v, int lane_mask) {
  return int(simt::warp_op(simt::kShfl, mask, uint32_t(v), uint32_t(lane_mask)));
}
inline void __syncthreads() { simt::block_barrier(0); }
inline int __syncthreads_or(int pred) { return int(simt::block_barrier(pred != 0)); }
inline void __threadfence() {}
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}
inline float4 __ldcg(const float4* p) { return *p; }
inline int4 __ldcg(const int4* p) { return *p; }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * uint64_t(b)) >> 32); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(int(v)); }
inline float __uint_as_float(unsigned v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
// volatile keeps the host compiler from contracting into an FMA (as __fmul_rn/__fadd_rn never are)
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float __fsub_rn(float a, float b) {
  volatile float r = a - b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
