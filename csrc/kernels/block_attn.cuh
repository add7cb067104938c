// Block-causal attention of a chunk against a per-row KV cache: device code only (no torch).
// The launcher is csrc/block_attn.cu; the contract is ARCHITECTURE.md (block_attention).
//
// Mask. Query i of row b (i < n = chunk_lens[b], absolute position p = cl + i, cl = cache_lens[b]) sees
// key position t iff t < kend(i) = min(cl + n, (p / block_size + 1) * block_size): every cached key is
// before p's block, and a chunk key j is visible iff its block is <= p's block. Rows i >= n are zero.
//
// Work decomposition. GQA packing: the G = Hq / Hkv query heads of one kv head are the rows of one
// matrix, token-major (row r = i * G + g), so one K/V tile in shared memory serves all G heads and the
// rows' key limits kend grow with r. A CTA (4 warps, 16 rows each) owns BM = 64 rows of one (b, kv head)
// and one "split" of the key range [0, kv_end), kv_end = the largest kend of its rows. With S splits,
// split s takes tiles [s * T / S, (s + 1) * T / S) of the T = ceil(kv_end / BN) key tiles, decided on
// the device from the lengths (no host reads). S == 1 writes the output directly; S > 1 writes a
// normalized fp32 partial output and its log2-sum-exp per row, merged by block_attn_combine.
//
// Key source. Keys t < cl come from the cache, keys cl <= t < cl + n straight from the chunk's k/v
// inputs: the cache write (done by the same launch, spread over the CTAs of each (b, kv head)) is never
// read back, so there is no ordering between CTAs. A row whose lengths are out of range
// (block_attn_row_in_range) writes nothing to the cache and outputs zeros.
//
// Per tile (BN = 64 keys): cp.async 16-byte copies into a 3-stage ring of XOR-swizzled shared tiles
// (K and V, zero-filled past kv_end; two tiles in flight while one is computed), S = Q K^T with mma.sync m16n8k16 (Q fragments kept in registers,
// K fragments by ldmatrix), scale, block-causal mask only on tiles that reach a row's kend, online
// softmax in fp32 (exp2, row max/sum over the 4 lanes of a quad), P re-packed from the S accumulators
// as the A operand of O += P V (V fragments by ldmatrix.trans).
//
// Two variants of the same CTA (template flag WG):
//   mma.sync (WG = false): each warp computes its 16 rows alone; a warp whose rows are all empty skips the
//     math. Tiles in shared memory: [rows][D] with 16-byte chunk c of a row stored at c ^ (row % 8).
//   wgmma (WG = true, sm_90a): the CTA's 4 warps are one warpgroup and each tile product is a warpgroup
//     wgmma.mma_async with A (Q, then P) in registers and B (K, then V) read from shared memory through
//     descriptors: S = Q K^T is m64n64k16 x D/16 with K "K-major", O += P V is m64nDk16 x BN/16 with V
//     "MN-major". The tiles use the 128-byte-swizzled canonical GMMA layout: D/64 column blocks of
//     [rows][64 elements], chunk c (< 8) of a row at c ^ (row % 8), 1024-byte aligned. Every warp runs the
//     math (wgmma is warpgroup-collective); the accumulator fragments equal mma.sync's, so the masking,
//     softmax and epilogue are shared. cp.async writes reach wgmma's async-proxy reads through
//     fence.proxy.async before the barrier that publishes a tile.
#pragma once

#include <cstdint>

#include "warp_ops.cuh"

