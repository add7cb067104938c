// CPU driver of the RMSNorm / q-k-norm + RoPE kernel source (kernels/rms_norm.cuh) under emulation (emu_core.h
// with the CUDA-builtins front-end), a shared library for python_tests/test_rms_norm.py (ctypes); not part of
// the extension. It mirrors the launchers in csrc/rms_norm.cu (grid, block, parameters). Build:
//   g++ -std=c++20 -O2 -ffp-contract=off -DLRF_KERNEL_EMULATION -shared -fPIC -Icsrc -I<cuda>/include
//       csrc/emu/rms_norm_emu.cpp -o rms_norm_emu.so
#include "emu/cuda_builtins.h"

#include <functional>

#include "kernels/rms_norm.cuh"

namespace {

using namespace lrf::kernels;

RmsNormParams g_rms;
QkNormRopeParams g_rope;

template <typename T, bool kAdd>
void rms_body() {
  rms_norm_kernel<T, kAdd>(g_rms);
}

template <typename T, int E>
void rope_body() {
  qk_norm_rope_kernel<T, E>(g_rope);
}

void run(unsigned grid, int threads, uint64_t order_seed, const std::function<void()>& body) {
  for (unsigned blk = 0; blk < grid; ++blk) lrf::emu::run_block(blk, grid, threads, 0, order_seed, body);
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, 2 float16. x: rows of n elements, x_stride elements apart; y dense. residual
// (rows r_stride elements apart) null: plain RMSNorm; else y = norm(x + residual) and sum (dense) = x + residual.
void emu_rms_norm(int dtype, const void* x, const void* weight, void* y, int64_t rows, int64_t x_stride, int n,
                  float eps, const void* residual, int64_t r_stride, void* sum, uint64_t order_seed) {
  g_rms = RmsNormParams{x, weight, y, rows, x_stride, n, eps, 1.0f / float(n), residual, r_stride, sum};
  void (*fn)() = nullptr;
  if (residual != nullptr) fn = dtype == 1 ? rms_body<Bf16Bits, true> : dtype == 2 ? rms_body<HalfBits, true>
                                                                                   : rms_body<float, true>;
  else fn = dtype == 1 ? rms_body<Bf16Bits, false> : dtype == 2 ? rms_body<HalfBits, false> : rms_body<float, false>;
  run(unsigned(rows), kRmsThreads, order_seed, fn);
}

// x [B, N, H, D] with element strides sb, sn, sh (last dim dense); cos, sin [B, N, D] and y [B, N, H, D] dense;
// heads h >= split use weight2.
void emu_qk_norm_rope(int dtype, const void* x, const void* weight, const void* weight2, int split, const void* cos,
                      const void* sin, void* y, int B, int N, int H, int D, int64_t sb, int64_t sn, int64_t sh,
                      float eps, uint64_t order_seed) {
  g_rope = QkNormRopeParams{x, weight, weight2, cos, sin, y, sb, sn, sh, B, N, H, split, eps, 1.0f / float(D)};
  void (*fn)() = nullptr;
  if (D == 128) fn = dtype == 1 ? rope_body<Bf16Bits, 4> : dtype == 2 ? rope_body<HalfBits, 4> : rope_body<float, 4>;
  else fn = dtype == 1 ? rope_body<Bf16Bits, 2> : dtype == 2 ? rope_body<HalfBits, 2> : rope_body<float, 2>;
  const int64_t vecs = int64_t(B) * N * H;
  run(unsigned((vecs + kRopeWarps - 1) / kRopeWarps), kRopeWarps * 32, order_seed, fn);
}

}  // extern "C"
