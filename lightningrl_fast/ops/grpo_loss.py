"""ops for the LightningRL objective (REFERENCE §4): group normalization of rewards and the GRPO loss.

* `group_normalize(rewards [S, R], group_ids [S], weights [R], mode)` -> advantages [S].
  "decoupled" (LightningRL): z-score each reward column within its group (population std, 0 where the
  std is 0), weighted sum, then z-score over the batch (std floored at 1e-8). "sum" (the ablation):
  weighted sum of the raw rewards, group z-score, then batch z-score. Arithmetic in float64 on every path.
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
  extra peak memory is O(chunk x V), never O(T x V).

CUDA kernels (csrc/grpo_loss.cu; all unverified on GPU hardware until the GPU tests ran):
* `group_normalize`: one single-CTA kernel, no host sync, deterministic. Group ids are arbitrary int64: a hash
  table maps them to slots, a stable counting sort orders each group's members by sample index, and the group
  statistics are summed in that fixed order (bitwise reproducible). Arithmetic in double; float32 output
  (float64 for float64 rewards).
* `linear_logprobs` on CUDA: token chunks, logits = hidden_chunk @ W^T by cuBLAS into one reused [chunk, V]
  buffer, then one row kernel (online max / logsumexp, target gather, optional entropy). Its backward recomputes
  each chunk's logits and writes g * (onehot - softmax) in place before the two gradient GEMMs.
* `fused_linear_grpo_loss` on CUDA: forward and backward fused in ONE pass over the chunks. The loss depends on
  the logits only through logp, and d loss / d logp_t = g_t is elementwise once the reduction's per-token weights
  are known up front (they need only seq_idx, correct and `totals`, not logp). So per chunk: GEMM -> row kernel
  (logp, PPO ratio / clip, k3, NLL, g_t, then the softmax gradient in place over the logits) -> grad_hidden rows
  = dlogits @ W and grad_W += dlogits^T @ hidden_chunk. The gradients are kept from the forward and returned by
  the autograd backward scaled by grad_output (in place, no copy). Extra memory: one [chunk, V] buffer in the
  input dtype plus the gradients; 6 T H V flops, against 8 for the checkpointed reference (forward, recompute,
  two gradient GEMMs).
  Precision: the logits buffer has the input dtype (bf16 logits, as `(h @ W.T).float()` in PyTorch), softmax and
  loss arithmetic in float32 (float64 for float64 inputs), the gradient rounded once to the input dtype (as
  autograd's), grad_W accumulated over chunks in the weight dtype by cuBLAS (beta = 1), as autograd accumulates
  the per-chunk gradients of the checkpointed reference.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ._common import FLOAT_DTYPES, check_float, check_int, check_tensor, cuda_kernel, host_checks_allowed

__all__ = [
    "fused_linear_grpo_loss",
    "group_normalize",
    "group_normalize_reference",
    "grpo_token_loss",
    "linear_logprobs",
]

_REDUCTIONS = ("seq", "tok")


def _segment_mean(x: torch.Tensor, seg: torch.Tensor, nseg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment mean of x [N] (0 for empty segments) and the counts [nseg]."""
    cnt = torch.zeros(nseg, dtype=x.dtype, device=x.device).index_add_(0, seg, torch.ones_like(x))
    tot = torch.zeros(nseg, dtype=x.dtype, device=x.device).index_add_(0, seg, x)
    return tot / cnt.clamp_min(1), cnt


def _group_zscore(x: torch.Tensor, inv: torch.Tensor, ngroups: int) -> torch.Tensor:
    """Population z-score of x [S] within groups `inv` [S] (0 where the std is 0).

    The mean is shifted by each group's first value (mean = x0 + mean(x - x0)): when all the values of a group
    are equal, the deviations are exactly 0 and so is the std, whatever the rounding of the mean (the plain
    mean of 3 x 0.1 is not 0.1 in floating point, and its deviations would give z = +-1 from noise).
    """
    idx = torch.arange(x.shape[0], device=x.device)
    first = torch.full((ngroups,), x.shape[0], dtype=idx.dtype, device=x.device).scatter_reduce(0, inv, idx, "amin")
    shift = x[first][inv]
    dmean, _ = _segment_mean(x - shift, inv, ngroups)
    mean = shift + dmean[inv]
    var, _ = _segment_mean((x - mean) ** 2, inv, ngroups)
    std = var.sqrt()[inv]
    return torch.where(std > 0, (x - mean) / torch.where(std > 0, std, 1), torch.zeros_like(x))


