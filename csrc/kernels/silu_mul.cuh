// SiLU-gated product of the decode MLP, silu(gate) * up, on the packed gate/up GEMM output: device code only
// (no torch). The launcher is csrc/silu_mul.cu; the contract and the pure-PyTorch reference are
// lightningrl_fast/ops/silu_mul.py.
//
// Why: the eager `F.silu(gate) * up` is two launches with a rounded intermediate; in a batch-1 denoising step
// of SDAR-8B (36 layers) each launch is latency, not bandwidth. One launch reads each 16-byte vector of gate
// and the matching one of up and writes one vector of the product.
//
// Numerics follow the eager code, rounding where it rounds (T the storage type):
//   s = fl_T(g / (1 + exp(-g)))   in fp32 (torch's silu: the same formula, expf, IEEE division),
//   y = fl_T(s * u)               (the T x T product computed in fp32 and rounded).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kernels/rms_norm.cuh"  // Conv<T>: storage <-> fp32 with round-to-nearest-even

namespace lrf {
namespace kernels {

constexpr int kSiluThreads = 256;

struct SiluMulParams {
  const void* gu;       // [rows, 2 I]: gate = the first I elements of a row, up = the next I; rows `stride` apart
  void* y;              // [rows, I] dense
  int64_t rows;
  int64_t stride;       // elements between rows of gu (a multiple of the elements per 16-byte vector)
  int32_t inner;        // I, a multiple of the elements per 16-byte vector
};

template <typename T>
__global__ void __launch_bounds__(kSiluThreads) silu_mul_kernel(const SiluMulParams p) {
  allow_dependent_launch();  // the down-projection GEMM may start streaming its weights
  wait_for_prerequisites();  // the gate/up GEMM that writes gu may still run (programmatic launch)
  using C = Conv<T>;
  using S = typename C::Storage;
  constexpr int kPer = 16 / int(sizeof(S));
  const int64_t per_row = p.inner / kPer;  // vectors per output row
  const int64_t total = p.rows * per_row;
  const S* gu = static_cast<const S*>(p.gu);
  S* y = static_cast<S*>(p.y);
  for (int64_t v = int64_t(blockIdx.x) * kSiluThreads + threadIdx.x; v < total;
       v += int64_t(gridDim.x) * kSiluThreads) {
    const int64_t row = v / per_row, col = (v % per_row) * kPer;
    const S* g_ptr = gu + row * p.stride + col;
    const uint4 graw = *reinterpret_cast<const uint4*>(g_ptr);
    const uint4 uraw = *reinterpret_cast<const uint4*>(g_ptr + p.inner);
    S g[kPer], u[kPer], out[kPer];
    memcpy(g, &graw, 16);  // (not a pointer cast: strict aliasing, which the host-compiled emulator enforces)
    memcpy(u, &uraw, 16);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const float gf = C::load(g + j);
      const float s = C::round(__fdiv_rn(gf, __fadd_rn(1.0f, expf(-gf))));
      C::store(out + j, __fmul_rn(s, C::load(u + j)));
    }
    uint4 yraw;
    memcpy(&yraw, out, 16);
    *reinterpret_cast<uint4*>(y + row * int64_t(p.inner) + col) = yraw;
  }
}

}  // namespace kernels
}  // namespace lrf
