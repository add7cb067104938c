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
//
// wgmma.mma_async m64nNk16 (sm_90a; a warpgroup = 4 consecutive warps, warp w of it owns rows 16w..16w+15):
//   A from registers ("RS"): the mma.m16n8k16 A fragment above, for the warp's 16 rows.
//   B from shared memory through a matrix descriptor (gmma_desc_sw128): K-major (B[n][k] with k contiguous,
//     the K tile of S = Q K^T) or MN-major (n contiguous, the V tile of O = P V), 128-byte swizzle.
//   D N/2 fp32 regs: d[4j + e] = (row group + 8 (e / 2), n 8j + 2tig + e % 2), the C fragment above per 8 columns.
// These layouts, the canonical shared-memory layouts and the descriptor fields are checked against CUTLASS/CuTe's
// GMMA traits on the host by python_tests/test_block_attn.py (csrc/emu/gmma_layout_check.cpp).
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

// ------------------------------------------------------------------ wgmma (sm_90a), warpgroup-collective

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LRF_HAS_WGMMA 1
#endif

// Orders this warpgroup's earlier register writes (accumulators, A fragments) before the next wgmma.mma_async.
LRF_DEVICE void wgmma_fence() {
#ifdef LRF_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

LRF_DEVICE void wgmma_commit() {
#ifdef LRF_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Wait until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
LRF_DEVICE void wgmma_wait() {
#ifdef LRF_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Generic-proxy shared-memory writes (st.shared, cp.async) of this thread become visible to async-proxy reads
// (wgmma's shared-memory operands) once a barrier orders them.
LRF_DEVICE void fence_proxy_async_smem() {
#ifdef LRF_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Keeps the compiler from moving reads or writes of accumulator registers across an asm statement (wgmma
// results exist only after wgmma_wait; the asm of the wgmma itself is where the compiler thinks they change).
template <int N>
LRF_DEVICE void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The same for 32-bit operand registers (wgmma A fragments): written before the wgmma.fence that covers them.
template <int N>
LRF_DEVICE void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// d (+)= A (16 rows of this warp, registers) x B (k16 x N from shared memory, descriptor desc_b), N = 64 or 128,
// over the warpgroup. TransB: false = B K-major, true = B MN-major. accumulate = false ignores d's old value.
// One specialization per (dtype, N), written by LRF_WGMMA_RS: the asm operands are d[0..N/2), a[0..4), desc_b,
// accumulate (-> predicate p), TransB (an immediate).
template <typename T, int N, bool TransB>
struct WgmmaRs;

#ifdef LRF_HAS_WGMMA
#define LRF_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define LRF_WGMMA_ASM(...) __trap()
#endif
#define LRF_WGMMA_D32 "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" "}"
#define LRF_WGMMA_D64 "{" "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" "}"
#define LRF_WGMMA_C32 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define LRF_WGMMA_C64 LRF_WGMMA_C32, \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// TAG: the element tag; TY: its PTX type; N; DREGS / DCONS: the accumulator operand list and constraints;
// A0..SC: the operand numbers of a[0], a[1], a[2], a[3], desc_b, accumulate; TR: of the TransB immediate.
#define LRF_WGMMA_RS(TAG, TY, N, DREGS, DCONS, A0, A1, A2, A3, DESC, SC, TR)                                    \
  template <bool TransB>                                                                                      \
  struct WgmmaRs<TAG, N, TransB> {                                                                            \
    static LRF_DEVICE void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) { \
      LRF_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" SC ", 0;\n"                                          \
                    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DREGS ", {%" A0 ", %" A1   \
                    ", %" A2 ", %" A3 "}, %" DESC ", p, 1, 1, %" TR ";\n}\n"                                    \
                    : DCONS                                                                                   \
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)),          \
                      "n"(TransB ? 1 : 0));                                                                   \
    }                                                                                                         \
  };

LRF_WGMMA_RS(Bf16, "bf16", 64, LRF_WGMMA_D32, LRF_WGMMA_C32, "32", "33", "34", "35", "36", "37", "38")
LRF_WGMMA_RS(Fp16, "f16", 64, LRF_WGMMA_D32, LRF_WGMMA_C32, "32", "33", "34", "35", "36", "37", "38")
LRF_WGMMA_RS(Bf16, "bf16", 128, LRF_WGMMA_D64, LRF_WGMMA_C64, "64", "65", "66", "67", "68", "69", "70")
LRF_WGMMA_RS(Fp16, "f16", 128, LRF_WGMMA_D64, LRF_WGMMA_C64, "64", "65", "66", "67", "68", "69", "70")
#undef LRF_WGMMA_RS
#undef LRF_WGMMA_C64
#undef LRF_WGMMA_C32
#undef LRF_WGMMA_D64
#undef LRF_WGMMA_D32
#undef LRF_WGMMA_ASM

template <typename T, int N, bool TransB>
LRF_DEVICE void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
  WgmmaRs<T, N, TransB>::run(d, a, desc_b, accumulate);
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
// (sm_90+ instructions: no-ops in code compiled for older GPUs, which have no programmatic dependent launch)
LRF_DEVICE void griddep_launch_dependents() {
#if !defined(__CUDA_ARCH__) || (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
LRF_DEVICE void griddep_wait() {
#if !defined(__CUDA_ARCH__) || (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// 2^x, approximate (ex2.approx.ftz: ~2 ulp); 2^-inf = +0.
LRF_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

LRF_DEVICE float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

LRF_DEVICE U128 ld_global_16(const void* p) { return *static_cast<const U128*>(p); }
LRF_DEVICE void st_global_16(void* p, U128 v) { *static_cast<U128*>(p) = v; }

// 16 bytes of data read once per launch (GEMM weights): read-only path, no L1 allocation, 256-byte L2
// prefetch. Volatile: issued where the code puts it, in particular before a griddepcontrol.wait that follows
// (a non-volatile asm was moved below it, losing the PDL prefetch).
LRF_DEVICE U128 ld_stream_16(const void* p) {
  U128 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

LRF_DEVICE void st_global_u16(void* p, uint16_t v) { *static_cast<uint16_t*>(p) = v; }

// Two consecutive floats (8-byte aligned) through a generic address: shared memory, the shared memory of
// another CTA of the cluster (cluster_map), or global memory.
LRF_DEVICE void ld_generic_f32x2(const float* p, float (&v)[2]) {
  const float2 t = *reinterpret_cast<const float2*>(p);
  v[0] = t.x, v[1] = t.y;
}

LRF_DEVICE void warp_sync() { __syncwarp(); }

// Thread-block clusters (sm_90): this CTA's rank in its cluster, a barrier of every thread of the cluster
// (release / acquire: shared-memory writes before it are visible to every CTA of the cluster after it), and
// the address of the same shared-memory variable in the CTA of another rank (distributed shared memory).
// A launch without a cluster dimension is a cluster of one CTA. Before sm_90 they trap.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#define LRF_CLUSTER_OP(...) __trap()
#else
#define LRF_CLUSTER_OP(...) __VA_ARGS__
#endif
LRF_DEVICE int cluster_ctarank() {
  uint32_t r = 0;
  LRF_CLUSTER_OP(asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r)));
  return static_cast<int>(r);
}
LRF_DEVICE void cluster_sync() {
  LRF_CLUSTER_OP(asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" :::
                              "memory"));
}
// The same barrier without release / acquire: for a barrier that only keeps shared memory alive (the reads of
// other CTAs' shared memory it waits for have completed: their values were used before it).
LRF_DEVICE void cluster_sync_relaxed() {
  LRF_CLUSTER_OP(asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" :::
                              "memory"));
}
LRF_DEVICE const float* cluster_map(const float* p, int rank) {
  uint64_t out = 0;
  LRF_CLUSTER_OP(asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(out) : "l"(p), "r"(rank)));
  return reinterpret_cast<const float*>(out);
}
#undef LRF_CLUSTER_OP

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

namespace lrf {
namespace kernels {

// Shared-memory matrix descriptor of a 128-byte-swizzled canonical layout (PTX "matrix descriptor"): start
// address, leading / stride byte offsets (all >> 4, 14 bits each), layout type 1 = 128B swizzle, base offset 0
// (the tiles are 1024-byte aligned). K-major: SBO = bytes between 8-row groups, LBO unused (1). MN-major: LBO =
// bytes between 64-element column blocks, SBO = bytes between 8-row (k) groups.
__host__ __device__ inline uint64_t gmma_desc_sw128(uint32_t smem_byte_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t((smem_byte_addr >> 4) & 0x3FFFu) | (uint64_t((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

}  // namespace kernels
}  // namespace lrf
