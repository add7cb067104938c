// Kernel launch with programmatic dependent launch (PDL, sm_90+), for the launchers of the decode forward's
// small kernels (norms, q/k-norm + RoPE, silu_mul, block attention).
//
// `launch_pdl(kernel, grid, block, smem, stream, args...)` launches with programmatic stream serialization: the
// kernel may become resident as soon as the kernel before it on the stream has executed
// griddepcontrol.launch_dependents in every CTA (our GEMM after its main loop, the norms and the attention at
// their start), instead of when that kernel has exited, so its launch latency and prologue overlap the
// predecessor's tail. What makes this safe for ANY predecessor: every kernel launched this way executes
// griddepcontrol.wait (kernels::griddep_wait / wait_for_prerequisites) before its first global memory access,
// and that wait returns only once the predecessor grid has completed and its writes are visible. A predecessor
// that never triggers (cuBLAS, torch's own kernels) simply completes first, as with a plain launch.
// Under CUDA-graph capture the attribute becomes a programmatic edge of the graph (CUDA 12.3+). If the driver
// refuses the attribute, the kernel is launched plainly (the same result: the wait is then a no-op).
// LRF_PDL=0 in the environment (read at every launch, so a benchmark can compare both in one process; the
// Python side reads the same switch for the GEMM's `pdl`, ops/_common.py) launches everything plainly.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <utility>

namespace lrf {

// False when LRF_PDL starts with '0' (LRF_PDL=0): programmatic dependent launch off.
inline bool pdl_allowed() {
  const char* v = std::getenv("LRF_PDL");
  return v == nullptr || v[0] != '0';
}

template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl_allowed() ? 1 : 0;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (err != cudaSuccess && cfg.numAttrs > 0) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone) {
      return err;  // a failed launch has invalidated the capture: report the first error, not the retry's
    }
    (void)cudaGetLastError();  // clear it; the plain launch reports its own errors
    cfg.numAttrs = 0;
    err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  }
  return err;
}

}  // namespace lrf
