"""Benchmark block_attention: the CUDA kernel vs the reference op, SDPA, FlexAttention and flash-attn.

    python profiling/bench_block_attn.py              # GPU: decode + prefill shapes (32 q / 8 kv heads, d 128, bf16)
    python profiling/bench_block_attn.py --quick      # a few shapes
    python profiling/bench_block_attn.py --quick --splits 1,4,8,16,32,64   # + the kernel at forced KV splits
    python profiling/bench_block_attn.py --cpu        # the reference only, one tiny shape each (no GPU needed)
    python profiling/bench_block_attn.py --ncu --batch 1 --cache 4096 --block 4   # one shape under an NVTX
                                                      # range "block_attn" (profiling/ncu_block_attn.sh)

Every row has every row of the batch at the same cache length `cache` (block-aligned) and a full chunk:
decode = one block (C = block) or a finished block + the next one (C = 2 x block); prefill = a whole
prompt (cache 0, C = prompt length). Timing (`timing` field): the kernel and the SDPA / Flex baselines are
timed as device time: back-to-back calls captured in one CUDA graph (common.graph_time_us), rotating through
enough copies of the inputs that their K/V span 2x the L2 cache (`sets` copies, at most 64), so no call finds its
keys in L2 and no host launch gap is counted ("graph"); a call that cannot be captured is timed eagerly over the
same copies ("eager"). `l2` "cold" where the copies span 2x L2, "warm" where 64 copies cannot (GB/s then
overstates DRAM bandwidth). Columns (microseconds):
  kernel_us  _C.block_attention (chunk write + attention; split count chosen by the launcher), device time,
             the automatic variant (mma.sync)
  wgmma_us   the same with the wgmma variant (sm_90 GPUs; "-" elsewhere); wg_x = kernel_us / wgmma_us (> 1: the
             wgmma variant is faster). Not yet run on hardware: by default (--wgmma probe) a child process first
             runs it once on every row shape, and a failure there (a fault's sticky CUDA error would end this
             process) leaves its columns out of the run, said on the console and in the final line's wgmma_note
  call_us    the same, one eager call between CUDA events (what the first lease measured: it includes the
             host's argument checks, output / partial allocation and launches whenever the GPU waits for them)
  ref_us     the op's PyTorch reference (cache write + masked SDPA over the whole cache)
  sdpa_us    F.scaled_dot_product_attention on the cached keys with the equivalent mask (no mask when the
             chunk is one block: it then sees every key; else an additive mask in q's dtype built once, not a
             bool one SDPA would convert on every call), best of the flash / cuDNN / efficient backends that
             accept the inputs (`sdpa` names it); attention only, no cache write
  flex_us    FlexAttention (torch.compile'd, block mask built once per shape); attention only
  fa_us      flash_attn_with_kvcache when flash-attn is installed (appends k/v like the kernel; causal=True
             within a two-block chunk, i.e. a stricter mask than block-causal); else "-"
  best          the faster of our variants (mma / wgmma); the columns below use its time
  check         each kernel variant's output against the reference on the first two rows, before it is timed:
                "ok", or the variant and its error (its time column then says "wrong" and it is not "best")
  GB/s, %copy   K/V bytes read by the kernel / kernel time, against the measured device copy bandwidth
                (bytes read + written per second, profiling/common.py)
  TFLOP/s       4 * D * (query, key) pairs allowed by the mask / kernel time
  vs_best       kernel time / fastest baseline time (< 1: the kernel is faster)
With --splits (decode rows): `s<n>_us` the mma.sync kernel forced to n KV splits (device time as kernel_us, whose
split count the launcher chose; "-" where n splits' fp32 partial outputs would exceed 1 GiB, i.e. large batches
that need no split), `best_split` the fastest n and `split_x` = kernel_us / its time (> 1: the launcher's choice
leaves that factor on the table; the data for tuning kernels::block_attn_num_splits).
Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RowLog, copy_bandwidth_gbs, device_name, emit_json, l2_state,  # noqa: E402
                    check, ints, print_table, rotation, time_fn)
from common import device_time as common_device_time  # noqa: E402

from lightningrl_fast import _ext  # noqa: E402
from lightningrl_fast.ops.block_attn import VARIANTS, block_attention_reference  # noqa: E402

HQ, HKV, D = 32, 8, 128
# (batch, cache, block, chunk): decode rows
DECODE = [(b, L, bs, c) for b in (1, 8, 32, 128, 256) for L in (512, 2048, 8192) for bs, c in ((4, 4), (32, 32), (32, 64))]
QUICK_DECODE = [(1, 8192, 4, 4), (32, 2048, 4, 4), (128, 4096, 32, 32), (256, 2048, 32, 64)]
# (batch, prompt length, block): prefill rows (cache 0)
PREFILL = [(1, 4096, 32), (4, 2048, 4), (8, 1024, 32), (1, 8192, 4)]
QUICK_PREFILL = [(1, 4096, 32), (4, 2048, 4)]
SPLIT_PARTIAL_MAX_BYTES = 1 << 30  # --splits: skip a forced split count whose partial outputs exceed this
REF_MAX_BYTES = 8 << 30  # skip the reference where its repeat_interleave'd K/V would exceed this


def block_mask_bool(B, C, Lk, cl, bs, device):
    """[B, 1, C, Lk] allow-mask of block attention with every row at cache length cl, chunk length C."""
    i = torch.arange(C, device=device).view(C, 1)
    t = torch.arange(Lk, device=device).view(1, Lk)
    allow = (t < cl + C) & (t // bs <= (cl + i) // bs)
    return allow.view(1, 1, C, Lk).expand(B, 1, C, Lk)


def allowed_pairs(C, cl, bs):
    i = torch.arange(C)
    kend = torch.minimum(torch.full_like(i, cl + C), ((cl + i) // bs + 1) * bs)
    return int(kend.sum())


def make(B, L, C, dtype, device, seed=0):
    cap = L + C
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = rnd(B, C, HQ, D), rnd(B, C, HKV, D), rnd(B, C, HKV, D)
    kc = torch.randn(B, cap, HKV, D, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    cl = torch.full((B,), L, dtype=torch.int32, device=device)
    nl = torch.full((B,), C, dtype=torch.int32, device=device)
    return q, k, v, kc, vc, cl, nl


def time_or_none(fn, device):
    try:
        fn()
        return 1e3 * time_fn(fn, device=device, warmup=5, iters=30)
    except Exception as e:  # a backend that rejects the inputs, out of memory, ...
        print(f"  (skipped: {type(e).__name__}: {str(e).splitlines()[0][:100]})", file=sys.stderr)
        torch.cuda.empty_cache() if device.type == "cuda" else None
        return None


TIMINGS = set()  # how the timed columns of this run were measured ("graph", "eager")


def device_time(make_fn, sets, device):
    """Microseconds per call of make_fn(s)() rotating over the input sets `sets`: CUDA-graph device time when
    the calls can be captured, else eager event timing of calls cycling through the sets; None when the call
    fails."""
    fns = [make_fn(s) for s in sets]
    try:
        fns[0]()
        us, how = common_device_time(fns, device)
    except Exception as e:  # a backend that rejects the inputs, out of memory, ...
        print(f"  (skipped: {type(e).__name__}: {str(e).splitlines()[0][:100]})", file=sys.stderr)
        torch.cuda.empty_cache() if device.type == "cuda" else None
        return None
    TIMINGS.add(how)
    return us


def sdpa_mask(B, C, L, bs, dtype, device):
    """SDPA's attn_mask for block attention at cache length L: None when the chunk sees every key, else the additive
    mask (0 / -inf, q's dtype) SDPA would otherwise make of a bool one on every call (a [B, 1, C, L + C] where(), then
    a padded copy for the efficient kernel: inside the timing), made once: rows 16-element aligned, broadcast over B."""
    Lk = L + C
    allow = block_mask_bool(1, C, Lk, L, bs, device)
    if bool(allow.all()):
        return None
    lp = -(-Lk // 16) * 16
    mask = torch.zeros(1, 1, C, lp, dtype=dtype, device=device)[..., :Lk]
    mask.masked_fill_(~allow, float("-inf"))
    return mask.expand(B, 1, C, Lk)


def sdpa_baseline(sets, L, C, bs, device):
    """Best SDPA backend on the cache prefix [0, L + C) with the block mask (None when it allows everything)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B = sets[0][0].shape[0]
    Lk = L + C
    mask = sdpa_mask(B, C, L, bs, sets[0][0].dtype, device)
    best, best_name = None, "-"
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in (True, False):  # native GQA where the backend has it, else K/V repeated per q head
            def make_run(s, gqa=gqa, backend=backend):
                q, kc, vc = s[0], s[3], s[4]
                qt, kt, vt = q.transpose(1, 2), kc[:, :Lk].transpose(1, 2), vc[:, :Lk].transpose(1, 2)
                if gqa:
                    args, kw = (qt, kt, vt), {"enable_gqa": True}
                else:  # the repeat is setup, not timed
                    args, kw = (qt, kt.repeat_interleave(HQ // HKV, 1), vt.repeat_interleave(HQ // HKV, 1)), {}

                def run():
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(*args, attn_mask=mask, **kw)
                return run

            try:
                with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
                    t = device_time(make_run, sets, device)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                continue
            if t is not None:
                if best is None or t < best:
                    best, best_name = t, name + ("" if gqa else "+rep")
                break
    return best, best_name


_FLEX = {}


def _compiled_flex(flex_attention):
    """One torch.compile'd flex_attention, allowed to specialize on every benchmark shape (the default
    recompile limit would silently fall back to the slow eager path after a few shapes)."""
    if "fn" not in _FLEX:
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 1024)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def flex_baseline(sets, L, C, bs, device):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    Lk = L + C

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < L + C) & (kv_idx // bs <= (q_idx + L) // bs)

    try:
        bm = create_block_mask(mask_mod, None, None, C, Lk, device=device)
        flex = _compiled_flex(flex_attention)
    except Exception as e:
        print(f"  (flex skipped: {type(e).__name__}: {e})", file=sys.stderr)
        return None

    def make_run(s):
        qt = s[0].transpose(1, 2).contiguous()
        kt, vt = s[3][:, :Lk].transpose(1, 2).contiguous(), s[4][:, :Lk].transpose(1, 2).contiguous()
        return lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True)

    return device_time(make_run, sets, device)


