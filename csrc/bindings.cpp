// The only PYBIND11_MODULE of lightningrl_fast._C: build facts, then one m.def per op, sorted by name.
// CUDA entry points exist only in a CUDA build (LRF_WITH_CUDA, set by setup.py / CMakeLists.txt).
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>

#include "checks.h"  // kCudaArchs

namespace lrf {

#ifdef LRF_WITH_CUDA
// block_attn.cu
at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& cache_lens, const at::Tensor& chunk_lens,
                           int64_t block_size, double softmax_scale, int64_t num_splits, int64_t variant);

// grpo_loss.cu
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
fused_linear_grpo_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                       const std::optional<at::Tensor>& old_logp, const std::optional<at::Tensor>& ref_logp,
                       const at::Tensor& advantages, const at::Tensor& w_pg, const std::optional<at::Tensor>& w_kl,
                       const std::optional<at::Tensor>& w_nll, double eps_low, double eps_high, double beta, double mu,
                       int64_t suppress_token, int64_t chunk, bool need_grad_hidden, bool need_grad_weight,
                       bool with_entropy);
at::Tensor group_normalize(const at::Tensor& rewards, const at::Tensor& group_ids, const at::Tensor& weights,
                           bool decoupled);
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> linear_logprobs(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, int64_t suppress_token,
    int64_t chunk, bool with_entropy);
std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> linear_logprobs_backward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse,
    const at::Tensor& grad_logp, int64_t suppress_token, int64_t chunk, bool need_grad_hidden,
    bool need_grad_weight);
// kv_cache.cu
void kv_cache_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cache_lens, const at::Tensor& chunk_lens,
                    const std::optional<at::Tensor>& maybe_error_flag);
// linear.cu
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, bool pdl);
// rms_norm.cu
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor qk_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                        double eps, const std::optional<at::Tensor>& weight2, int64_t split);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// silu_mul.cu
at::Tensor silu_mul(const at::Tensor& gate_up);
// unmask.cu
std::tuple<at::Tensor, at::Tensor> threshold_unmask(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& masked, const at::Tensor& step_map,
    const at::Tensor& logp, const at::Tensor& conf, const at::Tensor& step, const at::Tensor& quota,
    const at::Tensor& eos_ids, const at::Tensor& seed, const at::Tensor& offset, double threshold,
    double temperature, int64_t top_k, double top_p, bool greedy, bool two_level,
    const std::optional<at::Tensor>& noise_rows, const std::optional<at::Tensor>& logit_rows);
