// Launcher of the skinny GEMM y = x W^T of the decode forward (device code: kernels/linear.cuh). Contract and
// reference: lightningrl_fast/ops/linear.py.
//
// Every input is checked here (the extension is safe to call directly); the device check comes last, so the
// other checks run on CPU tensors in CI. Allocates only the output; reads nothing on the host; no workspace (the
// split-K partials are reduced through the cluster's shared memory), so the launch can be captured in a CUDA
// graph and two launches on two streams never share state.
//
// Launch: linear_plan (kernels/linear.cuh) picks the feature tile and the cluster size from the CTAs the device
// can hold at once per cluster size (occupancy API, read once); the kernel goes through cudaLaunchKernelEx with
// the cluster dimension (sm_90+; 1 before) and, when asked (`pdl`), programmatic stream serialization. If the
// driver refuses the attributes the launch falls back to one CTA per cluster and no PDL (the same sum in another
// order: equal up to fp32 rounding, not bit for bit); not while the stream is captured, where the failed launch has
// already invalidated the capture and its error is the one raised.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <ATen/ops/empty.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <limits>

#include "checks.h"
#include "kernels/linear.cuh"

namespace lrf {
namespace {

constexpr int kMaxDevices = 64;

// slots[i] of kernels::linear_plan for linear_kernel<T, NT> on `device`: CTAs resident at once with clusters of
// 2^i CTAs, from the occupancy API (cudaOccupancyMaxActiveClusters knows which clusters fit in the GPCs);
// cluster sizes the device cannot launch (before sm_90, or refused) get 0. Read once per device and kernel.
template <typename T, int NT>
void plan_slots(int device, int64_t (&slots)[4]) {
  static std::array<std::array<std::atomic<int64_t>, 4>, kMaxDevices> cache{};  // value + 1; 0 = not read yet
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && cache[device][0].load(std::memory_order_acquire) > 0) {
    for (int i = 0; i < 4; ++i) slots[i] = cache[device][i].load(std::memory_order_relaxed) - 1;
    return;
  }
  const auto kernel = kernels::linear_kernel<T, NT>;
  const int smem = kernels::linear_smem_bytes(NT);
  int sms = 0, major = 0, cluster_ok = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&cluster_ok, cudaDevAttrClusterLaunch, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kernels::kLinearThreads, smem));
  slots[0] = int64_t(sms) * (per_sm > 0 ? per_sm : 1);
  for (int i = 1; i < 4; ++i) {
    slots[i] = 0;
    if (major < 9 || !cluster_ok) continue;
    const unsigned cl = 1u << i;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(cl);
    cfg.blockDim = dim3(kernels::kLinearThreads);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cl;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess) {
      slots[i] = int64_t(clusters) * cl;
    } else {
      (void)cudaGetLastError();  // that size cannot launch: leave it out of the plan
    }
  }
  if (cached) {
    for (int i = 1; i < 4; ++i) cache[device][i].store(slots[i] + 1, std::memory_order_relaxed);
    cache[device][0].store(slots[0] + 1, std::memory_order_release);
  }
}