namespace lrf {
namespace kernels {

// A [B, rows, H, D] tensor as bytes: base pointer and the byte strides of its first three dims (last dim dense).
struct AttnTensor {
  char* ptr;
  int64_t stride_b;
  int64_t stride_row;
  int64_t stride_head;
};

// The kv_cache_write rule (kernels/kv_cache.cuh): a row whose lengths are out of range writes nothing.
LRF_DEVICE bool block_attn_row_in_range(int32_t start, int32_t n, int64_t chunk, int64_t capacity) {
  return start >= 0 && n >= 0 && n <= chunk && int64_t(start) + int64_t(n) <= capacity;
}

struct BlockAttnParams {
  AttnTensor q;        // [B, C, Hq, D], read
  AttnTensor k;        // [B, C, Hkv, D], read
  AttnTensor v;        // [B, C, Hkv, D], read
  AttnTensor k_cache;  // [B, L, Hkv, D], chunk rows written, rows < cache_lens read
  AttnTensor v_cache;  // [B, L, Hkv, D]
  char* out;         // [B, C, Hq, D] contiguous, q's dtype
  float* o_part;     // [S, B * C * Hq, D] normalized partial outputs (S > 1 only)
  float* lse_part;   // [S, B * C * Hq] log2-sum-exp of the scaled scores, -inf = no key (S > 1 only)
  const int32_t* cache_lens;  // [B]
  const int32_t* chunk_lens;  // [B]
  int batch;       // B
  int chunk;       // C
  int capacity;    // L
  int hq;          // Hq
  int hkv;         // Hkv
  int group;       // G = Hq / Hkv
  int block_size;  // block of the block-causal mask
  int m_rows;      // C * G, rows per (b, kv head)
  int m_tiles;     // ceil(m_rows / BM)
  int num_splits;  // S >= 1
  float scale_log2;  // softmax_scale * log2(e)
};

constexpr int kBlockAttnThreads = 128;  // 4 warps x 16 rows
constexpr int kBlockAttnBM = 64;        // query rows per CTA
constexpr int kBlockAttnBN = 64;        // keys per tile
constexpr int kBlockAttnStages = 3;     // cp.async pipeline depth (K/V tiles in shared memory)
constexpr int kBlockAttnMaxSplits = 64;
constexpr int kBlockAttnCombineWarps = 4;  // rows per combine CTA

// Dynamic shared memory: kBlockAttnStages stages of (K, V) tiles; the Q tile borrows the last stage's K
// slot before the loop starts. D = 128: 96 KB, 2 CTAs per SM (the register file allows 2 as well). The wgmma
// variant takes 1 KB more, to start its tiles at a 1024-byte aligned shared address (the swizzle atom).
__host__ __device__ constexpr int block_attn_smem_bytes(int head_dim, bool wgmma = false) {
  return kBlockAttnStages * 2 * kBlockAttnBN * head_dim * 2 + (wgmma ? 1024 : 0);
}

__host__ __device__ inline int ceil_div_i64(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Number of KV splits, from shapes only (never the lengths: no host sync, CUDA-graph safe).
//   base_ctas     CTAs without splitting (B * Hkv * m_tiles)
//   capacity      cache capacity L: the proxy for the key length
//   rows_per_cta  query rows a CTA really has (min(BM, C * G)): its partial output costs
//                 2 * rows * D * 4 bytes per split (write + read back), against (L / S) * D * 4 of K/V
//   resident      CTAs the device runs at once (SMs x CTAs per SM)
// Split until the grid fills the device once, keeping >= 4 key tiles per split and the partials under
// ~1/4 of the K/V bytes.
inline int block_attn_num_splits(int64_t base_ctas, int64_t capacity, int rows_per_cta, int64_t resident) {
  if (base_ctas <= 0 || base_ctas >= resident) return 1;
  int64_t s = (resident + base_ctas - 1) / base_ctas;
  const int64_t by_len = capacity / (4 * kBlockAttnBN);
  const int64_t by_partial = capacity / (8 * static_cast<int64_t>(rows_per_cta > 0 ? rows_per_cta : 1));
  s = s < by_len ? s : by_len;
  s = s < by_partial ? s : by_partial;
  s = s < kBlockAttnMaxSplits ? s : kBlockAttnMaxSplits;
  return s > 1 ? static_cast<int>(s) : 1;
}

// Key limit of chunk query i (valid row: 0 <= i < n, cl + n <= L): min(cl + n, end of the block of
// position cl + i). 32-bit division: cl + i < L <= INT_MAX - BN (a launcher check).
LRF_DEVICE int block_attn_kend(int32_t cl, int32_t n, int i, int block_size) {
  const uint32_t pos = uint32_t(cl) + uint32_t(i);
  const int64_t block_end = (int64_t(pos / uint32_t(block_size)) + 1) * block_size;
  const int64_t chunk_end = int64_t(cl) + n;
  return static_cast<int>(block_end < chunk_end ? block_end : chunk_end);
}

// Byte offset of 16-byte chunk c of row `row` in a tile of kBlockAttnBN (= BM) rows. mma.sync layout: rows
// of D elements, chunk c at c ^ (row % 8), so the 8 rows an ldmatrix phase reads (and the rows a warp's
// cp.async stores) hit 8 different 16-byte bank groups. wgmma layout (WG): the 128-byte-swizzled canonical
// GMMA layout, column block c / 8 of [rows][128 bytes], chunk c % 8 at (c % 8) ^ (row % 8) (the hardware's
// Swizzle<3,4,3> on a 1024-byte aligned tile). Both keep row + 8k at the same XOR as row.
template <int D, bool WG>
LRF_DEVICE uint32_t block_attn_swz(int row, int c) {
  if constexpr (WG) {
    return static_cast<uint32_t>((c / 8) * (kBlockAttnBN * 128) + row * 128 + (((c % 8) ^ (row & 7)) * 16));
  } else {
    return static_cast<uint32_t>((row * (D / 8) + (c ^ (row & 7))) * 16);
  }
}

// Bytes from row r to row r + 1 within one column block of a tile (block_attn_swz).
template <int D, bool WG>
constexpr uint32_t block_attn_row_bytes() {
  return WG ? 128u : static_cast<uint32_t>(D * 2);
}

// wgmma descriptors of stage tiles (tile = 1024-byte aligned shared address of the tile, block_attn_swz<D, true>):
//   K tile as the B operand of S = Q K^T (N = keys, K = head dim, K-major): k-step ks reads columns 16ks..16ks+15,
//   i.e. column block ks / 4 at byte 32 (ks % 4) of each 128-byte row; 8-row groups 1024 bytes apart.
//   V tile as the B operand of O += P V (K = keys, N = head dim, MN-major): k-step kk reads keys 16kk..16kk+15 =
//   8-row groups 2kk, 2kk + 1 (1024 bytes apart); 64-column blocks BN * 128 bytes apart.
LRF_DEVICE uint64_t block_attn_k_desc(uint32_t tile, int ks) {
  return gmma_desc_sw128(tile + (ks / 4) * (kBlockAttnBN * 128) + (ks % 4) * 32, 16, 1024);
}
LRF_DEVICE uint64_t block_attn_v_desc(uint32_t tile, int kk) {
  return gmma_desc_sw128(tile + kk * 2048, kBlockAttnBN * 128, 1024);
}

// One CTA: `cta` in [0, m_tiles * S * B * Hkv) (< 2^31, a launcher check), m-tile fastest (the CTAs that
// read the same K/V run together), heaviest m-tile first; `tid` in [0, kBlockAttnThreads); `smem` =
// block_attn_smem_bytes(D, WG) bytes, 16-byte aligned.
template <typename T, int D, bool WG>
LRF_DEVICE void block_attn_cta(const BlockAttnParams& p, int64_t cta64, int tid, char* smem) {
  constexpr int BM = kBlockAttnBM, BN = kBlockAttnBN, NT = kBlockAttnThreads, NS = kBlockAttnStages;
  constexpr int RC = D / 8;        // 16-byte chunks per row
  constexpr int KSTEPS = D / 16;   // k-steps of Q K^T
  constexpr int NB = BN / 8;       // 8-key n-blocks of S
  constexpr int DN = D / 8;        // 8-column n-blocks of O
  constexpr int RPI = NT / RC;     // rows per loader pass
  constexpr uint32_t TILE = BN * D * 2;
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(BM == 16 * (NT / 32), "16 rows per warp");
  static_assert(NS >= 2 && BM == BN, "the Q tile borrows one K slot");
  static_assert(!WG || (TILE % 1024 == 0 && BN % 16 == 0), "wgmma tiles: whole 1024-byte swizzle atoms");
  constexpr uint32_t ROWB = block_attn_row_bytes<D, WG>();

  // The combine grid (S > 1) may launch now: it only becomes resident in the space this grid leaves and
  // waits (griddepcontrol.wait) for this whole grid to finish before it reads a partial.
  griddep_launch_dependents();
  // Launched with programmatic serialization (launch.h): the kernel before this one (q/k-norm + RoPE, which
  // writes q and k) may still run. Nothing is read or written before this wait.
  griddep_wait();

  const int warp = tid / 32, lane = tid % 32;
  uint32_t rest = static_cast<uint32_t>(cta64);
  const int mt = static_cast<int>(rest % uint32_t(p.m_tiles));
  rest /= uint32_t(p.m_tiles);
  const int split = static_cast<int>(rest % uint32_t(p.num_splits));
  rest /= uint32_t(p.num_splits);
  const int kvh = static_cast<int>(rest % uint32_t(p.hkv));
  const int b = static_cast<int>(rest / uint32_t(p.hkv));
  const int mtile = p.m_tiles - 1 - mt;
  const int G = p.group;

  const int32_t cl = p.cache_lens[b];
  const int32_t n = p.chunk_lens[b];
  const bool row_ok = block_attn_row_in_range(cl, n, p.chunk, p.capacity);

  // 1. Key range of this CTA: [0, kv_end), kv_end = kend of its last valid row; this split's tiles.
  //    Rows r >= m_rows, rows of queries i >= n and every row of a bad row are "empty": they compute with
  //    kend = kv_end (finite values, discarded) and output zeros / lse = -inf.
  const int r0 = mtile * BM;
  const int r_last = (r0 + BM < p.m_rows ? r0 + BM : p.m_rows) - 1;
  const int i_first = r0 / G;
  const int i_last = r_last / G < n - 1 ? r_last / G : n - 1;
  const int kv_end = (row_ok && i_first < n) ? block_attn_kend(cl, n, i_last, p.block_size) : 0;
  const uint32_t tiles = static_cast<uint32_t>((kv_end + BN - 1) / BN);
  const int t_begin = static_cast<int>(uint32_t(split) * tiles / uint32_t(p.num_splits));
  const int t_end = static_cast<int>(uint32_t(split + 1) * tiles / uint32_t(p.num_splits));

  // Loader geometry: thread tid always moves 16-byte chunk lc of rows lrow + k * RPI (k < BN / RPI), so its
  // swizzled shared offsets are one base plus compile-time steps and its global pointers one base per
  // tensor plus row * stride.
  const int lrow = tid / RC, lc = tid % RC;
  const uint32_t loff = block_attn_swz<D, WG>(lrow, lc);  // (lrow + k * RPI) & 7 == lrow & 7: same XOR
  const uint32_t sbase = WG ? (smem_addr(smem) + 1023u) & ~1023u : smem_addr(smem);
  const char* kc_base = p.k_cache.ptr + b * p.k_cache.stride_b + kvh * p.k_cache.stride_head + lc * 16;
  const char* vc_base = p.v_cache.ptr + b * p.v_cache.stride_b + kvh * p.v_cache.stride_head + lc * 16;
  const char* kn_base = p.k.ptr + b * p.k.stride_b + kvh * p.k.stride_head + lc * 16;
  const char* vn_base = p.v.ptr + b * p.v.stride_b + kvh * p.v.stride_head + lc * 16;

  auto load_kv = [&](int tile, int stage) {
    const uint32_t k_sm = sbase + stage * 2 * TILE + loff, v_sm = k_sm + TILE;
#pragma unroll
    for (int it = 0; it < BN / RPI; ++it) {
      const int t = tile * BN + lrow + it * RPI;
      const char* kp = kc_base;  // any valid address when zero-filling
      const char* vp = vc_base;
      if (t < cl) {
        kp = kc_base + int64_t(t) * p.k_cache.stride_row;
        vp = vc_base + int64_t(t) * p.v_cache.stride_row;
      } else if (t < kv_end) {
        kp = kn_base + int64_t(t - cl) * p.k.stride_row;
        vp = vn_base + int64_t(t - cl) * p.v.stride_row;
      }
      const int bytes = t < kv_end ? 16 : 0;
      cp_async_16(k_sm + it * RPI * ROWB, kp, bytes);
      cp_async_16(v_sm + it * RPI * ROWB, vp, bytes);
    }
  };

  // 2. Start the copies first: K/V tile t_begin -> stage 0 and the Q tile -> the last stage's K slot (one
  //    commit group), then the next NS - 2 tiles, so NS - 1 tiles are in flight ahead of the computed one.
  const uint32_t qs = sbase + (NS - 1) * 2 * TILE;
  if (t_begin < t_end) {
    load_kv(t_begin, 0);
    int r = r0 + lrow;  // row of Q loader pass `it`, as (query i, head g) stepped without dividing
    int qi = r / G, qg = r % G;
    const int step_i = RPI / G, step_g = RPI % G;
#pragma unroll
    for (int it = 0; it < BM / RPI; ++it) {
      const bool ok = r < p.m_rows && qi < n;
      const char* src = ok ? p.q.ptr + b * p.q.stride_b + int64_t(qi) * p.q.stride_row +
                                 int64_t(kvh * G + qg) * p.q.stride_head + lc * 16
                           : p.q.ptr;
      cp_async_16(qs + loff + it * RPI * ROWB, src, ok ? 16 : 0);
      r += RPI;
      qi += step_i;
      qg += step_g;
      if (qg >= G) qg -= G, ++qi;
    }
    cp_async_commit();
#pragma unroll
    for (int st = 1; st < NS - 1; ++st) {
      if (t_begin + st < t_end) load_kv(t_begin + st, st);
      cp_async_commit();
    }
  }

  // 3. While those land: this CTA's share of the chunk's K/V -> cache rows [cl, cl + n) (16-byte units,
  //    strided over the m_tiles * S CTAs of this (b, kv head)). Nobody reads them back in this launch.
  if (row_ok) {
    const int64_t writers = int64_t(p.m_tiles) * p.num_splits;
    const int64_t w = int64_t(mt) * p.num_splits + split;
    const int64_t units = int64_t(n) * RC;
    for (int64_t e = w * NT + tid; e < units; e += writers * NT) {
      const int64_t j = e / RC;
      const int64_t c16 = (e % RC) * 16;
      const U128 kx = ld_global_16(p.k.ptr + b * p.k.stride_b + j * p.k.stride_row + kvh * p.k.stride_head + c16);
      const U128 vx = ld_global_16(p.v.ptr + b * p.v.stride_b + j * p.v.stride_row + kvh * p.v.stride_head + c16);
      const int64_t pos = int64_t(cl) + j;
      st_global_16(p.k_cache.ptr + b * p.k_cache.stride_b + pos * p.k_cache.stride_row + kvh * p.k_cache.stride_head + c16, kx);
      st_global_16(p.v_cache.ptr + b * p.v_cache.stride_b + pos * p.v_cache.stride_row + kvh * p.v_cache.stride_head + c16, vx);
    }
  }

  // 4. This lane's two rows (lane / 4 and lane / 4 + 8 of its warp's 16).
  const int wr0 = warp * 16;  // first row of this warp in the CTA tile
  const int wrow0 = r0 + wr0;
  const bool warp_active = row_ok && wrow0 < p.m_rows && wrow0 / G < n;  // rows grow with i: row 0 decides
  const int warp_kend_lo = warp_active ? block_attn_kend(cl, n, wrow0 / G, p.block_size) : 0;
  int kend[2];
  bool valid[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wrow0 + lane / 4 + 8 * h;
    valid[h] = row_ok && r < p.m_rows && r / G < n;
    kend[h] = valid[h] ? block_attn_kend(cl, n, r / G, p.block_size) : kv_end;
  }

  uint32_t qf[KSTEPS][4];
  float o[DN][4];
  float m_run[2] = {-INFINITY, -INFINITY};  // running max of the scaled scores (log2 domain)
  float l_run[2] = {0.f, 0.f};              // this lane's part of the running sum
#pragma unroll
  for (int j = 0; j < DN; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

  // The wgmma variant computes with every warp (warpgroup-collective); empty rows give finite, discarded values.
  const bool compute = WG || warp_active;

  if (t_begin < t_end) {
    cp_async_wait<NS - 2>();
    if constexpr (WG) fence_proxy_async_smem();
    block_sync();
    if (compute) {
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        const int row = wr0 + (lane % 8) + 8 * ((lane / 8) % 2);
        ldmatrix_x4(qf[ks], qs + block_attn_swz<D, WG>(row, 2 * ks + lane / 16));
      }
    }
    block_sync();  // the Q tile's space is the last stage again

    int stage = 0;           // stage of `tile`
    int pre_stage = NS - 1;  // stage of tile + NS - 1
    for (int tile = t_begin; tile < t_end; ++tile) {
      if (tile + NS - 1 < t_end) load_kv(tile + NS - 1, pre_stage);
      cp_async_commit();

      if (compute) {
        const uint32_t k_sm = sbase + stage * 2 * TILE, v_sm = k_sm + TILE;
        const int ts = tile * BN;

        // S = Q K^T (16 x BN per warp)
        float s[NB][4];
        float (&s_flat)[NB * 4] = reinterpret_cast<float (&)[NB * 4]>(s);
        if constexpr (WG) {
          wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < KSTEPS; ++ks) wgmma_rs<T, BN, false>(s_flat, qf[ks], block_attn_k_desc(k_sm, ks), ks > 0);
          wgmma_commit();
          wgmma_wait<0>();
          fence_regs(s_flat);
        } else {
#pragma unroll
          for (int j = 0; j < NB; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
          for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int jp = 0; jp < NB / 2; ++jp) {
              uint32_t kf[4];
              const int key = jp * 16 + (lane % 8) + 8 * (lane / 16);
              ldmatrix_x4(kf, k_sm + block_attn_swz<D, WG>(key, 2 * ks + (lane / 8) % 2));
              mma_16816<T>(s[2 * jp], qf[ks], kf[0], kf[1]);
              mma_16816<T>(s[2 * jp + 1], qf[ks], kf[2], kf[3]);
            }
          }
        }

        // scale (log2 domain), mask, online softmax
        const bool need_mask = ts + BN > warp_kend_lo;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < NB; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = s[j][e] * p.scale_log2;
            if (need_mask) {
              const int key = ts + 8 * j + 2 * (lane % 4) + (e & 1);
              if (key >= kend[e / 2]) x = -INFINITY;
            }
            s[j][e] = x;
            mx[e / 2] = fmaxf(mx[e / 2], x);
          }
        }
        float base[2], alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mx[h] = fmaxf(mx[h], shfl_xor(mx[h], 1));
          mx[h] = fmaxf(mx[h], shfl_xor(mx[h], 2));
          const float m_new = fmaxf(m_run[h], mx[h]);
          base[h] = m_new == -INFINITY ? 0.f : m_new;  // a row with no key yet: keep exp2 away from NaN
          alpha[h] = fast_exp2(m_run[h] - base[h]);
          m_run[h] = m_new;
        }
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < NB; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pv = fast_exp2(s[j][e] - base[e / 2]);
            s[j][e] = pv;
            rs[e / 2] += pv;
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + rs[h];
#pragma unroll
        for (int j = 0; j < DN; ++j) {
          o[j][0] *= alpha[0];
          o[j][1] *= alpha[0];
          o[j][2] *= alpha[1];
          o[j][3] *= alpha[1];
        }

