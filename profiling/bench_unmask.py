"""Benchmark threshold_unmask: the CUDA kernel vs the PyTorch reference (eager and torch.compile) and
FlashInfer's sampling kernel (when installed), vocabulary 151936, blocks of 32 positions.

    python profiling/bench_unmask.py                  # GPU: 32 (one sequence) to 8192 rows, bf16
    python profiling/bench_unmask.py --no-compile     # skip torch.compile (it compiles once per shape)
    python profiling/bench_unmask.py --cpu            # the reference only, one tiny shape

Prints one table and ends with one JSON line. Every position starts masked (the kernel skips positions that
are not, so this is its full workload); quota 1, tau 0.9. Columns:
  kernel_us   device time of one `_C.threshold_unmask` call: 20 calls captured in a CUDA graph, each after a
              reset of its `masked` tensor; the resets alone are timed in a second graph and subtracted
  GB/s, %copy logit bytes / kernel_us, against the measured device copy bandwidth (profiling/common.py); the 20
              calls read ONE logits tensor: `l2` "warm" where it is smaller than 2x L2 (32 / 128 rows: 9.7 / 39 MB,
              served from L2 as the lm_head's fresh output is in a decode step: GB/s there is not a DRAM figure),
              "cold" from 1024 rows on
  op_us       the public op called eagerly (validation + custom-op dispatch + launch, plus one fill_ that
              re-masks the state it is given; launch-bound when small)
  ref_us      the pure-PyTorch reference, eager; compiled_us the same under torch.compile
  flashinfer_us  flashinfer.sampling.sampling_from_logits on the same logits (a sample per row only: no
              confidence, no selection) — a yardstick for one pass over the vocabulary; device time like kernel_us
              (`flashinfer_timing` "graph"), or eager CUDA events around each call where its capture fails
  x_ref       ref_us / kernel_us
  check       one kernel call against the reference before timing: greedy, the same positions unmasked and every
              pick a maximum of its logits; sampling, the quota unmasked in every block ("ok", else no kernel time)
Modes: `greedy`; `sample` (temperature 1, noise="two_level", the default) on LLM-like logits (a few dominant
tokens over N(0, 2) noise) and `sample-flat` on N(0, 3) logits: one noise value per bucket of 1024 ids and per
token of the chosen bucket, whatever the logits (the scan should run at the greedy scan's speed);
`pertok*` the same with noise="per_token": `pertok` on the LLM-like logits (a sizeable share of the bulk stays
within 17 of the best Gumbel score: candidates), `pertok-peaked` with the few tokens 25..30 above the noise (a
confident position: the CTA-wide threshold prunes most of the bulk), `pertok-flat` where nearly every token is
a candidate and the kernel runs Philox for each (its worst case, RNG-bound).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RowLog, copy_bandwidth_gbs, device_name, device_time, ints,  # noqa: E402
                    kernels_dispatched, l2_state, print_table, time_fn)

from lightningrl_fast import _ext  # noqa: E402
from lightningrl_fast.ops.unmask import threshold_unmask, threshold_unmask_reference  # noqa: E402

BLOCK = 32
GPU_ROWS = [32, 128, 1024, 4096, 8192]
FLAT_ROWS = [32, 1024]
COPIES = 20


def make_logits(rows: int, vocab: int, kind: str, dtype, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    b = rows // BLOCK
    if kind == "flat":
        x = torch.randn(b, BLOCK, vocab, generator=g, device=device, dtype=torch.float32) * 3
    else:  # LLM-like: N(0, 2) plus 4 tokens raised by 12..20 ("peaked": by 25..30, a confident position)
        lo, span = (25, 5) if kind == "peaked" else (12, 8)
        x = torch.randn(b, BLOCK, vocab, generator=g, device=device, dtype=torch.float32) * 2
        top = torch.randint(0, vocab, (b, BLOCK, 4), generator=g, device=device)
        x.scatter_add_(-1, top, lo + span * torch.rand(b, BLOCK, 4, generator=g, device=device))
    return x.to(dtype)


def make_states(b: int, copies: int, device):
    """`copies` independent [B, S] states, all masked, so that each timed call does the full work."""
    def one():
        return [torch.zeros(b, BLOCK, dtype=torch.long, device=device),
                torch.ones(b, BLOCK, dtype=torch.bool, device=device),
                torch.full((b, BLOCK), -2, dtype=torch.int32, device=device),
                torch.zeros(b, BLOCK, device=device), torch.zeros(b, BLOCK, device=device)]
    return [one() for _ in range(copies)]


def extras(b: int, device):
    ones = torch.ones(b, dtype=torch.int32, device=device)
    return [ones, ones.clone(), torch.tensor([151643, 151645], device=device), torch.tensor([1234], device=device),
            torch.tensor([0], device=device)]


def cycling(states):
    it = [0]

    def nxt():
        st = states[it[0] % len(states)]
        it[0] += 1
        for t in st[1:2]:
            t.fill_(True)
        return st
    return nxt


def graph_time_us(logits, states, extra, greedy, noise, kernel, device) -> float:
    """Device time per kernel call: a graph of COPIES (reset + call) minus a graph of the resets alone."""
    masked0 = torch.ones_like(states[0][1])
    args = (0.9, 1.0, 0, 1.0, greedy, noise == "two_level")

    def body(with_kernel):
        for st in states:
            st[1].copy_(masked0)
            if with_kernel:
                kernel(logits, *st, *extra, *args)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body(True)  # warm-up (sizes the workspace) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    times = []
    for with_kernel in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body(with_kernel)
        times.append(time_fn(g.replay, device=device, warmup=3, iters=20))
    return 1e3 * (times[0] - times[1]) / len(states)


def kernel_check(logits, extra, greedy, noise, kernel) -> str:
    """One kernel call on fresh all-masked states against the reference's, before the kernel is timed: "ok" or what
    differs. Greedy: the same positions unmasked (quota 1, tau 0.9) and each picked token a maximum of its logits
    (ties may break either way; positions whose confidence is within 1e-4 of tau or of their block's best may be
    selected differently, as the kernel's conf is a few ulp from the reference's), each written confidence the
    softmax probability of its pick; sampling: at least the quota unmasked in every block, picks inside the
    vocabulary."""
    b, vocab = logits.shape[0], logits.shape[-1]
    (got, want) = make_states(b, 2, logits.device)
    try:
        kernel(logits, *got, *extra, 0.9, 1.0, 0, 1.0, greedy, noise == "two_level")
    except Exception as e:  # a launcher that refuses the inputs: no time either
        return f"raised {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    threshold_unmask_reference(logits, *want, *extra, 0.9, 1.0, 0, 1.0, greedy, noise)
    tokens, masked = got[0], got[1]
    picked = ~masked
    if not bool(picked.any(-1).all()):
        return "a block had nothing unmasked (quota 1)"
    if not bool(((tokens[picked] >= 0) & (tokens[picked] < vocab)).all()):
        return "a token outside the vocabulary"
    if greedy:
        # the kernel's conf is a few ulp from the reference's (kernels/unmask.cuh): a position whose conf is within
        # that of the threshold or of its block's best may be selected either way; elsewhere selections must agree
        lf = logits.float()
        top = lf.amax(-1)  # [B, S]
        conf = torch.exp(top - torch.logsumexp(lf, -1))  # [B, S] confidence of the greedy pick
        best = conf.amax(-1, keepdim=True)  # [B, 1]; the top-1 rule decides only where it is below tau
        near = ((conf - 0.9).abs() <= 1e-4) | (((conf - best).abs() <= 1e-4) & (best < 0.9 + 1e-4))
        differ = (masked != want[1]) & ~near
        if bool(differ.any()):
            return f"{int(differ.sum())} positions unmasked differently from the reference"
        if not torch.allclose(got[4][picked], conf[picked], rtol=1e-3, atol=1e-5):
            return "a picked position's confidence differs from the softmax of its logits"
        at = lf.gather(-1, tokens.clamp(0, vocab - 1)[..., None]).squeeze(-1)
        if not bool((at[picked] == top[picked]).all()):
            return "a greedy pick is not a maximum of its logits"
    return "ok"


def maybe_flashinfer():
    try:
        import flashinfer.sampling as fs  # noqa: PLC0415
        return fs.sampling_from_logits
    except Exception:  # not installed, or an incompatible build
        return None


def timed_or_none(fn, device, warmup, iters):
    try:
        return 1e3 * time_fn(fn, device=device, warmup=warmup, iters=iters)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


MODES = ("greedy", "sample", "pertok", "sample-flat", "pertok-peaked", "pertok-flat")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (reference only, one tiny shape)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--rows", type=ints, default=GPU_ROWS, help="comma-separated row counts (multiples of the block, 32)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--modes", default="", help="comma-separated subset of the modes (greedy, sample, pertok, "
                    "sample-flat, pertok-peaked, pertok-flat); default all")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"--modes: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if any(r % BLOCK for r in args.rows):
        ap.error(f"--rows must be multiples of the block ({BLOCK}): rows = sequences x {BLOCK}, got {args.rows}")

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    on_gpu = device.type == "cuda"
    kernels = kernels_dispatched(device, "threshold_unmask")  # op_us calls the public op (LRF_DISABLE_KERNELS)
    vocab = args.vocab if on_gpu else 1000
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        print("No GPU (or --cpu): the CUDA kernel needs a GPU; timing the PyTorch reference only, on one tiny "
              f"shape ({BLOCK * 2} rows x {vocab} tokens).")
    elif not kernels:
        print("threshold_unmask does not dispatch to a CUDA kernel (no CUDA build, or LRF_DISABLE_KERNELS=1): "
              "timing the references only.")
    bw = copy_bandwidth_gbs(device)
    fi = maybe_flashinfer() if on_gpu else None
    print(f"device: {device_name(device)}; copy bandwidth {bw:.0f} GB/s; vocab {vocab}, {str(dtype)[6:]}, "
          f"block {BLOCK}; flashinfer {'yes' if fi else 'not installed'}")

    plan = []
    for rows in (args.rows if on_gpu else [2 * BLOCK]):
        plan += [(rows, "greedy"), (rows, "sample"), (rows, "pertok")]
        if rows in FLAT_ROWS or not on_gpu:
            plan += [(rows, "sample-flat"), (rows, "pertok-peaked"), (rows, "pertok-flat")]
    if modes:
        plan = [(rows, m) for rows, m in plan if m in modes]

    rows_out = RowLog("threshold_unmask", device=device_name(device), copy_gbs=round(bw, 1), dtype=str(dtype)[6:],
                        vocab=vocab)
    compiled = None
    if not args.no_compile:
        for knob in ("recompile_limit", "cache_size_limit"):  # one compilation per (shape, mode): keep them all
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
        compiled = torch.compile(threshold_unmask_reference, dynamic=False)
    for rows, mode in plan:
        b = rows // BLOCK
        greedy = mode == "greedy"
        noise = "per_token" if mode.startswith("pertok") else "two_level"
        kind = "flat" if mode.endswith("-flat") else "peaked" if mode.endswith("-peaked") else "llm"
        logits = make_logits(rows, vocab, kind, dtype, device)
        extra = extras(b, device)
        states = make_states(b, COPIES, device)
        nbytes = logits.numel() * logits.element_size()
        row = {"rows": rows, "B": b, "mode": mode, "l2": l2_state(nbytes, 1, device)}
        heavy = rows * vocab > (1 << 28)  # the reference and compile take seconds per call there
        warm, iters = (1, 3) if heavy or not on_gpu else (3, 10)
        if kernels:
            row["check"] = kernel_check(logits, extra, greedy, noise, _ext.ext().threshold_unmask)
        if kernels and row["check"] == "ok":
            row["kernel_us"] = graph_time_us(logits, states, extra, greedy, noise, _ext.ext().threshold_unmask,
                                             device)
            row["GB/s"] = nbytes / (row["kernel_us"] * 1e-6) / 1e9
            row["%copy"] = 100 * row["GB/s"] / bw
            nxt = cycling(states)
            row["op_us"] = 1e3 * time_fn(lambda: threshold_unmask(logits, *nxt(), *extra, greedy=greedy, noise=noise),
                                         device=device, warmup=5, iters=20)
        nxt = cycling(states)
        ref_args = (0.9, 1.0, 0, 1.0, greedy, noise)
        row["ref_us"] = timed_or_none(lambda: threshold_unmask_reference(logits, *nxt(), *extra, *ref_args),
                                      device, warm, iters)
        if compiled is not None:
            try:
                row["compiled_us"] = timed_or_none(lambda: compiled(logits, *nxt(), *extra, *ref_args), device, warm,
                                                   iters)
            except Exception as e:  # a compile failure is a result too
                row["compiled_us"] = f"error: {type(e).__name__}"
        if fi is not None:
            flat = logits.view(-1, vocab)
            try:  # device time as kernel_us (a graph of back-to-back calls), eager where it cannot be captured
                row["flashinfer_us"], row["flashinfer_timing"] = device_time([lambda: fi(flat)], device)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                row["flashinfer_us"] = None
        if isinstance(row.get("kernel_us"), float) and isinstance(row.get("ref_us"), float):
            row["x_ref"] = row["ref_us"] / row["kernel_us"]
        rows_out.append({k: ("oom" if v is None else v) for k, v in row.items()})
        del logits, states
        if on_gpu:
            torch.cuda.empty_cache()

    cols = ["rows", "B", "mode", "l2", "check", "kernel_us", "GB/s", "%copy", "op_us", "ref_us", "compiled_us",
            "flashinfer_us", "x_ref"]
    print_table([{c: r.get(c, "") for c in cols} for r in rows_out])
    rows_out.emit(kernels=kernels, block=BLOCK, flashinfer=fi is not None,
              rows=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows_out])


if __name__ == "__main__":
    main()
