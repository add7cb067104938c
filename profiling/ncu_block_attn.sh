#!/usr/bin/env bash
# Nsight Compute profile of the block-attention kernel on one decode shape.
#
#   bash profiling/ncu_block_attn.sh                          # batch 1, cache 4096, block 4 (split-KV + combine)
#   BATCH=128 CACHE=2048 BLOCK=32 CHUNK=64 bash profiling/ncu_block_attn.sh
#   OUT=/tmp/attn bash profiling/ncu_block_attn.sh            # report path (default ./block_attn_<shape>.ncu-rep)
#   VARIANT=wgmma BATCH=128 CACHE=4096 BLOCK=32 bash profiling/ncu_block_attn.sh   # the wgmma variant (sm_90)
#
# profiling/bench_block_attn.py --ncu runs the shape a few times to warm up, then NCU_CALLS calls each inside
# an NVTX range "block_attn"; ncu profiles only the kernels launched inside that range (--nvtx-include
# "block_attn/" matches a push/pop range of that name): block_attn_kernel and, when the launcher splits the
# keys, block_attn_combine_kernel. The full section set includes memory throughput (compare DRAM
# bandwidth with the device's peak), the warp-state / stall breakdown, shared-memory bank conflicts of the
# ldmatrix loads, and the source view (-lineinfo builds: SASS lines mapped back to kernels/block_attn.cuh).
# Needs ncu on PATH (CUDA toolkit / Nsight Compute) and permission to read the GPU performance counters.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BATCH="${BATCH:-1}" CACHE="${CACHE:-4096}" BLOCK="${BLOCK:-4}" CHUNK="${CHUNK:-0}" NCU_CALLS="${NCU_CALLS:-2}"
VARIANT="${VARIANT:-auto}"
OUT="${OUT:-block_attn_${VARIANT}_b${BATCH}_l${CACHE}_bs${BLOCK}_c${CHUNK}}"
NCU="${NCU:-$(command -v ncu || echo "${CUDA_HOME:-/usr/local/cuda}/bin/ncu")}"
[ -x "$NCU" ] || { echo "ncu not found (set NCU=/path/to/ncu)"; exit 1; }

exec "$NCU" \
  --nvtx --nvtx-include "block_attn/" \
  --kernel-name regex:block_attn \
  --set full \
  --import-source yes \
  --target-processes all \
  -f -o "$OUT" \
  "${PYTHON:-python3}" "$REPO/profiling/bench_block_attn.py" --ncu \
    --batch "$BATCH" --cache "$CACHE" --block "$BLOCK" --chunk "$CHUNK" --ncu-calls "$NCU_CALLS" --variant "$VARIANT"