        // O += P V: P's A fragments (keys 16kk..16kk+15) straight from the S accumulators
        auto p_frag = [&](int kk, uint32_t (&a)[4]) {
          a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
          a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
          a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
          a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        };
        if constexpr (WG) {
          float (&o_flat)[DN * 4] = reinterpret_cast<float (&)[DN * 4]>(o);
          uint32_t pa[BN / 16][4];
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) p_frag(kk, pa[kk]);
          // PTX: registers written by other instructions (the rescaled O accumulators, the packed P fragments)
          // must be written before the wgmma.fence; an empty asm on each pins those writes above it (the
          // "memory" clobber of the fence orders memory, not registers), as CUTLASS's warpgroup_fence_operand
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) fence_regs(pa[kk]);
          fence_regs(o_flat);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs<T, D, true>(o_flat, pa[kk], block_attn_v_desc(v_sm, kk), true);
          wgmma_commit();
          wgmma_wait<0>();
          fence_regs(o_flat);
        } else {
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t a[4];
            p_frag(kk, a);
#pragma unroll
            for (int dp = 0; dp < DN / 2; ++dp) {
              uint32_t vf[4];
              const int key = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
              ldmatrix_x4_trans(vf, v_sm + block_attn_swz<D, WG>(key, 2 * dp + lane / 16));
              mma_16816<T>(o[2 * dp], a, vf[0], vf[1]);
              mma_16816<T>(o[2 * dp + 1], a, vf[2], vf[3]);
            }
          }
        }
      }
      cp_async_wait<NS - 2>();
      if constexpr (WG) fence_proxy_async_smem();
      block_sync();  // tile + 1 landed; this stage may be overwritten
      stage = stage + 1 == NS ? 0 : stage + 1;
      pre_stage = pre_stage + 1 == NS ? 0 : pre_stage + 1;
    }
  }

  // 4. Epilogue: full row sums, then the output (S == 1) or the partial + lse (S > 1).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += shfl_xor(l_run[h], 1);
    l_run[h] += shfl_xor(l_run[h], 2);
  }
  const int64_t rows_total = int64_t(p.batch) * p.chunk * p.hq;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wrow0 + lane / 4 + 8 * h;
    if (r >= p.m_rows) continue;
    const int i = r / G, head = kvh * G + r % G;
    const int64_t orow = (int64_t(b) * p.chunk + i) * p.hq + head;
    const bool has = valid[h] && l_run[h] > 0.f;
    const float inv = has ? 1.f / l_run[h] : 0.f;
    const int col = 2 * (lane % 4);
    if (p.num_splits == 1) {
      char* dst = p.out + orow * D * 2;
#pragma unroll
      for (int j = 0; j < DN; ++j) {
        st_global_u32(dst + (8 * j + col) * 2, pack2<T>(o[j][2 * h] * inv, o[j][2 * h + 1] * inv));
      }
    } else {
      const int64_t prow = int64_t(split) * rows_total + orow;
      if (has) {
        float* dst = p.o_part + prow * D;
#pragma unroll
        for (int j = 0; j < DN; ++j) st_global_f32x2(dst + 8 * j + col, o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
      }
      if (lane % 4 == 0) p.lse_part[prow] = has ? m_run[h] + log2f(l_run[h]) : -INFINITY;
    }
  }
}