def group_normalize_reference(rewards: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor,
                              mode: str = "decoupled") -> torch.Tensor:
    """Pure-PyTorch group normalization. Computes in float64 whatever the input dtype (the kernel's arithmetic: the
    z-score jumps at std == 0, so two precisions can disagree by O(1) on sums that tie in one and not the other);
    returns float64 for float64 rewards, float32 otherwise."""
    dt = torch.float64
    r, w = rewards.to(dt), weights.to(dt)
    _, inv = torch.unique(group_ids, return_inverse=True)
    ngroups = int(inv.max()) + 1 if inv.numel() else 0
    if mode == "decoupled":
        z = torch.stack([_group_zscore(r[:, j], inv, ngroups) for j in range(r.shape[1])], dim=1)  # [S, R]
        total = (z * w).sum(1)
    else:
        total = _group_zscore((r * w).sum(1), inv, ngroups)
    mean = total[0] + (total - total[0]).mean()  # shifted, as the group means
    std = ((total - mean) ** 2).mean().sqrt()
    return ((total - mean) / std.clamp_min(1e-8)).to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)


# csrc/grpo_loss.cu: the kernel's int32 hash table (2 x S slots); more samples take the reference
GROUP_NORMALIZE_KERNEL_MAX_SAMPLES = 2**29


@torch.library.custom_op("lightningrl_fast::group_normalize", mutates_args=())
def _group_normalize_op(rewards: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor, mode: str) -> torch.Tensor:
    kernel = cuda_kernel("group_normalize", rewards)
    if kernel is not None and rewards.shape[0] < GROUP_NORMALIZE_KERNEL_MAX_SAMPLES:
        return kernel(rewards, group_ids, weights, mode == "decoupled")
    return group_normalize_reference(rewards, group_ids, weights, mode)


@_group_normalize_op.register_fake
def _(rewards, group_ids, weights, mode):
    return rewards.new_empty((rewards.shape[0],), dtype=torch.float64 if rewards.dtype == torch.float64 else torch.float32)


def group_normalize(rewards: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor | None = None,
                    mode: str = "decoupled") -> torch.Tensor:
    """Advantages [S] from rewards [S, R] (float), group_ids [S] (int), weights [R] (default all ones).

    Group ids are arbitrary integers (any values, members in any order). On CUDA the kernel never syncs with the
    host; the finiteness check of the rewards and weights (a host read) is skipped while capturing a CUDA graph or
    tracing with torch.compile (non-finite values then give NaN advantages).
    """
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
    if nr == 0:
        raise ValueError(f"rewards has no reward columns, got shape {list(rewards.shape)}")
    if host_checks_allowed(rewards.device):  # one host read for both (a device sync on CUDA)
        finite = torch.stack([torch.isfinite(rewards).all(), torch.isfinite(weights).all()]).tolist()
        if not finite[0]:
            raise ValueError("rewards contain NaN or inf")
        if not finite[1]:
            raise ValueError("weights contain NaN or inf")
    return _group_normalize_op(rewards, group_ids.to(torch.int64), weights, mode)


def _parse_reduction(reduction: str) -> tuple[str, str, str]:
    if not isinstance(reduction, str):
        raise TypeError(f"reduction must be a string such as 'seq-tok-tok', got {type(reduction).__name__}")
    parts = tuple(p.strip().lower()[:3] for p in reduction.split("-"))
    if len(parts) != 3 or any(p not in _REDUCTIONS for p in parts):
        raise ValueError(f"reduction must be three of seq/tok joined by '-', e.g. 'seq-tok-tok', got {reduction!r}")
    return parts  # type: ignore[return-value]


