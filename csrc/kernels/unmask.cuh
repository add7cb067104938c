// Batched confidence-threshold unmasking: device code only (no torch). The launcher is csrc/unmask.cu;
// the contract and the pure-PyTorch reference are lightningrl_fast/ops/unmask.py. This file: the launch plan,
// the CTA that finishes a row or a sequence, the kernel; the scan of one chunk of a row (constants, parameters,
// noise, merges, scan_buckets) is kernels/unmask_scan.cuh.
//
// One launch, one pass over the logits. Rows r = b * S + s (b sequence, s position) of V logits each are cut
// into `nsplit` chunks of whole 16-byte vectors; CTA `r * nsplit + c` scans chunk c of row r and writes one
// partial (max raw logit m, sum of exp((x - m) / T), best score, the pick's scaled logit, best index) to the
// workspace. The CTA that arrives last at its sequence's counter (atomicAdd; the
// classic threadfence-reduction pattern, no CTA ever waits on another) merges the S * nsplit partials of
// that sequence, computes conf / logp per masked position, selects the positions to unmask, writes them in
// place, sets block_done / eos_seen, and resets the counter to 0 for the next launch.
//
// Picks (identical to the reference's, see ops/unmask.py):
//   greedy:   argmax of the raw logits, ties to the lowest token id.
//   per-token sampling (noise "per_token"): argmax over t of fl(fl(x_t * inv_t) + g_t) with g_t = -logf(-logf(u_t)) (full-precision logf,
//             the one torch.log uses on CUDA) and u_t from Philox4x32-10 keyed by seed, counter (r * V + t,
//             offset): u = ((w0 >> 9) + 0.5) * 2^-23. inv_t = 1.0f / float(T) and x * inv_t rounded on its
//             own (no FMA contraction), as torch computes `logits / T` on CUDA (multiply by the reciprocal).
//   Exact Gumbel pruning: u <= 1 - 2^-24, so g <= 16.64 < kGumbelBound = 17 and a token whose
//   fl(s + 17) is below a score already reached cannot win (fl is monotone), nor tie. "Reached" is CTA-wide:
//   each warp publishes to a shared threshold (atomicMax on an order-preserving int encoding) its best score
//   and, before any noise is drawn, fl(s_max - 2.82) for the largest scaled logit it has seen (that token's
//   score will be at least this, g >= -2.8116: a valid lower bound of the row's best); every warp screens
//   against the larger of its own and the shared value, so once any warp has met a dominant token, every warp
//   prunes the bulk of the row. (Every published value is <= the final best: by induction, a token whose
//   bound was published is either drawn, scoring >= it, or was pruned by an earlier, smaller-or-equal value.)
//   Only the other tokens
//   ("candidates") pay for Philox + two logf; they are compacted per warp (a group's scaled logits are staged
//   in shared memory, candidates queued by ballot into a 64-entry ring, flushed 32 at a time from a single
//   call site) so a warp runs the RNG converged and the RNG code exists once. Peaked LLM logits leave few
//   candidates; flat logits (all within ~20/T of the max) make every token one: then sampling is RNG-bound.
//   two-level sampling (noise "two_level", the default): the vocabulary is cut into buckets of kBucket = 1024
//   token ids; the row's bucket is the argmax over j of fl(L_j + G_j), L_j = log sum_{t in j} exp(s_t) (fp32) and
//   G_j Gumbel noise from the same Philox stream at counter kBucketTag + r * nbuckets + j; the token is then
//   the per-token Gumbel-max restricted to that bucket (the per-token counters above). Exact in distribution
//   (P(j) = mass of j, P(t | j) = exp(s_t) / mass of j), and it costs one noise value per bucket plus one per
//   token of the chosen bucket: the scan runs at the greedy scan's speed whatever the logits look like. The
//   scan (scan_buckets) gives every chunk whole buckets; the CTA that completes a row (a per-row arrival
//   counter when nsplit > 1) merges its partials, re-reads the chosen bucket and picks the token
//   (finish_row), then alone arrives for the sequence. Its picks equal the reference's except where two
//   buckets' scores are within the fp32 error of L_j (the reference's logsumexp sums in another order).
// logp = (s_pick - s_max) - log(sum exp((x - m) / T)) in fp32 (the structure of torch.logsumexp; the terms
// through ex2.approx), conf = exp(logp): a token whose row holds under 2^-25 of its mass elsewhere gets conf
// exactly 1.0, as in the reference; otherwise conf is a few ulp from the reference's when |x / T| is small,
// and up to ~2^-24 (|s_pick| + |s_max|) relative when it is large (T << 1: the reference rounds its logsumexp
// at ulp(s_max) and may give 1.0 where this keeps 1 - 1e-6), so a position whose conf is within that of the
// threshold or of another position's conf may be selected differently (the picks do not depend on it).
//
// Workspace (persistent, owned by the launcher): int32 counters[B] and row counters[B * S] (zero between
// launches) and, in a separate buffer, UnmaskPartial partials[B * S * nsplit]. Positions that are not masked, and sequences with quota <= 0,
// are not scanned at all (their logits are never read). So a caller may compute logits for the scanned positions
// only: a compact [M, V] logits and a map logit_rows [B, S] (the decoder's packed steps run the LM head on the
// still-masked positions of active rows, about half of a block's positions on average).
#pragma once

