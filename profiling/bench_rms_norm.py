"""Benchmark the fused RMSNorm, residual-add + RMSNorm and q/k-norm + RoPE kernels against the eager formulas.

    python profiling/bench_rms_norm.py            # GPU: SDAR-8B shapes (hidden 4096, 32 q / 8 kv heads, D 128)
    python profiling/bench_rms_norm.py --cpu      # no GPU: the references on one small shape

What matters in decoding is not one call but the norm work of a whole denoising step inside its CUDA graph:
per layer two residual adds, two hidden-size norms, and the q and k head norms with RoPE, 36 layers for
SDAR-8B. So two tables' worth of rows in one:
  * `op` rows: one call of each op (`kernel_us` the bare `_C` call, `ref_us` the eager reference,
    `compiled_us` the reference under torch.compile), each as device time: back-to-back calls in one CUDA
    graph over input copies spanning 2x L2 where at most 64 copies can (`l2` "cold"; "warm" at 8 / 256 tokens,
    where GB/s is not a DRAM figure), `common.device_time`; `timing` names the columns timed eagerly because their
    capture failed; `check` the kernel's output against the reference before it is timed ("ok", else the error and
    no kernel time). GB/s and % of the device copy bandwidth for the kernel (bytes: inputs read + outputs written,
    + cos/sin for RoPE);
  * `step` rows: the norm work of all layers of one step captured in one CUDA graph and replayed, for tokens
    per step = batch x chunk in {8, 256, 2048}: `ref_us` the eager formulas; `per_op_us` one kernel per
    norm and per q / k head norm with torch's residual adds (6 launches per layer, the decode forward before
    the fusion); `kernel_us` what the decode forward runs now (2 add_rms_norm + 1 two-weight qk_norm_rope
    over a packed q/k view: 3 launches per layer).
Prints one table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ColumnTimes, RowLog, check, copy_bandwidth_gbs, device_name, device_time_us,  # noqa: E402
                    l2_state, print_table, rotation)

from lightningrl_fast import _ext  # noqa: E402
from lightningrl_fast.model import rope_cos_sin  # noqa: E402
from lightningrl_fast.ops.rms_norm import (  # noqa: E402
    add_rms_norm_reference,
    qk_norm_rope_reference,
    rms_norm_reference,
)

EPS = 1e-6


def inputs(tokens: int, hidden: int, hq: int, hkv: int, d: int, dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, tokens, hidden, generator=g, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(dtype)
    q = torch.randn(1, tokens, hq, d, generator=g, device=device).to(dtype)
    k = torch.randn(1, tokens, hkv, d, generator=g, device=device).to(dtype)
    wd = (1 + 0.1 * torch.randn(d, generator=g, device=device)).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(tokens, device=device)[None] + 100, d, 1e6, dtype)
    r = torch.randn(1, tokens, hidden, generator=g, device=device).to(dtype)
    qkv = torch.randn(1, tokens, hq + 2 * hkv, d, generator=g, device=device).to(dtype)  # a packed projection
    return x, w, q, k, wd, cos, sin, r, qkv[:, :, : hq + hkv]


def graph_time(fn, device) -> float:
    """Microseconds of one replay of `fn` (a whole step's norm work) captured in a CUDA graph."""
    return device_time_us([fn], device, min_calls=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (references only)")
    ap.add_argument("--layers", type=int, default=36, help="layers per step in the `step` rows (SDAR-8B: 36)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    on_gpu = device.type == "cuda"
    mod = _ext.ext()
    kernels = on_gpu and _ext.has_cuda_kernels() and hasattr(mod, "rms_norm")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    hidden, hq, hkv, d = (4096, 32, 8, 128) if on_gpu else (256, 4, 2, 64)
    bw = copy_bandwidth_gbs(device)
    print(f"device: {device_name(device)}; copy bandwidth {bw:.0f} GB/s; hidden {hidden}, heads {hq}/{hkv}, "
          f"D {d}, {str(dtype)[6:]}; kernels {'yes' if kernels else 'no (references only)'}")
    compiled_rms = compiled_rope = compiled_add = None
    if not args.no_compile and on_gpu:
        compiled_rms = torch.compile(rms_norm_reference)
        compiled_rope = torch.compile(qk_norm_rope_reference)
        compiled_add = torch.compile(add_rms_norm_reference)

    rows = RowLog("rms_norm", device=device_name(device), copy_gbs=round(bw, 1), dtype=str(dtype)[6:])
    for tokens in (8, 256, 2048) if on_gpu else (8,):
        checks = []  # the op rows' kernel checks: the step rows time kernels only when every one passed
        xb = tokens * hidden * torch.empty((), dtype=dtype).element_size()
        # copies of every input (x, residual, q, k, the packed q/k) whose x alone spans 2x L2 where 64 can
        sets = [inputs(tokens, hidden, hq, hkv, d, dtype, device, seed=i) for i in range(rotation(xb, device))]
        x, w, q, k, wd, cos, sin, r, qk = sets[0]
        cb = 2 * cos.numel() * cos.element_size()
        qb, qkb = q.numel() * q.element_size(), qk.numel() * qk.element_size()
        # name, reference, compiled reference, kernel, the arguments from a set, bytes moved, bytes read per call
        for name, ref, comp, kern, args_of, nbytes, in_bytes in [
            ("rms_norm", rms_norm_reference, compiled_rms, getattr(mod, "rms_norm", None),
             lambda s: (s[0], s[1], EPS), 2 * xb, xb),
            ("add_rms_norm", add_rms_norm_reference, compiled_add, getattr(mod, "add_rms_norm", None),
             lambda s: (s[0], s[7], s[1], EPS), 4 * xb, 2 * xb),
            ("qk_norm_rope q", qk_norm_rope_reference, compiled_rope, getattr(mod, "qk_norm_rope", None),
             lambda s: (s[2], s[4], s[5], s[6], EPS), 2 * qb + cb, qb + cb),
            ("qk_norm_rope q+k", qk_norm_rope_reference, compiled_rope, getattr(mod, "qk_norm_rope", None),
             lambda s: (s[8], s[4], s[5], s[6], EPS, s[4], hq), 2 * qkb + cb, qkb + cb),
        ]:
            columns = ColumnTimes(device)

            def timed(col, fn):
                return columns(col, [lambda a=args_of(st): fn(*a) for st in sets])

            row = {"kind": "op", "what": name, "tokens": tokens, "l2": l2_state(in_bytes, len(sets), device)}
            row["ref_us"] = timed("ref_us", ref)
            if comp is not None:
                try:
                    row["compiled_us"] = timed("compiled_us", comp)
                except Exception as e:  # an Inductor failure is reported, not fatal
                    row["compiled_us"] = f"failed: {type(e).__name__}"
            if kernels:  # the kernel's output checked against the reference before it is timed
                row["check"] = check(lambda: kern(*args_of(sets[0])), ref(*args_of(sets[0]))) or "ok"
                checks.append(row["check"])
            if kernels and row["check"] == "ok":
                row["kernel_us"] = timed("kernel_us", kern)
                row["GB/s"] = nbytes / (row["kernel_us"] * 1e-6) / 1e9
                row["%copy"] = 100 * row["GB/s"] / bw
                row["x_ref"] = row["ref_us"] / row["kernel_us"]
            if on_gpu:
                row["timing"] = columns.label()
            rows.append(row)
        if on_gpu:
            def eager_step():
                for _ in range(args.layers):
                    add_rms_norm_reference(x, r, w, EPS)
                    qk_norm_rope_reference(q, wd, cos, sin, EPS)
                    qk_norm_rope_reference(k, wd, cos, sin, EPS)
                    add_rms_norm_reference(x, r, w, EPS)

            row = {"kind": "step", "what": f"{args.layers} layers x (2 add+norm, q/k norm)", "tokens": tokens,
                   "ref_us": graph_time(eager_step, device)}
            if kernels and all(c == "ok" for c in checks):
                def per_op_step():  # the decode forward before the add / q+k fusion: 6 launches per layer
                    for _ in range(args.layers):
                        mod.rms_norm(x + r, w, EPS)
                        mod.qk_norm_rope(q, wd, cos, sin, EPS)
                        mod.qk_norm_rope(k, wd, cos, sin, EPS)
                        mod.rms_norm(x + r, w, EPS)

                def fused_step():  # now: 3 launches per layer
                    for _ in range(args.layers):
                        mod.add_rms_norm(x, r, w, EPS)
                        mod.qk_norm_rope(qk, wd, cos, sin, EPS, wd, hq)
                        mod.add_rms_norm(x, r, w, EPS)

                row["per_op_us"] = graph_time(per_op_step, device)
                row["kernel_us"] = graph_time(fused_step, device)
                row["x_ref"] = row["ref_us"] / row["kernel_us"]
                row["x_per_op"] = row["per_op_us"] / row["kernel_us"]
            rows.append(row)
    print_table(rows)
    rows.emit(kernels=kernels, hidden=hidden, heads=[hq, hkv], head_dim=d,
              rows=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows])


if __name__ == "__main__":
    main()
