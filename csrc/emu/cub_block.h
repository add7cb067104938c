// Host stand-ins of the two cub block collectives that kernels/group_normalize.cuh uses, for the CPU emulator
// (cuda_builtins.h front-end): cub::BlockRadixSort<Key, kThreads, 1, Value>::Sort and cub::BlockScan<T, kThreads>
// ::ExclusiveSum / InclusiveScan. Test support only; the CUDA build includes the real cub headers.
//
// They keep cub's contract, not its algorithm: every thread of the CTA calls the collective with one item; the
// call is a block barrier (all threads must reach it: the emulator aborts otherwise); its TempStorage lives in
// the kernel's __shared__ memory and may be reused only after a __syncthreads() that follows the call, as cub
// requires (no trailing barrier here: a kernel that reuses it early races, as on the device).
//   Sort(keys, values, begin_bit, end_bit): a stable sort by key bits [begin_bit, end_bit) into the blocked
//     arrangement (thread t receives the t-th smallest (key, value)); keys keep all their bits.
//   ExclusiveSum(x, out, aggregate), InclusiveScan(x, out, op): prefix over thread order.
#pragma once

#include <cstdint>

#include "emu/emu_core.h"

namespace lrf::emu {
// Barrier kinds (compared by address: a thread at one of these and another at a __syncthreads is a divergence).
inline constexpr char kCubSortLoad[] = "cub::BlockRadixSort (stand-in) load";
inline constexpr char kCubSortExchange[] = "cub::BlockRadixSort (stand-in) exchange";
inline constexpr char kCubScan[] = "cub::BlockScan (stand-in)";
}  // namespace lrf::emu

namespace cub {

template <typename Key, int kThreads, int kItems, typename Value>
class BlockRadixSort {
  static_assert(kItems == 1, "the stand-in handles one item per thread");

 public:
  struct TempStorage {
    Key key[kThreads];
    Value value[kThreads];
    Key out_key[kThreads];
    Value out_value[kThreads];
  };

  explicit BlockRadixSort(TempStorage& s) : s_(s) {}

  void Sort(Key (&key)[1], Value (&value)[1], int begin_bit = 0, int end_bit = int(sizeof(Key) * 8)) {
    check_threads();
    const int t = lrf::emu::tid();
    s_.key[t] = key[0];
    s_.value[t] = value[0];
    lrf::emu::block_barrier(lrf::emu::kCubSortLoad);
    const int span = end_bit - begin_bit;
    const uint64_t mask = span >= 64 ? ~uint64_t(0) : (uint64_t(1) << span) - 1;
    auto bits = [&](Key k) { return (uint64_t(k) >> begin_bit) & mask; };
    const uint64_t mine = bits(key[0]);
    int rank = 0;  // stable: smaller keys, then equal keys of lower threads
    for (int j = 0; j < kThreads; ++j) {
      const uint64_t other = bits(s_.key[j]);
      rank += other < mine || (other == mine && j < t);
    }
    s_.out_key[rank] = key[0];
    s_.out_value[rank] = value[0];
    lrf::emu::block_barrier(lrf::emu::kCubSortExchange);
    key[0] = s_.out_key[t];
    value[0] = s_.out_value[t];
  }

 private:
  static void check_threads() {
    if (lrf::emu::nthreads() != kThreads) lrf::emu::fail("cub::BlockRadixSort: block size differs from kThreads");
  }
  TempStorage& s_;
};

template <typename T, int kThreads>
class BlockScan {
 public:
  struct TempStorage {
    T v[kThreads];
  };

  explicit BlockScan(TempStorage& s) : s_(s) {}

  void ExclusiveSum(T x, T& out, T& aggregate) {
    const int t = publish(x);
    T acc = T(0), all = T(0);
    for (int j = 0; j < kThreads; ++j) {
      if (j < t) acc = acc + s_.v[j];
      all = all + s_.v[j];
    }
    out = acc;
    aggregate = all;
  }

  template <typename Op>
  void InclusiveScan(T x, T& out, Op op) {
    const int t = publish(x);
    T acc = s_.v[0];
    for (int j = 1; j <= t; ++j) acc = op(acc, s_.v[j]);
    out = acc;
  }

 private:
  int publish(T x) {
    if (lrf::emu::nthreads() != kThreads) lrf::emu::fail("cub::BlockScan: block size differs from kThreads");
    const int t = lrf::emu::tid();
    s_.v[t] = x;
    lrf::emu::block_barrier(lrf::emu::kCubScan);
    return t;
  }
  TempStorage& s_;
};

}  // namespace cub
