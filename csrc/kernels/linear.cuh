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
//    ceil(N / F) * cluster CTAs; the launcher's plan (linear_plan) picks the widest F that still fills the GPU.
// K is walked in chunks of 32 (two mma k-steps). Lane (g, c) = (lane / 4, lane % 4) loads, per chunk, 16
// contiguous bytes at column 8c of W rows f0+g and f0+g+8 and of x rows 8j+g. Those registers ARE the mma
// fragments: the sum over K does not depend on the order of k, so k is permuted within the chunk the same way
// for A and B (chunk column 8c + 4s + e plays k-step s's logical k 2c + e, and 8c + 4s + 2 + e plays 8 + 2c +
// e). No shared memory and no shuffles in the main loop; W is read with streaming loads (no L1 allocation,
// 256-byte L2 prefetch), U chunks (8, 4 or 2 as NT grows) in flight per warp.
//
// Reduction: each warp stores its 16 x 8NT fp32 partial tile in its CTA's shared memory; after a cluster barrier
// the cluster's threads sum, for each output, the partials of every K slice in one fixed order (rank, then K
// warp) through distributed shared memory and write y rounded to T. Deterministic: the same inputs give the same
// bits whatever the scheduling (no atomics). A second cluster barrier keeps every CTA's shared memory alive until
// all reads of it are done.
//
// Programmatic dependent launch (p.pdl): the first U chunks of W are loaded before griddepcontrol.wait, so when
// the kernel before this one on the stream lets it launch early, the weight stream starts while that kernel
// drains. Only reads of W come before the wait: x (written by that kernel) and y (its memory may be a block the
// caching allocator freed after that kernel read it) come after. Contract: W must not be written by the kernel
// launched just before this one.
//
// Numerics: fp32 products and sums (mma), rounded once to T at the end, like cuBLAS; the order of the sum
// differs from torch's, so results agree with it to fp32 rounding before the final rounding.
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
  int32_t pdl;        // launched with programmatic stream serialization: prefetch W before griddepcontrol.wait
};

struct LinearPlan {
  int fw;
  int cluster;
  int64_t ctas;
};

// The launch shape for n features and k inputs on `num_sms` SMs (2 CTAs resident per SM): the widest feature
// tile (least x traffic) whose grid reaches 90% of one wave, splitting K over at most `max_cluster` CTAs, with
// at least one 32-column chunk per warp; when no shape reaches it (small n and k), the one with the most CTAs.
inline LinearPlan linear_plan(int64_t n, int64_t k, int num_sms, int max_cluster) {
  const int64_t chunks = (k + kLinearChunk - 1) / kLinearChunk;
  const int64_t want = (int64_t(num_sms) * 2 * 9 + 9) / 10;
  LinearPlan best{1, 1, (n + 15) / 16};
  int64_t best_fill = -1;
  for (int fw = kLinearWarps; fw >= 1; fw /= 2) {
    const int64_t tiles = (n + 16 * fw - 1) / (16 * fw);
    const int kw = kLinearWarps / fw;
    for (int cl = 1; cl <= max_cluster; cl *= 2) {
      if (cl > 1 && chunks < int64_t(cl) * kw) break;
      const int64_t ctas = tiles * cl;
      const int64_t fill = ctas < want ? ctas : want;
      if (fill > best_fill) best = LinearPlan{fw, cl, ctas}, best_fill = fill;
      if (ctas >= want) break;
    }
    if (best_fill >= want) break;
  }
  return best;
}

// A warp's W chunks in flight: 8 (256 bytes per thread) up to 16 tokens, 4 at 32, 2 at 64: the accumulators
// and x fragments need the registers (2 CTAs of 256 threads per SM leave 128 per thread; more spills, ptxas). Even 2
// keep 32 KB of weights in flight per SM, above the ~25 KB per SM that H100's bandwidth-latency product asks.
template <int NT>
constexpr int linear_unroll() {
  return NT >= 8 ? 2 : NT >= 4 ? 4 : 8;
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

  bool waited = false;
  for (int64_t ch = lo; ch < hi; ch += U) {
    U128 wl[U], wh[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t kk = (ch + u) * kLinearChunk;
      const bool in = ch + u < hi && kk + 8 * c < p.k;
      wl[u] = in && v_lo ? ld_stream_16(w_lo + kk) : zero;
      wh[u] = in && v_hi ? ld_stream_16(w_hi + kk) : zero;
    }
    if (!waited) {  // x is the previous kernel's output (a no-op without programmatic serialization)
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
  }
  if (!waited) griddep_wait();  // nothing is written before the previous kernel is complete

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
  const int64_t total = int64_t(p.m) * pairs;
  for (int64_t e = int64_t(rank) * kLinearThreads + tid; e < total; e += int64_t(p.cluster) * kLinearThreads) {
    const int t = static_cast<int>(e / pairs), f = 2 * static_cast<int>(e % pairs);
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
    cluster_sync();  // no CTA exits while another still reads its shared memory
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
