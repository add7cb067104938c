// Skinny GEMM of the decode forward, y[M, N] = x[M, K] W[N, K]^T for M <= 64 tokens: device code only (no
// torch). The launcher is csrc/linear.cu; the contract and the reference are lightningrl_fast/ops/linear.py.
//
// Why: a denoising step of a batch-1 SDAR model multiplies 4-64 tokens by every weight matrix once, so the step
// is a stream of the weights (SDAR-8B: 15 GB per forward) and its speed is the fraction of the copy bandwidth
// the GEMMs reach. Each weight byte is used M times: no tiling of W through shared memory is needed, only many
// 16-byte loads in flight and few other bytes moved.
//
// Work split:
//  * A warp owns 16 output features (one mma.m16n8k16 A tile, W as the "A" operand: swap-AB) and a slice of K,
//    and every token (NT n-tiles of 8 tokens, NT = 1, 2, 4, 8).
//  * A CTA of 8 warps: fw warps side by side along the features (F = 16 fw features per CTA) times kw = 8 / fw
//    warps along K. Its warps read the same x slices, so x comes from L1 after the first warp: x costs
//    M / F of W's bytes in L2 traffic.
//  * A cluster of `cluster` CTAs (1..8, sm_90 thread-block clusters) splits K further. The grid is
//    ceil(N / F) * cluster CTAs; the launcher's plan (linear_plan) picks the widest F that still fills whole
//    waves of the GPU.
// K is walked in chunks of 32 (two mma k-steps). Lane (g, c) = (lane / 4, lane % 4) loads, per chunk, 16
// contiguous bytes at column 8c of W rows f0+g and f0+g+8 and of x rows 8j+g. Those registers ARE the mma
// fragments: the sum over K does not depend on the order of k, so k is permuted within the chunk the same way
// for A and B (chunk column 8c + 4s + e plays k-step s's logical k 2c + e, and 8c + 4s + 2 + e plays 8 + 2c +
// e). No shared memory and no shuffles in the main loop; W is read with streaming loads (no L1 allocation,
// 256-byte L2 prefetch), in groups of U chunks (linear_unroll), the next group in flight while one is multiplied.
//
// Reduction: each warp stores its 16 x 8NT fp32 partial tile in its CTA's shared memory; after a cluster barrier
// the cluster's threads sum, for each output, the partials of every K slice in one fixed order (rank, then K
// warp) through distributed shared memory and write y rounded to T. Deterministic for a given plan (fw, cluster:
// the launcher's choice for the device): the same inputs give the same bits whatever the scheduling (no atomics);
// another plan splits K differently and may round differently. A second cluster barrier keeps every CTA's shared
// memory alive until all reads of it are done.
//
// Programmatic dependent launch (the launcher's `pdl`): the first groups of W are loaded before
// griddepcontrol.wait, so when the kernel before this one on the stream lets it launch early, the weight stream
// starts while that kernel drains. After its main loop the kernel lets its own successor launch
// (griddepcontrol.launch_dependents), which overlaps that kernel's launch with the reduction. Only reads of W
// come before the wait: x (written by that kernel) and y (its memory may be a block the caching allocator freed
// after that kernel read it) come after. Contract: W must not be written by any grid that may still run when
// this one starts. With the PDL chain (csrc/launch.h) that is more than the kernel just before: the norms,
// silu_mul and the attention signal their successor before their own wait, so the GEMM two kernels back may
// still be storing its output when this one loads W. Weights are written only by plain torch kernels
// (optimizer steps, copies), which end any chain.
//
// Numerics: exact products, fp32-class tensor-core accumulation (mma; its internal rounding of the additions
// is not IEEE round-to-nearest per add), the K slices summed in fp32, rounded once to T at the end, as cuBLAS
// does; the order of the sum differs from torch's, so results agree with F.linear to about one ulp of T.
#pragma once

#include <cstdint>

#include "kernels/warp_ops.cuh"