def fa_baseline(sets, C, bs, device):
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None

    def make_run(s):
        q, k, v, kc, vc, cl = s[:6]
        return lambda: flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=cl, causal=C > bs)

    return device_time(make_run, sets, device)


def bench_row(kind, B, L, bs, C, dtype, device, kernels, bw, baselines=True, splits=(), wgmma=True):
    t = make(B, L, C, dtype, device)
    q, k, v, kc, vc, cl, nl = t
    row = {"kind": kind, "B": B, "cache": L, "block": bs, "C": C}
    scale = D**-0.5
    kv_bytes = 2 * B * HKV * (L + C) * D * q.element_size()
    flops = 4 * B * HQ * D * allowed_pairs(C, L, bs)
    # distinct copies of the inputs, cycled through by the graph-timed columns (K/V beyond L2)
    sets = [t] + [make(B, L, C, dtype, device, seed=i) for i in range(1, rotation(kv_bytes, device))]
    row["sets"] = len(sets)
    row["l2"] = l2_state(kv_bytes, len(sets), device)
    if kernels:
        kern = _ext.ext().block_attention
        # each variant's output checked against the reference on the first rows before it is timed (the wgmma one
        # has not run on hardware yet): a wrong variant gets "wrong" and a `check` note instead of a time
        n = min(B, 2)
        want = block_attention_reference(*(x[:n] for x in t), bs, scale)
        bad = {}
        for name, code in (("mma", VARIANTS["auto"]), ("wgmma", VARIANTS["wgmma"])):
            if name == "mma" or (wgmma and has_wgmma(device)):
                bad[name] = check(lambda: kern(q, k, v, kc, vc, cl, nl, bs, scale, 0, code)[:n], want)
        row["check"] = "; ".join(f"{v_} {e}" for v_, e in bad.items() if e) or "ok"
        if bad["mma"] is None:
            row["kernel_us"] = device_time(lambda s: (lambda: kern(*s, bs, scale)), sets, device)
            row["call_us"] = time_or_none(lambda: kern(q, k, v, kc, vc, cl, nl, bs, scale), device)
        else:
            row["kernel_us"] = "wrong"
        if splits and kind == "decode" and isinstance(row.get("kernel_us"), float):
            mma = VARIANTS["mma"]
            forced = {}
            for ns in splits:  # each split count's output checked like the automatic one's before it is timed
                if ns * B * C * HQ * (D + 1) * 4 > SPLIT_PARTIAL_MAX_BYTES:  # the fp32 partials of ns splits
                    forced[ns] = None  # a batch that fills the GPU without splitting: not worth gigabytes
                    continue
                wrong = check(lambda: kern(q, k, v, kc, vc, cl, nl, bs, scale, ns, mma)[:n], want)
                forced[ns] = "wrong" if wrong else \
                    device_time(lambda s, ns=ns: (lambda: kern(*s, bs, scale, ns, mma)), sets, device)
            row.update({f"s{ns}_us": us for ns, us in forced.items()})
            timed = {ns: us for ns, us in forced.items() if isinstance(us, float)}
            if timed:
                row["best_split"] = min(timed, key=timed.get)
                row["split_x"] = row["kernel_us"] / timed[row["best_split"]]
        if "wgmma" in bad:
            wg = VARIANTS["wgmma"]
            row["wgmma_us"] = device_time(lambda s: (lambda: kern(*s, bs, scale, 0, wg)), sets, device) \
                if bad["wgmma"] is None else "wrong"
    ref_bytes = 2 * B * HQ * (L + C) * D * q.element_size()
    row["ref_us"] = time_or_none(lambda: block_attention_reference(q, k, v, kc, vc, cl, nl, bs, scale), device) \
        if ref_bytes <= REF_MAX_BYTES else None
    if baselines and device.type == "cuda":
        row["sdpa_us"], row["sdpa"] = sdpa_baseline(sets, L, C, bs, device)
        row["flex_us"] = flex_baseline(sets, L, C, bs, device)
        row["fa_us"] = fa_baseline(sets, C, bs, device)
    ours = {n: row[c] for n, c in (("mma", "kernel_us"), ("wgmma", "wgmma_us")) if isinstance(row.get(c), float)}
    if ours:
        row["best"] = min(ours, key=ours.get)
        row["best_us"] = ours[row["best"]]
    if len(ours) == 2:
        row["wg_x"] = ours["mma"] / ours["wgmma"]
    main = row.get("best_us") or row.get("ref_us")
    if main:
        row["GB/s"] = kv_bytes / (main * 1e-6) / 1e9
        row["%copy"] = 100 * row["GB/s"] / bw
        row["TFLOP/s"] = flops / (main * 1e-6) / 1e12
    base = [row.get(c) for c in ("sdpa_us", "flex_us", "fa_us") if row.get(c)]
    if row.get("best_us") and base:
        row["vs_best"] = row["best_us"] / min(base)
    if row.get("best_us") and row.get("flex_us"):
        row["vs_flex"] = row["best_us"] / row["flex_us"]
    del t, q, k, v, kc, vc, sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def wgmma_probe(shapes, dtype_name: str, timeout_s: float = 40.0) -> str | None:
    """Run the wgmma variant once on every row shape `shapes` ([kind, B, L, bs, C]) in a child process (not yet run
    on hardware: a fault there leaves a sticky CUDA error that would end this process, and with it the mma.sync
    rows and the split sweep). None when the child ran them all; else why the variant is left out of the run.
    `timeout_s` is short beside the stages' limits (150 s for attn_quick): a hang must leave time for the rest."""
    import json
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--wgmma-probe", json.dumps(shapes), "--dtype", dtype_name]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"the wgmma probe did not finish in {timeout_s:.0f} s"
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1][:160]
        return f"the wgmma probe failed (exit {r.returncode}: {tail})"
    return None


