// Warp-level primitives for the tensor-core kernels (torch-free): ldmatrix, mma.sync m16n8k16 (bf16/fp16
// inputs, fp32 accumulate), cp.async with zero fill, ex2.approx, warp shuffles, 2 x 16-bit packing.
//
// Every instruction the kernels use goes through this header, so the same kernel source also compiles as
// plain host C++ when LRF_KERNEL_EMULATION is defined: the functions then come from csrc/emu/warp_ops.h, the
// warp_ops front-end of the CPU emulator (csrc/emu/emu_core.h), which runs each CTA's threads as cooperative
// fibers and implements the PTX semantics (fragment layouts as in the PTX ISA). The CPU tests use that to
// check the index math without a GPU.
//
// Fragment layouts of mma.m16n8k16 (lane = 4 * group + tig):
//   A 16x16 row-major, 4 regs: a0 (row group,   k 2tig..+1), a1 (row group+8, k 2tig..+1),
//                              a2 (row group,   k 8+2tig..+1), a3 (row group+8, k 8+2tig..+1)
//   B 16x8 (k x n), 2 regs:    b0 (k 2tig..+1, n group), b1 (k 8+2tig..+1, n group)
//   C/D 16x8 fp32, 4 regs:     c0, c1 (row group, n 2tig, 2tig+1), c2, c3 (row group+8, same n)
#pragma once

#include <cstdint>

#if defined(LRF_KERNEL_EMULATION)
#include "emu/warp_ops.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define LRF_DEVICE __device__ __forceinline__

namespace lrf {
namespace kernels {

// Element tags: the 16-bit input dtypes of the tensor-core kernels.
struct Bf16 {};
struct Fp16 {};

using U128 = uint4;

// Shared-memory byte address (the 32-bit shared window) of a generic pointer into shared memory.
LRF_DEVICE uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Four 8x8 b16 matrices; lanes 8m..8m+7 give the row addresses of matrix m; reg m of lane l holds
// matrix m's row l/4, columns 2(l%4), 2(l%4)+1.
LRF_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The same, transposed: reg m of lane l holds matrix m's column l/4, rows 2(l%4), 2(l%4)+1.
LRF_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b (16x8x16), fp32 accumulators.
template <typename T>
LRF_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
LRF_DEVICE void mma_16816<Bf16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
LRF_DEVICE void mma_16816<Fp16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte global -> shared copy, L2 only; src_bytes 0 writes 16 zero bytes and reads nothing.
LRF_DEVICE void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

LRF_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N committed groups of this thread are still in flight.
template <int N>
LRF_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

LRF_DEVICE void block_sync() { __syncthreads(); }

// Programmatic dependent launch (sm_90): the primary grid lets its dependent grid launch early; the
// dependent grid waits until the primary grids have completed and their memory is visible. Both are no-ops
// when the launch did not ask for programmatic serialization.
LRF_DEVICE void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
LRF_DEVICE void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// 2^x, approximate (ex2.approx.ftz: ~2 ulp); 2^-inf = +0.
LRF_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

LRF_DEVICE float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

LRF_DEVICE U128 ld_global_16(const void* p) { return *static_cast<const U128*>(p); }
LRF_DEVICE void st_global_16(void* p, U128 v) { *static_cast<U128*>(p) = v; }

// Two floats -> two 16-bit values packed in one register (round to nearest even), lo in the low half.
template <typename T>
LRF_DEVICE uint32_t pack2(float lo, float hi);

template <>
LRF_DEVICE uint32_t pack2<Bf16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
LRF_DEVICE uint32_t pack2<Fp16>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// N = 2 or 4 consecutive floats (8 / 16-byte aligned) in one load.
template <int N>
LRF_DEVICE void ld_global_f32(const float* p, float (&x)[N]) {
  static_assert(N == 2 || N == 4, "2 or 4 floats");
  if constexpr (N == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const float2 v = *reinterpret_cast<const float2*>(p);
    x[0] = v.x, x[1] = v.y;
  }
}

LRF_DEVICE void st_global_u32(void* p, uint32_t v) { *static_cast<uint32_t*>(p) = v; }
LRF_DEVICE void st_global_u64(void* p, uint32_t lo, uint32_t hi) { *static_cast<uint2*>(p) = make_uint2(lo, hi); }
LRF_DEVICE void st_global_f32x2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }

}  // namespace kernels
}  // namespace lrf
#endif
