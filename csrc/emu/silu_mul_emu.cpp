// CPU driver of the silu_mul kernel source (kernels/silu_mul.cuh) under emulation (emu_core.h with the
// CUDA-builtins front-end), a shared library for python_tests/test_silu_mul.py (ctypes); not part of the
// extension. It mirrors the launcher in csrc/silu_mul.cu (block size, parameters); the grid is the caller's, so
// the tests can force the grid-stride loop. Build:
//   g++ -std=c++20 -O2 -ffp-contract=off -DLRF_KERNEL_EMULATION -shared -fPIC -Icsrc -I<cuda>/include
//       csrc/emu/silu_mul_emu.cpp -o silu_mul_emu.so
#include "emu/cuda_builtins.h"

#include "kernels/silu_mul.cuh"

namespace {

using namespace lrf::kernels;

SiluMulParams g_params;

template <typename T>
void body() {
  silu_mul_kernel<T>(g_params);
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, 2 float16. gu: rows of 2 * inner elements, `stride` apart; y [rows, inner] dense.
void emu_silu_mul(int dtype, const void* gu, void* y, int64_t rows, int64_t stride, int inner, unsigned grid,
                  uint64_t order_seed) {
  g_params = SiluMulParams{gu, y, rows, stride, inner};
  void (*fn)() = dtype == 1 ? body<Bf16Bits> : dtype == 2 ? body<HalfBits> : body<float>;
  for (unsigned blk = 0; blk < grid; ++blk) lrf::emu::run_block(blk, grid, kSiluThreads, 0, order_seed, fn);
}

}  // extern "C"
