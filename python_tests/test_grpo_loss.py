"""group_normalize and the GRPO loss: references vs naive per-element loops, hand examples, chunked LM head."""

import math

import pytest
import torch

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


def test_token_loss_errors():
    t = torch.zeros(4)
    seq = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="ref_logp is required"):
        grpo_token_loss(t, t, None, t, seq, 1, torch.ones(1, dtype=torch.bool), beta=0.1)
    with pytest.raises(ValueError, match="reduction must be"):
        grpo_token_loss(t, t, t, t, seq, 1, torch.ones(1, dtype=torch.bool), reduction="seq-tok")
    with pytest.raises(ValueError, match=r"seq_idx values must lie in \[0, 1\)"):
        grpo_token_loss(t, t, t, t, seq + 1, 1, torch.ones(1, dtype=torch.bool))


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
