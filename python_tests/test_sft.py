"""Tests of rl/sft.py: the block-diffusion SFT objective (the embedded default's warm-up and the RFT baseline).

The oracle computes each pair alone: its own [x_t ; x_0] of its own length under MaskLayout.block_proxy, the
cross-entropy of every masked token over the whole vocabulary, weighted by 1 / (its block's masking rate), summed
over the batch and divided by the batch's response tokens. sft_loss (packed micro-batches or padded rows, any
budget) must give the same loss and the same gradients in float64.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.ops.masked_attn import MaskLayout
from lightningrl_fast.rl.sft import collate, sft_loss, sft_masks, train_sft

MASK, PAD, V, BS = 110, 0, 111, 4


def tiny_model(dtype=torch.float64, seed=0):
    cfg = SDARConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=12, block_size=BS, mask_token_id=MASK, torch_dtype="float32",
                     max_position_embeddings=128)
    return build_model(cfg, dtype=dtype, seed=seed).init_weights(std=0.3, generator=torch.Generator().manual_seed(seed))


def ragged_pairs(seed=0):
    """Pairs of very different lengths: prompts 1..13 tokens, responses 1..23 (never the mask or pad id)."""
    rng = random.Random(seed)
    shapes = [(1, 1), (13, 23), (3, 4), (5, 1), (2, 17), (8, 8), (4, 3), (11, 2)]
    return [([rng.randrange(1, MASK) for _ in range(p)], [rng.randrange(1, MASK) for _ in range(r)]) for p, r in shapes]


def oracle_loss(model, ids, plens, lens, masked, p_tok):
    """Pair by pair (see the module docstring)."""
    total = 0.0
    for i in range(ids.shape[0]):
        n = -(-int(lens[i]) // BS) * BS
        x0 = ids[i, :n]
        xt = torch.where(masked[i, :n], MASK, x0)
        layout = MaskLayout.block_proxy(n, BS, torch.tensor([int(lens[i])]))
        hidden = model.hidden(torch.cat([xt, x0])[None], layout=layout)[0, :n]  # [n, H] the x_t half
        m = masked[i, :n]
        ce = F.cross_entropy(model.lm_head(hidden[m]), x0[m], reduction="none")
        total = total + (ce / p_tok[i, :n][m].double()).sum()
    resp = sum(int(lens[i]) - int(plens[i]) for i in range(ids.shape[0]))
    return total / resp


def test_masks_follow_the_objective():
    """Only response tokens are masked, at least one per response block; the rate is one U(eps, 1) per block."""
    pairs = ragged_pairs()
    ids, plens, lens = collate(pairs, BS, PAD)
    for seed in range(5):
        masked, p_tok, resp = sft_masks(plens, lens, ids.shape[1], BS, torch.Generator().manual_seed(seed), eps=0.05)
        assert not bool((masked & ~resp).any())
        blk_resp = resp.view(len(pairs), -1, BS).any(2)
        blk_masked = masked.view(len(pairs), -1, BS).any(2)
        assert torch.equal(blk_masked, blk_resp)
        p = p_tok.view(len(pairs), -1, BS)
        assert bool((p == p[..., :1]).all()) and float(p.min()) >= 0.05 and float(p.max()) <= 1.0
    # the fraction masked is what the rates imply: a block of rate p masks p of its tokens on average, plus one
    # forced token when none was drawn ((1 - p)^B of the time); 3200 blocks, tolerance ~4 standard deviations
    ids, plens, lens = collate([([1] * 4, [2] * 400)] * 32, BS, PAD)
    masked, p_tok, resp = sft_masks(plens, lens, ids.shape[1], BS, torch.Generator().manual_seed(0))
    p = p_tok[resp].view(-1, BS)[:, 0].double()  # [blocks]
    expect = float((p + (1 - p) ** BS / BS).mean())
    assert abs(float(masked.sum()) / float(resp.sum()) - expect) < 0.02


@pytest.mark.parametrize("pack", [True, False, None])
def test_loss_and_gradients_equal_the_pair_by_pair_oracle(pack):
    model = tiny_model()
    ids, plens, lens = collate(ragged_pairs(), BS, PAD)
    masked, p_tok, _ = sft_masks(plens, lens, ids.shape[1], BS, torch.Generator().manual_seed(3))
    want = oracle_loss(model, ids, plens, lens, masked, p_tok)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    for budget in (1, 30, 90, 10**6):  # one pair per forward (and the longest alone), a few, everything in one
        model.zero_grad(set_to_none=True)
        got = sft_loss(model, ids, plens, lens, torch.Generator().manual_seed(3), micro_batch_tokens=budget,
                       backward=True, pack=pack)
        assert not got.requires_grad
        assert float(got) == pytest.approx(float(want.detach()), rel=1e-6)  # returned as float32
        for p, g in zip(model.parameters(), want_grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-9, atol=1e-12)
    # without backward: a differentiable loss with the same gradients
    model.zero_grad(set_to_none=True)
    loss = sft_loss(model, ids, plens, lens, torch.Generator().manual_seed(3), micro_batch_tokens=90, pack=pack)
    assert loss.requires_grad
    loss.backward()
    for p, g in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-9, atol=1e-12)


def test_padding_ids_do_not_matter():
    """Positions past a pair's length are never attended nor read: another pad id gives the same loss."""
    model = tiny_model()
    pairs = ragged_pairs(1)
    losses = []
    for pad in (PAD, 57):
        ids, plens, lens = collate(pairs, BS, pad)
        for pack in (True, False):
            with torch.no_grad():
                losses.append(float(sft_loss(model, ids, plens, lens, torch.Generator().manual_seed(0), pack=pack)))
    assert max(losses) - min(losses) < 1e-9 * abs(losses[0])


