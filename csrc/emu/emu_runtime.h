// Host emulation of the warp primitives of kernels/warp_ops.cuh (LRF_KERNEL_EMULATION builds only).
//
// Purpose: run the real kernel source (kernels/*.cuh) on a CPU, one CTA at a time, to check its index
// math, fragment layouts, masking and pipeline ordering without a GPU. It is a test tool, not a fast path.
//
// Model:
//  * Each thread of a CTA is a fiber (ucontext) on one OS thread; fibers switch only at barriers. Warp
//    collectives (ldmatrix, mma, shfl) are "write my operand, warp barrier, read everyone's, warp barrier";
//    block_sync is a barrier of all the CTA's fibers. The next fiber to run is picked at random (seeded),
//    so warps interleave differently from run to run. A barrier nobody can complete (a warp diverging on a
//    collective, a block barrier skipped by some threads) aborts with "deadlock".
//  * cp.async: by default a copy lands at issue time (the earliest the hardware may land it); with
//    defer_copies it lands when the issuing thread's cp.async.wait_group retires its group (the latest).
//    Running both brackets the hardware's timing.
//  * Shared memory is a byte array; a "shared address" is an offset into it (bounds and alignment checked).
//    Global memory is host memory (16-, 8- and 4-byte accesses are alignment checked like the device).
//  * mma.m16n8k16 computes each lane's four fp32 outputs from the operands of all 32 lanes, with the
//    fragment layouts of the PTX ISA (see warp_ops.cuh); products are summed in fp32.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <math.h>
#include <random>
#include <vector>

#define LRF_DEVICE inline
#define __host__
#define __device__

namespace lrf {
namespace emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emulation error: %s\n", what);
  std::abort();
}

struct Copy {
  uint32_t dst;
  const char* src;
  int bytes;
};

struct Fiber {
  ucontext_t ctx{};
  std::vector<char> stack;
  bool done = false;
  int waiting = 0;  // 0 runnable, 1 warp barrier, 2 block barrier
  std::vector<Copy> open;
  std::deque<std::vector<Copy>> groups;
};

struct WarpSlots {
  uint32_t a[32][4];
  uint32_t b[32][2];
  float f[32];
};

struct Cta {
  int nthreads = 0;
  std::vector<Fiber> fibers;
  ucontext_t sched{};
  std::vector<char> smem;
  int cur = -1;
  std::vector<int> warp_arrived;
  int block_arrived = 0;
  std::vector<WarpSlots> slots;
  bool defer_copies = false;
  std::mt19937 rng{0};
  const std::function<void(int)>* body = nullptr;
  std::vector<int> runq;  // runnable threads (not done, not waiting)
  std::vector<int> slot;  // index of a thread in runq, -1 when absent

  void make_runnable(int t) {
    if (slot[t] < 0) {
      slot[t] = static_cast<int>(runq.size());
      runq.push_back(t);
    }
  }
  void remove_runnable(int t) {
    const int i = slot[t];
    if (i < 0) return;
    runq[i] = runq.back();
    slot[runq[i]] = i;
    runq.pop_back();
    slot[t] = -1;
  }
};

inline Cta& cta() {
  static Cta c;
  return c;
}

inline int tid() { return cta().cur; }

inline void barrier(int kind) {
  Cta& c = cta();
  const int t = c.cur;
  const int w = t / 32;
  const int lo = kind == 1 ? w * 32 : 0;
  const int hi = kind == 1 ? std::min(c.nthreads, lo + 32) : c.nthreads;
  int& arrived = kind == 1 ? c.warp_arrived[w] : c.block_arrived;
  c.fibers[t].waiting = kind;
  c.remove_runnable(t);
  if (++arrived == hi - lo) {
    arrived = 0;
    for (int i = lo; i < hi; ++i) {
      if (c.fibers[i].waiting == kind) {
        c.fibers[i].waiting = 0;
        c.make_runnable(i);
      }
    }
  }
  swapcontext(&c.fibers[t].ctx, &c.sched);
}

inline void trampoline() {
  Cta& c = cta();
  const int t = c.cur;
  (*c.body)(t);
  c.fibers[t].done = true;
  c.remove_runnable(t);
  bool pending = !c.fibers[t].open.empty();
  for (const auto& g : c.fibers[t].groups) pending = pending || !g.empty();
  if (pending) fail("thread exited with cp.async copies in flight");
}