namespace lrf {
namespace kernels {

constexpr int kLinearThreads = 256;                  // 8 warps
constexpr int kLinearWarps = kLinearThreads / 32;
constexpr int kLinearChunk = 32;                     // K elements per warp step: two mma k-steps
constexpr int kLinearMaxTokens = 64;                 // NT = 8 n-tiles of 8 tokens
constexpr int kLinearMaxCluster = 8;                 // the portable cluster size

struct LinearParams {
  const void* x;      // [m, k] 16-bit, rows x_stride elements apart, 16-byte aligned
  const void* w;      // [n, k] 16-bit, rows w_stride elements apart, 16-byte aligned
  void* y;            // [m, n] dense, 4-byte aligned
  int32_t m, n, k;    // m <= 8 NT, k a multiple of 8
  int64_t x_stride, w_stride;
  int32_t fw;         // warps along the features per CTA: 1, 2, 4 or 8 (F = 16 fw features per CTA)
  int32_t cluster;    // CTAs per cluster along K: 1..8; grid = ceil(n / F) * cluster
};

struct LinearPlan {
  int fw;
  int cluster;
  int64_t ctas;
};

// Index of cluster size cl (1, 2, 4, 8) in a per-cluster-size table.
constexpr int linear_cluster_index(int cl) { return cl >= 8 ? 3 : cl >= 4 ? 2 : cl >= 2 ? 1 : 0; }

// The launch shape for n features and k inputs. slots[i]: CTAs resident at once with clusters of 2^i CTAs (the
// launcher asks cudaOccupancyMaxActiveClusters: a cluster must fit in one GPC, so on a GPU whose GPCs have SM
// counts that are not multiples of the cluster's footprint fewer than SMs x 2 slots are usable); 0 = that size
// cannot launch. A grid of `ctas` runs in ceil(ctas / slots) waves, the last one possibly partial: its
// efficiency is ctas / (waves x slots) (a partial last wave has fewer weight bytes in flight). The plan is the
// widest feature tile (least x traffic) whose best cluster size reaches 90% efficiency, with at least one
// 32-column chunk per warp; when none does (small n and k), the most efficient shape, the widest on ties.
inline LinearPlan linear_plan(int64_t n, int64_t k, const int64_t (&slots)[4]) {
  const int64_t chunks = (k + kLinearChunk - 1) / kLinearChunk;
  LinearPlan best{1, 1, (n + 15) / 16};
  double best_eff = -1.0;
  for (int fw = kLinearWarps; fw >= 1; fw /= 2) {
    const int64_t tiles = (n + 16 * fw - 1) / (16 * fw);
    const int kw = kLinearWarps / fw;
    LinearPlan mine{fw, 1, tiles};
    double mine_eff = -1.0;
    for (int cl = 1; cl <= kLinearMaxCluster; cl *= 2) {
      const int64_t sl = slots[linear_cluster_index(cl)];
      if (sl <= 0 || (cl > 1 && chunks < int64_t(cl) * kw)) continue;
      const int64_t ctas = tiles * cl;
      const int64_t waves = (ctas + sl - 1) / sl;
      const double eff = double(ctas) / double(waves * sl);
      if (eff > mine_eff + 1e-9) mine = LinearPlan{fw, cl, ctas}, mine_eff = eff;
    }
    if (mine_eff >= 0.9) return mine;
    if (mine_eff > best_eff + 1e-9) best = mine, best_eff = mine_eff;
  }
  return best;
}

// Slots of an ideal GPU of `num_sms` SMs, 2 CTAs each, clusters up to `max_cluster` anywhere (tests, emulator).
inline void linear_ideal_slots(int num_sms, int max_cluster, int64_t (&slots)[4]) {
  for (int i = 0; i < 4; ++i) slots[i] = (1 << i) <= max_cluster ? int64_t(num_sms) * 2 : 0;
}

// W chunks a warp loads per group: 4 (128 bytes per thread) up to 16 tokens, 2 at 32 and 64 tokens. Up to 32
// tokens the loop keeps two groups in registers (the next group's loads are issued before the current group's
// math), so a warp always has one to two groups in flight; more spills at 128 registers (2 CTAs of 256 threads
// per SM). In flight per SM: 16 warps x 4-8 KB, above the ~25 KB per SM that H100's bandwidth-latency product
// asks.
template <int NT>
constexpr int linear_unroll() {
  return NT >= 4 ? 2 : 4;
}

// Whether the next group is loaded before the current group's math (two groups in registers). At 64 tokens
// the accumulators leave no room (ptxas spills even with one chunk per group): one group of 2 chunks, loaded
// after the math of the previous one (the x loads of 64 tokens keep the warp's memory pipe busy meanwhile).
template <int NT>
constexpr bool linear_prefetch() {
  return NT < 8;
}

// Shared memory of one CTA: the partial tiles of its 8 warps, [kw][8 NT tokens][F features] fp32.
constexpr int linear_smem_bytes(int nt) { return kLinearWarps * 16 * 8 * nt * 4; }

template <typename T, int NT>
LRF_DEVICE void linear_cta(const LinearParams& p, int64_t block, int tid, float* part) {
  constexpr int U = linear_unroll<NT>();
  constexpr int MP = 8 * NT;  // token rows of a partial tile
  const int lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, c = lane % 4;
  const int fw = p.fw, kw = kLinearWarps / fw, F = 16 * fw;
  const int rank = p.cluster > 1 ? cluster_ctarank() : 0;
  const int64_t tile = block / p.cluster;
  const int fwarp = warp % fw, kwarp = warp / fw;
  const int64_t f0 = tile * F + 16 * fwarp;  // the warp's first feature
  const int64_t chunks = (p.k + kLinearChunk - 1) / kLinearChunk;
  const int64_t slices = int64_t(p.cluster) * kw, slice = int64_t(rank) * kw + kwarp;
  const int64_t lo = slice * chunks / slices, hi = (slice + 1) * chunks / slices;

  const uint16_t* X = static_cast<const uint16_t*>(p.x);
  const uint16_t* W = static_cast<const uint16_t*>(p.w);
  const bool v_lo = f0 + g < p.n, v_hi = f0 + g + 8 < p.n;
  const uint16_t* w_lo = W + (v_lo ? f0 + g : 0) * p.w_stride + 8 * c;
  const uint16_t* w_hi = W + (v_hi ? f0 + g + 8 : 0) * p.w_stride + 8 * c;
  const U128 zero{0u, 0u, 0u, 0u};

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  // Group loads: U chunks of W rows f0+g and f0+g+8 from chunk ch (zeros past `hi`, the last column or N).
  auto load_group = [&](int64_t ch, U128 (&wl)[U], U128 (&wh)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t kk = (ch + u) * kLinearChunk;
      const bool in = ch + u < hi && kk + 8 * c < p.k;
      wl[u] = in && v_lo ? ld_stream_16(w_lo + kk) : zero;
      wh[u] = in && v_hi ? ld_stream_16(w_hi + kk) : zero;
    }
  };
  U128 wl[U], wh[U];
  load_group(lo, wl, wh);
  // griddepcontrol.wait (x is the previous kernel's output; a no-op without programmatic serialization) is
  // issued inside the first iteration, after the first groups' loads: ptxas hoists a wait that sits in
  // straight-line code above every load (moving it earlier is always legal), which loses the PDL prefetch.
  bool waited = false;
  for (int64_t ch = lo; ch < hi; ch += U) {
    U128 nl[U], nh[U];
    if constexpr (linear_prefetch<NT>()) load_group(ch + U, nl, nh);  // streams in while this group is multiplied
    if (!waited) {
      griddep_wait();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      // (an early exit keeps the x loads one chunk at a time: they hit L1 after the CTA's first warp, and
      // with 16 warps per SM each warp has ~1000 cycles per chunk at full bandwidth; issuing them together spills)
      if (ch + u >= hi) break;  // warp-uniform
      const int64_t kk = (ch + u) * kLinearChunk + 8 * c;
      const bool k_in = kk < p.k;
      const uint32_t a0[4] = {wl[u].x, wh[u].x, wl[u].y, wh[u].y};  // k-step 0: chunk columns 8c .. 8c+3
      const uint32_t a1[4] = {wl[u].z, wh[u].z, wl[u].w, wh[u].w};  // k-step 1: chunk columns 8c+4 .. 8c+7
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int t = 8 * j + g;
        const U128 xv = k_in && t < p.m ? ld_global_16(X + t * p.x_stride + kk) : zero;
        mma_16816<T>(acc[j], a0, xv.x, xv.y);
        mma_16816<T>(acc[j], a1, xv.z, xv.w);
      }
    }
    if constexpr (linear_prefetch<NT>()) {
#pragma unroll
      for (int u = 0; u < U; ++u) wl[u] = nl[u], wh[u] = nh[u];
    } else if (ch + U < hi) {
      load_group(ch + U, wl, wh);
    }
  }
  if (!waited) griddep_wait();  // a warp without chunks: nothing is written before the previous kernel is done
  // This warp has read all its weights: the kernel after this one (a norm, silu_mul or the attention, launched
  // with programmatic serialization: csrc/launch.h) may become resident once every CTA got here, during the
  // reduction; it waits for this grid's completion before it reads y.
  griddep_launch_dependents();

