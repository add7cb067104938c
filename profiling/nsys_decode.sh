#!/usr/bin/env bash
# Nsight Systems timeline of block-diffusion decoding, keyed on the NVTX ranges (profiling/README.md).
#
#   bash profiling/nsys_decode.sh [OUT_BASENAME] [bench_decode.py options...]
#   bash profiling/nsys_decode.sh decode_8b --config sdar-8b --batches 8 --blocks 32 --graphs off --impl kernels
#
# Writes OUT_BASENAME.nsys-rep (default profiling/out/nsys_decode) and prints the NVTX range and CUDA kernel
# summaries (nsys stats). The ranges: `bench b=.. blk=.. graphs=.. impl=..` (the timed call), `warmup ...`,
# and inside them the sampler's `prefill`, `denoise_step`, `commit`. Use --graphs off to see every kernel of a
# step under its denoise_step range (a replayed CUDA graph shows as one graph launch). Keep the run small:
# one batch, one block, --repeats 1.
# nsys is looked up as $NSYS, then on PATH, then under /opt/nvidia and /usr/local/cuda. The lent GPU machines
# of this workplace have no working nsys (not on PATH; the copy bundled with Nsight Compute cannot make a
# report): there, use profiling/ncu_kernels.sh, or `bench_decode.py --torch-trace FILE` for a Chrome trace.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OUT="${1:-profiling/out/nsys_decode}"
[ $# -gt 0 ] && shift
mkdir -p "$(dirname "$OUT")"

NSYS="${NSYS:-$(command -v nsys || true)}"
if [ -z "$NSYS" ]; then
  for c in /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/bin/nsys /usr/local/cuda/nsight-systems-*/bin/nsys; do
    [ -x "$c" ] && NSYS="$c" && break
  done
fi
if [ -z "$NSYS" ]; then
  echo "nsys (Nsight Systems) not found: set NSYS=/path/to/nsys, or use profiling/ncu_kernels.sh," >&2
  echo "or: python profiling/bench_decode.py --torch-trace trace.json ... (open in chrome://tracing / Perfetto)" >&2
  exit 1
fi

ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--config sdar-8b --batches 8 --blocks 32 --graphs off --impl kernels --repeats 1)

"$NSYS" profile --trace cuda,nvtx,osrt --sample none --cuda-graph-trace node --force-overwrite true \
  --output "$OUT" "${PYTHON:-python3}" profiling/bench_decode.py "${ARGS[@]}"
"$NSYS" stats --report nvtx_sum,cuda_gpu_kern_sum --format column "$OUT.nsys-rep" || true
echo "timeline: $OUT.nsys-rep (open in the Nsight Systems GUI)"
