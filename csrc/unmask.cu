// Launcher of threshold_unmask (device code: kernels/unmask.cuh + unmask_scan.cuh). Contract: ARCHITECTURE.md and
// lightningrl_fast/ops/unmask.py (the reference this kernel reproduces).
//
// Checks every input, sizes the grid from the device's SM count and the kernel's occupancy (cached per
// device), and launches once on the current stream. No host synchronization: seed, offset, step, quota and
// the mask are read on the device only, so the call is CUDA-graph capturable (bump `offset` between replays).
//
// Allocation per call: the two [B] bool outputs only. The cross-CTA workspace is two persistent buffers that
// grow geometrically: the per-sequence and per-row arrival counters (int32, zeroed when allocated; the kernel
// leaves them at zero) and the per-chunk partials (~32 bytes per chunk, never read before written). They are
// separate so that a launch with a larger batch never reads an earlier launch's partials as counters (found
// on an H100: a counter that is not zero on entry means no CTA is last and the rows stay masked).
// Eager launches use one workspace per stream, so launches on two streams may overlap (a shared counter would
// be left off zero for good). Launches being captured into a CUDA graph share one workspace per device (the
// replays of a device's graphs must therefore be stream-ordered, as the sampler's are); an eager launch grows
// it too, and growing it while a stream is being captured is refused (run the op once eagerly first, as
// torch's graph recipe does). A replaced workspace is never freed, because a captured graph may point at it.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "checks.h"
#include "kernels/unmask.cuh"

namespace lrf {
namespace {

using kernels::UnmaskParams;
using KernelFn = void (*)(UnmaskParams);

template <typename Tag>
KernelFn pick_mode(int mode) {
  using namespace kernels;
  switch (mode) {
    case kPickGreedy: return threshold_unmask_kernel<Tag, kPickGreedy>;
    case kPickToken: return threshold_unmask_kernel<Tag, kPickToken>;
    default: return threshold_unmask_kernel<Tag, kPickBucket>;
  }
}

KernelFn pick_kernel(at::ScalarType dtype, int mode) {
  switch (dtype) {
    case at::kBFloat16: return pick_mode<kernels::Bf16Tag>(mode);
    case at::kHalf: return pick_mode<kernels::HalfTag>(mode);
    default: return pick_mode<float>(mode);
  }
}

struct Workspace {
  at::Tensor counters;  // uint8, zero-initialized, zero between launches
  at::Tensor partials;  // uint8, scratch
};

struct DeviceInfo {
  int sms = 0;
  std::map<std::pair<KernelFn, int64_t>, int> occupancy;  // (kernel, dynamic smem) -> resident CTAs per SM
  std::map<cudaStream_t, Workspace> eager;                 // one per stream launched on outside a capture
  Workspace graph;                                         // shared by the launches captured into graphs
  std::vector<at::Tensor> retired;                         // earlier buffers, kept for captured graphs
};

std::mutex g_mutex;
std::map<int, DeviceInfo> g_devices;

int resident_ctas(DeviceInfo& info, KernelFn fn, int64_t smem) {
  auto key = std::make_pair(fn, smem);
  auto it = info.occupancy.find(key);
  if (it != info.occupancy.end()) return it->second;
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, kernels::kUnmaskThreads, smem));
  blocks = std::max(blocks, 1);
  info.occupancy.emplace(key, blocks);
  return blocks;
}

// `buf` holds at least `bytes` bytes (zeroed when (re)allocated) on return.
uint8_t* grow(DeviceInfo& info, at::Tensor& buf, int64_t bytes, const at::Device& device, bool capturing,
              const char* what) {
  if (buf.defined() && buf.numel() >= bytes) return buf.data_ptr<uint8_t>();
  LRF_CHECK(!capturing, "threshold_unmask: its ", what, " workspace must grow to ", bytes, " bytes, which cannot "
            "happen while a CUDA graph is being captured; call the op once eagerly with the same (or a larger) "
            "batch before capturing");
  int64_t size = std::max<int64_t>(bytes, 1 << 12);
  if (buf.defined()) {
    size = std::max(size, 2 * buf.numel());
    info.retired.push_back(buf);
  }
  buf = at::zeros({size}, at::TensorOptions().dtype(at::kByte).device(device));
  return buf.data_ptr<uint8_t>();
}

template <typename T>
kernels::Mat<T> mat(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0), t.stride(1)};
}