def _check_loss_inputs(t: int, dev: torch.device, old_logp, ref_logp, advantages, seq_idx, num_seqs: int, correct,
                       eps_low: float, eps_high: float, beta: float, reduction: str, totals,
                       check_values: bool | None = None, mu: float = 0.0) -> tuple[str, str, str]:
    """The checks of grpo_token_loss (shared with fused_linear_grpo_loss, where old_logp may be None). Returns the
    parsed reduction. `check_values`: read seq_idx's range on the host (a device sync for CUDA tensors); None =
    unless capturing or compiling, False = the caller has checked it."""
    num_seqs = check_int("num_seqs", num_seqs, lo=0)
    for name, x in (("eps_low", eps_low), ("eps_high", eps_high)):
        check_float(name, x, allow_inf=True, lo=0.0)  # inf: no clipping on that side
    for name, x in (("beta", beta), ("mu", mu)):
        check_float(name, x)
    if old_logp is not None:
        check_tensor("old_logp", old_logp, shape=(t,), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("advantages", advantages, shape=(t,), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("seq_idx", seq_idx, shape=(t,), dtypes=(torch.int64,), device=dev)
    check_tensor("correct", correct, shape=(num_seqs,), dtypes=(torch.bool,), device=dev)
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("ref_logp is required when beta != 0")
        check_tensor("ref_logp", ref_logp, shape=(t,), dtypes=FLOAT_DTYPES, device=dev)
    if totals is not None:
        if isinstance(totals, (str, bytes)) or not hasattr(totals, "__len__") or len(totals) != 4:
            raise ValueError(f"totals must be (sequences, tokens, correct sequences, correct tokens), got {totals!r}")
        for name, x in zip(("sequences", "tokens", "correct sequences", "correct tokens"), totals):
            check_float(f"totals ({name})", x, lo=0.0)  # a negative count flipped the loss's sign, NaN made it NaN
    parts = _parse_reduction(reduction)
    check_values = host_checks_allowed(dev) if check_values is None else check_values
    if t and check_values and (int(seq_idx.min()) < 0 or int(seq_idx.max()) >= num_seqs):
        raise ValueError(f"seq_idx values must lie in [0, {num_seqs})")
    return parts


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
    t = logp.shape[0]
    check_tensor("old_logp", old_logp, shape=(t,), dtypes=FLOAT_DTYPES, device=logp.device)
    red_pg, red_kl, red_nll = _check_loss_inputs(t, logp.device, old_logp, ref_logp, advantages, seq_idx, num_seqs,
                                                 correct, eps_low, eps_high, beta, reduction, totals, mu=mu)

    # The gradient at the edges is stated here, not inherited from torch's clamp / minimum backward (which give 0
    # at a clamp bound and half to each side of a tie, version-dependent): the ratio passes gradient for
    # -10 <= d <= 10, bounds included, and a tie of the two PPO terms takes the unclipped one's whole gradient.
    # So on-policy with eps = 0 (rho == 1 == the clip bound) is the plain policy gradient. The CUDA kernel
    # (grpo_dlogp) and _grpo_dlogp compute the same.
    d = logp - old_logp  # [T]
    inside = (d >= -10.0) & (d <= 10.0)
    ratio = torch.exp(torch.where(inside, d, d.clamp(-10.0, 10.0).detach()))  # [T]
    adv = advantages.to(ratio.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv  # taken only when rho is strictly outside
    pg = -torch.where(unclipped <= clipped, unclipped, clipped)  # [T]
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


def _suppress(logits: torch.Tensor, suppress: int) -> torch.Tensor:
    """logits [t, V] with column `suppress` at -inf (out of place). The index is made on the device by a fill
    kernel: a host-built index tensor would be a pageable copy, which waits for the stream, once per chunk."""
    idx = torch.full((1,), suppress, dtype=torch.int64, device=logits.device)
    return logits.index_fill(1, idx, float("-inf"))


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, suppress: int) -> torch.Tensor:
    logits = hidden @ weight.t()  # [t, V]
    if logits.dtype != torch.float64:
        logits = logits.float()
    if suppress >= 0:
        logits = _suppress(logits, suppress)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunk_entropy(hidden: torch.Tensor, weight: torch.Tensor, suppress: int) -> torch.Tensor:
    logits = hidden @ weight.t()
    if logits.dtype != torch.float64:
        logits = logits.float()
    if suppress >= 0:
        logits = _suppress(logits, suppress)
    logq = torch.log_softmax(logits, dim=-1)
    return -(logq.exp() * torch.where(torch.isinf(logq), 0.0, logq)).sum(-1)


def _check_lm_head(hidden, weight, targets, chunk: int, suppress_token: int | None,
                   check_values: bool | None = None) -> int:
    """Checks of the LM-head ops; returns the suppressed id (-1 for none). `check_values`: read the targets' range
    on the host (a device sync for CUDA tensors); None = unless capturing or compiling, False = the caller has."""
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, shape=(None, hidden.shape[1]), dtypes=(hidden.dtype,), device=hidden.device)
    check_tensor("targets", targets, shape=(hidden.shape[0],), dtypes=(torch.int64,), device=hidden.device)
    check_int("chunk", chunk, lo=1)
    vocab = weight.shape[0]
    check_values = host_checks_allowed(hidden.device) if check_values is None else check_values
    if targets.numel() and check_values and not (0 <= int(targets.min()) and int(targets.max()) < vocab):
        raise ValueError(f"targets must lie in [0, {vocab})")
    suppress = -1 if suppress_token is None else check_int("suppress_token", suppress_token)
    if not -1 <= suppress < vocab:
        raise ValueError(f"suppress_token must be None or in [0, {vocab}), got {suppress_token}")
    return suppress


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _LinearLogprobsFn(torch.autograd.Function):
    """CUDA linear_logprobs: the forward kernel saves lse [T]; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, suppress: int, chunk: int):
        from .._ext import ext

        logp, lse, _ = ext().linear_logprobs(hidden, weight, targets, suppress, chunk, False)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.suppress, ctx.chunk = suppress, chunk
        return logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp):
        from .._ext import ext

        hidden, weight, targets, lse = ctx.saved_tensors
        gh, gw = ext().linear_logprobs_backward(hidden, weight, targets, lse, grad_logp.to(lse.dtype).contiguous(),
                                                ctx.suppress, ctx.chunk, ctx.needs_input_grad[0],
                                                ctx.needs_input_grad[1])
        return gh, gw, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 1024,
                    suppress_token: int | None = None, check_values: bool | None = None) -> torch.Tensor:
    """Per-token log-probs [T] (float32; float64 for float64 input) of `targets` under softmax(hidden @ weight.T), in chunks of `chunk` tokens.

    hidden [T, H], weight [V, H] (same float dtype), targets [T] int64 in [0, V). Differentiable; each chunk is
    recomputed in backward, so peak extra memory is O(chunk x V). `suppress_token`: a vocabulary id left out of
    the softmax (the sampler never emits the mask token, so its log-probs exclude it too). `check_values=False`:
    the caller has checked the targets' range (skips a device sync per call).
    On CUDA (with the extension) this runs the chunked kernel (cuBLAS GEMM + one row kernel per chunk; backward:
    recompute, softmax gradient in place, two GEMMs); elsewhere the checkpointed PyTorch reference.
    """
    suppress = _check_lm_head(hidden, weight, targets, chunk, suppress_token, check_values)
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    kernel = cuda_kernel("linear_logprobs", hidden)
    if kernel is not None:
        h, w, y = hidden.contiguous(), weight.contiguous(), targets.contiguous()
        if need_grad:
            return _LinearLogprobsFn.apply(h, w, y, suppress, chunk)
        return kernel(h, w, y, suppress, chunk, False)[0]
    outs = []
    for t0 in range(0, hidden.shape[0], chunk):
        h, y = hidden[t0 : t0 + chunk], targets[t0 : t0 + chunk]
        if need_grad:
            outs.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, h, weight, y, suppress, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(h, weight, y, suppress))
    if not outs:
        return hidden.new_zeros((0,), dtype=_acc_dtype(hidden.dtype))
    return torch.cat(outs)


def _loss_weights(seq_idx: torch.Tensor, num_seqs: int, correct: torch.Tensor, parts: tuple[str, str, str],
                  totals, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token weights (w_pg, w_kl, w_nll) [T] of the reduction: loss = sum w_pg pg + beta sum w_kl k3 + mu sum w_nll (-logp).

    Exactly grpo_token_loss's reductions written as weighted sums: "tok" -> 1 / tokens, "seq" -> 1 / (tokens of
    the token's sequence in this call x sequences), NLL only over tokens of correct sequences; `totals` replace the
    local counts (micro-batches). They need seq_idx and correct only (not logp), so the fused kernel knows every
    token's d loss / d logp as soon as it has the token's logp. Device ops only (no host sync).
    """
    t, dev = seq_idx.shape[0], seq_idx.device
    ones = torch.ones(t, dtype=dtype, device=dev)
    cnt = torch.zeros(num_seqs, dtype=dtype, device=dev).index_add_(0, seq_idx, ones)
    cnt_tok = cnt[seq_idx].clamp_min(1)  # tokens of each token's sequence in this call
    corr_tok = correct[seq_idx].to(dtype)
    present = cnt > 0
    n_seq, n_tok, n_cseq, n_ctok = totals if totals is not None else (None, None, None, None)
    seq_den = n_seq if n_seq else present.sum().to(dtype).clamp_min(1)
    tok_den = n_tok if n_tok else max(t, 1)
    cseq_den = n_cseq if n_cseq else (present & correct).sum().to(dtype).clamp_min(1)
    ctok_den = n_ctok if n_ctok else corr_tok.sum().clamp_min(1)

    def weight(how: str, tok, seq) -> torch.Tensor:
        return ones / tok if how == "tok" else 1.0 / (cnt_tok * seq)

    red_pg, red_kl, red_nll = parts
    return (weight(red_pg, tok_den, seq_den), weight(red_kl, tok_den, seq_den),
            corr_tok * weight(red_nll, ctok_den, cseq_den))


def _loss_from_terms(logp, terms, w_pg, w_kl, w_nll, beta: float, mu: float):
    """(loss, policy, kl, nll) from the kernel's per-token terms [4, T] (pg, k3, ratio, clipped)."""
    policy = (w_pg * terms[0]).sum()
    loss = policy
    kl = nll = policy * 0.0
    if beta != 0.0:
        kl = (w_kl * terms[1]).sum()
        loss = loss + beta * kl
    if mu != 0.0:
        nll = torch.where(w_nll != 0, w_nll * -logp, 0.0).sum()  # 0 * -inf stays out (suppressed target)
        loss = loss + mu * nll
    return loss, policy, kl, nll


class _FusedLinearGRPOFn(torch.autograd.Function):
    """Forward and backward in one pass (the CUDA kernel): the gradients are computed during the forward, kept on
    ctx and returned by backward scaled (in place) by grad_output."""

    @staticmethod
    def forward(ctx, hidden, weight, kernel, args):
        targets, old, ref, adv, w_pg, w_kl, w_nll, eps_low, eps_high, beta, mu, suppress, chunk, with_entropy = args
        logp, terms, entropy, gh, gw = kernel(hidden, weight, targets, old, ref, adv, w_pg, w_kl, w_nll, eps_low,
                                              eps_high, beta, mu, suppress, chunk, ctx.needs_input_grad[0],
                                              ctx.needs_input_grad[1], with_entropy)
        loss = _loss_from_terms(logp, terms, w_pg, w_kl, w_nll, beta, mu)[0]
        ctx.grads = (gh, gw)
        if entropy is None:
            entropy = logp.new_empty((0,))
        ctx.mark_non_differentiable(logp, terms, entropy)
        return loss, logp, terms, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, *unused):
        gh, gw = ctx.grads
        ctx.grads = None  # backward runs once: free them with the graph
        for g in (gh, gw):
            if g is not None:
                g.mul_(grad_loss)  # in place: no second [V, H] buffer, no host read of grad_loss
        return gh, gw, None, None


