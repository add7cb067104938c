// Launcher of block attention with an incremental KV cache (device code: kernels/block_attn.cuh).
// Contract: ARCHITECTURE.md (block_attention).
//
// Checks every input, then one launch writes the chunk's K/V into the caches and attends (S == 1), or that
// launch writes per-split partials and a second one merges them (S > 1). `variant` picks the CTA's tensor-core
// path: 1 = mma.sync, 2 = wgmma (sm_90 only), 0 = automatic, which is mma.sync for now: the wgmma variant has
// passed the CPU emulator and the CUTLASS layout check but has not yet run on an H100 (profiling/RESULTS.md). The split count comes from the
// shapes and the device (SM count x resident CTAs per SM), never from the lengths: nothing here reads a
// device value on the host, so the call is CUDA-graph capturable. Lengths out of range are handled on the
// device (that row writes nothing and outputs zeros); the Python wrapper raises on them when it may sync.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one needs the cuBLAS/cuSPARSE headers

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

#include "checks.h"
#include "launch.h"
#include "kernels/block_attn.cuh"

namespace lrf {
namespace {

constexpr int kMaxDevices = 64;

kernels::AttnTensor as_attn_tensor(const at::Tensor& t) {
  const int64_t es = t.element_size();
  return {static_cast<char*>(const_cast<void*>(t.data_ptr())), t.stride(0) * es, t.stride(1) * es,
          t.stride(2) * es};
}

// cp.async moves 16-byte units: the data pointer and the byte strides of the first three dims must be
// multiples of 16 and the last dim dense.
bool aligned16(const at::Tensor& t) {
  if (t.size(3) > 1 && t.stride(3) != 1) return false;
  const int64_t es = t.element_size();
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && (t.stride(d) * es) % 16 != 0) return false;
  }
  return true;
}

// Per device and kernel instantiation: dynamic shared memory raised once, resident CTAs per SM x SMs.
template <typename T, int D, bool WG>
int64_t resident_ctas(int device) {
  static std::atomic<int64_t> cache[kMaxDevices];
  LRF_CHECK(device >= 0 && device < kMaxDevices, "block_attention: device index ", device, " out of range");
  int64_t r = cache[device].load(std::memory_order_relaxed);
  if (r > 0) return r;
  const int smem = kernels::block_attn_smem_bytes(D, WG);
  auto kernel = kernels::block_attn_kernel<T, D, WG>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kernels::kBlockAttnThreads, smem));
  r = int64_t(sms) * (per_sm > 0 ? per_sm : 1);
  cache[device].store(r, std::memory_order_relaxed);
  return r;
}

template <typename T, int D, bool WG>
void launch(const kernels::BlockAttnParams& p, int device, cudaStream_t stream) {
  resident_ctas<T, D, WG>(device);  // raises the shared-memory limit on this device first
  const int64_t grid = int64_t(p.m_tiles) * p.num_splits * p.batch * p.hkv;
  // Programmatic dependent launches (launch.h): the main grid waits for the kernel before it (q/k-norm + RoPE)
  // before its first memory access; the combine grid is scheduled while the main grid drains and waits in
  // griddepcontrol.wait for its completion. Both hide a launch latency; plain launches if the driver refuses.
  C10_CUDA_CHECK(launch_pdl(kernels::block_attn_kernel<T, D, WG>, dim3(static_cast<unsigned>(grid)),
                            dim3(kernels::kBlockAttnThreads), kernels::block_attn_smem_bytes(D, WG), stream, p));
  if (p.num_splits > 1) {
    const int64_t rows = int64_t(p.batch) * p.chunk * p.hq;
    const int64_t cgrid = (rows + kernels::kBlockAttnCombineWarps - 1) / kernels::kBlockAttnCombineWarps;
    C10_CUDA_CHECK(launch_pdl(kernels::block_attn_combine_kernel<T, D>, dim3(static_cast<unsigned>(cgrid)),
                              dim3(kernels::kBlockAttnCombineWarps * 32), 0, stream, p));
  }
}

template <typename T, int D, bool WG>
void dispatch_splits(kernels::BlockAttnParams& p, int64_t requested, int device) {
  if (requested > 0) {
    p.num_splits = static_cast<int>(requested);
  } else {
    const int rows_per_cta = p.m_rows < kernels::kBlockAttnBM ? p.m_rows : kernels::kBlockAttnBM;
    p.num_splits = kernels::block_attn_num_splits(int64_t(p.m_tiles) * p.batch * p.hkv, p.capacity, rows_per_cta,
                                                  resident_ctas<T, D, WG>(device));
  }
}

}  // namespace

