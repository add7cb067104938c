// CPU driver of the threshold-unmask kernel source (kernels/unmask.cuh) under emulation (emu_core.h with the
// CUDA-builtins front-end cuda_builtins.h), a shared library for python_tests/test_unmask_emu.py (ctypes); not
// part of the extension. It mirrors the launcher csrc/unmask.cu: the same split choice and workspace sizes
// (both from the header: zeroed counters and a separate partials buffer, here poisoned as a reused one holds
// stale values), one "launch" of rows * nsplit blocks — run in a caller-chosen order — and it reports whether
// the kernel left every counter at zero. Build:
//   g++ -std=c++20 -O2 -ffp-contract=off -DLRF_KERNEL_EMULATION -shared -fPIC -Icsrc -I<cuda>/include
//       csrc/emu/unmask_emu.cpp -o unmask_emu.so
#include "emu/cuda_builtins.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

namespace lrf::emu {
uint64_t gumbel_draws = 0;  // counted by NoiseKey::gumbel, every noise value drawn (LRF_KERNEL_EMULATION only)
}  // namespace lrf::emu

#include "kernels/unmask.cuh"

namespace {

lrf::kernels::UnmaskParams g_params;

template <typename Tag, int kMode>
void body() {
  lrf::kernels::threshold_unmask_kernel<Tag, kMode>(g_params);
}

template <typename Tag>
void (*body_for(int mode))() {
  using namespace lrf::kernels;
  return mode == kPickGreedy ? body<Tag, kPickGreedy> : mode == kPickToken ? body<Tag, kPickToken>
                                                                           : body<Tag, kPickBucket>;
}

}  // namespace

extern "C" {

// Gumbel draws (noise values computed: tokens, and buckets of two-level sampling) since the last call; resets
// the count.
uint64_t emu_take_gumbel_draws() {
  const uint64_t n = lrf::emu::gumbel_draws;
  lrf::emu::gumbel_draws = 0;
  return n;
}

// dtype: 0 float32, 1 bfloat16, 2 float16. Strides are in elements: logits' two leading ones, and `strides`
// (13 values, as the launcher takes them from the tensors): tokens, masked, step_map, logp, conf (each the batch then
// the position stride), step, quota, eos_ids; strides == nullptr: those arrays contiguous. logit_rows (strides in
// elements; nullptr: none): compact logits of num_logit_rows rows at row stride logits_sb (logits_ss unused).
// slots = SMs x resident CTAs per SM used for the split choice; order_seed 0 = blocks in launch order and
// each block's threads in launch order, else a random permutation of the blocks and seeded random thread
// interleavings. two_level: the two-level sampler (else per-token noise). Returns 0, or 1 when a counter was
// left non-zero. *nsplit_out = chunks per row.
int emu_threshold_unmask(int dtype, const void* logits, int64_t logits_sb, int64_t logits_ss, int B, int S, int V,
                         int64_t* tokens, bool* masked, int32_t* step_map, float* logp, float* conf,
                         const int32_t* step, const int32_t* quota, const int64_t* eos_ids, int num_eos,
                         const int64_t* seed, const int64_t* offset, double threshold, double temperature,
                         int greedy, int two_level, bool* block_done, bool* eos_seen, int64_t slots, int force_split,
                         uint64_t order_seed, int* nsplit_out, const int64_t* strides, const int64_t* noise_rows,
                         int64_t noise_rows_stride, const int64_t* logit_rows, int64_t logit_rows_sb,
                         int64_t logit_rows_ss, int64_t num_logit_rows) {
  using namespace lrf::kernels;
  const int64_t per_vec = dtype == 0 ? 4 : 8;
  const int64_t rows = int64_t(B) * S;
  UnmaskParams p{};
  const int mode = unmask_pick_mode(greedy, temperature, two_level);
  p.nsplit = force_split > 0 ? force_split : unmask_choose_split(rows, unmask_max_split(V, per_vec, mode), slots);
  *nsplit_out = p.nsplit;
  // two buffers, as the launcher keeps them: zeroed counters, and partials the kernel writes before reading
  std::vector<int32_t> counters(size_t(unmask_counter_bytes(B, rows)) / 4, 0);
  std::vector<UnmaskPartial> partials(size_t(unmask_partial_bytes(rows, p.nsplit)) / sizeof(UnmaskPartial));
  std::memset(partials.data(), 0xFF, partials.size() * sizeof(UnmaskPartial));  // stale: NaN, index -1
  p.counters = counters.data();
  p.row_counters = counters.data() + unmask_seq_counter_bytes(B) / 4;
  p.partials = partials.data();
  p.logits = logits;
  p.logits_sb = logits_sb;
  p.logits_ss = logits_ss;
  const int64_t dense[13] = {S, 1, S, 1, S, 1, S, 1, S, 1, 1, 1, 1};
  const int64_t* st = strides != nullptr ? strides : dense;
  p.tokens = {tokens, st[0], st[1]};
  p.masked = {masked, st[2], st[3]};
  p.step_map = {step_map, st[4], st[5]};
  p.logp = {logp, st[6], st[7]};
  p.conf = {conf, st[8], st[9]};
  p.step = {step, st[10]};
  p.quota = {quota, st[11]};
  p.eos_ids = {eos_ids, st[12]};
  p.num_eos = num_eos;
  p.seed = seed;
  p.offset = offset;
  p.noise_rows = {noise_rows, noise_rows_stride};  // nullptr: none
  p.logit_rows = {logit_rows, logit_rows_sb, logit_rows_ss};  // nullptr: none (logits [B, S, V])
  p.num_logit_rows = num_logit_rows;
  p.block_done = block_done;
  p.eos_seen = eos_seen;
  p.batch = B;
  p.positions = S;
  p.vocab = V;
  p.inv_temp = temperature > 0.0 ? 1.0f / static_cast<float>(temperature) : 1.0f;
  p.threshold = static_cast<float>(threshold);
  g_params = p;

  void (*fn)() = dtype == 1 ? body_for<Bf16Tag>(mode) : dtype == 2 ? body_for<HalfTag>(mode) : body_for<float>(mode);
  const unsigned grid = unsigned(rows * p.nsplit);
  std::vector<unsigned> order(grid);
  std::iota(order.begin(), order.end(), 0u);
  if (order_seed != 0) std::shuffle(order.begin(), order.end(), std::mt19937_64(order_seed));
  const size_t smem = size_t(unmask_dynamic_smem(S, mode));
  const std::function<void()> thread = fn;
  for (unsigned blk : order) lrf::emu::run_block(blk, grid, kUnmaskThreads, smem, order_seed, thread);
  for (int32_t c : counters) {  // sequence and row counters
    if (c != 0) return 1;
  }
  return 0;
}

}  // extern "C"