def fused_linear_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, old_logp: torch.Tensor | None,
                           ref_logp: torch.Tensor | None, advantages: torch.Tensor, seq_idx: torch.Tensor,
                           num_seqs: int, correct: torch.Tensor, chunk: int = 1024, *, eps_low: float = 0.2,
                           eps_high: float = 0.2, beta: float = 0.01, mu: float = 0.1, reduction: str = "seq-tok-tok",
                           totals: tuple[float, float, float, float] | None = None,
                           suppress_token: int | None = None, with_entropy: bool = False,
                           check_values: bool | None = None):
    """`grpo_token_loss` from hidden states [T, H] and the LM head [V, H] without materializing [T, V] logits.

    Returns (loss, stats, logp [T] detached). Gradients flow to hidden and weight. The loss arguments are those of
    grpo_token_loss (`totals` for micro-batches), except that `old_logp` may be None: on-policy (one update per
    batch), old = logp detached, so rho = 1 without a separate old-policy forward. `suppress_token` as in
    linear_logprobs; `with_entropy` adds stats["entropy"], the mean over tokens of the softmax entropy (logging
    only, no gradient). `check_values=False`: the caller has checked the ranges of targets and seq_idx (skips the
    device syncs of those checks; a training loop checks once per pass on the host).
    On CUDA (with the extension) forward and backward are fused per chunk (see the module docstring); elsewhere
    the reference: linear_logprobs (checkpointed chunks) + grpo_token_loss.
    """
    suppress = _check_lm_head(hidden, weight, targets, chunk, suppress_token, check_values)
    t = hidden.shape[0]
    parts = _check_loss_inputs(t, hidden.device, old_logp, ref_logp, advantages, seq_idx, num_seqs, correct, eps_low,
                               eps_high, beta, reduction, totals, check_values, mu=mu)
    loss_kw = dict(eps_low=eps_low, eps_high=eps_high, beta=beta, mu=mu, reduction=reduction, totals=totals)
    kernel = cuda_kernel("fused_linear_grpo_loss", hidden)
    if kernel is None:
        logp = linear_logprobs(hidden, weight, targets, chunk, suppress_token=suppress_token)
        old = logp.detach() if old_logp is None else old_logp
        loss, stats = grpo_token_loss(logp, old, ref_logp, advantages, seq_idx, num_seqs, correct, **loss_kw)
        if with_entropy:
            with torch.no_grad():
                ent = [_chunk_entropy(hidden[t0 : t0 + chunk], weight, suppress) for t0 in range(0, t, chunk)]
                stats["entropy"] = torch.cat(ent).mean() if ent else loss.detach() * 0.0
        return loss, stats, logp.detach()

    acc = _acc_dtype(hidden.dtype)
    w_pg, w_kl, w_nll = _loss_weights(seq_idx, num_seqs, correct, parts, totals, acc)
    use_kl, use_nll = beta != 0.0, mu != 0.0
    old = old_logp.to(acc).contiguous() if old_logp is not None else None
    args = (targets.contiguous(), old, ref_logp.to(acc).contiguous() if use_kl else None, advantages.to(acc).contiguous(), w_pg, w_kl if use_kl else None, w_nll if use_nll else None,
            float(eps_low), float(eps_high), float(beta), float(mu), suppress, int(chunk), bool(with_entropy))
    h, w = hidden.contiguous(), weight.contiguous()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss, logp, terms, entropy = _FusedLinearGRPOFn.apply(h, w, kernel, args)
        policy, kl, nll = (x.detach() for x in _loss_from_terms(logp, terms, w_pg, w_kl, w_nll, beta, mu)[1:])
    else:
        logp, terms, entropy, _, _ = kernel(h, w, *args[:-1], False, False, args[-1])
        loss, policy, kl, nll = _loss_from_terms(logp, terms, w_pg, w_kl, w_nll, beta, mu)
    zero = policy.detach() * 0.0
    stats = {"policy": policy, "kl": kl, "nll": nll, "clip_frac": terms[3].mean() if t else zero,
             "ratio": terms[2].mean() if t else zero}
    if with_entropy:
        stats["entropy"] = entropy.mean() if t else zero
    return loss, stats, logp