  // The warp's partial tile: acc[j] = (feature g | g + 8, tokens 8j + 2c, 8j + 2c + 1).
  float* mine = part + size_t(kwarp) * MP * F + 16 * fwarp;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int t = 8 * j + 2 * c;
    mine[t * F + g] = acc[j][0];
    mine[(t + 1) * F + g] = acc[j][1];
    mine[t * F + g + 8] = acc[j][2];
    mine[(t + 1) * F + g + 8] = acc[j][3];
  }
  warp_sync();
  if (p.cluster > 1) cluster_sync(); else block_sync();

  // Outputs (token t, features f, f + 1 of the tile), split over the cluster's threads; the sum runs over the
  // K slices in order: rank 0's kw warps, then rank 1's, ...
  uint16_t* Y = static_cast<uint16_t*>(p.y);
  const int pairs = F / 2;
  const int total = p.m * pairs;  // <= 64 x 64
  for (int e = rank * kLinearThreads + tid; e < total; e += p.cluster * kLinearThreads) {
    const int t = e / pairs, f = 2 * (e % pairs);
    const int64_t col = tile * F + f;
    if (col >= p.n) continue;
    float s0 = 0.0f, s1 = 0.0f;
    for (int r = 0; r < p.cluster; ++r) {
      const float* src = p.cluster > 1 ? cluster_map(part, r) : part;
      for (int kv = 0; kv < kw; ++kv) {
        float v[2];
        ld_generic_f32x2(src + (size_t(kv) * MP + t) * F + f, v);
        s0 += v[0];
        s1 += v[1];
      }
    }
    const uint32_t packed = pack2<T>(s0, s1);
    uint16_t* dst = Y + int64_t(t) * p.n + col;
    if (p.n % 2 == 0) {
      st_global_u32(dst, packed);
    } else {
      st_global_u16(dst, static_cast<uint16_t>(packed & 0xffffu));
      if (col + 1 < p.n) st_global_u16(dst + 1, static_cast<uint16_t>(packed >> 16));
    }
  }
  if (p.cluster > 1) {
    warp_sync();
    cluster_sync_relaxed();  // no CTA exits while another still reads its shared memory (nothing to publish)
  }
}

#if !defined(LRF_KERNEL_EMULATION)
template <typename T, int NT>
__global__ void __launch_bounds__(kLinearThreads, 2) linear_kernel(const LinearParams p) {
  extern __shared__ __align__(16) float linear_smem[];
  linear_cta<T, NT>(p, blockIdx.x, threadIdx.x, linear_smem);
}
#endif

}  // namespace kernels
}  // namespace lrf
