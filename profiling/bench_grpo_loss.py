"""Benchmark the fused linear GRPO loss (forward + backward): CUDA kernel vs the PyTorch paths and Liger-Kernel.

    python profiling/bench_grpo_loss.py                    # GPU: 16k tokens, hidden 4096, vocab 151936 (SDAR / Qwen2), bf16
    python profiling/bench_grpo_loss.py --tokens 8192 --chunks 1024 4096
    python profiling/bench_grpo_loss.py --cpu              # CPU: the PyTorch reference only, at a tiny size

Rows (one loss + torch.autograd.grad w.r.t. hidden and the LM head per call):
  gemm_bf16          one plain [T, H] x [H, V] bf16 GEMM (torch.mm): the device's GEMM rate, the roofline here
  kernel chunk=N     lightningrl_fast fused_linear_grpo_loss on CUDA (cuBLAS GEMMs + one fused row kernel per chunk)
  reference          the same op's PyTorch path (checkpointed token chunks of linear_logprobs + grpo_token_loss)
  reference+compile  that path under torch.compile (reported as failed if it does not compile)
  dense              materialized [T, V] logits + autograd (skipped when it would not fit)
  liger              Liger-Kernel's LigerFusedLinearGRPOLoss (when installed; its own loss variant "grpo",
                     token-chunked like ours), for time and memory only
The kernel's loss is checked against the reference path's first (no kernel row is timed when it differs: "wrong").
Columns: `ms` median per call, `TFLOP/s` = 6 T H V / time (the useful work: one forward and two backward GEMMs,
whatever a path recomputes), `%gemm` that rate over the plain GEMM's, `peak_GiB` the extra peak allocated memory
of one call over the inputs (torch.cuda.max_memory_allocated), gradients included.
Prints one table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RowLog, check, device_name, kernels_dispatched, print_table, time_fn  # noqa: E402

from lightningrl_fast.ops import grpo_loss as gl  # noqa: E402


def make_inputs(T, H, V, nseq, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = (torch.randn(T, H, generator=g) / H ** 0.5).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H ** 0.25).to(device=device, dtype=dtype).requires_grad_()
    y = torch.randint(0, V, (T,), generator=g).to(device)
    seq = (torch.arange(T) * nseq // T).to(device)  # nseq sequences of T / nseq tokens
    with torch.no_grad():
        old = gl.linear_logprobs(hidden, weight, y, chunk=2048).float()
    ref = old + 0.05 * torch.randn(T, generator=g).to(device)
    adv = torch.randn(nseq, generator=g).to(device)[seq]
    correct = (torch.rand(nseq, generator=g) < 0.5).to(device)
    return hidden, weight, (y, old, ref, adv, seq, nseq, correct)


def measure(fn, device, warmup, iters):
    """(median ms, extra peak bytes) of fn() — fn returns something to drop."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
    else:
        peak = float("nan")
    ms = time_fn(fn, device=device, warmup=warmup, iters=iters)
    return ms, peak


def grad_call(loss_fn, hidden, weight):
    def go():
        loss = loss_fn()
        return torch.autograd.grad(loss, (hidden, weight))
    return go


def reference_loss(hidden, weight, args, chunk, kw):
    """The op's PyTorch path (what fused_linear_grpo_loss runs without the kernel): checkpointed token chunks of
    log-probs, then grpo_token_loss. Written out here so that torch.compile sees PyTorch only (no dispatch)."""
    y, old, ref, adv, seq, nseq, correct = args
    parts = []
    for t0 in range(0, hidden.shape[0], chunk):
        parts.append(torch.utils.checkpoint.checkpoint(gl._chunk_logprobs, hidden[t0 : t0 + chunk], weight,
                                                       y[t0 : t0 + chunk], -1, use_reentrant=False))
    return gl.grpo_token_loss(torch.cat(parts), old, ref, adv, seq, nseq, correct, **kw)[0]


def dense_loss(hidden, weight, args, kw):
    y, old, ref, adv, seq, nseq, correct = args
    logp = torch.log_softmax((hidden @ weight.t()).float(), -1).gather(-1, y[:, None]).squeeze(-1)
    return gl.grpo_token_loss(logp, old, ref, adv, seq, nseq, correct, **kw)[0]