def _grpo_dlogp(logp, old, ref, adv, w_pg, w_kl, w_nll, eps_low, eps_high, beta, mu):
    """d loss / d logp per token and the terms (pg, k3, ratio, clipped), as the CUDA kernel computes them.
    old None: on-policy (rho = 1); ref / w_kl unused when beta == 0, w_nll when mu == 0."""
    d = logp - old if old is not None else torch.zeros_like(logp)
    rho = torch.exp(d.clamp(-10.0, 10.0))
    u = rho * adv
    c = rho.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    g = torch.where((u <= c) & (d >= -10.0) & (d <= 10.0), -adv * rho * w_pg, 0.0)
    k3 = torch.zeros_like(logp)
    if beta != 0.0:
        dr = logp - ref
        e = torch.exp(-dr)
        k3 = e - 1.0 + dr
        g = g + beta * w_kl * (1.0 - e)
    if mu != 0.0:
        g = g - mu * w_nll
    return g, torch.stack([-torch.minimum(u, c), k3, rho, (c < u).to(logp.dtype)])


class _KernelModel:
    """PyTorch models of the `_C` LM-head entry points, with their exact signatures and algorithms (token chunks,
    logits in the input dtype, softmax statistics in float32 / float64, the gradient rounded to the input dtype,
    grad_W accumulated over chunks in the weight dtype). Tests substitute them for `_C` on the CPU to check the
    Python glue (autograd Functions, argument order, weights) and the fused algorithm without a GPU."""

    @staticmethod
    def _chunk_stats(h, weight, suppress):
        logits = (h @ weight.t()).to(_acc_dtype(h.dtype))
        if suppress >= 0:
            logits[:, suppress] = float("-inf")
        return logits, torch.logsumexp(logits, -1)

    @staticmethod
    def _entropy(logits, lse):
        q = torch.exp(logits - lse[:, None])
        return -(q * torch.where(q > 0, logits - lse[:, None], 0.0)).sum(-1)

    @staticmethod
    def _softmax_grad(logits, lse, y, g, suppress, dtype):
        dl = -g[:, None] * torch.exp(logits - lse[:, None])
        dl[torch.arange(dl.shape[0]), y] += g
        if suppress >= 0:
            dl[:, suppress] = 0.0
        return dl.to(dtype)

    @staticmethod
    @torch.no_grad()
    def linear_logprobs(hidden, weight, targets, suppress_token, chunk, with_entropy):
        acc = _acc_dtype(hidden.dtype)
        t = hidden.shape[0]
        logp, lse = torch.empty(t, dtype=acc), torch.empty(t, dtype=acc)
        ent = torch.empty(t, dtype=acc) if with_entropy else None
        for t0 in range(0, t, chunk):
            sl = slice(t0, min(t, t0 + chunk))
            logits, l = _KernelModel._chunk_stats(hidden[sl], weight, suppress_token)
            lse[sl] = l
            logp[sl] = logits.gather(1, targets[sl][:, None]).squeeze(1) - l
            if with_entropy:
                ent[sl] = _KernelModel._entropy(logits, l)
        return logp, lse, ent

    @staticmethod
    @torch.no_grad()
    def linear_logprobs_backward(hidden, weight, targets, lse, grad_logp, suppress_token, chunk, need_grad_hidden,
                                 need_grad_weight):
        gh = torch.empty_like(hidden) if need_grad_hidden else None
        gw = torch.zeros_like(weight) if need_grad_weight else None
        for t0 in range(0, hidden.shape[0], chunk):
            sl = slice(t0, min(hidden.shape[0], t0 + chunk))
            logits, _ = _KernelModel._chunk_stats(hidden[sl], weight, suppress_token)
            dl = _KernelModel._softmax_grad(logits, lse[sl], targets[sl], grad_logp[sl], suppress_token, hidden.dtype)
            if gh is not None:
                gh[sl] = dl @ weight
            if gw is not None:
                gw += dl.t() @ hidden[sl]
        return gh, gw

    @staticmethod
    @torch.no_grad()
    def fused_linear_grpo_loss(hidden, weight, targets, old_logp, ref_logp, advantages, w_pg, w_kl, w_nll, eps_low,
                               eps_high, beta, mu, suppress_token, chunk, need_grad_hidden, need_grad_weight,
                               with_entropy):
        acc = _acc_dtype(hidden.dtype)
        t = hidden.shape[0]
        for name, x in (("old_logp", old_logp), ("advantages", advantages), ("w_pg", w_pg)):
            assert x is None or (x.dtype == acc and x.shape == (t,)), name
        logp, terms = torch.empty(t, dtype=acc), torch.empty(4, t, dtype=acc)
        ent = torch.empty(t, dtype=acc) if with_entropy else None
        gh = torch.empty_like(hidden) if need_grad_hidden else None
        gw = torch.zeros_like(weight) if need_grad_weight else None
        for t0 in range(0, t, chunk):
            sl = slice(t0, min(t, t0 + chunk))
            logits, lse = _KernelModel._chunk_stats(hidden[sl], weight, suppress_token)
            y = targets[sl]
            lp = logits.gather(1, y[:, None]).squeeze(1) - lse
            pick = (lambda x: x[sl] if x is not None else None)
            g, tm = _grpo_dlogp(lp, pick(old_logp), pick(ref_logp), advantages[sl], w_pg[sl], pick(w_kl), pick(w_nll),
                                eps_low, eps_high, beta, mu)
            logp[sl], terms[:, sl] = lp, tm
            if with_entropy:
                ent[sl] = _KernelModel._entropy(logits, lse)
            if gh is not None or gw is not None:
                dl = _KernelModel._softmax_grad(logits, lse, y, g, suppress_token, hidden.dtype)
                if gh is not None:
                    gh[sl] = dl @ weight
                if gw is not None:
                    gw += dl.t() @ hidden[sl]
        return logp, terms, ent, gh, gw