def test_bad_inputs():
    model = tiny_model()
    with pytest.raises(ValueError, match="at least one"):
        collate([], BS, PAD)
    ids, plens, lens = collate(ragged_pairs(), BS, PAD)
    with pytest.raises(ValueError, match="multiple of the block size"):
        sft_loss(model, ids[:, :-1], plens, lens.clamp_max(ids.shape[1] - 1), torch.Generator())


def test_train_sft_lowers_the_loss():
    """A few steps on one fixed pair distribution: the loss goes down and the gradients are left cleared."""
    model = tiny_model(dtype=torch.float32)
    rng0 = random.Random(0)
    bank = [([rng0.randrange(1, 20) for _ in range(3)], [7, 8, 9, 10, 11, 12]) for _ in range(4)]
    losses = train_sft(model, lambda rng: rng.choice(bank), steps=40, batch_size=8, lr=3e-3, pad_id=PAD, warmup=2,
                       log=None, micro_batch_tokens=64)
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert all(p.grad is None for p in model.parameters())


def test_train_sft_with_the_optimizer_state_offloaded_is_the_same_run():
    """`optimizer_offload` (the RFT baseline's fine-tune with --optimizer-offload): bf16 weights, fp32 state in
    host memory, the same losses and weights bit for bit as with the state resident."""
    rng0 = random.Random(0)
    bank = [([rng0.randrange(1, 20) for _ in range(3)], [7, 8, 9, 10, 11, 12]) for _ in range(4)]
    runs = []
    for offload in (False, True):
        model = tiny_model(dtype=torch.bfloat16)
        losses = train_sft(model, lambda rng: rng.choice(bank), steps=4, batch_size=4, lr=3e-3, pad_id=PAD, warmup=2,
                           log=None, micro_batch_tokens=64, optimizer_offload=offload)
        runs.append((losses, {n: q.detach().clone() for n, q in model.named_parameters()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])
    assert any(not torch.equal(runs[0][1][n], q) for n, q in tiny_model(dtype=torch.bfloat16).named_parameters())


def test_collate_rounds_up_to_whole_blocks():
    """n is the longest pair rounded UP to whole blocks: a pair that fills its blocks exactly gets no extra block."""
    ids, plens, lens = collate([([1, 2], [3, 4]), ([5], [6])], BS, PAD)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, PAD, PAD]] and plens.tolist() == [2, 1] and lens.tolist() == [4, 2]
    assert collate([([1] * 5, [2] * 4)], BS, PAD)[0].shape == (1, 12)


