// Launcher of the KV-cache write (device code: kernels/kv_cache.cuh). Contract: ARCHITECTURE.md.
//
// Checks every input, picks the widest copy unit (16 bytes when D * element size, the strides and the
// pointers are multiples of 16), and launches on the current stream (c10::cuda::getCurrentCUDAStream,
// the stream at::cuda::getCurrentCUDAStream returns). It never reads lengths on the
// host: out-of-range rows are skipped on the device and reported through `error_flag`, so the launch
// is CUDA-graph capturable.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one needs the cuBLAS/cuSPARSE headers

#include <cstdint>
#include <optional>

#include "checks.h"
#include "kernels/kv_cache.cuh"

namespace lrf {
namespace {

kernels::Strided4 as_bytes(const at::Tensor& t) {
  const int64_t es = t.element_size();
  return {static_cast<char*>(const_cast<void*>(t.data_ptr())), t.stride(0) * es, t.stride(1) * es,
          t.stride(2) * es};
}

template <typename Unit>
void launch(kernels::KvCacheWriteParams p, int64_t head_bytes, cudaStream_t stream) {
  p.units_per_head = head_bytes / int64_t(sizeof(Unit));
  const int threads = kernels::kv_cache_write_threads(p.heads * p.units_per_head);
  const int blocks = kernels::kv_cache_write_blocks(p.batch, p.chunk);
  kernels::kv_cache_write_kernel<Unit><<<blocks, threads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void kv_cache_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cache_lens, const at::Tensor& chunk_lens,
                    const std::optional<at::Tensor>& maybe_error_flag) {
  // Device last, so that every other check can be exercised on CPU tensors (python_tests, no GPU needed).
  CHECK_DIM(k_cache, 4);
  CHECK_DIM(k, 4);
  const int64_t B = k_cache.size(0), L = k_cache.size(1), H = k_cache.size(2), D = k_cache.size(3);
  const int64_t C = k.size(1);
  CHECK_SHAPE(v_cache, B, L, H, D);
  CHECK_SHAPE(k, B, C, H, D);
  CHECK_SHAPE(v, B, C, H, D);
  CHECK_SHAPE(cache_lens, B);
  CHECK_SHAPE(chunk_lens, B);

  CHECK_DTYPE_IN(k_cache, at::kBFloat16, at::kHalf, at::kFloat, at::kDouble);
  CHECK_SAME_DTYPE(k_cache, v_cache);
  CHECK_SAME_DTYPE(k_cache, k);
  CHECK_SAME_DTYPE(k_cache, v);
  CHECK_DTYPE(cache_lens, at::kInt);
  CHECK_DTYPE(chunk_lens, at::kInt);

  CHECK_SAME_DEVICE(k_cache, v_cache);
  CHECK_SAME_DEVICE(k_cache, k);
  CHECK_SAME_DEVICE(k_cache, v);
  CHECK_SAME_DEVICE(k_cache, cache_lens);
  CHECK_SAME_DEVICE(k_cache, chunk_lens);

  CHECK_LAST_DIM_CONTIGUOUS(k_cache);
  CHECK_LAST_DIM_CONTIGUOUS(v_cache);
  CHECK_LAST_DIM_CONTIGUOUS(k);
  CHECK_LAST_DIM_CONTIGUOUS(v);
  CHECK_CONTIGUOUS(cache_lens);
  CHECK_CONTIGUOUS(chunk_lens);
  CHECK_NO_INTERNAL_OVERLAP(k_cache);
  CHECK_NO_INTERNAL_OVERLAP(v_cache);

  int32_t* flag = nullptr;
  const at::Tensor error_flag = maybe_error_flag.value_or(at::Tensor());  // undefined when absent
  if (error_flag.defined()) {
    CHECK_DTYPE(error_flag, at::kInt);
    CHECK_SAME_DEVICE(k_cache, error_flag);
    LRF_CHECK(error_flag.numel() >= 1, "error_flag must have at least one element");
    flag = error_flag.data_ptr<int32_t>();
  }
  // other blocks read k / v / the lengths while a block writes its cache rows: a cache sharing memory with them
  // would copy whatever the writes had reached
  check_no_overlaps({{"k_cache", k_cache}, {"v_cache", v_cache}, {"error_flag", error_flag}},
                    {{"k", k}, {"v", v}, {"cache_lens", cache_lens}, {"chunk_lens", chunk_lens}});

  CHECK_CUDA(k_cache);
  if (B == 0) return;  // C == 0 still launches: out-of-range lengths are flagged like the reference does

  const c10::cuda::CUDAGuard guard(k_cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  kernels::KvCacheWriteParams p{};
  p.k_cache = as_bytes(k_cache);
  p.v_cache = as_bytes(v_cache);
  p.k = as_bytes(k);
  p.v = as_bytes(v);
  p.cache_lens = cache_lens.data_ptr<int32_t>();
  p.chunk_lens = chunk_lens.data_ptr<int32_t>();
  p.error_flag = flag;
  p.batch = B;
  p.chunk = C;
  p.capacity = L;
  p.heads = H;

  const int64_t head_bytes = D * k_cache.element_size();
  const int64_t unit = kernels::kv_cache_copy_unit(p, head_bytes);
  switch (unit) {
    case 16: launch<uint4>(p, head_bytes, stream); break;
    case 8: launch<uint2>(p, head_bytes, stream); break;
    case 4: launch<uint32_t>(p, head_bytes, stream); break;
    case 2: launch<uint16_t>(p, head_bytes, stream); break;
    default: launch<uint8_t>(p, head_bytes, stream); break;
  }
}

}  // namespace lrf
