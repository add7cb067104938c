// Self-check of the CPU emulator (csrc/emu/emu_core.h through its CUDA-builtins front-end): tiny kernels
// that are right, and kernels with the bugs the emulator must refuse (divergent collectives, a thread leaving
// a barrier's other threads waiting, a misaligned 16-byte load). Used by python_tests/test_emu.py; not part of the
// extension. Run: selfcheck_emu CASE SEED -> exit 0 (and a checksum line) or an abort with the error.
#include "emu/cuda_builtins.h"

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

namespace {

std::string g_case;
float g_out[64];

// A block reduction of 2 warps: shuffles within each warp, one __syncthreads, warp 0 combines.
void kernel() {
  __shared__ float partial[2];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  float v = float(t + 1);
  if (g_case == "warp_vs_block" && t == 5) {
    __syncwarp();  // lane 5 of warp 0 syncs the warp while its 31 neighbours enter __syncthreads
  }
  if (g_case == "divergent_shfl" && lane < 16) {
    __syncwarp();  // half a warp at __syncwarp, the other half at a shuffle
  }
  alignas(16) static const uint32_t words[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const uint4 w = lrf::emu::load16(g_case == "misaligned_load16" ? words + 1 : words + 4);  // +4 bytes: misaligned
  v += float(w.x);
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) partial[warp] = v;
  if (g_case == "exit_early" && warp == 1) return;  // warp 1 never reaches the barrier warp 0 waits at
  if (g_case == "skip_barrier" && t == 40) {
    // one thread of warp 1 goes around the barrier and waits at a different one
    __syncthreads_or(1);
    return;
  }
  __syncthreads();
  if (warp == 0) g_out[lane] = partial[0] + partial[1];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: selfcheck_emu CASE SEED\n");
    return 2;
  }
  g_case = argv[1];
  lrf::emu::Launch launch;
  launch.nthreads = 64;
  launch.random_order = std::strtoull(argv[2], nullptr, 10) != 0;
  launch.seed = std::strtoull(argv[2], nullptr, 10);
  const std::function<void()> body = kernel;
  lrf::emu::run_cta(launch, body);
  for (int i = 0; i < 32; ++i) {
    if (g_out[i] != 64.f * 65.f / 2.f) {
      std::printf("wrong sum at lane %d: %g\n", i, g_out[i]);
      return 1;
    }
  }
  std::printf("sum %g\n", g_out[0]);
  return 0;
}