at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& cache_lens, const at::Tensor& chunk_lens,
                           int64_t block_size, double softmax_scale, int64_t num_splits, int64_t variant) {
  CHECK_CUDA(q);
  CHECK_DIM(q, 4);
  CHECK_DIM(k_cache, 4);
  const int64_t B = q.size(0), C = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t L = k_cache.size(1), Hkv = k_cache.size(2);
  CHECK_SHAPE(k_cache, B, L, Hkv, D);
  CHECK_SHAPE(v_cache, B, L, Hkv, D);
  CHECK_SHAPE(k, B, C, Hkv, D);
  CHECK_SHAPE(v, B, C, Hkv, D);
  CHECK_SHAPE(cache_lens, B);
  CHECK_SHAPE(chunk_lens, B);

  CHECK_DTYPE_IN(q, at::kBFloat16, at::kHalf);
  CHECK_SAME_DTYPE(q, k);
  CHECK_SAME_DTYPE(q, v);
  CHECK_SAME_DTYPE(q, k_cache);
  CHECK_SAME_DTYPE(q, v_cache);
  CHECK_DTYPE(cache_lens, at::kInt);
  CHECK_DTYPE(chunk_lens, at::kInt);

  CHECK_SAME_DEVICE(q, k);
  CHECK_SAME_DEVICE(q, v);
  CHECK_SAME_DEVICE(q, k_cache);
  CHECK_SAME_DEVICE(q, v_cache);
  CHECK_SAME_DEVICE(q, cache_lens);
  CHECK_SAME_DEVICE(q, chunk_lens);
  CHECK_CONTIGUOUS(cache_lens);
  CHECK_CONTIGUOUS(chunk_lens);
  CHECK_NO_INTERNAL_OVERLAP(k_cache);
  CHECK_NO_INTERNAL_OVERLAP(v_cache);
  // the launch writes the chunk's cache rows while other CTAs read q / k / v and the lengths (and the two caches
  // must not share memory)
  check_no_overlaps({{"k_cache", k_cache}, {"v_cache", v_cache}},
                    {{"q", q}, {"k", k}, {"v", v}, {"cache_lens", cache_lens}, {"chunk_lens", chunk_lens}});

  LRF_CHECK(D == 64 || D == 128, "block_attention: head_dim must be 64 or 128, got ", D);
  LRF_CHECK(Hkv > 0 && Hq > 0 && Hq % Hkv == 0, "block_attention: q heads (", Hq,
            ") must be a positive multiple of the cache's kv heads (", Hkv, ")");
  LRF_CHECK(block_size > 0 && block_size <= std::numeric_limits<int>::max(),
              "block_attention: block_size must be positive, got ", block_size);
  LRF_CHECK(std::isfinite(softmax_scale), "block_attention: softmax_scale must be finite, got ", softmax_scale);
  LRF_CHECK(num_splits >= 0 && num_splits <= kernels::kBlockAttnMaxSplits, "block_attention: num_splits must be in [0, ",
              kernels::kBlockAttnMaxSplits, "] (0 = automatic), got ", num_splits);
  LRF_CHECK(variant >= 0 && variant <= 2, "block_attention: variant must be 0 (automatic), 1 (mma.sync) or 2 (wgmma), got ",
            variant);
  // The kernel indexes keys, rows and CTAs in int32: tile starts reach L + BN - 1, row tiles C * G + BM - 1.
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  constexpr int64_t kIndexMax = kIntMax - kernels::kBlockAttnBN;
  LRF_CHECK(B <= kIndexMax && L <= kIndexMax && Hq <= kIndexMax && C * (Hq / std::max<int64_t>(Hkv, 1)) <= kIndexMax,
              "block_attention: sizes must fit in int32 (less one tile), got q ", q.sizes(), " and a cache of ",
              k_cache.sizes());
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    LRF_CHECK(aligned16(*t), t == &k_cache ? "k_cache" : "v_cache",
                " must have a dense last dimension and a data pointer and strides that are multiples of 16 bytes, got "
                "strides ",
                t->strides());
  }

  at::Tensor out = at::empty({B, C, Hq, D}, q.options());
  if (B == 0 || C == 0) return out;  // nothing to write (a length error cannot write out of bounds either)

  // q, k, v are only read: copy the rare misaligned or strided-in-the-last-dim one into a fresh tensor.
  auto fit = [](const at::Tensor& t) { return aligned16(t) ? t : t.clone(at::MemoryFormat::Contiguous); };
  const at::Tensor qa = fit(q), ka = fit(k), va = fit(v);

  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int device = q.get_device();

  kernels::BlockAttnParams p{};
  p.q = as_attn_tensor(qa);
  p.k = as_attn_tensor(ka);
  p.v = as_attn_tensor(va);
  p.k_cache = as_attn_tensor(k_cache);
  p.v_cache = as_attn_tensor(v_cache);
  p.out = static_cast<char*>(out.data_ptr());
  p.cache_lens = cache_lens.data_ptr<int32_t>();
  p.chunk_lens = chunk_lens.data_ptr<int32_t>();
  p.batch = static_cast<int>(B);
  p.chunk = static_cast<int>(C);
  p.capacity = static_cast<int>(L);
  p.hq = static_cast<int>(Hq);
  p.hkv = static_cast<int>(Hkv);
  p.group = static_cast<int>(Hq / Hkv);
  p.block_size = static_cast<int>(block_size);
  p.m_rows = static_cast<int>(C * p.group);
  p.m_tiles = (p.m_rows + kernels::kBlockAttnBM - 1) / kernels::kBlockAttnBM;
  p.scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
  LRF_CHECK(std::isfinite(p.scale_log2), "block_attention: softmax_scale ", softmax_scale, " is out of the fp32 range");

  const bool wg = variant == 2;
  if (wg) {
    // the wgmma instructions exist in the sm_90a code only (elsewhere that kernel would trap)
    LRF_CHECK(std::string_view(kCudaArchs).find("90a") != std::string_view::npos,
              "block_attention: the wgmma variant needs an extension built for sm_90a (LRF_CUDA_ARCHS), this one has '",
              kCudaArchs, "'");
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    LRF_CHECK(major == 9, "block_attention: the wgmma variant needs an sm_90 GPU (H100/H200), got compute capability ",
              major, ".x");
  }
  // One call per instantiation (dtype x head dim x variant): `f` is called with the tag types of the kernel.
  auto instantiation = [&](auto&& f) {
    const bool bf16 = q.scalar_type() == at::kBFloat16;
    auto by_variant = [&](auto tag, auto dim) {
      if (wg) f(tag, dim, std::true_type{});
      else f(tag, dim, std::false_type{});
    };
    using D128 = std::integral_constant<int, 128>;
    using D64 = std::integral_constant<int, 64>;
    if (bf16 && D == 128) by_variant(kernels::Bf16{}, D128{});
    else if (bf16) by_variant(kernels::Bf16{}, D64{});
    else if (D == 128) by_variant(kernels::Fp16{}, D128{});
    else by_variant(kernels::Fp16{}, D64{});
  };
  instantiation([&](auto tag, auto dim, auto wg_tag) {
    dispatch_splits<decltype(tag), decltype(dim)::value, decltype(wg_tag)::value>(p, num_splits, device);
  });

  const int64_t grid = int64_t(p.m_tiles) * p.num_splits * B * Hkv;
  LRF_CHECK(grid <= kIntMax, "block_attention: too many CTAs (", grid, "); split the batch");
  LRF_CHECK(p.num_splits == 1 || B * C * Hq / kernels::kBlockAttnCombineWarps < kIntMax,
              "block_attention: too many output rows for the split combine (", B * C * Hq, "); split the batch");
  at::Tensor o_part, lse_part;
  if (p.num_splits > 1) {
    const int64_t rows = B * C * Hq;
    o_part = at::empty({p.num_splits, rows, D}, q.options().dtype(at::kFloat));
    lse_part = at::empty({p.num_splits, rows}, q.options().dtype(at::kFloat));
    p.o_part = o_part.data_ptr<float>();
    p.lse_part = lse_part.data_ptr<float>();
  }

  instantiation([&](auto tag, auto dim, auto wg_tag) {
    launch<decltype(tag), decltype(dim)::value, decltype(wg_tag)::value>(p, device, stream);
  });
  return out;
}

}  // namespace lrf
