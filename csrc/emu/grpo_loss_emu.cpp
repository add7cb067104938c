// CPU driver of the LM-head row kernel source (kernels/grpo_loss.cuh: log-softmax statistics, the fused GRPO
// terms and d loss / d logits, in place over a chunk of logits) under emulation (emu_core.h with the
// CUDA-builtins front-end), a shared library for python_tests/test_grpo_loss.py (ctypes); not part of the
// extension. It mirrors csrc/grpo_loss.cu's launch_rows for one chunk: a grid of min(rows, 2^30) CTAs of
// kRowThreads threads, the 16-byte vector path when the chunk is 16-byte aligned and V * sizeof(T) % 16 == 0.
// The GEMMs around the kernel (logits = h @ W^T, the gradient GEMMs) are cuBLAS in the extension and are not
// emulated: the caller passes the logits. Build:
//   g++ -std=c++20 -O2 -ffp-contract=off -DLRF_KERNEL_EMULATION -shared -fPIC -Icsrc -I<cuda>/include
//       csrc/emu/grpo_loss_emu.cpp -o grpo_loss_emu.so
#include "emu/cuda_builtins.h"

#include <cuda_bf16.h>

#include <functional>

#include "kernels/grpo_loss.cuh"

namespace {

using namespace lrf::kernels;

LmHeadRowParams<float> g_pf;
LmHeadRowParams<double> g_pd;

template <typename T, typename Acc, int kMode, bool kEntropy>
void body() {
  if constexpr (std::is_same_v<Acc, double>) {
    lm_head_rows_kernel<T, Acc, kMode, kEntropy>(g_pd);
  } else {
    lm_head_rows_kernel<T, Acc, kMode, kEntropy>(g_pf);
  }
}

template <typename T, typename Acc>
void (*pick(int mode, bool entropy))() {
  if (mode == kLogprobs) return entropy ? body<T, Acc, kLogprobs, true> : body<T, Acc, kLogprobs, false>;
  if (mode == kGrpo) return body<T, Acc, kGrpo, false>;
  return body<T, Acc, kGrad, false>;
}

template <typename Acc>
void fill(LmHeadRowParams<Acc>& p, void* logits, int64_t rows, int64_t vocab, int64_t row0, int64_t tokens,
          int64_t suppress, bool vec, bool write_grad, const int64_t* targets, const void* old_logp,
          const void* ref_logp, const void* advantages, const void* w_pg, const void* w_kl, const void* w_nll,
          double clip_lo, double clip_hi, double beta, double mu, const void* lse_in, const void* grad_logp,
          void* logp, void* lse_out, void* entropy, void* terms) {
  auto in = [](const void* q) { return static_cast<const Acc*>(q); };
  auto out = [](void* q) { return static_cast<Acc*>(q); };
  p = LmHeadRowParams<Acc>{};
  p.logits = logits;
  p.vocab = vocab;
  p.rows = rows;
  p.row0 = row0;
  p.tokens = tokens;
  p.suppress = suppress;
  p.vec = vec;
  p.write_grad = write_grad;
  p.targets = targets;
  p.old_logp = in(old_logp);
  p.ref_logp = in(ref_logp);
  p.advantages = in(advantages);
  p.w_pg = in(w_pg);
  p.w_kl = in(w_kl);
  p.w_nll = in(w_nll);
  p.clip_lo = Acc(clip_lo);
  p.clip_hi = Acc(clip_hi);
  p.beta = Acc(beta);
  p.mu = Acc(mu);
  p.lse_in = in(lse_in);
  p.grad_logp = in(grad_logp);
  p.logp = out(logp);
  p.lse_out = out(lse_out);
  p.entropy = out(entropy);
  p.terms = out(terms);
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, 2 float16, 3 float64 (per-token arrays: float64 for float64 logits, else
// float32). logits: [rows, vocab] dense, the chunk of tokens row0 .. row0 + rows - 1 of T = `tokens`; per-token
// arrays have T entries (terms: [4, T]); null pointers as in LmHeadRowParams. mode: 0 log-probs, 1 GRPO, 2
// gradient. order_seed 0: blocks and threads in launch order; else blocks in a seeded random order and seeded
// random thread interleavings. Returns 1 when the vector path was taken, else 0.
int emu_lm_head_rows(int dtype, int mode, int entropy, void* logits, int64_t rows, int64_t vocab, int64_t row0,
                     int64_t tokens, int64_t suppress, int write_grad, const int64_t* targets, const void* old_logp,
                     const void* ref_logp, const void* advantages, const void* w_pg, const void* w_kl,
                     const void* w_nll, double clip_lo, double clip_hi, double beta, double mu, const void* lse_in,
                     const void* grad_logp, void* logp, void* lse_out, void* entropy_out, void* terms,
                     uint64_t order_seed) {
  const int64_t es = dtype == 3 ? 8 : dtype == 0 ? 4 : 2;
  const bool vec = reinterpret_cast<uintptr_t>(logits) % 16 == 0 && (vocab * es) % 16 == 0;  // launcher's rule
  void (*fn)() = nullptr;
  if (dtype == 3) {
    fill(g_pd, logits, rows, vocab, row0, tokens, suppress, vec, write_grad != 0, targets, old_logp, ref_logp,
         advantages, w_pg, w_kl, w_nll, clip_lo, clip_hi, beta, mu, lse_in, grad_logp, logp, lse_out, entropy_out,
         terms);
    fn = pick<double, double>(mode, entropy != 0);
  } else {
    fill(g_pf, logits, rows, vocab, row0, tokens, suppress, vec, write_grad != 0, targets, old_logp, ref_logp,
         advantages, w_pg, w_kl, w_nll, clip_lo, clip_hi, beta, mu, lse_in, grad_logp, logp, lse_out, entropy_out,
         terms);
    fn = dtype == 1 ? pick<__nv_bfloat16, float>(mode, entropy != 0)
         : dtype == 2 ? pick<__half, float>(mode, entropy != 0)
                      : pick<float, float>(mode, entropy != 0);
  }
  const unsigned grid = unsigned(rows < (int64_t(1) << 30) ? rows : (int64_t(1) << 30));
  std::vector<unsigned> blocks(grid);
  for (unsigned b = 0; b < grid; ++b) blocks[b] = b;
  if (order_seed != 0) std::shuffle(blocks.begin(), blocks.end(), std::mt19937_64(order_seed));
  for (unsigned b : blocks) lrf::emu::run_block(b, grid, kRowThreads, 0, order_seed, fn);
  return vec ? 1 : 0;
}

}  // extern "C"
