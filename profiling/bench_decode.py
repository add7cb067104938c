"""Benchmark block-diffusion decoding: tokens/s, forwards/s and memory-bandwidth utilization.

    python profiling/bench_decode.py --config sdar-8b            # GPU: SDAR-8B shapes, random bf16 weights
    python profiling/bench_decode.py --config sdar-4b --tpf 2 --batches 1,64 --blocks 4
    python profiling/bench_decode.py                             # no GPU: the tiny config on the CPU
    python profiling/bench_decode.py --cpu                       # force the CPU

What it runs: `sampler.Decoder.generate` (the real engine: prefill, folded commits, CUDA-graph step) on random prompts
of `--prompt-len` tokens, decoding `--new-tokens` tokens per row, for every batch in `--batches` (default
1,8,64,256) x block in `--blocks` (default 4,8,32) x CUDA graphs on/off x kernels/reference ops.

A fixed TPF is forced so that runs are comparable whatever the random weights predict: greedy decoding,
threshold 1.01 (no confidence reaches it) and SDAR's quota rule with steps_per_block = block / K, so every
step unmasks exactly K tokens (`--tpf K`, default 4; K is capped at the block and must divide it for an exact
TPF; the measured TPF is reported). EOS is set to the mask token id, which the sampler never emits, so every
row decodes exactly `--new-tokens` tokens (prompt length and new tokens are multiples of 32 by default, so
every block starts fully masked).

Columns: `fwd` engine forwards per call (prefill included), `s` median seconds per generate call (on one
`Decoder` kept from the warm-up call, as the CLIs and a chunked rollout use it, so the timed calls replay
graphs captured by the warm-up; `--fresh` gives every call a new Decoder, as a one-off `generate()`, and then
the eager first step and the captures are included), `tok/s` generated tokens / s, `fwd/s`
forwards / s, `GB/fwd` bytes one forward must read at least = weights (every matrix once; the embedding table
only when tied to the LM head) + the KV cache of the batch at the mean context (prompt + new/2 tokens), `bound`
the physical bound forwards/s <= copy bandwidth / (GB/fwd) with the copy bandwidth measured by
profiling/common.py, `%bw` = fwd/s / bound (the memory-bandwidth utilization; large batches become
compute-bound, so the ratio falls there by design), `steady fwd/s` the steady-state rate: the same call is
also timed with half the new tokens, and (forwards difference) / (time difference) leaves out the prefill, the
first (eager) step and the graph captures, which both calls pay alike (`--no-steady` skips it); `steady bound`
the bound at the mean context of the differenced forwards (prompt + 3/4 of the new tokens: they decode the second
half) and `steady %bw` against it; `peakGB` peak allocated device memory.
The compute side (large batches): `TFLOP/s` the FLOPs the call's schedule needs at least (`decode_flops`: the
prefill, each step's current block and each folded commit through projections, MLP and attention against the keys
up to the block's end, and the LM head only on the positions still masked at each step), over its time; `roof
bound` the forwards/s of a roofline that needs both the call's bytes at the copy bandwidth and its FLOPs at the
measured dense GEMM rate (`gemm_tflops` of the JSON line, common.gemm_tflops: bf16 [8192, 4096] x [4096, 8192] on
the GPU), and `%roof` the measured rate against it, for the whole call and (`steady ...`) for the differenced
forwards: where `%bw` falls at large batches by design, `%roof` says how far the engine is from the hardware. `graphs=failed`: the step could not be
captured and ran eagerly; `pdl=off (capture retry)`: it was captured only after the sampler turned programmatic
dependent launch off (its retry after a failed capture with PDL on), so the row is a graph without PDL.

Attention kernel: `--attn mma,wgmma` times the kernel rows once per block-attention variant (column `attn`; the
variant is set through LRF_BLOCK_ATTN_VARIANT for that combination, ops/block_attn.py); default `auto`.
GEMMs: `--gemm cublas,kernel` times the kernel rows once per implementation of the decode forward's GEMMs
(column `gemm`; LRF_DECODE_GEMM for that combination, ops/linear.py: cuBLAS, or the skinny-GEMM kernel for
<= 64 tokens per forward); default `cublas`.
Packed forwards: `--pack auto,on,off` times every row once per `SamplerConfig.pack` mode (column `pack`; "auto"
packs on the GPU from 256 rows x block tokens, sampler.py). With the forced TPF every row folds its commit on the
same steps, so a packed working set runs [rows, 2 x block] on those and [rows, block] on the others, and its LM head
on the still-masked positions only (block 32 at TPF 4: 32, 28, ..., 4 of a row's 32, ~56% over a block); `--ragged`
spreads the prompt lengths over one block (row i gets (7 i) mod block more tokens, so its first block finishes
earlier) and the rows fold on different steps, as in real rollouts (their TPF is then a little below K).
Programmatic dependent launch: `--pdl on,off` times the kernel rows with and without it (column `pdl`; LRF_PDL=0
for "off": every kernel launched plainly, csrc/launch.h); default `on`.

Reference vs kernels: kernel rows run in this process. Reference rows run in a child process started with
LRF_DISABLE_KERNELS=1, which the ops must honour (the child checks that `ops._common.cuda_kernel` then returns
None; if it does not, the reference rows are reported as unavailable rather than silently timing kernels). When
this process itself runs with LRF_DISABLE_KERNELS=1, its rows are reference rows (never labelled kernels).
On the CPU there are no kernels and no graphs: reference rows only.

NVTX: every timed call is inside the range `bench_timed` (a fixed name, for `ncu --nvtx-include bench_timed/`),
inside it `bench b=<batch> blk=<block> graphs=<on|off> impl=<impl>`, and the sampler adds `prefill`,
`denoise_step` and `commit`; warmup calls are under `warmup ...`. See profiling/README.md for nsys/ncu.
`--torch-trace FILE` writes a torch.profiler Chrome trace of the first combination's timed call (a fallback
where nsys is missing). Prints one table and ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (RowLog, copy_bandwidth_gbs, device_name, emit_json, gemm_tflops, ints,  # noqa: E402
                    kernels_dispatched, print_table)

from lightningrl_fast import _ext  # noqa: E402
from lightningrl_fast.model import SDARConfig, SDARForCausalLM, build_model  # noqa: E402
from lightningrl_fast.ops.block_attn import VARIANT_ENV as ATTN_ENV  # noqa: E402
from lightningrl_fast.ops.block_attn import VARIANTS  # noqa: E402
from lightningrl_fast.ops._common import PDL_ENV  # noqa: E402
from lightningrl_fast.ops.linear import IMPL_ENV as GEMM_ENV  # noqa: E402
from lightningrl_fast.ops.linear import IMPLS as GEMM_IMPLS  # noqa: E402
from lightningrl_fast.profiling import Timer, nvtx_range  # noqa: E402
from lightningrl_fast.sampler import PACK_MODES, Decoder, SamplerConfig  # noqa: E402

_SDAR = dict(vocab_size=151936, head_dim=128, mask_token_id=151669, max_position_embeddings=32768,
             rms_norm_eps=1e-6, rope_theta=1e6, torch_dtype="bfloat16")
CONFIGS = {  # REFERENCE §1
    "sdar-1.7b": dict(_SDAR, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, tie_word_embeddings=True),
    "sdar-4b": dict(_SDAR, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8),
    "sdar-8b": dict(_SDAR, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, mask_token_id=511, max_position_embeddings=4096,
                 torch_dtype="float32"),
}
DECODE_OPS = ("kv_cache_write", "block_attention", "threshold_unmask")
DISABLE_ENV = "LRF_DISABLE_KERNELS"


def make_model(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> SDARForCausalLM:
    """Random weights (normal(0, 0.02) matrices, unit norms) allocated straight on `device` in `dtype`."""
    cfg = SDARConfig(**CONFIGS[name])
    if device.type == "cpu":
        return build_model(cfg, device=device, dtype=dtype, seed=seed).eval()
    with torch.device("meta"):
        model = SDARForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def kv_bytes(cfg: SDARConfig, batch: int, context: float, elt: int) -> float:
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elt * batch * context


def mean_context(prompt_len: int, first_new: float, last_new: float) -> float:
    """Mean cached context of the forwards that decode new tokens first_new .. last_new (KV bytes grow linearly):
    the whole call is (0, new), the steady-state difference of a full and a half-length call (half, new)."""
    return prompt_len + (first_new + last_new) / 2


def decode_flops(cfg: SDARConfig, ro, block: int) -> float:
    """The FLOPs a generate call's schedule needs at least, from its Rollout: the prefill (each prompt's whole blocks,
    block-causal), every denoising step's current block (B tokens against the keys up to the block's end), each
    finished block's commit folded into the next forward (B tokens), and the LM head on the positions still masked
    at each step (the 2 x H x V of a position once per step it waits). Projections and MLP 2 x their weights per
    token, attention 4 x Hq x D per query and key; norms, RoPE and the unmask are left out. Rows sharing a prompt
    prefix are counted as separate prefills (the bench's random prompts share none)."""
    h, inner, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    body = 2.0 * layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inner)  # per token
    attn = 4.0 * layers * hq * d  # per query token and key
    head = 2.0 * h * cfg.vocab_size  # per masked position and step
    n, width = ro.seq_step_map.shape
    sm = ro.seq_step_map.long().view(n, width // block, block)  # [N, blocks, B] -1 prompt, -2 never decoded
    dec = sm >= 0
    has = dec.any(-1)  # [N, blocks] decoded blocks
    lo = torch.where(dec, sm, 2**62).amin(-1)  # each block's first step
    steps = torch.where(has, torch.where(dec, sm, -1).amax(-1) - lo + 1, 0)  # [N, blocks] steps it was current
    waits = torch.where(dec, sm - lo[..., None] + 1, 0).sum()  # LM-head positions over all steps
    idx = torch.arange(width // block)
    last = torch.where(has, idx, -1).amax(-1, keepdim=True)
    folds = (has & (idx < last)).long()  # committed by folding into the next block's first forward
    keys = ((idx + 1) * block).double()  # a block's queries see the keys up to its end
    full = (ro.prompt_lens // block).double()  # [N] whole prompt blocks, prefilled
    prefill = body * block * full.sum() + attn * block * block * (full * (full + 1) / 2).sum()
    chunks = (steps + folds).double()  # B-token query chunks per block
    return float(prefill + body * block * chunks.sum() + attn * block * (chunks * keys).sum() + head * waits)


def capture_outcome(messages: list[str]) -> tuple[bool, bool]:
    """(the step ran eagerly, its graph was captured only with programmatic dependent launch turned off) from the
    warnings of sampler._GraphedStep: a capture that fails with PDL on is retried once with LRF_PDL=0 (a graph
    without PDL), a second failure leaves the step eager."""
    eager = any("CUDA graph capture" in m and "decoding continues eagerly" in m for m in messages)
    pdl_off = any("CUDA graph capture" in m and "retrying with it off" in m for m in messages)
    return eager, pdl_off and not eager


def kernel_status() -> dict:
    mod = _ext.ext()
    has = bool(mod is not None and _ext.has_cuda_kernels())
    return {"cuda_kernels": has, "decode_kernels": [n for n in DECODE_OPS if has and hasattr(mod, n)]}


def reference_switch_honoured(device: torch.device) -> bool:
    """True when, with LRF_DISABLE_KERNELS=1, the ops dispatch to the reference (or there are no kernels)."""
    if device.type != "cuda" or not kernel_status()["cuda_kernels"]:
        return True
    from lightningrl_fast.ops._common import cuda_kernel

    probe = torch.empty(1, device=device)
    return all(cuda_kernel(n, probe) is None for n in DECODE_OPS)


def run_combo(model, device, batch: int, block: int, graphs: bool, impl: str, args, torch_trace: str | None,
              pack: str = "auto") -> dict:
    cfg_m = model.config
    k = min(args.tpf, block)
    cfg = SamplerConfig(block_size=block, threshold=1.01, rule="quota", steps_per_block=max(1, block // k),
                        temperature=0.0, max_new_tokens=args.new_tokens, eos_ids=(cfg_m.mask_token_id,),
                        cuda_graphs=graphs, seed=0, pack=pack)
    gen = torch.Generator().manual_seed(batch * 1000 + block)
    hi = min(cfg_m.vocab_size, 30000)
    prompts = torch.randint(0, hi - 1, (batch, args.prompt_len + block), generator=gen)
    prompts = torch.where(prompts == cfg_m.mask_token_id, prompts + 1, prompts).tolist()
    # --ragged: row i's prompt is (7 i) mod block tokens longer, so its first block has that many fewer positions to
    # unmask and finishes steps earlier: the rows fold their commits on different steps, as real rollouts do
    prompts = [p[: args.prompt_len + ((7 * i) % block if args.ragged else 0)] for i, p in enumerate(prompts)]
    label = f"bench b={batch} blk={block} graphs={'on' if graphs else 'off'} impl={impl} pack={pack}"
    row = {"batch": batch, "block": block, "graphs": "on" if graphs else "off", "impl": impl, "pack": pack,
           "engine": "fresh" if args.fresh else "kept"}
    old_block = cfg_m.block_size
    cfg_m.block_size = block  # the model's attention blocks must match the sampler's
    capture_failed = pdl_retried = False
    dec = Decoder(model)
    fresh = (lambda: Decoder(model)) if args.fresh else (lambda: dec)
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with nvtx_range(f"warmup {label}"):
                dec.generate(prompts, cfg)
            secs, ro = [], None
            for r in range(args.repeats):
                prof = contextlib.nullcontext()
                if torch_trace and r == 0:
                    from torch.profiler import ProfilerActivity, profile

                    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                    prof = profile(activities=acts)
                with prof as p, nvtx_range("bench_timed"), nvtx_range(label), Timer(device) as t:
                    ro = fresh().generate(prompts, cfg)
                if torch_trace and r == 0:
                    p.export_chrome_trace(torch_trace)
                secs.append(t.seconds)
            # the same call with half the new tokens: the difference is pure steady-state decoding (prefill,
            # the first eager step and the graph captures cost the same in both)
            half_secs, ro_half = [], None
            half_cfg = dataclasses.replace(cfg, max_new_tokens=max(block, args.new_tokens // 2))
            for _ in range(args.repeats if args.steady else 0):
                with nvtx_range("bench_half"), Timer(device) as t:
                    ro_half = fresh().generate(prompts, half_cfg)
                half_secs.append(t.seconds)
        capture_failed, pdl_retried = capture_outcome([str(w.message) for w in caught])
    except torch.cuda.OutOfMemoryError:
        row.update(error="out of memory")
        return row
    finally:
        cfg_m.block_size = old_block
    s = statistics.median(secs)
    toks = int(ro.lengths.sum())
    elt = next(model.parameters()).element_size()
    gb = (model.forward_weight_bytes() + kv_bytes(cfg_m, batch, mean_context(args.prompt_len, 0, args.new_tokens),
                                                  elt)) / 1e9
    bound = args.copy_gbs / gb
    fwd_s = ro.total_forwards / s
    flops = decode_flops(cfg_m, ro, block)
    # roofline: the call needs at least its bytes at the copy bandwidth and its FLOPs at the measured GEMM rate
    roof_s = max(ro.total_forwards * gb / args.copy_gbs, flops / (args.gemm_tflops * 1e12))
    row.update({"tpf": round(float(ro.tpf.mean()), 3), "fwd": ro.total_forwards, "s": s, "tok/s": toks / s,
                "fwd/s": fwd_s, "GB/fwd": gb, "bound": bound, "%bw": 100 * fwd_s / bound,
                "TFLOP/s": flops / s / 1e12, "roof bound": ro.total_forwards / roof_s,
                "%roof": 100 * roof_s / s})
    if ro_half is not None:
        ds = s - statistics.median(half_secs)
        dfwd = ro.total_forwards - ro_half.total_forwards
        steady = dfwd / ds if ds > 0 and dfwd > 0 else float("nan")
        # the differenced forwards decode the second half of the tokens: a longer KV cache than the call's mean
        ctx = mean_context(args.prompt_len, half_cfg.max_new_tokens, args.new_tokens)
        steady_bound = args.copy_gbs / ((model.forward_weight_bytes() + kv_bytes(cfg_m, batch, ctx, elt)) / 1e9)
        row.update({"steady fwd/s": steady, "steady bound": steady_bound, "steady %bw": 100 * steady / steady_bound})
        dflops = flops - decode_flops(cfg_m, ro_half, block)
        if ds > 0 and dfwd > 0:
            droof = max(dfwd / steady_bound, dflops / (args.gemm_tflops * 1e12))  # seconds, as roof_s above
            row.update({"steady TFLOP/s": dflops / ds / 1e12, "steady roof bound": dfwd / droof,
                        "steady %roof": 100 * droof / ds})
    if device.type == "cuda":
        row["peakGB"] = torch.cuda.max_memory_allocated(device) / 1e9
    if graphs and capture_failed:
        row["graphs"] = "failed"  # the step did not capture (e.g. a host sync in the reference ops): ran eagerly
    if graphs and pdl_retried:
        row["pdl_retried"] = True  # captured, but only with PDL off (LRF_PDL=0): the caller's pdl column says so
    return row


def child_reference_rows(argv: list[str], timeout_s: float) -> tuple[list[dict], str | None]:
    """Run the reference combinations in a child process with LRF_DISABLE_KERNELS=1; (rows, error)."""
    env = dict(os.environ, **{DISABLE_ENV: "1"})
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--impl", "reference", "--child"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [], f"reference child did not finish within --child-timeout {timeout_s:g} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return [], f"reference child failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}"
    out = json.loads(lines[-1])
    return out.get("rows", []), out.get("error")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default=None, help="model shapes (default sdar-8b on GPU)")
    ap.add_argument("--tpf", type=int, default=4, help="tokens unmasked per step (forced), default 4")
    ap.add_argument("--batches", type=ints, default=None, help="default 1,8,64,256 (GPU) / 1,8 (CPU)")
    ap.add_argument("--blocks", type=ints, default=None, help="default 4,8,32 (GPU) / 4,8 (CPU)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 64 (GPU) / 8 (CPU)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 256 (GPU) / 32 (CPU)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per combination (median); 3 GPU / 1 CPU")
    ap.add_argument("--graphs", choices=("both", "on", "off"), default="both", help="CUDA graphs (GPU only)")
    ap.add_argument("--impl", choices=("both", "kernels", "reference"), default="both")
    ap.add_argument("--attn", type=attn_variants, default=["auto"],
                    help="block-attention kernel variants for the kernel rows, comma-separated: auto, mma, wgmma")
    ap.add_argument("--pdl", type=pdl_modes, default=["on"],
                    help="programmatic dependent launch for the kernel rows, comma-separated: on, off")
    ap.add_argument("--gemm", type=gemm_impls, default=["cublas"],
                    help="decode GEMM implementations for the kernel rows, comma-separated: cublas, kernel")
    ap.add_argument("--ragged", action="store_true",
                    help="prompt lengths spread over one block (row i: + (7 i) mod block tokens): rows out of step")
    ap.add_argument("--pack", type=pack_modes, default=["auto"],
                    help="packed decoding forwards (SamplerConfig.pack), comma-separated: auto, on, off")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (tiny config, reference ops)")
    ap.add_argument("--torch-trace", default=None, help="Chrome trace of the first combination's timed call")
    ap.add_argument("--no-steady", dest="steady", action="store_false",
                    help="skip the half-length calls that give the steady-state rate (steady fwd/s)")
    ap.add_argument("--fresh", action="store_true",
                    help="a new Decoder for every timed call (a one-off generate(): eager first step and captures "
                         "included) instead of the one kept from the warm-up")
    ap.add_argument("--child-timeout", type=float, default=900.0,
                    help="seconds the reference child process may take (its rows are reported as unavailable after)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tpf < 1:
        ap.error("--tpf must be >= 1")

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    on_gpu = device.type == "cuda"
    notes = []
    if not on_gpu:
        if args.config not in (None, "tiny"):
            notes.append(f"no GPU: --config {args.config} replaced by tiny")
        args.config = "tiny"
        notes.append("CPU run: tiny config, small batches, reference ops, no CUDA graphs")
        torch.set_num_threads(1)  # tiny shapes: more threads only add contention
    args.config = args.config or "sdar-8b"
    args.batches = args.batches or ([1, 8, 64, 256] if on_gpu else [1, 8])
    args.blocks = args.blocks or ([4, 8, 32] if on_gpu else [4, 8])
    args.prompt_len = args.prompt_len or (64 if on_gpu else 8)
    args.new_tokens = args.new_tokens or (256 if on_gpu else 32)
    args.repeats = args.repeats or (3 if on_gpu else 1)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    for b in args.blocks:
        if b % min(args.tpf, b):
            notes.append(f"block {b}: --tpf {args.tpf} does not divide it, the measured TPF differs from K")

    ks = kernel_status() if on_gpu else {"cuda_kernels": False, "decode_kernels": []}
    ref_error = None
    if args.child:  # the reference half of a GPU run, started by the parent with LRF_DISABLE_KERNELS=1
        local, child = ["reference"], False
        if not reference_switch_honoured(device):
            emit_json("decode", rows=[], error=f"{DISABLE_ENV}=1 is not honoured by the ops: they still dispatch to "
                                               f"the _C kernels, so no reference timing is possible")
            return
    elif not on_gpu or not ks["cuda_kernels"]:
        local, child = ["reference"], False
        if on_gpu:
            notes.append("lightningrl_fast._C has no CUDA kernels: every op runs its PyTorch reference")
    elif not kernels_dispatched(device, *DECODE_OPS):  # LRF_DISABLE_KERNELS=1 in this process's environment
        local, child = ["reference"], False
        ks["decode_kernels"] = []
        notes.append(f"{DISABLE_ENV}=1: every op runs its PyTorch reference (rows labelled reference, not kernels)")
    else:
        local = ["kernels"] if args.impl in ("both", "kernels") else []
        child = args.impl in ("both", "reference")
    graphs = [False] if not on_gpu else {"both": [True, False], "on": [True], "off": [False]}[args.graphs]

    args.copy_gbs = copy_bandwidth_gbs(device)
    args.gemm_tflops = gemm_tflops(device, dtype)
    with torch.device("meta"):  # sizes only; the real model is built when this process times something
        shape_model = SDARForCausalLM(SDARConfig(**CONFIGS[args.config])).to(dtype)
    wb = shape_model.forward_weight_bytes()
    n_params = sum(p.numel() for p in {id(p): p for p in shape_model.parameters()}.values())
    del shape_model
    model = make_model(args.config, device, dtype) if local else None
    if not args.child:
        print(f"device: {device_name(device)}; copy bandwidth {args.copy_gbs:.0f} GB/s; {str(dtype)[6:]} GEMM "
              f"{args.gemm_tflops:.1f} TFLOP/s; config {args.config} "
              f"({n_params / 1e9:.3f} B params, "
              f"{wb / 1e9:.3f} GB read per forward as weights, {str(dtype)[6:]}); forced TPF {args.tpf}; prompt "
              f"{args.prompt_len}{' + (7 i) mod block' if args.ragged else ''} + {args.new_tokens} new tokens; "
              f"decode kernels: {ks['decode_kernels'] or 'none'}")
        for n in notes:
            print(f"note: {n}")

    rows = RowLog("decode", device=device_name(device), config=args.config, dtype=str(dtype)[6:], tpf=args.tpf,
                  prompt_len=args.prompt_len, ragged=args.ragged, new_tokens=args.new_tokens,
                  copy_gbs=round(args.copy_gbs, 1), gemm_tflops=round(args.gemm_tflops, 1))
    trace = args.torch_trace
    for impl in local:
        combos = ([(a, m, d) for a in args.attn for m in args.gemm for d in args.pdl] if impl == "kernels"
                  else [("-", "-", "-")])
        for attn, gemm, pdl in combos:
            for batch in args.batches:
                for block in args.blocks:
                    for g, pack in itertools.product(graphs, args.pack):
                        pdl_env = {"on": "1", "off": "0"}.get(pdl, "-")
                        with env_setting(ATTN_ENV, attn), env_setting(GEMM_ENV, gemm), env_setting(PDL_ENV, pdl_env):
                            row = run_combo(model, device, batch, block, g, impl, args, trace, pack)
                        used = "off (capture retry)" if row.pop("pdl_retried", False) else pdl
                        rows.append({**row, "attn": attn, "gemm": gemm, "pdl": used})
                        trace = None
    if args.child:
        emit_json("decode", rows=rows)
        return
    if child:
        del model  # free the device for the child's copy
        if on_gpu:
            torch.cuda.empty_cache()
        ref_rows, ref_error = child_reference_rows(_strip_opt(_strip_opt(argv, "--impl"), "--torch-trace"),
                                                   args.child_timeout)
        rows += ref_rows
        if ref_error:
            print(f"note: reference rows unavailable: {ref_error}")
    print_table(rows)
    rows.emit(weight_gb=round(wb / 1e9, 4), kernels=ks, reference_error=ref_error, notes=notes,
              rows=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows])


def comma_choices(allowed, what: str):
    """An argparse type: a comma-separated, non-empty list of names among `allowed` (the error names `what`)."""

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"{what} must be among {', '.join(allowed)}, got {text!r}")
        return names

    return parse


attn_variants = comma_choices(VARIANTS, "variants")
gemm_impls = comma_choices(GEMM_IMPLS, "GEMM implementations")
pdl_modes = comma_choices(("on", "off"), "PDL modes")
pack_modes = comma_choices(PACK_MODES, "pack modes")


@contextlib.contextmanager
def env_setting(key: str, value: str):
    """os.environ[key] = value for the block ("-": unchanged); the ops read LRF_BLOCK_ATTN_VARIANT and
    LRF_DECODE_GEMM at every call and capture."""
    if value == "-":
        yield
        return
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _strip_opt(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == name:
            skip = True
            continue
        if a.startswith(name + "="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
