// CUDA-builtins front-end of the CPU emulator (emu_core.h): the CUDA names that device code uses directly
// (threadIdx / blockIdx / blockDim / gridDim, __syncthreads[_or], __syncwarp, __ballot_sync, __any_sync,
// __reduce_or_sync, __shfl_xor_sync, atomicAdd, atomicMax, atomicCAS, __ldcg, ...) for a kernel header compiled as host C++ with
// -DLRF_KERNEL_EMULATION. Used by unmask_emu.cpp (csrc/kernels/unmask.cuh, unmask_scan.cuh), grpo_loss_emu.cpp
// (csrc/kernels/grpo_loss.cuh, group_normalize.cuh), rms_norm_emu.cpp, silu_mul_emu.cpp, kv_cache_emu.cpp and
// selfcheck_emu.cpp; test support only.
//
// Kernels are 1-D (threadIdx.x, blockIdx.x); only full-warp masks (0xffffffff) are emulated. `__shared__`
// variables become host statics (shared by the CTAs, which run one after another); the dynamic shared memory
// is the core's per-CTA array (dynamic_smem()). The CUDA headers (cuda_fp16.h, cuda_runtime.h) are needed for
// the vector types and half-precision conversions the device code uses.
#pragma once

#define __shared__ static  // before the CUDA headers, which keep a definition they find

#include <cmath>
#include <cstdint>
#include <cstring>

#include <math.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>  // before the threadIdx / gridDim macros below
#include <vector_functions.h>
#include <vector_types.h>

#include "emu/emu_core.h"

namespace lrf {
namespace emu {

// Collective kinds (pointer identity; the text is what a divergence report prints).
inline constexpr char kSyncWarp[] = "__syncwarp";
inline constexpr char kBallot[] = "__ballot_sync / __any_sync";
inline constexpr char kReduceOr[] = "__reduce_or_sync";
inline constexpr char kShflXor[] = "__shfl_xor_sync";
inline constexpr char kSyncThreads[] = "__syncthreads";
inline constexpr char kSyncThreadsOr[] = "__syncthreads_or";

struct Idx3 {
  unsigned x, y, z;
};

inline Idx3 thread_idx() { return {unsigned(tid()), 0u, 0u}; }
inline Idx3 block_idx() { return {unsigned(block()), 0u, 0u}; }
inline Idx3 block_dim() { return {unsigned(nthreads()), 1u, 1u}; }
inline Idx3 grid_dim() { return {grid(), 1u, 1u}; }
inline char* dynamic_smem() { return smem(); }

// order_seed bit 63: the warp-greedy schedule (Launch::warp_greedy), its warp priorities seeded by the other bits.
inline constexpr uint64_t kWarpGreedy = uint64_t(1) << 63;

// Runs block `blk` of a 1-D grid of `grid` blocks: `nthreads` fibers, `smem` bytes of dynamic shared memory;
// order_seed 0 runs the threads in launch order, any other value in random interleavings seeded per block
// (kWarpGreedy set: warp after warp in a seeded order, as far as the barriers allow).
inline void run_block(unsigned blk, unsigned grid, int nthreads, size_t smem, uint64_t order_seed,
                      const std::function<void()>& body) {
  Launch launch;
  launch.nthreads = nthreads;
  launch.smem_bytes = smem;
  launch.block = int(blk);
  launch.grid = grid;
  launch.random_order = order_seed != 0;
  launch.warp_greedy = (order_seed & kWarpGreedy) != 0;
  launch.seed = (order_seed & ~kWarpGreedy) + blk;
  run_cta(launch, body);
}

inline void check_full_mask(unsigned mask) {
  if (mask != 0xffffffffu) fail("only full-warp masks are emulated");
}

struct ShflIn {
  uint32_t val, lane_mask;
};

inline uint32_t shfl_xor_bits(unsigned mask, uint32_t v, int lane_mask) {
  check_full_mask(mask);
  if (lane_mask < 0 || lane_mask >= kWarpSize) fail("shfl_xor lane mask outside 0..31");
  return warp_collective<uint32_t>(kShflXor, ShflIn{v, uint32_t(lane_mask)},
                                   [](const auto& in, auto& out) {
                                     for (int l = 0; l < kWarpSize; ++l) {
                                       if (in[l].lane_mask != in[0].lane_mask) {
                                         fail("shfl_xor with a non-uniform lane mask");
                                       }
                                       out[l] = in[l ^ int(in[l].lane_mask)].val;
                                     }
                                   });
}

// __ballot_sync (bit l = lane l's predicate) or __reduce_or_sync (OR of the values).
inline uint32_t vote(const char* kind, unsigned mask, uint32_t v, bool as_bits) {
  check_full_mask(mask);
  return warp_collective<uint32_t>(kind, v, [as_bits](const auto& in, auto& out) {
    uint32_t all = 0;
    for (int l = 0; l < kWarpSize; ++l) all |= as_bits ? (in[l] ? 1u : 0u) << l : in[l];
    out.fill(all);
  });
}

// A 16-byte global load (unmask_scan.cuh's load_stream16): the device faults on an address that is not 16-byte aligned,
// so the emulator refuses one too (a host memcpy would read it silently).
inline uint4 load16(const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) fail("16-byte global load not aligned");
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}

}  // namespace emu
}  // namespace lrf

