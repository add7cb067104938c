"""Benchmark the RL optimizer step: MasterAdamW with its fp32 state on the GPU vs offloaded to pinned host memory
(rl/optim.py, --optimizer-offload), beside torch's fused AdamW (state in the parameters' dtype) as a speed yardstick.

    python profiling/bench_optim.py                          # GPU: SDAR-4B shapes, 4 decoder layers + embeddings
    python profiling/bench_optim.py --config sdar-8b --layers 2
    python profiling/bench_optim.py --cpu                    # tiny shapes on the CPU

Parameters are bf16 (fp32 on the CPU) with SDAR's shapes (embedding, lm_head unless tied, per layer q/k/v/o,
gate/up/down, the norms); `--layers` limits the decoder layers so the resident baseline fits beside the others,
and `full_ms` scales the measured step to the whole model by parameter count. Prints one table and ends with one
JSON line. Columns: `ms` median milliseconds of one `step()` (CUDA events), `Mparam`, `peak_MiB` GPU memory the
step allocates above what was allocated before it (offload: one chunk's temporaries), `host_GiB` pinned host
memory of the offloaded state, `PCIe_GB/s` bytes over PCIe (24 per bf16 parameter: fp32 master + two moments in
and out) / time, `%bound` the copy-bound time / time, `full_ms` milliseconds per step for the whole model. The
copy-bound time is the state's bytes moved in and out at the same time (copies to and from pinned memory on two
streams at once, measured: PCIe carries both directions together), which the overlapped offload (the default)
can reach; `offload serial` (`overlap=False`: every copy on one stream, in and out one after the other) is the
comparison and is bounded by the sum of the two one-way times instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import CONFIGS  # noqa: E402
from common import RowLog, device_name, print_table, time_fn  # noqa: E402

from lightningrl_fast.rl.optim import MasterAdamW  # noqa: E402


def param_shapes(cfg: dict, layers: int | None) -> tuple[list[tuple[int, ...]], int]:
    """SDAR parameter shapes with `layers` decoder layers (None: all), and the whole model's parameter count."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = cfg.get("head_dim", H // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    layer = [(q, H), (kv, H), (kv, H), (H, q), (I, H), (I, H), (H, I), (H,), (H,), (D,), (D,)]
    outer = [(V, H), (H,)] + ([] if cfg.get("tie_word_embeddings") else [(V, H)])
    n_layers = cfg["num_hidden_layers"]
    numel = lambda shapes: sum(int(torch.Size(s).numel()) for s in shapes)  # noqa: E731
    full = numel(outer) + n_layers * numel(layer)
    return outer + layer * min(n_layers, layers or n_layers), full


def pinned_bandwidths(device: torch.device, nbytes: int = 512 << 20) -> tuple[float, float, float]:
    """Measured copy bandwidths (GB/s) of pinned memory: host to device, device to host, and both at once (two
    streams, `nbytes` each way; the figure is the bytes of one direction / the time both took)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = time_fn(lambda: dev.copy_(host, non_blocking=True), device=device, warmup=2, iters=5)
    d2h = time_fn(lambda: host.copy_(dev, non_blocking=True), device=device, warmup=2, iters=5)
    side = torch.cuda.Stream(device)

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream(device))
        dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(side):
            host2.copy_(dev2, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(side)

    duplex = time_fn(both, device=device, warmup=2, iters=5)
    return tuple(nbytes / (ms * 1e-3) / 1e9 for ms in (h2d, d2h, duplex))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (tiny shapes)")
    ap.add_argument("--config", default="sdar-4b", choices=sorted(CONFIGS), help="model shapes (GPU)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers to include (the embeddings always are)")
    ap.add_argument("--iters", type=int, default=3, help="timed steps per row (median)")
    args = ap.parse_args()
    if args.layers < 1 or args.iters < 1:
        ap.error(f"--layers and --iters must be >= 1, got {args.layers} and {args.iters}")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    on_gpu = device.type == "cuda"
    config = args.config if on_gpu else "tiny"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shapes, full = param_shapes(CONFIGS[config], args.layers if on_gpu else None)
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, device=device, generator=g) * 0.02).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, device=device, generator=g) * 1e-3).to(dtype)
    n = sum(p.numel() for p in params)
    h2d, d2h, duplex = pinned_bandwidths(device) if on_gpu else (None, None, None)
    print(f"device: {device_name(device)}; {config} shapes, {len(shapes)} tensors, {n / 1e6:.1f} M parameters "
          f"({full / 1e9:.2f} B in the whole model), {str(dtype)[6:]}"
          + (f"; pinned copies: {h2d:.1f} GB/s to the GPU, {d2h:.1f} GB/s back, {duplex:.1f} GB/s each way at once"
             if on_gpu else ""))

    variants = [("resident", dict(offload=False)), ("offload", dict(offload=True)),
                ("offload serial", dict(offload=True, overlap=False)),
                ("offload chunk 4M", dict(offload=True, chunk_elems=1 << 22)), ("torch AdamW fused", None)]
    rows = RowLog("optim", device=device_name(device), config=config, dtype=str(dtype)[6:])
    for name, kw in variants:
        if kw is None:
            fused = {"fused": True} if on_gpu else {"foreach": True}
            opt = torch.optim.AdamW(params, lr=1e-6, **fused)
        else:
            opt = MasterAdamW(params, lr=1e-6, **kw)
        try:
            opt.step()  # the state's allocation (and first pinning) is not part of the timed steps
            if on_gpu:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if on_gpu else 0
            ms = time_fn(opt.step, device=device, warmup=0, iters=args.iters)
            peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if on_gpu else None
        except torch.cuda.OutOfMemoryError:
            rows.append({"variant": name, "ms": "oom"})
            continue
        finally:
            state_bytes = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                              if torch.is_tensor(t) and t.dim() > 0)
            offloaded = getattr(opt, "offload", False)
            del opt
            if on_gpu:
                torch.cuda.empty_cache()
        row = {"variant": name, "ms": ms, "Mparam": n / 1e6, "peak_MiB": peak,
               "host_GiB": state_bytes / 2**30 if offloaded else 0.0, "full_ms": ms * full / n}
        if offloaded and on_gpu:
            pcie = 2 * state_bytes  # every state byte goes to the GPU and back
            row["PCIe_GB/s"] = pcie / (ms * 1e-3) / 1e9
            bound_s = (state_bytes / h2d + state_bytes / d2h if kw.get("overlap") is False
                       else state_bytes / duplex) / 1e9
            row["%bound"] = 100 * bound_s / (ms * 1e-3)
        rows.append(row)
    print_table([{k: ("-" if r.get(k) is None else r[k]) for k in
                  ("variant", "ms", "Mparam", "peak_MiB", "host_GiB", "PCIe_GB/s", "%bound", "full_ms")} for r in rows])
    rows.emit(layers=args.layers,
              params=n, full_params=full, h2d_gbs=h2d, d2h_gbs=d2h, duplex_gbs=duplex, kernels=False, rows=rows)


if __name__ == "__main__":
    main()
