// LM-head rows: per-token log-softmax statistics and the softmax gradient, in place over a chunk of logits.
// Device code only (no torch); the launcher (chunk loop, cuBLAS GEMMs through ATen) is csrc/grpo_loss.cu.
//
// One CTA per row (token) of a [rows, V] logits chunk (bf16 / fp16 / fp32 / fp64, row-major, written by the
// GEMM hidden_chunk @ W^T). Three modes:
//   kLogprobs  pass 1 only: online max / sum-exp (and entropy) over the row -> logp, lse, entropy.
//   kGrpo      pass 1, then the GRPO loss terms of the token from logp (ratio, clip, k3 KL, NLL) and
//              g = d loss / d logp (per-token reduction weights given), then pass 2 overwrites the row with
//              d loss / d logits = g * (onehot(target) - softmax). Forward and backward fused.
//   kGrad      pass 2 only, with lse and g = grad_logp given (backward of kLogprobs).
// The vocabulary id `suppress` (>= 0) is left out of the softmax (its logit counts as -inf; its gradient is 0).
//
// Precision: the logits buffer has the input dtype (bf16 for bf16 inputs, exactly what the PyTorch
// computation `(h @ W.T).float()` sees); all softmax / loss arithmetic is in Acc (float; double for fp64
// inputs); the gradient is rounded once to the buffer dtype, which is what the backward GEMMs consume (as
// PyTorch autograd's bf16 grad of `logits.float()` would be).
//
// Memory traffic per row: pass 1 reads it, pass 2 reads it again and writes it (16-byte vectors when
// V * sizeof(T) is a multiple of 16 and the buffer is 16-byte aligned; scalar otherwise).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace lrf {
namespace kernels {

constexpr int kRowThreads = 256;

enum RowMode : int { kLogprobs = 0, kGrpo = 1, kGrad = 2 };

// Terms written per token in kGrpo mode ([kGrpoTerms, T], Acc): the policy term -min(rho A, clip(rho) A),
// the k3 KL estimate (0 without a reference), the ratio rho, and 1 where the clipped term was taken.
constexpr int kGrpoTerms = 4;

template <typename Acc>
struct LmHeadRowParams {
  void* logits;             // [rows, vocab] of T, row-major; overwritten with d loss / d logits (kGrpo, kGrad)
  int64_t vocab;            // V
  int64_t rows;             // tokens in this chunk
  int64_t row0;             // token index of row 0: per-token arrays are read / written at row0 + r
  int64_t tokens;           // T (stride of the terms rows)
  int64_t suppress;         // vocabulary id excluded from the softmax, or -1
  bool vec;                 // 16-byte vector path
  bool write_grad;          // kGrpo: write d loss / d logits (false: loss terms only, no pass 2)
  const int64_t* targets;   // [T]
  // kGrpo inputs ([T], Acc); old_logp null = on-policy (old = logp, rho = 1); ref_logp / w_kl null when
  // beta == 0, w_nll null when mu == 0
  const Acc* old_logp;
  const Acc* ref_logp;
  const Acc* advantages;
  const Acc* w_pg;          // weight of the token's policy term in the reduction
  const Acc* w_kl;          // weight of its k3 term (beta applied here, not in the weight)
  const Acc* w_nll;         // weight of its -logp term (0 for tokens of incorrect sequences; mu applied here)
  Acc clip_lo, clip_hi;     // 1 - eps_low, 1 + eps_high
  Acc beta, mu;
  // kGrad inputs ([T], Acc)
  const Acc* lse_in;
  const Acc* grad_logp;
  // outputs ([T], Acc; null = not wanted)
  Acc* logp;
  Acc* lse_out;
  Acc* entropy;
  Acc* terms;               // [kGrpoTerms, T]
};

// ---- element types ----------------------------------------------------------------------------------------

__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_acc(double x) { return static_cast<T>(x); }

// exp in Acc: the fast intrinsic for 16-bit logits (its ~2 ulp float error is far below their rounding),
// accurate expf / exp for fp32 / fp64 logits.
template <typename T> __device__ __forceinline__ float row_exp(float x) { return expf(x); }
template <> __device__ __forceinline__ float row_exp<__nv_bfloat16>(float x) { return __expf(x); }
template <> __device__ __forceinline__ float row_exp<__half>(float x) { return __expf(x); }
template <typename T> __device__ __forceinline__ double row_exp(double x) { return exp(x); }

__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }

