"""Benchmark the decode skinny GEMM (ops.linear's kernel) against cuBLAS (F.linear) on SDAR decode shapes.

    python profiling/bench_linear.py                  # GPU: SDAR-8B's projections, bf16, tokens 1..64
    python profiling/bench_linear.py --config sdar-4b --tokens 8,64
    python profiling/bench_linear.py --cpu            # no GPU: the reference on small shapes

Rows: one per (projection, tokens M). The projections of a decoder layer as the decode forward runs them
(q/k/v packed, o_proj, gate/up packed, down_proj) and the lm_head, y [M, N] = x [M, K] W[N, K]^T. M = batch x
chunk tokens per forward: the sampler's chunk is 2 blocks, so batch 1 at block 4 / 32 is M = 8 / 64.
Columns (device microseconds per call: back-to-back calls in one CUDA graph, cycling through weight copies
that span 2x L2 so that every call streams its weights from DRAM, `common.graph_time_us`):
  `cublas_us`   F.linear (cuBLAS): the reference op and the baseline (the best installed one for this product)
  `kernel_us`   _C.linear, plain launches
  `pdl_us`      _C.linear with programmatic dependent launch (each call's weight loads may start while the
                previous call drains; in the decode step the previous kernel is a norm / attention / silu_mul)
  GB/s and %copy for the faster kernel column (weights + x + y bytes / time, against the measured copy
  bandwidth), and `x_cublas` = cublas_us / min(kernel_us, pdl_us);
  `check` the kernel's output against F.linear's before it is timed ("ok", else the error and no kernel time);
  `l2` "cold" where the weight copies span 2x L2 (at most 8 copies: "warm" for the small projections of small
  configs, where GB/s overstates DRAM bandwidth); `timing` "graph", or the columns timed eagerly because their
  capture failed (CUDA events around each call, cycling through the same weight copies; host overhead included).
Prints one table and ends with one JSON line. Record GPU results in profiling/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ColumnTimes, RowLog, check, copy_bandwidth_gbs, device_name, ints, l2_state,  # noqa: E402
                    print_table, rotation)

from bench_decode import CONFIGS  # noqa: E402  (the named model shapes, REFERENCE §1)

from lightningrl_fast import _ext  # noqa: E402
from lightningrl_fast.model import SDARConfig  # noqa: E402


def projections(cfg) -> list[tuple[str, int, int]]:
    """(name, N, K) of the decode forward's GEMMs for a model config."""
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return [("qkv", (hq + 2 * hkv) * d, h), ("o_proj", h, hq * d), ("gate_up", 2 * cfg.intermediate_size, h),
            ("down", h, cfg.intermediate_size), ("lm_head", cfg.vocab_size, h)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (reference only, tiny shapes)")
    ap.add_argument("--config", default="sdar-8b", choices=sorted(CONFIGS), help="model shapes")
    ap.add_argument("--tokens", type=ints, default=[1, 4, 8, 32, 64], help="comma-separated M values (1..64)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    on_gpu = device.type == "cuda"
    mod = _ext.ext()
    kernels = on_gpu and _ext.has_cuda_kernels() and hasattr(mod, "linear")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tokens = args.tokens
    if any(not 1 <= t <= 64 for t in tokens):
        ap.error(f"--tokens must be in 1..64, got {args.tokens}")
    cfg = SDARConfig(**CONFIGS[args.config if on_gpu else "tiny"])
    bw = copy_bandwidth_gbs(device)
    print(f"device: {device_name(device)}; copy bandwidth {bw:.0f} GB/s; {args.config if on_gpu else 'tiny'} "
          f"shapes, {str(dtype)[6:]}; kernels {'yes' if kernels else 'no (reference only)'}")

    rows = RowLog("linear", device=device_name(device), copy_gbs=round(bw, 1), dtype=str(dtype)[6:],
                  config=args.config if on_gpu else "tiny")
    for name, n, k in projections(cfg):
        g = torch.Generator(device=device).manual_seed(n + k)
        w0 = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
        wbytes = w0.numel() * w0.element_size()
        weights = [w0] + [w0.clone() for _ in range(rotation(wbytes, device, max_sets=8) - 1)]
        for m in tokens:
            x = torch.randn(m, k, generator=g, device=device).to(dtype)
            nbytes = wbytes + (m * k + m * n) * w0.element_size()
            timed = ColumnTimes(device)
            row = {"proj": name, "M": m, "N": n, "K": k, "l2": l2_state(wbytes, len(weights), device),
                   "cublas_us": timed("cublas_us", [lambda w=w: F.linear(x, w) for w in weights])}
            if kernels:  # the kernel's output checked against cuBLAS' before it is timed
                want = F.linear(x, w0)
                row["check"] = (check(lambda: mod.linear(x, w0, False), want)
                                or check(lambda: mod.linear(x, w0, True), want) or "ok")
            if kernels and row["check"] == "ok":
                row["kernel_us"] = timed("kernel_us", [lambda w=w: mod.linear(x, w, False) for w in weights])
                row["pdl_us"] = timed("pdl_us", [lambda w=w: mod.linear(x, w, True) for w in weights])
                best = min(row["kernel_us"], row["pdl_us"])
                row["GB/s"] = nbytes / (best * 1e-6) / 1e9
                row["%copy"] = 100 * row["GB/s"] / bw
                row["cublas_%copy"] = 100 * nbytes / (row["cublas_us"] * 1e-6) / 1e9 / bw
                row["x_cublas"] = row["cublas_us"] / best
            if on_gpu:
                row["timing"] = timed.label()
            rows.append(row)
        del weights
    print_table(rows)
    rows.emit(kernels=kernels,
              rows=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows])


if __name__ == "__main__":
    main()
