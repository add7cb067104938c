"""ops.threshold_unmask: reference vs a naive per-position loop, Philox known answers, sampling statistics."""

import math

import pytest
import torch

from lightningrl_fast.ops.unmask import philox_uniform, threshold_unmask, threshold_unmask_reference


def philox_py(seed, offset, ctr):
    """Independent pure-Python Philox4x32-10 (first output word)."""
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    c = [ctr & 0xFFFFFFFF, ctr >> 32, offset & 0xFFFFFFFF, offset >> 32]
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c[0]


def test_philox_known_answer_and_torch_port():
    assert philox_py(0, 0, 0) == 0x6627E8D5  # Random123 known-answer vector, ctr = key = 0
    ctr = torch.tensor([0, 1, 2**31 + 5, 2**40 + 3])
    got = philox_uniform(torch.tensor([2**33 + 77]), torch.tensor([2**35 + 9]), ctr)
    want = [((philox_py(2**33 + 77, 2**35 + 9, int(c)) >> 9) + 0.5) * 2**-23 for c in ctr]
    assert got.tolist() == want


def make_state(b, s, vocab, seed, frac_masked=0.7, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, s, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
    masked = torch.rand(b, s, generator=g) < frac_masked
    tokens = torch.where(masked, torch.full((b, s), -5), torch.randint(0, vocab, (b, s), generator=g))
    step_map = torch.where(masked, torch.full((b, s), -7), torch.randint(-1, 3, (b, s), generator=g)).int()
    logp = torch.full((b, s), 123.0)
    conf = torch.full((b, s), -9.0)
    return logits, tokens, masked, step_map, logp, conf


def naive_step(logits, tokens, masked, step_map, logp, conf, step, quota, eos, seed, offset, tau, temp, greedy):
    b, s, vocab = logits.shape
    tokens, masked, step_map, logp, conf = (x.clone() for x in (tokens, masked, step_map, logp, conf))
    done, eos_seen = [], []
    for r in range(b):
        cand = {}
        for i in range(s):
            if not masked[r, i]:
                continue
            row = [float(x) / (temp if temp > 0 else 1.0) for x in logits[r, i].double()]
            if greedy:
                pick = max(range(vocab), key=lambda t: (row[t], -t))
            else:
                def score(t):
                    u = ((philox_py(seed, offset, (r * s + i) * vocab + t) >> 9) + 0.5) * 2**-23
                    return row[t] - math.log(-math.log(u))
                pick = max(range(vocab), key=score)
            m = max(row)
            lse = m + math.log(sum(math.exp(x - m) for x in row))
            cand[i] = (pick, row[pick] - lse)
        order = sorted(cand, key=lambda i: (-math.exp(cand[i][1]), i))
        chosen = set(order[: int(quota[r])]) if quota[r] > 0 else set()
        if quota[r] > 0:
            chosen |= {i for i in cand if math.exp(cand[i][1]) >= tau}
        for i in chosen:
            tokens[r, i], logp[r, i], conf[r, i] = cand[i][0], cand[i][1], math.exp(cand[i][1])
            step_map[r, i], masked[r, i] = int(step[r]), False
        done.append(not bool(masked[r].any()))
        eos_seen.append(any(int(tokens[r, i]) in eos and step_map[r, i] >= 0 and not masked[r, i] for i in range(s)))
    return tokens, masked, step_map, logp, conf, torch.tensor(done), torch.tensor(eos_seen)


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("b,s,vocab,tau,temp", [(3, 4, 111, 0.3, 1.0), (2, 8, 97, 0.9, 0.7), (1, 1, 5, 1.0, 1.0),
                                                 (4, 5, 23, 0.0, 1.3)])
def test_reference_matches_naive(greedy, b, s, vocab, tau, temp):
    state = make_state(b, s, vocab, seed=vocab + s)
    step = torch.arange(b, dtype=torch.int32) + 2
    quota = torch.tensor([1, 2, 0, 3][:b], dtype=torch.int32)
    eos = [3, 7]
    seed, offset = 2**34 + 11, 5
    want = naive_step(*state, step, quota, eos, seed, offset, tau, temp, greedy)
    got_state = [x.clone() for x in state]
    done, eos_seen = threshold_unmask(*got_state, step, quota, torch.tensor(eos), torch.tensor([seed]),
                                      torch.tensor([offset]), threshold=tau, temperature=temp, greedy=greedy)
    names = ["tokens", "masked", "step_map", "logp", "conf"]
    for name, g, w in zip(names, got_state[1:], want[:5]):
        if g.dtype.is_floating_point:
            torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(g, w), name
    assert torch.equal(done, want[5]) and torch.equal(eos_seen, want[6])


def test_untouched_positions_and_edge_cases():
    logits, tokens, masked, step_map, logp, conf = make_state(2, 6, 111, seed=1)
    keep = ~masked
    before = [x.clone() for x in (tokens, step_map, logp, conf)]
    args = (torch.tensor([1, 1], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32), torch.tensor([0]),
            torch.tensor([1]), torch.tensor([0]))
    threshold_unmask(logits, tokens, masked, step_map, logp, conf, *args, threshold=0.0, greedy=True)
    for old, new in zip(before, (tokens, step_map, logp, conf)):
        assert torch.equal(new[keep], old[keep])
    assert not masked.any()  # tau 0 unmasks everything in one step
    # nothing masked: a no-op
    snap = [x.clone() for x in (tokens, masked, step_map, logp, conf)]
    done, _ = threshold_unmask(logits, tokens, masked, step_map, logp, conf, *args, threshold=0.5)
    assert done.all() and all(torch.equal(a, b) for a, b in zip(snap, (tokens, masked, step_map, logp, conf)))


def test_tau_one_unmasks_exactly_one_and_special_logits():
    b, s, vocab = 2, 4, 111
    logits = torch.zeros(b, s, vocab)  # all-equal logits: ties go to the lowest id, conf = 1/V
    logits[1, :, 50:] = float("-inf")
    masked = torch.ones(b, s, dtype=torch.bool)
    tokens = torch.zeros(b, s, dtype=torch.long)
    step_map = torch.full((b, s), -1, dtype=torch.int32)
    logp, conf = torch.zeros(b, s), torch.zeros(b, s)
    ones = torch.ones(b, dtype=torch.int32)
    threshold_unmask(logits, tokens, masked, step_map, logp, conf, ones, ones, torch.tensor([0]), torch.tensor([0]),
                     torch.tensor([0]), threshold=1.0, greedy=True)
    assert masked.sum(1).tolist() == [3, 3]
    assert tokens[:, 0].tolist() == [0, 0]
    torch.testing.assert_close(conf[:, 0], torch.tensor([1 / 111, 1 / 50]))


def test_sampling_matches_softmax_statistically():
    vocab, n = 7, 4000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5])
    probs = torch.softmax(logits / 0.8, 0)
    counts = torch.zeros(vocab)
    for off in range(n // 100):
        b = 100
        tokens = torch.zeros(b, 1, dtype=torch.long)
        masked = torch.ones(b, 1, dtype=torch.bool)
        sm = torch.zeros(b, 1, dtype=torch.int32)
        lp, cf = torch.zeros(b, 1), torch.zeros(b, 1)
        ones = torch.ones(b, dtype=torch.int32)
        threshold_unmask(logits.expand(b, 1, vocab).contiguous(), tokens, masked, sm, lp, cf, ones, ones,
                         torch.tensor([0]), torch.tensor([42]), torch.tensor([off]), temperature=0.8)
        counts += torch.bincount(tokens.view(-1), minlength=vocab)
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum().item()
    assert chi2 < 22.5, chi2  # 6 degrees of freedom, p = 0.001


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0]).expand(200, 1, 5).contiguous()
    for kw, allowed in [({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1})]:
        tokens = torch.zeros(200, 1, dtype=torch.long)
        masked = torch.ones(200, 1, dtype=torch.bool)
        cf = torch.zeros(200, 1)
        ones = torch.ones(200, dtype=torch.int32)
        threshold_unmask(logits, tokens, masked, torch.zeros(200, 1, dtype=torch.int32), torch.zeros(200, 1), cf, ones,
                         ones, torch.tensor([0]), torch.tensor([3]), torch.tensor([0]), **kw)
        assert set(tokens.view(-1).tolist()) == allowed
        # confidence stays the untruncated probability
        torch.testing.assert_close(cf[tokens == 0], torch.softmax(logits[0, 0], 0)[0].expand(int((tokens == 0).sum())))


