// CPU driver of the KV-cache write kernel source (kernels/kv_cache.cuh) under emulation (emu_core.h with the
// CUDA-builtins front-end), a shared library for python_tests/test_kv_cache.py (ctypes); not part of the
// extension. It mirrors the launcher csrc/kv_cache.cu with the header's launch plan (kv_cache_copy_unit,
// kv_cache_write_threads, kv_cache_write_blocks), blocks in launch or shuffled order. Build:
//   g++ -std=c++20 -O2 -ffp-contract=off -DLRF_KERNEL_EMULATION -shared -fPIC -Icsrc -I<cuda>/include
//       csrc/emu/kv_cache_emu.cpp -o kv_cache_emu.so
#include "emu/cuda_builtins.h"

#include <algorithm>
#include <random>
#include <vector>

#include "kernels/kv_cache.cuh"

namespace {

using namespace lrf::kernels;

KvCacheWriteParams g_params;

template <typename Unit>
void body() {
  kv_cache_write_kernel<Unit>(g_params);
}

}  // namespace

extern "C" {

// Tensors are [B, rows, H, D] with element strides (sb, sr, sh) each (the last dim dense), elements of `es`
// bytes; error_flag may be null. max_blocks > 0 caps the grid below the launcher's (to exercise the grid-stride
// loop on small inputs). Returns the copy unit in bytes (the launcher's choice); *threads_out, *blocks_out: the
// launch shape.
int emu_kv_cache_write(void* k_cache, void* v_cache, const void* k, const void* v, const int64_t* cache_strides,
                       const int64_t* v_cache_strides, const int64_t* k_strides, const int64_t* v_strides, int64_t es,
                       const int32_t* cache_lens, const int32_t* chunk_lens, int32_t* error_flag, int64_t B, int64_t C,
                       int64_t L, int64_t H, int64_t D, int64_t max_blocks, uint64_t order_seed, int* threads_out,
                       int* blocks_out) {
  auto strided = [es](const void* ptr, const int64_t* st) {
    return Strided4{static_cast<char*>(const_cast<void*>(ptr)), st[0] * es, st[1] * es, st[2] * es};
  };
  KvCacheWriteParams p{};
  p.k_cache = strided(k_cache, cache_strides);
  p.v_cache = strided(v_cache, v_cache_strides);
  p.k = strided(k, k_strides);
  p.v = strided(v, v_strides);
  p.cache_lens = cache_lens;
  p.chunk_lens = chunk_lens;
  p.error_flag = error_flag;
  p.batch = B;
  p.chunk = C;
  p.capacity = L;
  p.heads = H;
  const int64_t head_bytes = D * es;
  const int64_t unit = kv_cache_copy_unit(p, head_bytes);
  p.units_per_head = head_bytes / unit;
  const int threads = kv_cache_write_threads(p.heads * p.units_per_head);
  int blocks = kv_cache_write_blocks(B, C);
  if (max_blocks > 0 && blocks > max_blocks) blocks = int(max_blocks);
  *threads_out = threads;
  *blocks_out = blocks;
  g_params = p;
  if (B == 0) return int(unit);  // the launcher returns before launching
  void (*fn)() = unit == 16 ? body<uint4> : unit == 8 ? body<uint2> : unit == 4 ? body<uint32_t>
               : unit == 2 ? body<uint16_t> : body<uint8_t>;
  std::vector<unsigned> order(static_cast<size_t>(blocks));
  for (unsigned b = 0; b < order.size(); ++b) order[b] = b;
  if (order_seed != 0) std::shuffle(order.begin(), order.end(), std::mt19937_64(order_seed));
  for (unsigned blk : order) lrf::emu::run_block(blk, unsigned(blocks), threads, 0, order_seed, fn);
  return int(unit);
}

}  // extern "C"
