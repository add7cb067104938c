"""group_normalize and the GRPO loss: references vs naive per-element loops, hand examples, chunked LM head."""

import math

import pytest
import torch
from conftest import fuzz_cases
from test_grpo_loss_emu_random import _check_random_config, _LmHeadThroughGemm

from lightningrl_fast.ops import grpo_loss as _gl
from lightningrl_fast.ops.grpo_loss import (
    fused_linear_grpo_loss,
    group_normalize,
    grpo_token_loss,
    linear_logprobs,
)


def naive_zscore(vals):
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))
    return [(v - m) / sd if sd > 0 else 0.0 for v in vals]


def naive_group_normalize(rewards, groups, weights, mode):
    s, nr = len(rewards), len(weights)
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    total = [0.0] * s
    if mode == "decoupled":
        for j in range(nr):
            for idx in members.values():
                for i, z in zip(idx, naive_zscore([rewards[i][j] for i in idx])):
                    total[i] += weights[j] * z
    else:
        raw = [sum(w * r for w, r in zip(weights, rewards[i])) for i in range(s)]
        for idx in members.values():
            for i, z in zip(idx, naive_zscore([raw[i] for i in idx])):
                total[i] = z
    m = sum(total) / s
    sd = math.sqrt(sum((t - m) ** 2 for t in total) / s)
    return [(t - m) / max(sd, 1e-8) for t in total]


@pytest.mark.parametrize("mode", ["decoupled", "sum"])
@pytest.mark.parametrize("s,gsize", [(97, 1), (123, 3), (32, 8), (1, 1)])
def test_group_normalize_matches_naive(mode, s, gsize):
    g = torch.Generator().manual_seed(s)
    acc = (torch.rand(s, generator=g) < 0.5).double()
    tpf = torch.rand(s, generator=g, dtype=torch.float64) * 8
    rewards = torch.stack([acc, tpf], 1)
    groups = torch.arange(s) // gsize
    groups = groups[torch.randperm(s, generator=g)]  # group members need not be contiguous
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    got = group_normalize(rewards, groups, weights, mode)
    want = torch.tensor(naive_group_normalize(rewards.tolist(), groups.tolist(), weights.tolist(), mode), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    got32 = group_normalize(rewards.float(), groups, weights.float(), mode)
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-5)


