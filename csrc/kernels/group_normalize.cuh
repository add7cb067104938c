// Group normalization of rewards (LightningRL advantages): device code only (no torch).
// The launcher is csrc/grpo_loss.cu; the contract is ARCHITECTURE.md / ops/grpo_loss.py.
//
// rewards [S, R] + group_ids [S] (arbitrary int64) + weights [R] -> advantages [S]:
//   decoupled: per reward column, z-score within the group (population std, 0 where std == 0), weighted sum;
//   sum:       weighted sum of the raw columns, then the group z-score;
//   then the batch z-score (std floored at 1e-8). All arithmetic in double.
//
// One CTA of kThreads threads does everything (S is a batch of samples: hundreds to tens of thousands), so
// there is no host sync and no second launch; the phases are separated by __syncthreads:
//   0. clear the hash table and the per-slot counters (global workspace, cap = power of two >= 2 S);
//   1. insert every sample into an open-addressing hash table keyed by its group id (linear probing;
//      a slot holds the index of the first sample that claimed it, keys are compared through group_ids,
//      so every int64 value is a valid id: no sentinel key). slot[i] = the group's slot; count[slot]++;
//   2. offset = exclusive scan of count over the slots;
//   3. stable counting sort by slot: tiles of kThreads samples in index order, each tile sorted by slot with
//      cub::BlockRadixSort (stable), the rank within a run of equal slots gives the position. So each group's
//      members lie at order[offset[h] : offset[h] + count[h]] in increasing sample index;
//   4. group statistics, summed in that fixed order (a thread per small group, a warp per large group with a
//      fixed lane split and an xor-butterfly): deterministic, bitwise reproducible run to run;
//   5. batch mean / std over the per-sample totals (fixed-order block reduction), then the output.
// Means are computed shifted by the group's first value (mean = x0 + sum(x - x0) / n), so a group whose values
// are all equal has deviations of exactly 0 and std exactly 0 (z = 0), whatever the rounding of its mean;
// the batch mean is shifted by the first total the same way. The PyTorch reference does the same.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#ifdef LRF_KERNEL_EMULATION
#include "emu/cub_block.h"  // host stand-ins of the two cub collectives (CPU emulator, csrc/emu)
#else
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#endif

#include <cstdint>

