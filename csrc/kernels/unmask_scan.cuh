// The per-chunk scan of threshold_unmask (kernels/unmask.cuh, whose opening comment describes the whole kernel):
// the launch's constants, parameters and per-chunk partial; Philox / Gumbel noise; the online max, softmax sum
// and best-pick state of a thread, its warp and CTA merges; the sampling candidate ring; the scan of one chunk
// of a row (scan_buckets) and the CTA's partial (cta_to_partial). Device code only (no torch); compiled as host
// C++ over the CPU emulator when LRF_KERNEL_EMULATION is defined (csrc/emu/unmask_emu.cpp).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace lrf {
namespace kernels {

constexpr int kUnmaskThreads = 256;                       // threads per CTA (8 warps)
constexpr int kUnmaskWarps = kUnmaskThreads / 32;
constexpr int kUnmaskUnroll = 4;                          // 16-byte loads in flight per thread
constexpr int kUnmaskMaxPositions = 1024;                 // S limit of the kernel (selection in shared memory)
constexpr int kUnmaskRing = 64;                           // per-warp candidate ring (sampling)
constexpr int kUnmaskStage = 32;                          // elements per group at most (4 x 8 bf16/fp16)
constexpr float kGumbelBound = 17.0f;                     // > every Gumbel value the noise can produce (16.64)
constexpr float kGumbelFloor = 2.82f;                     // -g < 2.82 for every noise value (g >= -2.8116)
constexpr int32_t kNoIndex = 0x7fffffff;                  // "no token seen yet"
constexpr int kBucket = 1024;                             // two-level sampling: tokens per bucket (ops/unmask.py)
constexpr uint64_t kBucketTag = uint64_t(1) << 62;        // two-level sampling: Philox counters of bucket noise
constexpr float kLog2e = 1.4426950408889634f;

// Philox4x32-10 constants (Random123).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

// How a position's token is picked (template argument of the kernel).
enum PickMode : int {
  kPickGreedy = 0,  // argmax of the logits
  kPickToken = 1,   // Gumbel-max with one noise value per token ("per_token")
  kPickBucket = 2,  // two-level Gumbel-max: a bucket of kBucket tokens by its mass, then a token in it ("two_level")
};

// The launch's mode: greedy when asked or when T <= 0, else the sampler the caller chose.
inline int unmask_pick_mode(bool greedy, double temperature, bool two_level) {
  return greedy || temperature <= 0.0 ? kPickGreedy : (two_level ? kPickBucket : kPickToken);
}

// Buckets of two-level sampling in a row of V logits.
__host__ __device__ constexpr int unmask_nbuckets(int vocab) { return (vocab + kBucket - 1) / kBucket; }

// One chunk's summary, 32 bytes (two 16-byte stores / loads).
struct alignas(16) UnmaskPartial {
  float m;       // max raw logit of the chunk (-inf when empty)
  float sum;     // sum of exp((x - m) / T), computed as 2^((x - m) * c2), c2 = log2(e) / T
  float score;   // greedy: best raw logit; per-token sampling: best fl(s + g); two-level: best bucket score
  float pick;    // the best token's scaled logit s = fl(x * inv_t) (two-level: set by finish_row)
  int32_t idx;   // the best token (kNoIndex when the chunk is empty); two-level: the best bucket, then the token
  int32_t pad[3];
};

// [B, S] tensor with element strides.
template <typename T>
struct Mat {
  T* ptr;
  int64_t sb, ss;
  __device__ __forceinline__ T& operator()(int64_t b, int64_t s) const { return ptr[b * sb + s * ss]; }
};

// [N] tensor with an element stride.
template <typename T>
struct Vec {
  T* ptr;
  int64_t st;
  __device__ __forceinline__ T& operator[](int64_t i) const { return ptr[i * st]; }
};

struct UnmaskParams {
  const void* logits;          // [B, S, V], last dim dense; or [num_logit_rows, V] with logit_rows
  int64_t logits_sb, logits_ss;  // element strides of dims 0 and 1 (with logit_rows: the row stride, unused)
  Mat<const int64_t> logit_rows;  // [B, S], ptr nullptr when absent: position (b, s) reads logits row
                                  // logit_rows(b, s), clamped into [0, num_logit_rows) (unmask_logits_offset)
  int64_t num_logit_rows;      // rows of the compact logits (>= 1 when logit_rows is given)
  Mat<int64_t> tokens;         // [B, S] written at unmasked positions
  Mat<bool> masked;            // [B, S] cleared at unmasked positions
  Mat<int32_t> step_map;       // [B, S]
  Mat<float> logp;             // [B, S]
  Mat<float> conf;             // [B, S]
  Vec<const int32_t> step;     // [B]
  Vec<const int32_t> quota;    // [B]
  Vec<const int64_t> eos_ids;  // [E]
  int32_t num_eos;             // E
  const int64_t* seed;         // [1] (sampling only)
  const int64_t* offset;       // [1] (sampling only)
  Vec<const int64_t> noise_rows;  // [B], ptr nullptr when absent (sampling only): position (b, s) draws the noise
                                 // of flat row noise_rows[b] * S + s instead of b * S + s (unmask_noise_row)
  bool* block_done;            // [B] out
  bool* eos_seen;              // [B] out
  int32_t* counters;           // [B] workspace, zero on entry, reset to zero on exit
  int32_t* row_counters;       // [B * S] workspace (two-level sampling with nsplit > 1), zero on entry and exit
  UnmaskPartial* partials;     // [B * S * nsplit] workspace
  int32_t batch, positions, vocab, nsplit;
  float inv_temp;              // 1.0f / float(T) (1 when greedy with T <= 0)
  float threshold;             // fp32, as `conf >= threshold` compares in the reference
};

// ---------------------------------------------------------------------------------------------- helpers

// LRF_KERNEL_EMULATION: csrc/emu/unmask_emu.cpp compiles this header as host C++ over the CPU emulator
// (csrc/emu/cuda_builtins.h supplies the intrinsics; CPU tests of the device logic); it replaces the two
// inline-PTX helpers.
#ifndef LRF_KERNEL_EMULATION
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 16-byte streaming load: read-only path, no L1 allocation (every logit is read exactly once). volatile so
// that the compiler keeps a group's loads together where they are written (it would otherwise sink each
// into the code that unpacks it, leaving one load in flight per thread).
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
#else
__device__ __forceinline__ float ex2_approx(float x) { return exp2f(x); }
__device__ __forceinline__ uint4 load_stream16(const void* p) { return lrf::emu::load16(p); }
#endif

// First output word of Philox4x32-10: key (k0, k1), counter (c0, c1, c2, c3).
__device__ __forceinline__ uint32_t philox_word0(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                                 uint32_t k1) {
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    const uint32_t hi0 = __umulhi(c0, kPhiloxM0), lo0 = c0 * kPhiloxM0;
    const uint32_t hi1 = __umulhi(c2, kPhiloxM1), lo1 = c2 * kPhiloxM1;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return c0;
}

// g = -log(-log(u)), u = ((w >> 9) + 0.5) * 2^-23 (exact in fp32), full-precision logf as torch.log.
__device__ __forceinline__ float gumbel_from_word(uint32_t w) {
  const float u = __fmul_rn(__fadd_rn(static_cast<float>(w >> 9), 0.5f), 0x1p-23f);
  return -logf(-logf(u));
}

// Philox key and offset words of a launch (sampling).
struct NoiseKey {
  uint32_t k0, k1, o0, o1;
  __device__ __forceinline__ float gumbel(uint64_t ctr) const {
#ifdef LRF_KERNEL_EMULATION
    ++lrf::emu::gumbel_draws;  // test support: how many noise values were drawn
#endif
    return gumbel_from_word(philox_word0(uint32_t(ctr), uint32_t(ctr >> 32), o0, o1, k0, k1));
  }
};

__device__ __forceinline__ NoiseKey noise_key(const UnmaskParams& p) {
  const uint64_t seed = uint64_t(*p.seed), off = uint64_t(*p.offset);
  return {uint32_t(seed), uint32_t(seed >> 32), uint32_t(off), uint32_t(off >> 32)};
}

// Logit element types: 16-byte vector -> floats.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kPerVec = 4;
  __device__ __forceinline__ static void unpack(const uint4& v, float* out) {
    out[0] = __uint_as_float(v.x);
    out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z);
    out[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static float load1(const void* row, int64_t i) {
    return static_cast<const float*>(row)[i];
  }
};

struct Bf16Tag {};  // bfloat16 handled as raw 16-bit words (exact widening: bits << 16)
struct HalfTag {};

template <>
struct Elem<Bf16Tag> {
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float* out) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static float load1(const void* row, int64_t i) {
    return __uint_as_float(uint32_t(static_cast<const uint16_t*>(row)[i]) << 16);
  }
};