def test_group_normalize_hand_examples():
    # one group, accuracy [1, 0, 1, 0] and equal TPF: z_acc = [1,-1,1,-1], z_tpf = 0 -> batch z = same
    r = torch.tensor([[1.0, 3.0], [0.0, 3.0], [1.0, 3.0], [0.0, 3.0]])
    adv = group_normalize(r, torch.zeros(4, dtype=torch.long), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    # all-equal groups: every advantage is 0 (std 0 everywhere, then 0 / 1e-8 floor)
    adv = group_normalize(torch.ones(6, 2), torch.arange(6) // 3)
    assert torch.equal(adv, torch.zeros(6))
    with pytest.raises(ValueError, match="NaN or inf"):
        group_normalize(torch.tensor([[float("nan")]]), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="mode must be"):
        group_normalize(torch.ones(2, 1), torch.zeros(2, dtype=torch.long), mode="avg")
    with pytest.raises(ValueError, match=r"group_ids must have shape \[3\]"):
        group_normalize(torch.ones(3, 1), torch.zeros(2, dtype=torch.long))


def test_group_normalize_opcheck():
    torch.library.opcheck(torch.ops.lightningrl_fast.group_normalize.default,
                          (torch.randn(12, 2), torch.arange(12) // 4, torch.ones(2), "decoupled"))


def naive_loss(logp, old, ref, adv, seq, nseq, correct, el, eh, beta, mu, red):
    red_pg, red_kl, red_nll = red.split("-")
    T = len(logp)

    def reduce(vals, how, sel):
        idx = [t for t in range(T) if sel(t)]
        if not idx:
            return 0.0
        if how == "tok":
            return sum(vals[t] for t in idx) / len(idx)
        per = {}
        for t in idx:
            per.setdefault(seq[t], []).append(vals[t])
        return sum(sum(v) / len(v) for v in per.values()) / len(per)

    pg = []
    for t in range(T):
        rho = math.exp(max(-10.0, min(10.0, logp[t] - old[t])))
        pg.append(-min(rho * adv[t], max(1 - el, min(1 + eh, rho)) * adv[t]))
    loss = reduce(pg, red_pg, lambda t: True)
    if beta:
        k3 = [math.exp(-(logp[t] - ref[t])) - 1 + (logp[t] - ref[t]) for t in range(T)]
        loss += beta * reduce(k3, red_kl, lambda t: True)
    if mu:
        loss += mu * reduce([-x for x in logp], red_nll, lambda t: correct[seq[t]])
    return loss


@pytest.mark.parametrize("red", ["seq-tok-tok", "tok-tok-tok", "seq-seq-seq"])
@pytest.mark.parametrize("beta,mu,correct_frac", [(0.01, 0.1, 0.5), (0.0, 0.0, 0.5), (0.04, 0.1, 0.0)])
def test_token_loss_matches_naive_and_gradient(red, beta, mu, correct_frac):
    g = torch.Generator().manual_seed(7)
    T, nseq = 97, 9
    seq = torch.sort(torch.randint(0, nseq, (T,), generator=g)).values
    logp = (-torch.rand(T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + torch.randn(T, generator=g, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(nseq, generator=g, dtype=torch.float64)[seq]
    correct = torch.rand(nseq, generator=g) < correct_frac
    loss, stats = grpo_token_loss(logp, old, ref, adv, seq, nseq, correct, 0.2, 0.28, beta, mu, red)
    want = naive_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), seq.tolist(), nseq, correct.tolist(),
                      0.2, 0.28, beta, mu, red)
    assert abs(loss.item() - want) < 1e-10
    loss.backward()
    eps = 1e-6
    for t in (0, 13, 96):  # finite-difference check of d loss / d logp at a few tokens
        lp = logp.detach().clone()
        lp[t] += eps
        up = naive_loss(lp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), seq.tolist(), nseq, correct.tolist(),
                        0.2, 0.28, beta, mu, red)
        assert abs((up - want) / eps - logp.grad[t].item()) < 1e-4
    assert 0.0 <= stats["clip_frac"].item() <= 1.0


def test_token_loss_gradient_at_clip_and_clamp_bounds():
    """Edges where torch's clamp / minimum backward would decide (0 at a clamp bound, half to each side of a tie):
    the loss states its own semantics, the CUDA kernel's (_grpo_dlogp models it): the ratio passes gradient for
    -10 <= d <= 10 inclusive, a tie of the PPO terms takes the unclipped gradient. On-policy with eps = 0 is thus the
    plain policy gradient -A / T per token (tok reduction), not half or zero of it."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0, -1.0, -2.0], dtype=torch.float64)
    old = logp + torch.tensor([0.0, 0.0, 0.0, 0.0, -10.0, 10.0, -10.5], dtype=torch.float64)  # d = logp - old
    adv = torch.tensor([0.7, -1.3, 0.4, -0.2, -0.9, 0.8, 1.1], dtype=torch.float64)  # d = +-10: unclipped is smaller
    T = logp.shape[0]
    seq = torch.arange(T)
    for eps_low, eps_high in ((0.0, 0.0), (0.2, 0.0), (0.0, 0.28)):
        lp = logp.clone().requires_grad_()
        loss, _ = grpo_token_loss(lp, old, None, adv, seq, T, torch.zeros(T, dtype=torch.bool), eps_low, eps_high,
                                  0.0, 0.0, "tok-tok-tok")
        (grad,) = torch.autograd.grad(loss, lp)
        d = logp - old
        rho = torch.exp(d.clamp(-10, 10))
        u, c = rho * adv, rho.clamp(1 - eps_low, 1 + eps_high) * adv
        want = torch.where((d.abs() <= 10) & (u <= c), -adv * rho / T, 0.0)
        assert int(((d.abs() <= 10) & (u <= c)).sum()) == T - 1  # every token but d = -10.5 takes the gradient
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=0.0)
        g, _ = _gl._grpo_dlogp(logp, old, None, adv, torch.full((T,), 1.0 / T, dtype=torch.float64), None, None,
                               eps_low, eps_high, 0.0, 0.0)
        torch.testing.assert_close(g, want, rtol=1e-12, atol=0.0)


def test_token_loss_errors():
    t = torch.zeros(4)
    seq = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="ref_logp is required"):
        grpo_token_loss(t, t, None, t, seq, 1, torch.ones(1, dtype=torch.bool), beta=0.1)
    with pytest.raises(ValueError, match="reduction must be"):
        grpo_token_loss(t, t, t, t, seq, 1, torch.ones(1, dtype=torch.bool), reduction="seq-tok")
    with pytest.raises(ValueError, match=r"seq_idx values must lie in \[0, 1\)"):
        grpo_token_loss(t, t, t, t, seq + 1, 1, torch.ones(1, dtype=torch.bool))


def test_loss_and_lm_head_inputs_are_checked():
    """Every tensor's length (a length-1 advantages or old_logp would broadcast silently, a short `correct` be
    indexed out of range), the value ranges (negative seq_idx or targets, a target or suppress_token equal to V),
    eps >= 0, four totals and chunk >= 1 are refused by name before anything is computed."""
    g = torch.Generator().manual_seed(1)
    a = dict(logp=torch.randn(5, generator=g), old_logp=torch.randn(5, generator=g),
             ref_logp=torch.randn(5, generator=g), advantages=torch.randn(5, generator=g),
             seq_idx=torch.tensor([0, 0, 1, 1, 1]), num_seqs=2, correct=torch.tensor([True, False]))
    cases = [
        (dict(advantages=torch.randn(1)), ValueError, r"advantages must have shape \[5\], got \[1\]"),
        (dict(old_logp=torch.randn(1)), ValueError, r"old_logp must have shape \[5\], got \[1\]"),
        (dict(ref_logp=torch.randn(4)), ValueError, r"ref_logp must have shape \[5\], got \[4\]"),
        (dict(correct=torch.tensor([True])), ValueError, r"correct must have shape \[2\], got \[1\]"),
        (dict(seq_idx=torch.tensor([0, 0, 1, 1, -1])), ValueError, r"seq_idx values must lie in \[0, 2\)"),
    ]
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            grpo_token_loss(**(a | change))
    with pytest.raises(ValueError, match="eps_low must be >= 0.0, got -0.1"):
        grpo_token_loss(**a, eps_low=-0.1)
    with pytest.raises(ValueError, match=r"totals must be \(sequences, tokens, correct sequences, correct tokens\)"):
        grpo_token_loss(**a, totals=(2, 5, 1))
    h, w, y = torch.randn(5, 4, generator=g), torch.randn(7, 4, generator=g), torch.tensor([0, 1, 2, 3, 6])
    cases = [
        (dict(weight=w[:, :3]), ValueError, r"weight must have shape \[\*, 4\], got \[7, 3\]"),
        (dict(targets=y[:4]), ValueError, r"targets must have shape \[5\], got \[4\]"),
        (dict(targets=torch.tensor([0, 1, 2, 3, -1])), ValueError, r"targets must lie in \[0, 7\)"),
        (dict(targets=torch.tensor([0, 1, 2, 3, 7])), ValueError, r"targets must lie in \[0, 7\)"),
        (dict(suppress_token=7), ValueError, r"suppress_token must be None or in \[0, 7\), got 7"),
        (dict(chunk=0), ValueError, "chunk must be >= 1, got 0"),
    ]
    for change, error, match in cases:
        kw = dict(hidden=h, weight=w, targets=y) | change
        with pytest.raises(error, match=match):
            linear_logprobs(**kw)
        with pytest.raises(error, match=match):
            fused_linear_grpo_loss(kw.pop("hidden"), kw.pop("weight"), kw.pop("targets"), None, a["ref_logp"],
                                   a["advantages"], a["seq_idx"], 2, a["correct"], **kw)


def test_group_normalize_inputs_dtypes_and_opcheck():
    """int32 group ids are accepted (and group as int64 ones do), weights of another length are refused, and the
    fake's dtype follows the rewards' (float64 in, float64 out; float32 for the others)."""
    rewards = torch.randn(12, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ids = torch.arange(12) % 4
    assert torch.equal(group_normalize(rewards, ids.int()), group_normalize(rewards, ids))
    assert group_normalize(rewards, ids).dtype == torch.float64
    assert group_normalize(rewards.half(), ids).dtype == torch.float32
    with pytest.raises(ValueError, match=r"weights must have shape \[2\], got \[3\]"):
        group_normalize(rewards, ids, torch.ones(3, dtype=torch.float64))
    for r in (rewards, rewards.bfloat16()):
        torch.library.opcheck(torch.ops.lightningrl_fast.group_normalize.default, (r, ids, torch.ones(2), "sum"))


def test_linear_logprobs_of_no_tokens():
    """T = 0: an empty result in the accumulation dtype (float32 for bf16 input, float64 for float64), as for T > 0."""
    w = torch.randn(7, 4)
    for dtype, want in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        out = linear_logprobs(torch.zeros(0, 4, dtype=dtype), w.to(dtype), torch.zeros(0, dtype=torch.long))
        assert out.shape == (0,) and out.dtype == want


def test_linear_logprobs_and_fused_loss_match_dense():
    g = torch.Generator().manual_seed(3)
    T, H, V = 123, 16, 111
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (T,), generator=g)
    dense = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, y[:, None]).squeeze(-1)
    chunked = linear_logprobs(hidden, weight, y, chunk=10)
    torch.testing.assert_close(chunked.double(), dense, rtol=1e-6, atol=1e-6)
    seq = torch.arange(T) // 20
    kw = dict(eps_low=0.2, eps_high=0.2, beta=0.01, mu=0.1)
    old, ref, adv = dense.detach() - 0.1, dense.detach() + 0.05, torch.randn(7, generator=g, dtype=torch.float64)[seq]
    correct = torch.tensor([True, False, True, False, False, True, False])
    loss, _, _ = fused_linear_grpo_loss(hidden, weight, y, old, ref, adv, seq, 7, correct, chunk=17, **kw)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    want, _ = grpo_token_loss(dense, old, ref, adv, seq, 7, correct, **kw)
    wh, ww = torch.autograd.grad(want, (hidden, weight))
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gh, wh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 111\)"):
        linear_logprobs(hidden, weight, y + 111)


@pytest.mark.parametrize("red", ["seq-tok-tok", "seq-seq-seq", "tok-tok-tok"])
def test_microbatches_with_totals_sum_to_batch_loss(red):
    g = torch.Generator().manual_seed(11)
    T, nseq = 123, 10
    seq = torch.sort(torch.randint(0, nseq, (T,), generator=g)).values
    logp = -torch.rand(T, generator=g, dtype=torch.float64)
    old, ref = logp + 0.1 * torch.randn(T, generator=g, dtype=torch.float64), logp - 0.2
    adv = torch.randn(nseq, generator=g, dtype=torch.float64)[seq]
    correct = torch.rand(nseq, generator=g) < 0.5
    whole, _ = grpo_token_loss(logp, old, ref, adv, seq, nseq, correct, reduction=red)
    present = torch.unique(seq)
    totals = (len(present), T, int(correct[present].sum()), int(correct[seq].sum()))
    parts = 0.0
    for lo, hi in [(0, 3), (4, 4), (5, nseq - 1)]:  # micro-batches of whole sequences
        sel = (seq >= lo) & (seq <= hi)
        part, _ = grpo_token_loss(logp[sel], old[sel], ref[sel], adv[sel], seq[sel], nseq, correct, reduction=red,
                                  totals=totals)
        parts = parts + part
    assert abs(float(parts) - float(whole)) < 1e-12


# ---- reductions as per-token weights, the fused algorithm's PyTorch model (CPU) --------------------------------




def _loss_case(T, nseq, V, H, dtype=torch.float64, seed=0, adv_mode="random", correct_frac=0.5, spread=0.3,
               device="cpu"):
    """Random inputs of the linear GRPO loss; old/ref log-probs near the current ones (some ratios clipped)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64) / H ** 0.25
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.25
    y = torch.randint(0, V, (T,), generator=g)
    seq = torch.sort(torch.randint(0, nseq, (T,), generator=g)).values
    dense = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, y[:, None]).squeeze(-1)
    old = dense + spread * torch.randn(T, generator=g, dtype=torch.float64)
    ref = dense + spread * torch.randn(T, generator=g, dtype=torch.float64)
    if adv_mode == "random":
        adv = torch.randn(nseq, generator=g, dtype=torch.float64)[seq]
    else:  # all equal
        adv = torch.full((T,), 0.7, dtype=torch.float64)
    correct = torch.rand(nseq, generator=g) < correct_frac
    to = dict(device=device)
    return (hidden.to(dtype).to(**to), weight.to(dtype).to(**to), y.to(**to), old.to(**to), ref.to(**to),
            adv.to(**to), seq.to(**to), nseq, correct.to(**to))


def _dense_loss(hidden, weight, y, old, ref, adv, seq, nseq, correct, suppress=None, **kw):
    """The loss with materialized logits (autograd through everything), in the inputs' dtype."""
    logits = hidden @ weight.t()
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if suppress is not None:
        logits = logits.index_fill(1, torch.tensor([suppress], device=logits.device), float("-inf"))
    logp = torch.log_softmax(logits, -1).gather(-1, y[:, None]).squeeze(-1)
    return grpo_token_loss(logp, old, ref, adv, seq, nseq, correct, **kw)[0], logp


@pytest.mark.parametrize("red", ["seq-tok-tok", "tok-tok-tok", "seq-seq-seq", "tok-seq-tok"])
@pytest.mark.parametrize("with_totals", [False, True])
def test_loss_weights_reproduce_the_reduction(red, with_totals):
    g = torch.Generator().manual_seed(5)
    T, nseq = 123, 11
    seq = torch.sort(torch.randint(0, nseq, (T,), generator=g)).values
    logp = -torch.rand(T, generator=g, dtype=torch.float64) * 2
    old, ref = logp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64), logp - 0.2
    adv = torch.randn(nseq, generator=g, dtype=torch.float64)[seq]
    correct = torch.rand(nseq, generator=g) < 0.5
    totals = (13, 150, 7, 80) if with_totals else None
    kw = dict(eps_low=0.2, eps_high=0.28, beta=0.04, mu=0.1, reduction=red, totals=totals)
    want, wstats = grpo_token_loss(logp, old, ref, adv, seq, nseq, correct, **kw)
    w = _gl._loss_weights(seq, nseq, correct, _gl._parse_reduction(red), totals, torch.float64)
    _, terms = _gl._grpo_dlogp(logp, old, ref, adv, *w, 0.2, 0.28, 0.04, 0.1)
    got, policy, kl, nll = _gl._loss_from_terms(logp, terms, *w, 0.04, 0.1)
    assert abs(float(got) - float(want)) < 1e-12
    for k, v in (("policy", policy), ("kl", kl), ("nll", nll)):
        assert abs(float(v) - float(wstats[k])) < 1e-12, k
    assert abs(float(terms[3].mean()) - float(wstats["clip_frac"])) < 1e-7  # the reference counts in float32
    assert abs(float(terms[2].mean()) - float(wstats["ratio"])) < 1e-12


