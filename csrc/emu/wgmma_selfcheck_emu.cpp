// Self-check of the emulator's wgmma model (warp_ops.h): one warpgroup computes D[64 x 64] = A[64 x 32] B[32 x 64]
// with two wgmma.m64n64k16 (A in registers as mma.m16n8k16 fragments, B K-major in a 128B-swizzled shared tile
// read through descriptors, the layout of the block-attention K tile) and prints the largest error against the
// float product; broken variants of the same kernel must abort with a named error or give a wrong result.
// An executable for python_tests/test_emu.py; never part of the extension. Build:
//   g++ -std=c++20 -O2 -DLRF_KERNEL_EMULATION -Icsrc csrc/emu/wgmma_selfcheck_emu.cpp -o wgmma_selfcheck
//
//   wgmma_selfcheck CASE DEFER SEED     DEFER 1: results land at the wait (else at issue)
//     ok               prints "max_err <e>"
//     no_fence         the batch is not preceded by wgmma.fence            -> abort "without a wgmma.fence"
//     read_early       the accumulators are read before the wait           -> NaN results (deferred)
//     write_in_flight  an accumulator is written while the wgmma is in flight -> abort "were written" (deferred)
//     warp_skips       warp 1 skips the batch                              -> abort "different wgmma sequences"
//     no_wait          the group is committed but never waited for         -> abort "not waited for"
//     smem_reuse       the B tile is overwritten before the wait           -> wrong results (deferred)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/block_attn.cuh"  // block_attn_swz / block_attn_k_desc: the kernel's K-tile layout

using namespace lrf::kernels;

namespace {

constexpr int M = 64, N = 64, K = 32;  // N = kBlockAttnBN keys, K = two k-steps of the head dim (D = 64 tile)

float value(int i, int j, int salt) { return float(((i * 7 + j * 13 + salt) % 17) - 8) / 8.f; }  // exact in bf16

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s CASE DEFER SEED\n", argv[0]);
    return 2;
  }
  const std::string c = argv[1];
  const bool defer = std::atoi(argv[2]) != 0;
  const uint32_t seed = static_cast<uint32_t>(std::atoi(argv[3]));
  std::vector<float> out(size_t(M) * N, 0.f);

  const std::function<void(int)> body = [&](int tid) {
    const int warp = tid / 32, lane = tid % 32;
    const uint32_t tile = (smem_addr(lrf::emu::smem()) + 1023u) & ~1023u;
    // B[n][k] (n = key row, k = column) into the swizzled tile: thread tid writes rows tid / 2 of its half
    for (int n = tid / 2; n < N; n += 64) {
      for (int k = (tid % 2) * 16; k < (tid % 2) * 16 + 16; ++k) {
        const uint32_t addr = tile + block_attn_swz<64, true>(n, k / 8) + (k % 8) * 2;
        const uint16_t h = from_float(Bf16{}, value(n, k, 1));
        std::memcpy(lrf::emu::smem() + addr, &h, 2);
      }
    }
    block_sync();
    uint32_t a[2][4];  // A fragments of this warp's 16 rows, k-steps 0 and 1
    for (int ks = 0; ks < 2; ++ks) {
      for (int r = 0; r < 4; ++r) {
        const int row = 16 * warp + lane / 4 + 8 * (r % 2), k = 16 * ks + 2 * (lane % 4) + 8 * (r / 2);
        a[ks][r] = pack2<Bf16>(value(row, k, 0), value(row, k + 1, 0));
      }
    }
    float d[32];
    const bool skip = c == "warp_skips" && warp == 1;
    if (!skip) {
      if (c != "no_fence") wgmma_fence();
      for (int ks = 0; ks < 2; ++ks) wgmma_rs<Bf16, 64, false>(d, a[ks], block_attn_k_desc(tile, ks), ks > 0);
      wgmma_commit();
      if (c == "write_in_flight") d[3] = 1.f;
      if (c == "smem_reuse") {
        block_sync();
        std::memset(lrf::emu::smem() + tile, 0, 2 * N * 64);
      }
      if (c == "read_early") {
        for (int v = 0; v < 32; ++v) out[size_t(16 * warp + wgmma_d_row(lane, v)) * N + wgmma_d_col(lane, v)] = d[v];
      }
      if (c != "no_wait") wgmma_wait<0>();
      if (c == "smem_reuse") block_sync();
    } else {
      for (float& x : d) x = 0.f;
    }
    if (c != "read_early") {
      for (int v = 0; v < 32; ++v) out[size_t(16 * warp + wgmma_d_row(lane, v)) * N + wgmma_d_col(lane, v)] = d[v];
    }
  };
  lrf::emu::run_cta(128, 2 * N * 64 + 1024, body, defer, seed);

  double err = 0;  // NaN when any result is NaN
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      double want = 0;
      for (int k = 0; k < K; ++k) want += double(value(i, k, 0)) * value(j, k, 1);
      const double got = out[size_t(i) * N + j];
      err = std::isnan(got) || std::isnan(err) ? NAN : std::fmax(err, std::fabs(got - want));
    }
  }
  std::printf("max_err %g\n", err);
  return 0;
}
