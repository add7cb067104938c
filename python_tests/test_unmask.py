"""ops.threshold_unmask: reference vs a naive per-position loop, Philox known answers, sampling statistics; the
CUDA kernel on a GPU (marked `gpu`) against the reference, also on random configurations. The kernel's device code
on the CPU (the emulator): test_unmask_emu.py, which shares this file's case builders and the random-configuration
draw and check."""

import math
import random

import pytest
import torch
from conftest import EMU_GREEDY, fuzz_cases

from lightningrl_fast.ops.unmask import (
    BUCKET,
    BUCKET_TAG,
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
         r"logits must have at least one position and one token, got shape \[2, 4, 0\]"),
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


# the kernel's three pick modes: (greedy, noise)
MODES = {"greedy": (True, "two_level"), "per_token": (False, "per_token"), "two_level": (False, "two_level")}


# ------------------------------------------------------------------ random configurations (fuzzing)
# The draw and the check of the random-configuration tests: test_unmask_emu.py's (the emulated kernel) and
# test_gpu_random_config (the CUDA kernel) below.

_PAD = 1000.0  # fills the bytes around the rows of a padded layout: a read outside its row would win the pick


def _max_split(vocab, per_vec, greedy, noise):
    """unmask_max_split (csrc/kernels/unmask.cuh): the most chunks the launcher may cut a row into."""
    n = -(-vocab // BUCKET) // 8 if not greedy and noise == "two_level" else vocab // per_vec // 512
    return max(1, min(64, n))


def _fuzz_vocab(rng, per_vec, gpu=False):
    kind = rng.choices(["tiny", "small", "vector", "chunk", "bucket", "medium", "large"],
                       weights=[8, 15, 10, 12, 12, 15, 28] if gpu else [10, 25, 12, 15, 15, 18, 5])[0]
    if kind == "tiny":  # shorter than a few 16-byte vectors
        return rng.randint(1, 3 * per_vec + 1)
    if kind == "small":
        return rng.choice([111, 127, 128, 129, 255, 256, 257, rng.randint(2, 1100)])
    if kind == "vector":  # around a CTA's group of 4 vectors per thread (4 * 256 * per_vec tokens)
        return max(1, rng.randint(1, 3) * 1024 * per_vec + rng.randint(-per_vec - 1, per_vec + 1))
    if kind == "chunk":  # around unmask_max_split's steps (2 vectors per thread per chunk)
        return max(1, rng.randint(1, 12) * 512 * per_vec + rng.randint(-per_vec - 1, per_vec + 1))
    if kind == "bucket":  # around the two-level buckets of 1024 tokens
        return max(1, rng.randint(1, 24) * BUCKET + rng.choice([-per_vec, -1, 0, 1, per_vec - 1, per_vec, 7]))
    if kind == "medium":
        return rng.randint(1100, 30000)
    if gpu:  # Qwen2 / SDAR's vocabulary the most often
        return rng.choice([151936, 151936, 151936, 152064, rng.randint(30000, 160000)])
    return rng.choice([151936, 152064, rng.randint(30000, 160000)])


def _fuzz_logits(rng, g, b, s, vocab, dtype):
    """[b, s, vocab] logits in `dtype` (random, with the drawn features; on the generator's device) and the
    features' names."""
    dev = g.device
    scale = rng.choice([0.5, 1.0, 3.0, 8.0])
    x = torch.randn(b, s, vocab, generator=g, dtype=torch.float64, device=dev) * scale
    feats = [f"scale {scale}"]
    if rng.random() < 0.3:  # peaked (LLM-like): a few tokens far above the bulk
        k = min(vocab, rng.randint(1, 4))
        top = torch.randint(0, vocab, (b, s, k), generator=g, device=dev)
        bump = rng.uniform(5, 30) + 5 * torch.rand(b, s, k, generator=g, dtype=torch.float64, device=dev)
        x.scatter_add_(-1, top, bump)
        feats.append("peaked")
    x = x.to(dtype)
    if rng.random() < 0.2:  # -inf at random tokens (a row may end up all -inf: NaN conf, as the reference's)
        frac = rng.choice([0.1, 0.5, 0.9])
        x.masked_fill_(torch.rand(b, s, vocab, generator=g, device=dev) < frac, float("-inf"))
        feats.append(f"-inf at {frac} of the tokens")
    if rng.random() < 0.15:  # half the rows have one finite token (conf exactly 1)
        rows = torch.rand(b, s, generator=g, device=dev) < 0.5
        keep = torch.randint(0, vocab, (b, s, 1), generator=g, device=dev)
        val = x.gather(-1, keep).nan_to_num(neginf=0.0)
        x[rows] = float("-inf")
        x.scatter_(-1, keep, torch.where(rows[..., None], val, x.gather(-1, keep)))
        feats.append("one finite token")
    if rng.random() < 0.2:  # tied maxima: the row's max (or a new one) at a few more tokens, across chunks
        n = min(vocab, rng.randint(1, 5))
        ids = torch.randint(0, vocab, (b, s, n), generator=g, device=dev)
        top = x.amax(-1, keepdim=True).nan_to_num(neginf=1.0) + rng.choice([0.0, 2.0])
        x.scatter_(-1, ids, top.expand(b, s, n).to(dtype))
        feats.append(f"tied maxima x{n}")
    if rng.random() < 0.05:  # all-equal logits in some rows (conf 1/V, ties to the lowest id)
        rows = torch.rand(b, s, generator=g, device=dev) < 0.5
        x[rows] = rng.choice([0.0, 1.25, -3.5])
        feats.append("constant rows")
    if rng.random() < 0.03:  # one row all -inf (conf NaN on both sides)
        x[rng.randrange(b), rng.randrange(s)] = float("-inf")
        feats.append("an all -inf row")
    if rng.random() < 0.3:  # the sampler's mask token: one -inf column
        x[..., rng.randrange(vocab)] = float("-inf")
        feats.append("-inf column")
    same = rng.random() < 0.08
    if same:  # every row the same: equal conf at every position, quota ties go to the lowest positions
        x[:] = x[:1, :1].clone()
        feats.append("identical rows")
    return x, feats, same


def _fuzz_layout(rng, x, per_vec, same_alignment):
    """x laid out as the launcher accepts it (last dim dense; any row strides, any start), padded with _PAD;
    with `same_alignment` every row starts at the same offset modulo 16 bytes (identical rows then sum in the
    same order, as on the device)."""
    b, s, vocab = x.shape
    kind = rng.choices(["dense", "offset", "padded", "transposed", "broadcast"], weights=[3, 2, 4, 2, 1])[0]
    pad = rng.choice([0, 1, 3, per_vec, rng.randint(1, 40)]) if kind in ("padded", "transposed") else 0
    off = rng.randint(0, 2 * per_vec)
    if kind in ("dense", "offset"):
        off = off if kind == "offset" else 0
        if same_alignment and vocab % per_vec:
            kind = "padded"
        else:
            flat = torch.full((off + b * s * vocab + per_vec,), _PAD, dtype=x.dtype, device=x.device)
            out = flat[off:off + b * s * vocab].view(b, s, vocab)
            out.copy_(x)
            return out, f"{kind} (start +{off})"
    width = off + vocab + pad  # the row stride
    if same_alignment:
        width += -width % per_vec
    if kind == "padded":
        buf = torch.full((b, s, width), _PAD, dtype=x.dtype, device=x.device)
        out = buf[:, :, off:off + vocab]
    elif kind == "transposed":  # sequence stride < position stride
        buf = torch.full((s, b, width), _PAD, dtype=x.dtype, device=x.device)
        out = buf[:, :, off:off + vocab].transpose(0, 1)
    else:  # stride 0 over the batch: every sequence reads the same rows
        buf = torch.full((1, s, width), _PAD, dtype=x.dtype, device=x.device)
        out = buf[:, :, off:off + vocab].expand(b, s, vocab)
        out[:1].copy_(x[:1])
        return out, f"broadcast (row stride {width}, start +{off})"
    out.copy_(x)
    return out, f"{kind} (strides {tuple(out.stride())}, start +{off})"


def near_tie(logits, masked, quota, threshold, temperature, greedy, noise, seed, offset):
    """Why the kernel may legitimately differ from the reference on this draw, or None (ops/unmask.py: conf
    is fp32 on both sides, so a position whose float64 conf is within their rounding of the threshold, or of
    another conf at the quota boundary, may select differently; sampling scores within an ulp, or bucket scores
    within the fp32 error of a logsumexp, may pick differently). The rounding: ~1e-6 each, and the reference's
    logsumexp loses ulp(max |logit / T|) (conf 1.0 for a token only nearly certain when the logits are large).
    Runs on the logits' device (the reference's picks there)."""
    tok, conf, _ = pick_tokens_reference(logits, seed, offset, temperature, 0, 1.0, greedy, noise)
    b, s, vocab = logits.shape
    dev = logits.device
    scaled = logits.double() / (temperature if temperature > 0 else 1.0)
    conf64 = (scaled.gather(-1, tok[..., None]).squeeze(-1) - torch.logsumexp(scaled, -1)).exp()
    big = scaled.abs().nan_to_num(posinf=0.0).amax(-1) if vocab else scaled.new_zeros(b, s)
    eps = 3e-6 + 4e-7 * big  # relative
    tau = torch.tensor(threshold, dtype=torch.float32).item()
    rows = masked & (quota > 0)[:, None]
    for r in range(b):
        keep = rows[r] & ~conf64[r].isnan()
        c, e, xs = conf64[r][keep], eps[r][keep], logits[r][keep]
        # a token certain to 2^-26 gets conf exactly 1.0 on both sides
        near = ((c - tau).abs() <= e * abs(tau)) & ~((tau == 1.0) & (c > 1 - 2**-26)) & (abs(tau) < math.inf)
        if near.any():
            return f"sequence {r}: float64 conf {c[near].tolist()} near the threshold"
        q = int(quota[r]) - int(rows[r].sum() - c.numel())  # NaN confs rank first
        if 0 < q < c.numel():
            hi, lo = c.sort(descending=True).values[q - 1:q + 1].tolist()
            tol = e.max().item() * hi
            # an exact tie at the boundary goes to the lower positions on both sides when the fp32 confs tie too:
            # identical rows (laid out alike), or tokens certain to 2^-26 (conf 1.0); and no conf within rounding
            # of the tied value may overtake it
            if hi == lo:
                near = c[((c - hi).abs() <= tol) & (c != hi)]
            else:
                near = c.new_tensor([lo] if hi - lo <= 2 * tol else [])
            tied = xs[c == hi]
            exact = hi != lo or hi > 1 - 2**-26 or bool((tied == tied[:1]).all())
            if lo < tau and (near.numel() or not exact):
                return f"sequence {r}: float64 confs {hi}, {near.tolist()[:4]} at the quota boundary"
    if greedy or temperature <= 0:
        return None
    flat = logits.float().view(b * s, vocab)[rows.view(-1)] / temperature
    ids = torch.arange(b * s, device=dev).view(b, s)[rows].view(-1, 1)
    if flat.numel() == 0:
        return None

    def gumbel(ctr):
        return -torch.log(-torch.log(philox_uniform(seed, offset, ctr)))

    def gap(scores):  # best minus second best per row (inf where one candidate)
        if scores.shape[-1] < 2:
            return torch.full(scores.shape[:1], float("inf"), device=dev), scores[:, 0]
        top = scores.topk(2, dim=-1).values
        return torch.where(top[:, 1] == float("-inf"), float("inf"), top[:, 0] - top[:, 1]), top[:, 0]

    if noise == "two_level" and vocab > BUCKET:
        nb = -(-vocab // BUCKET)
        padded = torch.nn.functional.pad(flat, (0, nb * BUCKET - vocab), value=float("-inf"))
        mass = torch.logsumexp(padded.view(-1, nb, BUCKET), dim=-1)
        score = mass + gumbel(BUCKET_TAG + ids * nb + torch.arange(nb, device=dev))
        d, top = gap(score)
        if (d <= 1e-5 * top.abs().clamp_min(1.0)).any():
            return "two buckets' scores within the error of a logsumexp"
        j = score.argmax(-1, keepdim=True)
        t = (j * BUCKET + torch.arange(BUCKET, device=dev)).clamp_max(vocab - 1)
        inside = j * BUCKET + torch.arange(BUCKET, device=dev) < vocab
        tscore = (flat.gather(-1, t) + gumbel(ids * vocab + t)).masked_fill(~inside, float("-inf"))
    else:
        tscore = flat + gumbel(ids * vocab + torch.arange(vocab, device=dev))
    d, top = gap(tscore)
    if (d <= 1.5e-6 * top.abs().clamp_min(1.0)).any():
        return "two tokens' perturbed scores within an ulp"
    return None


GPU_FUZZ_LOGITS = 64 * 32 * 152064  # on a GPU: B x S x V at most (64 sequences, blocks of 32, vocabulary 152064)
GPU_FUZZ_ROWS = 4096  # on a GPU: B x S at most
GPU_FUZZ_PER_TOKEN = 1 << 27  # on a GPU, per-token sampling: B x S x V at most (the reference's Philox per token)


def draw_unmask_config(case, device="cpu", gpu=False) -> dict:
    """One random configuration of the kernel's whole space from the case seed (test_emulated_unmask_random_config
    lists what is drawn), its tensors on `device`: state [logits, tokens, masked, step_map, logp, conf] (logits at
    the drawn layout), extra [step, quota, eos_ids, seed, offset], the scalar arguments, the emulator's slots /
    split / order, the reference's inputs (ref_logits, ref_t), the dense logits and mask before the step (for the
    float64 check) and `config`, the configuration in words. Logits are redrawn until no near-tie decides the result
    (near_tie, on `device`). gpu=True (test_gpu_random_config): larger shapes besides (B to 64, S 32 the most often,
    vocabulary 151936 far more often; at most GPU_FUZZ_ROWS rows and GPU_FUZZ_LOGITS logits, GPU_FUZZ_PER_TOKEN
    for per-token sampling); slots / split / order are still drawn (emulator-only). gpu=False on the CPU draws as
    before the parameters existed."""
    rng = random.Random(case)
    g = torch.Generator(device).manual_seed(case)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    per_vec = 4 if dtype == torch.float32 else 8
    mode = rng.choice(list(MODES))
    greedy, noise = MODES[mode]
    if mode == "greedy":
        noise = rng.choice(["two_level", "per_token"])
        if rng.random() < 0.25:  # temperature <= 0 is greedy too
            greedy = False
    vocab = _fuzz_vocab(rng, per_vec, gpu)
    big = vocab > 40000
    s = rng.choices([1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, rng.randint(34, 100), rng.choice([255, 256, 1024])],
                    weights=[4, 2, 3, 8, 2, 2, 8, 2, 5, 3, 3, 24, 3, 2, 2] if gpu else
                    [6, 3, 4, 8, 3, 3, 8, 3, 5, 3, 3, 8, 3, 2, 1])[0]
    if gpu:
        b = rng.choices([1, 2, 3, 4, 5, 8, rng.randint(9, 24), 32, 64, rng.randint(25, 64)],
                        weights=[4, 3, 3, 3, 2, 3, 3, 3, 5, 3])[0]
    else:
        b = rng.choices([1, 2, 3, 4, 5, 8, rng.randint(9, 24)], weights=[6, 5, 5, 4, 3, 2, 1])[0]
    # keep a case cheap (for the emulator: at most ~1.5M logits and ~256 rows)
    rows_cap, logits_cap = (GPU_FUZZ_ROWS, GPU_FUZZ_LOGITS) if gpu else (256, 600_000 if big else 1_500_000)
    while b * s > rows_cap or b * s * vocab > logits_cap:
        if b > 1:
            b = max(1, b // 2)
        elif s > 1:
            s = max(1, s // 2)
        else:
            vocab = max(1, vocab // 2)
    if greedy:
        temperature = rng.choice([1.0, 1.0, 0.5, 2.0, 0.7, 1.3, rng.uniform(0.05, 4.0)])
    elif mode == "greedy":
        temperature = rng.choice([0.0, -1.0, -0.0])
    else:
        temperature = rng.choice([1.0, 1.0, 0.5, 2.0, 0.25, 0.7, 1.3, rng.uniform(0.05, 4.0), 1e-2, 30.0])
    sampling = not greedy and temperature > 0
    per_token_cap = GPU_FUZZ_PER_TOKEN if gpu else 300_000 if temperature > 1.5 else 800_000
    while noise == "per_token" and sampling and b * s * vocab > per_token_cap:
        b, s = (b // 2, s) if b > 1 else (b, s // 2) if s > 1 else (b, s)  # flat rows: a Philox draw per token
        vocab = vocab if b * s > 1 else min(vocab, 300_000)
    if sampling:  # the kernel samples the untruncated distribution; the op dispatches top-k >= V to it
        top_k, top_p = rng.choice([0, 0, vocab, vocab + rng.randint(1, 9)]), 1.0
    else:  # ignored by greedy picks
        top_k, top_p = rng.choice([0, 1, rng.randint(1, vocab + 2)]), rng.choice([1.0, 0.5, 0.9])
    threshold = rng.choice([0.0, 1.0, 0.9, 0.5, rng.random(), rng.uniform(0, 0.05), 2.0, -0.5, math.inf, -math.inf])
    frac = rng.choice([0.0, 1.0, 0.3, 0.7, rng.random()])
    quota = torch.tensor([rng.choice([1, 1, 2, 3, 0, -2, s, s + 3, rng.randint(1, max(1, s)), 2**31 - 1, -2**31])
                          for _ in range(b)], dtype=torch.int32, device=device)
    step = torch.tensor([rng.choice([0, 1, 7, -1, rng.randint(0, 2**31 - 1), -2**31]) for _ in range(b)],
                        dtype=torch.int32, device=device)
    n_eos = rng.choice([0, 1, 2, 3, 8, 100])
    eos = [rng.choice([rng.randrange(vocab), rng.randrange(vocab), vocab + rng.randint(0, 5), -1, 0])
           for _ in range(n_eos)]
    seed = torch.tensor([rng.randint(-2**63, 2**63 - 1)], device=device)
    offset = torch.tensor([rng.choice([0, 5, rng.randint(-2**63, 2**63 - 1)])], device=device)
    slots = rng.choice([132 * 4, 132 * 3, 114 * 4, 16, 1, rng.randint(1, 2000)])
    max_split = _max_split(vocab, per_vec, greedy or temperature <= 0, noise)
    split = rng.choice([0, 0, 1, rng.randint(1, max_split), max_split, rng.randint(1, 64)])
    while split > 1 and b * s * split > 1024:  # emulated CTAs
        split //= 2
    order = rng.choice([0, rng.getrandbits(63) | 1, EMU_GREEDY | rng.getrandbits(63)])

    for attempt in range(40):  # redraw the logits until no near-tie decides the result
        x, feats, same = _fuzz_logits(rng, g, b, s, vocab, dtype)
        masked = torch.rand(b, s, generator=g, device=device) < frac
        logits, layout = _fuzz_layout(rng, x, per_vec, same)
        dense = logits.contiguous()
        # sampling: the kernel multiplies by fl(1 / T), as torch does on CUDA; the CPU reference divides, so it
        # gets the logits so scaled (rounded once in fp32) and T = 1: the same scores, hence the same picks (on
        # CUDA the very product the reference's own x / T computes)
        inv_t = torch.tensor(1.0 / torch.tensor(temperature, dtype=torch.float32).item() if sampling else 1.0,
                             dtype=torch.float32)
        ref_logits, ref_t = (dense.float() * inv_t, 1.0) if sampling else (dense, temperature)
        why = near_tie(ref_logits, masked, quota, threshold, ref_t, greedy, noise, seed, offset)
        if why is None:
            break
    assert kernel_supported(logits, temperature, top_k, top_p, greedy)

    tokens = torch.where(masked, -5, torch.randint(0, vocab, (b, s), generator=g, device=device))
    if eos and rng.random() < 0.5:  # some already unmasked tokens are EOS ids, prompt (step_map < 0) or not
        tokens = torch.where(torch.rand(b, s, generator=g, device=device) < 0.3, eos[0], tokens)
        tokens = torch.where(masked, -5, tokens)
    step_map = torch.where(masked, -7, torch.randint(-2, 4, (b, s), generator=g, device=device)).int()
    logp = torch.where(masked, float("nan"), torch.rand(b, s, generator=g, device=device).log())
    conf = torch.where(masked, -9.0, logp.exp())
    state = [logits, tokens, masked.clone(), step_map, logp, conf]
    extra = [step, quota, torch.tensor(eos, dtype=torch.int64, device=device), seed, offset]
    config = (f"case {case}: {dtype} B={b} S={s} V={vocab} mode={mode} greedy={greedy} noise={noise} T={temperature} "
              f"top_k={top_k} top_p={top_p} tau={threshold} frac_masked={frac:.2f} ({int(masked.sum())} masked) "
              f"quota={quota.tolist()} step={step.tolist()} eos={eos} seed={seed.item()} offset={offset.item()} "
              f"{'(emulator only: ' if gpu else ''}slots={slots} split={split} (launcher max {max_split}) "
              f"order={order:#x}{')' if gpu else ''} layout={layout} "
              f"logits: {', '.join(feats)}; redrawn {attempt}x" + (f" (still: {why})" if why else ""))
    return dict(state=state, extra=extra, threshold=threshold, temperature=temperature, greedy=greedy, noise=noise,
                top_k=top_k, top_p=top_p, slots=slots, split=split, order=order, ref_logits=ref_logits, ref_t=ref_t,
                dense=dense, masked=masked, config=config)


def check_random_config(case, run, device="cpu", gpu=False):
    """The configuration draw_unmask_config(case, device, gpu) draws, run by `run(state, extra, cfg)` (the kernel, in
    place on `state`; -> its (block_done, eos_seen)) and compared with the reference on `device` (on CUDA the same
    Philox stream, logf and x * fl(1 / T) as the kernel): tokens, mask, step map and flags exactly (near ties were
    redrawn), logp / conf against float64 (_assert_same_step_fp64). A failure names the configuration."""
    c = draw_unmask_config(case, device, gpu)
    print(c["config"])
    ref = clone(c["state"])
    ref[0] = c["ref_logits"]
    want = threshold_unmask_reference(*ref, *c["extra"], c["threshold"], c["ref_t"], c["top_k"], c["top_p"],
                                      c["greedy"], c["noise"])
    got = clone(c["state"])
    got[0] = c["state"][0]  # the drawn layout (a clone of a padded view is dense)
    try:
        flags = run(got, c["extra"], c)
        _assert_same_step_fp64(got, flags, ref, want, c["masked"], c["dense"], c["temperature"])
    except AssertionError as e:
        raise AssertionError(f"{c['config']}: {e}") from e


def _assert_same_step_fp64(got, got_flags, ref, want_flags, masked, logits, temperature, rtol=1e-5, atol=2e-6):
    """assert_same_step, with logp / conf of the written positions within rtol / atol of float64 plus twice the
    fp32 reference's error, at least its rounding of the pick's and the max's scaled logits (fl(x / T): 2^-24
    of their magnitudes each; the reference may be luckier on one position, and where |x / T| is large, T << 1,
    that error is far above rtol); every other position bit-equal. `masked`: the mask before the step."""
    for name, g, w in zip(["tokens", "masked", "step_map"], got[1:4], ref[1:4]):
        assert torch.equal(g, w), f"{name} differs at {(g != w).nonzero()[:5].tolist()}"
    assert torch.equal(got_flags[0], want_flags[0]), "block_done"
    assert torch.equal(got_flags[1], want_flags[1]), "eos_seen"
    scaled = logits.double() / (temperature if temperature > 0 else 1.0)
    tok = got[1].clamp(0, logits.shape[-1] - 1)
    s_pick = scaled.gather(-1, tok[..., None]).squeeze(-1)
    logp64 = s_pick - torch.logsumexp(scaled, -1)
    rounding = 2**-24 * (s_pick.abs() + scaled.amax(-1).abs()).nan_to_num(nan=0.0, posinf=0.0)  # of logp
    for name, g, w, r64, fl in (("logp", got[4], ref[4], logp64, rounding),
                                ("conf", got[5], ref[5], logp64.exp(), rounding * logp64.exp())):
        same = (g == w) | (g.isnan() & w.isnan())
        err_k, err_r = (g.double() - r64).abs(), (w.double() - r64).abs()
        close = (err_k <= 2 * torch.maximum(err_r, fl) + atol + rtol * r64.abs()) | (g.isnan() & r64.isnan())
        ok = same | (masked & ~got[2] & close)
        assert ok.all(), (f"{name} differs at {(~ok).nonzero()[:5].tolist()}: kernel {g[~ok][:5].tolist()}, "
                          f"reference {w[~ok][:5].tolist()}, float64 {r64[~ok][:5].tolist()}")


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


GPU_FUZZ_CASES = 64  # estimated (not yet timed): ~1.4G logits over the 64 default cases, ~1 s for the largest


def op_runner(device):
    """`run` for check_random_config: the public op on `device` (on CUDA the kernel: every drawn configuration is
    kernel_supported; on the CPU the reference), its two flags checked for bytes other than 0 / 1 (on CUDA they come
    from at::empty: freed blocks of the caching allocator are filled with 0xA5 first, so a flag the kernel never
    wrote likely reads 0xA5; best effort)."""

    def run(state, extra, c):
        junk = [torch.full((512,), 0xA5, dtype=torch.uint8, device=device) for _ in range(64)]
        del junk
        flags = threshold_unmask(*state, *extra, threshold=c["threshold"], temperature=c["temperature"],
                                 top_k=c["top_k"], top_p=c["top_p"], greedy=c["greedy"], noise=c["noise"])
        for name, f in zip(("block_done", "eos_seen"), flags):
            assert f.device == state[0].device and f.dtype == torch.bool, (name, f.device, f.dtype)
            assert bool((f.view(torch.uint8) <= 1).all()), f"{name} left unwritten: {f.view(torch.uint8).tolist()}"
        return flags

    return run


@pytest.mark.gpu
@pytest.mark.parametrize("case", fuzz_cases(GPU_FUZZ_CASES))
def test_gpu_random_config(cuda_kernels, case):
    """The CUDA kernel through the public op on a random configuration of the emulator's space
    (test_unmask_emu.test_emulated_unmask_random_config: dtypes, modes incl. T <= 0, temperatures, thresholds,
    quotas, masks, -inf / tied / peaked / constant / identical rows, EOS ids, row layouts (misaligned, padded,
    transposed, broadcast), Philox seed and offset) with larger shapes (B to 64, S 32 the most often, vocabulary
    151936 far more often: draw_unmask_config(gpu=True)), the reference on CUDA; checked as there (near ties
    redrawn, so picks, selection, writes and flags exactly; logp / conf against float64). The split of a row is the
    launcher's for this GPU; the forced split, slot count and schedule seed are emulator-only (drawn, not used)."""
    check_random_config(case, op_runner("cuda"), "cuda", gpu=True)