def test_reductions_average_over_the_sequences_present_only():
    """num_seqs (the LayoutBatch's rows) counts sequences with no token in this call (an empty response, or a
    micro-batch without `totals`): a 'seq' mean is over the sequences that have tokens, the NLL's over the correct
    ones among them, in grpo_token_loss and in the per-token weights of the fused kernel (_loss_weights) alike.
    Oracle: naive_loss, which sees only the sequences present (15 of 23 absent here, correct ones among them)."""
    g = torch.Generator().manual_seed(23)
    T, nseq, V, H = 97, 23, 111, 16
    present = torch.tensor([1, 4, 5, 9, 12, 17, 20, 22])
    seq = torch.sort(present[torch.randint(0, len(present), (T,), generator=g)]).values
    assert set(seq.tolist()) == set(present.tolist())
    correct = torch.rand(nseq, generator=g) < 0.5
    correct[[0, 2, 3, 6, 7]] = True  # absent and correct
    correct[[1, 4, 5]] = torch.tensor([True, False, True])  # present: correct and wrong ones
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64) / H ** 0.25
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.25
    y = torch.randint(0, V, (T,), generator=g)
    logp = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, y[:, None]).squeeze(-1)
    old = logp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    adv = torch.randn(nseq, generator=g, dtype=torch.float64)[seq]
    for red in ("seq-seq-seq", "seq-tok-seq", "tok-seq-tok"):
        kw = dict(eps_low=0.2, eps_high=0.28, beta=0.04, mu=0.1, reduction=red)
        want = naive_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), seq.tolist(), nseq,
                          correct.tolist(), 0.2, 0.28, 0.04, 0.1, red)
        got, _ = grpo_token_loss(logp, old, ref, adv, seq, nseq, correct, **kw)
        assert abs(float(got) - want) < 1e-12, red
        w = _gl._loss_weights(seq, nseq, correct, _gl._parse_reduction(red), None, torch.float64)
        _, terms = _gl._grpo_dlogp(logp, old, ref, adv, *w, 0.2, 0.28, 0.04, 0.1)
        assert abs(float(_gl._loss_from_terms(logp, terms, *w, 0.04, 0.1)[0]) - want) < 1e-12, red
        loss = _gl._fused_linear_grpo_chunked(hidden, weight, y, old, ref, adv, seq, nseq, correct, chunk=10, **kw)[0]
        assert abs(float(loss) - want) < 1e-12, red


