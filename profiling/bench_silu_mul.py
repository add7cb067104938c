"""Benchmark the fused silu(gate) * up kernel against the eager formula it replaces in the decode MLP.

    python profiling/bench_silu_mul.py            # GPU: SDAR-8B's intermediate size (I = 12288), bf16
    python profiling/bench_silu_mul.py --cpu      # no GPU: the reference on one small shape

Rows are tokens per step (batch x chunk) in {8, 256, 2048, 16384}; gate_up [tokens, 2 I] as the packed gate/up
GEMM writes it. Columns (device microseconds per call, back-to-back calls in one CUDA graph over input copies
spanning 2x L2 where at most 64 copies can, `common.device_time`): `kernel_us` the bare `_C.silu_mul`, `ref_us`
the eager `F.silu(gate) * up` (two launches), `compiled_us` the same under torch.compile; GB/s and % of the
measured copy bandwidth for the kernel (bytes: gate_up read + the product written), and the speedups; `l2`
"cold" where the input copies span 2x L2 (DRAM reads), "warm" where they cannot (8 tokens: GB/s is then not a
DRAM figure); `timing` "graph", or the columns timed eagerly (CUDA events around each call, host overhead
included) because their capture failed; `check` the kernel's output against the reference before it is timed
("ok", else the error and no kernel time). At 8 tokens (batch-1 decode) every column is launch latency: the saving
is one launch per layer, 36 per SDAR-8B forward.
Prints one table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ColumnTimes, RowLog, check, copy_bandwidth_gbs, device_name, l2_state, print_table,  # noqa: E402
                    rotation)

from lightningrl_fast import _ext  # noqa: E402
from lightningrl_fast.ops.silu_mul import silu_mul_reference  # noqa: E402


def device_us(fn, inputs, timed: ColumnTimes, col: str) -> float:
    """Device time per call of fn over the rotated inputs, as column `col` of `timed` (common.ColumnTimes)."""
    return timed(col, [lambda t=t: fn(t) for t in inputs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (reference only)")
    ap.add_argument("--inner", type=int, default=None, help="intermediate size I (default 12288 GPU / 256 CPU)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    on_gpu = device.type == "cuda"
    mod = _ext.ext()
    kernels = on_gpu and _ext.has_cuda_kernels() and hasattr(mod, "silu_mul")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    inner = args.inner or (12288 if on_gpu else 256)
    bw = copy_bandwidth_gbs(device)
    print(f"device: {device_name(device)}; copy bandwidth {bw:.0f} GB/s; I {inner}, {str(dtype)[6:]}; "
          f"kernels {'yes' if kernels else 'no (reference only)'}")
    compiled = torch.compile(silu_mul_reference) if on_gpu and not args.no_compile else None

    rows = RowLog("silu_mul", device=device_name(device), copy_gbs=round(bw, 1), dtype=str(dtype)[6:])
    for tokens in (8, 256, 2048, 16384) if on_gpu else (8, 64):
        g = torch.Generator(device=device).manual_seed(tokens)
        one = torch.randn(tokens, 2 * inner, generator=g, device=device).mul_(3).to(dtype)
        in_bytes = one.numel() * one.element_size()  # gate and up, read
        nbytes = in_bytes * 3 // 2  # + the product, written
        inputs = [one] + [one.clone() for _ in range(rotation(in_bytes, device) - 1)]
        timed = ColumnTimes(device)
        row = {"tokens": tokens, "l2": l2_state(in_bytes, len(inputs), device),
               "ref_us": device_us(silu_mul_reference, inputs, timed, "ref_us")}
        if compiled is not None:
            try:
                row["compiled_us"] = device_us(compiled, inputs, timed, "compiled_us")
            except Exception as e:  # an Inductor failure is reported, not fatal
                row["compiled_us"] = f"failed: {type(e).__name__}"
        if kernels:  # the kernel's output checked against the reference before it is timed
            row["check"] = check(lambda: mod.silu_mul(one), silu_mul_reference(one)) or "ok"
        if kernels and row["check"] == "ok":
            row["kernel_us"] = device_us(mod.silu_mul, inputs, timed, "kernel_us")
            row["GB/s"] = nbytes / (row["kernel_us"] * 1e-6) / 1e9
            row["%copy"] = 100 * row["GB/s"] / bw
            row["x_ref"] = row["ref_us"] / row["kernel_us"]
            if isinstance(row.get("compiled_us"), float):
                row["x_compiled"] = row["compiled_us"] / row["kernel_us"]
        if on_gpu:
            row["timing"] = timed.label()
        rows.append(row)
    print_table(rows)
    rows.emit(kernels=kernels, inner=inner,
              rows=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows])


if __name__ == "__main__":
    main()