// ------------------------------------------------------------------ CUDA names the device code uses

#define threadIdx (::lrf::emu::thread_idx())
#define blockIdx (::lrf::emu::block_idx())
#define blockDim (::lrf::emu::block_dim())
#define gridDim (::lrf::emu::grid_dim())
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  lrf::emu::check_full_mask(mask);
  lrf::emu::warp_barrier(lrf::emu::kSyncWarp);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return lrf::emu::vote(lrf::emu::kBallot, mask, pred != 0, true);
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0u; }
inline unsigned __reduce_or_sync(unsigned mask, unsigned v) {
  return lrf::emu::vote(lrf::emu::kReduceOr, mask, v, false);
}
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = lrf::emu::shfl_xor_bits(mask, bits, lane_mask);
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
inline double __shfl_xor_sync(unsigned mask, double v, int lane_mask) {  // the device's two 32-bit shuffles
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  const uint64_t lo = lrf::emu::shfl_xor_bits(mask, uint32_t(bits), lane_mask);
  const uint64_t hi = lrf::emu::shfl_xor_bits(mask, uint32_t(bits >> 32), lane_mask);
  bits = lo | (hi << 32);
  double out;
  std::memcpy(&out, &bits, 8);
  return out;
}
inline int __shfl_xor_sync(unsigned mask, int v, int lane_mask) {
  return int(lrf::emu::shfl_xor_bits(mask, uint32_t(v), lane_mask));
}
inline void __syncthreads() { lrf::emu::block_barrier(lrf::emu::kSyncThreads); }
inline int __syncthreads_or(int pred) { return int(lrf::emu::block_barrier(lrf::emu::kSyncThreadsOr, pred != 0)); }
inline void __threadfence() {}
inline int atomicAdd(int* p, int v) {  // no fiber switch inside: atomic by construction
  const int old = *p;
  *p = old + v;
  return old;
}
inline int atomicMax(int* p, int v) {  // likewise
  const int old = *p;
  *p = old > v ? old : v;
  return old;
}
inline int atomicCAS(int* p, int compare, int v) {  // likewise
  const int old = *p;
  if (old == compare) *p = v;
  return old;
}
inline float4 __ldcg(const float4* p) { return *p; }
inline int4 __ldcg(const int4* p) { return *p; }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * uint64_t(b)) >> 32); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(int(v)); }
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline double __longlong_as_double(long long i) {
  double d;
  std::memcpy(&d, &i, 8);
  return d;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
// The CUDA headers declare __expf (extern "C", device-only): defined here as the host's expf, more accurate than
// the device's ex2.approx-based intrinsic (the tests' tolerances allow for it). Weak: one definition per program.
extern "C" __attribute__((weak)) float __expf(float x) __THROW { return expf(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }  // the device's is approximate (2 ulp)
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
inline float __fdiv_rn(float a, float b) {
  volatile float r = a / b;
  return r;
}