// Runs one CTA of `nthreads` threads, body(tid) per thread, with `smem_bytes` of shared memory filled
// with 0xFF bytes (NaN in bf16/fp16): reading shared memory nobody wrote shows up as NaN.
inline void run_cta(int nthreads, size_t smem_bytes, const std::function<void(int)>& body, bool defer_copies,
                    uint32_t seed) {
  Cta& c = cta();
  c.nthreads = nthreads;
  c.body = &body;
  c.defer_copies = defer_copies;
  c.rng.seed(seed);
  c.smem.assign(smem_bytes + 16, static_cast<char>(0xFF));
  c.warp_arrived.assign((nthreads + 31) / 32, 0);
  c.block_arrived = 0;
  c.slots.resize((nthreads + 31) / 32);
  if (static_cast<int>(c.fibers.size()) < nthreads) c.fibers.resize(nthreads);
  for (int t = 0; t < nthreads; ++t) {
    Fiber& f = c.fibers[t];
    f.done = false;
    f.waiting = 0;
    f.open.clear();
    f.groups.clear();
    if (f.stack.empty()) f.stack.resize(256 * 1024);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &c.sched;
    makecontext(&f.ctx, trampoline, 0);
  }
  c.runq.clear();
  c.slot.assign(nthreads, -1);
  for (int t = 0; t < nthreads; ++t) c.make_runnable(t);
  for (;;) {
    if (c.runq.empty()) {
      for (int t = 0; t < nthreads; ++t) {
        if (!c.fibers[t].done) fail("deadlock: every live thread waits on a barrier that cannot complete");
      }
      break;
    }
    c.cur = c.runq[c.rng() % c.runq.size()];
    swapcontext(&c.sched, &c.fibers[c.cur].ctx);
  }
  c.cur = -1;
}

inline char* smem_ptr(uint32_t addr, size_t bytes) {
  Cta& c = cta();
  if (size_t(addr) + bytes > c.smem.size() - 16) fail("shared memory access out of bounds");
  return c.smem.data() + addr;
}

inline void do_copy(const Copy& cp) {
  char* dst = smem_ptr(cp.dst, 16);
  if (cp.bytes == 16) {
    std::memcpy(dst, cp.src, 16);
  } else {
    std::memset(dst, 0, 16);
  }
}

inline void check_align(const void* p, uintptr_t a, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % a != 0) fail(what);
}

inline uint16_t ld_u16(uint32_t addr) {
  uint16_t v;
  std::memcpy(&v, smem_ptr(addr, 2), 2);
  return v;
}

}  // namespace emu

