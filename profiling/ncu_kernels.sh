#!/usr/bin/env bash
# Nsight Compute report of each of our kernels inside the decode loop (profiling/README.md).
#
#   bash profiling/ncu_kernels.sh [OUT_BASENAME] [bench_decode.py options...]
#   KERNELS='regex:kv_cache_write' bash profiling/ncu_kernels.sh kv --config sdar-4b --batches 64 --blocks 4
#
# Profiles only kernels whose names match $KERNELS (default: our kernels kv_cache_write, block_attention /
# block_attn, threshold_unmask / unmask, grpo, the decode skinny GEMM linear_kernel (the default arguments select
# it with --gemm kernel), rms_norm, qk_norm_rope, silu_mul) launched inside the NVTX push/pop range `bench_timed` (the timed
# decode calls, not the warmup), $COUNT launches at most (default 20), with the full section set
# (speed of light, memory workload, occupancy, launch stats). Writes OUT_BASENAME.ncu-rep (default
# profiling/out/ncu_kernels) and prints the per-kernel summary. Clocks are left alone (--clock-control none),
# as the device notes ask. CUDA graphs are turned off by default so that kernels launch one by one.
# ncu reads hardware counters on the Firecracker GPU machines lent here (not on gVisor ones).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OUT="${1:-profiling/out/ncu_kernels}"
[ $# -gt 0 ] && shift
mkdir -p "$(dirname "$OUT")"
NCU="${NCU:-$(command -v ncu || true)}"
if [ -z "$NCU" ]; then
  for c in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
    [ -x "$c" ] && NCU="$c" && break
  done
fi
[ -n "$NCU" ] || { echo "ncu (Nsight Compute) not found: set NCU=/path/to/ncu" >&2; exit 1; }

KERNELS="${KERNELS:-regex:kv_cache_write|block_att|threshold_unmask|unmask|grpo|linear_kernel|rms_norm|qk_norm_rope|silu_mul}"
COUNT="${COUNT:-20}"
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--config sdar-8b --batches 8 --blocks 32 --impl kernels --gemm kernel --repeats 1)

"$NCU" --nvtx --nvtx-include "bench_timed/" --kernel-name "$KERNELS" --launch-count "$COUNT" \
  --set full --clock-control none --target-processes all --force-overwrite --export "$OUT" \
  "${PYTHON:-python3}" profiling/bench_decode.py --graphs off "${ARGS[@]}"
"$NCU" --import "$OUT.ncu-rep" --page raw --csv \
  --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum \
  > "$OUT.csv" || true
"$NCU" --import "$OUT.ncu-rep" --print-summary per-kernel || true
echo "report: $OUT.ncu-rep (ncu-ui), metrics: $OUT.csv"
