"""Benchmark kv_cache_write: CUDA kernel vs the PyTorch reference on decode-like shapes.

    python profiling/bench_kv_cache.py            # GPU: SDAR-8B-like caches (Hkv 8, D 128, bf16)
    python profiling/bench_kv_cache.py --cpu      # force the CPU (reference only, one tiny shape)

Prints one table and ends with one JSON line. Columns: `op_us` the public op (validation with
check_lengths=False + custom-op dispatch + kernel), `call_us` one eager bare `_C` call (both between CUDA
events, host overhead included), `kernel_us` the bare kernel's device time (back-to-back calls in one CUDA
graph, rotating through copies of the new k/v whose bytes span 2x L2 where at most 64 copies can: common.graph_time_us;
"eager" in `timing` when the capture failed), `ref_us` the reference; `GB/s` and `%copy` for kernel_us against the
measured device copy bandwidth (bytes = k and v read + written); `l2` "cold" where the rotated k/v span 2x L2
(DRAM reads), "warm" where they are too small to (the smallest writes: GB/s then overstates DRAM bandwidth). In
the sampler the write runs inside the captured decode step, so kernel_us is its cost there; op_us is what an
eager caller pays. `check`: the kernel's cache writes against the reference's before timing ("ok", else the error
and no kernel columns).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RowLog, copy_bandwidth_gbs, device_name, graph_time_us, kernels_dispatched, l2_state,  # noqa: E402
                    check, print_table, rotation, time_fn)

from lightningrl_fast import _ext  # noqa: E402
from lightningrl_fast.ops.kv_cache import kv_cache_write, kv_cache_write_reference  # noqa: E402

# (B, C, L): decode one block of 4 / 32, a finished block + the next one, a prefill chunk
GPU_SHAPES = [(1, 4, 4096), (32, 4, 4096), (128, 4, 4096), (128, 32, 4096), (128, 64, 4096), (16, 1024, 4096)]
CPU_SHAPES = [(2, 4, 64)]


def make(B, C, L, H, D, dtype, device, cache=True):
    """(k_cache, v_cache, k, v, cache_lens, chunk_lens); cache=False: (None, None, ...) for rotating sets."""
    k_cache = torch.zeros(B, L, H, D, dtype=dtype, device=device) if cache else None
    v_cache = torch.zeros_like(k_cache) if cache else None
    k = torch.randn(B, C, H, D, device=device).to(dtype)
    v = torch.randn_like(k)
    cache_lens = torch.randint(0, L - C + 1, (B,), dtype=torch.int32, device=device)
    chunk_lens = torch.full((B,), C, dtype=torch.int32, device=device)
    return k_cache, v_cache, k, v, cache_lens, chunk_lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (reference only)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    H, D = args.heads, args.head_dim
    on_gpu = device.type == "cuda"
    kernels = kernels_dispatched(device, "kv_cache_write")  # op_us calls the public op: not with LRF_DISABLE_KERNELS=1
    if not on_gpu:
        print("No GPU (or --cpu): timing the PyTorch reference only, on one tiny shape.")
        H, D = 2, 16
    elif not kernels:
        print("kv_cache_write does not dispatch to a CUDA kernel (no CUDA build, or LRF_DISABLE_KERNELS=1): timing the "
              "reference only.")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    bw = copy_bandwidth_gbs(device)
    print(f"device: {device_name(device)}; copy bandwidth {bw:.0f} GB/s; Hkv={H} D={D} {str(dtype)[6:]}")

    rows = RowLog("kv_cache_write", device=device_name(device), copy_gbs=round(bw, 1), dtype=str(dtype)[6:])
    for B, C, L in GPU_SHAPES if on_gpu else CPU_SHAPES:
        t = make(B, C, L, H, D, dtype, device)
        in_bytes = 2 * t[2].numel() * t[2].element_size()  # k and v, read
        nbytes = 2 * in_bytes  # read + written
        row = {"B": B, "C": C, "L": L}
        row["ref_us"] = 1e3 * time_fn(lambda: kv_cache_write_reference(*t), device=device)
        if kernels:
            kernel = _ext.ext().kv_cache_write
            # the kernel's writes checked against the reference's (a copy: exact) before anything is timed
            got, want = [(t[0].clone(), t[1].clone()) for _ in range(2)]
            kv_cache_write_reference(*want, *t[2:])
            row["check"] = check(lambda: (kernel(*got, *t[2:], None), got)[1], want, rel=0.0) or "ok"
            del got, want
        if kernels and row["check"] == "ok":
            row["op_us"] = 1e3 * time_fn(lambda: kv_cache_write(*t, check_lengths=False), device=device)
            row["call_us"] = 1e3 * time_fn(lambda: kernel(*t, None), device=device)
            # more new k/v (and write offsets) into the same caches: the reads do not come from L2
            sets = [t] + [t[:2] + make(B, C, L, H, D, dtype, device, cache=False)[2:]
                          for _ in range(1, rotation(in_bytes, device))]
            us = graph_time_us([lambda s=s: kernel(*s, None) for s in sets], device)
            row["timing"] = "graph" if us is not None else "eager"
            row["l2"] = l2_state(in_bytes, len(sets) if us is not None else 1, device)
            row["kernel_us"] = us if us is not None else row["call_us"]
            del sets
            row["GB/s"] = nbytes / (row["kernel_us"] * 1e-6) / 1e9
            row["%copy"] = 100 * row["GB/s"] / bw
            row["speedup"] = row["ref_us"] / row["op_us"]
        rows.append(row)
    print_table(rows)
    rows.emit(kernels=kernels, heads=H, head_dim=D,
              rows=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows])


if __name__ == "__main__":
    main()
