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
#include <optional>
#include <tuple>

#include "checks.h"
#include "launch.h"
#include "kernels/rms_norm.cuh"

namespace lrf {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }


// x and (when given) residual viewed as [rows, N] with one row stride each: the kernel's 16-byte-vector layout.
at::Tensor rows_view(const at::Tensor& t, const char* name, int64_t N, int64_t per_vec) {
  const at::Tensor t2 = t.reshape({-1, N});
  LRF_CHECK(t2.size(0) == 0 || (t2.stride(1) == 1 && t2.stride(0) % per_vec == 0 && aligned16(t2.data_ptr())),
              "rms_norm kernel: ", name, " must have a dense last dimension and 16-byte aligned rows, got strides ",
              t.strides(), " (ops.rms_norm uses the PyTorch reference otherwise)");
  return t2;
}

// y = rms_norm(x (+ residual)); `sum` receives x + residual when a residual is given.
void launch_rms_norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                     at::Tensor& y, at::Tensor* sum) {
  LRF_CHECK(x.dim() >= 1, "x must have at least one dimension, got shape ", x.sizes());
  const int64_t N = x.size(-1);
  CHECK_DTYPE_IN(x, at::kBFloat16, at::kHalf, at::kFloat);
  CHECK_SAME_DTYPE(x, weight);
  CHECK_SHAPE(weight, N);
  CHECK_SAME_DEVICE(x, weight);
  CHECK_CONTIGUOUS(weight);
  if (residual != nullptr) {
    const at::Tensor& res = *residual;
    LRF_CHECK(res.scalar_type() == x.scalar_type(), "x and residual must have the same dtype, got ",
                x.scalar_type(), " and ", res.scalar_type());
    LRF_CHECK(res.sizes() == x.sizes(), "residual must have x's shape ", x.sizes(), ", got ", res.sizes());
    LRF_CHECK(res.device() == x.device(), "x is on ", x.device(), " but residual is on ", res.device());
  }
  LRF_CHECK(std::isfinite(eps) && eps >= 0.0, "eps must be finite and >= 0, got ", eps);
  const int64_t per_vec = 16 / x.element_size();
  LRF_CHECK(N > 0 && N % per_vec == 0 && N <= int64_t(kernels::kRmsMaxVecs) * kernels::kRmsThreads * per_vec,
              "rms_norm kernel: the last dimension must be a positive multiple of ", per_vec, " up to ",
              int64_t(kernels::kRmsMaxVecs) * kernels::kRmsThreads * per_vec, ", got ", N,
              " (ops.rms_norm uses the PyTorch reference otherwise)");
  const at::Tensor x2 = rows_view(x, "x", N, per_vec);
  const at::Tensor r2 = residual != nullptr ? rows_view(*residual, "residual", N, per_vec) : at::Tensor();
  const int64_t rows = x2.size(0);
  LRF_CHECK(aligned16(weight.data_ptr()), "rms_norm kernel: weight must be 16-byte aligned");
  LRF_CHECK(rows <= std::numeric_limits<int32_t>::max(), "rms_norm kernel: too many rows: ", rows);
  CHECK_CUDA(x);
  if (residual != nullptr) CHECK_CUDA(*residual);

  y = at::empty(x.sizes(), x.options());
  if (sum != nullptr) *sum = at::empty(x.sizes(), x.options());
  if (rows == 0) return;
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
  if (residual != nullptr) {
    p.residual = r2.data_ptr();
    p.r_stride = r2.stride(0);
    p.sum = sum->data_ptr();
  }
  const dim3 grid(static_cast<unsigned>(rows)), block(kernels::kRmsThreads);
  const bool add = residual != nullptr;
  // launch_pdl (launch.h): the kernel waits for the previous one before touching memory
  cudaError_t err;
  switch (x.scalar_type()) {
    case at::kBFloat16:
      err = add ? launch_pdl(kernels::rms_norm_kernel<kernels::Bf16Bits, true>, grid, block, 0, stream, p)
                : launch_pdl(kernels::rms_norm_kernel<kernels::Bf16Bits>, grid, block, 0, stream, p);
      break;
    case at::kHalf:
      err = add ? launch_pdl(kernels::rms_norm_kernel<kernels::HalfBits, true>, grid, block, 0, stream, p)
                : launch_pdl(kernels::rms_norm_kernel<kernels::HalfBits>, grid, block, 0, stream, p);
      break;
    default:
      err = add ? launch_pdl(kernels::rms_norm_kernel<float, true>, grid, block, 0, stream, p)
                : launch_pdl(kernels::rms_norm_kernel<float>, grid, block, 0, stream, p);
  }
  C10_CUDA_CHECK(err);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor y;
  launch_rms_norm(x, nullptr, weight, eps, y, nullptr);
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  at::Tensor y, sum;
  launch_rms_norm(x, &residual, weight, eps, y, &sum);
  return {y, sum};
}

at::Tensor qk_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                        double eps, const std::optional<at::Tensor>& maybe_weight2, int64_t split) {
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
  if (maybe_weight2.has_value()) {
    const at::Tensor& weight2 = *maybe_weight2;
    CHECK_SAME_DTYPE(x, weight2);
    CHECK_SHAPE(weight2, D);
    CHECK_SAME_DEVICE(x, weight2);
    CHECK_CONTIGUOUS(weight2);
    LRF_CHECK(split >= 0 && split <= H, "qk_norm_rope: split must be in [0, heads = ", H, "], got ", split);
  }
  LRF_CHECK(D == 64 || D == 128, "qk_norm_rope kernel: head_dim must be 64 or 128, got ", D,
              " (ops.qk_norm_rope uses the PyTorch reference otherwise)");
  LRF_CHECK(std::isfinite(eps) && eps >= 0.0, "eps must be finite and >= 0, got ", eps);
  LRF_CHECK(B * N * H <= std::numeric_limits<int32_t>::max() && B <= std::numeric_limits<int32_t>::max(),
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
  p.weight2 = maybe_weight2.has_value() ? maybe_weight2->data_ptr() : weight.data_ptr();
  p.split = static_cast<int32_t>(maybe_weight2.has_value() ? split : H);
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
  const dim3 block(kernels::kRopeWarps * 32);
  const bool d128 = D == 128;
  cudaError_t err;  // launch_pdl (launch.h): the kernel waits for the previous one before touching memory
  switch (x.scalar_type()) {
    case at::kBFloat16:
      err = d128 ? launch_pdl(kernels::qk_norm_rope_kernel<kernels::Bf16Bits, 4>, grid, block, 0, stream, p)
                 : launch_pdl(kernels::qk_norm_rope_kernel<kernels::Bf16Bits, 2>, grid, block, 0, stream, p);
      break;
    case at::kHalf:
      err = d128 ? launch_pdl(kernels::qk_norm_rope_kernel<kernels::HalfBits, 4>, grid, block, 0, stream, p)
                 : launch_pdl(kernels::qk_norm_rope_kernel<kernels::HalfBits, 2>, grid, block, 0, stream, p);
      break;
    default:
      err = d128 ? launch_pdl(kernels::qk_norm_rope_kernel<float, 4>, grid, block, 0, stream, p)
                 : launch_pdl(kernels::qk_norm_rope_kernel<float, 2>, grid, block, 0, stream, p);
  }
  C10_CUDA_CHECK(err);
  return y;
}

}  // namespace lrf