#include <cstdint>

#include "unmask_scan.cuh"

namespace lrf {
namespace kernels {

// Bytes of dynamic shared memory the kernel needs for S positions.
__host__ __device__ constexpr int64_t unmask_dynamic_smem(int64_t positions, int mode) {
  const int64_t rings = mode != kPickToken
      ? 0 : int64_t(kUnmaskWarps) * (int64_t(sizeof(CandRing)) + int64_t(kUnmaskStage) * 32 * 4);
  const int64_t finish = positions * 13 + 16;  // conf, logp (fp32), token (int32), masked (u8)
  return rings > finish ? rings : finish;
}

// The most chunks a row of V logits is cut into: each chunk keeps >= 2 vectors per thread, or, for two-level
// sampling (chunks of whole buckets), >= 1 bucket per warp; at most 64.
inline int64_t unmask_max_split(int64_t vocab, int64_t per_vec, int mode) {
  const int64_t n = mode == kPickBucket ? unmask_nbuckets(int(vocab)) / kUnmaskWarps
                                        : vocab / per_vec / (2 * kUnmaskThreads);
  return n < 1 ? 1 : (n > 64 ? 64 : n);
}

// Chunks per row: the smallest split (<= max_split) whose rows x split CTAs fill whole waves of the resident
// CTA slots (SMs x CTAs per SM) to >= 95%, else the best filling one.
inline int unmask_choose_split(int64_t rows, int64_t max_split, int64_t slots) {
  int best = 1;
  double best_eff = -1.0;
  for (int64_t n = 1; n <= max_split; ++n) {
    const int64_t ctas = rows * n;
    const int64_t waves = (ctas + slots - 1) / slots;
    const double eff = double(ctas) / double(waves * slots);
    if (eff >= 0.95) return int(n);
    if (eff > best_eff + 1e-9) {
      best_eff = eff;
      best = int(n);
    }
  }
  return best;
}

// Workspace: int32 counters[B] (padded to 256 bytes) followed by the row counters [B * S], and, in a separate
// buffer, the partials. The counters must never share bytes with partials of an earlier launch: they must
// read zero on entry.
inline int64_t unmask_seq_counter_bytes(int64_t batch) { return (batch * 4 + 255) / 256 * 256; }
inline int64_t unmask_counter_bytes(int64_t batch, int64_t rows) {
  return unmask_seq_counter_bytes(batch) + (rows * 4 + 255) / 256 * 256;
}
inline int64_t unmask_partial_bytes(int64_t rows, int64_t nsplit) {
  return rows * nsplit * int64_t(sizeof(UnmaskPartial));
}

// ------------------------------------------------------------------------------ the CTA that finishes b

__device__ __forceinline__ bool conf_before(float a, int ia, float c, int ic) {
  // descending stable sort order of torch: NaN first, then larger values, equal keys by position
  const bool an = a != a, cn = c != c;
  if (an || cn) return an && (!cn || ia < ic);
  return a > c || (a == c && ia < ic);
}

// A partial written by another CTA of this launch, read from L2 (ld.cg: after the arrival's threadfence).
__device__ __forceinline__ ScanState load_partial(const UnmaskPartial* q) {
  const float4 a = __ldcg(reinterpret_cast<const float4*>(q));
  const int4 c = __ldcg(reinterpret_cast<const int4*>(q) + 1);
  ScanState o;
  o.m = a.x;
  o.sum = a.y;
  o.score = a.z;
  o.pick = a.w;
  o.idx = c.x;
  return o;
}

// The flat row whose noise counters position (b, s) = row (b * S + s) uses: noise_rows[b] * S + s when given (a
// caller that moves its sequences between launches, the decoder's compaction, keeps each one's noise), else row.
// Only the counters: `row` still addresses the logits, partials and workspace.
__device__ __forceinline__ uint64_t unmask_noise_row(const UnmaskParams& p, int64_t row) {
  if (p.noise_rows.ptr == nullptr) return uint64_t(row);
  const int64_t b = row / p.positions;
  return uint64_t(p.noise_rows[b]) * uint64_t(p.positions) + uint64_t(row - b * p.positions);
}

// The logits row of position (b, s), in elements from p.logits: b * sb + s * ss, or, with a compact [M, V] logits
// (a caller that computed logits for the positions it needs scanned only), row logit_rows(b, s) clamped into
// [0, M): never a read outside the tensor, whatever the map holds (the launcher cannot check device values).
__device__ __forceinline__ int64_t unmask_logits_offset(const UnmaskParams& p, int b, int s) {
  if (p.logit_rows.ptr == nullptr) return b * p.logits_sb + s * p.logits_ss;
  int64_t r = p.logit_rows(b, s);
  r = r < 0 ? 0 : (r < p.num_logit_rows ? r : p.num_logit_rows - 1);
  return r * p.logits_sb;
}

// Two-level sampling, pass 2, in the CTA that completes row `row` (the last of its nsplit CTAs to arrive):
// merge the row's partials into (m, sum) and its bucket j*, re-read bucket j*'s <= kBucket logits (streamed
// moments ago: mostly L2 hits), give each token its own noise (the per-token stream, counter row * V + t) and
// keep the Gumbel-max token, ties to the lower id. The row's result replaces its partial 0, which is all that
// finish_sequence reads of it in this mode.
template <typename Tag>
__device__ void finish_row(const UnmaskParams& p, int64_t row, const char* rowp, UnmaskShared& sh) {
  using E = Elem<Tag>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float inv_t = p.inv_temp, c2 = inv_t * kLog2e;
  UnmaskPartial* part = p.partials + row * p.nsplit;
  if (warp == 0) {
    ScanState st;
    for (int k = lane; k < p.nsplit; k += 32) {
      merge_state(st, load_partial(part + k), c2);
    }
    warp_merge(st, c2);
    if (lane == 0) {
      sh.row_m = st.m;
      sh.row_sum = st.sum;
      sh.bucket = st.idx == kNoIndex ? 0 : st.idx;  // kNoIndex only with NaN logits (unsupported)
    }
  }
  __syncthreads();
  const int t0 = sh.bucket * kBucket;
  const int len = p.vocab - t0 < kBucket ? p.vocab - t0 : kBucket;
  const uint64_t row_ctr = unmask_noise_row(p, row) * uint64_t(p.vocab) + uint64_t(t0);
  const NoiseKey key = noise_key(p);
  ScanState st;
  for (int e = tid; e < len; e += kUnmaskThreads) {  // increasing ids per thread
    const float sc = __fmul_rn(E::load1(rowp, t0 + e), inv_t);
    merge_best(st.score, st.pick, st.idx, __fadd_rn(sc, key.gumbel(row_ctr + uint64_t(e))), sc, t0 + e);
  }
  // the row's (m, sum) enter through thread 0 alone: merged with the others' empty sums they stay exact
  if (tid == 0) {
    st.m = sh.row_m;
    st.sum = sh.row_sum;
  }
  cta_to_partial(st, sh, part, c2);
}

__device__ void finish_sequence(const UnmaskParams& p, int b, char* dyn, int nmerge) {
  const int S = p.positions;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* cf = reinterpret_cast<float*>(dyn);
  float* lp = cf + S;
  int32_t* tk = reinterpret_cast<int32_t*>(lp + S);
  uint8_t* ms = reinterpret_cast<uint8_t*>(tk + S);
  const int32_t q = p.quota[b];
  const float c2 = p.inv_temp * kLog2e;

  for (int i = tid; i < S; i += kUnmaskThreads) ms[i] = (q > 0 && p.masked(b, i)) ? 1 : 0;
  __syncthreads();

  // 1. merge each masked position's first `nmerge` partials (nsplit; 1 for two-level sampling, where
  //    finish_row left the row's result in partial 0): lane groups of G (a power of two >= nmerge, at most 32)
  //    take one position each, so a warp merges 32 / G positions at once (their loads in flight together)
  int G = 1;
  while (G < nmerge && G < 32) G <<= 1;
  const int per_warp = 32 / G, sub = lane % G, slot = lane / G;
  for (int first = warp * per_warp; first < S; first += kUnmaskWarps * per_warp) {  // warp-uniform
    const int i = first + slot;
    const bool act = i < S && ms[i];
    ScanState st;
    if (act) {
      const UnmaskPartial* part = p.partials + (int64_t(b) * S + i) * p.nsplit;
      for (int k = sub; k < nmerge; k += G) {
        merge_state(st, load_partial(part + k), c2);
      }
    }
    for (int mask = G >> 1; mask >= 1; mask >>= 1) merge_state(st, shfl_state(st, mask), c2);
    if (act && sub == 0) {
      // logp = s_pick - logsumexp(s) = (s_pick - s_max) - log(sum exp(s - s_max)), as torch.logsumexp
      const float logp = __fsub_rn(st.pick, __fmul_rn(st.m, p.inv_temp)) - logf(st.sum);
      cf[i] = expf(logp);
      lp[i] = logp;
      tk[i] = st.idx == kNoIndex ? 0 : st.idx;  // kNoIndex only with NaN logits (unsupported)
    }
  }
  __syncthreads();

  // 2. select (quota most confident, ties to the lower position, plus conf >= threshold) and write
  bool any_masked = false, any_eos = false;
  const int32_t step = p.step[b];
  for (int i = tid; i < S; i += kUnmaskThreads) {
    bool still_masked = false;
    bool sel = false;
    if (ms[i]) {
      const float c = cf[i];
      int rank = 0;
      for (int j = 0; j < S && rank < q; ++j) rank += (ms[j] && conf_before(cf[j], j, c, i)) ? 1 : 0;
      sel = rank < q || c >= p.threshold;
      still_masked = !sel;
    } else {
      still_masked = p.masked(b, i);  // quota <= 0 rows keep their mask
    }
    int64_t token;
    int32_t smap;
    if (sel) {
      token = tk[i];
      smap = step;
      p.tokens(b, i) = token;
      p.step_map(b, i) = step;
      p.logp(b, i) = lp[i];
      p.conf(b, i) = cf[i];
      p.masked(b, i) = false;
    } else {
      token = p.tokens(b, i);
      smap = p.step_map(b, i);
    }
    any_masked |= still_masked;
    if (!still_masked && smap >= 0) {
      for (int e = 0; e < p.num_eos; ++e) any_eos |= (token == p.eos_ids[e]);
    }
  }
  any_masked = __syncthreads_or(any_masked);
  any_eos = __syncthreads_or(any_eos);
  if (tid == 0) {
    p.block_done[b] = !any_masked;
    p.eos_seen[b] = any_eos;
    p.counters[b] = 0;  // every CTA of b has arrived: ready for the next launch
  }
}

// ---------------------------------------------------------------------------------------------- kernel

// 4 resident CTAs per SM (at most 64 registers) when greedy or two-level, 3 (80) for per-token sampling (the
// RNG path).
template <typename Tag, int kMode>
__global__ void __launch_bounds__(kUnmaskThreads, kMode == kPickToken ? 3 : 4)
    threshold_unmask_kernel(const UnmaskParams p) {
  using E = Elem<Tag>;
  constexpr bool kGreedy = kMode == kPickGreedy;
  constexpr int kPerVec = E::kPerVec;
  constexpr int N = kUnmaskUnroll * kPerVec;
  constexpr int64_t kElemBytes = 16 / kPerVec;
  constexpr float kInf = INFINITY;
  static_assert(N <= kUnmaskStage && N <= 32, "a group must fit the staging block and a 32-bit mask");

  __shared__ UnmaskShared sh;
#ifndef LRF_KERNEL_EMULATION
  extern __shared__ __align__(16) char dyn[];
#else
  char* dyn = lrf::emu::dynamic_smem();
#endif

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t item = blockIdx.x;
  const int64_t row = item / p.nsplit;
  const int chunk = int(item - row * p.nsplit);
  const int S = p.positions;
  const int b = int(row / S);
  const int s = int(row - int64_t(b) * S);
  const int V = p.vocab;
  const bool scanned = p.quota[b] > 0 && p.masked(b, s);
  // the map is read only where a row is scanned (a compact logits holds no row for the other positions)
  const char* rowp = static_cast<const char*>(p.logits) + (scanned ? unmask_logits_offset(p, b, s) : 0) * kElemBytes;

  if (scanned) {
    // row = [head scalars | nvec 16-byte vectors | tail scalars]
    const int mis = int(((16 - (reinterpret_cast<uintptr_t>(rowp) & 15)) & 15) / kElemBytes);
    const int head = mis < V ? mis : V;
    const int nvec = (V - head) / kPerVec;
    const int tail0 = head + nvec * kPerVec;
    const int per_chunk = (nvec + p.nsplit - 1) / p.nsplit;
    const int vbeg = chunk * per_chunk < nvec ? chunk * per_chunk : nvec;
    const int vend = vbeg + per_chunk < nvec ? vbeg + per_chunk : nvec;
    const float inv_t = p.inv_temp;
    const float c2 = inv_t * kLog2e;

    ScanState st;
    Sampler smp;
    if constexpr (kMode == kPickBucket) {
      const int nb = unmask_nbuckets(V);
      const int per = (nb + p.nsplit - 1) / p.nsplit;
      const int jbeg = chunk * per < nb ? chunk * per : nb;
      const int jend = jbeg + per < nb ? jbeg + per : nb;
      scan_buckets<Tag>(st, rowp, mis == 0, V, jbeg, jend, kBucketTag + unmask_noise_row(p, row) * uint64_t(nb),
                        noise_key(p), inv_t, c2, lane, warp);
    }
    if constexpr (kMode == kPickToken) {
      smp.ring = reinterpret_cast<CandRing*>(dyn) + warp;
      smp.stage = reinterpret_cast<float*>(reinterpret_cast<CandRing*>(dyn) + kUnmaskWarps) + warp * kUnmaskStage * 32;
      smp.head = 0;
      smp.count = 0;
      smp.thr = -kInf;
      smp.cta_thr = &sh.thr;
      if (tid == 0) sh.thr = ordered_bits(-kInf);
      __syncthreads();  // CTA-uniform branch (one row per CTA)
      smp.row_ctr = unmask_noise_row(p, row) * uint64_t(V);
      smp.key = noise_key(p);
    }

    if (kMode != kPickBucket && chunk == 0 && head > 0) {
      const bool ok = tid < head;
      process_one<kGreedy>(st, smp, ok ? E::load1(rowp, tid) : -kInf, ok, tid, inv_t, c2, lane);
    }
    const uint4* vecs = reinterpret_cast<const uint4*>(rowp + int64_t(head) * kElemBytes);
    for (int g = vbeg; kMode != kPickBucket && g < vend; g += kUnmaskUnroll * kUnmaskThreads) {  // CTA-uniform
      uint4 raw[kUnmaskUnroll];
#pragma unroll
      for (int u = 0; u < kUnmaskUnroll; ++u) {  // unpredicated: lanes past the end re-read the last vector
        const int v = g + tid + u * kUnmaskThreads;
        raw[u] = load_stream16(vecs + (v < vend ? v : vend - 1));
      }
      float x[N];
      uint32_t valid = 0;
#pragma unroll
      for (int u = 0; u < kUnmaskUnroll; ++u) {  // branch-free, so that ptxas keeps the four loads up front
        const bool ok = g + tid + u * kUnmaskThreads < vend;
        E::unpack(raw[u], x + u * kPerVec);
#pragma unroll
        for (int j = 0; j < kPerVec; ++j) x[u * kPerVec + j] = ok ? x[u * kPerVec + j] : -kInf;
        valid |= (ok ? (1u << kPerVec) - 1u : 0u) << (u * kPerVec);
      }
      process_group<kGreedy, N, kPerVec>(st, smp, x, valid, head + (g + tid) * kPerVec, kUnmaskThreads * kPerVec,
                                         inv_t, c2, lane);
    }
    if (kMode != kPickBucket && chunk == p.nsplit - 1 && tail0 < V) {
      const int t = tail0 + tid;
      const bool ok = t < V;
      process_one<kGreedy>(st, smp, ok ? E::load1(rowp, t) : -kInf, ok, t, inv_t, c2, lane);
    }
    if constexpr (kMode == kPickToken) {
      if (smp.count > 0) smp.flush(st, smp.count, lane);
    } else if constexpr (kGreedy) {
      st.pick = st.idx == kNoIndex ? -kInf : __fmul_rn(st.score, inv_t);
    }

    cta_to_partial(st, sh, p.partials + row * p.nsplit + chunk, c2);
  }

  if constexpr (kMode == kPickBucket) {
    // row arrival: the last CTA of the row picks its token (finish_row), then alone arrives for the sequence
    if (p.nsplit > 1) {
      if (tid == 0) {
        __threadfence();
        const int arrived = atomicAdd(p.row_counters + row, 1);
        sh.is_last = arrived == p.nsplit - 1;
        if (sh.is_last) {
          p.row_counters[row] = 0;  // every CTA of the row has arrived
          __threadfence();  // acquire in the observing thread too, before the barrier (the grid.sync ordering)
        }
      }
      __syncthreads();
      if (!sh.is_last) return;
      __threadfence();
    }
    if (scanned) finish_row<Tag>(p, row, rowp, sh);  // CTA-uniform
    __syncthreads();  // every thread has read sh.is_last before it is reused below
  }

  // arrival: the last CTA of sequence b finishes it
  if (tid == 0) {
    __threadfence();  // this CTA's partial is visible device-wide before it is counted
    const int arrived = atomicAdd(p.counters + b, 1);
    sh.is_last = arrived == (kMode == kPickBucket ? S : S * p.nsplit) - 1;
    if (sh.is_last) __threadfence();  // acquire in the observing thread too, before the barrier
  }
  __syncthreads();
  if (!sh.is_last) return;
  __threadfence();  // acquire: the other CTAs' partials (read with ld.cg, L2)
  finish_sequence(p, b, dyn, kMode == kPickBucket ? 1 : p.nsplit);
}

}  // namespace kernels
}  // namespace lrf
