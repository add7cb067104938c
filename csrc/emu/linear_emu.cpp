// CPU driver of the skinny-GEMM kernel source (kernels/linear.cuh) under emulation (emu_core.h with the warp_ops
// front-end warp_ops.h). An executable for python_tests/test_linear.py; not part of the extension. Build:
//   g++ -std=c++20 -O2 -ffp-contract=off -DLRF_KERNEL_EMULATION -Icsrc csrc/emu/linear_emu.cpp -o linear_emu
//
//   linear_emu run IN OUT
//     IN: int32 m, n, k, dtype (0 bf16, 1 fp16), fw, cluster, x_stride, w_stride, seed;
//         then (16-bit elements) x [m, x_stride], w [n, w_stride].
//     OUT: y [m, n] (16-bit), as the launcher would leave it. Every CTA cluster runs as one emulated CTA
//     (run_cluster), its threads interleaved at random from the seed. y starts as poison (0xFFFF) with guard
//     elements after it; the driver fails if a guard changed.
//   linear_emu plan N K SMS MAX_CLUSTER   -> prints "fw cluster ctas" of linear_plan(...) on an ideal GPU
//                                           (SMS x 2 slots for every cluster size up to MAX_CLUSTER)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/linear.cuh"

using namespace lrf::kernels;

namespace {

template <typename V>
void read_into(FILE* f, V& v, size_t n) {
  v.resize(n);
  if (n && std::fread(v.data(), sizeof(v[0]), n, f) != n) lrf::emu::fail("short input file");
}

uint16_t* aligned16(std::vector<uint16_t>& keep, size_t n, uint16_t fill) {
  keep.assign(n + 8, fill);
  uint16_t* base = keep.data();
  while (reinterpret_cast<uintptr_t>(base) % 16) ++base;
  return base;
}

template <typename T, int NT>
void run(const LinearParams& p, uint32_t seed) {
  const int64_t tiles = (p.n + 16 * p.fw - 1) / (16 * p.fw);
  const size_t smem = linear_smem_bytes(NT);
  for (int64_t cl = 0; cl < tiles; ++cl) {
    std::function<void(int)> body = [&](int tid) {
      const int rank = tid / kLinearThreads;
      float* part = reinterpret_cast<float*>(lrf::kernels::cta_smem());
      linear_cta<T, NT>(p, cl * p.cluster + rank, tid % kLinearThreads, part);
    };
    if (p.cluster > 1) {
      lrf::emu::run_cluster(p.cluster, kLinearThreads, smem, body, seed + static_cast<uint32_t>(cl));
    } else {
      lrf::emu::run_cta(kLinearThreads, smem, body, false, seed + static_cast<uint32_t>(cl));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "plan") {
    int64_t slots[4];
    linear_ideal_slots(std::atoi(argv[4]), std::atoi(argv[5]), slots);
    const LinearPlan pl = linear_plan(std::atoll(argv[2]), std::atoll(argv[3]), slots);
    std::printf("%d %d %lld\n", pl.fw, pl.cluster, static_cast<long long>(pl.ctas));
    return 0;
  }
  if (argc != 4 || std::string(argv[1]) != "run") {
    std::fprintf(stderr, "usage: %s run IN OUT | plan N K SMS MAX_CLUSTER\n", argv[0]);
    return 2;
  }
  FILE* in = std::fopen(argv[2], "rb");
  if (!in) lrf::emu::fail("cannot open input");
  std::vector<int32_t> hdr;
  read_into(in, hdr, 9);
  const int m = hdr[0], n = hdr[1], k = hdr[2], dtype = hdr[3];
  const int64_t xs = hdr[6], ws = hdr[7];
  std::vector<uint16_t> x, w;
  read_into(in, x, size_t(m) * xs);
  read_into(in, w, size_t(n) * ws);
  std::fclose(in);

  std::vector<uint16_t> xk, wk, yk;
  uint16_t* xa = aligned16(xk, x.size(), 0);
  uint16_t* wa = aligned16(wk, w.size(), 0);
  std::memcpy(xa, x.data(), x.size() * 2);
  std::memcpy(wa, w.data(), w.size() * 2);
  constexpr size_t kGuard = 64;
  const size_t ny = size_t(m) * n;
  uint16_t* ya = aligned16(yk, ny + kGuard, 0xFFFF);  // poison: every output must be written

  LinearParams p{};
  p.x = xa;
  p.w = wa;
  p.y = ya;
  p.m = m;
  p.n = n;
  p.k = k;
  p.x_stride = xs;
  p.w_stride = ws;
  p.fw = hdr[4];
  p.cluster = hdr[5];
  const uint32_t seed = static_cast<uint32_t>(hdr[8]);
  if (m < 1 || m > kLinearMaxTokens || k % 8 || xs % 8 || ws % 8 || xs < k || ws < k) lrf::emu::fail("bad shape");
  if (p.fw != 1 && p.fw != 2 && p.fw != 4 && p.fw != 8) lrf::emu::fail("fw must be 1, 2, 4 or 8");
  if (p.cluster < 1 || p.cluster > kLinearMaxCluster) lrf::emu::fail("cluster must be 1..8");
  const int nt = m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
  auto go = [&](auto t_tag) {
    using T = decltype(t_tag);
    if (nt == 1) run<T, 1>(p, seed);
    else if (nt == 2) run<T, 2>(p, seed);
    else if (nt == 4) run<T, 4>(p, seed);
    else run<T, 8>(p, seed);
  };
  if (dtype == 0) go(Bf16{});
  else if (dtype == 1) go(Fp16{});
  else lrf::emu::fail("dtype must be 0 (bf16) or 1 (fp16)");
  for (size_t i = ny; i < ny + kGuard; ++i) {
    if (ya[i] != 0xFFFF) lrf::emu::fail("the kernel wrote past the end of y");
  }

  FILE* o = std::fopen(argv[3], "wb");
  if (!o) lrf::emu::fail("cannot open output");
  std::fwrite(ya, 2, ny, o);
  std::fclose(o);
  return 0;
}
