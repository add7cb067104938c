"""The rollout sampler: cache vs no-cache decoding, folded vs separate commits, rules, EOS, TPF, errors."""

import contextlib
import dataclasses
import os
from typing import NamedTuple

import pytest
import torch

from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.ops.masked_attn import MaskLayout
from lightningrl_fast.ops.unmask import threshold_unmask
from lightningrl_fast.sampler import Decoder, SamplerConfig, _bucket, _check_memory, _pack_rows, generate
from lightningrl_fast.sampler import _prefix_sources as sampler_prefix_sources

MASK, EOS, V = 110, 3, 111


@pytest.fixture(scope="module")
def model():
    cfg = SDARConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, block_size=4, mask_token_id=MASK, torch_dtype="float32",
                     max_position_embeddings=256)
    return build_model(cfg, dtype=torch.float64, seed=0).eval()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 100, (n,), generator=g).tolist() for n in lengths]


class Decoded(NamedTuple):
    """What `nocache_decode` gives for one prompt: response positions only ([R] = max_new_tokens)."""

    tokens: torch.Tensor  # [R] int64, as decoded (the EOS block's later positions included)
    step_map: torch.Tensor  # [R] int32
    logp: torch.Tensor  # [R] float64, NaN where never decoded
    forwards: int  # forwards this row takes part in: its prefill (a full prompt block), steps, separate commits


def nocache_decode(model, prompt, cfg: SamplerConfig, row=0, rows=1) -> Decoded:
    """Recompute the whole sequence every step (no KV cache), one prompt at a time. Greedy, or sampled as the
    sampler's row `row` of a working set of `rows` (never compacted): the op's noise is keyed by the row's index
    (the other rows are inactive here: quota 0), the seed and the step's Philox offset, which starts at 0 and
    advances by one per denoising step of the batch (= per step of this row: every row is active from step 0).
    The block size is the config's override if it has one (the forward's block-causal mask too)."""
    bs = cfg.block_size or model.config.block_size
    mask, vocab = model.config.mask_token_id, model.config.vocab_size
    temp = cfg.temperature if cfg.temperature > 0 else 1.0  # greedy: confidences under the plain softmax
    total = len(prompt) + cfg.max_new_tokens
    last = (total - 1) // bs
    seq = torch.full((1, (last + 1) * bs), mask)
    seq[0, : len(prompt)] = torch.tensor(prompt)
    step_map = torch.full((1, seq.shape[1]), -1, dtype=torch.int32)
    masked = torch.arange(seq.shape[1])[None] >= len(prompt)
    logp_map = torch.full((seq.shape[1],), float("nan"), dtype=torch.float64)
    blk, step, blk_steps = len(prompt) // bs, 0, 0
    forwards = int(len(prompt) >= bs)  # the prefill of the prompt's full blocks
    while True:
        sl = slice(blk * bs, blk * bs + bs)
        n = blk * bs + bs
        with torch.no_grad():
            logits = model(seq[:, :n], layout=MaskLayout.block_causal(n, bs))[:, sl].clone()
        forwards += 1
        logits[..., mask] = float("-inf")
        s = cfg.steps_per_block or bs
        quota = 1
        if cfg.rule == "quota":
            quota = bs if blk_steps >= s - 1 else bs // s + (blk_steps < bs % s)
        # the op on `rows` rows, this prompt's at index `row`, the others inactive (quota 0, nothing masked)
        big = torch.zeros(rows, bs, vocab, dtype=logits.dtype)
        big[row] = logits[0]
        tok, msk = torch.zeros(rows, bs, dtype=torch.int64), torch.zeros(rows, bs, dtype=torch.bool)
        sm, q = torch.full((rows, bs), -2, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32)
        tok[row], msk[row], sm[row], q[row] = seq[0, sl], masked[0, sl], step_map[0, sl], quota
        done, eos = threshold_unmask(big, tok, msk, sm, torch.zeros(rows, bs), torch.zeros(rows, bs),
                                     torch.full((rows,), step, dtype=torch.int32), q, torch.tensor(cfg.eos_ids),
                                     torch.tensor([cfg.seed]), torch.tensor([step]), threshold=cfg.threshold,
                                     temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                     greedy=cfg.greedy, noise=cfg.noise)
        tok, msk, sm, done, eos = tok[row : row + 1], msk[row : row + 1], sm[row : row + 1], done[row], eos[row]
        # the log-prob of each token at the step that unmasked it: log-softmax of the full forward's float64 logits
        # over the temperature (the mask token left out), computed here rather than read back from the op
        new = (masked[0, sl] & ~msk[0]).nonzero().squeeze(1)
        lsm = torch.log_softmax(logits[0].double() / temp, -1)
        logp_map[blk * bs + new] = lsm[new, tok[0, new]]
        seq[:, sl], masked[:, sl], step_map[:, sl] = tok, msk, sm
        step += 1
        blk_steps += 1
        if bool(done):
            blk_steps = 0
            if bool(eos) or blk == last:
                break
            blk += 1
            forwards += int(not cfg.fold_commit)  # SDAR's separate commit forward of the finished block
    r = slice(len(prompt), total)
    return Decoded(seq[0, r], step_map[0, r], logp_map[r], forwards)


def truncate_at_eos(tokens, eos_ids=(EOS,)):
    """`tokens` up to and including the first of `eos_ids`."""
    out = []
    for t in tokens:
        out.append(t)
        if t in eos_ids:
            break
    return out


@pytest.mark.parametrize("rule,threshold", [("threshold", 0.3), ("threshold", 0.05), ("quota", 0.9)])
def test_cache_decoding_equals_nocache_decoding(model, rule, threshold):
    lengths = [1, 3, 4, 5, 9]  # 1, B-1, B, B+1, and a longer one in one batch
    prompts = prompts_of(lengths)
    cfg = SamplerConfig(threshold=threshold, rule=rule, steps_per_block=2, temperature=0, max_new_tokens=14,
                        eos_ids=(EOS,))
    ro = generate(model, prompts, cfg)
    for i, p in enumerate(prompts):
        resp, smap, lp, forwards = nocache_decode(model, p, cfg)
        want = truncate_at_eos(resp.tolist())
        assert ro.response_ids(i) == want, i
        assert int(ro.forwards[i]) == forwards, i  # prefill (a full prompt block) + the row's steps
        assert ro.step_map[i, : len(want)].tolist() == smap[: len(want)].tolist()
        # the recorded log-prob and confidence (float32) of every token: within float32 rounding of the oracle's
        n = len(want)
        torch.testing.assert_close(ro.logp[i, :n].double(), lp[:n], rtol=2.4e-7, atol=1e-9)
        torch.testing.assert_close(ro.conf[i, :n].double(), lp[:n].exp(), rtol=2.4e-7, atol=1e-9)
        assert not torch.isnan(lp[:n]).any()
        # TPF (REFERENCE §2): tokens up to and including the first EOS / distinct steps that unmasked them
        assert int(ro.lengths[i]) == n and bool(ro.eos_found[i]) == (want[-1] == EOS)
        assert float(ro.tpf[i]) == pytest.approx(n / len(set(smap[:n].tolist())), rel=1e-6)


def test_folded_commit_equals_separate_commit(model):
    prompts = prompts_of([2, 7, 4, 13])
    base = SamplerConfig(threshold=0.2, temperature=0, max_new_tokens=17, eos_ids=(EOS,))
    a = generate(model, prompts, base)
    b = generate(model, prompts, dataclasses.replace(base, fold_commit=False))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.step_map, b.step_map)
    assert (b.forwards > a.forwards).any()  # the separate commits cost forwards
    assert b.total_forwards > a.total_forwards