def liger_call(hidden, weight, args, kw, chunk):
    """Liger-Kernel's fused linear GRPO loss on the same tokens laid out [B, L] (None when not installed)."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None
    y, old, ref, adv, seq, nseq, correct = args
    T, H = hidden.shape
    B = nseq
    L = T // B
    n = B * L
    mod = LigerFusedLinearGRPOLoss(beta=kw["beta"], epsilon_low=kw["eps_low"], epsilon_high=kw["eps_high"],
                                   loss_type="grpo", use_ref_model=True, chunk_size=max(1, chunk // L))
    mask = torch.ones(B, L, dtype=torch.long, device=hidden.device)
    adv_b = adv[:n].view(B, L)[:, 0].contiguous()

    def loss_fn():
        out = mod(hidden[:n].view(B, L, H), weight, y[:n].view(B, L), mask, adv_b,
                  ref_per_token_logps=ref[:n].view(B, L), old_per_token_logps=old[:n].view(B, L))
        return out[0] if isinstance(out, tuple) else out

    return loss_fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (reference only, tiny size)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seqs", type=int, default=64, help="sequences the tokens belong to")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096], help="kernel token chunks")
    ap.add_argument("--ref-chunk", type=int, default=1024, help="token chunk of the reference / compiled paths")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    on_gpu = device.type == "cuda"
    # the kernel rows call the public op: it runs the reference when LRF_DISABLE_KERNELS=1, so ask its dispatch
    kernels = kernels_dispatched(device, "fused_linear_grpo_loss")
    T, H, V, nseq = args.tokens, args.hidden, args.vocab, args.seqs
    dtype = torch.bfloat16
    warmup, iters = 2, args.iters
    if not on_gpu:
        print("No GPU (or --cpu): the CUDA kernel needs a GPU; timing the PyTorch reference only, at a tiny size.")
        T, H, V, nseq, dtype, iters = 512, 64, 1000, 8, torch.float32, 3
        args.chunks, args.ref_chunk = [], 128
    elif not kernels:
        print("fused_linear_grpo_loss does not dispatch to a CUDA kernel (no CUDA build of lightningrl_fast._C, or "
              "LRF_DISABLE_KERNELS=1): timing the PyTorch paths only.")
        args.chunks = []
    kw = dict(eps_low=0.2, eps_high=0.28, beta=0.01, mu=0.1, reduction="seq-tok-tok")
    hidden, weight, loss_args = make_inputs(T, H, V, nseq, dtype, device)
    flops = 6.0 * T * H * V
    print(f"device: {device_name(device)}; T={T} H={H} V={V} {str(dtype)[6:]}; {nseq} sequences; "
          f"useful work 6 T H V = {flops / 1e12:.2f} TFLOP")

    rows = RowLog("grpo_loss", device=device_name(device), dtype=str(dtype)[6:])

    def add(name, fn, chunk=None):
        try:
            ms, peak = measure(fn, device, warmup, iters)
        except Exception as e:  # OOM, compile failure, an API mismatch (Liger): report it, keep going
            if on_gpu:
                torch.cuda.empty_cache()
            rows.append({"path": name, "chunk": chunk or "", "ms": "failed", "TFLOP/s": "", "%gemm": "",
                         "peak_GiB": "", "note": f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"})
            return
        rows.append({"path": name, "chunk": chunk or "", "ms": ms, "TFLOP/s": flops / (ms * 1e-3) / 1e12,
                     "%gemm": "", "peak_GiB": peak / 2**30 if on_gpu else "", "note": ""})

    gemm_tflops = None
    if on_gpu:
        with torch.no_grad():
            hd, wd = hidden.detach(), weight.detach()
            out = torch.empty(T, V, device=device, dtype=dtype)
            ms = time_fn(lambda: torch.mm(hd, wd.t(), out=out), device=device, warmup=3, iters=iters)
            del out
        gemm_tflops = 2.0 * T * H * V / (ms * 1e-3) / 1e12
        rows.append({"path": "gemm_bf16 [T,H]x[H,V]", "chunk": "", "ms": ms, "TFLOP/s": gemm_tflops, "%gemm": 100.0,
                     "peak_GiB": "", "note": "2 T H V flops"})
    kernel_check = "ok"
    if args.chunks:  # the kernel's loss checked against the reference path's before any kernel row is timed
        with torch.no_grad():
            want = reference_loss(hidden, weight, loss_args, args.ref_chunk, kw).float()
            kernel_check = check(lambda: gl.fused_linear_grpo_loss(hidden, weight, *loss_args, chunk=args.chunks[0],
                                                                   **kw)[0].float(), want, rel=0.02) or "ok"
        if kernel_check != "ok":
            rows.append({"path": "kernel", "chunk": args.chunks[0], "ms": "wrong", "TFLOP/s": "", "%gemm": "",
                         "peak_GiB": "", "note": f"loss vs reference: {kernel_check}"[:120]})
    for c in args.chunks if kernel_check == "ok" else []:
        add("kernel", grad_call(lambda c=c: gl.fused_linear_grpo_loss(hidden, weight, *loss_args, chunk=c, **kw)[0],
                                hidden, weight), c)
    add("reference", grad_call(lambda: reference_loss(hidden, weight, loss_args, args.ref_chunk, kw), hidden, weight),
        args.ref_chunk)
    if not args.no_compile:
        compiled = torch.compile(lambda h, w: reference_loss(h, w, loss_args, args.ref_chunk, kw))
        add("reference+compile", grad_call(lambda: compiled(hidden, weight), hidden, weight), args.ref_chunk)
    dense_bytes = T * V * (2 + 4 + 4 + 4)
    if not on_gpu or dense_bytes < 0.8 * torch.cuda.mem_get_info(device)[0]:
        add("dense", grad_call(lambda: dense_loss(hidden, weight, loss_args, kw), hidden, weight))
    else:
        rows.append({"path": "dense", "chunk": "", "ms": "skipped", "TFLOP/s": "", "%gemm": "", "peak_GiB": "",
                     "note": f"needs ~{dense_bytes / 2**30:.0f} GiB"})
    try:
        liger = liger_call(hidden, weight, loss_args, kw, args.ref_chunk) if on_gpu else None
    except Exception as e:  # an older / newer Liger API
        liger = None
        rows.append({"path": "liger", "chunk": "", "ms": "failed", "TFLOP/s": "", "%gemm": "", "peak_GiB": "",
                     "note": f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"})
    if liger is not None:
        add("liger", grad_call(liger, hidden, weight), args.ref_chunk)
    elif not any(r["path"] == "liger" for r in rows):
        rows.append({"path": "liger", "chunk": "", "ms": "n/a", "TFLOP/s": "", "%gemm": "", "peak_GiB": "",
                     "note": "liger_kernel not installed" if on_gpu else "needs a GPU"})
    for r in rows:
        if gemm_tflops and isinstance(r["TFLOP/s"], float) and r["%gemm"] == "":
            r["%gemm"] = 100.0 * r["TFLOP/s"] / gemm_tflops
    print_table(rows)

    def best(name):
        vals = [r for r in rows if r["path"] == name and isinstance(r["ms"], float)]
        return min(vals, key=lambda r: r["ms"]) if vals else None

    k, lg = best("kernel"), best("liger")
    summary = {}
    if k is not None:
        summary = {"kernel_ms": round(k["ms"], 3), "kernel_chunk": k["chunk"], "kernel_tflops": round(k["TFLOP/s"], 1),
                   "kernel_pct_gemm": round(k["%gemm"], 1) if gemm_tflops else None,
                   "kernel_peak_gib": round(k["peak_GiB"], 3),
                   "target_60pct_gemm_met": bool(gemm_tflops and k["%gemm"] >= 60.0)}
        if lg is not None:
            summary.update(liger_ms=round(lg["ms"], 3), liger_peak_gib=round(lg["peak_GiB"], 3),
                           not_slower_than_liger=k["ms"] <= lg["ms"], peak_not_above_liger=k["peak_GiB"] <= lg["peak_GiB"])
    if not on_gpu:
        summary["note"] = "the CUDA kernel needs a GPU: PyTorch reference only, tiny size"
    rows.emit(kernels=kernels, tokens=T, hidden=H,
              vocab=V, gemm_tflops=round(gemm_tflops, 1) if gemm_tflops else None, **summary,
              rows=[{k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in r.items()} for r in rows])


if __name__ == "__main__":
    main()