template <typename Acc> __device__ __forceinline__ Acc neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000ll); }
template <typename Acc> __device__ __forceinline__ Acc quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fffffff); }
template <> __device__ __forceinline__ double quiet_nan<double>() { return __longlong_as_double(0x7fffffffffffffffll); }

// N consecutive elements: one 16-byte access when N * sizeof(T) == 16, else element by element.
template <typename T, int N, typename Acc>
__device__ __forceinline__ void load_n(const T* src, Acc (&x)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    union { uint4 u; T e[N]; } v;
    v.u = *reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = to_acc(v.e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = to_acc(src[k]);
  }
}

template <typename T, int N, typename Acc>
__device__ __forceinline__ void store_n(T* dst, const Acc (&x)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    union { uint4 u; T e[N]; } v;
#pragma unroll
    for (int k = 0; k < N; ++k) v.e[k] = from_acc<T>(x[k]);
    *reinterpret_cast<uint4*>(dst) = v.u;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = from_acc<T>(x[k]);
  }
}

// ---- online softmax statistics ------------------------------------------------------------------------------
// m = running max, s = sum exp(l - m), u = sum exp(l - m) * (l - m) (entropy = log s - u / s).
template <typename Acc>
struct SoftmaxStats {
  Acc m, s, u;
};

template <typename T, typename Acc, bool kEntropy, int N>
__device__ __forceinline__ void stats_update(SoftmaxStats<Acc>& st, const Acc (&x)[N]) {
  Acc vmax = x[0];
#pragma unroll
  for (int k = 1; k < N; ++k) vmax = x[k] > vmax ? x[k] : vmax;
  if (vmax == neg_inf<Acc>()) return;  // nothing but excluded entries
  if (vmax > st.m) {
    if (st.m != neg_inf<Acc>()) {  // rescale the sums to the new max (s == u == 0 while m == -inf)
      const Acc a = row_exp<T>(st.m - vmax);
      if constexpr (kEntropy) st.u = a * (st.u + (st.m - vmax) * st.s);
      st.s *= a;
    }
    st.m = vmax;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const Acc d = x[k] - st.m;
    const Acc e = row_exp<T>(d);
    st.s += e;
    if constexpr (kEntropy) st.u += e > Acc(0) ? e * d : Acc(0);  // -inf entries: e == 0, skip 0 * -inf
  }
}

template <typename T, typename Acc, bool kEntropy>
__device__ __forceinline__ SoftmaxStats<Acc> stats_merge(SoftmaxStats<Acc> a, SoftmaxStats<Acc> b) {
  if (b.m == neg_inf<Acc>()) return a;
  if (a.m == neg_inf<Acc>()) return b;
  const Acc m = a.m > b.m ? a.m : b.m;
  const Acc ea = row_exp<T>(a.m - m), eb = row_exp<T>(b.m - m);
  SoftmaxStats<Acc> r;
  r.m = m;
  r.s = ea * a.s + eb * b.s;
  r.u = kEntropy ? ea * (a.u + (a.m - m) * a.s) + eb * (b.u + (b.m - m) * b.s) : Acc(0);
  return r;
}