template <typename T, int NT>
void launch(kernels::LinearParams p, const kernels::LinearPlan& plan, bool pdl, cudaStream_t stream) {
  p.fw = plan.fw;
  p.cluster = plan.cluster;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(plan.ctas));
  cfg.blockDim = dim3(kernels::kLinearThreads);
  cfg.dynamicSmemBytes = kernels::linear_smem_bytes(NT);
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2]{};
  unsigned n = 0;
  if (plan.cluster > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = static_cast<unsigned>(plan.cluster);
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernels::linear_kernel<T, NT>, p);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (err != cudaSuccess && n > 0 &&
      (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone)) {
    C10_CUDA_CHECK(err);  // a failed launch has invalidated the capture: report it, not the retry's error (launch.h)
  }
  if (err != cudaSuccess && n > 0) {
    (void)cudaGetLastError();  // clear it; the plain launch below reports its own errors
    const int64_t tiles = plan.ctas / plan.cluster;
    p.cluster = 1;
    kernels::linear_kernel<T, NT><<<static_cast<unsigned>(tiles), kernels::kLinearThreads,
                                    kernels::linear_smem_bytes(NT), stream>>>(p);
  } else if (err != cudaSuccess) {
    C10_CUDA_CHECK(err);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int NT>
void plan_and_launch(const kernels::LinearParams& p, bool pdl, int device, cudaStream_t stream) {
  int64_t slots[4];
  plan_slots<T, NT>(device, slots);
  const kernels::LinearPlan plan = kernels::linear_plan(p.n, p.k, slots);
  LRF_CHECK(plan.ctas <= std::numeric_limits<int32_t>::max(), "linear kernel: N too large for one grid: ", p.n);
  launch<T, NT>(p, plan, pdl, stream);
}

template <typename T>
void dispatch_tokens(const kernels::LinearParams& p, bool pdl, int device, cudaStream_t stream) {
  if (p.m <= 8) plan_and_launch<T, 1>(p, pdl, device, stream);
  else if (p.m <= 16) plan_and_launch<T, 2>(p, pdl, device, stream);
  else if (p.m <= 32) plan_and_launch<T, 4>(p, pdl, device, stream);
  else plan_and_launch<T, 8>(p, pdl, device, stream);
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, bool pdl) {
  CHECK_DIM(x, 2);
  CHECK_DIM(weight, 2);
  CHECK_DTYPE_IN(x, at::kBFloat16, at::kHalf);
  CHECK_SAME_DTYPE(x, weight);
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  LRF_CHECK(weight.size(1) == k, "linear: x is [M, K] = ", x.sizes(), " but weight [N, K] is ", weight.sizes());
  LRF_CHECK(m >= 1 && m <= kernels::kLinearMaxTokens, "linear kernel: x must have 1..", kernels::kLinearMaxTokens,
            " rows (tokens), got ", m, " (ops.linear uses F.linear otherwise)");
  LRF_CHECK(k > 0 && k % 8 == 0 && k <= std::numeric_limits<int32_t>::max(),
            "linear kernel: K (in_features) must be a positive multiple of 8, got ", k);
  LRF_CHECK(n > 0 && n <= std::numeric_limits<int32_t>::max(), "linear kernel: N (out_features) must be 1..2^31-1, got ",
            n);
  LRF_CHECK(x.stride(1) == 1 && (m == 1 || (x.stride(0) % 8 == 0 && x.stride(0) >= k)) &&
                reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
            "linear kernel: x must have a dense last dimension and 16-byte aligned rows, got strides ", x.strides());
  LRF_CHECK(weight.stride(1) == 1 && (n == 1 || (weight.stride(0) % 8 == 0 && weight.stride(0) >= k)) &&
                reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
            "linear kernel: weight must have a dense last dimension and 16-byte aligned rows, got strides ",
            weight.strides());
  CHECK_CUDA(x);
  CHECK_SAME_DEVICE(x, weight);

  at::Tensor y = at::empty({m, n}, x.options());
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  kernels::LinearParams p{};
  p.x = x.data_ptr();
  p.w = weight.data_ptr();
  p.y = y.data_ptr();
  p.m = static_cast<int32_t>(m);
  p.n = static_cast<int32_t>(n);
  p.k = static_cast<int32_t>(k);
  p.x_stride = m == 1 ? k : x.stride(0);
  p.w_stride = n == 1 ? k : weight.stride(0);
  if (x.scalar_type() == at::kBFloat16) {
    dispatch_tokens<kernels::Bf16>(p, pdl, x.get_device(), stream);
  } else {
    dispatch_tokens<kernels::Fp16>(p, pdl, x.get_device(), stream);
  }
  return y;
}

}  // namespace lrf
