"""ops for the LightningRL objective (REFERENCE §4): group normalization of rewards and the GRPO loss.

* `group_normalize(rewards [S, R], group_ids [S], weights [R], mode)` -> advantages [S].
  "decoupled" (LightningRL): z-score each reward column within its group (population std, 0 where the
  std is 0), weighted sum, then z-score over the batch (std floored at 1e-8). "sum" (the ablation):
  weighted sum of the raw rewards, group z-score, then batch z-score.
* `grpo_token_loss(logp, old_logp, ref_logp, advantages, seq_idx, num_seqs, correct, ...)` -> (loss, stats)
  from per-token log-probs. Kept from GRPO: the PPO clip with asymmetric eps_low / eps_high on
  rho = exp(clamp(logp - old_logp, -10, 10)), the k3 KL to a frozen reference (beta), group-relative
  advantages broadcast to every response token. Added by LightningRL: an NLL term (mu) on the tokens
  of verifier-correct samples. Dropped: GRPO's per-group std in the advantage (replaced by the decoupled
  per-reward normalization above), any entropy bonus, the value model. Reduction "seq-tok-tok" (the paper's
  best): policy = mean over sequences of the mean over their tokens; KL and NLL = mean over tokens.
  Each of the three parts takes "seq" or "tok" ("tok-tok-tok", "seq-seq-seq", ...).
* `linear_logprobs(hidden [T, H], weight [V, H], targets [T])` and `fused_linear_grpo_loss(...)`: the same
  from hidden states and the LM head, computed in token chunks with recomputation in backward, so the
  extra peak memory is O(chunk x V), never O(T x V). The CUDA fused kernel comes from its own issue.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ._common import FLOAT_DTYPES, check_tensor, cuda_kernel

_REDUCTIONS = ("seq", "tok")


def _segment_mean(x: torch.Tensor, seg: torch.Tensor, nseg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment mean of x [N] (0 for empty segments) and the counts [nseg]."""
    cnt = torch.zeros(nseg, dtype=x.dtype, device=x.device).index_add_(0, seg, torch.ones_like(x))
    tot = torch.zeros(nseg, dtype=x.dtype, device=x.device).index_add_(0, seg, x)
    return tot / cnt.clamp_min(1), cnt


def _group_zscore(x: torch.Tensor, inv: torch.Tensor, ngroups: int) -> torch.Tensor:
    mean, _ = _segment_mean(x, inv, ngroups)
    var, _ = _segment_mean((x - mean[inv]) ** 2, inv, ngroups)
    std = var.sqrt()[inv]
    return torch.where(std > 0, (x - mean[inv]) / torch.where(std > 0, std, 1), torch.zeros_like(x))


def group_normalize_reference(rewards: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor,
                              mode: str = "decoupled") -> torch.Tensor:
    """Pure-PyTorch group normalization; computes in float64 for float64 input, float32 otherwise."""
    dt = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r, w = rewards.to(dt), weights.to(dt)
    _, inv = torch.unique(group_ids, return_inverse=True)
    ngroups = int(inv.max()) + 1 if inv.numel() else 0
    if mode == "decoupled":
        z = torch.stack([_group_zscore(r[:, j], inv, ngroups) for j in range(r.shape[1])], dim=1)  # [S, R]
        total = (z * w).sum(1)
    else:
        total = _group_zscore((r * w).sum(1), inv, ngroups)
    mean = total.mean()
    std = ((total - mean) ** 2).mean().sqrt()
    return ((total - mean) / std.clamp_min(1e-8)).to(torch.float32 if dt == torch.float32 else dt)


@torch.library.custom_op("lightningrl_fast::group_normalize", mutates_args=())
def _group_normalize_op(rewards: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor, mode: str) -> torch.Tensor:
    kernel = cuda_kernel("group_normalize", rewards)
    if kernel is not None:
        return kernel(rewards, group_ids, weights, mode == "decoupled")
    return group_normalize_reference(rewards, group_ids, weights, mode)