template <>
struct Elem<HalfTag> {
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float* out) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 f = __half22float2(h);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ __forceinline__ static float load1(const void* row, int64_t i) {
    return __half2float(static_cast<const __half*>(row)[i]);
  }
};

// Running state of one thread over its share of a chunk.
struct ScanState {
  float m = -INFINITY;
  float sum = 0.f;
  float score = -INFINITY;
  float pick = -INFINITY;
  int32_t idx = kNoIndex;
};

// Softmax-sum merge: both (m, sum) pairs describe sum_x 2^((x - m) * c2); -inf maxima are empty.
// x - m is exact for the maximum itself (term exactly 1), so a token that dominates its row gets conf exactly
// 1.0 when the reference's fp32 logsumexp does.
__device__ __forceinline__ void merge_sum(float& m, float& sum, float m_o, float sum_o, float c2) {
  const float mn = fmaxf(m, m_o);
  const float mu = mn == -INFINITY ? 0.f : mn;
  // _rn intrinsics: never contracted into an FMA, so the merge is commutative bit for bit (a fused
  // a*b + round(c*d) is not: the lanes of a butterfly would end with different sums, and which lane's sum a
  // two-level bucket pick uses depends on the launch's split) and the device matches the emulator
  sum = __fadd_rn(__fmul_rn(sum, ex2_approx((m - mu) * c2)), __fmul_rn(sum_o, ex2_approx((m_o - mu) * c2)));
  m = mn;
}

