"""ops.threshold_unmask: reference vs a naive per-position loop, Philox known answers, sampling statistics; the
CUDA kernel on a GPU (marked `gpu`) against the reference. The kernel's device code on the CPU (the emulator):
test_unmask_emu.py, which shares this file's case builders; random configurations (emulator and GPU):
test_unmask_random.py."""

import math
import random

import pytest
import torch

from lightningrl_fast.ops.unmask import (
    kernel_supported,
    philox_uniform,
    pick_tokens_reference,
    threshold_unmask,
    threshold_unmask_reference,
)


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
                                      torch.tensor([offset]), threshold=tau, temperature=temp, greedy=greedy,
                                      noise="per_token")
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


def naive_two_level_pick(row, seed, offset, r, bucket=1024):
    """The two-level contract in plain Python (float64): bucket by Gumbel-max over the buckets' log-masses
    (counter 2^62 + r * n_buckets + j), then token by Gumbel-max inside it (counter r * V + t)."""
    vocab = len(row)
    nb = -(-vocab // bucket)

    def gumbel(ctr):
        return -math.log(-math.log(((philox_py(seed, offset, ctr) >> 9) + 0.5) * 2**-23))

    def mass(j):
        xs = row[j * bucket:(j + 1) * bucket]
        m = max(xs)
        return m + math.log(sum(math.exp(x - m) for x in xs)) if m > -math.inf else -math.inf

    j = max(range(nb), key=lambda j: (mass(j) + gumbel(2**62 + r * nb + j), -j))
    ts = range(j * bucket, min(vocab, (j + 1) * bucket))
    return max(ts, key=lambda t: (row[t] + gumbel(r * vocab + t), -t))


@pytest.mark.parametrize("vocab,temp", [(111, 1.0), (2500, 0.7), (3072, 1.3)])
def test_reference_two_level_matches_naive(vocab, temp):
    """The reference's two-level picks are the contract's (plain-Python Philox and float64 masses)."""
    b, s = 2, 3
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(b, s, vocab, generator=g, dtype=torch.float64) * 2
    if vocab > 2048:
        logits[0, 0, 1024:2048] = float("-inf")  # an empty bucket
    seed, offset = 2**34 + 11, 5
    tok, conf, logp = pick_tokens_reference(logits, torch.tensor([seed]), torch.tensor([offset]), temp, 0, 1.0,
                                            False, "two_level")
    for r in range(b * s):
        row = [float(x) / temp for x in logits.view(b * s, vocab)[r]]
        assert int(tok.view(-1)[r]) == naive_two_level_pick(row, seed, offset, r), r
    if vocab <= 1024:  # one bucket: the same per-token noise decides, as with noise="per_token"
        per_token = pick_tokens_reference(logits, torch.tensor([seed]), torch.tensor([offset]), temp, 0, 1.0, False,
                                          "per_token")[0]
        assert torch.equal(tok, per_token)
    # conf is the pick's untruncated probability, as in every mode
    want = torch.softmax(logits / temp, -1).gather(-1, tok[..., None]).squeeze(-1)
    torch.testing.assert_close(conf.double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("noise", ["two_level", "per_token"])
@pytest.mark.parametrize("top_k, top_p, greedy", [(0, 1.0, True), (0, 1.0, False), (7, 1.0, False),
                                                  (0, 0.8, False), (30, 0.9, False)])
def test_reference_slices_give_the_unsliced_picks(monkeypatch, noise, top_k, top_p, greedy):
    """pick_tokens_reference works on slices of whole sequences (bounded temporaries for the GPU fallback of
    truncated sampling): any slice size gives the one-slice picks, confidences and log-probs bit for bit (the
    noise counters are keyed by the flat row in the whole batch). 7 sequences x 5 positions x vocab 1111 (two
    buckets); slices of 1, 2, 3 and 7 sequences."""
    import lightningrl_fast.ops.unmask as U

    g = torch.Generator().manual_seed(17)
    logits = torch.randn(7, 5, 1111, generator=g) * 2.5
    logits[2, 1, 100:900] = float("-inf")
    args = (torch.tensor([2**33 + 5]), torch.tensor([41]), 0.8, top_k, top_p, greedy, noise)
    whole = pick_tokens_reference(logits, *args)
    # the same logits compact: rows in another order, every position's row through the map (logit_rows)
    perm = torch.randperm(35, generator=g)
    compact, rows = logits.reshape(35, 1111)[perm], torch.argsort(perm).view(7, 5)
    for per in (1, 2, 3, 7):
        monkeypatch.setattr(U, "PICK_SLICE_ELEMS", per * 5 * 1111 + 3)
        got = pick_tokens_reference(logits, *args)
        assert all(torch.equal(a, b) for a, b in zip(got, whole)), per
        got = pick_tokens_reference(compact, *args, logit_rows=rows)
        assert all(torch.equal(a, b) for a, b in zip(got, whole)), ("compact", per)


def bucket_chi2(noise, device="cpu", dtype=torch.float32):
    """3 buckets (vocab 3000): 8 heavy tokens across them (two on each side of a bucket edge) plus each
    bucket's bulk as one category; 20000 draws. Returns the chi-square statistic against softmax(logits / T)
    (10 degrees of freedom)."""
    vocab, n, b, temp = 3000, 20000, 1000, 0.9
    heavy = [5, 900, 1023, 1024, 1500, 2047, 2100, 2999]
    logits = torch.full((vocab,), -1.0)
    logits[heavy] = torch.tensor([4.0, 3.0, 5.0, 4.5, 2.0, 5.5, 3.5, 4.0])
    probs = torch.softmax(logits / temp, 0)
    cat = torch.full((vocab,), -1)
    cat[heavy] = torch.arange(8)
    for j in range(3):
        bulk = torch.zeros(vocab, dtype=torch.bool)
        bulk[j * 1024:(j + 1) * 1024] = True
        bulk[heavy] = False
        cat[bulk] = 8 + j
    want = torch.zeros(11).index_add_(0, cat, probs)
    counts = torch.zeros(11)
    dev = torch.device(device)
    rows = logits.to(device=dev, dtype=dtype).expand(b, 1, vocab).contiguous()
    ones = torch.ones(b, dtype=torch.int32, device=dev)
    for off in range(n // b):
        tokens = torch.zeros(b, 1, dtype=torch.long, device=dev)
        masked = torch.ones(b, 1, dtype=torch.bool, device=dev)
        zeros = torch.zeros(b, 1, device=dev)
        threshold_unmask(rows, tokens, masked, torch.zeros(b, 1, dtype=torch.int32, device=dev), zeros, zeros.clone(),
                         ones, ones, torch.tensor([0], device=dev), torch.tensor([42], device=dev),
                         torch.tensor([off], device=dev), temperature=temp, noise=noise)
        assert not masked.any()
        counts += torch.bincount(cat[tokens.view(-1).cpu()], minlength=11).float()
    return (((counts - n * want) ** 2) / (n * want)).sum().item()


@pytest.mark.parametrize("noise", ["two_level", "per_token"])
def test_sampling_over_buckets_matches_softmax_statistically(noise):
    chi2 = bucket_chi2(noise)
    assert chi2 < 29.6, chi2  # 10 degrees of freedom, p = 0.001


@pytest.mark.parametrize("noise", ["two_level", "per_token"])
def test_sampling_matches_softmax_statistically(noise):
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
                         torch.tensor([0]), torch.tensor([42]), torch.tensor([off]), temperature=0.8, noise=noise)
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


def _sample_once(logits, offset, **kw):
    """One threshold_unmask step on fully masked rows (quota 1, tau 2: exactly one position unmasked per row when
    S = 1). Returns (tokens, conf, logp)."""
    b, s, _ = logits.shape
    tokens = torch.zeros(b, s, dtype=torch.long)
    masked = torch.ones(b, s, dtype=torch.bool)
    logp, conf = torch.zeros(b, s), torch.zeros(b, s)
    ones = torch.ones(b, dtype=torch.int32)
    threshold_unmask(logits, tokens, masked, torch.zeros(b, s, dtype=torch.int32), logp, conf, ones, ones,
                     torch.tensor([0]), torch.tensor([11]), torch.tensor([offset]), threshold=2.0, **kw)
    assert not masked.any()
    return tokens, conf, logp


def nucleus(row, temperature, top_k, top_p):
    """The token ids a top-k-then-top-p sampler may draw, in plain float64 Python: the tempered softmax, its top_k
    most likely tokens renormalized, then the smallest prefix (most likely first) whose mass reaches top_p."""
    xs = [x / temperature for x in row]
    m = max(xs)
    w = [math.exp(x - m) for x in xs]
    order = sorted(range(len(row)), key=lambda t: -w[t])
    if top_k > 0:
        order = order[:top_k]
    total = sum(w[t] for t in order)
    keep, mass = set(), 0.0
    for t in order:
        if mass >= top_p:
            break
        keep.add(t)
        mass += w[t] / total
    return keep


@pytest.mark.parametrize("noise", ["two_level", "per_token"])
@pytest.mark.parametrize("temperature,top_k,top_p,want", [
    (0.5, 0, 0.9, {5, 17, 40}),  # T = 1 would keep 77 and 90 too: the nucleus is the tempered distribution's
    (2.0, 4, 0.7, {5, 17, 40}),  # top-k alone (and top-p alone at T = 2) would keep 77 too
    (2.0, 3, 0.5, {5, 17}),
    (1.3, 2, 1.0, {5, 17}),
])
def test_top_k_then_top_p_of_the_tempered_distribution(noise, temperature, top_k, top_p, want):
    """Sampling draws exactly from the nucleus of softmax(logits / T) after top-k (REFERENCE §2: temperature, then
    top-k / top-p); the confidence and log-prob are the pick's UNtruncated tempered probability (float64 oracle)."""
    vocab, n = 111, 600
    row = [-30.0] * vocab
    for t, x in zip([5, 17, 40, 77, 90, 109], [2.0, 1.6, 1.2, 0.8, 0.4, 0.0]):
        row[t] = x
    assert nucleus(row, temperature, top_k, top_p) == want  # the oracle agrees with the hand-written set
    logits = torch.tensor(row).expand(n, 1, vocab).contiguous()
    tokens, conf, logp = _sample_once(logits, 3, temperature=temperature, top_k=top_k, top_p=top_p, noise=noise)
    assert set(tokens.view(-1).tolist()) == want  # every kept token drawn (each has >= 12% of the nucleus)
    probs = torch.softmax(torch.tensor(row, dtype=torch.float64) / temperature, 0)
    torch.testing.assert_close(conf.view(-1).double(), probs[tokens.view(-1)], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logp.view(-1).double(), probs[tokens.view(-1)].log(), rtol=1e-5, atol=1e-6)


def test_top_p_at_an_exact_boundary_keeps_the_smallest_set_reaching_it():
    """Four equally likely tokens (probabilities exactly 1/4): top_p 0.5 keeps exactly two of them (the smallest set
    whose mass reaches top_p), top_p 0.5 + 1e-6 three. Checked on one row, over many offsets."""
    row = torch.full((1, 1, 13), float("-inf"))
    row[0, 0, [2, 5, 6, 11]] = 0.75
    for top_p, size in ((0.5, 2), (0.5 + 1e-6, 3), (0.25, 1), (1.0, 4)):
        seen = set()
        for off in range(60):
            seen |= set(_sample_once(row, off, top_p=top_p, temperature=1.0)[0].view(-1).tolist())
        assert len(seen) == size and seen <= {2, 5, 6, 11}, (top_p, seen)


@pytest.mark.parametrize("greedy", [True, False])
def test_threshold_is_inclusive_conf_exactly_one(greedy):
    """conf >= threshold unmasks (REFERENCE §2): positions whose row has one finite logit have conf exactly 1.0
    and all pass tau = 1.0 in one step; a row without such positions unmasks only its most confident one."""
    b, s, vocab = 2, 5, 111
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(b, s, vocab, generator=g) * 2
    sure = {(0, 1): 17, (0, 3): 104, (0, 4): 0}  # (row, position): the only finite token
    for (r, i), t in sure.items():
        logits[r, i] = float("-inf")
        logits[r, i, t] = 3.5 - i
    masked = torch.ones(b, s, dtype=torch.bool)
    masked[0, 4] = False  # not masked: untouched even though its conf would be 1
    tokens = torch.full((b, s), -3)
    step_map = torch.full((b, s), -2, dtype=torch.int32)
    logp, conf = torch.full((b, s), 7.0), torch.full((b, s), 7.0)
    step, quota = torch.tensor([4, 9], dtype=torch.int32), torch.ones(b, dtype=torch.int32)
    done, _ = threshold_unmask(logits, tokens, masked, step_map, logp, conf, step, quota, torch.tensor([200]),
                               torch.tensor([1]), torch.tensor([2]), threshold=1.0, greedy=greedy)
    assert masked[0].tolist() == [True, False, True, False, False]
    assert tokens[0].tolist() == [-3, 17, -3, 104, -3] and step_map[0].tolist() == [-2, 4, -2, 4, -2]
    assert conf[0].tolist() == [7.0, 1.0, 7.0, 1.0, 7.0] and logp[0].tolist() == [7.0, 0.0, 7.0, 0.0, 7.0]
    assert int((~masked[1]).sum()) == 1 and not done.any()
    if greedy:  # the unmasked position of row 1 is its most confident one (float64 oracle)
        best = torch.softmax(logits[1].double(), -1).amax(-1).argmax()
        assert not masked[1, best]


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
                          (*[x.clone() for x in state], *extra, 0.9, 1.0, 0, 1.0, False, "two_level"))
    torch.library.opcheck(torch.ops.lightningrl_fast.threshold_unmask.default,
                          (*[x.clone() for x in state], *extra, 0.9, 1.0, 0, 1.0, False, "per_token",
                           torch.tensor([5, 2])))


@pytest.mark.parametrize("noise", ["two_level", "per_token"])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (9, 0.85)])
def test_noise_rows_keep_a_sequences_noise_wherever_it_sits(noise, top_k, top_p):
    """noise_rows: sequence b draws the noise of sequence noise_rows[b] of the default numbering. A batch
    reordered (and cut to a subset, as the decoder's compaction does) with noise_rows naming each sequence's
    original index decodes exactly as the original batch did (tokens, confidences, log-probs, every in-place
    output and flag); without it, the reordered sequences draw other noise. Vocab 2111 (three buckets)."""
    state = make_state(5, 4, 2111, seed=31, frac_masked=0.9)
    step = torch.arange(5, dtype=torch.int32)
    quota = torch.tensor([1, 2, 1, 3, 1], dtype=torch.int32)
    extra = (step, quota, torch.tensor([1, 3]), torch.tensor([2**40 + 3]), torch.tensor([17]))
    kw = dict(threshold=0.6, temperature=1.3, top_k=top_k, top_p=top_p, noise=noise)
    whole = [x.clone() for x in state]
    flags = threshold_unmask(*whole, *extra, **kw)
    keep = torch.tensor([4, 1, 3])  # a subset, reordered
    sub = [x[keep].clone() for x in state]
    sub_extra = (step[keep], quota[keep], *extra[2:])
    got = threshold_unmask(*sub, *sub_extra, **kw, noise_rows=keep.clone())
    assert all(torch.equal(a, b[keep]) for a, b in zip(sub[1:], whole[1:]))
    assert all(torch.equal(a, b[keep]) for a, b in zip(got, flags))
    plain = [x[keep].clone() for x in state]
    threshold_unmask(*plain, *sub_extra, **kw)
    assert not torch.equal(plain[1], sub[1])  # the default numbering: other noise, other tokens
    # the identity numbering is the default
    ident = [x.clone() for x in state]
    threshold_unmask(*ident, *extra, **kw, noise_rows=torch.arange(5))
    assert all(torch.equal(a, b) for a, b in zip(ident, whole))