@torch.no_grad()
def _fused_linear_grpo_chunked(hidden, weight, targets, old_logp, ref_logp, advantages, seq_idx, num_seqs, correct,
                               chunk=1024, *, eps_low=0.2, eps_high=0.2, beta=0.01, mu=0.1, reduction="seq-tok-tok",
                               totals=None, suppress_token=None):
    """The fused algorithm end to end in PyTorch (weights, then _KernelModel.fused_linear_grpo_loss).
    Returns (loss, logp, terms, grad_hidden, grad_weight)."""
    acc = _acc_dtype(hidden.dtype)
    w_pg, w_kl, w_nll = _loss_weights(seq_idx, num_seqs, correct, _parse_reduction(reduction), totals, acc)
    logp, terms, _, gh, gw = _KernelModel.fused_linear_grpo_loss(
        hidden, weight, targets, old_logp.to(acc) if old_logp is not None else None,
        ref_logp.to(acc) if beta != 0.0 else None, advantages.to(acc), w_pg, w_kl if beta != 0.0 else None,
        w_nll if mu != 0.0 else None, eps_low, eps_high, beta, mu, -1 if suppress_token is None else suppress_token,
        chunk, True, True, False)
    loss = _loss_from_terms(logp, terms, w_pg, w_kl, w_nll, beta, mu)[0]
    return loss, logp, terms, gh, gw