namespace kernels {

struct Bf16 {};
struct Fp16 {};

struct U128 {
  uint32_t x, y, z, w;
};

inline float to_float(Bf16, uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_float(Fp16, uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

inline uint16_t from_float(Bf16, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t from_float(Fp16, float f) {
  const _Float16 x = static_cast<_Float16>(f);  // round to nearest even
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

inline uint32_t smem_addr(const void* p) {
  emu::Cta& c = emu::cta();
  const char* q = static_cast<const char*>(p);
  if (q < c.smem.data() || q > c.smem.data() + c.smem.size()) emu::fail("smem_addr of a non-shared pointer");
  return static_cast<uint32_t>(q - c.smem.data());
}

inline void ldmatrix_impl(uint32_t (&r)[4], uint32_t addr, bool trans) {
  emu::Cta& c = emu::cta();
  const int t = emu::tid(), lane = t % 32;
  emu::WarpSlots& ws = c.slots[t / 32];
  if (addr % 16 != 0) emu::fail("ldmatrix row address not 16-byte aligned");
  ws.a[lane][0] = addr;
  emu::barrier(1);
  for (int m = 0; m < 4; ++m) {
    uint16_t lo, hi;
    if (!trans) {  // row lane/4 of matrix m, columns 2(lane%4), +1
      const uint32_t row = ws.a[8 * m + lane / 4][0];
      lo = emu::ld_u16(row + 4 * (lane % 4));
      hi = emu::ld_u16(row + 4 * (lane % 4) + 2);
    } else {  // column lane/4 of matrix m, rows 2(lane%4), +1
      lo = emu::ld_u16(ws.a[8 * m + 2 * (lane % 4)][0] + 2 * (lane / 4));
      hi = emu::ld_u16(ws.a[8 * m + 2 * (lane % 4) + 1][0] + 2 * (lane / 4));
    }
    r[m] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  emu::barrier(1);
}

inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { ldmatrix_impl(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { ldmatrix_impl(r, addr, true); }

inline uint16_t half_of(uint32_t reg, int k) { return static_cast<uint16_t>(k % 2 ? reg >> 16 : reg & 0xffffu); }

template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::Cta& c = emu::cta();
  const int t = emu::tid(), lane = t % 32;
  emu::WarpSlots& ws = c.slots[t / 32];
  for (int i = 0; i < 4; ++i) ws.a[lane][i] = a[i];
  ws.b[lane][0] = b0;
  ws.b[lane][1] = b1;
  emu::barrier(1);
  const int g = lane / 4, tg = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * tg + (e % 2);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) {
      const uint32_t areg = ws.a[(row % 8) * 4 + (k % 8) / 2][(row / 8) + 2 * (k / 8)];
      const uint32_t breg = ws.b[col * 4 + (k % 8) / 2][k / 8];
      acc += to_float(T{}, half_of(areg, k)) * to_float(T{}, half_of(breg, k));
    }
    d[e] = acc;
  }
  emu::barrier(1);
}

inline void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  emu::Cta& c = emu::cta();
  if (dst % 16 != 0) emu::fail("cp.async shared address not 16-byte aligned");
  if (src_bytes != 0 && src_bytes != 16) emu::fail("cp.async src-size must be 0 or 16 here");
  if (src_bytes == 16) emu::check_align(src, 16, "cp.async global address not 16-byte aligned");
  const emu::Copy cp{dst, static_cast<const char*>(src), src_bytes};
  emu::smem_ptr(dst, 16);
  if (c.defer_copies) {
    c.fibers[emu::tid()].open.push_back(cp);
  } else {
    emu::do_copy(cp);
  }
}

inline void cp_async_commit() {
  emu::Fiber& f = emu::cta().fibers[emu::tid()];
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}

template <int N>
inline void cp_async_wait() {
  emu::Fiber& f = emu::cta().fibers[emu::tid()];
  while (static_cast<int>(f.groups.size()) > N) {
    for (const emu::Copy& cp : f.groups.front()) emu::do_copy(cp);
    f.groups.pop_front();
  }
}

inline void block_sync() { emu::barrier(2); }

// Grids run one after the other here: programmatic dependent launch has nothing to overlap.
inline void griddep_launch_dependents() {}
inline void griddep_wait() {}

inline float fast_exp2(float x) { return std::exp2(x); }

inline float shfl_xor(float v, int mask) {
  emu::Cta& c = emu::cta();
  const int t = emu::tid(), lane = t % 32;
  emu::WarpSlots& ws = c.slots[t / 32];
  ws.f[lane] = v;
  emu::barrier(1);
  const float r = ws.f[lane ^ mask];
  emu::barrier(1);
  return r;
}

inline U128 ld_global_16(const void* p) {
  emu::check_align(p, 16, "16-byte global load not aligned");
  U128 v;
  std::memcpy(&v, p, 16);
  return v;
}

inline void st_global_16(void* p, U128 v) {
  emu::check_align(p, 16, "16-byte global store not aligned");
  std::memcpy(p, &v, 16);
}

template <typename T>
inline uint32_t pack2(float lo, float hi) {
  return uint32_t(from_float(T{}, lo)) | (uint32_t(from_float(T{}, hi)) << 16);
}

template <int N>
inline void ld_global_f32(const float* p, float (&x)[N]) {
  emu::check_align(p, 4 * N, "vector float load not aligned");
  std::memcpy(x, p, 4 * N);
}

inline void st_global_u32(void* p, uint32_t v) {
  emu::check_align(p, 4, "4-byte store not aligned");
  std::memcpy(p, &v, 4);
}

inline void st_global_u64(void* p, uint32_t lo, uint32_t hi) {
  emu::check_align(p, 8, "8-byte store not aligned");
  std::memcpy(p, &lo, 4);
  std::memcpy(static_cast<char*>(p) + 4, &hi, 4);
}

inline void st_global_f32x2(float* p, float a, float b) {
  emu::check_align(p, 8, "float2 store not aligned");
  p[0] = a;
  p[1] = b;
}

}  // namespace kernels
}  // namespace lrf