template <typename T>
kernels::Vec<const T> vec(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> threshold_unmask(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& masked, const at::Tensor& step_map,
    const at::Tensor& logp, const at::Tensor& conf, const at::Tensor& step, const at::Tensor& quota,
    const at::Tensor& eos_ids, const at::Tensor& seed, const at::Tensor& offset, double threshold,
    double temperature, int64_t top_k, double top_p, bool greedy, bool two_level,
    const std::optional<at::Tensor>& noise_rows, const std::optional<at::Tensor>& logit_rows) {
  CHECK_CUDA(logits);
  // logits [B, S, V]; or, with logit_rows [B, S], a compact [M, V] holding the scanned positions' rows only
  const bool compact = logit_rows.has_value();
  CHECK_DIM(logits, compact ? 2 : 3);
  CHECK_DIM(tokens, 2);
  const int64_t B = compact ? tokens.size(0) : logits.size(0), S = compact ? tokens.size(1) : logits.size(1);
  const int64_t V = logits.size(logits.dim() - 1);
  CHECK_DTYPE_IN(logits, at::kBFloat16, at::kHalf, at::kFloat);
  CHECK_LAST_DIM_CONTIGUOUS(logits);
  if (compact) {
    const at::Tensor& lr = *logit_rows;
    LRF_CHECK(lr.dim() == 2 && lr.size(0) == B && lr.size(1) == S, "logit_rows must have shape [", B, ", ", S,
              "] (one logits row per position), got ", lr.sizes());
    LRF_CHECK(lr.scalar_type() == at::kLong, "logit_rows must have dtype Long, got ", lr.scalar_type());
    LRF_CHECK(lr.device() == logits.device(), "logits is on ", logits.device(), " but logit_rows is on ", lr.device());
    LRF_CHECK(logits.size(0) >= 1, "logits with logit_rows must have at least one row, got shape ", logits.sizes());
  }
  CHECK_SHAPE(tokens, B, S);
  CHECK_SHAPE(masked, B, S);
  CHECK_SHAPE(step_map, B, S);
  CHECK_SHAPE(logp, B, S);
  CHECK_SHAPE(conf, B, S);
  CHECK_SHAPE(step, B);
  CHECK_SHAPE(quota, B);
  CHECK_DIM(eos_ids, 1);
  CHECK_SHAPE(seed, 1);
  CHECK_SHAPE(offset, 1);
  CHECK_DTYPE(tokens, at::kLong);
  CHECK_DTYPE(masked, at::kBool);
  CHECK_DTYPE(step_map, at::kInt);
  CHECK_DTYPE(logp, at::kFloat);
  CHECK_DTYPE(conf, at::kFloat);
  CHECK_DTYPE(step, at::kInt);
  CHECK_DTYPE(quota, at::kInt);
  CHECK_DTYPE(eos_ids, at::kLong);
  CHECK_DTYPE(seed, at::kLong);
  CHECK_DTYPE(offset, at::kLong);
  CHECK_SAME_DEVICE(logits, tokens);
  CHECK_SAME_DEVICE(logits, masked);
  CHECK_SAME_DEVICE(logits, step_map);
  CHECK_SAME_DEVICE(logits, logp);
  CHECK_SAME_DEVICE(logits, conf);
  CHECK_SAME_DEVICE(logits, step);
  CHECK_SAME_DEVICE(logits, quota);
  CHECK_SAME_DEVICE(logits, eos_ids);
  CHECK_SAME_DEVICE(logits, seed);
  CHECK_SAME_DEVICE(logits, offset);
  if (noise_rows.has_value()) {
    const at::Tensor& nr = *noise_rows;
    LRF_CHECK(nr.dim() == 1 && nr.size(0) == B, "noise_rows must have shape [", B, "] (one per sequence), got ",
              nr.sizes());
    LRF_CHECK(nr.scalar_type() == at::kLong, "noise_rows must have dtype Long, got ", nr.scalar_type());
    LRF_CHECK(nr.device() == logits.device(), "logits is on ", logits.device(), " but noise_rows is on ", nr.device());
    check_no_overlaps({{"tokens", tokens}, {"masked", masked}, {"step_map", step_map}, {"logp", logp}, {"conf", conf}},
                      {{"noise_rows", nr}});
  }
  if (compact) {  // after the outputs' own checks, as noise_rows
    check_no_overlaps({{"tokens", tokens}, {"masked", masked}, {"step_map", step_map}, {"logp", logp}, {"conf", conf}},
                      {{"logit_rows", *logit_rows}});
  }
  CHECK_NO_INTERNAL_OVERLAP(tokens);
  CHECK_NO_INTERNAL_OVERLAP(masked);
  CHECK_NO_INTERNAL_OVERLAP(step_map);
  CHECK_NO_INTERNAL_OVERLAP(logp);
  CHECK_NO_INTERNAL_OVERLAP(conf);
  // the CTA that finishes a sequence writes its positions while other CTAs still read logits, the mask (their
  // own rows) and the per-sequence inputs
  check_no_overlaps({{"tokens", tokens}, {"masked", masked}, {"step_map", step_map}, {"logp", logp}, {"conf", conf}},
                    {{"logits", logits}, {"step", step}, {"quota", quota}, {"eos_ids", eos_ids}, {"seed", seed},
                     {"offset", offset}});
  LRF_CHECK(S >= 1 && V >= 1, "logits must have at least one position and one token, got ", S, " positions and ",
            V, " tokens");
  LRF_CHECK(S <= kernels::kUnmaskMaxPositions, "threshold_unmask kernel: at most ",
              kernels::kUnmaskMaxPositions, " positions per row (tokens.size(1)), got ", S,
              "; ops.threshold_unmask uses the PyTorch reference for larger blocks");
  LRF_CHECK(V <= (int64_t(1) << 31) - (int64_t(1) << 16), "threshold_unmask kernel: vocabulary too large: ", V);
  LRF_CHECK(eos_ids.numel() <= (int64_t(1) << 20), "eos_ids has too many entries: ", eos_ids.numel());
  const int mode = kernels::unmask_pick_mode(greedy, temperature, two_level);
  LRF_CHECK(top_k >= 0, "top_k must be >= 0 (0 = off), got ", top_k);
  LRF_CHECK(top_p > 0.0 && top_p <= 1.0, "top_p must be in (0, 1], got ", top_p);
  LRF_CHECK(mode == kernels::kPickGreedy || ((top_k == 0 || top_k >= V) && top_p >= 1.0),
              "threshold_unmask kernel samples from the full tempered distribution only (top_k=", top_k,
              ", top_p=", top_p, " given); ops.threshold_unmask uses the PyTorch reference for top-k/top-p");
  // torch computes logits / T on CUDA as logits * (1.0f / float(T)); the kernel does the same
  const float inv_t = temperature > 0.0 ? 1.0f / static_cast<float>(temperature) : 1.0f;
  LRF_CHECK(std::isfinite(inv_t) && inv_t > 0.0f, "temperature ", temperature, " is out of the fp32 range");

  const auto bool_opts = at::TensorOptions().dtype(at::kBool).device(logits.device());
  at::Tensor block_done = at::empty({B}, bool_opts);
  at::Tensor eos_seen = at::empty({B}, bool_opts);
  if (B == 0) return {block_done, eos_seen};

  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const KernelFn fn = pick_kernel(logits.scalar_type(), mode);
  const int64_t smem = kernels::unmask_dynamic_smem(S, mode);
  const int64_t per_vec = 16 / logits.element_size();
  const int64_t rows = B * S;

  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;

  UnmaskParams p{};
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    DeviceInfo& info = g_devices[logits.device().index()];
    if (info.sms == 0) {
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, logits.device().index()));
    }
    const int64_t slots = int64_t(info.sms) * resident_ctas(info, fn, smem);
    p.nsplit = kernels::unmask_choose_split(rows, kernels::unmask_max_split(V, per_vec, mode), slots);
    LRF_CHECK(rows * p.nsplit <= std::numeric_limits<int32_t>::max(), "threshold_unmask: too many rows: ", rows);
    const int64_t counter_bytes = kernels::unmask_counter_bytes(B, rows);
    const int64_t partial_bytes = kernels::unmask_partial_bytes(rows, p.nsplit);
    if (!capturing) {  // a later capture of this launch finds the graph workspace large enough
      grow(info, info.graph.counters, counter_bytes, logits.device(), false, "counter");
      grow(info, info.graph.partials, partial_bytes, logits.device(), false, "partials");
    }
    Workspace& ws = capturing ? info.graph : info.eager[stream];
    uint8_t* counters = grow(info, ws.counters, counter_bytes, logits.device(), capturing, "counter");
    p.counters = reinterpret_cast<int32_t*>(counters);
    p.row_counters = reinterpret_cast<int32_t*>(counters + kernels::unmask_seq_counter_bytes(B));
    p.partials = reinterpret_cast<kernels::UnmaskPartial*>(
        grow(info, ws.partials, partial_bytes, logits.device(), capturing, "partials"));
  }

  p.logits = logits.data_ptr();
  p.logits_sb = logits.stride(0);
  p.logits_ss = compact ? 0 : logits.stride(1);
  p.logit_rows = compact ? kernels::Mat<const int64_t>{logit_rows->data_ptr<int64_t>(), logit_rows->stride(0),
                                                       logit_rows->stride(1)}
                         : kernels::Mat<const int64_t>{nullptr, 0, 0};
  p.num_logit_rows = compact ? logits.size(0) : 0;
  p.tokens = mat<int64_t>(tokens);
  p.masked = mat<bool>(masked);
  p.step_map = mat<int32_t>(step_map);
  p.logp = mat<float>(logp);
  p.conf = mat<float>(conf);
  p.step = vec<int32_t>(step);
  p.quota = vec<int32_t>(quota);
  p.eos_ids = vec<int64_t>(eos_ids);
  p.num_eos = static_cast<int32_t>(eos_ids.numel());
  p.seed = seed.data_ptr<int64_t>();
  p.offset = offset.data_ptr<int64_t>();
  p.noise_rows = noise_rows.has_value() ? vec<int64_t>(*noise_rows) : kernels::Vec<const int64_t>{nullptr, 0};
  p.block_done = block_done.data_ptr<bool>();
  p.eos_seen = eos_seen.data_ptr<bool>();
  p.batch = static_cast<int32_t>(B);
  p.positions = static_cast<int32_t>(S);
  p.vocab = static_cast<int32_t>(V);
  p.inv_temp = inv_t;
  p.threshold = static_cast<float>(threshold);

  fn<<<static_cast<unsigned>(rows * p.nsplit), kernels::kUnmaskThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {block_done, eos_seen};
}

}  // namespace lrf