def test_train_sft_schedule_and_optimizer(monkeypatch):
    """The warm-up recipe (not in the SFT cache key: a change needs run_setup.SFT_CACHE_VERSION bumped): AdamW, betas
    (0.9, 0.98), no weight decay, gradients clipped at norm 1.0, learning rate = lr * min(1, (s + 1) / warmup) *
    (0.1 + 0.9 * (1 + cos(pi * s / steps)) / 2) at step s (linear warm-up from lr / warmup, cosine decay to a
    10% floor). Values for steps 4, warmup 2 worked out by hand."""
    import lightningrl_fast.rl.sft as S

    seen, lrs, clips = {}, [], []
    real_make, real_clip = S.make_optimizer, torch.nn.utils.clip_grad_norm_

    def make(params, **kw):
        seen.update(kw)
        seen["opt"] = real_make(params, **kw)
        return seen["opt"]

    def clip(params, max_norm, *a, **k):  # called once per step, right before opt.step: the lr that step uses
        clips.append(max_norm)
        lrs.append(seen["opt"].param_groups[0]["lr"])
        return real_clip(params, max_norm, *a, **k)

    monkeypatch.setattr(S, "make_optimizer", make)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    model = tiny_model(dtype=torch.float32)
    bank = [([1, 2, 3], [7, 8, 9, 10])]
    train_sft(model, lambda rng: rng.choice(bank), steps=4, batch_size=2, lr=1e-3, pad_id=PAD, warmup=2, log=None)
    assert seen["lr"] == 1e-3 and seen["betas"] == (0.9, 0.98) and seen["weight_decay"] == 0.0
    assert clips == [1.0] * 4
    # s=0: 0.5 * 1; s=1: 0.1 + 0.45 * (1 + cos(pi/4)); s=2: 0.1 + 0.45; s=3: 0.1 + 0.45 * (1 - cos(pi/4))
    assert lrs == pytest.approx([1e-3 * f for f in (0.5, 0.8681981, 0.55, 0.2318019)], rel=1e-6)
    lrs.clear()
    train_sft(tiny_model(dtype=torch.float32), lambda rng: rng.choice(bank), steps=2, batch_size=2, lr=1e-3,
              pad_id=PAD, warmup=1, log=None)
    assert lrs == pytest.approx([1e-3, 0.55e-3], rel=1e-6)  # warmup 1 = no warm-up: the first step at the peak


def test_train_sft_time_budget_and_log_cadence(monkeypatch):
    """The budget is checked after each step against the seconds since the start (a fake clock: 1 s per step);
    a log line every `log_every` steps, after the step it names."""
    import time as time_mod

    clock = iter(range(10**6))
    monkeypatch.setattr(time_mod, "perf_counter", lambda: float(next(clock)))
    lines = []
    bank = [([1, 2, 3], [7, 8, 9, 10])]
    losses = train_sft(tiny_model(dtype=torch.float32), lambda rng: rng.choice(bank), steps=10, batch_size=2,
                       lr=1e-3, pad_id=PAD, warmup=1, log=lines.append, log_every=2, time_budget_s=4.5)
    # t0 = 0; step 1's budget check reads 1, step 2's log line 2 and its check 3, step 3's check 4, step 4's
    # log line 5 and its check 6 > 4.5: four steps
    assert len(losses) == 4
    assert [l.split(" loss")[0] for l in lines] == ["sft step 2/10", "sft step 4/10"]


@pytest.mark.gpu
@pytest.mark.timeout(400)  # compiles FlexAttention (forward, or forward + backward) per shape: minutes
@pytest.mark.parametrize("pack", [True, False])
def test_gpu_sft_matches_the_cpu(pack):
    """On CUDA (packed rows rounded to packed_length and FlexAttention over the token tables, or padded rows under
    the block-proxy mask) the loss and gradients of a float32 copy match the float64 CPU ones."""
    import copy

    model = tiny_model()
    ids, plens, lens = collate(ragged_pairs(2), BS, PAD)
    cpu = sft_loss(model, ids, plens, lens, torch.Generator().manual_seed(5), micro_batch_tokens=60, backward=True,
                   pack=pack)
    gpu_model = copy.deepcopy(model).float().cuda()
    gpu_model.zero_grad(set_to_none=True)
    gpu = sft_loss(gpu_model, ids, plens, lens, torch.Generator().manual_seed(5), micro_batch_tokens=60,
                   backward=True, pack=pack)
    assert gpu.device.type == "cuda" and float(gpu) == pytest.approx(float(cpu), rel=1e-4)
    for (name, a), b in zip(model.named_parameters(), gpu_model.parameters()):
        err = (b.grad.double().cpu() - a.grad).abs().max().item()
        assert err <= 1e-3 * max(1.0, a.grad.abs().max().item()), (name, err)