def test_determinism_and_opcheck():
    state = make_state(2, 4, 33, seed=9)
    step = torch.ones(2, dtype=torch.int32)
    a = [x.clone() for x in state]
    b = [x.clone() for x in state]
    extra = (step, step, torch.tensor([1]), torch.tensor([7]), torch.tensor([3]))
    threshold_unmask(*a, *extra)
    threshold_unmask(*b, *extra)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    torch.library.opcheck(torch.ops.lightningrl_fast.threshold_unmask.default,
                          (*[x.clone() for x in state], *extra, 0.9, 1.0, 0, 1.0, False))


def test_bad_inputs():
    state = make_state(2, 4, 33, seed=9)
    step = torch.ones(2, dtype=torch.int32)
    extra = (step, step, torch.tensor([1]), torch.tensor([7]), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"tokens must have shape \[2, 4\]"):
        threshold_unmask(state[0], state[1][:, :3], *state[2:], *extra)
    with pytest.raises(TypeError, match="masked must have dtype"):
        threshold_unmask(state[0], state[1], state[2].int(), *state[3:], *extra)
    with pytest.raises(ValueError, match="top_p must be in"):
        threshold_unmask(*state, *extra, top_p=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [111, 151936])
def test_gpu_greedy_matches_reference(dtype, vocab):
    state = [x.cuda() for x in make_state(4, 32, vocab, seed=3, dtype=dtype)]
    step = torch.full((4,), 5, dtype=torch.int32, device="cuda")
    quota = torch.tensor([1, 2, 0, 4], dtype=torch.int32, device="cuda")
    extra = (step, quota, torch.tensor([3, 7], device="cuda"), torch.tensor([1], device="cuda"),
             torch.tensor([2], device="cuda"))
    ref = [x.clone() for x in state]
    want = threshold_unmask_reference(*ref, *extra, 0.9, 1.0, 0, 1.0, True)
    got_state = [x.clone() for x in state]
    got = threshold_unmask(*got_state, *extra, greedy=True)
    assert torch.equal(got_state[1], ref[1]) and torch.equal(got_state[2], ref[2]) and torch.equal(got_state[3], ref[3])
    torch.testing.assert_close(got_state[4], ref[4], rtol=1e-4, atol=1e-5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