// Best merge: higher score wins, equal scores go to the lower index (kNoIndex loses every tie).
__device__ __forceinline__ void merge_best(float& score, float& pick, int32_t& idx, float score_o, float pick_o,
                                           int32_t idx_o) {
  if (score_o > score || (score_o == score && idx_o < idx)) {
    score = score_o;
    pick = pick_o;
    idx = idx_o;
  }
}

__device__ __forceinline__ void merge_state(ScanState& a, const ScanState& o, float c2) {
  merge_sum(a.m, a.sum, o.m, o.sum, c2);
  merge_best(a.score, a.pick, a.idx, o.score, o.pick, o.idx);
}

__device__ __forceinline__ ScanState shfl_state(const ScanState& s, int mask) {
  ScanState o;
  o.m = __shfl_xor_sync(0xffffffffu, s.m, mask);
  o.sum = __shfl_xor_sync(0xffffffffu, s.sum, mask);
  o.score = __shfl_xor_sync(0xffffffffu, s.score, mask);
  o.pick = __shfl_xor_sync(0xffffffffu, s.pick, mask);
  o.idx = __shfl_xor_sync(0xffffffffu, s.idx, mask);
  return o;
}

__device__ __forceinline__ void warp_merge(ScanState& s, float c2) {
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) merge_state(s, shfl_state(s, mask), c2);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask));
  return v;
}

// float <-> int with the same order (for atomicMax on scores): non-negative floats keep their bits, negative
// ones get their magnitude bits flipped. An involution.
__device__ __forceinline__ int ordered_bits(float f) {
  const int i = __float_as_int(f);
  return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float ordered_float(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff); }

// Per-warp candidate ring for Gumbel sampling: scaled logits and token ids waiting for their noise.
struct CandRing {
  float s[kUnmaskRing];
  int32_t idx[kUnmaskRing];
};