@_group_normalize_op.register_fake
def _(rewards, group_ids, weights, mode):
    return rewards.new_empty((rewards.shape[0],), dtype=torch.float64 if rewards.dtype == torch.float64 else torch.float32)


def group_normalize(rewards: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor | None = None,
                    mode: str = "decoupled") -> torch.Tensor:
    """Advantages [S] from rewards [S, R] (float), group_ids [S] (int), weights [R] (default all ones)."""
    check_tensor("rewards", rewards, ndim=2, dtypes=FLOAT_DTYPES)
    s, nr = rewards.shape
    check_tensor("group_ids", group_ids, shape=(s,), dtypes=(torch.int32, torch.int64), device=rewards.device)
    if weights is None:
        weights = torch.ones(nr, dtype=rewards.dtype, device=rewards.device)
    check_tensor("weights", weights, shape=(nr,), dtypes=FLOAT_DTYPES, device=rewards.device)
    if mode not in ("decoupled", "sum"):
        raise ValueError(f"mode must be 'decoupled' or 'sum', got {mode!r}")
    if s == 0:
        raise ValueError("rewards has no samples")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf")
    return _group_normalize_op(rewards, group_ids.to(torch.int64), weights, mode)


def _parse_reduction(reduction: str) -> tuple[str, str, str]:
    parts = tuple(p.strip().lower()[:3] for p in reduction.split("-"))
    if len(parts) != 3 or any(p not in _REDUCTIONS for p in parts):
        raise ValueError(f"reduction must be three of seq/tok joined by '-', e.g. 'seq-tok-tok', got {reduction!r}")
    return parts  # type: ignore[return-value]


