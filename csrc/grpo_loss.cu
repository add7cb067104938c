// Launchers of the LightningRL objective ops (device code: kernels/group_normalize.cuh, kernels/grpo_loss.cuh).
// Contracts: ARCHITECTURE.md and lightningrl_fast/ops/grpo_loss.py.
//
//   group_normalize            one single-CTA kernel (hash + stable counting sort, deterministic, no host sync)
//   linear_logprobs            per-token log-probs (+ lse, entropy) from hidden [T, H] and the LM head [V, H]
//   linear_logprobs_backward   grad_hidden / grad_weight from grad_logp (recomputes each chunk's logits)
//   fused_linear_grpo_loss     logp, loss terms and grad_hidden / grad_weight in one pass over the chunks
//
// The LM-head ops loop over token chunks of `chunk` rows: logits = hidden_chunk @ W^T (cuBLAS through at::mm_out,
// into one [chunk, V] buffer of the input dtype reused by every chunk), one row kernel over the chunk, and for
// the gradient grad_hidden_chunk = dlogits @ W (into the output rows) and grad_W (+)= dlogits^T @ hidden_chunk
// (cuBLAS beta = 1 in place; accumulated in the weight dtype, as autograd accumulates per-chunk grads). Extra
// memory: the chunk buffer, O(chunk x V), plus the outputs. Everything is enqueued on the current stream and
// nothing reads device memory on the host.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

#include "checks.h"
#include "kernels/group_normalize.cuh"
#include "kernels/grpo_loss.cuh"