@pytest.mark.parametrize("mode, top_k, top_p", [("greedy", 0, 1.0), ("two_level", 0, 1.0), ("per_token", 0, 1.0),
                                                ("two_level", 9, 0.85)])
def test_logit_rows_compact_logits_decode_as_the_full_ones(mode, top_k, top_p):
    """logit_rows: a compact [M, V] logits holding the scanned positions' rows only (shuffled among junk rows, at a
    padded row stride; the map junk, out of range too, at the other positions) gives exactly the step the full
    [B, S, V] logits give: every in-place output and flag (a quota-0 sequence and fully unmasked rows included)."""
    greedy, noise = MODES[mode]
    state, extra = case(6, 5, 2111, torch.float32, seed=41, frac_masked=0.6, quota=(1, 2, 0, 3, 1, 1))
    state[2][4] = False  # a sequence with nothing masked: none of its positions is scanned
    kw = dict(threshold=0.6, temperature=1.3, top_k=top_k, top_p=top_p, greedy=greedy, noise=noise)
    whole = clone(state)
    want = threshold_unmask(*whole, *extra, **kw)
    compact, rows = compact_logits(state[0], state[2], extra[1], random.Random(5), torch.Generator().manual_seed(5))
    assert compact.shape[0] < 6 * 5 and compact.stride(0) > compact.shape[1]  # fewer rows, padded stride
    got = [compact] + clone(state[1:])
    flags = threshold_unmask(*got, *extra, **kw, logit_rows=rows)
    assert_same_step(got, flags, whole, want, rtol=0, atol=0)
    # a wrong map shows: two scanned positions' rows swapped
    scanned = (state[2] & (extra[1] > 0)[:, None]).nonzero()
    (b0, s0), (b1, s1) = scanned[0].tolist(), scanned[-1].tolist()
    swapped = rows.clone()
    swapped[b0, s0], swapped[b1, s1] = rows[b1, s1], rows[b0, s0]
    other = [compact] + clone(state[1:])
    threshold_unmask(*other, *extra, **kw, logit_rows=swapped)
    assert not all(torch.equal(a, b) for a, b in zip(other[1:], got[1:]))