// Sampling context of one warp: the ring, its head / fill (warp-uniform), the pruning threshold (the best
// score any lane of the warp has reached; warp-uniform) and the row's Philox key and counter base.
struct Sampler {
  CandRing* ring;
  float* stage;      // [kUnmaskStage][32] scaled logits of the warp's current group
  int head, count;
  float thr;
  int* cta_thr;      // the CTA's best score so far (ordered_bits), shared by the warps
  uint64_t row_ctr;  // r * V
  NoiseKey key;

  // Lanes < n take one queued candidate each, draw its noise, keep the best; then refresh the threshold.
  __device__ __forceinline__ void flush(ScanState& st, int n, int lane) {
    __syncwarp();
    if (lane < n) {
      const int slot = (head + lane) & (kUnmaskRing - 1);
      const float s = ring->s[slot];
      const int32_t t = ring->idx[slot];
      merge_best(st.score, st.pick, st.idx, __fadd_rn(s, key.gumbel(row_ctr + uint64_t(t))), s, t);
    }
    __syncwarp();
    head = (head + n) & (kUnmaskRing - 1);
    count -= n;
    const float best = warp_max(st.score);
    if (lane == 0 && best > thr) atomicMax(cta_thr, ordered_bits(best));
    thr = fmaxf(thr, best);
  }

  // Raise this lane's threshold to the CTA's (a valid lower bound of the final best score whenever read; the
  // lanes of a warp may see different values, which only changes how much is pruned).
  __device__ __forceinline__ void refresh() {
    thr = fmaxf(thr, ordered_float(*static_cast<volatile int*>(cta_thr)));
  }

  // A lower bound of the final best score that costs no noise: the token with scaled logit s scores >= s - 2.82.
  __device__ __forceinline__ void bound_from(float smax) {
    const float lb = __fsub_rn(smax, kGumbelFloor);
    if (lb > thr) {
      atomicMax(cta_thr, ordered_bits(lb));
      thr = lb;
    }
  }
};

// Process one group of N logits x[e] (invalid ones already set to -inf), token id of element e =
// base + (e / kPerVec) * vstride + e % kPerVec, `valid` bit e set for real elements. A thread visits its
// tokens in increasing id order, group after group, which the greedy "first maximum" rule relies on.
// Every lane of the warp must call this together (sampling uses warp votes).
template <bool kGreedy, int N, int kPerVec>
__device__ __forceinline__ void process_group(ScanState& st, Sampler& smp, const float (&x)[N], uint32_t valid,
                                              int32_t base, int32_t vstride, float inv_t, float c2, int lane) {
  float gmax = x[0];
#pragma unroll
  for (int e = 1; e < N; ++e) gmax = fmaxf(gmax, x[e]);

  // online softmax sum: one rescale per group
  const float mnew = fmaxf(st.m, gmax);
  const float mu = mnew == -INFINITY ? 0.f : mnew;
  float acc[4] = {st.sum * ex2_approx((st.m - mu) * c2), 0.f, 0.f, 0.f};
#pragma unroll
  for (int e = 0; e < N; ++e) acc[e & 3] += ex2_approx((x[e] - mu) * c2);
  st.sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  st.m = mnew;

  if constexpr (kGreedy) {
    // strictly greater keeps the earlier token; the very first valid token is taken whatever its value
    if (valid != 0u && (gmax > st.score || st.idx == kNoIndex)) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        if (((valid >> e) & 1u) && x[e] == gmax) {
          st.score = gmax;
          st.idx = base + (e / kPerVec) * vstride + (e % kPerVec);
          break;
        }
      }
    }
  } else {
    const float smax = __fmul_rn(gmax, inv_t);
    smp.refresh();
    if (valid != 0u) smp.bound_from(smax);
    const bool maybe = valid != 0u && __fadd_rn(smax, kGumbelBound) >= smp.thr;
    if (__any_sync(0xffffffffu, maybe)) {
      // stage the scaled logits (column `lane` of the warp's [N][32] block) and flag the candidates ...
      uint32_t cand = 0u;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float s = __fmul_rn(x[e], inv_t);
        smp.stage[e * 32 + lane] = s;
        cand |= uint32_t(maybe && ((valid >> e) & 1u) && __fadd_rn(s, kGumbelBound) >= smp.thr) << e;
      }
      __syncwarp();
      // ... then queue them element by element (one loop, one flush site: no code bloat), re-screening
      // each against the threshold as it rises
      const uint32_t lanes_below = (1u << lane) - 1u;
      uint32_t todo = __reduce_or_sync(0xffffffffu, cand);
#pragma unroll 1
      while (todo != 0u) {
        const int e = __ffs(todo) - 1;  // warp-uniform
        todo &= todo - 1u;
        const float s = smp.stage[e * 32 + lane];
        const bool c = ((cand >> e) & 1u) && __fadd_rn(s, kGumbelBound) >= smp.thr;
        const uint32_t ballot = __ballot_sync(0xffffffffu, c);
        if (c) {
          const int slot = (smp.head + smp.count + __popc(ballot & lanes_below)) & (kUnmaskRing - 1);
          smp.ring->s[slot] = s;
          smp.ring->idx[slot] = base + (e / kPerVec) * vstride + (e % kPerVec);
        }
        smp.count += __popc(ballot);
        if (smp.count >= 32) smp.flush(st, 32, lane);
      }
      __syncwarp();  // the stage is rewritten by the next group
    }
  }
}