namespace lrf {
namespace {

// ATen scalar type -> the CUDA element type of the kernels, and its accumulation type.
template <typename S> struct Cuda { using type = S; };
template <> struct Cuda<at::BFloat16> { using type = __nv_bfloat16; };
template <> struct Cuda<at::Half> { using type = __half; };
template <typename T> using AccOf = std::conditional_t<std::is_same_v<T, double>, double, float>;

at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

void check_token_vector(const at::Tensor& x, const char* name, int64_t T, at::ScalarType dtype,
                        const at::Tensor& like) {
  LRF_CHECK(x.dim() == 1 && x.size(0) == T, name, " must have shape [", T, "], got ", x.sizes());
  LRF_CHECK(x.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", x.scalar_type());
  LRF_CHECK(x.device() == like.device(), name, " is on ", x.device(), " but hidden is on ", like.device());
  LRF_CHECK(x.is_contiguous(), name, " must be contiguous, got strides ", x.strides());
}

// Shared checks of the LM-head ops. Returns (T, H, V).
std::tuple<int64_t, int64_t, int64_t> check_lm_head(const at::Tensor& hidden, const at::Tensor& weight,
                                                    const at::Tensor& targets, int64_t suppress_token, int64_t chunk) {
  CHECK_CUDA(hidden);
  CHECK_DIM(hidden, 2);
  CHECK_DIM(weight, 2);
  CHECK_DTYPE_IN(hidden, at::kBFloat16, at::kHalf, at::kFloat, at::kDouble);
  CHECK_SAME_DTYPE(hidden, weight);
  CHECK_SAME_DEVICE(hidden, weight);
  CHECK_CONTIGUOUS(hidden);
  CHECK_CONTIGUOUS(weight);
  const int64_t T = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  LRF_CHECK(weight.size(1) == H, "weight must have shape [V, ", H, "] (hidden has ", H, " features), got ",
              weight.sizes());
  LRF_CHECK(V >= 1 && V <= (int64_t(1) << 31) - (int64_t(1) << 16), "weight must have 1 <= V <= 2^31 - 2^16 rows, got ",
            V);
  check_token_vector(targets, "targets", T, at::kLong, hidden);
  LRF_CHECK(suppress_token >= -1 && suppress_token < V, "suppress_token must be -1 (none) or in [0, ", V,
              "), got ", suppress_token);
  LRF_CHECK(chunk >= 1, "chunk must be positive, got ", chunk);
  return {T, H, V};
}

template <typename T, typename Acc, int kMode, bool kEntropy>
void launch_rows(const kernels::LmHeadRowParams<Acc>& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(p.rows, int64_t(1) << 30));
  kernels::lm_head_rows_kernel<T, Acc, kMode, kEntropy><<<blocks, kernels::kRowThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The chunk loop. `setup(p)` fills the mode's inputs / outputs; `kGradient` runs the backward GEMMs.
template <typename S, int kMode, bool kEntropy, typename Setup>
void run_chunks(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, int64_t suppress,
                int64_t chunk, std::optional<at::Tensor>& grad_hidden, std::optional<at::Tensor>& grad_weight,
                Setup&& setup) {
  using T = typename Cuda<S>::type;
  using Acc = AccOf<S>;
  const int64_t T_ = hidden.size(0), V = weight.size(0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rows = std::min(chunk, T_);
  at::Tensor buf = at::empty({rows, V}, hidden.options());
  const bool aligned = reinterpret_cast<uintptr_t>(buf.data_ptr()) % 16 == 0;

  kernels::LmHeadRowParams<Acc> p{};
  p.vocab = V;
  p.tokens = T_;
  p.suppress = suppress;
  p.vec = aligned && (V * int64_t(sizeof(T))) % 16 == 0;
  p.targets = targets.data_ptr<int64_t>();
  p.write_grad = grad_hidden.has_value() || grad_weight.has_value();
  setup(p);

  const at::Tensor wt = weight.t();
  for (int64_t t0 = 0; t0 < T_; t0 += chunk) {
    const int64_t c = std::min(chunk, T_ - t0);
    const at::Tensor h = hidden.narrow(0, t0, c);
    at::Tensor logits = buf.narrow(0, 0, c);
    at::mm_out(logits, h, wt);
    p.logits = logits.data_ptr();
    p.rows = c;
    p.row0 = t0;
    launch_rows<T, Acc, kMode, kEntropy>(p, stream);
    if constexpr (kMode != kernels::kLogprobs) {
      if (grad_hidden.has_value()) {
        at::Tensor out = grad_hidden->narrow(0, t0, c);
        at::mm_out(out, logits, weight);
      }
      if (grad_weight.has_value()) {
        if (t0 == 0) {
          at::mm_out(*grad_weight, logits.t(), h);
        } else {
          grad_weight->addmm_(logits.t(), h);
        }
      }
    }
  }
}

void alloc_grads(const at::Tensor& hidden, const at::Tensor& weight, bool need_h, bool need_w,
                 std::optional<at::Tensor>& gh, std::optional<at::Tensor>& gw) {
  if (need_h) gh = at::empty_like(hidden);
  if (need_w) gw = hidden.size(0) == 0 ? at::zeros_like(weight) : at::empty_like(weight);
}

}  // namespace

at::Tensor group_normalize(const at::Tensor& rewards, const at::Tensor& group_ids, const at::Tensor& weights,
                           bool decoupled) {
  CHECK_CUDA(rewards);
  CHECK_DIM(rewards, 2);
  const int64_t S = rewards.size(0), R = rewards.size(1);
  CHECK_SHAPE(group_ids, S);
  CHECK_SHAPE(weights, R);
  CHECK_DTYPE_IN(rewards, at::kBFloat16, at::kHalf, at::kFloat, at::kDouble);
  CHECK_DTYPE_IN(weights, at::kBFloat16, at::kHalf, at::kFloat, at::kDouble);
  CHECK_DTYPE(group_ids, at::kLong);
  CHECK_SAME_DEVICE(rewards, group_ids);
  CHECK_SAME_DEVICE(rewards, weights);
  LRF_CHECK(S >= 1, "rewards has no samples");
  LRF_CHECK(S < (int64_t(1) << 29), "group_normalize: at most 2^29 samples, got ", S);
  LRF_CHECK(R >= 1, "rewards must have at least one column");

  const c10::cuda::CUDAGuard guard(rewards.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor r = rewards.contiguous();
  const at::Tensor g = group_ids.contiguous();
  const at::Tensor w = weights.to(at::kDouble).contiguous();
  const bool out_double = rewards.scalar_type() == at::kDouble;
  at::Tensor out = at::empty({S}, rewards.options().dtype(out_double ? at::kDouble : at::kFloat));

  int64_t cap = 32;
  while (cap < 2 * S) cap *= 2;
  at::Tensor ws = at::empty({4 * cap + 2 * S}, rewards.options().dtype(at::kInt));
  at::Tensor total = at::empty({S}, rewards.options().dtype(at::kDouble));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "group_normalize", [&] {
    using T = typename Cuda<scalar_t>::type;
    kernels::GroupNormalizeParams<T> p{};
    p.rewards = reinterpret_cast<const T*>(r.data_ptr<scalar_t>());
    p.group_ids = g.data_ptr<int64_t>();
    p.weights = w.data_ptr<double>();
    p.out = out.data_ptr();
    p.out_double = out_double;
    p.decoupled = decoupled;
    p.samples = S;
    p.rewards_per = R;
    p.cap = cap;
    int32_t* base = ws.data_ptr<int32_t>();
    p.table = base;
    p.count = base + cap;
    p.offset = base + 2 * cap;
    p.cursor = base + 3 * cap;
    p.slot = base + 4 * cap;
    p.order = base + 4 * cap + S;
    p.total = total.data_ptr<double>();
    kernels::group_normalize_kernel<T><<<1, kernels::kGroupNormThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> linear_logprobs(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, int64_t suppress_token,
    int64_t chunk, bool with_entropy) {
  const auto [T, H, V] = check_lm_head(hidden, weight, targets, suppress_token, chunk);
  (void)H;
  (void)V;
  const c10::cuda::CUDAGuard guard(hidden.device());
  const auto acc = hidden.options().dtype(acc_dtype(hidden.scalar_type()));
  at::Tensor logp = at::empty({T}, acc), lse = at::empty({T}, acc);
  std::optional<at::Tensor> entropy;
  if (with_entropy) entropy = at::empty({T}, acc);
  std::optional<at::Tensor> none_h, none_w;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "linear_logprobs", [&] {
    using Acc = AccOf<scalar_t>;
    auto setup = [&](kernels::LmHeadRowParams<Acc>& p) {
      p.logp = logp.data_ptr<Acc>();
      p.lse_out = lse.data_ptr<Acc>();
      p.entropy = with_entropy ? entropy->data_ptr<Acc>() : nullptr;
    };
    if (with_entropy) {
      run_chunks<scalar_t, kernels::kLogprobs, true>(hidden, weight, targets, suppress_token, chunk, none_h, none_w, setup);
    } else {
      run_chunks<scalar_t, kernels::kLogprobs, false>(hidden, weight, targets, suppress_token, chunk, none_h, none_w, setup);
    }
  });
  return {logp, lse, entropy};
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> linear_logprobs_backward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse,
    const at::Tensor& grad_logp, int64_t suppress_token, int64_t chunk, bool need_grad_hidden,
    bool need_grad_weight) {
  const auto [T, H, V] = check_lm_head(hidden, weight, targets, suppress_token, chunk);
  (void)H;
  (void)V;
  const at::ScalarType acc = acc_dtype(hidden.scalar_type());
  check_token_vector(lse, "lse", T, acc, hidden);
  check_token_vector(grad_logp, "grad_logp", T, acc, hidden);
  const c10::cuda::CUDAGuard guard(hidden.device());
  std::optional<at::Tensor> gh, gw;
  alloc_grads(hidden, weight, need_grad_hidden, need_grad_weight, gh, gw);
  if (!need_grad_hidden && !need_grad_weight) return {gh, gw};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "linear_logprobs_backward", [&] {
    using Acc = AccOf<scalar_t>;
    run_chunks<scalar_t, kernels::kGrad, false>(hidden, weight, targets, suppress_token, chunk, gh, gw,
                                                [&](kernels::LmHeadRowParams<Acc>& p) {
                                                  p.lse_in = lse.data_ptr<Acc>();
                                                  p.grad_logp = grad_logp.data_ptr<Acc>();
                                                });
  });
  return {gh, gw};
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
fused_linear_grpo_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                       const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
                       const at::Tensor& advantages, const at::Tensor& w_pg, const std::optional<at::Tensor>& w_kl,
                       const std::optional<at::Tensor>& w_nll, double eps_low, double eps_high, double beta, double mu,
                       int64_t suppress_token, int64_t chunk, bool need_grad_hidden, bool need_grad_weight,
                       bool with_entropy) {
  const auto [T, H, V] = check_lm_head(hidden, weight, targets, suppress_token, chunk);
  (void)H;
  (void)V;
  const at::ScalarType acc = acc_dtype(hidden.scalar_type());
  if (old_logp.has_value()) check_token_vector(*old_logp, "old_logp", T, acc, hidden);
  check_token_vector(advantages, "advantages", T, acc, hidden);
  check_token_vector(w_pg, "w_pg", T, acc, hidden);
  LRF_CHECK(eps_low >= 0 && eps_high >= 0, "eps_low / eps_high must be >= 0, got ", eps_low, ", ", eps_high);
  const bool use_kl = beta != 0.0, use_nll = mu != 0.0;
  if (use_kl) {
    LRF_CHECK(ref_logp.has_value() && w_kl.has_value(), "ref_logp and w_kl are required when beta != 0");
    check_token_vector(*ref_logp, "ref_logp", T, acc, hidden);
    check_token_vector(*w_kl, "w_kl", T, acc, hidden);
  }
  if (use_nll) {
    LRF_CHECK(w_nll.has_value(), "w_nll is required when mu != 0");
    check_token_vector(*w_nll, "w_nll", T, acc, hidden);
  }
  const c10::cuda::CUDAGuard guard(hidden.device());
  const auto opts = hidden.options().dtype(acc);
  at::Tensor logp = at::empty({T}, opts);
  at::Tensor terms = at::empty({kernels::kGrpoTerms, T}, opts);
  std::optional<at::Tensor> entropy;
  if (with_entropy) entropy = at::empty({T}, opts);
  std::optional<at::Tensor> gh, gw;
  alloc_grads(hidden, weight, need_grad_hidden, need_grad_weight, gh, gw);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "fused_linear_grpo_loss", [&] {
    using Acc = AccOf<scalar_t>;
    auto setup = [&](kernels::LmHeadRowParams<Acc>& p) {
      p.old_logp = old_logp.has_value() ? old_logp->data_ptr<Acc>() : nullptr;
      p.ref_logp = use_kl ? ref_logp->data_ptr<Acc>() : nullptr;
      p.advantages = advantages.data_ptr<Acc>();
      p.w_pg = w_pg.data_ptr<Acc>();
      p.w_kl = use_kl ? w_kl->data_ptr<Acc>() : nullptr;
      p.w_nll = use_nll ? w_nll->data_ptr<Acc>() : nullptr;
      // the clip bounds as PyTorch's clamp sees them: the Python float rounded to the tensor dtype
      p.clip_lo = static_cast<Acc>(1.0 - eps_low);
      p.clip_hi = static_cast<Acc>(1.0 + eps_high);
      p.beta = static_cast<Acc>(beta);
      p.mu = static_cast<Acc>(mu);
      p.logp = logp.data_ptr<Acc>();
      p.terms = terms.data_ptr<Acc>();
      p.entropy = with_entropy ? entropy->data_ptr<Acc>() : nullptr;
    };
    if (with_entropy) {
      run_chunks<scalar_t, kernels::kGrpo, true>(hidden, weight, targets, suppress_token, chunk, gh, gw, setup);
    } else {
      run_chunks<scalar_t, kernels::kGrpo, false>(hidden, weight, targets, suppress_token, chunk, gh, gw, setup);
    }
  });
  return {logp, terms, entropy, gh, gw};
}

}  // namespace lrf
