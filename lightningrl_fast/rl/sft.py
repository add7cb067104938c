"""Block-diffusion SFT (the SDAR objective) — the warm-up of the embedded default and the RFT baseline.

For each (prompt, response) pair: in every response block draw a masking rate p ~ U(eps, 1), mask each
response token of the block with probability p (at least one per block), and run the block-proxy layout
[x_t ; x_0] in one forward. Loss = sum over masked tokens of CE / p, divided by the number of response
tokens (an unbiased estimate of the block-diffusion NELBO, REFERENCE §3).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from ..model import SDARForCausalLM
from ..ops.masked_attn import MaskLayout
from .optim import make_optimizer


def collate(pairs: list[tuple[list[int], list[int]]], block_size: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, n], prompt_lens [N], total_lens [N]); n rounded up to whole blocks, padded with pad_id."""
    lens = [len(p) + len(r) for p, r in pairs]
    n = -(-max(lens) // block_size) * block_size
    ids = torch.full((len(pairs), n), pad_id, dtype=torch.int64)
    for i, (p, r) in enumerate(pairs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.int64)
    return ids, torch.tensor([len(p) for p, _ in pairs]), torch.tensor(lens)


def sft_loss(model: SDARForCausalLM, ids: torch.Tensor, prompt_lens: torch.Tensor, lens: torch.Tensor,
             generator: torch.Generator, eps: float = 0.05) -> torch.Tensor:
    """The SDAR objective on a padded batch (see the module docstring). ids [N, n]."""
    cfg = model.config
    bs, (nrows, n) = cfg.block_size, ids.shape
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
    dev = next(model.parameters()).device
    xt = torch.where(masked, cfg.mask_token_id, ids)
    layout = MaskLayout.block_proxy(n, bs, lens.to(dev))
    inp = torch.cat([xt, ids], 1).to(dev)
    hidden = model.hidden(inp, layout=layout)[:, :n]  # [N, n, H] the x_t half
    rows, cols = masked.nonzero(as_tuple=True)
    logits = model.lm_head(hidden[rows.to(dev), cols.to(dev)]).float()  # [M, V]
    ce = F.cross_entropy(logits, ids[rows, cols].to(dev), reduction="none")
    return (ce / p_tok[rows, cols].to(dev)).sum() / resp.sum().clamp_min(1).to(dev)


def train_sft(model: SDARForCausalLM, sample_pair, steps: int, batch_size: int, lr: float, pad_id: int, seed: int = 0,
              warmup: int = 20, log_every: int = 50, log=print, time_budget_s: float | None = None) -> list[float]:
    """Run SFT for `steps` AdamW steps on pairs drawn by `sample_pair(rng) -> (prompt ids, response ids)`.

    Cosine decay after `warmup`; stops early at `time_budget_s`. Returns the loss curve.
    """
    import math
    import time

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)  # fp32 state for bf16 models
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    model.train()
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        ids, plens, lens = collate([sample_pair(rng) for _ in range(batch_size)], model.config.block_size, pad_id)
        loss = sft_loss(model, ids, plens, lens, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
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