// One element (head / tail of a row that is not 16-byte aligned): a group of one, maybe invalid.
template <bool kGreedy>
__device__ __forceinline__ void process_one(ScanState& st, Sampler& smp, float v, bool valid, int32_t t,
                                            float inv_t, float c2, int lane) {
  const float x[1] = {valid ? v : -INFINITY};
  process_group<kGreedy, 1, 1>(st, smp, x, valid ? 1u : 0u, t, 0, inv_t, c2, lane);
}

// Two-level sampling, pass 1 (in the scan): warp `warp` of the CTA takes buckets jbeg + warp, jbeg + warp + 8,
// ... < jend of the row. For each bucket the lanes' (max, sum) are merged across the warp into the bucket's
// log-mass L_j = fl(m_j * inv_t) + logf(sum_j) (the same value in every lane), and each lane folds its own
// (max, sum) into its share of the row's softmax sum. Lane k mod 32 holds the warp's k-th bucket until 32 are
// pending; then every lane draws the noise of its bucket at once (a converged Philox call per 32 buckets) and
// keeps the best fl(L_j + g_j) in (score, idx) (idx = bucket). `aligned`: the row starts on 16 bytes, so a
// bucket is whole 16-byte vectors (kBucket is a multiple of every vector width), else it is read by scalars.
template <typename Tag>
__device__ __forceinline__ void scan_buckets(ScanState& st, const char* rowp, bool aligned, int V, int jbeg,
                                             int jend, uint64_t bucket_ctr0, const NoiseKey& key, float inv_t,
                                             float c2, int lane, int warp) {
  using E = Elem<Tag>;
  constexpr int kPerVec = E::kPerVec;
  constexpr int kVecs = kBucket / kPerVec / 32;  // vectors per lane per bucket: 4 (bf16 / fp16), 8 (fp32)
  constexpr int kPerLane = kBucket / 32;         // 32 tokens per lane per bucket
  constexpr int64_t kElemBytes = 16 / kPerVec;
  static_assert(kVecs * kPerVec == kPerLane, "a bucket is whole vectors per lane");

  float pend_l = -INFINITY;  // this lane's pending bucket: log-mass and index (-1: none)
  int32_t pend_j = -1;
  int npend = 0;             // warp-uniform
  auto draw = [&]() {
    if (pend_j >= 0) {
      const float g = key.gumbel(bucket_ctr0 + uint64_t(pend_j));
      merge_best(st.score, st.pick, st.idx, __fadd_rn(pend_l, g), -INFINITY, pend_j);
      pend_j = -1;
    }
    npend = 0;
  };

  for (int j = jbeg + warp; j < jend; j += kUnmaskWarps) {  // warp-uniform
    const int t0 = j * kBucket;
    const int len = V - t0 < kBucket ? V - t0 : kBucket;
    float x[kPerLane];
    float extra = -INFINITY;  // aligned rows: the < kPerVec tokens after the last whole vector (last bucket)
    if (aligned) {
      const int nv = len / kPerVec;
      if (nv > 0) {
        const uint4* vecs = reinterpret_cast<const uint4*>(rowp + int64_t(t0) * kElemBytes);
        uint4 raw[kVecs];
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {  // unpredicated: lanes past the end re-read the last vector
          const int v = lane + 32 * u;
          raw[u] = load_stream16(vecs + (v < nv ? v : nv - 1));
        }
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {
          E::unpack(raw[u], x + u * kPerVec);
          const bool ok = lane + 32 * u < nv;
#pragma unroll
          for (int e = 0; e < kPerVec; ++e) x[u * kPerVec + e] = ok ? x[u * kPerVec + e] : -INFINITY;
        }
      } else {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) x[e] = -INFINITY;
      }
      const int t = nv * kPerVec + lane;
      if (t < len) extra = E::load1(rowp, t0 + t);
    } else {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int t = lane + 32 * e;
        x[e] = t < len ? E::load1(rowp, t0 + t) : -INFINITY;
      }
    }
    // this lane's (max, sum) over its tokens of the bucket
    float lm = extra;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) lm = fmaxf(lm, x[e]);
    const float mu = lm == -INFINITY ? 0.f : lm;
    float acc[4] = {ex2_approx((extra - mu) * c2), 0.f, 0.f, 0.f};
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[e & 3] += ex2_approx((x[e] - mu) * c2);
    const float ls = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    merge_sum(st.m, st.sum, lm, ls, c2);
    // the bucket's (max, sum) in every lane (a butterfly: both partners compute the same commutative merge)
    float bm = lm, bs = ls;
