"""Benchmark the training pass of an RL step: padded micro-batches vs packed micro-batches.

    python profiling/bench_rl_step.py                                  # GPU: sdar-1.7b shapes, bf16, 64 samples
    python profiling/bench_rl_step.py --config sdar-8b --samples 32 --grad-ckpt
    python profiling/bench_rl_step.py --cpu                            # CPU: tiny shapes

What is timed (the rollout itself is bench_decode's): the passes that follow it over one batch of sampled
sequences, in both training layouts (--modes block_proxy,trace):
  logprob   no-grad per-token log-probs of every target (the old-policy / frozen-reference pass)
  train     forward + fused GRPO loss + backward over every sample (one optimizer step's worth of gradients)
Two ways to cut the batch into forwards of at most --budget positions:
  padded    the LayoutBatch as built: every sample padded to the longest one (and, in trace mode, to the most
            rounds), consecutive rows per forward. What the trainer ran before packing, and how peer pipelines
            batch their training forward. Written out here as the baseline.
  packed    rl/trainer.micro_batches (logprobs.iter_micro_batches: what the trainer runs): each sample cut to its
            own length and to the noisy blocks its targets need, samples packed back to back (best-fit
            decreasing), rows rounded to a few fixed lengths on CUDA.
The samples are synthetic with the shape of real rollouts: prompts uniform in --prompt, responses log-uniform in
--response (a --truncated fraction at the maximum), random token ids, a step map of about --tpf tokens per step.
Both paths are checked to give the same loss before anything is timed.
Columns: positions (processed per pass, padding included), fill (positions the packed forwards need / processed), ms
(median), ktok/s (target tokens per second), x (padded ms / packed ms), peak_GiB (CUDA, extra peak memory).
Prints one table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import make_model  # noqa: E402  (random weights of a named config, straight on the device)
from common import RowLog, device_name, ints, kernels_dispatched, print_table, time_fn  # noqa: E402

from lightningrl_fast.ops.grpo_loss import fused_linear_grpo_loss, linear_logprobs  # noqa: E402
from lightningrl_fast.ops.masked_attn import MaskLayout  # noqa: E402
from lightningrl_fast.rl.logprobs import LayoutBatch, build_layout_batch  # noqa: E402
from lightningrl_fast.rl.trainer import RLConfig, logprob_stage, loss_backward_stage, micro_batches  # noqa: E402


def synthetic_batch(n: int, prompt: tuple[int, int], response: tuple[int, int], block: int, tpf: float,
                    truncated: float, vocab: int, mask_id: int, seed: int = 0):
    """(sequences [N, L], step_map [N, L], prompt_lens [N], resp_lens [N]) shaped like decoded rollouts: blocks from
    position 0, the decoded length ending at the end of the last response block, steps counted per sequence with
    each block's tokens unmasked over block / (tpf x U(0.5, 1.5)) consecutive steps (each step unmasks >= 1)."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g)
    lo, hi = math.log(response[0]), math.log(response[1])
    rlens = torch.exp(lo + (hi - lo) * torch.rand(n, generator=g)).round().long().clamp(response[0], response[1])
    rlens[torch.rand(n, generator=g) < truncated] = response[1]
    ends = -(-(plens + rlens) // block) * block  # decoded length: whole blocks
    width = int(ends.max())
    seqs = torch.randint(0, vocab - 1, (n, width), generator=g)
    seqs[seqs >= mask_id] += 1  # never the mask token
    smap = torch.full((n, width), -2, dtype=torch.int32)
    for i in range(n):
        p, e = int(plens[i]), int(ends[i])
        smap[i, :p] = -1
        seqs[i, e:] = mask_id
        step = 0
        for b0 in range(p - p % block, e, block):
            pos = torch.arange(max(b0, p), b0 + block)
            rounds = max(1, min(len(pos), round(len(pos) / (tpf * (0.5 + float(torch.rand(1, generator=g)))))))
            r = torch.randint(0, rounds, (len(pos),), generator=g)
            r[torch.randperm(len(pos), generator=g)[:rounds]] = torch.arange(rounds)  # every round unmasks one
            smap[i, pos] = (step + r).int()
            step += rounds
    return seqs, smap, plens, rlens


def padded_ranges(lb: LayoutBatch, budget: int) -> list[tuple[int, int, torch.Tensor]]:
    """The baseline's micro-batches: consecutive rows of the padded LayoutBatch, budget // row-width rows each."""
    width = lb.layout.n * lb.layout.num_copies
    per = max(1, budget // width)
    rows = lb.num_rows
    return [(r0, min(rows, r0 + per), ((lb.tgt_row >= r0) & (lb.tgt_row < r0 + per)).nonzero().squeeze(1))
            for r0 in range(0, rows, per)]


def padded_sub(lb: LayoutBatch, r0: int, r1: int, dev):
    lay = MaskLayout(lb.layout.n, lb.layout.num_copies, lb.layout.block_size, lb.layout.lengths[r0:r1])
    ids, pos = lb.inputs(slice(r0, r1))  # [rows, copies * n] each
    return ids.to(dev), pos.to(dev), lay


@torch.no_grad()
def padded_logprobs(model, lb: LayoutBatch, budget: int) -> torch.Tensor:
    dev = next(model.parameters()).device
    out = torch.empty(lb.num_tokens)
    for r0, r1, sel in padded_ranges(lb, budget):
        hidden = model.hidden(*padded_sub(lb, r0, r1, dev))  # [rows, copies * n, H]
        h = hidden[(lb.tgt_row[sel] - r0).to(dev), lb.tgt_col[sel].to(dev)]
        out[sel] = linear_logprobs(h, model.lm_head.weight, lb.targets[sel].to(dev),
                                   suppress_token=model.config.mask_token_id).float().cpu()
    return out


def padded_train(model, lb: LayoutBatch, adv_tok, old, ref, correct, cfg: RLConfig) -> float:
    """The baseline training pass: the trainer's loss over padded row ranges (same totals, same fused loss)."""
    dev = next(model.parameters()).device
    present = torch.unique(lb.tgt_row)
    totals = (len(present), lb.num_tokens, int(correct[present].sum()), int(correct[lb.tgt_row].sum()))
    total = 0.0
    for r0, r1, sel in padded_ranges(lb, cfg.micro_batch_tokens):
        hidden = model.hidden(*padded_sub(lb, r0, r1, dev))
        h = hidden[(lb.tgt_row[sel] - r0).to(dev), lb.tgt_col[sel].to(dev)]
        loss, _, _ = fused_linear_grpo_loss(
            h, model.lm_head.weight, lb.targets[sel].to(dev), old[sel].to(dev), ref[sel].to(dev), adv_tok[sel].to(dev),
            lb.tgt_row[sel].to(dev), lb.num_rows, correct.to(dev), eps_low=cfg.eps_low,
            eps_high=cfg.eps_high, beta=cfg.kl_beta, mu=cfg.nll_weight, reduction=cfg.reduction, totals=totals,
            suppress_token=model.config.mask_token_id)
        loss.backward()
        total += float(loss.detach())
    return total


def measure(fn, device, warmup, iters):
    """(median ms, extra peak GiB or nan) of fn()."""
    peak = float("nan")
    if device.type == "cuda":
        fn()  # compiles (FlexAttention per row length) happen here, not in the timing
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return time_fn(fn, device=device, warmup=warmup, iters=iters), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU with tiny shapes")
    ap.add_argument("--config", default=None, help="model shapes (bench_decode CONFIGS; default sdar-1.7b on GPU)")
    ap.add_argument("--samples", type=int, default=None, help="sequences in the batch (default 64 GPU / 16 CPU)")
    ap.add_argument("--prompt", type=ints, default=None, help="LO,HI prompt tokens (default 64,320 / 2,12)")
    ap.add_argument("--response", type=ints, default=None, help="LO,HI response tokens (default 48,1024 / 3,60)")
    ap.add_argument("--truncated", type=float, default=0.05, help="fraction of responses at the maximum length")
    ap.add_argument("--block", type=int, default=None, help="block size (default 32 GPU / 4 CPU)")
    ap.add_argument("--tpf", type=float, default=None, help="mean tokens per denoising step of the synthetic "
                    "trajectories (default 4 GPU / 2 CPU)")
    ap.add_argument("--budget", type=int, default=None, help="positions per forward (default 16384 / 512)")
    ap.add_argument("--modes", default="block_proxy,trace", help="layouts: block_proxy, trace")
    ap.add_argument("--passes", default="logprob,train", help="logprob, train")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in the train pass")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if on_gpu else "cpu")
    config = args.config or ("sdar-1.7b" if on_gpu else "tiny")
    samples = args.samples or (64 if on_gpu else 16)
    prompt = tuple(args.prompt or ((64, 320) if on_gpu else (2, 12)))
    response = tuple(args.response or ((48, 1024) if on_gpu else (3, 60)))
    block = args.block or (32 if on_gpu else 4)
    tpf = args.tpf or (4.0 if on_gpu else 2.0)
    budget = args.budget or (16384 if on_gpu else 512)
    modes = [m for m in args.modes.split(",") if m]
    passes = [p for p in args.passes.split(",") if p]
    if len(prompt) != 2 or len(response) != 2 or prompt[0] > prompt[1] or response[0] > response[1]:
        ap.error("--prompt and --response take LO,HI with LO <= HI")
    if set(passes) - {"logprob", "train"} or set(modes) - {"block_proxy", "trace"}:
        ap.error("--passes takes logprob,train and --modes block_proxy,trace")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = make_model(config, device, dtype)
    model.gradient_checkpointing = args.grad_ckpt
    cfg = model.config
    seqs, smap, plens, rlens = synthetic_batch(samples, prompt, response, block, tpf, args.truncated,
                                               cfg.vocab_size, cfg.mask_token_id)
    g = torch.Generator().manual_seed(1)
    rows, out_modes = RowLog("rl_step", device=device_name(device), config=config,
                             dtype=str(dtype).replace("torch.", "")), {}
    for mode in modes:
        lb = build_layout_batch(seqs, smap, plens, rlens, block, cfg.mask_token_id, mode)
        packed = list(micro_batches(lb, range(samples), budget, device, cfg.mask_token_id))
        padded = padded_ranges(lb, budget)
        geometry = {
            "padded": (sum((r1 - r0) * lb.layout.n * lb.layout.num_copies for r0, r1, _ in padded), len(padded)),
            "packed": (sum(mb.positions for mb in packed), len(packed)),
        }
        used = sum(mb.used for mb in packed)
        adv_tok = torch.randn(samples, generator=g)[lb.tgt_row]
        old = padded_logprobs(model, lb, budget)
        ref = old + 0.01 * torch.randn(lb.num_tokens, generator=g)
        correct = torch.rand(samples, generator=g) < 0.5
        rc = RLConfig(micro_batch_tokens=budget, kl_beta=0.01, nll_weight=0.1, group_size=2)
        # the two paths compute the same thing (checked once, before any timing)
        lp_packed = logprob_stage(model, lb, budget)
        lp_err = float((lp_packed - old).abs().max())
        model.train()
        loss_packed = loss_backward_stage(model, lb, range(samples), adv_tok, old, ref, correct, rc)["loss"]
        model.zero_grad(set_to_none=True)
        loss_padded = padded_train(model, lb, adv_tok, old, ref, correct, rc)
        model.zero_grad(set_to_none=True)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        if lp_err > tol * 10 or abs(loss_packed - loss_padded) > tol * max(1.0, abs(loss_padded)):
            raise SystemExit(f"{mode}: packed and padded passes disagree (log-prob max err {lp_err:.3g}, "
                             f"loss {loss_packed:.6g} vs {loss_padded:.6g})")
        fns = {
            ("logprob", "padded"): lambda: padded_logprobs(model, lb, budget),
            ("logprob", "packed"): lambda: logprob_stage(model, lb, budget),
            ("train", "padded"): lambda: padded_train(model, lb, adv_tok, old, ref, correct, rc),
            ("train", "packed"): lambda: loss_backward_stage(model, lb, range(samples), adv_tok, old, ref, correct, rc),
        }
        out_modes[mode] = {"copies": lb.layout.num_copies, "n": lb.layout.n, "targets": lb.num_tokens,
                           "logprob_max_err": lp_err, "loss_packed": loss_packed, "loss_padded": loss_padded}
        for p in passes:
            if p == "train":
                model.train()
            times, pair = {}, []
            for path in ("padded", "packed"):
                ms, peak = measure(fns[(p, path)], device, warmup=1, iters=args.iters)
                model.zero_grad(set_to_none=True)
                times[path] = ms
                positions, forwards = geometry[path]
                pair.append({"mode": mode, "pass": p, "path": path, "forwards": forwards, "positions": positions,
                             "fill": used / positions, "ms": ms,
                             "ktok/s": lb.num_tokens / ms, "x": float("nan"), "peak_GiB": peak})
            pair[-1]["x"] = times["padded"] / times["packed"]
            for row in pair:
                rows.append(row)
            model.eval()
    print(f"device {device_name(device)}, config {config} {str(dtype).replace('torch.', '')}, {samples} samples, "
          f"prompt {prompt}, response {response}, block {block}, tpf {tpf}, budget {budget}"
          f"{', gradient checkpointing' if args.grad_ckpt else ''}")
    print_table(rows)
    rows.emit(samples=samples, prompt=list(prompt), response=list(response), block=block, tpf=tpf,
              budget=budget, grad_ckpt=args.grad_ckpt, modes=out_modes, rows=rows,
              kernels=kernels_dispatched(device, "linear_logprobs", "fused_linear_grpo_loss"))


if __name__ == "__main__":
    main()
