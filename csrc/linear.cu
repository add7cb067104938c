// Launcher of the skinny GEMM y = x W^T of the decode forward (device code: kernels/linear.cuh). Contract and
// reference: lightningrl_fast/ops/linear.py.
//
// Every input is checked here (the extension is safe to call directly); the device check comes last, so the
// other checks run on CPU tensors in CI. Allocates only the output; reads nothing on the host; no workspace (the
// split-K partials are reduced through the cluster's shared memory), so the launch can be captured in a CUDA
// graph and two launches on two streams never share state.
//
// Launch: linear_plan (kernels/linear.cuh) picks the feature tile and the cluster size from the device's SM
// count; the kernel goes through cudaLaunchKernelEx with the cluster dimension (sm_90+; 1 before) and, when
// asked (`pdl`), programmatic stream serialization. If the driver refuses the attributes the launch falls back
// to one CTA per cluster and no PDL (the same result).
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

struct DeviceFacts {
  int sms;
  int max_cluster;
};

// SM count and cluster support of `device`, read once per device.
DeviceFacts device_facts(int device) {
  static std::array<std::atomic<int>, kMaxDevices> sms_cache{};
  static std::array<std::atomic<int>, kMaxDevices> cluster_cache{};
  if (device >= 0 && device < kMaxDevices) {
    const int s = sms_cache[device].load(std::memory_order_relaxed);
    if (s > 0) return {s, cluster_cache[device].load(std::memory_order_relaxed)};
  }
  int sms = 0, major = 0, cluster_ok = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&cluster_ok, cudaDevAttrClusterLaunch, device));
  const DeviceFacts f{sms > 0 ? sms : 1, major >= 9 && cluster_ok ? kernels::kLinearMaxCluster : 1};
  if (device >= 0 && device < kMaxDevices) {
    cluster_cache[device].store(f.max_cluster, std::memory_order_relaxed);
    sms_cache[device].store(f.sms, std::memory_order_relaxed);
  }
  return f;
}

template <typename T, int NT>
void launch(kernels::LinearParams p, const kernels::LinearPlan& plan, cudaStream_t stream) {
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
  if (p.pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernels::linear_kernel<T, NT>, p);
  if (err != cudaSuccess && n > 0) {
    (void)cudaGetLastError();  // clear it; the plain launch below reports its own errors
    const int64_t tiles = plan.ctas / plan.cluster;
    p.cluster = 1;
    p.pdl = 0;
    kernels::linear_kernel<T, NT><<<static_cast<unsigned>(tiles), kernels::kLinearThreads,
                                    kernels::linear_smem_bytes(NT), stream>>>(p);
  } else if (err != cudaSuccess) {
    C10_CUDA_CHECK(err);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_tokens(const kernels::LinearParams& p, const kernels::LinearPlan& plan, cudaStream_t stream) {
  if (p.m <= 8) launch<T, 1>(p, plan, stream);
  else if (p.m <= 16) launch<T, 2>(p, plan, stream);
  else if (p.m <= 32) launch<T, 4>(p, plan, stream);
  else launch<T, 8>(p, plan, stream);
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
  p.pdl = pdl ? 1 : 0;
  const DeviceFacts facts = device_facts(x.get_device());
  const kernels::LinearPlan plan = kernels::linear_plan(n, k, facts.sms, facts.max_cluster);
  LRF_CHECK(plan.ctas <= std::numeric_limits<int32_t>::max(), "linear kernel: N too large for one grid: ", n);
  if (x.scalar_type() == at::kBFloat16) {
    dispatch_tokens<kernels::Bf16>(p, plan, stream);
  } else {
    dispatch_tokens<kernels::Fp16>(p, plan, stream);
  }
  return y;
}

}  // namespace lrf
