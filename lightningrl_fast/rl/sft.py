"""Block-diffusion SFT (the SDAR objective) — the warm-up of the embedded default and the RFT baseline.

For each (prompt, response) pair: in every response block draw a masking rate p ~ U(eps, 1), mask each
response token of the block with probability p (at least one per block), and run the block-proxy layout
[x_t ; x_0] in one forward. Loss = sum over masked tokens of CE / p, divided by the number of response
tokens (an unbiased estimate of the block-diffusion NELBO, REFERENCE §3). The CE is over the whole vocabulary,
mask token included, as SDAR trains.

The forward runs packed, as the RL passes do (rl/logprobs.iter_micro_batches): each pair keeps only the x_t
blocks that hold masked tokens (a prompt-only block of x_t is never read) and the blocks of its clean copy
before the last of them (within its own length; nothing reads a later clean block), pairs go back to
back into rows of at most `micro_batch_tokens` positions, and each row's loss is back-propagated as soon as it
is computed (train_sft), so memory is bounded by the budget rather than by the batch. Equal to the padded
[N, 2n] forward (tested in float64 against a pair-by-pair computation), which runs instead (consecutive rows)
when packing would save under 1/8 of its positions (pairs of about one length, as in the embedded default).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..model import SDARForCausalLM
from ..ops._common import upload
from ..ops.grpo_loss import linear_logprobs
from ..ops.masked_attn import MaskLayout
from .logprobs import LayoutBatch, iter_micro_batches
from .optim import make_optimizer


def collate(pairs: list[tuple[list[int], list[int]]], block_size: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, n], prompt_lens [N], total_lens [N]); n rounded up to whole blocks, padded with pad_id."""
    if not pairs:
        raise ValueError("SFT needs at least one (prompt, response) pair")
    lens = [len(p) + len(r) for p, r in pairs]
    n = -(-max(lens) // block_size) * block_size
    ids = torch.full((len(pairs), n), pad_id, dtype=torch.int64)
    for i, (p, r) in enumerate(pairs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.int64)
    return ids, torch.tensor([len(p) for p, _ in pairs]), torch.tensor(lens)


def sft_masks(prompt_lens: torch.Tensor, lens: torch.Tensor, n: int, block_size: int, generator: torch.Generator,
              eps: float = 0.05) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(masked [N, n] bool, p_tok [N, n] float32 masking rate of each position's block, resp [N, n] bool): the
    noise of one SFT batch, drawn from `generator` in a fixed order (rates, then coins)."""
    bs, nrows = block_size, prompt_lens.numel()
    pos = torch.arange(n)
    resp = (pos[None] >= prompt_lens[:, None]) & (pos[None] < lens[:, None])  # [N, n]
    nblk = n // bs
    p_blk = eps + (1 - eps) * torch.rand(nrows, nblk, generator=generator)  # [N, nblk]
    p_tok = p_blk.repeat_interleave(bs, dim=1)  # [N, n]
    masked = resp & (torch.rand(nrows, n, generator=generator) < p_tok)
    # at least one masked token per response block: force the first response token of empty blocks
    blk = (pos // bs).expand(nrows, n)
    has = torch.zeros(nrows, nblk, dtype=torch.bool).scatter_reduce(1, blk, masked, "amax")
    has_resp = torch.zeros(nrows, nblk, dtype=torch.bool).scatter_reduce(1, blk, resp, "amax")
    first_resp = resp & ~torch.cat([torch.zeros(nrows, 1, dtype=torch.bool), resp[:, :-1] & (blk[:, 1:] == blk[:, :-1])], 1)
    masked |= first_resp & (has_resp & ~has).gather(1, blk)
    return masked, p_tok, resp


def sft_loss(model: SDARForCausalLM, ids: torch.Tensor, prompt_lens: torch.Tensor, lens: torch.Tensor,
             generator: torch.Generator, eps: float = 0.05, micro_batch_tokens: int = 16384,
             backward: bool = False, pack: bool | None = None) -> torch.Tensor:
    """The SDAR objective of a collated batch (see the module docstring). ids [N, n] (host), prompt_lens and
    lens [N]. Returns the loss (0-dim float32, on the model's device). `backward=True` back-propagates each
    micro-batch's share as it goes (the gradients add up to the loss's) and returns the loss detached.

    `pack` None: packed micro-batches unless they would save under 1/8 of the padded positions (pairs of about
    one length, as in the embedded default), where the padded forward over consecutive rows is cheaper."""
    cfg = model.config
    bs, (nrows, n) = cfg.block_size, ids.shape
    if n % bs:
        raise ValueError(f"SFT ids have {n} positions, not a multiple of the block size {bs} (use collate)")
    masked, p_tok, resp = sft_masks(prompt_lens, lens, n, bs, generator, eps)
    rows, cols = masked.nonzero(as_tuple=True)  # [M] the targets, read in x_t (copy 0)
    weight = 1.0 / (p_tok[rows, cols].double() * resp.sum().clamp_min(1))  # [M]
    lb = LayoutBatch(ids, torch.where(masked, 0, -1).to(torch.int16), cfg.mask_token_id,
                     MaskLayout(n, 2, bs, lens.clamp_min(1)), rows, cols, ids[rows, cols], cols - prompt_lens[rows])
    if pack is None:  # positions a packed pass runs: the x_t blocks with targets + each pair's clean blocks
        needed = int(masked.view(nrows, n // bs, bs).any(2).sum()) * bs + int((-(-lens // bs)).sum()) * bs
        pack = nrows * 2 * n > needed * 9 // 8
    dev = next(model.parameters()).device
    if pack:
        parts = ((mb.to(dev), mb.sel) for mb in iter_micro_batches(
            lb, range(nrows), micro_batch_tokens, pad_shapes=dev.type == "cuda", pad_id=cfg.mask_token_id))
    else:
        parts = (_padded_rows(lb, r0, min(nrows, r0 + max(1, micro_batch_tokens // (2 * n))), dev)
                 for r0 in range(0, nrows, max(1, micro_batch_tokens // (2 * n))))
    total = torch.zeros((), device=dev, dtype=torch.float64)
    for mb, sel in parts:
        hidden = model.hidden(mb.input_ids, mb.position_ids, mb.layout)  # [rows, P, H]
        h = hidden.flatten(0, 1)[mb.read_col]  # [t, H] the x_t states of the targets (a packed batch has one row)
        logp = linear_logprobs(h, model.lm_head.weight, mb.targets)  # [t] whole vocabulary (mask token included)
        part = -(logp.double() * upload(weight[sel], dev)).sum()  # no host wait for the queued forward
        if backward:
            part.backward()
            part = part.detach()
        total = total + part
    return total.float()


@dataclass
class _Rows:
    """Consecutive rows of the padded [x_t ; x_0] forward, with where their targets are read."""

    input_ids: torch.Tensor  # [r, 2n]
    position_ids: torch.Tensor  # [r, 2n]
    layout: MaskLayout
    read_col: torch.Tensor  # [t] flat position (row * 2n + column) of each target's state
    targets: torch.Tensor  # [t]


def _padded_rows(lb: LayoutBatch, r0: int, r1: int, dev: torch.device) -> tuple[_Rows, torch.Tensor]:
    """(rows r0..r1-1 of lb's padded forward on `dev`, the indices of their targets among lb's)."""
    sel = ((lb.tgt_row >= r0) & (lb.tgt_row < r1)).nonzero().squeeze(1)  # [t]
    ids, pos = lb.inputs(slice(r0, r1))  # [r, 2n] each
    layout = MaskLayout.block_proxy(lb.layout.n, lb.layout.block_size, lb.layout.lengths[r0:r1])  # host lengths
    read = (lb.tgt_row[sel] - r0) * ids.shape[1] + lb.tgt_col[sel]
    return _Rows(upload(ids, dev), upload(pos, dev), layout, upload(read, dev), upload(lb.targets[sel], dev)), sel


def train_sft(model: SDARForCausalLM, sample_pair, steps: int, batch_size: int, lr: float, pad_id: int, seed: int = 0,
              warmup: int = 20, log_every: int = 50, log=print, time_budget_s: float | None = None,
              micro_batch_tokens: int = 16384, optimizer_offload: bool = False) -> list[float]:
    """Run SFT for `steps` AdamW steps on pairs drawn by `sample_pair(rng) -> (prompt ids, response ids)`.

    Cosine decay after `warmup`; stops early at `time_budget_s`. Each step's batch runs as forwards of at most
    `micro_batch_tokens` positions (packed, or padded rows: `sft_loss`); `optimizer_offload` keeps the fp32
    optimizer state in host memory (rl/optim.py). Returns the loss curve.
    """
    import math
    import time

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0,
                         offload=optimizer_offload)  # fp32 state for bf16 models
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    model.train()
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        ids, plens, lens = collate([sample_pair(rng) for _ in range(batch_size)], model.config.block_size, pad_id)
        opt.zero_grad(set_to_none=True)
        loss = sft_loss(model, ids, plens, lens, gen, micro_batch_tokens=micro_batch_tokens, backward=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log and (step + 1) % log_every == 0:
            log(f"sft step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.4f} "
                f"({time.perf_counter() - t0:.0f}s)")
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
    opt.zero_grad(set_to_none=True)
    model.eval()
    return losses
