// Launcher of the SiLU-gated product silu(gate) * up of the decode MLP (device code: kernels/silu_mul.cuh).
// Contract and reference: lightningrl_fast/ops/silu_mul.py.
//
// Every input is checked here (the extension is safe to call directly); the device check comes last, so the
// other checks run on CPU tensors in CI. Nothing is allocated but the output and nothing is read on the host,
// so the launch can be captured in a CUDA graph.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "checks.h"
#include "launch.h"
#include "kernels/silu_mul.cuh"

namespace lrf {

at::Tensor silu_mul(const at::Tensor& gate_up) {
  LRF_CHECK(gate_up.dim() >= 1, "gate_up must have at least one dimension, got shape ", gate_up.sizes());
  CHECK_DTYPE_IN(gate_up, at::kBFloat16, at::kHalf, at::kFloat);
  const int64_t two_i = gate_up.size(-1);
  const int64_t per_vec = 16 / gate_up.element_size();
  LRF_CHECK(two_i % (2 * per_vec) == 0 && two_i > 0,
              "silu_mul kernel: the last dimension of gate_up (gate and up side by side) must be a positive multiple "
              "of ", 2 * per_vec, ", got ", two_i, " (ops.silu_mul uses the PyTorch reference otherwise)");
  const int64_t inner = two_i / 2;
  const at::Tensor g2 = gate_up.reshape({-1, two_i});
  const int64_t rows = g2.size(0);
  LRF_CHECK(rows == 0 || (g2.stride(1) == 1 && g2.stride(0) % per_vec == 0 &&
                            reinterpret_cast<uintptr_t>(g2.data_ptr()) % 16 == 0),
              "silu_mul kernel: gate_up must have a dense last dimension and 16-byte aligned rows, got strides ",
              gate_up.strides(), " (ops.silu_mul uses the PyTorch reference otherwise)");
  LRF_CHECK(inner <= std::numeric_limits<int32_t>::max(), "silu_mul kernel: the last dimension is too large: ",
              two_i);
  CHECK_CUDA(gate_up);

  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inner;
  at::Tensor y = at::empty(shape, gate_up.options());
  if (rows == 0) return y;
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  kernels::SiluMulParams p{};
  p.gu = g2.data_ptr();
  p.y = y.data_ptr();
  p.rows = rows;
  p.stride = g2.stride(0);
  p.inner = static_cast<int32_t>(inner);
  const int64_t vecs = rows * (inner / per_vec);
  // enough CTAs to cover every vector once up to ~16 waves of 132 SMs; larger inputs loop (grid stride)
  const int64_t ctas = std::min<int64_t>((vecs + kernels::kSiluThreads - 1) / kernels::kSiluThreads, 132 * 16);
  const dim3 grid(static_cast<unsigned>(ctas)), block(kernels::kSiluThreads);
  cudaError_t err;  // launch_pdl (launch.h): the kernel waits for the previous one before touching memory
  switch (gate_up.scalar_type()) {
    case at::kBFloat16:
      err = launch_pdl(kernels::silu_mul_kernel<kernels::Bf16Bits>, grid, block, 0, stream, p);
      break;
    case at::kHalf:
      err = launch_pdl(kernels::silu_mul_kernel<kernels::HalfBits>, grid, block, 0, stream, p);
      break;
    default:
      err = launch_pdl(kernels::silu_mul_kernel<float>, grid, block, 0, stream, p);
  }
  C10_CUDA_CHECK(err);
  return y;
}

}  // namespace lrf