def _reduce(x: torch.Tensor, how: str, seq_idx: torch.Tensor, num_seqs: int, sel: torch.Tensor | None = None,
            denom: float | None = None) -> torch.Tensor:
    """Mean of x over the selected tokens ('tok') or mean over sequences of per-sequence means ('seq').

    `denom` replaces the count in the outer mean (tokens for 'tok', sequences for 'seq'): micro-batches of one
    batch pass the whole batch's counts, so their losses add up to the loss of the whole batch.
    """
    if sel is not None:
        x, seq_idx = x[sel], seq_idx[sel]
    if x.numel() == 0:
        return x.sum() * 0.0
    if how == "tok":
        return x.sum() / denom if denom else x.mean()
    means, cnt = _segment_mean(x, seq_idx, num_seqs)
    present = cnt > 0
    return means[present].sum() / denom if denom else means[present].mean()


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    seq_idx: torch.Tensor,
    num_seqs: int,
    correct: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.01,
    mu: float = 0.1,
    reduction: str = "seq-tok-tok",
    totals: tuple[float, float, float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """LightningRL loss from per-token log-probs (differentiable in `logp`). See the module docstring.

    logp, old_logp, ref_logp, advantages [T] float; seq_idx [T] int64 in [0, num_seqs); correct [num_seqs] bool.
    ref_logp may be None when beta == 0. `totals` = (sequences, tokens, correct sequences, their tokens) of the whole
    batch when this call sees one micro-batch of it: the micro-batch losses then sum to the batch loss. Returns (scalar loss, detached stats: policy, kl, nll, clip_frac, ratio).
    """
    check_tensor("logp", logp, ndim=1, dtypes=FLOAT_DTYPES)
    t, dev = logp.shape[0], logp.device
    check_tensor("old_logp", old_logp, shape=(t,), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("advantages", advantages, shape=(t,), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("seq_idx", seq_idx, shape=(t,), dtypes=(torch.int64,), device=dev)
    check_tensor("correct", correct, shape=(num_seqs,), dtypes=(torch.bool,), device=dev)
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("ref_logp is required when beta != 0")
        check_tensor("ref_logp", ref_logp, shape=(t,), dtypes=FLOAT_DTYPES, device=dev)
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low/eps_high must be >= 0, got {eps_low}, {eps_high}")
    red_pg, red_kl, red_nll = _parse_reduction(reduction)
    if t and (int(seq_idx.min()) < 0 or int(seq_idx.max()) >= num_seqs):
        raise ValueError(f"seq_idx values must lie in [0, {num_seqs})")

    ratio = torch.exp(torch.clamp(logp - old_logp, -10.0, 10.0))  # [T]
    adv = advantages.to(ratio.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    pg = -torch.minimum(unclipped, clipped)  # [T]
    n_seq, n_tok, n_cseq, n_ctok = totals if totals is not None else (None, None, None, None)
    den = {"seq": n_seq, "tok": n_tok}
    policy = _reduce(pg, red_pg, seq_idx, num_seqs, denom=den[red_pg])
    loss = policy
    zero = logp.sum() * 0.0
    kl = zero
    if beta != 0.0:
        d = logp - ref_logp
        kl = _reduce(torch.exp(-d) - 1.0 + d, red_kl, seq_idx, num_seqs, denom=den[red_kl])
        loss = loss + beta * kl
    nll = zero
    if mu != 0.0:
        nll = _reduce(-logp, red_nll, seq_idx, num_seqs, sel=correct[seq_idx],
                      denom=n_ctok if red_nll == "tok" else n_cseq)
        loss = loss + mu * nll
    with torch.no_grad():
        clip_frac = ((clipped < unclipped).float().mean() if t else zero.detach())
        stats = {"policy": policy.detach(), "kl": kl.detach(), "nll": nll.detach(),
                 "clip_frac": clip_frac, "ratio": ratio.mean() if t else zero.detach()}
    return loss, stats


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, suppress: int) -> torch.Tensor:
    logits = hidden @ weight.t()  # [t, V]
    if logits.dtype != torch.float64:
        logits = logits.float()
    if suppress >= 0:
        logits = logits.index_fill(1, torch.tensor([suppress], device=logits.device), float("-inf"))
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 1024,
                    suppress_token: int | None = None) -> torch.Tensor:
    """Per-token log-probs [T] (float32; float64 for float64 input) of `targets` under softmax(hidden @ weight.T), in chunks of `chunk` tokens.

    hidden [T, H], weight [V, H] (same float dtype), targets [T] int64 in [0, V). Differentiable; each chunk is
    recomputed in backward, so peak extra memory is O(chunk x V). `suppress_token`: a vocabulary id left out of
    the softmax (the sampler never emits the mask token, so its log-probs exclude it too).
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, shape=(None, hidden.shape[1]), dtypes=(hidden.dtype,), device=hidden.device)
    check_tensor("targets", targets, shape=(hidden.shape[0],), dtypes=(torch.int64,), device=hidden.device)
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if targets.numel() and not (0 <= int(targets.min()) and int(targets.max()) < weight.shape[0]):
        raise ValueError(f"targets must lie in [0, {weight.shape[0]})")
    suppress = -1 if suppress_token is None else int(suppress_token)
    outs = []
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for t0 in range(0, hidden.shape[0], chunk):
        h, y = hidden[t0 : t0 + chunk], targets[t0 : t0 + chunk]
        if need_grad:
            outs.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, h, weight, y, suppress, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(h, weight, y, suppress))
    if not outs:
        return hidden.new_zeros((0,), dtype=torch.float32)
    return torch.cat(outs)


def fused_linear_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, old_logp: torch.Tensor,
                           ref_logp: torch.Tensor | None, advantages: torch.Tensor, seq_idx: torch.Tensor,
                           num_seqs: int, correct: torch.Tensor, chunk: int = 1024, **loss_kwargs):
    """`grpo_token_loss` from hidden states [T, H] and the LM head [V, H] without materializing [T, V] logits.

    Returns (loss, stats, logp [T] detached). Gradients flow to hidden and weight.
    """
    logp = linear_logprobs(hidden, weight, targets, chunk)
    loss, stats = grpo_token_loss(logp, old_logp, ref_logp, advantages, seq_idx, num_seqs, correct, **loss_kwargs)
    return loss, stats, logp.detach()