namespace lrf {
namespace kernels {

constexpr int kGroupNormThreads = 1024;
constexpr int kGroupNormWarpMin = 33;  // groups with at least this many members are reduced by a warp

template <typename T>
struct GroupNormalizeParams {
  const T* rewards;         // [S, R], row-major contiguous
  const int64_t* group_ids; // [S]
  const double* weights;    // [R]
  void* out;                // [S] float (out_double == false) or double
  bool out_double;
  bool decoupled;
  int64_t samples;          // S
  int64_t rewards_per;      // R
  int64_t cap;              // hash capacity, power of two >= 2 S
  // workspace (global, uninitialized on entry)
  int32_t* table;           // [cap] -1 or the index of the sample that claimed the slot
  int32_t* count;           // [cap] members per slot
  int32_t* offset;          // [cap] exclusive scan of count
  int32_t* cursor;          // [cap] members already placed (sort)
  int32_t* slot;            // [S] slot of each sample
  int32_t* order;           // [S] samples sorted by (slot, index)
  double* total;            // [S] per-sample total before the batch z-score
};

struct MaxOp {
  __device__ __forceinline__ int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; }
};

__device__ __forceinline__ uint64_t group_hash(int64_t key) {  // splitmix64 finalizer
  uint64_t x = static_cast<uint64_t>(key);
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

__device__ __forceinline__ double gn_double(__nv_bfloat16 x) { return static_cast<double>(__bfloat162float(x)); }
__device__ __forceinline__ double gn_double(__half x) { return static_cast<double>(__half2float(x)); }
__device__ __forceinline__ double gn_double(float x) { return static_cast<double>(x); }
__device__ __forceinline__ double gn_double(double x) { return x; }

template <typename T>
__device__ __forceinline__ double gn_value(const GroupNormalizeParams<T>& p, int64_t i, int64_t col) {
  const T* row = p.rewards + i * p.rewards_per;
  if (p.decoupled) return gn_double(row[col]);
  double v = 0.0;  // "sum": weighted sum of the raw rewards, columns in order
  for (int64_t j = 0; j < p.rewards_per; ++j) v += p.weights[j] * gn_double(row[j]);
  return v;
}

// z-scores of column `col` of one group, members order[b : b + n], done by one thread. Adds w * z into total
// (first column: assigns).
template <typename T>
__device__ void gn_group_thread(const GroupNormalizeParams<T>& p, int32_t b, int32_t n, int64_t col, double w,
                                bool first) {
  const int32_t* mem = p.order + b;
  const double shift = gn_value(p, mem[0], col);
  double s = 0.0;
  for (int32_t k = 0; k < n; ++k) s += gn_value(p, mem[k], col) - shift;
  const double mean = shift + s / n;
  double q = 0.0;
  for (int32_t k = 0; k < n; ++k) {
    const double d = gn_value(p, mem[k], col) - mean;
    q += d * d;
  }
  const double sd = sqrt(q / n);
  for (int32_t k = 0; k < n; ++k) {
    const double z = sd > 0.0 ? (gn_value(p, mem[k], col) - mean) / sd : 0.0;
    p.total[mem[k]] = first ? w * z : p.total[mem[k]] + w * z;
  }
}

__device__ __forceinline__ double warp_sum_xor(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;  // every lane holds the same bits (each level adds the same two operands, commuted)
}

// The same for a large group, done by one warp: lane l takes members l, l + 32, ... in order.
template <typename T>
__device__ void gn_group_warp(const GroupNormalizeParams<T>& p, int32_t b, int32_t n, int64_t col, double w,
                              bool first, int lane) {
  const int32_t* mem = p.order + b;
  const double shift = gn_value(p, mem[0], col);
  double s = 0.0;
  for (int32_t k = lane; k < n; k += 32) s += gn_value(p, mem[k], col) - shift;
  const double mean = shift + warp_sum_xor(s) / n;
  double q = 0.0;
  for (int32_t k = lane; k < n; k += 32) {
    const double d = gn_value(p, mem[k], col) - mean;
    q += d * d;
  }
  const double sd = sqrt(warp_sum_xor(q) / n);
  for (int32_t k = lane; k < n; k += 32) {
    const double z = sd > 0.0 ? (gn_value(p, mem[k], col) - mean) / sd : 0.0;
    p.total[mem[k]] = first ? w * z : p.total[mem[k]] + w * z;
  }
}

// Fixed-order block sum of per-thread partials: every thread gets the same result.
__device__ __forceinline__ double gn_block_sum(double v, double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum_xor(v);
  __syncthreads();  // `red` may still be read from a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < kGroupNormThreads / 32 ? red[lane] : 0.0;
  return warp_sum_xor(v);
}

template <typename T>
__global__ void __launch_bounds__(kGroupNormThreads) group_normalize_kernel(const GroupNormalizeParams<T> p) {
  using Sort = cub::BlockRadixSort<uint32_t, kGroupNormThreads, 1, int32_t>;
  using Scan = cub::BlockScan<int32_t, kGroupNormThreads>;
  __shared__ union {
    typename Sort::TempStorage sort;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ uint32_t sorted_slot[kGroupNormThreads];
  __shared__ int32_t carry;
  __shared__ double red[kGroupNormThreads / 32];

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int64_t S = p.samples;
  const int64_t mask = p.cap - 1;

  // 0. clear
  for (int64_t h = tid; h < p.cap; h += kGroupNormThreads) {
    p.table[h] = -1;
    p.count[h] = 0;
    p.cursor[h] = 0;
  }
  __syncthreads();

  // 1. hash insert
  for (int64_t i = tid; i < S; i += kGroupNormThreads) {
    const int64_t key = p.group_ids[i];
    int64_t h = static_cast<int64_t>(group_hash(key) & static_cast<uint64_t>(mask));
    while (true) {
      const int32_t owner = atomicCAS(&p.table[h], -1, static_cast<int32_t>(i));
      if (owner == -1 || p.group_ids[owner] == key) break;  // claimed it, or it is this group's slot
      h = (h + 1) & mask;
    }
    p.slot[i] = static_cast<int32_t>(h);
    atomicAdd(&p.count[h], 1);
  }
  __syncthreads();

  // 2. offset = exclusive scan of count (tiles with a carry)
  if (tid == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < p.cap; base += kGroupNormThreads) {
    const int64_t h = base + tid;
    const int32_t c = h < p.cap ? p.count[h] : 0;
    int32_t ex, agg;
    Scan(tmp.scan).ExclusiveSum(c, ex, agg);
    if (h < p.cap) p.offset[h] = carry + ex;
    __syncthreads();
    if (tid == 0) carry += agg;
    __syncthreads();
  }

  // 3. stable counting sort by slot, tile by tile in sample order
  int bits = 1;
  while ((int64_t(1) << bits) <= p.cap) ++bits;  // keys 0..cap (cap = padding of the last tile)
  for (int64_t base = 0; base < S; base += kGroupNormThreads) {
    const int64_t i = base + tid;
    uint32_t key[1] = {static_cast<uint32_t>(i < S ? p.slot[i] : p.cap)};
    int32_t val[1] = {static_cast<int32_t>(i < S ? i : 0)};
    __syncthreads();  // tmp is reused
    Sort(tmp.sort).Sort(key, val, 0, bits);  // thread tid now holds the tid-th (slot, index) of the tile
    sorted_slot[tid] = key[0];
    __syncthreads();
    const int32_t head = (tid == 0 || sorted_slot[tid - 1] != key[0]) ? tid : 0;
    int32_t run_start;
    __syncthreads();
    Scan(tmp.scan).InclusiveScan(head, run_start, MaxOp{});
    const bool valid = int64_t(key[0]) < p.cap;
    const bool run_end = tid == kGroupNormThreads - 1 || sorted_slot[tid + 1] != key[0];
    int32_t placed = 0;
    if (valid) {
      placed = p.cursor[key[0]];
      p.order[p.offset[key[0]] + placed + (tid - run_start)] = val[0];
    }
    __syncthreads();  // every thread of the tile has read cursor before the run ends update it
    if (valid && run_end) p.cursor[key[0]] = placed + (tid - run_start) + 1;
    __syncthreads();
  }

  // 4. group statistics -> total[i]
  const int64_t ncols = p.decoupled ? p.rewards_per : 1;
  for (int64_t h = tid; h < p.cap; h += kGroupNormThreads) {  // small groups: a thread each
    const int32_t n = p.count[h];
    if (n == 0 || n >= kGroupNormWarpMin) continue;
    for (int64_t c = 0; c < ncols; ++c) gn_group_thread(p, p.offset[h], n, c, p.decoupled ? p.weights[c] : 1.0, c == 0);
  }
  for (int64_t h = warp; h < p.cap; h += kGroupNormThreads / 32) {  // large groups: a warp each
    const int32_t n = p.count[h];
    if (n < kGroupNormWarpMin) continue;
    for (int64_t c = 0; c < ncols; ++c) {
      gn_group_warp(p, p.offset[h], n, c, p.decoupled ? p.weights[c] : 1.0, c == 0, lane);
      __syncwarp();
    }
  }
  __syncthreads();

  // 5. batch z-score
  const double t0 = p.total[0];
  double part = 0.0;
  for (int64_t i = tid; i < S; i += kGroupNormThreads) part += p.total[i] - t0;
  const double mean = t0 + gn_block_sum(part, red) / static_cast<double>(S);
  part = 0.0;
  for (int64_t i = tid; i < S; i += kGroupNormThreads) {
    const double d = p.total[i] - mean;
    part += d * d;
  }
  const double sd = fmax(sqrt(gn_block_sum(part, red) / static_cast<double>(S)), 1e-8);
  for (int64_t i = tid; i < S; i += kGroupNormThreads) {
    const double a = (p.total[i] - mean) / sd;
    if (p.out_double) {
      static_cast<double*>(p.out)[i] = a;
    } else {
      static_cast<float*>(p.out)[i] = static_cast<float>(a);
    }
  }
}

}  // namespace kernels
}  // namespace lrf