// Block-wide merge; the result is valid in every thread. `sh` holds one entry per warp.
template <typename T, typename Acc, bool kEntropy>
__device__ __forceinline__ SoftmaxStats<Acc> stats_block(SoftmaxStats<Acc> st, SoftmaxStats<Acc>* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    SoftmaxStats<Acc> other;
    other.m = __shfl_xor_sync(0xffffffffu, st.m, o);
    other.s = __shfl_xor_sync(0xffffffffu, st.s, o);
    other.u = kEntropy ? __shfl_xor_sync(0xffffffffu, st.u, o) : Acc(0);
    st = stats_merge<T, Acc, kEntropy>(st, other);
  }
  if (lane == 0) sh[warp] = st;
  __syncthreads();
  st = sh[0];
#pragma unroll
  for (int w = 1; w < kRowThreads / 32; ++w) st = stats_merge<T, Acc, kEntropy>(st, sh[w]);
  return st;  // same merge order in every thread: identical results
}

// ---- the two passes -------------------------------------------------------------------------------------------

// Indices within a row are int32 (V < 2^31, checked by the launcher): fewer registers in the hot loops.
template <typename T, typename Acc, bool kEntropy, int N>
__device__ __forceinline__ SoftmaxStats<Acc> row_pass1(const T* row, int32_t vocab, int32_t suppress) {
  SoftmaxStats<Acc> st{neg_inf<Acc>(), Acc(0), Acc(0)};
  const int32_t nvec = vocab / N;
#pragma unroll 2
  for (int32_t j = threadIdx.x; j < nvec; j += kRowThreads) {
    Acc x[N];
    load_n<T, N>(row + j * N, x);
    const int32_t rel = suppress - j * N;
    if (rel >= 0 && rel < N) {
#pragma unroll
      for (int k = 0; k < N; ++k) x[k] = k == rel ? neg_inf<Acc>() : x[k];
    }
    stats_update<T, Acc, kEntropy, N>(st, x);
  }
  return st;
}

// row <- g * (onehot(target) - exp(l - lse)), 0 at `suppress`.
template <typename T, typename Acc, int N>
__device__ __forceinline__ void row_pass2(T* row, int32_t vocab, int32_t suppress, int32_t target, Acc lse, Acc g) {
  const int32_t nvec = vocab / N;
  if (g == Acc(0)) {  // no gradient through this token (clipped, zero weight): only zeros to write
    const Acc z[N] = {};
    for (int32_t j = threadIdx.x; j < nvec; j += kRowThreads) store_n<T, N>(row + j * N, z);
    return;
  }
#pragma unroll 2
  for (int32_t j = threadIdx.x; j < nvec; j += kRowThreads) {
    Acc x[N];
    load_n<T, N>(row + j * N, x);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int32_t v = j * N + k;
      const Acc gp = g * row_exp<T>(x[k] - lse);
      x[k] = v == suppress ? Acc(0) : (v == target ? g - gp : -gp);
    }
    store_n<T, N>(row + j * N, x);
  }
}

// d loss / d logp of one token and its loss terms (kGrpo). Mirrors grpo_token_loss's autograd exactly:
// rho = exp(clamp(d, -10, 10)) passes gradient for -10 <= d <= 10; -min(u, c) takes the gradient of the
// smaller one (u == c happens inside the clip range, where both have the gradient of u).
template <typename Acc>
__device__ __forceinline__ Acc grpo_dlogp(const LmHeadRowParams<Acc>& p, int64_t t, Acc logp, Acc* out_terms) {
  const Acc d = p.old_logp != nullptr ? logp - p.old_logp[t] : Acc(0);  // null: on-policy, rho = 1
  const Acc dc = d < Acc(-10) ? Acc(-10) : (d > Acc(10) ? Acc(10) : d);
  const Acc rho = row_exp<Acc>(dc);
  const Acc adv = p.advantages[t];
  const Acc u = rho * adv;
  const Acc rc = rho < p.clip_lo ? p.clip_lo : (rho > p.clip_hi ? p.clip_hi : rho);
  const Acc c = rc * adv;
  const bool pass_d = d >= Acc(-10) && d <= Acc(10);
  Acc g = (u <= c && pass_d) ? -adv * rho * p.w_pg[t] : Acc(0);
  Acc k3 = Acc(0);
  if (p.ref_logp != nullptr) {
    const Acc dr = logp - p.ref_logp[t];
    const Acc e = row_exp<Acc>(-dr);
    k3 = e - Acc(1) + dr;
    g += p.beta * p.w_kl[t] * (Acc(1) - e);
  }
  if (p.w_nll != nullptr) g -= p.mu * p.w_nll[t];
  out_terms[0] = -(u < c ? u : c);
  out_terms[1] = k3;
  out_terms[2] = rho;
  out_terms[3] = c < u ? Acc(1) : Acc(0);
  return g;
}