// Merge of the S partials of one output row per warp: out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),
// M = max_s lse_s; zeros when every lse_s is -inf (an empty row). `cta` in [0, ceil(rows / warps)).
template <typename T, int D>
LRF_DEVICE void block_attn_combine_cta(const BlockAttnParams& p, int64_t cta, int tid) {
  constexpr int VEC = D / 32;  // floats per lane
  griddep_wait();  // launched with programmatic serialization: the partials are complete past this point
  griddep_launch_dependents();  // the o_proj GEMM (ops.linear with pdl) may start streaming its weights
  const int warp = tid / 32, lane = tid % 32;
  const int64_t rows_total = int64_t(p.batch) * p.chunk * p.hq;
  const int64_t row = cta * kBlockAttnCombineWarps + warp;
  if (row >= rows_total) return;  // warp-uniform; no block barrier below
  const int S = p.num_splits;
  float mx = -INFINITY;
  for (int s = lane; s < S; s += 32) mx = fmaxf(mx, p.lse_part[int64_t(s) * rows_total + row]);
#pragma unroll
  for (int sh = 16; sh >= 1; sh /= 2) mx = fmaxf(mx, shfl_xor(mx, sh));
  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
  float wsum = 0.f;
  if (mx != -INFINITY) {
#pragma unroll 4
    for (int s = 0; s < S; ++s) {
      const int64_t prow = int64_t(s) * rows_total + row;
      const float lse = p.lse_part[prow];
      if (lse == -INFINITY) continue;  // no key in this split: its partial was never written
      const float w = fast_exp2(lse - mx);
      float x[VEC];
      ld_global_f32<VEC>(p.o_part + prow * D + lane * VEC, x);
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += w * x[e];
      wsum += w;
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  char* dst = p.out + row * D * 2 + lane * VEC * 2;
  if constexpr (VEC == 4) {
    st_global_u64(dst, pack2<T>(acc[0] * inv, acc[1] * inv), pack2<T>(acc[2] * inv, acc[3] * inv));
  } else {
    st_global_u32(dst, pack2<T>(acc[0] * inv, acc[1] * inv));
  }
}

#if !defined(LRF_KERNEL_EMULATION)
template <typename T, int D, bool WG>
__global__ void __launch_bounds__(kBlockAttnThreads, 2) block_attn_kernel(const BlockAttnParams p) {
  extern __shared__ __align__(128) char block_attn_smem[];
  block_attn_cta<T, D, WG>(p, blockIdx.x, threadIdx.x, block_attn_smem);
}

template <typename T, int D>
__global__ void __launch_bounds__(kBlockAttnCombineWarps * 32) block_attn_combine_kernel(const BlockAttnParams p) {
  block_attn_combine_cta<T, D>(p, blockIdx.x, threadIdx.x);
}
#endif

}  // namespace kernels
}  // namespace lrf