def test_threshold_extremes_and_quota(model):
    prompts = prompts_of([3, 6])
    one = generate(model, prompts, SamplerConfig(threshold=1.0, temperature=0, max_new_tokens=12, eos_ids=(0,)))
    for i in range(2):  # tau 1.0: exactly one token per step
        sm = one.step_map[i][one.response_mask[i]]
        assert len(torch.unique(sm)) == len(sm)
        assert float(one.tpf[i]) == 1.0
    allin = generate(model, prompts, SamplerConfig(threshold=0.0, temperature=0, max_new_tokens=12, eos_ids=(0,)))
    for i, p in enumerate(prompts):  # tau 0: every block in one step
        sm = allin.step_map[i][allin.response_mask[i]]
        pos = torch.arange(len(p), len(p) + len(sm))
        assert torch.equal(sm, (pos // 4 - len(p) // 4).int())
    q = generate(model, prompts, SamplerConfig(rule="quota", steps_per_block=2, threshold=1.01, temperature=0,
                                               max_new_tokens=12, eos_ids=(0,)))
    for i, p in enumerate(prompts):  # quota 2 per step with B = 4, S = 2 (threshold unreachable): in each decoded
        # block of m masked positions, step s unmasks min(2, m), step s + 1 (the last scheduled) the rest
        smap = q.seq_step_map[i].tolist()
        step, blocks = 0, 0
        for b in range(len(p) // 4, len(smap) // 4):
            got = [smap[x] for x in range(max(b * 4, len(p)), b * 4 + 4)]
            if all(x == -2 for x in got):  # not decoded (after the EOS block)
                break
            m = len(got)
            want = [step] * min(2, m) + [step + 1] * (m - 2)
            assert sorted(got) == want, (i, b, got, want)
            step += 1 + (m > 2)
            blocks += 1
        assert blocks >= 2


def test_eos_stops_after_its_block_and_pads(model):
    prompts = prompts_of([5, 5, 5, 5], seed=3)
    # make every token EOS-likely: the model is random, so pick as EOS the token it produces first
    first = generate(model, prompts, SamplerConfig(threshold=0.9, temperature=0, max_new_tokens=16, eos_ids=(0,)))
    eos = int(first.tokens[0, 2])
    ro = generate(model, prompts, SamplerConfig(threshold=0.9, temperature=0, max_new_tokens=16, eos_ids=(eos,)))
    i = 0
    assert ro.eos_found[i] and ro.finish_reason[i] == "eos"
    n = int(ro.lengths[i])
    assert ro.tokens[i, n - 1] == eos and eos not in ro.tokens[i, : n - 1].tolist()
    assert (ro.tokens[i, n:] == eos).all() and (ro.step_map[i, n:] == -1).all()  # padding after the first EOS
    # the sequence stopped at the block holding EOS: no later block was decoded
    eos_pos = 5 + n - 1
    assert (ro.sequences[i, (eos_pos // 4 + 1) * 4 :] == MASK).all()
    for i in range(4):  # every row, not only the first: EOS rows stop at their EOS's block, the others run to the cap
        n = int(ro.lengths[i])
        assert (ro.logp[i, n:] == 0).all() and (ro.conf[i, n:] == 0).all()  # padding: no log-prob, no confidence
        if bool(ro.eos_found[i]):
            assert ro.finish_reason[i] == "eos" and ro.tokens[i, n - 1] == eos
            assert eos not in ro.tokens[i, : n - 1].tolist() and (ro.tokens[i, n:] == eos).all()
            end = ((5 + n - 1) // 4 + 1) * 4  # the end of the EOS's block
            assert (ro.sequences[i, end:] == MASK).all()
            assert float(ro.tpf[i]) == pytest.approx(n / len(set(ro.seq_step_map[i, 5 : 5 + n].tolist())), rel=1e-6)
        else:
            assert ro.finish_reason[i] == "length" and n == 16 and eos not in ro.tokens[i].tolist()
    assert not ro.eos_found.all()  # the rows differ: both branches above ran
    # an id the model never produces: no row finds it, every row runs to max_new_tokens and says so
    never = next(t for t in range(V) if t != MASK and t not in first.tokens.tolist() and t not in ro.tokens.tolist())
    no_eos = generate(model, prompts, SamplerConfig(threshold=0.9, temperature=0, max_new_tokens=16, eos_ids=(never,)))
    assert not no_eos.eos_found.any() and all(r == "length" for r in no_eos.finish_reason)
    assert no_eos.lengths.tolist() == [16] * 4 and bool(no_eos.response_mask.all())


def test_tpf_consistent_with_step_map_and_forwards(model):
    prompts = prompts_of([4, 9, 1])
    ro = generate(model, prompts, SamplerConfig(threshold=0.1, temperature=0, max_new_tokens=20, eos_ids=(EOS,)))
    for i in range(3):
        sm = ro.step_map[i][ro.response_mask[i]]
        assert float(ro.tpf[i]) == pytest.approx(len(sm) / len(torch.unique(sm)))
        assert int(ro.forwards[i]) >= len(torch.unique(sm))
        assert torch.isfinite(ro.logp[i][ro.response_mask[i]]).all()
        torch.testing.assert_close(ro.conf[i][ro.response_mask[i]], ro.logp[i][ro.response_mask[i]].exp())



def test_tpf_counts_only_the_steps_up_to_the_first_eos(model):
    """TPF = tokens up to and including the FIRST EOS / distinct steps that unmasked THOSE tokens (REFERENCE §2):
    the EOS block's positions after the EOS, unmasked at later steps, count in neither. The EOS is chosen as a
    token of a decode without EOS whose block has such later steps and holds the token again after it (an EOS
    changes only where a row stops)."""
    prompts = prompts_of([5, 2, 7], seed=3)
    cfg = SamplerConfig(threshold=0.9, temperature=0, max_new_tokens=16, eos_ids=(1,))
    base = generate(model, prompts, cfg)
    assert not base.eos_found.any()
    pick = None
    for i, p in enumerate(prompts):
        resp, steps = base.tokens[i].tolist(), base.step_map[i].tolist()
        for x, t in enumerate(resp):
            end = min(((len(p) + x) // 4 + 1) * 4 - len(p), len(resp))  # the end of x's block, in the response
            if t not in resp[:x] and t in resp[x + 1 : end] and set(steps[x + 1 : end]) - set(steps[: x + 1]):
                pick = (i, x, t, len(set(steps[: x + 1])))
                break
        if pick:
            break
    assert pick is not None
    i, x, t, n_steps = pick
    ro = generate(model, prompts, dataclasses.replace(cfg, eos_ids=(t, 1)))  # 1: never produced, the default pad
    assert bool(ro.eos_found[i]) and int(ro.lengths[i]) == x + 1
    assert ro.tokens[i, : x + 1].tolist() == base.tokens[i, : x + 1].tolist()
    assert float(ro.tpf[i]) == pytest.approx((x + 1) / n_steps, rel=1e-6)
    # the decoded positions after the EOS are padding in the per-token fields: the last EOS id, step -1, no
    # log-prob or confidence (the sequence keeps them as decoded)
    assert ro.tokens[i, x + 1 :].tolist() == [1] * (16 - x - 1) and (ro.step_map[i, x + 1 :] == -1).all()
    assert (ro.logp[i, x + 1 :] == 0).all() and (ro.conf[i, x + 1 :] == 0).all()
    assert (ro.seq_step_map[i, len(prompts[i]) + x + 1 :] >= 0).any()


@pytest.mark.parametrize("fold_commit", [True, False])
def test_forward_counts_are_exact(model, monkeypatch, fold_commit):
    """`forwards` per row = its prefill (only with a full prompt block) + one per denoising step it was active
    + (separate commits) one per block it finished and moved on from; `total_forwards` = one prefill (if any row
    has a full prompt block) + the batch's denoising steps (the CPU checks "all finished?" every step) + one per
    step at which some row's commit was due. All derived from the recorded step maps (a row's step k is the
    batch's step k: every row is active from step 0 until it finishes). The positions the forwards run over
    (their chunk lengths) are those and no more: finished rows cost nothing."""
    bs = 4
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=13, eos_ids=(EOS,), fold_commit=fold_commit)
    real, positions = model.hidden_cached, []

    def spy(input_ids, cache, cache_lens, chunk_lens, *args, **kwargs):
        positions.append(int(chunk_lens.sum()))
        return real(input_ids, cache, cache_lens, chunk_lens, *args, **kwargs)

    monkeypatch.setattr(model, "hidden_cached", spy)
    for prompts in (prompts_of([1, 3, 4, 5, 9, 2, 7], seed=11), prompts_of([1, 3, 2], seed=12)):  # no prefill
        positions.clear()
        ro = generate(model, prompts, cfg)
        want_positions, commit_steps = 0, set()
        for i, p in enumerate(prompts):
            smap = ro.seq_step_map[i]
            decoded = [b for b in range(smap.shape[0] // bs) if (smap[b * bs : (b + 1) * bs] >= 0).any()]
            assert decoded == list(range(len(p) // bs, decoded[-1] + 1))
            ends = [int(smap[b * bs : (b + 1) * bs].max()) for b in decoded[:-1]]  # the row moved on after these
            commit_steps |= set(ends)
            want = int(len(p) >= bs) + int(smap.max()) + 1 + (0 if fold_commit else len(ends))
            assert int(ro.forwards[i]) == want, (i, int(ro.forwards[i]), want)
            # prefill: the full prompt blocks; a step: the block (+ the folded finished one); a commit: a block
            want_positions += len(p) // bs * bs + (int(smap.max()) + 1 + len(ends)) * bs
        assert len(set(ro.seq_step_map.amax(1).tolist())) > 1  # rows finished at different steps
        prefill = int(any(len(p) >= bs for p in prompts))
        want_total = prefill + int(ro.seq_step_map.max()) + 1 + (0 if fold_commit else len(commit_steps))
        assert ro.total_forwards == want_total and sum(positions) == want_positions


@pytest.mark.parametrize("bs,s,schedule", [(4, 3, [2, 1, 1]), (8, 3, [3, 3, 2]), (4, 6, [1, 1, 1, 1])])
def test_quota_rule_spreads_the_remainder_over_the_first_steps(model, bs, s, schedule):
    """SDAR's quota rule: step k of a block unmasks at least B // S + (k < B % S) positions (REFERENCE §2), here
    exactly that many (the threshold is unreachable) until the block's masked positions run out."""
    prompts = prompts_of([3, 6, 8, 1], seed=4)
    cfg = SamplerConfig(block_size=bs, rule="quota", steps_per_block=s, threshold=1.01, temperature=0,
                        max_new_tokens=13, eos_ids=(1,))
    ro = generate(model, prompts, cfg)
    assert not ro.eos_found.any()  # every block decoded
    for i, p in enumerate(prompts):
        smap = ro.seq_step_map[i].tolist()
        step, blocks = 0, 0
        for b in range(len(p) // bs, len(smap) // bs):
            got = [smap[x] for x in range(max(b * bs, len(p)), b * bs + bs)]
            if all(x == -2 for x in got):  # not decoded (after the EOS block)
                break
            want, left = [], len(got)
            for k, n in enumerate(schedule):
                n = min(n, left)
                want += [step + k] * n
                left -= n
            assert left == 0 and sorted(got) == want, (i, b, got, want)
            step = want[-1] + 1
            blocks += 1
        assert blocks >= 2


@pytest.fixture(scope="module")
def wide_model():
    """A vocabulary of two sampling buckets (1301 > 1024): two-level and per-token noise pick differently."""
    cfg = SDARConfig(vocab_size=1301, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, block_size=4, mask_token_id=1300, torch_dtype="float32",
                     max_position_embeddings=64)
    return build_model(cfg, dtype=torch.float64, seed=3).eval()


@pytest.mark.parametrize("which,kw", [
    ("model", dict(temperature=0.7, threshold=0.4, seed=1)),
    ("model", dict(temperature=1.3, top_k=9, top_p=0.85, threshold=0.2, noise="per_token", seed=5)),
    ("wide_model", dict(temperature=1.0, threshold=0.02, noise="per_token", seed=2)),
    ("wide_model", dict(temperature=0.8, top_p=0.9, threshold=0.02, seed=2)),
])
def test_sampled_decoding_equals_nocache_decoding(request, which, kw):
    """Sampling through the sampler (KV cache, folded commits, rows at different blocks) equals the no-cache
    oracle that calls the op with the config's temperature / top-k / top-p / noise / seed, the row's index and
    the step's Philox offset: tokens, step map, log-probs and confidences under the tempered distribution."""
    m = request.getfixturevalue(which)
    prompts = prompts_of([3, 6, 1, 9], seed=13)
    cfg = SamplerConfig(max_new_tokens=10, eos_ids=(EOS,), compact=False, **kw)  # rows keep their index
    ro = generate(m, prompts, cfg)
    greedy = generate(m, prompts, dataclasses.replace(cfg, temperature=0))
    assert not torch.equal(ro.tokens, greedy.tokens)
    for i, p in enumerate(prompts):
        resp, smap, lp, _ = nocache_decode(m, p, cfg, row=i, rows=len(prompts))
        want = truncate_at_eos(resp.tolist())
        n = len(want)
        assert ro.response_ids(i) == want, i
        assert ro.step_map[i, :n].tolist() == smap[:n].tolist()
        torch.testing.assert_close(ro.logp[i, :n].double(), lp[:n], rtol=2.4e-7, atol=1e-9)
        torch.testing.assert_close(ro.conf[i, :n].double(), lp[:n].exp(), rtol=2.4e-7, atol=1e-9)


def test_sampling_is_deterministic_per_seed(model):
    prompts = prompts_of([3, 8, 5])
    cfg = SamplerConfig(threshold=0.5, temperature=1.0, max_new_tokens=16, eos_ids=(EOS,), seed=7)
    a, b = generate(model, prompts, cfg), generate(model, prompts, cfg)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logp, b.logp)
    c = generate(model, prompts, dataclasses.replace(cfg, seed=8))
    assert not torch.equal(a.tokens, c.tokens)
    # per-token noise: with one bucket (vocab 111 <= 1024) two-level sampling draws the same per-token noise
    # inside the only bucket, so the two samplers give the same tokens
    d = generate(model, prompts, dataclasses.replace(cfg, noise="per_token"))
    assert torch.equal(a.tokens, d.tokens) and torch.equal(a.logp, d.logp)


def test_compaction_does_not_change_results(model):
    prompts = prompts_of([2, 3, 4, 5, 6, 7, 8, 9], seed=5)
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=18, eos_ids=(EOS,))
    a = generate(model, prompts, cfg)
    b = generate(model, prompts, dataclasses.replace(cfg, compact=False))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.step_map, b.step_map)


@pytest.mark.parametrize("noise", ["two_level", "per_token"])
def test_sampled_tokens_do_not_depend_on_compaction_or_the_check_cadence(model, monkeypatch, noise):
    """A row draws the noise of its index in the request (threshold_unmask's noise_rows), not of its place in the
    working set: sampled decoding gives the same rollout with compaction on or off, with the host checked every
    step (the CPU's cadence, where compactions happen as soon as they can) or every 2 or 3 steps (CUDA's: they
    happen later, so rows sit at other places in between), packed or not. Rows finish at different steps (EOS,
    prompt lengths), so the working set is compacted once or more in every run."""
    import lightningrl_fast.sampler as sampler

    prompts = prompts_of([2, 3, 4, 5, 6, 7, 8, 9, 11, 1, 6, 3], seed=25)
    cfg = SamplerConfig(threshold=0.5, temperature=1.0, max_new_tokens=26, eos_ids=(EOS,), seed=13, noise=noise)
    want = generate(model, prompts, dataclasses.replace(cfg, compact=False))
    compactions = []
    real = sampler.Decoder._compact
    monkeypatch.setattr(sampler.Decoder, "_compact", lambda self, *a: (compactions.append(1), real(self, *a))[1])
    for every in (1, 2, 3):
        monkeypatch.setattr(sampler, "_host_check_every", lambda c, dev, every=every: every)
        for pack in ("off", "on"):
            compactions.clear()
            got = generate(model, prompts, dataclasses.replace(cfg, pack=pack))
            assert compactions, (every, pack)
            # the engine's own forward count follows the cadence (steps past the last row's end until a check)
            assert_same_rollout(dataclasses.replace(got, total_forwards=want.total_forwards), want)


def assert_same_rollout(a, b):
    for name in ("sequences", "seq_step_map", "tokens", "response_mask", "step_map", "logp", "conf", "lengths",
                 "forwards", "eos_found"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and torch.equal(x, y), name
    assert a.total_forwards == b.total_forwards and a.finish_reason == b.finish_reason


@pytest.mark.parametrize("kw", [
    dict(temperature=0, threshold=0.3),  # greedy, folded commits
    dict(temperature=0.8, threshold=0.4, seed=3),  # sampled: the same noise per row and step
    dict(temperature=0, threshold=0.2, fold_commit=False),  # separate commits (packed to the pending rows)
    dict(temperature=0, rule="quota", steps_per_block=2, block_size=8),  # all rows fold on the same steps
    dict(temperature=1.0, threshold=0.9, compact=False, seed=9),  # finished rows stay in the working set
])
def test_packed_steps_equal_unpacked_steps(model, monkeypatch, kw):
    """pack="on" runs every forward (prefill, denoising steps, separate commits) on the rows' chunk tokens packed
    into a static number of slots (rounded up: padding slots included) instead of the [rows, 2B] chunk: the same
    rollout, bit for bit, as pack="off" (on the CPU the unpacked path packs exactly the valid tokens itself)."""
    import lightningrl_fast.model as model_mod

    real, seen = model_mod._Packing.static, []

    def spy(chunk_lens, c, capacity):
        seen.append((int(chunk_lens.clamp(0, c).sum()), capacity, chunk_lens.shape[0] * c))
        return real(chunk_lens, c, capacity)

    monkeypatch.setattr(model_mod._Packing, "static", staticmethod(spy))
    prompts = prompts_of([1, 3, 4, 5, 9, 13, 2, 8, 11], seed=3)  # prompt tails of every length, full blocks to prefill
    cfg = SamplerConfig(max_new_tokens=21, eos_ids=(EOS,), **kw)
    a = generate(model, prompts, dataclasses.replace(cfg, pack="off"))
    assert not seen  # the CPU default never packs statically
    b = generate(model, prompts, dataclasses.replace(cfg, pack="on"))
    assert_same_rollout(a, b)
    assert seen and all(valid <= cap < full for valid, cap, full in seen)  # packed, never past its slots
    assert any(valid < cap for valid, cap, _ in seen)  # padding slots were exercised
    bs = cfg.block_size or model.config.block_size
    # exactly the rule: the prefill and the separate commits their own token counts, a denoising step its active
    # rows' blocks (1 or 2 each) rounded up by _pack_rows
    assert all(cap in (valid, _pack_rows(valid // bs) * bs) for valid, cap, _ in seen), seen
    if not kw.get("fold_commit", True):
        assert any(valid == cap for valid, cap, _ in seen)  # the commit forwards: exactly the pending rows


@pytest.mark.parametrize("kw", [
    dict(temperature=0, threshold=0.3),
    dict(temperature=0.8, threshold=0.4, seed=3, fold_commit=False),
    dict(temperature=0, rule="quota", steps_per_block=2, block_size=8),  # 4 positions a step, all rows alike
])
def test_packed_steps_run_the_lm_head_on_masked_positions_only(model, monkeypatch, kw):
    """A packed step runs the LM head on the current blocks' masked positions of the rows still decoding, a count
    the host read at the previous step's check, not on all rows x B positions: exactly the positions the unmask
    scans (counted at its call as masked & quota > 0, each mapped by logit_rows to a distinct row of the compact
    logits); the rollout is the unpacked one."""
    import lightningrl_fast.sampler as sampler

    real_step, real_head, real_unmask = sampler._unmask_step, model.decode_logits, sampler.threshold_unmask
    steps, heads, unmasks = [], [], []

    def spy(model_, st, cfg, bs, eos_ids, h, lm_rows=None):
        steps.append((lm_rows, int(sampler._scanned(st, bs).sum()), h.shape[0] * bs))
        return real_step(model_, st, cfg, bs, eos_ids, h, lm_rows)

    def spy_unmask(logits, tokens, masked, *args, logit_rows=None, **kw):
        quota = args[4]
        scanned = masked & (quota > 0)[:, None]
        if logit_rows is not None:
            rows = logit_rows[scanned]  # each scanned position's row: distinct, all of the compact logits
            assert sorted(rows.tolist()) == list(range(logits.shape[0])), (rows, logits.shape)
        unmasks.append(int(scanned.sum()))
        return real_unmask(logits, tokens, masked, *args, logit_rows=logit_rows, **kw)

    monkeypatch.setattr(sampler, "_unmask_step", spy)
    monkeypatch.setattr(sampler, "threshold_unmask", spy_unmask)
    monkeypatch.setattr(model, "decode_logits", lambda h: heads.append(h.shape[:-1].numel()) or real_head(h))
    prompts = prompts_of([1, 3, 4, 5, 9, 13, 2, 8, 11], seed=5)
    cfg = SamplerConfig(max_new_tokens=21, eos_ids=(EOS,), **kw)
    a = generate(model, prompts, dataclasses.replace(cfg, pack="off"))
    assert all(lm is None for lm, _, _ in steps) and heads == [full for _, _, full in steps]
    steps.clear(), heads.clear(), unmasks.clear()
    b = generate(model, prompts, dataclasses.replace(cfg, pack="on"))
    assert_same_rollout(a, b)
    assert steps and all(lm == exact for lm, exact, _ in steps), steps
    assert heads == [lm for lm, _, _ in steps] == unmasks  # the LM head's rows: the positions the unmask scans
    assert sum(heads) < 0.8 * sum(full for _, _, full in steps)


def test_packed_steps_check_for_the_end_every_step(model, monkeypatch):
    """A packed step reads the device before it anyway, so the "all finished?" check runs after every packed step
    whatever the CUDA cadence (`sync_every`): no step runs after the last row finished (forced cadence on the CPU)."""
    import lightningrl_fast.sampler as sampler

    prompts = prompts_of([3, 6, 9, 2], seed=23)
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=13, eos_ids=(EOS,), pack="on", sync_every=16)
    want = generate(model, prompts, cfg)  # the CPU's check after every step
    monkeypatch.setattr(sampler, "_host_check_every", lambda cfg, dev: cfg.sync_every)
    assert_same_rollout(generate(model, prompts, cfg), want)  # total_forwards included
    unpacked = dataclasses.replace(cfg, pack="off")
    assert generate(model, prompts, unpacked).total_forwards > want.total_forwards  # (the cadence does apply there)


def test_decoder_keeps_its_most_recently_used_graphs(model, monkeypatch):
    """`Decoder._graph` (CUDA graphs, bookkeeping checked on the CPU with a stand-in step): one capture per (step
    parameters, working-set size, packed size); at the limit the least recently used graph goes (a replayed one
    counts as used), the pool and stream stay; the limit is never below 2, so the pool always keeps a live graph
    when a capture needs it."""
    import lightningrl_fast.sampler as sampler

    made = []

    class Fake:
        def __init__(self, fn, pool, stream):
            made.append(fn)
            self.pool, self.stream = pool, stream

    monkeypatch.setattr(sampler, "_GraphedStep", Fake)
    monkeypatch.setattr(sampler.torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(sampler, "_capture_stream", lambda dev: "stream")
    monkeypatch.setattr(sampler, "_MAX_GRAPHS", 3)
    dec = Decoder(model)
    dev = torch.device("cpu")
    g1 = dec._graph("sig", 8, None, lambda: "step 8", dev)
    g2 = dec._graph("sig", 8, 40, lambda: "step 8 packed", dev)
    assert dec._graph("sig", 8, None, lambda: "again", dev) is g1 and made == ["step 8", "step 8 packed"]
    dec._graph("sig", 4, None, lambda: "step 4", dev)
    dec._graph("other", 8, None, lambda: "other", dev)  # full: (sig, 8, 40) was used least recently
    assert list(dec._graphs) == [("sig", 8, None), ("sig", 4, None), ("other", 8, None)]
    assert g2 not in dec._graphs.values()
    assert all(g.pool == "pool" and g.stream == "stream" for g in dec._graphs.values())
    monkeypatch.setattr(sampler, "_MAX_GRAPHS", 1)  # taken as 2
    dec._graph("sig", 2, None, lambda: "step 2", dev)
    assert list(dec._graphs) == [("other", 8, None), ("sig", 2, None)]


@pytest.mark.parametrize("kernels, pdl, outcomes", [
    (True, None, ["fail", "ok"]),  # PDL was in play and its retry captured: it stays off
    (True, "1", ["fail", "fail"]),  # the retry failed too: not PDL's doing, its switch as it was
    (False, None, ["fail"]),  # the references ran (no kernels): no PDL to blame, no retry
    (True, "0", ["fail"]),  # PDL already off: no retry
])
def test_capture_failure_blames_pdl_only_when_it_was_in_play(monkeypatch, kernels, pdl, outcomes):
    """`_GraphedStep`'s fallback (run on the CPU with stand-ins for the CUDA graph API): a failed capture is
    retried without programmatic dependent launch only when the step's kernels launched with it; LRF_PDL is
    set to 0 for the process only when the retry then captures, and gets its old value back otherwise."""
    import lightningrl_fast.sampler as sampler

    if pdl is None:
        monkeypatch.delenv("LRF_PDL", raising=False)
    else:
        monkeypatch.setenv("LRF_PDL", pdl)
    monkeypatch.setattr(sampler, "_kernels_launch", lambda device: kernels)
    seen = []

    class Capture:
        def __init__(self, graph, pool=None, stream=None):
            seen.append((os.environ.get("LRF_PDL"), pool))

        def __enter__(self):
            if outcomes[len(seen) - 1] == "fail":
                raise RuntimeError("simulated capture failure")

        def __exit__(self, *exc):
            return False

    cuda = sampler.torch.cuda
    monkeypatch.setattr(cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(cuda, "graph", Capture)
    monkeypatch.setattr(cuda, "current_stream", lambda d=None: "current")
    monkeypatch.setattr(cuda, "set_stream", lambda s: None)
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: "new pool")
    ran = []
    step = sampler._GraphedStep(lambda: ran.append(1), "pool", type("S", (), {"device": "cuda:0"})())
    with pytest.warns(RuntimeWarning) as warned:
        step()
    # the eager first call, and (this stand-in runs what it captures) the body of a capture that succeeded
    assert len(seen) == len(outcomes) and len(ran) == 1 + (outcomes[-1] == "ok")
    assert seen[0] == (pdl, "pool") and all(p == ("0", "new pool") for p in seen[1:])  # a retry: PDL off, own pool
    assert (step.graph == "graph") == (outcomes[-1] == "ok") and step.failed == (outcomes[-1] == "fail")
    assert os.environ.get("LRF_PDL") == ("0" if outcomes == ["fail", "ok"] else pdl)
    assert [("retrying" in str(w.message), "eagerly" in str(w.message)) for w in warned] == (
        [(True, False)] + ([(False, True)] if outcomes[-1] == "fail" else []) if len(outcomes) == 2
        else [(False, True)])


def test_pack_sizes():
    assert [_pack_rows(n) for n in range(1, 18)] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20]
    assert [_pack_rows(n) for n in (31, 33, 100, 256, 257, 300, 513)] == [32, 40, 112, 256, 320, 320, 640]
    for n in range(1, 5000):  # never below n, at most 25% above it
        assert n <= _pack_rows(n) <= max(n, 8) * 1.25


def test_bucket_sizes():
    assert [_bucket(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert _bucket(97) == 128 and _bucket(129) == 192 and _bucket(192) == 192 and _bucket(193) == 256


def test_decoder_reused_across_calls_equals_fresh_calls(model, monkeypatch):
    """One Decoder over calls of different sizes (its buffers grow, later calls are narrower and smaller than
    them, a call repeats) gives exactly what a fresh generate() gives each time, compaction included."""
    compactions = []
    real = Decoder._compact

    def spy(self, st, cache, keep):
        compactions.append((st.seq.shape[0], keep.numel()))
        return real(self, st, cache, keep)

    monkeypatch.setattr(Decoder, "_compact", spy)
    greedy = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=18, eos_ids=(EOS,))
    calls = [
        (prompts_of([9, 2, 5], seed=1), dataclasses.replace(greedy, max_new_tokens=30)),
        (prompts_of([1, 3, 4, 5, 6, 7, 8, 2, 3, 11, 4, 6, 5], seed=2), greedy),  # more rows: the buffers grow
        (prompts_of([2, 3], seed=3), dataclasses.replace(greedy, temperature=1.0, threshold=0.6, seed=4)),
        (prompts_of([9, 2, 5], seed=1), dataclasses.replace(greedy, max_new_tokens=30)),
        (prompts_of([4, 5, 6, 2, 7, 3, 8, 9], seed=5), dataclasses.replace(greedy, rule="quota", steps_per_block=2)),
        (prompts_of([40, 3], seed=7), dataclasses.replace(greedy, max_new_tokens=30)),  # longer: the width grows
    ]
    dec = Decoder(model)
    for prompts, cfg in calls:
        got = dec.generate(prompts, cfg)
        assert dec.capacity[0] >= len(prompts) and dec.capacity[1] % 4 == 0
        assert_same_rollout(got, generate(model, prompts, cfg))
        assert_same_rollout(got, generate(model, prompts, dataclasses.replace(cfg, compact=False)))
    assert dec.capacity == (13, 72)  # rows: the largest call; positions: the longest (40 + 30 in blocks of 4)
    assert compactions and all(m == _bucket(m) and 2 * m <= n for n, m in compactions)
    dec.release()
    assert dec.capacity == (0, 0)


def test_decoder_sees_in_place_weight_updates(model):
    """The trainer updates the shared weights in place between rollouts: a kept Decoder decodes with the new
    weights (on CUDA its captured steps read them at replay)."""
    m = build_model(model.config, dtype=torch.float64, seed=1).eval()
    prompts = prompts_of([2, 5, 7], seed=6)
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=16, eos_ids=(EOS,))
    dec = Decoder(m)
    before = dec.generate(prompts, cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    after = dec.generate(prompts, cfg)
    assert_same_rollout(after, generate(m, prompts, cfg))
    assert not torch.equal(before.logp, after.logp)


def test_replaced_weights_drop_the_graphs_with_their_pool(model):
    """Replaced parameters drop the captured steps AND their memory pool: a CUDA graph pool whose graphs are all
    gone cannot take a new capture while a block stays in it (torch's allocator asserts its use count > 0; the
    capture stream's cuBLAS workspace stays there), so reusing it would make every later capture fail. The capture
    stream is kept. Checked on the host bookkeeping: on the CPU nothing is captured, so a stand-in pool must go."""
    m = build_model(model.config, dtype=torch.float64, seed=2).eval()
    prompts = prompts_of([3, 6], seed=8)
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=8, eos_ids=(EOS,))
    dec = Decoder(m)
    first = dec.generate(prompts, cfg)
    pool, stream = object(), object()
    dec._pool, dec._stream, dec._graphs = pool, stream, {"step": object()}
    assert_same_rollout(dec.generate(prompts, cfg), first)  # the same weights: everything kept
    assert dec._pool is pool and dec._stream is stream and "step" in dec._graphs
    m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
    assert_same_rollout(dec.generate(prompts, cfg), first)
    assert dec._pool is None and dec._stream is stream and dec._graphs == {}


@pytest.mark.parametrize("fold_commit", [True, False])
@pytest.mark.parametrize("bs,new,sync_every,prompts", [(4, 7, 16, [[17], [23, 41]]), (2, 5, 4, [[17]]),
                                                        (4, 6, 8, [[17], [23, 41, 5]])])
def test_host_check_at_the_last_step(model, monkeypatch, bs, new, sync_every, prompts, fold_commit):
    """CUDA checks "all finished?" every `sync_every` steps; decoding that ends after the last multiple of it
    below the step limit must still be seen as finished (it raised "did not finish"). Forced here on the CPU,
    which otherwise checks every step; tau 1.0 unmasks one token per step, so the last step is needed."""
    import lightningrl_fast.sampler as sampler

    cfg = SamplerConfig(block_size=bs, threshold=1.0, temperature=0, max_new_tokens=new, eos_ids=(0,),
                        sync_every=sync_every, fold_commit=fold_commit)
    want = generate(model, prompts, cfg)  # the CPU's check every step
    max_steps = want.sequences.shape[1] + 1  # the decoder's step limit: Ltot + 1
    steps = int(want.seq_step_map.max()) + 1
    assert not want.eos_found.any() and steps > max_steps // sync_every * sync_every  # the case of the bug
    monkeypatch.setattr(sampler, "_host_check_every", lambda cfg, dev: cfg.sync_every)
    got = generate(model, prompts, cfg)
    assert_same_rollout(got, dataclasses.replace(want, total_forwards=got.total_forwards))
    assert got.total_forwards > want.total_forwards  # the steps run after every row finished, before the check


def spy_on_prefill(monkeypatch, model, record) -> None:
    """`record(input_ids, chunk_lens)` for every forward the sampler runs inside its "prefill" NVTX range."""
    import contextlib

    import lightningrl_fast.sampler as sampler

    ranges, real_range, real_hidden = [], sampler.nvtx_range, model.hidden_cached

    @contextlib.contextmanager
    def named(name):
        ranges.append(name)
        with real_range(name):
            yield
        ranges.pop()

    def spy(input_ids, cache, cache_lens, chunk_lens, *args, **kwargs):
        if ranges and ranges[-1] == "prefill":
            record(input_ids, chunk_lens)
        return real_hidden(input_ids, cache, cache_lens, chunk_lens, *args, **kwargs)

    monkeypatch.setattr(sampler, "nvtx_range", named)
    monkeypatch.setattr(model, "hidden_cached", spy)


@pytest.mark.parametrize("pack", ["off", "on"])
def test_rows_with_the_same_prompt_prefix_prefill_once(model, monkeypatch, pack):
    """Rows whose prompts share their whole-block prefix (an RL group's G samples; or prompts that differ only in
    the tail after their last whole block) run no prefill tokens of their own: the first such row's prefill is
    computed, and its cache rows are copied. Every row still decodes as the no-cache oracle says (greedy and
    sampled, the copies in any order, chunked prefill across them) and counts its prefill forward."""
    import lightningrl_fast.sampler as sampler

    a, b, c = prompts_of([9, 6, 13], seed=21)
    tail = a[:8] + [a[8] + 1]  # a's two whole blocks, another tail token
    prompts = [a, b, a, c, tail, a[:3], b, a, c, a[:3]]
    computed = []
    spy_on_prefill(monkeypatch, model, lambda ids, chunk_lens: computed.append(chunk_lens.tolist()))
    for cfg in (SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=11, eos_ids=(EOS,), pack=pack),
                SamplerConfig(threshold=0.5, temperature=1.0, max_new_tokens=11, eos_ids=(EOS,), pack=pack, seed=4,
                              compact=False)):
        for limit in (None, 30):  # one prefill forward; chunks of 30 // 12 = 2 rows (copies' sources elsewhere)
            computed.clear()
            with monkeypatch.context() as mp:
                if limit:
                    mp.setattr(sampler, "_PREFILL_TOKENS", limit)
                ro = generate(model, prompts, cfg)
            assert len(computed) == (2 if limit else 1), computed  # rows 0-1 (a, b), 2-3 (a's copy, c); no others
            lens = [n for chunk in computed for n in chunk]
            # rows 0 (a), 1 (b), 3 (c) compute 8, 4, 12 positions; the rest copy (5: no whole block; 4: a's)
            assert sorted(n for n in lens if n) == [4, 8, 12], computed
            for i, p in enumerate(prompts):
                want = nocache_decode(model, p, cfg, row=i, rows=len(prompts))
                toks = truncate_at_eos(want.tokens.tolist())
                assert ro.response_ids(i) == toks, i
                assert ro.step_map[i, : len(toks)].tolist() == want.step_map[: len(toks)].tolist(), i
                torch.testing.assert_close(ro.logp[i, : len(toks)].double(), want.logp[: len(toks)], rtol=2.4e-7,
                                           atol=1e-9)
                assert int(ro.forwards[i]) == want.forwards, i


def test_prefix_sources():
    assert sampler_prefix_sources([[1, 2, 3], [1, 2, 4], [1, 2, 3], [5], [1, 2]], [2, 2, 2, 0, 2]) == [0, 0, 0, 3, 0]
    assert sampler_prefix_sources([[1], [1]], [0, 0]) == [0, 1]  # no whole block: nothing to share
    assert sampler_prefix_sources([[1, 2, 3, 4], [1, 2, 3, 5]], [4, 0]) == [0, 1]


def test_prefill_in_row_chunks_equals_one_forward(model, monkeypatch):
    """The prefill runs in row chunks of at most `_PREFILL_TOKENS` positions (bounded activations on CUDA)
    and writes the same cache as one forward over every row: the decodes are identical."""
    import lightningrl_fast.sampler as sampler

    prompts = prompts_of([13, 2, 5, 9, 1, 14, 6, 12, 3, 8], seed=9)  # full blocks 12, 0, 4, 8, 0, 12, 4, ...
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=15, eos_ids=(EOS,))
    sampled = dataclasses.replace(cfg, temperature=1.0, threshold=0.6, seed=2)
    shapes = []
    want = [generate(model, prompts, c) for c in (cfg, sampled)]  # the default: one prefill forward
    spy_on_prefill(monkeypatch, model, lambda ids, chunk_lens: shapes.append(tuple(ids.shape)))
    for limit in (1, 24, 40):
        monkeypatch.setattr(sampler, "_PREFILL_TOKENS", limit)
        for c, w in zip((cfg, sampled), want):
            shapes.clear()
            assert_same_rollout(generate(model, prompts, c), w)
            assert len(shapes) > 1 and all(r * n <= max(limit, 12) for r, n in shapes), shapes
            assert sum(r for r, _ in shapes) <= len(prompts)


def test_bad_requests(model):
    cfg = SamplerConfig(temperature=0, max_new_tokens=8, eos_ids=(EOS,))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[5], []], cfg)
    with pytest.raises(ValueError, match=r"300 prompt tokens \+ max_new_tokens 8 = 308 positions, more than the 256 the cache holds"):
        generate(model, [[5] * 300], cfg)
    with pytest.raises(ValueError, match=r"prompt 0 has token id\(s\) \[111\] outside the model's vocabulary \[0, 111\)"):
        generate(model, [[5, 111]], cfg)
    with pytest.raises(ValueError, match=r"prompt 0 contains the mask token id 110 \(position 1\)"):
        generate(model, [[5, MASK]], cfg)
    with pytest.raises(ValueError, match="no prompts"):
        generate(model, [], cfg)
    with pytest.raises(ValueError, match="rule must be"):
        generate(model, [[5]], dataclasses.replace(cfg, rule="fast"))
    with pytest.raises(ValueError, match="noise must be one of"):
        generate(model, [[5]], dataclasses.replace(cfg, noise="bucket"))
    with pytest.raises(ValueError, match=r"pack must be one of \('auto', 'on', 'off'\), got 'yes'"):
        generate(model, [[5]], dataclasses.replace(cfg, pack="yes"))
    for s in (0, -1):  # a negative S decoded every block in one step, 0 fell back to the block size, silently
        with pytest.raises(ValueError, match=f"steps_per_block must be >= 1 .*got {s}"):
            generate(model, [[5]], dataclasses.replace(cfg, rule="quota", steps_per_block=s))
    for name in ("sync_every", "max_length"):  # sync_every 0 divided by zero on CUDA; max_length 0 meant "no cap"
        with pytest.raises(ValueError, match=f"{name} must be >= 1, got 0"):
            generate(model, [[5]], dataclasses.replace(cfg, **{name: 0}))
    for bad in ({"threshold": float("nan")}, {"temperature": float("nan")}, {"temperature": float("inf")}):
        with pytest.raises(ValueError, match="threshold and temperature must be finite"):
            generate(model, [[5]], dataclasses.replace(cfg, **bad))


def test_sampler_block_size_overrides_the_model_config(model):
    """Decoding a block-4 checkpoint with block 8 equals decoding the same weights configured for block 8."""
    import copy

    prompts = prompts_of([3, 9, 12], seed=2)
    cfg = SamplerConfig(block_size=8, threshold=0.2, temperature=0, max_new_tokens=14, eos_ids=(EOS,))
    a = generate(model, prompts, cfg)
    as8 = copy.deepcopy(model)
    as8.config = dataclasses.replace(model.config, block_size=8)
    b = generate(as8, prompts, dataclasses.replace(cfg, block_size=None))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.step_map, b.step_map)
    c = generate(model, prompts, dataclasses.replace(cfg, block_size=None))
    assert not torch.equal(a.step_map, c.step_map)


# ------------------------------------------------------------------------------------------- on a GPU


def _on_cuda(model, dtype):
    """A model for the GPU tests: the CPU fixture's shape but head_dim 64, so that the block-attention and
    q/k-norm kernels run (they take head_dim 64 or 128); `model` is unused beyond its config."""
    cfg = dataclasses.replace(model.config, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    return build_model(cfg, dtype=torch.float64, seed=0).eval().to(device="cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.filterwarnings("error:CUDA graph capture")  # a failed capture would compare eager with eager
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_graphs_equal_eager(model, dtype):
    """The captured step replays exactly what the eager step computes (tokens, steps, log-probs, forwards)."""
    m = _on_cuda(model, dtype)
    prompts = prompts_of([1, 3, 4, 5, 9, 12, 2, 7], seed=11)
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=22, eos_ids=(EOS,), cuda_graphs=True)
    a = generate(m, prompts, cfg)
    b = generate(m, prompts, dataclasses.replace(cfg, cuda_graphs=False))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.step_map, b.step_map)
    assert torch.equal(a.logp, b.logp) and torch.equal(a.forwards, b.forwards)
    assert a.total_forwards == b.total_forwards


@pytest.mark.gpu
@pytest.mark.filterwarnings("error:CUDA graph capture")  # the reference ops' step must capture too
def test_gpu_kernels_equal_reference_ops(model, monkeypatch):
    """float32 weights, greedy, quota rule: the CUDA unmask / cache-write kernels and the PyTorch references give
    the same tokens and steps (block attention has no fp32 kernel, so both runs use its reference). Both steps
    are captured in CUDA graphs: the references keep static shapes and never read the device on the host (the
    cache-write reference used to gather its pairs with a `nonzero`, so capture failed and was blamed on PDL)."""
    m = _on_cuda(model, torch.float32)
    prompts = prompts_of([2, 4, 6, 9, 13], seed=12)
    cfg = SamplerConfig(rule="quota", steps_per_block=2, temperature=0, max_new_tokens=20, eos_ids=(EOS,))
    a = generate(m, prompts, cfg)
    monkeypatch.setenv("LRF_DISABLE_KERNELS", "1")
    b = generate(m, prompts, cfg)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.step_map, b.step_map)
    torch.testing.assert_close(a.logp, b.logp, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("pack", ["off", "on"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_denoise_step_never_syncs_with_the_host(model, monkeypatch, dtype, pack):
    """Every eager denoising step runs under torch.cuda.set_sync_debug_mode('error'): any op that waits for
    the device (.item(), nonzero, a host copy) raises. (fp32 has no block-attention kernel: its reference, which
    writes the cache through the kv_cache_write kernel and keeps static shapes, must not sync either.) A packed
    step too: its one host read (the token count) happens before it, outside."""
    import lightningrl_fast.sampler as sampler

    calls = []

    def strict(real):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return real(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                calls.append(real.__name__)

        return run

    # the two halves of every step (a packed step runs them apart, the LM head on the masked positions)
    monkeypatch.setattr(sampler, "_forward_step", strict(sampler._forward_step))
    monkeypatch.setattr(sampler, "_unmask_step", strict(sampler._unmask_step))
    m = _on_cuda(model, dtype)
    for temperature in (0.0, 1.0):
        cfg = SamplerConfig(threshold=0.5, temperature=temperature, max_new_tokens=12, eos_ids=(EOS,),
                            cuda_graphs=False, pack=pack)
        generate(m, prompts_of([3, 6, 9], seed=13), cfg)
    assert calls.count("_forward_step") > 4 and calls.count("_unmask_step") == calls.count("_forward_step")


@pytest.mark.gpu
def test_gpu_sampling_deterministic_and_compaction_invariant(model):
    """Same seed, same tokens (graphs on, the Philox offset advanced on the device); under greedy decoding,
    compaction (a smaller working set mid-call: a new graph, a smaller unmask batch) changes nothing. (Sampled
    rows keep their noise through a compaction, tested on the CPU; here the GEMMs' size changes with the working
    set, so a bf16 sample may round across a tie.)"""
    m = _on_cuda(model, torch.bfloat16)
    prompts = prompts_of([2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], seed=14)
    cfg = SamplerConfig(threshold=0.6, temperature=1.0, max_new_tokens=24, eos_ids=(EOS,), seed=5)
    a, b = generate(m, prompts, cfg), generate(m, prompts, cfg)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logp, b.logp)
    d = generate(m, prompts, dataclasses.replace(cfg, seed=6))
    assert not torch.equal(a.tokens, d.tokens)
    greedy = dataclasses.replace(cfg, temperature=0.0, threshold=0.3)
    e, f = generate(m, prompts, greedy), generate(m, prompts, dataclasses.replace(greedy, compact=False))
    assert torch.equal(e.tokens, f.tokens) and torch.equal(e.step_map, f.step_map)


@pytest.mark.gpu
@pytest.mark.filterwarnings("error:CUDA graph capture")  # a failed capture would compare eager with eager
def test_gpu_decoder_replays_its_graphs_across_calls(model, monkeypatch):
    """A kept Decoder captures each working-set size once: a repeated call adds no graph and equals an eager
    fresh call; in-place weight updates are read at replay; replaced parameters drop the graphs, and the new
    ones capture (in a new pool: the old one, its graphs gone, would refuse them); a Decoder at its graph limit
    lets the least recently used graph go and captures the new one in the same pool, which keeps a live graph."""
    import lightningrl_fast.sampler as sampler

    m = _on_cuda(model, torch.bfloat16)
    prompts = prompts_of([2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], seed=15)
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=24, eos_ids=(EOS,))
    eager = dataclasses.replace(cfg, cuda_graphs=False)
    dec = Decoder(m)
    assert_same_rollout(dec.generate(prompts, cfg), generate(m, prompts, eager))
    graphs = dict(dec._graphs)
    assert graphs and all(g.graph is not None for g in graphs.values())
    assert_same_rollout(dec.generate(prompts, cfg), generate(m, prompts, eager))
    assert dec._graphs == graphs  # the same graph objects, replayed
    sampled = dataclasses.replace(cfg, temperature=1.0, threshold=0.6, seed=3)
    assert_same_rollout(dec.generate(prompts[:5], sampled), generate(m, prompts[:5], sampled))
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.25)
    assert_same_rollout(dec.generate(prompts, cfg), generate(m, prompts, eager))
    assert dec._graphs.keys() >= graphs.keys()
    m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
    assert_same_rollout(dec.generate(prompts, cfg), generate(m, prompts, eager))
    assert not any(dec._graphs.get(k) is g for k, g in graphs.items())  # stale graphs were dropped
    assert dec._graphs and all(g.graph is not None and not g.failed for g in dec._graphs.values())  # recaptured
    monkeypatch.setattr(sampler, "_MAX_GRAPHS", 2)  # every new step shape now evicts the least recently used
    pool = dec._pool
    for tau in (0.2, 0.4, 0.5):
        tcfg = dataclasses.replace(cfg, threshold=tau)
        want = generate(m, prompts, dataclasses.replace(tcfg, cuda_graphs=False))
        assert_same_rollout(dec.generate(prompts, tcfg), want)
        assert 0 < len(dec._graphs) <= 2 and dec._pool is pool
        assert all(g.graph is not None and not g.failed for g in dec._graphs.values())
    assert dec._stream is sampler._capture_stream(next(m.parameters()).device)  # one per device for every Decoder


@pytest.mark.gpu
@pytest.mark.filterwarnings("error:CUDA graph capture")  # a failed capture would compare eager with eager
def test_gpu_packed_steps(model, monkeypatch):
    """Packed steps on CUDA. bf16: the captured packed steps (one graph per working-set size and packed size)
    replay what the eager packed steps compute, greedy and sampled, and a kept Decoder replays them in a second
    call. fp32: packed and unpacked rollouts agree (tokens and steps exactly; log-probs within rounding: the
    GEMMs run at other sizes). pack="auto" packs a working set of >= 256 rows x block tokens and leaves a
    smaller one unpacked."""
    import lightningrl_fast.model as model_mod

    prompts = prompts_of([1, 3, 4, 5, 9, 13, 2, 8, 11, 6, 7, 12], seed=16)
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=24, eos_ids=(EOS,), pack="on")
    m = _on_cuda(model, torch.bfloat16)
    for c in (cfg, dataclasses.replace(cfg, temperature=1.0, threshold=0.6, seed=4),
              dataclasses.replace(cfg, fold_commit=False)):
        dec = Decoder(m)
        a = dec.generate(prompts, c)
        assert any(k[2] is not None for k in dec._graphs)  # packed sizes were captured
        assert all(g.graph is not None and not g.failed for g in dec._graphs.values())
        assert_same_rollout(a, generate(m, prompts, dataclasses.replace(c, cuda_graphs=False)))
        assert_same_rollout(dec.generate(prompts, c), a)
    m32 = _on_cuda(model, torch.float32)
    a = generate(m32, prompts, cfg)
    b = generate(m32, prompts, dataclasses.replace(cfg, pack="off"))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.step_map, b.step_map)
    assert torch.equal(a.forwards, b.forwards) and a.total_forwards == b.total_forwards
    torch.testing.assert_close(a.logp, b.logp, rtol=1e-5, atol=1e-6)

    real, seen = model_mod._Packing.static, []
    monkeypatch.setattr(model_mod._Packing, "static",
                        staticmethod(lambda lens, c, cap: seen.append(lens.shape[0]) or real(lens, c, cap)))
    auto = dataclasses.replace(cfg, pack="auto", max_new_tokens=8)
    generate(m, prompts_of([4] * 63, seed=17), auto)  # 63 rows x block 4 < 256: unpacked steps
    assert not seen  # (the prompts are whole blocks and unpacked prefills pack nothing either: equal lengths)
    generate(m, prompts_of([4] * 64, seed=17), auto)  # 64 x 4 = 256: packed steps
    assert seen and max(seen) == 64


@pytest.mark.gpu
def test_gpu_rows_with_the_same_prompt_prefix_prefill_once(model):
    """On CUDA (the cache rows copied on the device): under greedy decoding a row whose prompt repeats an earlier
    one decodes exactly as that row (the copied cache holds the same values), and each distinct prompt decodes
    as it does in a batch without repeats (fp32: tokens and steps; log-probs within rounding)."""
    m = _on_cuda(model, torch.float32)
    a, b, c = prompts_of([9, 6, 13], seed=22)
    prompts = [a, b, a, c, a, b, c, c]
    for pack in ("auto", "on", "off"):
        cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=14, eos_ids=(EOS,), pack=pack)
        ro = generate(m, prompts, cfg)
        one = generate(m, [a, b, c], cfg)
        for i, j in enumerate([0, 1, 0, 2, 0, 1, 2, 2]):
            assert ro.response_ids(i) == one.response_ids(j), (pack, i)
            assert torch.equal(ro.step_map[i], one.step_map[j]), (pack, i)
            torch.testing.assert_close(ro.logp[i], one.logp[j], rtol=1e-5, atol=1e-6)
        for i, src in ((2, 0), (4, 0), (5, 1), (6, 3), (7, 3)):
            assert torch.equal(ro.logp[i], ro.logp[src]) and torch.equal(ro.conf[i], ro.conf[src]), (pack, i)


@pytest.mark.gpu
def test_gpu_capture_that_fails_with_pdl_is_retried_without_it(model, monkeypatch):
    """A capture failing with programmatic dependent launch on is retried once with it off (LRF_PDL=0 for the
    process, a warning), in a pool of its own, and then replays the eager tokens; a second failure leaves the step
    eager with its own warning. (The failure is simulated: the first capture's context raises on entry.)"""
    import lightningrl_fast.sampler as sampler

    monkeypatch.delenv("LRF_PDL", raising=False)
    monkeypatch.setenv("LRF_PDL", "1")  # restored after the test, whatever the retry sets
    real_graph, calls = torch.cuda.graph, []

    def flaky_graph(*args, **kwargs):
        calls.append(os.environ.get("LRF_PDL"))
        if len(calls) == 1:
            raise RuntimeError("simulated capture failure")
        return real_graph(*args, **kwargs)

    monkeypatch.setattr(sampler.torch.cuda, "graph", flaky_graph)
    m = _on_cuda(model, torch.bfloat16)
    prompts = prompts_of([1, 3, 4, 5, 9], seed=12)
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=16, eos_ids=(EOS,))
    dec = Decoder(m)
    with pytest.warns(RuntimeWarning, match="with programmatic dependent launch on; retrying with it off"):
        got = dec.generate(prompts, cfg)
    assert calls[:2] == ["1", "0"] and os.environ["LRF_PDL"] == "0"
    assert all(g.graph is not None and not g.failed for g in dec._graphs.values())
    assert_same_rollout(got, generate(m, prompts, dataclasses.replace(cfg, cuda_graphs=False)))
    # without PDL to turn off, one failure is final: eager, with the other warning
    calls.clear()
    with pytest.warns(RuntimeWarning, match="decoding continues eagerly"):
        Decoder(m).generate(prompts, cfg)
    assert calls == ["0"]


@pytest.mark.gpu
def test_gpu_graphs_on_a_device_that_is_not_the_current_one(model):
    """A model on cuda:1 while cuda:0 is current: the step is captured on cuda:1 (a capture on the current
    device's stream recorded none of its kernels and ran them) and replays the eager tokens; the current
    device and cuda:1's current stream are as they were."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    m = _on_cuda(model, torch.bfloat16).to("cuda:1")
    prompts = prompts_of([1, 3, 4, 5, 9, 12, 2, 7], seed=16)
    cfg = SamplerConfig(threshold=0.3, temperature=0, max_new_tokens=22, eos_ids=(EOS,), cuda_graphs=True)
    with torch.cuda.device(0):
        dec = Decoder(m)
        a = dec.generate(prompts, cfg)
        assert dec._graphs and all(g.graph is not None and not g.failed for g in dec._graphs.values())
        assert torch.cuda.current_device() == 0
        assert torch.cuda.current_stream(1) == torch.cuda.default_stream(1)
        b = generate(m, prompts, dataclasses.replace(cfg, cuda_graphs=False))
        assert_same_rollout(a, b)
        assert_same_rollout(dec.generate(prompts, cfg), b)  # replayed


@pytest.mark.gpu
def test_gpu_decoder_refuses_a_cache_that_cannot_fit(model):
    cfg = dataclasses.replace(model.config, num_hidden_layers=4096, num_key_value_heads=64, head_dim=128)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="KV cache.*fewer"):
        _check_memory(cfg, 4096, 8192, 4, torch.bfloat16, torch.device("cuda"))
    _check_memory(model.config, 2, 256, 4, torch.bfloat16, torch.device("cuda"))  # a small one passes


def test_prompt_problem_order_and_kinds():
    """One rule for sampler, generate, eval and train: empty, then ids outside the vocabulary, then the mask token,
    then the fit (the last block, aligned at position 0, within the positions)."""
    from lightningrl_fast.sampler import prompt_problem

    def kind(ids, new=8, bs=4, max_length=None, pos=64):
        p = prompt_problem(ids, 111, 110, new, bs, max_length, pos)
        return None if p is None else p.kind

    assert kind([]) == "empty"
    assert kind([111, 110]) == "vocab" and kind([-1]) == "vocab"  # before the mask token
    assert kind([5, 110] * 40) == "mask"  # 80 tokens do not fit 64 positions either: the mask token comes first
    assert kind([5] * 57) == "fit"  # 57 + 8 = 65 > 64
    assert kind([5] * 56) is None  # 56 + 8 = 64, the last block ends at 64
    assert kind([5] * 53, new=8, bs=6, pos=64) == "fit"  # 61 positions fit, but blocks of 6 end at 66 > 64
    assert kind([5] * 53, new=8, bs=6, max_length=66, pos=64) is None  # a longer cache holds the last block
    p = prompt_problem([5, 110, 7], 111, 110, 8, 4, None, 64)
    assert p.text == "contains the mask token id 110 (position 1)"
    assert prompt_problem([7, 200, 300], 111, 110, 8, 4, None, 64).text == \
        "has token id(s) [200, 300] outside the model's vocabulary [0, 111)"