def wgmma_probe_child(shapes_json: str, dtype) -> None:
    """--wgmma-probe: one wgmma call per shape, synchronized, no error handling (any failure ends the process with
    a non-zero status, which is the answer)."""
    import json

    device = torch.device("cuda")
    kern = _ext.ext().block_attention
    shapes = json.loads(shapes_json)
    for kind, B, L, bs, C in shapes:
        q, k, v, kc, vc, cl, nl = make(B, L, C, dtype, device)
        kern(q, k, v, kc, vc, cl, nl, bs, D**-0.5, 0, VARIANTS["wgmma"])
        torch.cuda.synchronize(device)
        del q, k, v, kc, vc
        torch.cuda.empty_cache()
    print(f"wgmma probe: {len(shapes)} shapes ran")


def has_wgmma(device) -> bool:
    """The wgmma variant runs on sm_90 GPUs (H100 / H200) only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def ncu_mode(args, device, dtype):
    """One shape, a few calls, each inside an NVTX range named block_attn (ncu --nvtx-include block_attn/)."""
    q, k, v, kc, vc, cl, nl = make(args.batch, args.cache, args.chunk or args.block, dtype, device)
    kern = _ext.ext().block_attention
    variant = VARIANTS[args.variant]
    for _ in range(3):  # warm up: lazy module load, shared-memory attribute
        kern(q, k, v, kc, vc, cl, nl, args.block, D**-0.5, 0, variant)
    torch.cuda.synchronize()
    for _ in range(args.ncu_calls):
        torch.cuda.nvtx.range_push("block_attn")
        kern(q, k, v, kc, vc, cl, nl, args.block, D**-0.5, 0, variant)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    emit_json("block_attention_ncu", device=device_name(device), batch=args.batch, cache=args.cache, block=args.block,
              chunk=args.chunk or args.block, calls=args.ncu_calls, variant=args.variant)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (reference only, tiny shapes)")
    ap.add_argument("--quick", action="store_true", help="a few decode and prefill shapes")
    ap.add_argument("--no-baselines", action="store_true", help="kernel and reference only")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--ncu", action="store_true", help="profile mode: one shape (--batch/--cache/--block/--chunk)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cache", type=int, default=4096)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=0, help="chunk length (default: one block)")
    ap.add_argument("--ncu-calls", type=int, default=2)
    ap.add_argument("--variant", choices=tuple(VARIANTS), default="auto", help="--ncu: the kernel variant profiled")
    ap.add_argument("--splits", type=ints, default=[], help="decode rows: also time the mma.sync kernel forced to "
                    "each of these KV split counts (1..64), e.g. 1,4,8,16,32,64")
    ap.add_argument("--wgmma", choices=("probe", "on", "off"), default="probe",
                    help="the wgmma variant's columns (sm_90): probe = only after it ran every row shape in a child "
                    "process (default), on = without the probe, off = never")
    ap.add_argument("--wgmma-probe", metavar="SHAPES_JSON", help=argparse.SUPPRESS)  # the probe's child process
    args = ap.parse_args()
    if any(n > 64 for n in args.splits):
        ap.error(f"--splits: at most 64 KV splits (kernels::kBlockAttnMaxSplits), got {max(args.splits)}")

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    on_gpu = device.type == "cuda"
    kernels = on_gpu and _ext.has_cuda_kernels() and hasattr(_ext.ext(), "block_attention")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.wgmma_probe:
        return wgmma_probe_child(args.wgmma_probe, dtype)
    if args.ncu:
        if not kernels:
            raise SystemExit("--ncu needs a GPU and a CUDA build of lightningrl_fast._C")
        return ncu_mode(args, device, dtype)

    global HQ, HKV, D
    if not on_gpu:
        print("No GPU (or --cpu): timing the PyTorch reference only, at a tiny size (2 q / 1 kv heads, d 16, fp32).")
        HQ, HKV, D = 2, 1, 16
        dtype = torch.float32
        decode, prefill = [(2, 64, 4, 4)], [(1, 64, 8)]
    elif not kernels:
        print("lightningrl_fast._C has no block_attention kernel: timing the reference and the baselines only.")
    if on_gpu:
        decode, prefill = (QUICK_DECODE, QUICK_PREFILL) if args.quick else (DECODE, PREFILL)
    bw = copy_bandwidth_gbs(device)
    print(f"device: {device_name(device)}; copy bandwidth {bw:.0f} GB/s; Hq={HQ} Hkv={HKV} D={D} {str(dtype)[6:]}")

    wgmma, wgmma_note = kernels and has_wgmma(device) and args.wgmma != "off", None
    if wgmma and args.wgmma == "probe":
        shapes = [["decode", *d] for d in decode] + [["prefill", B, 0, bs, P] for B, P, bs in prefill]
        wgmma_note = wgmma_probe(shapes, args.dtype)
        wgmma = wgmma_note is None
        print(f"wgmma variant: {wgmma_note}; its columns are left out" if wgmma_note else
              f"wgmma variant: ran every row shape in a child process ({len(shapes)})")
    rows = RowLog("block_attention", device=device_name(device), copy_gbs=round(bw, 1), dtype=str(dtype)[6:],
                  hq=HQ, hkv=HKV, head_dim=D, wgmma_note=wgmma_note)
    for B, L, bs, C in decode:
        rows.append(bench_row("decode", B, L, bs, C, dtype, device, kernels, bw, not args.no_baselines, args.splits,
                              wgmma))
    for B, P, bs in prefill:
        rows.append(bench_row("prefill", B, 0, bs, P, dtype, device, kernels, bw, not args.no_baselines,
                              wgmma=wgmma))
    cols = ["kind", "B", "cache", "block", "C", "sets", "l2", "check", "kernel_us", "wgmma_us", "wg_x", "call_us",
            "ref_us", "sdpa_us", "sdpa", "flex_us", "fa_us", "best", "GB/s", "%copy", "TFLOP/s", "vs_best", "vs_flex"]
    if args.splits:
        cols += [f"s{n}_us" for n in args.splits] + ["best_split", "split_x"]
    table = [{c: ("-" if r.get(c) is None else r[c]) for c in cols} for r in rows]
    print_table(table)

    dec = [r for r in rows if r["kind"] == "decode" and r.get("best_us")]
    summary = {}
    if dec:
        long = [r for r in dec if r["cache"] >= 2048]
        summary["decode_min_pct_copy_cache_ge_2048"] = round(min(r["%copy"] for r in long), 1) if long else None
        vs = [r["vs_best"] for r in dec if r.get("vs_best")]
        summary["decode_max_vs_best"] = round(max(vs), 3) if vs else None
    pre = [r["vs_flex"] for r in rows if r["kind"] == "prefill" and r.get("vs_flex")]
    summary["prefill_max_vs_flex"] = round(max(pre), 3) if pre else None
    wx = [r["wg_x"] for r in rows if r.get("wg_x")]
    summary["wgmma_speedup_min_max"] = [round(min(wx), 3), round(max(wx), 3)] if wx else None
    print(f"timing: {', '.join(sorted(TIMINGS)) or 'eager'} (graph = CUDA-graph device time over rotating input "
          "copies; eager = CUDA events around each call, over the same copies)")
    rows.emit(kernels=kernels, cpu_reference_only=not on_gpu, timing=sorted(TIMINGS), **summary,
              rows=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows])


if __name__ == "__main__":
    main()
