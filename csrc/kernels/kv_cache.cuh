// KV-cache write: device code only (no torch). The launcher is csrc/kv_cache.cu.
//
// Row b copies k[b, :n] and v[b, :n] (n = chunk_lens[b]) into k_cache[b, s:s+n] and v_cache[b, s:s+n]
// (s = cache_lens[b]). A row whose lengths are out of range (s < 0, n < 0, n > C or s + n > L) writes
// nothing and sets *error_flag = 1 (when error_flag is not null): the kernel never writes out of bounds,
// whatever the lengths hold, and it reads them on the device only, so the launch needs no host sync and
// can be captured in a CUDA graph.
//
// The copy is dtype-agnostic: every tensor is seen as bytes, one head vector (D elements, contiguous)
// at a time, moved in units of `Unit` (uint4 = 16 bytes when sizes, strides and pointers allow it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace lrf {
namespace kernels {

// A [B, rows, H, D] tensor as bytes: base pointer and the byte strides of its first three dims
// (the last dim is dense).
struct Strided4 {
  char* ptr;
  int64_t stride_b;
  int64_t stride_row;
  int64_t stride_head;
};

struct KvCacheWriteParams {
  Strided4 k_cache;             // [B, L, H, D], written
  Strided4 v_cache;             // [B, L, H, D], written
  Strided4 k;                   // [B, C, H, D], read
  Strided4 v;                   // [B, C, H, D], read
  const int32_t* cache_lens;    // [B]
  const int32_t* chunk_lens;    // [B]
  int32_t* error_flag;          // [1] or nullptr; set to 1 when a row is out of range
  int64_t batch;                // B
  int64_t chunk;                // C
  int64_t capacity;             // L
  int64_t heads;                // H
  int64_t units_per_head;       // D * element size / sizeof(Unit)
};

constexpr int kKvCacheWriteMaxThreads = 256;
constexpr int64_t kKvCacheWriteMaxBlocks = int64_t(1) << 20;

__device__ __forceinline__ bool kv_cache_row_in_range(int32_t start, int32_t n, int64_t chunk,
                                                      int64_t capacity) {
  return start >= 0 && n >= 0 && n <= chunk && int64_t(start) + int64_t(n) <= capacity;
}

// Pairs (row b, chunk token t) the grid covers: B * C, or B when C == 0 (the rows' lengths are still checked).
__host__ __device__ __forceinline__ int64_t kv_cache_write_pairs(int64_t batch, int64_t chunk) {
  return batch * (chunk > 0 ? chunk : 1);
}

// The launch plan (the launcher's, and the CPU emulator's driver's: csrc/emu/kv_cache_emu.cpp).
// Copy unit: the largest power of two <= 16 bytes that divides the head's bytes, every pointer and every byte stride.
__host__ __device__ __forceinline__ int64_t kv_cache_copy_unit(const KvCacheWriteParams& p, int64_t head_bytes) {
  const Strided4* ts[] = {&p.k_cache, &p.v_cache, &p.k, &p.v};
  int64_t bits = head_bytes;
  for (const Strided4* t : ts) {
    bits |= static_cast<int64_t>(reinterpret_cast<uintptr_t>(t->ptr)) | t->stride_b | t->stride_row | t->stride_head;
  }
  int64_t unit = 16;
  while (unit > 1 && bits % unit != 0) unit /= 2;
  return unit;
}

// Threads per block: a multiple of 32 covering a token's units (its heads), at most kKvCacheWriteMaxThreads.
__host__ __device__ __forceinline__ int kv_cache_write_threads(int64_t per_token_units) {
  const int64_t warps = (per_token_units + 31) / 32;
  const int64_t t = warps * 32 < 32 ? 32 : warps * 32;
  return static_cast<int>(t < kKvCacheWriteMaxThreads ? t : kKvCacheWriteMaxThreads);
}

// Blocks: one per (row, token) pair, at most kKvCacheWriteMaxBlocks (the kernel strides over the rest).
__host__ __device__ __forceinline__ int kv_cache_write_blocks(int64_t batch, int64_t chunk) {
  const int64_t pairs = kv_cache_write_pairs(batch, chunk);
  return static_cast<int>(pairs < kKvCacheWriteMaxBlocks ? pairs : kKvCacheWriteMaxBlocks);
}

// One block per (row b, chunk token t), grid-stride over the pairs.
template <typename Unit>
__global__ void kv_cache_write_kernel(const KvCacheWriteParams p) {
  const int64_t tokens = p.chunk > 0 ? p.chunk : 1;
  const int64_t pairs = kv_cache_write_pairs(p.batch, p.chunk);
  const int64_t per_token = p.heads * p.units_per_head;
  for (int64_t pair = blockIdx.x; pair < pairs; pair += gridDim.x) {
    const int64_t b = pair / tokens;
    const int64_t t = pair - b * tokens;
    const int32_t start = p.cache_lens[b];
    const int32_t n = p.chunk_lens[b];
    if (!kv_cache_row_in_range(start, n, p.chunk, p.capacity)) {
      if (t == 0 && threadIdx.x == 0 && p.error_flag != nullptr) *p.error_flag = 1;
      continue;  // uniform across the block: every thread sees the same row
    }
    if (t >= n) continue;
    const int64_t pos = int64_t(start) + t;
    const char* k_src = p.k.ptr + b * p.k.stride_b + t * p.k.stride_row;
    const char* v_src = p.v.ptr + b * p.v.stride_b + t * p.v.stride_row;
    char* k_dst = p.k_cache.ptr + b * p.k_cache.stride_b + pos * p.k_cache.stride_row;
    char* v_dst = p.v_cache.ptr + b * p.v_cache.stride_b + pos * p.v_cache.stride_row;
    for (int64_t i = threadIdx.x; i < per_token; i += blockDim.x) {
      const int64_t h = i / p.units_per_head;
      const int64_t u = i - h * p.units_per_head;
      // both loads before both stores, so they are in flight together
      const Unit k_unit = reinterpret_cast<const Unit*>(k_src + h * p.k.stride_head)[u];
      const Unit v_unit = reinterpret_cast<const Unit*>(v_src + h * p.v.stride_head)[u];
      reinterpret_cast<Unit*>(k_dst + h * p.k_cache.stride_head)[u] = k_unit;
      reinterpret_cast<Unit*>(v_dst + h * p.v_cache.stride_head)[u] = v_unit;
    }
  }
}

}  // namespace kernels
}  // namespace lrf