# (T, V, adv_mode, correct_frac, beta, mu, spread, reduction, suppress)
FUSED_CASES = [
    (97, 111, "random", 0.5, 0.01, 0.1, 0.3, "seq-tok-tok", None),
    (123, 111, "random", 0.5, 0.04, 0.1, 0.05, "tok-tok-tok", 7),
    (123, 111, "equal", 0.5, 0.01, 0.1, 0.3, "seq-tok-tok", None),  # all-equal advantages
    (97, 111, "random", 0.0, 0.01, 0.1, 0.3, "seq-seq-seq", None),  # no correct sample
    (97, 111, "random", 0.5, 0.0, 0.0, 0.3, "seq-tok-tok", 0),  # beta 0 and mu 0
    (123, 64, "random", 1.0, 0.01, 0.1, 3.0, "seq-tok-tok", None),  # many clipped / clamped ratios
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"T{c[0]}-V{c[1]}-{c[2]}-c{c[3]}-b{c[4]}-m{c[5]}-{c[7]}-s{c[8]}")
def test_fused_algorithm_model_matches_autograd_float64(case):
    """The CUDA kernel's algorithm (one pass: logp -> g_t -> softmax gradient -> GEMMs), modelled in PyTorch."""
    T, V, adv_mode, cf, beta, mu, spread, red, sup = case
    hidden, weight, y, old, ref, adv, seq, nseq, correct = _loss_case(T, 9, V, 16, adv_mode=adv_mode,
                                                                      correct_frac=cf, spread=spread, seed=T + V)
    if sup is not None:
        y = torch.where(y == sup, (sup + 1) % V, y)
    kw = dict(eps_low=0.2, eps_high=0.28, beta=beta, mu=mu, reduction=red)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want, want_logp = _dense_loss(h, w, y, old, ref, adv, seq, nseq, correct, suppress=sup, **kw)
    wh, ww = torch.autograd.grad(want, (h, w), retain_graph=True)
    want = want.detach()
    loss, logp, terms, gh, gw = _gl._fused_linear_grpo_chunked(hidden, weight, y, old, ref, adv, seq, nseq, correct,
                                                               chunk=10, suppress_token=sup, **kw)
    assert abs(float(loss) - float(want)) < 1e-12
    torch.testing.assert_close(logp, want_logp.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, wh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, ww, rtol=1e-9, atol=1e-12)
    # the public op (the reference path on the CPU) agrees too, suppress_token included
    got, stats, lp = fused_linear_grpo_loss(h, w, y, old, ref, adv, seq, nseq, correct, chunk=17,
                                            suppress_token=sup, with_entropy=True, **kw)
    gh2, gw2 = torch.autograd.grad(got, (h, w))
    assert abs(float(got.detach()) - float(want)) < 1e-12
    torch.testing.assert_close(gh2, wh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw2, ww, rtol=1e-9, atol=1e-12)
    logits = hidden @ weight.t()
    if sup is not None:
        logits[:, sup] = float("-inf")
    q = torch.softmax(logits, -1)
    ent = -(q * torch.log(q.clamp_min(1e-300))).sum(-1).mean()
    assert abs(float(stats["entropy"]) - float(ent)) < 1e-10


@pytest.fixture(params=["model", pytest.param("cuda", marks=pytest.mark.gpu)])
def kdev(request, monkeypatch):
    """Where the LM-head kernel tests run. "cuda": the real CUDA kernels (GPU). "model": on the CPU, with `_C`'s
    LM-head entry points replaced by their PyTorch models (_gl._KernelModel, same signatures and algorithm), so
    the Python glue (dispatch, autograd Functions, argument order, reduction weights) and these tests' own code
    run everywhere."""
    if request.param == "cuda":
        _kernels_or_skip("fused_linear_grpo_loss")
        return "cuda"
    from lightningrl_fast import _ext

    monkeypatch.setattr(_gl, "cuda_kernel", lambda name, *tensors: getattr(_gl._KernelModel, name, None))
    monkeypatch.setattr(_ext, "ext", lambda: _gl._KernelModel)
    return "cpu"


