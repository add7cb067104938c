// CPU driver of the GRPO-loss kernel sources under emulation (emu_core.h with the CUDA-builtins front-end), a
// shared library for python_tests/test_grpo_loss_emu.py and _random.py (ctypes); not part of the extension. Two
// entry points, each mirroring its launcher in csrc/grpo_loss.cu:
//   emu_lm_head_rows      kernels/grpo_loss.cuh (log-softmax statistics, the fused GRPO terms and d loss / d logits
//                         in place over a chunk of logits), as launch_rows runs one chunk: a grid of min(rows,
//                         2^30) CTAs of kRowThreads threads, the 16-byte vector path when the chunk is 16-byte
//                         aligned and V * sizeof(T) % 16 == 0. The GEMMs around it (logits = h @ W^T, the
//                         gradient GEMMs) are cuBLAS in the extension and are not emulated: the caller passes the
//                         logits.
//   emu_group_normalize   kernels/group_normalize.cuh: one CTA of kGroupNormThreads threads, the launcher's hash
//                         capacity and workspace layout; cub's block sort and scan are host stand-ins
//                         (emu/cub_block.h) with cub's contract.
// Build:
//   g++ -std=c++20 -O2 -ffp-contract=off -DLRF_KERNEL_EMULATION -shared -fPIC -Icsrc -I<cuda>/include
//       csrc/emu/grpo_loss_emu.cpp -o grpo_loss_emu.so
#include "emu/cuda_builtins.h"

#include <cuda_bf16.h>

#include <functional>

#include "kernels/group_normalize.cuh"
#include "kernels/grpo_loss.cuh"

namespace {

using namespace lrf::kernels;

LmHeadRowParams<float> g_pf;
LmHeadRowParams<double> g_pd;
GroupNormalizeParams<float> g_gf;
GroupNormalizeParams<double> g_gd;
GroupNormalizeParams<__nv_bfloat16> g_gb;
GroupNormalizeParams<__half> g_gh;

template <typename T>
GroupNormalizeParams<T>& gn_params() {
  if constexpr (std::is_same_v<T, float>) return g_gf;
  else if constexpr (std::is_same_v<T, double>) return g_gd;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return g_gb;
  else return g_gh;
}

template <typename T>
void gn_body() {
  group_normalize_kernel<T>(gn_params<T>());
}

template <typename T>
void (*gn_setup(const void* rewards, const int64_t* group_ids, const double* weights, void* out, bool decoupled,
                int64_t S, int64_t R, int64_t cap, int32_t* ws, double* total))() {
  GroupNormalizeParams<T>& p = gn_params<T>();
  p = GroupNormalizeParams<T>{};
  p.rewards = static_cast<const T*>(rewards);
  p.group_ids = group_ids;
  p.weights = weights;
  p.out = out;
  p.out_double = std::is_same_v<T, double>;
  p.decoupled = decoupled;
  p.samples = S;
  p.rewards_per = R;
  p.cap = cap;
  p.table = ws;  // the launcher's layout: four [cap] arrays, then slot and order ([S] each)
  p.count = ws + cap;
  p.offset = ws + 2 * cap;
  p.cursor = ws + 3 * cap;
  p.slot = ws + 4 * cap;
  p.order = ws + 4 * cap + S;
  p.total = total;
  return gn_body<T>;
}

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
  if (mode == kGrpo) return entropy ? body<T, Acc, kGrpo, true> : body<T, Acc, kGrpo, false>;  // with_entropy
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

// dtype as above (rewards [S, R] dense); group_ids [S]; weights [R] float64; out [S] float32 (float64 for float64
// rewards). The workspace is the launcher's: cap = the smallest power of two >= max(32, 2 S), poisoned here (the
// kernel must initialize what it reads). Returns cap.
int64_t emu_group_normalize(int dtype, const void* rewards, const int64_t* group_ids, const double* weights, void* out,
                            int decoupled, int64_t S, int64_t R, uint64_t order_seed) {
  int64_t cap = 32;
  while (cap < 2 * S) cap *= 2;
  std::vector<int32_t> ws(size_t(4 * cap + 2 * S), int32_t(0x7fbadbad));
  std::vector<double> total(size_t(S), std::nan(""));
  void (*fn)() = dtype == 3 ? gn_setup<double>(rewards, group_ids, weights, out, decoupled != 0, S, R, cap, ws.data(),
                                               total.data())
                 : dtype == 1 ? gn_setup<__nv_bfloat16>(rewards, group_ids, weights, out, decoupled != 0, S, R, cap,
                                                        ws.data(), total.data())
                 : dtype == 2 ? gn_setup<__half>(rewards, group_ids, weights, out, decoupled != 0, S, R, cap, ws.data(),
                                                 total.data())
                              : gn_setup<float>(rewards, group_ids, weights, out, decoupled != 0, S, R, cap, ws.data(),
                                                total.data());
  lrf::emu::run_block(0, 1, kGroupNormThreads, 0, order_seed, fn);
  return cap;
}

}  // extern "C"
