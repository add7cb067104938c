// Launchers of RMSNorm and the fused q/k-norm + RoPE (device code: kernels/rms_norm.cuh). Contract and
// references: lightningrl_fast/ops/rms_norm.py.
//
// Every input is checked here (the extension is safe to call directly); the device check comes last, so the
// other checks run on CPU tensors in CI. No length is read on the host and nothing is allocated but the
// output, so both launches can be captured in a CUDA graph.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "checks.h"
#include "kernels/rms_norm.cuh"

namespace lrf {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension, got shape ", x.sizes());
  const int64_t N = x.size(-1);
  CHECK_DTYPE_IN(x, at::kBFloat16, at::kHalf, at::kFloat);
  CHECK_SAME_DTYPE(x, weight);
  CHECK_SHAPE(weight, N);
  CHECK_SAME_DEVICE(x, weight);
  CHECK_CONTIGUOUS(weight);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "eps must be finite and >= 0, got ", eps);
  const int64_t per_vec = 16 / x.element_size();
  TORCH_CHECK(N > 0 && N % per_vec == 0 && N <= int64_t(kernels::kRmsMaxVecs) * kernels::kRmsThreads * per_vec,
              "rms_norm kernel: the last dimension must be a positive multiple of ", per_vec, " up to ",
              int64_t(kernels::kRmsMaxVecs) * kernels::kRmsThreads * per_vec, ", got ", N,
              " (ops.rms_norm uses the PyTorch reference otherwise)");
  // rows: x viewed as [rows, N] with one row stride (any leading layout that flattens so)
  const at::Tensor x2 = x.reshape({-1, N});
  const int64_t rows = x2.size(0);
  TORCH_CHECK(rows == 0 || (x2.stride(1) == 1 && x2.stride(0) % per_vec == 0 && aligned16(x2.data_ptr())),
              "rms_norm kernel: x must have a dense last dimension, 16-byte aligned rows, got strides ",
              x.strides(), " (ops.rms_norm uses the PyTorch reference otherwise)");
  TORCH_CHECK(aligned16(weight.data_ptr()), "rms_norm kernel: weight must be 16-byte aligned");
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), "rms_norm kernel: too many rows: ", rows);
  CHECK_CUDA(x);

  at::Tensor y = at::empty(x.sizes(), x.options());
  if (rows == 0) return y;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  kernels::RmsNormParams p{};
  p.x = x2.data_ptr();
  p.weight = weight.data_ptr();
  p.y = y.data_ptr();
  p.rows = rows;
  p.x_stride = x2.stride(0);
  p.n = static_cast<int32_t>(N);
  p.eps = static_cast<float>(eps);
  p.inv_n = 1.0f / static_cast<float>(N);
  const dim3 grid(static_cast<unsigned>(rows));
  switch (x.scalar_type()) {
    case at::kBFloat16:
      kernels::rms_norm_kernel<kernels::Bf16Bits><<<grid, kernels::kRmsThreads, 0, stream>>>(p);
      break;
    case at::kHalf:
      kernels::rms_norm_kernel<kernels::HalfBits><<<grid, kernels::kRmsThreads, 0, stream>>>(p);
      break;
    default:
      kernels::rms_norm_kernel<float><<<grid, kernels::kRmsThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor qk_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                        double eps) {
  CHECK_DIM(x, 4);
  const int64_t B = x.size(0), N = x.size(1), H = x.size(2), D = x.size(3);
  CHECK_DTYPE_IN(x, at::kBFloat16, at::kHalf, at::kFloat);
  CHECK_SAME_DTYPE(x, weight);
  CHECK_SAME_DTYPE(x, cos);
  CHECK_SAME_DTYPE(x, sin);
  CHECK_SHAPE(weight, D);
  CHECK_SHAPE(cos, B, N, D);
  CHECK_SHAPE(sin, B, N, D);
  CHECK_SAME_DEVICE(x, weight);
  CHECK_SAME_DEVICE(x, cos);
  CHECK_SAME_DEVICE(x, sin);
  CHECK_CONTIGUOUS(weight);
  CHECK_CONTIGUOUS(cos);
  CHECK_CONTIGUOUS(sin);
  CHECK_LAST_DIM_CONTIGUOUS(x);
  TORCH_CHECK(D == 64 || D == 128, "qk_norm_rope kernel: head_dim must be 64 or 128, got ", D,
              " (ops.qk_norm_rope uses the PyTorch reference otherwise)");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "eps must be finite and >= 0, got ", eps);
  TORCH_CHECK(B * N * H <= std::numeric_limits<int32_t>::max() && B <= std::numeric_limits<int32_t>::max(),
              "qk_norm_rope kernel: too many head vectors: ", B * N * H);
  CHECK_CUDA(x);

  at::Tensor y = at::empty({B, N, H, D}, x.options());
  const int64_t vecs = B * N * H;
  if (vecs == 0) return y;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  kernels::QkNormRopeParams p{};
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.y = y.data_ptr();
  p.sb = x.stride(0);
  p.sn = x.stride(1);
  p.sh = x.stride(2);
  p.batch = static_cast<int32_t>(B);
  p.tokens = static_cast<int32_t>(N);
  p.heads = static_cast<int32_t>(H);
  p.eps = static_cast<float>(eps);
  p.inv_d = 1.0f / static_cast<float>(D);
  const dim3 grid(static_cast<unsigned>((vecs + kernels::kRopeWarps - 1) / kernels::kRopeWarps));
  const int threads = kernels::kRopeWarps * 32;
  const bool d128 = D == 128;
  switch (x.scalar_type()) {
    case at::kBFloat16:
      if (d128) kernels::qk_norm_rope_kernel<kernels::Bf16Bits, 4><<<grid, threads, 0, stream>>>(p);
      else kernels::qk_norm_rope_kernel<kernels::Bf16Bits, 2><<<grid, threads, 0, stream>>>(p);
      break;
    case at::kHalf:
      if (d128) kernels::qk_norm_rope_kernel<kernels::HalfBits, 4><<<grid, threads, 0, stream>>>(p);
      else kernels::qk_norm_rope_kernel<kernels::HalfBits, 2><<<grid, threads, 0, stream>>>(p);
      break;
    default:
      if (d128) kernels::qk_norm_rope_kernel<float, 4><<<grid, threads, 0, stream>>>(p);
      else kernels::qk_norm_rope_kernel<float, 2><<<grid, threads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

}  // namespace lrf