def test_fused_on_policy_old_logp_none(kdev):
    """old_logp=None: old = logp detached (rho = 1, gradient of rho A), without a separate old-policy forward."""
    hidden, weight, y, old, ref, adv, seq, nseq, correct = _loss_case(97, 7, 111, 16, seed=9)
    kw = dict(eps_low=0.2, eps_high=0.28, beta=0.02, mu=0.1)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h @ w.t()
    logp = torch.log_softmax(logits, -1).gather(-1, y[:, None]).squeeze(-1)
    want, _ = grpo_token_loss(logp, logp.detach(), ref, adv, seq, nseq, correct, **kw)
    wh, ww = torch.autograd.grad(want, (h, w))
    want = want.detach()
    loss, _, _, gh, gw = _gl._fused_linear_grpo_chunked(hidden, weight, y, None, ref, adv, seq, nseq, correct, chunk=20,
                                                        **kw)
    assert abs(float(loss) - float(want)) < 1e-12
    torch.testing.assert_close(gh, wh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, ww, rtol=1e-9, atol=1e-12)
    got, stats, _ = fused_linear_grpo_loss(h, w, y, None, ref, adv, seq, nseq, correct, chunk=20, **kw)
    assert abs(float(got.detach()) - float(want)) < 1e-12 and float(stats["ratio"]) == 1.0
    hc, wc = hidden.to(kdev).requires_grad_(), weight.to(kdev).requires_grad_()
    got, stats, _ = fused_linear_grpo_loss(hc, wc, y.to(kdev), None, ref.to(kdev), adv.to(kdev), seq.to(kdev), nseq,
                                           correct.to(kdev), chunk=20, **kw)
    gh2, gw2 = torch.autograd.grad(got, (hc, wc))
    assert abs(float(got.detach()) - float(want)) < 1e-10 and float(stats["ratio"]) == 1.0
    torch.testing.assert_close(gh2.cpu(), wh, rtol=1e-8, atol=1e-11)
    torch.testing.assert_close(gw2.cpu(), ww, rtol=1e-8, atol=1e-11)


def test_reference_path_on_policy_old_logp_none():
    """The CPU path (no kernel): old_logp=None is old = logp DETACHED, so rho = 1 with the gradient of rho * A
    (an attached old would cancel it), and the returned logp is detached."""
    hidden, weight, y, old, ref, adv, seq, nseq, correct = _loss_case(97, 7, 111, 16, seed=9)
    kw = dict(eps_low=0.2, eps_high=0.28, beta=0.02, mu=0.1)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = torch.log_softmax(h @ w.t(), -1).gather(-1, y[:, None]).squeeze(-1)
    want, _ = grpo_token_loss(logp, logp.detach(), ref, adv, seq, nseq, correct, **kw)
    wh, ww = torch.autograd.grad(want, (h, w))
    got, stats, lp = fused_linear_grpo_loss(h, w, y, None, ref, adv, seq, nseq, correct, chunk=20, **kw)
    gh, gw = torch.autograd.grad(got, (h, w))
    assert not lp.requires_grad and float(stats["ratio"]) == 1.0
    assert abs(float(got.detach()) - float(want.detach())) < 1e-12
    torch.testing.assert_close(gh, wh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, ww, rtol=1e-9, atol=1e-12)