#pragma unroll
    for (int mask = 16; mask >= 1; mask >>= 1) {
      merge_sum(bm, bs, __shfl_xor_sync(0xffffffffu, bm, mask), __shfl_xor_sync(0xffffffffu, bs, mask), c2);
    }
    if (lane == npend) {
      pend_l = __fadd_rn(__fmul_rn(bm, inv_t), logf(bs));
      pend_j = j;
    }
    if (++npend == 32) draw();
  }
  if (npend > 0) draw();
}

// Shared memory of a CTA: the block reduction (static); dynamic: the candidate rings and staging blocks
// (sampling) or, in the CTA that finishes a sequence, its per-position arrays (the same bytes, reused).
struct UnmaskShared {
  float m[kUnmaskWarps], sum[kUnmaskWarps], score[kUnmaskWarps], pick[kUnmaskWarps];
  int32_t idx[kUnmaskWarps];
  int is_last;
  int thr;  // sampling: the CTA's best score so far (ordered_bits)
  float row_m, row_sum;  // two-level sampling: the row's merged softmax sum (finish_row)
  int32_t bucket;        // two-level sampling: the row's bucket (finish_row)
};

// The CTA's states merged into one partial at `out` (written by thread 0). Every thread of the CTA calls it.
__device__ __forceinline__ void cta_to_partial(ScanState st, UnmaskShared& sh, UnmaskPartial* out, float c2) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  warp_merge(st, c2);
  if (lane == 0) {
    sh.m[warp] = st.m;
    sh.sum[warp] = st.sum;
    sh.score[warp] = st.score;
    sh.pick[warp] = st.pick;
    sh.idx[warp] = st.idx;
  }
  __syncthreads();
  if (warp == 0) {
    ScanState w;
    if (lane < kUnmaskWarps) {
      w.m = sh.m[lane];
      w.sum = sh.sum[lane];
      w.score = sh.score[lane];
      w.pick = sh.pick[lane];
      w.idx = sh.idx[lane];
    }
    warp_merge(w, c2);
    if (lane == 0) {
      reinterpret_cast<float4*>(out)[0] = make_float4(w.m, w.sum, w.score, w.pick);
      reinterpret_cast<int4*>(out)[1] = make_int4(w.idx, 0, 0, 0);
    }
  }
}

}  // namespace kernels
}  // namespace lrf