#endif

}  // namespace lrf

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "lightningrl_fast C++/CUDA kernels; call them through lightningrl_fast.ops";

  m.def("has_cuda", [] {
#ifdef LRF_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "True when the module was compiled with its CUDA kernels.");
  m.def("cuda_archs", [] {
    std::string archs = lrf::kCudaArchs;  // "90a,100a" -> "90a;100a"; "" in a CPU build
    for (char& c : archs) c = (c == ',') ? ';' : c;
    return archs;
  }, "The CUDA architectures compiled in, ';'-separated (e.g. '90a'); '' in a CPU-only build.");

#ifdef LRF_WITH_CUDA
  m.def("add_rms_norm", &lrf::add_rms_norm,
        "(RMSNorm of x + residual, x + residual): the residual add and the next norm in one launch "
        "(see ops/rms_norm.py)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("block_attention", &lrf::block_attention,
        "Block-causal attention of a chunk against the KV cache; writes the chunk's K/V into the caches "
        "(see ARCHITECTURE.md). num_splits: KV splits, 0 = chosen from the shapes and the device. variant: 0 = "
        "automatic (mma.sync for now), 1 = mma.sync, 2 = wgmma (sm_90; not yet verified on hardware).",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("cache_lens"),
        py::arg("chunk_lens"), py::arg("block_size"), py::arg("softmax_scale"), py::arg("num_splits") = 0,
        py::arg("variant") = 0);
  m.def("fused_linear_grpo_loss", &lrf::fused_linear_grpo_loss,
        "GRPO loss from hidden states and the LM head, forward and backward fused per token chunk -> "
        "(logp [T], terms [4, T] (policy term, k3, ratio, clipped), entropy [T] | None, grad_hidden | None, "
        "grad_weight | None); see ops/grpo_loss.py",
        py::arg("hidden"), py::arg("weight"), py::arg("targets"), py::arg("old_logp"), py::arg("ref_logp"),
        py::arg("advantages"), py::arg("w_pg"), py::arg("w_kl"), py::arg("w_nll"), py::arg("eps_low"),
        py::arg("eps_high"), py::arg("beta"), py::arg("mu"), py::arg("suppress_token"), py::arg("chunk"),
        py::arg("need_grad_hidden"), py::arg("need_grad_weight"), py::arg("with_entropy"));
  m.def("group_normalize", &lrf::group_normalize,
        "Decoupled / sum group normalization of rewards -> advantages [S] (see ARCHITECTURE.md)",
        py::arg("rewards"), py::arg("group_ids"), py::arg("weights"), py::arg("decoupled"));
  m.def("kv_cache_write", &lrf::kv_cache_write, "KV-cache write (in place; see ARCHITECTURE.md)",
        py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("cache_lens"),
        py::arg("chunk_lens"), py::arg("error_flag") = py::none());
  m.def("linear", &lrf::linear,
        "skinny GEMM x [M <= 64, K] @ weight [N, K]^T -> [M, N] of the decode forward (see ops/linear.py)",
        py::arg("x"), py::arg("weight"), py::arg("pdl") = false);
  m.def("linear_logprobs", &lrf::linear_logprobs,
        "Per-token log-probs of targets under softmax(hidden @ weight.T), chunked -> (logp [T], lse [T], "
        "entropy [T] | None)",
        py::arg("hidden"), py::arg("weight"), py::arg("targets"), py::arg("suppress_token"), py::arg("chunk"),
        py::arg("with_entropy"));
  m.def("linear_logprobs_backward", &lrf::linear_logprobs_backward,
        "Backward of linear_logprobs from grad_logp and the saved lse -> (grad_hidden | None, grad_weight | None)",
        py::arg("hidden"), py::arg("weight"), py::arg("targets"), py::arg("lse"), py::arg("grad_logp"),
        py::arg("suppress_token"), py::arg("chunk"), py::arg("need_grad_hidden"), py::arg("need_grad_weight"));
  m.def("qk_norm_rope", &lrf::qk_norm_rope,
        "RMSNorm over the last dim of x [B, N, H, D] (D 64 or 128) then rotate-half RoPE with cos/sin [B, N, D], "
        "fused; heads >= split use weight2 when given (see ops/rms_norm.py)",
        py::arg("x"), py::arg("weight"), py::arg("cos"), py::arg("sin"), py::arg("eps"),
        py::arg("weight2") = py::none(), py::arg("split") = 0);
  m.def("rms_norm", &lrf::rms_norm, "RMSNorm over the last dim of x, Qwen3 rounding (see ops/rms_norm.py)",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("silu_mul", &lrf::silu_mul,
        "silu(gate) * up for gate_up [..., 2 I] holding gate and up side by side -> [..., I] (see ops/silu_mul.py)",
        py::arg("gate_up"));
  m.def("threshold_unmask", &lrf::threshold_unmask,
        "Threshold unmasking step (in place; returns (block_done, eos_seen); see ARCHITECTURE.md)",
        py::arg("logits"), py::arg("tokens"), py::arg("masked"), py::arg("step_map"), py::arg("logp"),
        py::arg("conf"), py::arg("step"), py::arg("quota"), py::arg("eos_ids"), py::arg("seed"),
        py::arg("offset"), py::arg("threshold"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("greedy"), py::arg("two_level"), py::arg("noise_rows") = py::none(),
        py::arg("logit_rows") = py::none());
#endif
}