def test_logit_rows_out_of_range_are_clamped():
    """A map value outside [0, M) reads row 0 (below) or M - 1 (above), never outside the tensor."""
    state, extra = case(2, 3, 97, torch.float32, seed=3, frac_masked=1.0, quota=(1, 1))
    compact = torch.randn(4, 97, generator=torch.Generator().manual_seed(4)) * 3
    wild = torch.tensor([[-5, 1, 2**40], [3, -(2**62), 7]])
    clamped = wild.clamp(0, 3)
    a, b = [compact] + clone(state[1:]), [compact] + clone(state[1:])
    fa = threshold_unmask(*a, *extra, greedy=True, threshold=0.0, logit_rows=wild)
    fb = threshold_unmask(*b, *extra, greedy=True, threshold=0.0, logit_rows=clamped)
    assert_same_step(a, fa, b, fb, rtol=0, atol=0)
    assert a[1].tolist() == compact[clamped].argmax(-1).tolist()  # tau 0: every position unmasked to its argmax


def test_logit_rows_bad_inputs():
    state, extra = case(2, 4, 33, torch.float32, seed=9)
    compact, rows = state[0].reshape(8, 33).clone(), torch.arange(8).view(2, 4)
    with pytest.raises(ValueError, match=r"logits must have 2 dimensions"):
        threshold_unmask(*state, *extra, logit_rows=rows)  # [B, S, V] with a map
    with pytest.raises(ValueError, match=r"logits must have 3 dimensions"):
        threshold_unmask(compact, *state[1:], *extra)  # compact without one
    with pytest.raises(ValueError, match=r"logit_rows must have shape \[2, 4\]"):
        threshold_unmask(compact, *state[1:], *extra, logit_rows=rows[:, :3])
    with pytest.raises(TypeError, match="logit_rows must have dtype"):
        threshold_unmask(compact, *state[1:], *extra, logit_rows=rows.int())
    with pytest.raises(ValueError, match="at least one row"):
        threshold_unmask(compact[:0], *state[1:], *extra, logit_rows=rows)
    with pytest.raises(ValueError, match="logit_rows"):  # an output sharing its memory
        threshold_unmask(compact, state[1], *state[2:], *extra, logit_rows=state[1])
    torch.library.opcheck(torch.ops.lightningrl_fast.threshold_unmask.default,
                          (compact, *clone(state[1:]), *extra, 0.9, 1.0, 0, 1.0, False, "two_level", None, rows))


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
    with pytest.raises(ValueError, match="noise must be one of"):
        threshold_unmask(*state, *extra, noise="per_bucket")
    with pytest.raises(ValueError, match=r"noise_rows must have shape \[2\]"):
        threshold_unmask(*state, *extra, noise_rows=torch.arange(3))
    with pytest.raises(TypeError, match="noise_rows must have dtype"):
        threshold_unmask(*state, *extra, noise_rows=torch.arange(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="noise_rows"):  # an output sharing its memory
        threshold_unmask(state[0], state[1], *state[2:], *extra, noise_rows=state[1][:, 0])
    with pytest.raises(ValueError, match=r"top_k must be >= 0 \(0 = off\), got -1"):
        threshold_unmask(*state, *extra, top_k=-1)
    with pytest.raises(ValueError, match="top_p must be in .*got nan"):
        threshold_unmask(*state, *extra, top_p=float("nan"))
    one = torch.ones(1, dtype=torch.int64)
    cases = [  # (argument index, replacement, error, match): shapes the kernel indexes by row, dtypes it reads raw
        (6, step[:1], ValueError, r"step must have shape \[2\], got \[1\]"),
        (7, step.long(), TypeError, r"quota must have dtype in \(int32\), got int64"),
        (9, torch.cat([one, one]), ValueError, r"seed must have shape \[1\], got \[2\]"),
        (5, state[5].double(), TypeError, r"conf must have dtype in \(float32\), got float64"),
        (0, state[0][..., :0], ValueError,
         r"logits must have at least one position and one token, got 4 positions and 0 tokens"),
    ]
    for i, new, error, match in cases:
        args = [x.clone() for x in state] + list(extra)
        args[i] = new
        with pytest.raises(error, match=match):
            threshold_unmask(*args)
    with pytest.raises(ValueError, match="logp is written in place and must not share memory with logits"):
        threshold_unmask(state[0], *state[1:4], state[0][..., 0], state[5], *extra)


def test_kernel_supported_routing():
    x = torch.zeros(2, 4, 10)
    assert kernel_supported(x, 1.0, 0, 1.0, False)
    assert kernel_supported(x, 1.0, 5, 0.5, True)  # greedy ignores truncation
    assert kernel_supported(x, 0.0, 5, 0.5, False)  # temperature 0 is greedy
    assert kernel_supported(x, 1.0, 10, 1.0, False)  # top_k >= V truncates nothing
    assert not kernel_supported(x, 1.0, 5, 1.0, False)
    assert not kernel_supported(x, 1.0, 0, 0.9, False)
    assert not kernel_supported(x.double(), 1.0, 0, 1.0, True)
    assert not kernel_supported(torch.zeros(1, 1025, 3), 1.0, 0, 1.0, True)
    assert kernel_supported(torch.zeros(1, 1024, 3), 1.0, 0, 1.0, True)  # KERNEL_MAX_POSITIONS itself
    huge = torch.empty(0, 1, 2**31 - 2**16 + 1)  # no storage: only the shape is read
    assert not kernel_supported(huge, 1.0, 0, 1.0, True) and kernel_supported(huge[..., 1:], 1.0, 0, 1.0, True)
    assert kernel_supported(torch.zeros(5, 3), 1.0, 0, 1.0, True, positions=1024)  # compact logits: positions given
    assert not kernel_supported(torch.zeros(5, 3), 1.0, 0, 1.0, True, positions=1025)
    assert kernel_supported(torch.zeros(8, 2000), 1.0, 0, 1.0, True, positions=4)  # not logits.shape[1]


# ------------------------------------------------------------------ shared helpers of the kernel tests


def case(b, s, vocab, dtype, seed, frac_masked=0.7, device="cpu", quota=(1, 2, 0, 3), offset=5, eos=(3, 7)):
    """(state [logits, tokens, masked, step_map, logp, conf], extra [step, quota, eos_ids, seed, offset])."""
    state = [x.to(device) for x in make_state(b, s, vocab, seed, frac_masked, dtype)]
    q = torch.tensor([quota[i % len(quota)] for i in range(b)], dtype=torch.int32, device=device)
    extra = [torch.arange(b, dtype=torch.int32, device=device) + 2, q, torch.tensor(eos, device=device),
             torch.tensor([2**34 + 11], device=device), torch.tensor([offset], device=device)]
    return state, extra


def clone(xs):
    return [x.clone() for x in xs]


def assert_same_step(got_state, got_flags, want_state, want_flags, rtol=1e-5, atol=2e-6):
    """Integers and flags exactly equal, logp / conf close (NaN == NaN)."""
    for name, g, w in zip(["tokens", "masked", "step_map"], got_state[1:4], want_state[1:4]):
        assert torch.equal(g.cpu(), w.cpu()), f"{name} differs at {(g.cpu() != w.cpu()).nonzero()[:5].tolist()}"
    for name, g, w in zip(["logp", "conf"], got_state[4:6], want_state[4:6]):
        torch.testing.assert_close(g.cpu(), w.cpu(), rtol=rtol, atol=atol, equal_nan=True, msg=name)
    assert torch.equal(got_flags[0].cpu(), want_flags[0].cpu()), "block_done"
    assert torch.equal(got_flags[1].cpu(), want_flags[1].cpu()), "eos_seen"


def compact_logits(dense: torch.Tensor, masked: torch.Tensor, quota: torch.Tensor, rng: random.Random,
                   g: torch.Generator, same_alignment: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [M, V], logit_rows [B, S] int64): threshold_unmask's compact layout of `dense` [B, S, V]. The rows of
    the positions the kernel scans (masked, quota > 0) in a random order among 1-4 junk rows (other random logits:
    a position reading a wrong row picks otherwise), rows at a stride of V + 0..8 (misaligned ones included); the
    map's entries at the other positions are junk, out of range too (they must not be read). `same_alignment`:
    the stride rounded up to whole 16 bytes, so every row starts at one alignment (identical rows then sum in the
    same order and tie exactly, as the random draws of identical rows expect)."""
    b, s, vocab = dense.shape
    dev = dense.device
    scanned = (masked & (quota > 0)[:, None]).flatten().nonzero().squeeze(1)  # [n] flat positions
    n = scanned.numel()
    m = n + rng.randint(1, 4)
    cpu_gen = torch.Generator().manual_seed(rng.getrandbits(63))
    slot = torch.randperm(m, generator=cpu_gen).to(dev)  # [m] rows of the scanned positions first, then the junk's
    pad = rng.choice([0, 0, 1, 3, 8])
    if same_alignment:
        per_vec = 16 // dense.element_size()
        pad += -(vocab + pad) % per_vec
    base = (torch.randn(m, vocab + pad, generator=g, device=dev) * 4).to(dense.dtype)
    logits = base[:, :vocab]
    logits[slot[:n]] = dense.reshape(b * s, vocab)[scanned]
    rows = torch.randint(-3 * m, 3 * m + 1, (b * s,), generator=cpu_gen).to(dev)
    rows[scanned] = slot[:n]
    return logits, rows.view(b, s)


# the kernel's three pick modes: (greedy, noise)
MODES = {"greedy": (True, "two_level"), "per_token": (False, "per_token"), "two_level": (False, "two_level")}


# ---------------------------------------------------------------------------- the CUDA kernel (GPU)


@pytest.fixture
def cuda_kernels(cuda_ext_with):
    """The CUDA kernel must be what runs, else a GPU test would compare the reference with itself."""
    return cuda_ext_with("threshold_unmask").threshold_unmask


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,s,vocab", [(4, 32, 111), (4, 32, 151936), (3, 4, 5003), (64, 8, 4096)])
def test_gpu_greedy_matches_reference(cuda_kernels, dtype, b, s, vocab):
    state, extra = case(b, s, vocab, dtype, seed=3, device="cuda")
    ref = clone(state)
    want = threshold_unmask_reference(*ref, *extra, 0.9, 1.0, 0, 1.0, True)
    got = clone(state)
    flags = threshold_unmask(*got, *extra, threshold=0.9, greedy=True)
    assert_same_step(got, flags, ref, want, rtol=1e-4, atol=1e-5)
    # picks and logp / conf at the written positions against float64
    tok64, conf64, logp64 = pick_tokens_reference(state[0].cpu().double(), 0, 0, 1.0, 0, 1.0, True)
    w = (state[2] & ~got[2]).cpu()
    assert w.any() and torch.equal(got[1].cpu()[w], tok64[w])
    torch.testing.assert_close(got[4].cpu()[w], logp64[w], rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(got[5].cpu()[w], conf64[w], rtol=1e-4, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("noise", ["two_level", "per_token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("b,vocab", [(4, 111), (4, 151936), (1, 151936), (3, 5003)])
def test_gpu_sampling_picks_equal_reference(cuda_kernels, noise, dtype, temperature, b, vocab):
    """Same Philox stream and fp32 arithmetic as the reference on the GPU: tau 0 writes every pick; at most a
    rare near-tie (perturbed scores within an ulp; two-level: bucket scores within a logsumexp's fp32 error)
    may differ. B 1 x 32 rows over 151936 tokens: several CTAs per row (two-level: the row counters)."""
    state, extra = case(b, 32, vocab, dtype, seed=8, frac_masked=1.0, device="cuda")
    ref = clone(state)
    threshold_unmask_reference(*ref, *extra, 0.0, temperature, 0, 1.0, False, noise)
    got = clone(state)
    threshold_unmask(*got, *extra, threshold=0.0, temperature=temperature, noise=noise)
    same = got[1] == ref[1]
    assert same.float().mean().item() >= 0.99, f"{int((~same).sum())} of {same.numel()} picks differ"
    torch.testing.assert_close(got[4][same], ref[4][same], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[5][same], ref[5][same], rtol=1e-4, atol=1e-5)
    # every masked position of a row with quota > 0 is written (tau 0); the quota-0 row keeps its mask
    assert torch.equal(got[2], ref[2]) and torch.equal(got[3], ref[3])
    assert not got[2][extra[1] > 0].any() and (got[3][extra[1] > 0] == extra[0][extra[1] > 0, None]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_workspace_survives_batch_growth(cuda_kernels, mode):
    """Calls with a small batch, then larger ones, then a small one again: the persistent workspace's arrival
    counters must read zero on entry every time (an H100 run once found a larger batch reading the previous
    launch's partials as counters, so no CTA was last and rows stayed masked)."""
    greedy, noise = MODES[mode]
    for b, vocab in [(2, 4099), (3, 151936), (700, 97), (1500, 4099), (5, 151936)]:
        state, extra = case(b, 4, vocab, torch.bfloat16, seed=b, frac_masked=1.0, device="cuda", quota=(1, 2, 3))
        ref = clone(state)
        want = threshold_unmask_reference(*ref, *extra, 0.5, 1.0, 0, 1.0, greedy, noise)
        got = clone(state)
        flags = threshold_unmask(*got, *extra, threshold=0.5, greedy=greedy, noise=noise)
        same = got[1] == ref[1]
        assert same.float().mean().item() >= 0.99, (b, vocab, int((~same).sum()))
        assert (~got[2]).sum(1).ge(1).all(), f"B={b}: a row with quota >= 1 unmasked nothing"
        if greedy:
            assert_same_step(got, flags, ref, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_sampling_matches_softmax_statistically(cuda_kernels):
    vocab, n = 7, 20000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5], device="cuda")
    probs = torch.softmax(logits / 0.8, 0).cpu()
    counts = torch.zeros(vocab)
    b = 1000
    ones = torch.ones(b, dtype=torch.int32, device="cuda")
    for off in range(n // b):
        st = [logits.expand(b, 1, vocab).contiguous(), torch.zeros(b, 1, dtype=torch.long, device="cuda"),
              torch.ones(b, 1, dtype=torch.bool, device="cuda"), torch.zeros(b, 1, dtype=torch.int32, device="cuda"),
              torch.zeros(b, 1, device="cuda"), torch.zeros(b, 1, device="cuda")]
        threshold_unmask(*st, ones, ones, torch.tensor([0], device="cuda"), torch.tensor([42], device="cuda"),
                         torch.tensor([off], device="cuda"), temperature=0.8)
        counts += torch.bincount(st[1].view(-1).cpu(), minlength=vocab)
        torch.testing.assert_close(st[5].view(-1).cpu(), probs[st[1].view(-1).cpu()], rtol=1e-5, atol=1e-6)
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum().item()
    assert chi2 < 22.5, chi2  # 6 degrees of freedom, p = 0.001


@pytest.mark.gpu
@pytest.mark.parametrize("noise", ["two_level", "per_token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_sampling_over_buckets_matches_softmax_statistically(cuda_kernels, noise, dtype):
    chi2 = bucket_chi2(noise, "cuda", dtype)
    assert chi2 < 29.6, chi2  # 10 degrees of freedom, p = 0.001


@pytest.mark.gpu
@pytest.mark.parametrize("greedy", [True, False])
def test_gpu_never_touches_other_positions(cuda_kernels, greedy):
    """Poison every value the kernel must not write (unmasked positions, rows with quota 0, unselected ones)."""
    state, extra = case(6, 32, 4099, torch.bfloat16, seed=12, frac_masked=0.6, device="cuda")
    state[4][~state[2]] = float("nan")
    state[5][~state[2]] = float("inf")
    state[1][~state[2]] = -123456789
    before = clone(state)
    got = clone(state)
    threshold_unmask(*got, *extra, threshold=0.95, greedy=greedy)
    written = before[2] & ~got[2]  # newly unmasked
    assert written.any() and (written.sum(1)[extra[1] == 0] == 0).all()
    bits = {torch.bool: torch.uint8, torch.int64: torch.int64, torch.int32: torch.int32, torch.float32: torch.int32}
    for name, old, new in zip(["tokens", "masked", "step_map", "logp", "conf"], before[1:], got[1:]):
        assert torch.equal(new.view(bits[new.dtype])[~written], old.view(bits[old.dtype])[~written]), name


@pytest.mark.gpu
def test_gpu_deterministic_for_fixed_seed_and_offset(cuda_kernels):
    state, extra = case(8, 32, 151936, torch.bfloat16, seed=21, device="cuda")
    a, b = clone(state), clone(state)
    fa = threshold_unmask(*a, *extra, threshold=0.5)
    fb = threshold_unmask(*b, *extra, threshold=0.5)
    assert all(torch.equal(x, y) for x, y in zip(a + list(fa), b + list(fb)))
    c = clone(state)
    threshold_unmask(*c, *extra[:4], extra[4] + 1, threshold=0.0)
    d = clone(state)
    threshold_unmask(*d, *extra, threshold=0.0)
    assert not torch.equal(c[1], d[1])  # another offset, other draws


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_cuda_graph_replay_with_offset_bumps(cuda_kernels, mode):
    greedy, noise = MODES[mode]
    state, extra = case(4, 32, 151936, torch.bfloat16, seed=31, device="cuda")
    init = clone(state)
    live = clone(state)
    offset = extra[4]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (sizes the kernel's workspace)
        threshold_unmask(*live, *extra, threshold=0.8, greedy=greedy, noise=noise)
    torch.cuda.current_stream().wait_stream(side)
    for dst, src in zip(live, init):
        dst.copy_(src)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flags = threshold_unmask(*live, *extra, threshold=0.8, greedy=greedy, noise=noise)
    for k in range(3):
        for dst, src in zip(live, init):
            dst.copy_(src)
        offset.fill_(100 + k)
        graph.replay()
        ref = clone(init)
        want = threshold_unmask_reference(*ref, *extra, 0.8, 1.0, 0, 1.0, greedy, noise)
        torch.cuda.synchronize()
        if greedy:
            assert_same_step(live, flags, ref, want, rtol=1e-4, atol=1e-5)
        else:
            agree = (live[1] == ref[1]).float().mean().item()
            assert agree >= 0.99 and torch.equal(flags[0], want[0]), agree
    # an eager call after the graph still works (same workspace, counters left at zero by every launch)
    for dst, src in zip(live, init):
        dst.copy_(src)
    eager = threshold_unmask(*live, *extra, threshold=0.8, greedy=True)
    ref = clone(init)
    want = threshold_unmask_reference(*ref, *extra, 0.8, 1.0, 0, 1.0, True)
    assert_same_step(live, eager, ref, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_edge_cases(cuda_kernels, mode):
    greedy, noise = MODES[mode]
    # nothing masked: no-op
    state, extra = case(3, 8, 111, torch.float32, seed=1, frac_masked=0.0, device="cuda")
    got = clone(state)
    done, _ = threshold_unmask(*got, *extra, threshold=0.5, greedy=greedy, noise=noise)
    assert done.all() and all(torch.equal(a, b) for a, b in zip(got, state))
    # tau 0 and 1
    state, extra = case(4, 32, 151936, torch.bfloat16, seed=2, frac_masked=1.0, device="cuda")
    for tau, left in ((0.0, [0, 0, 32, 0]), (1.0, [31, 30, 32, 29])):
        got = clone(state)
        threshold_unmask(*got, *extra, threshold=tau, greedy=greedy, noise=noise)
        assert got[2].sum(1).tolist() == left
    # -inf logits, a single finite token, all-equal logits; vocab 111 and 151936
    for vocab in (111, 151936):
        b, s = 3, 4
        logits = torch.randn(b, s, vocab, device="cuda")
        logits[..., vocab - 1] = float("-inf")
        logits[0, :, ::2] = float("-inf")
        logits[1] = float("-inf")
        logits[1, :, 42] = 5.0
        logits[2] = 1.25
        st = [logits, torch.zeros(b, s, dtype=torch.long, device="cuda"),
              torch.ones(b, s, dtype=torch.bool, device="cuda"), torch.full((b, s), -1, dtype=torch.int32, device="cuda"),
              torch.zeros(b, s, device="cuda"), torch.zeros(b, s, device="cuda")]
        ex = [torch.ones(b, dtype=torch.int32, device="cuda"), torch.ones(b, dtype=torch.int32, device="cuda"),
              torch.tensor([42], device="cuda"), torch.tensor([9], device="cuda"), torch.tensor([1], device="cuda")]
        ref = clone(st)
        want = threshold_unmask_reference(*ref, *ex, 0.0, 1.0, 0, 1.0, greedy, noise)
        got = clone(st)
        flags = threshold_unmask(*got, *ex, threshold=0.0, greedy=greedy, noise=noise)
        assert_same_step(got, flags, ref, want, rtol=1e-4, atol=1e-6)
        assert (got[1][1] == 42).all() and (got[5][1] == 1.0).all() and bool(flags[1][1])
        assert (got[1][0] % 2 == 1).all()
        torch.testing.assert_close(got[5][2], torch.full((s,), 1 / vocab, device="cuda"))


@pytest.mark.gpu
def test_gpu_fallbacks_and_strided_logits(cuda_kernels):
    """top-k / top-p sampling and float64 run the reference; a non-dense last dim is made dense first."""
    state, extra = case(2, 4, 111, torch.float32, seed=5, device="cuda")
    for kw in ({"top_k": 5}, {"top_p": 0.5}):
        got, ref = clone(state), clone(state)
        flags = threshold_unmask(*got, *extra, threshold=0.3, **kw)
        want = threshold_unmask_reference(*ref, *extra, 0.3, 1.0, kw.get("top_k", 0), kw.get("top_p", 1.0), False)
        assert_same_step(got, flags, ref, want)
    got, ref = clone(state), clone(state)
    got[0] = got[0].double()
    flags = threshold_unmask(*got, *extra, threshold=0.3, greedy=True)
    want = threshold_unmask_reference(*ref, *extra, 0.3, 1.0, 0, 1.0, True)
    assert torch.equal(got[1], ref[1])
    wide = torch.zeros(2, 4, 111, 2, device="cuda")
    wide[..., 1] = state[0]
    got, ref = clone(state), clone(state)
    got[0] = wide[..., 1]  # last-dim stride 2
    flags = threshold_unmask(*got, *extra, threshold=0.3, greedy=True)
    want = threshold_unmask_reference(*ref, *extra, 0.3, 1.0, 0, 1.0, True)
    assert_same_step(got, flags, ref, want)


@pytest.mark.gpu
def test_gpu_workspace_grows_and_rows_beyond_one_wave(cuda_kernels):
    for b, s, vocab in ((1, 4, 1000), (512, 32, 2048), (2, 32, 151936)):
        state, extra = case(b, s, vocab, torch.bfloat16, seed=b, device="cuda")
        ref, got = clone(state), clone(state)
        want = threshold_unmask_reference(*ref, *extra, 0.7, 1.0, 0, 1.0, True)
        flags = threshold_unmask(*got, *extra, threshold=0.7, greedy=True)
        assert_same_step(got, flags, ref, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_launcher_checks_inputs(cuda_kernels):
    """The C++ launcher is safe to call directly: its TORCH_CHECKs name the argument."""
    kernel = cuda_kernels
    state, extra = case(2, 4, 33, torch.float32, seed=9, device="cuda")
    args = state + extra
    opts = (0.9, 1.0, 0, 1.0, False, True)

    def call(i, t, o=opts):
        a = list(args)
        a[i] = t
        return kernel(*a, *o)

    with pytest.raises(RuntimeError, match="logits must have dtype in"):
        call(0, state[0].int())
    with pytest.raises(RuntimeError, match="logits must have 3 dimensions"):
        call(0, state[0][0])
    with pytest.raises(RuntimeError, match="logits must have a contiguous last dimension"):
        call(0, torch.stack([state[0], state[0]], -1)[..., 0])
    with pytest.raises(RuntimeError, match=r"tokens must have shape"):
        call(1, state[1][:, :3])
    with pytest.raises(RuntimeError, match="masked must have dtype"):
        call(2, state[2].int())
    with pytest.raises(RuntimeError, match="step_map must have dtype"):
        call(3, state[3].long())
    with pytest.raises(RuntimeError, match="conf is on|logits is on"):
        call(5, state[5].cpu())
    with pytest.raises(RuntimeError, match="quota must have shape"):
        call(7, extra[1][:1])
    with pytest.raises(RuntimeError, match="seed must have dtype"):
        call(9, extra[3].int())
    with pytest.raises(RuntimeError, match="offset must have shape"):
        call(10, extra[4].view(1, 1))
    with pytest.raises(RuntimeError, match="logits must be a CUDA tensor"):
        kernel(*[t.cpu() for t in args], *opts)
    with pytest.raises(RuntimeError, match="top-k/top-p"):
        kernel(*args, 0.9, 1.0, 5, 1.0, False, True)
    with pytest.raises(RuntimeError, match="at most 1024 positions"):
        big, big_extra = case(1, 1025, 8, torch.float32, seed=1, device="cuda")
        kernel(*big, *big_extra, *opts)
    with pytest.raises(RuntimeError, match="tokens is written in place and must not"):
        call(1, state[1][:1].expand(2, 4))
    # outputs written by the CTA that finishes a sequence while others still read: no memory shared
    with pytest.raises(RuntimeError, match="logp and conf are both written in place"):
        call(4, state[5])
    with pytest.raises(RuntimeError, match="tokens is written in place and must not share memory with logits"):
        call(1, state[0].view(-1)[:16].view(torch.int64).view(2, 4))
    # compact logits [M, V] with a logit_rows map [B, S]
    compact, rows = state[0].reshape(8, 33).clone(), torch.arange(8, device="cuda").view(2, 4)

    def call_compact(logits, logit_rows):
        return kernel(logits, *args[1:], *opts, None, logit_rows)

    with pytest.raises(RuntimeError, match="logits must have 2 dimensions"):
        call_compact(state[0], rows)
    with pytest.raises(RuntimeError, match=r"logit_rows must have shape \[2, 4\]"):
        call_compact(compact, rows[:, :3])
    with pytest.raises(RuntimeError, match="logit_rows must have dtype Long"):
        call_compact(compact, rows.int())
    with pytest.raises(RuntimeError, match="logit_rows is on"):
        call_compact(compact, rows.cpu())
    with pytest.raises(RuntimeError, match="at least one row"):
        call_compact(compact[:0], rows)
    with pytest.raises(RuntimeError, match="must not share memory with logit_rows"):
        kernel(compact, args[1], *args[2:], *opts, None, args[1])


@pytest.mark.gpu
def test_gpu_launches_on_two_streams_may_overlap(cuda_kernels):
    """Eager launches on two streams, not ordered with each other, each use their own workspace: every launch
    finishes its rows as the reference does, and so does a launch after them (a workspace shared by the two
    would leave its arrival counters off zero for good)."""
    state, extra = case(64, 8, 4099, torch.float32, seed=5, device="cuda")
    ref = clone(state)
    want = threshold_unmask_reference(*ref, *extra, 0.9, 1.0, 0, 1.0, True)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    runs = []
    torch.cuda.synchronize()
    for _ in range(20):
        for st in streams:
            got = clone(state)
            st.wait_stream(torch.cuda.current_stream())  # the clone is ready; the two streams race each other
            with torch.cuda.stream(st):
                runs.append((got, threshold_unmask(*got, *extra, threshold=0.9, greedy=True)))
    torch.cuda.synchronize()
    for got, flags in runs:
        assert_same_step(got, flags, ref, want, rtol=1e-4, atol=1e-5)
    got = clone(state)
    assert_same_step(got, threshold_unmask(*got, *extra, threshold=0.9, greedy=True), ref, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_opcheck(cuda_kernels):
    state, extra = case(2, 4, 333, torch.bfloat16, seed=9, device="cuda")
    for noise in ("two_level", "per_token"):
        torch.library.opcheck(torch.ops.lightningrl_fast.threshold_unmask.default,
                              (*clone(state), *extra, 0.9, 1.0, 0, 1.0, False, noise))
    compact, rows = compact_logits(state[0], state[2], extra[1], random.Random(1), torch.Generator("cuda"))
    torch.library.opcheck(torch.ops.lightningrl_fast.threshold_unmask.default,
                          (compact, *clone(state[1:]), *extra, 0.9, 1.0, 0, 1.0, False, "two_level", None, rows))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["greedy", "two_level"])
def test_gpu_compact_logits_run_the_kernel(cuda_kernels, monkeypatch, mode):
    """Compact logits at the real vocabulary (V 151936 > 1024: kernel_supported must be given the positions, not
    logits.shape[1]) run the kernel, not the reference (made to raise here), and give the full layout's step."""
    import lightningrl_fast.ops.unmask as U

    greedy, noise = MODES[mode]
    state, extra = case(8, 32, 151936, torch.bfloat16, seed=12, frac_masked=0.6, device="cuda")
    want_state = clone(state)
    want = threshold_unmask(*want_state, *extra, threshold=0.5, greedy=greedy, noise=noise)
    # rows at whole 16 bytes, as the full layout's: the same head / vector / tail split, the same sums, bit-equal
    compact, rows = compact_logits(state[0], state[2], extra[1], random.Random(2), torch.Generator("cuda"),
                                   same_alignment=True)
    monkeypatch.setattr(U, "threshold_unmask_reference", lambda *a: pytest.fail("the reference ran"))
    got = [compact] + clone(state[1:])
    flags = threshold_unmask(*got, *extra, threshold=0.5, greedy=greedy, noise=noise, logit_rows=rows)
    assert_same_step(got, flags, want_state, want, rtol=0, atol=0)  # the same kernel arithmetic on the same rows