def test_kernel_path_checks_shapes_and_asks_only_for_needed_gradients(monkeypatch):
    """The kernel path (the `_C` entry points replaced by their recording PyTorch models, CPU): a frozen LM head
    costs no [V, H] weight gradient, a frozen hidden none for the hidden states: need_grad_hidden /
    need_grad_weight follow autograd in the fused loss and in linear_logprobs' backward. An old_logp of the wrong
    length is refused by name before the kernel runs."""
    from lightningrl_fast import _ext

    flags = []

    class Recorder(_gl._KernelModel):
        @staticmethod
        def fused_linear_grpo_loss(*args):
            flags.append(("fused", args[15], args[16]))
            return _gl._KernelModel.fused_linear_grpo_loss(*args)

        @staticmethod
        def linear_logprobs_backward(*args):
            flags.append(("backward", args[7], args[8]))
            return _gl._KernelModel.linear_logprobs_backward(*args)

    monkeypatch.setattr(_gl, "cuda_kernel", lambda name, *tensors: getattr(Recorder, name, None))
    monkeypatch.setattr(_ext, "ext", lambda: Recorder)
    hidden, weight, y, old, ref, adv, seq, nseq, correct = _loss_case(40, 4, 50, 8, seed=2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    for hh, ww in ((h, weight), (hidden, w), (h, w)):
        loss, _, _ = fused_linear_grpo_loss(hh, ww, y, old, ref, adv, seq, nseq, correct, chunk=16)
        loss.backward()
    for hh, ww in ((h, weight), (hidden, w)):
        linear_logprobs(hh, ww, y, chunk=16).sum().backward()
    assert flags == [("fused", True, False), ("fused", False, True), ("fused", True, True), ("backward", True, False),
                     ("backward", False, True)]
    with pytest.raises(ValueError, match=r"old_logp must have shape \[40\], got \[39\]"):
        fused_linear_grpo_loss(h, w, y, old[:39], ref, adv, seq, nseq, correct, chunk=16)


def _rel_err(x, ref):
    return float((x.detach().double() - ref).norm() / ref.norm().clamp_min(1e-30))


def test_fused_algorithm_model_bf16_error_within_2x_of_pytorch():
    """In bf16 the model of the kernel is as accurate as the same-dtype PyTorch computation (CPU)."""
    hidden, weight, y, old, ref, adv, seq, nseq, correct = _loss_case(123, 9, 111, 64, seed=3)
    kw = dict(eps_low=0.2, eps_high=0.28, beta=0.01, mu=0.1)
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want, _ = _dense_loss(h64, w64, y, old, ref, adv, seq, nseq, correct, **kw)
    wh, ww = torch.autograd.grad(want, (h64, w64))
    hb, wb = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    torch_loss, _ = _dense_loss(hb, wb, y, old.float(), ref.float(), adv.float(), seq, nseq, correct, **kw)
    th, tw = torch.autograd.grad(torch_loss, (hb, wb))
    want, torch_loss = want.detach(), torch_loss.detach()
    loss, _, _, gh, gw = _gl._fused_linear_grpo_chunked(hidden.bfloat16(), weight.bfloat16(), y, old.float(),
                                                        ref.float(), adv.float(), seq, nseq, correct, chunk=50, **kw)
    assert abs(float(loss) - float(want)) <= 2 * abs(float(torch_loss) - float(want)) + 1e-6
    assert _rel_err(gh, wh) <= 2 * _rel_err(th, wh) + 1e-6
    assert _rel_err(gw, ww) <= 2 * _rel_err(tw, ww) + 1e-6


def test_group_normalize_equal_values_give_exact_zero():
    # 0.1 three times: the plain mean is not exactly 0.1, the shifted mean is, so z is exactly 0 (not +-1 noise)
    r = torch.tensor([[0.1, 1.0], [0.1, 0.0], [0.1, 1.0], [0.3, 0.0]], dtype=torch.float64)
    adv = group_normalize(r, torch.tensor([5, 5, 5, -2]), torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert torch.equal(adv, torch.zeros(4, dtype=torch.float64))


# ---- CUDA kernels (GPU) -------------------------------------------------------------------------------------------

def _kernels_or_skip(name):
    from conftest import skip_or_fail

    from lightningrl_fast import _ext

    if not (_ext.has_cuda_kernels() and hasattr(_ext.ext(), name)):
        skip_or_fail(f"lightningrl_fast._C has no CUDA kernel {name}")  # a lost kernel fails CI's CUDA build
    return getattr(_ext.ext(), name)


def _gn_inputs(s, gsize, nr, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    acc = (torch.rand(s, generator=g) < 0.5).double()
    cols = [acc] + [torch.rand(s, generator=g, dtype=torch.float64) * 8 for _ in range(nr - 1)]
    rewards = torch.stack(cols, 1)
    ngroups = (s + gsize - 1) // gsize
    keys = torch.randint(-2 ** 62, 2 ** 62, (ngroups,), generator=g)  # arbitrary int64 ids
    groups = keys[(torch.arange(s) // gsize)[torch.randperm(s, generator=g)]]
    weights = torch.rand(nr, generator=g, dtype=torch.float64) + 0.5
    return rewards.to(dtype), groups, weights.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decoupled", "sum"])
@pytest.mark.parametrize("s,gsize,nr", [(1, 1, 1), (7, 3, 2), (97, 1, 2), (123, 8, 3), (1000, 16, 2), (5000, 40, 2),
                                        (3000, 3000, 2), (4099, 64, 1)])
def test_group_normalize_kernel_matches_reference(mode, s, gsize, nr):
    _kernels_or_skip("group_normalize")
    rewards, groups, weights = _gn_inputs(s, gsize, nr, seed=s + gsize)
    want = _gl.group_normalize_reference(rewards, groups, weights, mode)
    got = group_normalize(rewards.cuda(), groups.cuda(), weights.cuda(), mode)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-10)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        r = rewards.to(dt)  # bf16: the rewards are rounded first; the kernel computes in double from there
        want_dt = _gl.group_normalize_reference(r.double(), groups, weights.to(dt).double(), mode)
        got_dt = group_normalize(r.cuda(), groups.cuda(), weights.to(dt).cuda(), mode)
        assert got_dt.dtype == torch.float32
        torch.testing.assert_close(got_dt.cpu().double(), want_dt, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_group_normalize_past_the_kernel_limit_takes_the_reference(monkeypatch):
    """More samples than the kernel's int32 table holds (2^29; the limit lowered to 100 here) run the reference
    on the device instead of reaching the launcher's check: equal results, no error."""
    _kernels_or_skip("group_normalize")
    monkeypatch.setattr(_gl, "GROUP_NORMALIZE_KERNEL_MAX_SAMPLES", 100)
    rewards, groups, weights = _gn_inputs(123, 8, 2, seed=3)
    want = _gl.group_normalize_reference(rewards, groups, weights, "decoupled")
    real, ran = _gl.group_normalize_reference, []
    monkeypatch.setattr(_gl, "group_normalize_reference", lambda *a: ran.append(a[0].shape[0]) or real(*a))
    got = group_normalize(rewards.cuda(), groups.cuda(), weights.cuda())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)
    assert ran == [123]  # the reference ran, on the device
    group_normalize(rewards[:99].cuda(), groups[:99].cuda(), weights.cuda())
    assert ran == [123] and got.is_cuda  # 99 samples, below the limit: the kernel


@pytest.mark.gpu
def test_group_normalize_kernel_deterministic_and_graph_capturable():
    _kernels_or_skip("group_normalize")
    rewards, groups, weights = _gn_inputs(6000, 48, 2, seed=1)
    r, gi, w = rewards.cuda(), groups.cuda(), weights.cuda()
    first = group_normalize(r, gi, w)
    for _ in range(3):
        assert torch.equal(group_normalize(r, gi, w), first)  # bitwise: fixed summation order
    # no host sync anywhere: the op can be captured in a CUDA graph
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        group_normalize(r, gi, w)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = group_normalize(r, gi, w)
    r.copy_(torch.flip(r, [0]))
    graph.replay()
    torch.testing.assert_close(out, group_normalize(r, gi, w), rtol=0, atol=0)
    # hand example and all-equal groups on the GPU
    adv = group_normalize(torch.ones(6, 2, device="cuda"), torch.tensor([9, 9, 9, 4, 4, 4], device="cuda"))
    assert torch.equal(adv.cpu(), torch.zeros(6))
    torch.library.opcheck(torch.ops.lightningrl_fast.group_normalize.default,
                          (torch.randn(12, 2, device="cuda"), torch.arange(12, device="cuda") // 4,
                           torch.ones(2, device="cuda"), "decoupled"))


def _cuda_case(case, dtype, H=32):
    T, V, adv_mode, cf, beta, mu, spread, red, sup = case
    args = _loss_case(T, 9, V, H, adv_mode=adv_mode, correct_frac=cf, spread=spread, seed=T + V)
    hidden, weight, y = args[0], args[1], args[2]
    if sup is not None:
        y = torch.where(y == sup, (sup + 1) % V, y)
    kw = dict(eps_low=0.2, eps_high=0.28, beta=beta, mu=mu, reduction=red)
    return hidden, weight, (y,) + args[3:], kw, sup


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"T{c[0]}-V{c[1]}-{c[2]}-c{c[3]}-b{c[4]}-m{c[5]}-{c[7]}-s{c[8]}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_kernel_matches_float64_reference(case, dtype, kdev):
    hidden, weight, rest, kw, sup = _cuda_case(case, torch.float64)
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want, want_logp = _dense_loss(h64, w64, *rest, suppress=sup, **kw)
    wh, ww = torch.autograd.grad(want, (h64, w64))
    dev_rest = tuple(x.to(kdev) if isinstance(x, torch.Tensor) else x for x in rest)
    # the same-dtype PyTorch computation (materialized logits, autograd) on the GPU: the error budget
    hp, wp = hidden.to(dtype).to(kdev).requires_grad_(), weight.to(dtype).to(kdev).requires_grad_()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    rest_acc = tuple(x.to(acc) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in dev_rest)
    torch_loss, _ = _dense_loss(hp, wp, *rest_acc, suppress=sup, **kw)
    th, tw = torch.autograd.grad(torch_loss, (hp, wp))
    want, torch_loss = want.detach(), torch_loss.detach()
    hk, wk = hidden.to(dtype).to(kdev).requires_grad_(), weight.to(dtype).to(kdev).requires_grad_()
    loss, stats, logp = fused_linear_grpo_loss(hk, wk, *dev_rest, chunk=32, suppress_token=sup, with_entropy=True,
                                               **kw)
    gh, gw = torch.autograd.grad(loss, (hk, wk))
    loss = loss.detach()
    if dtype == torch.float64:
        assert abs(float(loss) - float(want)) < 1e-10
        torch.testing.assert_close(logp.cpu(), want_logp.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(gh.cpu(), wh, rtol=1e-8, atol=1e-11)
        torch.testing.assert_close(gw.cpu(), ww, rtol=1e-8, atol=1e-11)
    else:  # the scalar loss's error is noisy (cancellations): its floor is wider than the gradients'
        floor, loss_floor = (1e-6, 1e-5) if dtype == torch.float32 else (1e-4, 5e-3)
        assert abs(float(loss) - float(want)) <= 2 * abs(float(torch_loss) - float(want)) + loss_floor
        assert _rel_err(gh.cpu(), wh) <= 2 * _rel_err(th.cpu(), wh) + floor
        assert _rel_err(gw.cpu(), ww) <= 2 * _rel_err(tw.cpu(), ww) + floor
    assert set(stats) >= {"policy", "kl", "nll", "clip_frac", "ratio", "entropy"}
    assert 0.0 <= float(stats["clip_frac"]) <= 1.0


def test_fused_kernel_grad_scaling_frozen_head_no_grad_and_microbatches(kdev):
    hidden, weight, rest, kw, _ = _cuda_case(FUSED_CASES[0], torch.float64)
    hidden, weight = hidden.to(kdev), weight.to(kdev)
    y, old, ref, adv, seq, nseq, correct = (x.to(kdev) if isinstance(x, torch.Tensor) else x for x in rest)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _, logp = fused_linear_grpo_loss(h, w, y, old, ref, adv, seq, nseq, correct, chunk=16, **kw)
    gh, gw = torch.autograd.grad(loss, (h, w))
    loss2, _, _ = fused_linear_grpo_loss(h, w, y, old, ref, adv, seq, nseq, correct, chunk=16, **kw)
    gh3, gw3 = torch.autograd.grad(-3.0 * loss2, (h, w))  # grad_output scales the kept gradients
    torch.testing.assert_close(gh3, -3.0 * gh)
    torch.testing.assert_close(gw3, -3.0 * gw)
    loss4, _, _ = fused_linear_grpo_loss(h, weight, y, old, ref, adv, seq, nseq, correct, chunk=16, **kw)
    (gh4,) = torch.autograd.grad(loss4, (h,))  # frozen head: no weight gradient computed
    torch.testing.assert_close(gh4, gh)
    with torch.no_grad():
        loss5, _, logp5 = fused_linear_grpo_loss(h, w, y, old, ref, adv, seq, nseq, correct, chunk=16, **kw)
    assert float(loss5) == float(loss.detach()) and torch.equal(logp5, logp)
    # micro-batches of whole sequences with the batch totals: losses and gradients add up
    present = torch.unique(seq)
    totals = (len(present), y.numel(), int(correct[present].sum()), int(correct[seq].sum()))
    total_loss, agh, agw = 0.0, torch.zeros_like(gh), torch.zeros_like(gw)
    for lo, hi in [(0, 3), (4, 4), (5, nseq - 1)]:
        sel = ((seq >= lo) & (seq <= hi)).nonzero().squeeze(1)
        hs = h.detach()[sel].clone().requires_grad_()
        part, _, _ = fused_linear_grpo_loss(hs, w, y[sel], old[sel], ref[sel], adv[sel], seq[sel], nseq, correct,
                                            chunk=16, totals=totals, **kw)
        ph, pw = torch.autograd.grad(part, (hs, w))
        total_loss += float(part.detach())
        agh[sel] += ph
        agw += pw
    assert abs(total_loss - float(loss.detach())) < 1e-10
    torch.testing.assert_close(agh, gh)
    torch.testing.assert_close(agw, gw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,V,sup", [(97, 111, None), (123, 111, 5), (300, 1024, 1023)])
def test_linear_logprobs_kernel_forward_backward(dtype, T, V, sup, kdev):
    g = torch.Generator().manual_seed(T)
    hidden = torch.randn(T, 48, generator=g, dtype=torch.float64) / 48 ** 0.25
    weight = torch.randn(V, 48, generator=g, dtype=torch.float64) / 48 ** 0.25
    y = torch.randint(0, V, (T,), generator=g)
    if sup is not None:
        y = torch.where(y == sup, 0, y)
    gout = torch.randn(T, generator=g, dtype=torch.float64)
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (h64 @ w64.t())
    if sup is not None:
        logits = logits.index_fill(1, torch.tensor([sup]), float("-inf"))
    want = torch.log_softmax(logits, -1).gather(-1, y[:, None]).squeeze(-1)
    wh, ww = torch.autograd.grad((want * gout).sum(), (h64, w64))
    hk, wk = hidden.to(dtype).to(kdev).requires_grad_(), weight.to(dtype).to(kdev).requires_grad_()
    got = linear_logprobs(hk, wk, y.to(kdev), chunk=40, suppress_token=sup)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    gh, gw = torch.autograd.grad((got * gout.to(got.dtype).to(kdev)).sum(), (hk, wk))
    hp, wp = hidden.to(dtype).to(kdev).requires_grad_(), weight.to(dtype).to(kdev).requires_grad_()
    with torch.no_grad():  # the forward-only entry: the same kernel, the same numbers
        nograd = linear_logprobs(hk, wk, y.to(kdev), chunk=40, suppress_token=sup)
    assert torch.equal(nograd, got.detach())
    if dtype == torch.float64:
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(gh.cpu(), wh, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(gw.cpu(), ww, rtol=1e-9, atol=1e-11)
    else:  # the same-dtype PyTorch computation on the GPU: the error budget
        lg = (hp @ wp.t()).float()
        if sup is not None:
            lg = lg.index_fill(1, torch.tensor([sup], device=kdev), float("-inf"))
        tl = torch.log_softmax(lg, -1).gather(-1, y.to(kdev)[:, None]).squeeze(-1)
        th, tw = torch.autograd.grad((tl * gout.float().to(kdev)).sum(), (hp, wp))
        floor = 1e-6 if dtype == torch.float32 else 1e-4
        assert _rel_err(got.cpu(), want.detach()) <= 2 * _rel_err(tl.detach().cpu(), want.detach()) + floor
        assert _rel_err(gh.cpu(), wh) <= 2 * _rel_err(th.cpu(), wh) + floor
        assert _rel_err(gw.cpu(), ww) <= 2 * _rel_err(tw.cpu(), ww) + floor


def _extra_peak(fn) -> int:
    fn()  # warm-up: cuBLAS workspaces and the like are allocated once, outside the measurement
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    torch.cuda.empty_cache()
    return peak


@pytest.mark.gpu
@pytest.mark.slow
def test_fused_kernel_peak_memory_16k_tokens_qwen_vocab():
    """16k tokens x vocab 151936 x hidden 4096 (bf16): extra peak memory (over the inputs) of loss + backward.

    Kernel: one [chunk, V] bf16 buffer + the two gradients (~0.3 + 1.3 GiB at chunk 1024). The reference for the
    1/8 bound is the PyTorch computation of the same loss from materialized [T, V] logits (~30 GiB). Against the
    chunked PyTorch path of the op (checkpointed chunks of the same size), the scratch memory (extra peak minus
    the gradients both return) must be under 1/4 of the reference's (estimated ~0.3 vs ~2.7 GiB).
    """
    _kernels_or_skip("fused_linear_grpo_loss")
    T, V, H = 16384, 151936, 4096
    free, _ = torch.cuda.mem_get_info()
    dense_need = T * V * (2 + 4 + 4 + 4) + 4 * V * H * 2 + 4 * T * H * 2  # logits bf16 + fp32 copies + grads
    if free < dense_need * 1.1:
        pytest.skip(f"needs ~{dense_need / 2**30:.0f} GiB free GPU memory, {free / 2**30:.0f} GiB free")
    dev = "cuda"
    hidden = (torch.randn(T, H, device=dev) / 8).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, device=dev) / 64).bfloat16().requires_grad_()
    y = torch.randint(0, V, (T,), device=dev)
    nseq = 64
    seq = torch.sort(torch.randint(0, nseq, (T,), device=dev)).values
    old = torch.full((T,), -12.0, device=dev)
    ref = old.clone()
    adv = torch.randn(nseq, device=dev)[seq]
    correct = torch.rand(nseq, device=dev) < 0.5
    args = (y, old, ref, adv, seq, nseq, correct)
    grad_bytes = hidden.numel() * 2 + weight.numel() * 2

    def run(fn):
        def go():
            loss = fn()
            return torch.autograd.grad(loss, (hidden, weight))
        return _extra_peak(go)

    kernel = run(lambda: fused_linear_grpo_loss(hidden, weight, *args, chunk=1024)[0])
    dense = run(lambda: _dense_loss(hidden, weight, *args)[0])
    saved = _gl.cuda_kernel
    _gl.cuda_kernel = lambda *a, **k: None  # the chunked PyTorch reference op on the same GPU
    try:
        chunked = run(lambda: fused_linear_grpo_loss(hidden, weight, *args, chunk=1024)[0])
    finally:
        _gl.cuda_kernel = saved
    print(f"extra peak GiB: kernel {kernel / 2**30:.2f}, dense {dense / 2**30:.2f}, chunked reference "
          f"{chunked / 2**30:.2f}; gradients {grad_bytes / 2**30:.2f}")
    assert kernel < dense / 8
    assert kernel - grad_bytes < (chunked - grad_bytes) / 4


@pytest.mark.gpu
@pytest.mark.parametrize("case", fuzz_cases(100))
def test_gpu_random_config(cuda_ext_with, monkeypatch, case):
    """test_grpo_loss_emu_random.py's random configurations of the LM-head row kernel and group_normalize on the
    CUDA kernels, checked as there (_check_random_config: float64 oracles, within 2x the same-dtype PyTorch
    error). The row kernel runs in `_C`'s real chunk loop (linear_logprobs / linear_logprobs_backward /
    fused_linear_grpo_loss, every mode, entropy on / off, write_grad on / off, grad_hidden asked or not) on
    hidden states and a head that make the cuBLAS GEMM give the drawn logits exactly (_LmHeadThroughGemm; its
    gradient read back exactly from grad_W), with the GPU sizes of the draws: vocabularies up to 160000 (151936
    and around it among them), up to 100 rows, random chunk sizes (1 .. 1024) and hidden sizes. group_normalize
    runs through the public op (S up to 60000). Not drawn here, as the emulator draws them: a misaligned logits
    buffer (the launcher's chunk buffer is its own), schedule seeds, -inf logits (through the GEMM they would be
    NaN; a logit 200 below its row's max stands in), GRPO targets at the suppressed id (their NaN gradient row
    would spread through grad_W's GEMM). Without a GPU test_grpo_loss_emu_random.py's
    test_gpu_random_config_code_on_the_emulator runs this code on the emulated row kernel."""
    C = cuda_ext_with("linear_logprobs", "linear_logprobs_backward", "fused_linear_grpo_loss", "group_normalize")
    # exact one-hot GEMMs (no TF32) and fp32 accumulation in the grad_hidden bound
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)

    def run_group_normalize(rewards, ids, weights, c):
        got = group_normalize(rewards.cuda(), ids.cuda(), weights.to(c["weight_dtype"]).cuda(), c["mode"])
        assert got.is_cuda
        return got.cpu()

    _check_random_config(case, lambda c: _LmHeadThroughGemm(C, "cuda", c), run_group_normalize, gpu=True)


def test_extension_entry_points_check_their_inputs():
    """The launchers' TORCH_CHECKs (runs wherever _C is a CUDA build, GPU or not: CPU tensors are refused first)."""
    from lightningrl_fast import _ext

    C = _ext.ext()
    if C is None or not C.has_cuda():
        pytest.skip("lightningrl_fast._C is not a CUDA build")
    h, w, y = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long)
    v = torch.zeros(4)
    with pytest.raises(RuntimeError, match="hidden must be a CUDA tensor"):
        C.fused_linear_grpo_loss(h, w, y, v, None, v, v, None, None, 0.2, 0.2, 0.0, 0.0, -1, 1024, True, True, False)
    with pytest.raises(RuntimeError, match="hidden must be a CUDA tensor"):
        C.linear_logprobs(h, w, y, suppress_token=-1, chunk=1024, with_entropy=False)
    with pytest.raises(RuntimeError, match="hidden must be a CUDA tensor"):
        C.linear_logprobs_backward(h, w, y, v, v, -1, 1024, True, True)
    with pytest.raises(RuntimeError, match="rewards must be a CUDA tensor"):
        C.group_normalize(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), torch.ones(2), True)
