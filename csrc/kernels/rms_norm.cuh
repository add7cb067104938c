// RMSNorm and the fused q/k-norm + RoPE of the decode path: device code only (no torch). The launcher is
// csrc/rms_norm.cu; the contract and the pure-PyTorch references are lightningrl_fast/ops/rms_norm.py.
//
// Why: one SDAR layer's eager norms and rotary embedding are ~40 small elementwise launches (cast, square,
// mean, add, rsqrt, mul, cast, mul per norm, four norms; slice, neg, cat, mul, mul, add per RoPE), which
// dominate a batch-1 denoising step once the weights stream at full bandwidth. These two kernels do each
// norm (and each q/k norm + RoPE) in one launch.
//
// Numerics follow the eager code (Qwen3's RMSNorm, rotate-half RoPE) step by step, rounding where it rounds:
//   t = fl_T(x * rsqrt(sum(x^2) * (1 / N) + eps))   in fp32, rounded to the storage type T,
//   y = fl_T(w * t)                                  (T x T products are computed in fp32 and rounded),
//   rope: out_i = fl_T(fl_T(y_i * cos_i) + fl_T(r_i * sin_i)),  r = (-y[D/2:], y[:D/2]).
// The products and sums that feed a rounding to T are written __fmul_rn / __fadd_rn, so no FMA contraction
// changes those. The sum of squares and `total * (1 / N) + eps` are plain fp32 (the device fuses them into FMAs,
// the emulator does not) and the sum's order differs from torch's reduction, so a result can differ from eager
// by one unit of T's last place where t lands on a rounding boundary.
//
//   rms_norm_kernel:      one CTA of kRmsThreads per row of N, 16-byte vectors held in registers (one read).
//                         With kAdd it first adds a residual row, s = fl_T(x + r) (the eager `x + r`), writes
//                         s (the residual stream the next layer adds to) and normalizes s: the residual add
//                         and the next norm of a decoder layer in one launch instead of two.
//   qk_norm_rope_kernel:  one warp per head vector of D = 32 * E elements (E consecutive per lane); the RoPE
//                         partner of element i (i +- D/2) lives in lane ^ 16. Heads h >= split use a second
//                         weight, so q and k of one packed q/k/v projection are normalized in one launch.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace lrf {
namespace kernels {

constexpr int kRmsThreads = 128;    // rms_norm: threads per row
constexpr int kRmsMaxVecs = 8;      // rms_norm: 16-byte vectors per thread at most (N <= 8192 bf16, 4096 fp32)
constexpr int kRopeWarps = 4;       // qk_norm_rope: head vectors per CTA

// Lets the grid launched after this one with programmatic stream serialization (the decode GEMM, ops.linear
// with pdl) start while this grid drains: it prefetches weights, then waits in griddepcontrol.wait for this
// grid's completion before it reads our output. A no-op for other successors, before sm_90 and in emulation.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The launchers start these kernels with programmatic serialization (csrc/launch.h), so the kernel before one
// on the stream (the GEMM whose output it reads) may still be running when it starts: this wait, before the
// first access to global memory, returns once that grid has completed and its writes are visible. A no-op in
// a plain launch, before sm_90 and in emulation.
__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

struct Bf16Bits {};  // bfloat16 as raw 16-bit words
struct HalfBits {};

// Storage type <-> fp32, round to nearest even.
template <typename T>
struct Conv;

template <>
struct Conv<float> {
  using Storage = float;
  __device__ __forceinline__ static float load(const float* p) { return *p; }
  __device__ __forceinline__ static float round(float x) { return x; }
  __device__ __forceinline__ static void store(float* p, float x) { *p = x; }
};

template <>
struct Conv<Bf16Bits> {
  using Storage = uint16_t;
  __device__ __forceinline__ static float load(const uint16_t* p) { return __uint_as_float(uint32_t(*p) << 16); }
  __device__ __forceinline__ static uint16_t bits(float x) {
    const uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  __device__ __forceinline__ static float round(float x) { return __uint_as_float(uint32_t(bits(x)) << 16); }
  __device__ __forceinline__ static void store(uint16_t* p, float x) { *p = bits(x); }
};

template <>
struct Conv<HalfBits> {
  using Storage = __half;
  __device__ __forceinline__ static float load(const __half* p) { return __half2float(*p); }
  __device__ __forceinline__ static float round(float x) { return __half2float(__float2half_rn(x)); }
  __device__ __forceinline__ static void store(__half* p, float x) { *p = __float2half_rn(x); }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

// ------------------------------------------------------------------------------------------------ rms_norm

struct RmsNormParams {
  const void* x;        // [rows, N], rows `x_stride` elements apart, each 16-byte aligned
  const void* weight;   // [N]
  void* y;              // [rows, N] dense
  int64_t rows;
  int64_t x_stride;     // elements
  int32_t n;            // N, a multiple of the elements per 16-byte vector
  float eps;
  float inv_n;          // 1.0f / N
  const void* residual; // kAdd: [rows, N], rows `r_stride` elements apart, each 16-byte aligned
  int64_t r_stride;     // elements
  void* sum;            // kAdd: [rows, N] dense, fl_T(x + residual)
};

template <typename T, bool kAdd = false>
__global__ void __launch_bounds__(kRmsThreads) rms_norm_kernel(const RmsNormParams p) {
  allow_dependent_launch();
  wait_for_prerequisites();
  using C = Conv<T>;
  using S = typename C::Storage;
  constexpr int kPer = 16 / int(sizeof(S));  // elements per 16-byte vector
  __shared__ float partial[kRmsThreads / 32];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = blockIdx.x;
  const S* xr = static_cast<const S*>(p.x) + row * p.x_stride;
  const S* w = static_cast<const S*>(p.weight);
  S* yr = static_cast<S*>(p.y) + row * int64_t(p.n);
  const int nvec = p.n / kPer;

  // one read: this thread's vectors v = tid + k * kRmsThreads stay in registers (nvec <= kRmsMaxVecs * threads);
  // every load of the row is issued before the first store (the stores of the sum may alias nothing, but the
  // compiler cannot know that: without the split each vector's loads waited for the previous vector's store)
  float x[kRmsMaxVecs][kPer];
  float ss = 0.f;
  uint4 xraw[kRmsMaxVecs], rraw[kRmsMaxVecs];
#pragma unroll
  for (int k = 0; k < kRmsMaxVecs; ++k) {
    const int v = tid + k * kRmsThreads;
    if (v < nvec) {
      xraw[k] = *reinterpret_cast<const uint4*>(xr + int64_t(v) * kPer);
      if constexpr (kAdd) rraw[k] = *reinterpret_cast<const uint4*>(static_cast<const S*>(p.residual) + row * p.r_stride + int64_t(v) * kPer);
    }
  }
#pragma unroll
  for (int k = 0; k < kRmsMaxVecs; ++k) {
    const int v = tid + k * kRmsThreads;
    if (v < nvec) {
      S e[kPer];
      memcpy(e, &xraw[k], 16);
      if constexpr (kAdd) {
        S re[kPer];
        memcpy(re, &rraw[k], 16);
#pragma unroll
        for (int j = 0; j < kPer; ++j) C::store(e + j, __fadd_rn(C::load(e + j), C::load(re + j)));
        uint4 sraw;
        memcpy(&sraw, e, 16);
        *reinterpret_cast<uint4*>(static_cast<S*>(p.sum) + row * int64_t(p.n) + int64_t(v) * kPer) = sraw;
      }
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        x[k][j] = C::load(e + j);
        ss += x[k][j] * x[k][j];
      }
    }
  }
  uint4 wr[kRmsMaxVecs];  // the weight's vectors, fetched while the block reduces
#pragma unroll
  for (int k = 0; k < kRmsMaxVecs; ++k) {
    const int v = tid + k * kRmsThreads;
    if (v < nvec) wr[k] = *reinterpret_cast<const uint4*>(w + int64_t(v) * kPer);
  }
  ss = warp_sum(ss);
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kRmsThreads / 32; ++i) total += partial[i];
  const float r = rsqrtf(total * p.inv_n + p.eps);

#pragma unroll
  for (int k = 0; k < kRmsMaxVecs; ++k) {
    const int v = tid + k * kRmsThreads;
    if (v < nvec) {
      const uint4 wraw = wr[k];
      S we[kPer], oe[kPer];
      memcpy(we, &wraw, 16);
#pragma unroll
      for (int j = 0; j < kPer; ++j) C::store(oe + j, __fmul_rn(C::load(we + j), C::round(__fmul_rn(x[k][j], r))));
      uint4 out;
      memcpy(&out, oe, 16);
      *reinterpret_cast<uint4*>(yr + int64_t(v) * kPer) = out;
    }
  }
}

// ------------------------------------------------------------------------------------------- qk_norm_rope

struct QkNormRopeParams {
  const void* x;        // [B, N, H, D]: element strides sb, sn, sh; the last dim dense
  const void* weight;   // [D], heads h < split
  const void* weight2;  // [D], heads h >= split (the k heads of a packed q/k view)
  const void* cos;      // [B, N, D] dense
  const void* sin;      // [B, N, D] dense
  void* y;              // [B, N, H, D] dense
  int64_t sb, sn, sh;
  int32_t batch, tokens, heads;
  int32_t split;        // first head normalized with weight2 (= heads: none)
  float eps;
  float inv_d;          // 1.0f / D
};

// E = D / 32 elements per lane (D = 32 * E).
template <typename T, int E>
__global__ void __launch_bounds__(kRopeWarps * 32) qk_norm_rope_kernel(const QkNormRopeParams p) {
  allow_dependent_launch();
  wait_for_prerequisites();
  using C = Conv<T>;
  using S = typename C::Storage;
  constexpr int D = 32 * E;
  const int lane = threadIdx.x & 31;
  const int64_t vec = int64_t(blockIdx.x) * kRopeWarps + (threadIdx.x >> 5);  // (b, n, h) flattened
  const int64_t total = int64_t(p.batch) * p.tokens * p.heads;
  if (vec >= total) return;  // warp-uniform: whole warps leave together
  const int64_t h = vec % p.heads;
  const int64_t bn = vec / p.heads;  // b * N + n
  const int64_t n = bn % p.tokens, b = bn / p.tokens;

  const S* xv = static_cast<const S*>(p.x) + b * p.sb + n * p.sn + h * p.sh;
  const S* w = static_cast<const S*>(h < p.split ? p.weight : p.weight2);
  const S* cs = static_cast<const S*>(p.cos) + bn * D;
  const S* sn = static_cast<const S*>(p.sin) + bn * D;
  S* yv = static_cast<S*>(p.y) + vec * D;

  // every load first (x, weight, cos, sin), then the math, then the stores: a load after a store waits for it
  // (the compiler cannot rule out aliasing), which made each element a memory round trip
  float x[E], wv[E], cv[E], sv[E];
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int i = lane * E + j;
    x[j] = C::load(xv + i);
    wv[j] = C::load(w + i);
    cv[j] = C::load(cs + i);
    sv[j] = C::load(sn + i);
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < E; ++j) ss += x[j] * x[j];
  ss = warp_sum(ss);
  const float r = rsqrtf(ss * p.inv_d + p.eps);
  float y[E];
#pragma unroll
  for (int j = 0; j < E; ++j) y[j] = C::round(__fmul_rn(wv[j], C::round(__fmul_rn(x[j], r))));
  // rotate half: lanes 0..15 hold the first half, their partners (lane ^ 16) the second
  const bool first = lane < 16;
  float out[E];
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const float other = __shfl_xor_sync(0xffffffffu, y[j], 16);
    const float rot = first ? -other : other;
    const float a = C::round(__fmul_rn(y[j], cv[j]));
    const float c = C::round(__fmul_rn(rot, sv[j]));
    out[j] = __fadd_rn(a, c);
  }
#pragma unroll
  for (int j = 0; j < E; ++j) C::store(yv + lane * E + j, out[j]);
}

}  // namespace kernels
}  // namespace lrf