template <typename T, typename Acc, int kMode, bool kEntropy, int N>
__device__ __forceinline__ void lm_head_row(const LmHeadRowParams<Acc>& p, int64_t r, SoftmaxStats<Acc>* sh_stats,
                                            Acc* sh_scalars) {
  T* row = static_cast<T*>(p.logits) + r * p.vocab;
  const int64_t t = p.row0 + r;
  const int64_t y = p.targets[t];
  const bool y_ok = y >= 0 && y < p.vocab && y != p.suppress;
  Acc lse, g;
  if constexpr (kMode != kGrad) {
    const SoftmaxStats<Acc> st = stats_block<T, Acc, kEntropy>(
        row_pass1<T, Acc, kEntropy, N>(row, static_cast<int32_t>(p.vocab), static_cast<int32_t>(p.suppress)), sh_stats);
    if (threadIdx.x == 0) {
      lse = st.m + acc_log(st.s);
      // an out-of-range target (-1 included when nothing is suppressed) reads nothing: NaN (the Python side
      // validates targets); the suppressed id: -inf
      const Acc logp = y_ok ? to_acc(row[y]) - lse
                            : (p.suppress >= 0 && y == p.suppress ? neg_inf<Acc>() : quiet_nan<Acc>());
      p.logp[t] = logp;
      if (p.lse_out != nullptr) p.lse_out[t] = lse;
      if constexpr (kEntropy) {
        if (p.entropy != nullptr) p.entropy[t] = acc_log(st.s) - st.u / st.s;
      }
      if constexpr (kMode == kGrpo) {
        Acc terms[kGrpoTerms];
        g = grpo_dlogp(p, t, logp, terms);
#pragma unroll
        for (int k = 0; k < kGrpoTerms; ++k) p.terms[k * p.tokens + t] = terms[k];
        sh_scalars[0] = lse;
        sh_scalars[1] = g;
      }
    }
    if (kMode == kLogprobs || !p.write_grad) return;  // uniform over the block
    __syncthreads();  // every thread read its part of the row (and thread 0 the target) before pass 2 writes
    lse = sh_scalars[0];
    g = sh_scalars[1];
  } else {
    lse = p.lse_in[t];
    g = p.grad_logp[t];
  }
  // an out-of-range or suppressed target matches no column (the suppressed column gets 0 anyway)
  row_pass2<T, Acc, N>(row, static_cast<int32_t>(p.vocab), static_cast<int32_t>(p.suppress),
                       y_ok ? static_cast<int32_t>(y) : -2, lse, g);
}

template <typename T, typename Acc, int kMode, bool kEntropy>
__global__ void __launch_bounds__(kRowThreads) lm_head_rows_kernel(const LmHeadRowParams<Acc> p) {
  __shared__ SoftmaxStats<Acc> sh_stats[kRowThreads / 32];
  __shared__ Acc sh_scalars[2];
  constexpr int kVecN = 16 / sizeof(T);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    if (p.vec) {
      lm_head_row<T, Acc, kMode, kEntropy, kVecN>(p, r, sh_stats, sh_scalars);
    } else {
      lm_head_row<T, Acc, kMode, kEntropy, 1>(p, r, sh_stats, sh_scalars);
    }
    __syncthreads();  // shared memory is reused by the next row
  }
}

}  // namespace kernels
}  // namespace lrf
