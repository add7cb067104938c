"""The RL stages: advantages and filtering, rollouts in chunks, train_step, and the whole objective against a
hand-written float64 oracle of REFERENCE §4 (the log-prob passes and packing: test_logprobs.py)."""

import dataclasses

import math

import pytest
import torch

from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.rl.advantages import Scored, compute_advantages, keep_groups, score_rollout
from lightningrl_fast.rl.logging import step_line
from lightningrl_fast.rl.logprobs import batch_logprobs, build_layout_batch
from lightningrl_fast.rl.trainer import (Groups, RLConfig, example_stream, layout_stage, loss_backward_stage,
                                         make_state, micro_batches, rollout_stage, train_step, update_stage)
from lightningrl_fast.sampler import SamplerConfig, cat_rollouts, generate
from lightningrl_fast.tasks.synthetic import SyntheticArithmetic

from conftest import TINY_MASK, TINY_VOCAB, tiny_rl_model, varied_layout_batch

MASK, V = TINY_MASK, TINY_VOCAB


def test_advantages_hand_examples():
    # group 0: acc [1, 0], tpf [2, 2] -> z_acc [1, -1], z_tpf [0, 0]; group 1: acc [1, 1], tpf [1, 3] -> z_tpf [-1, 1]
    sc = Scored(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([2.0, 2.0, 1.0, 3.0]), torch.tensor([0, 0, 1, 1]))
    adv = compute_advantages(sc, tpf_weight=0.5)
    r = torch.tensor([1.0, -1.0, -0.5, 0.5])
    torch.testing.assert_close(adv, (r - r.mean()) / r.std(unbiased=False))
    # single-sample groups: every z-score is 0 -> advantages 0
    sc1 = Scored(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 1, 2]))
    assert torch.equal(compute_advantages(sc1), torch.zeros(3))
    # sum-then-normalize differs from decoupled when the rewards have different scales
    sc2 = Scored(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 5.0, 9.0]), torch.tensor([0, 0, 0]))
    assert not torch.allclose(compute_advantages(sc2, mode="sum"), compute_advantages(sc2))


def test_filtering_and_scoring():
    sc = Scored(torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0]), torch.tensor([2.0, 3.0, 2.0, 2.005, 1.0, 4.0]),
                torch.tensor([0, 0, 1, 1, 2, 2]))
    # group 0 all wrong, group 1 TPF spread 0.005 < 0.01, group 2 kept
    assert keep_groups(sc).tolist() == [False, False, False, False, True, True]
    assert keep_groups(sc, min_tpf_range=0.0).tolist() == [False, False, True, True, True, True]
    # a correct answer without EOS (hit max_new_tokens) counts as wrong
    s = score_rollout([True, True], torch.tensor([2.0, 3.0]), torch.tensor([True, False]), torch.tensor([0, 0]))
    assert s.accuracy.tolist() == [1.0, 0.0]


def test_example_stream_is_resumable():
    a = example_stream(10, 0, 25, seed=3)
    b = example_stream(10, 0, 12, seed=3) + example_stream(10, 12, 13, seed=3)
    assert a == b and sorted(a[:10]) == list(range(10)) and a[:10] != a[10:20]


def test_bf16_model_keeps_fp32_advantages():
    """A bf16 policy: the advantages reach the loss in fp32. On-policy with no KL or NLL the loss is
    -(weighted mean advantage), so a constant advantage 1 + 2^-10 (1.0 in bf16) must scale the loss by itself."""
    model = tiny_rl_model(dtype=torch.bfloat16, peaky=20.0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 100, (n,), generator=g).tolist() for n in [3, 6]]
    ro = generate(model, [p for p in prompts for _ in range(2)],
                  SamplerConfig(threshold=0.5, temperature=1.0, max_new_tokens=8, eos_ids=(3,)))
    groups = Groups(sequences=list(ro.sequences), step_maps=list(ro.seq_step_map), prompt_lens=ro.prompt_lens.tolist(),
                    resp_lens=ro.lengths.tolist(), accuracy=[1.0, 0.0] * 2, tpf=ro.tpf.tolist(),
                    group_ids=[0, 0, 1, 1], texts=[""] * 4)
    lb = layout_stage(groups, 4, MASK, "block_proxy")
    correct = torch.tensor(groups.accuracy) > 0
    cfg = RLConfig(kl_beta=0.0, nll_weight=0.0, group_size=2, prompts_per_step=2)
    losses = []
    for c in (1.0, 1.0 + 2.0**-10):
        model.zero_grad()
        adv_tok = torch.full((lb.num_tokens,), c, dtype=torch.float32)
        losses.append(loss_backward_stage(model, lb, range(4), adv_tok, None, None, correct, cfg)["loss"])
    assert losses[0] != 0.0
    assert losses[1] / losses[0] == pytest.approx(1.0 + 2.0**-10, rel=1e-6)


class HalfRightTask(SyntheticArithmetic):
    """A random model is never right on arithmetic; call a response right when its length is even."""

    def is_correct(self, response, ex):
        return len(response) % 2 == 0


def half_right_config(tok) -> SDARConfig:
    """A one-layer model over the synthetic task's character vocabulary (block 8)."""
    return SDARConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=8,
                      mask_token_id=tok.mask_token_id, torch_dtype="float32", max_position_embeddings=64)


def test_train_step_updates_the_weights_the_sampler_uses():
    task = HalfRightTask(max_operand=4)
    tok = task.tokenizer
    cfg = half_right_config(tok)
    model = build_model(cfg, dtype=torch.float32, seed=0).eval()
    scfg = SamplerConfig(threshold=0.9, temperature=1.0, max_new_tokens=20, eos_ids=tuple(sorted(tok.eos_token_ids)))
    rc = RLConfig(steps=1, prompts_per_step=2, group_size=4, lr=1e-2, kl_beta=0.01, filter_groups=False,
                  max_refill_rounds=0, micro_batch_tokens=4096)
    state = make_state(model, rc)
    before = [p.detach().clone() for p in model.parameters()]
    probe = [tok.encode(task.train[0].prompt)]
    ro_before = generate(model, probe, dataclasses.replace(scfg, temperature=0))
    m = train_step(state, tok, task, task.train, rc, scfg)
    assert state.step == 1 and m["updates"] == 1 and state.cursor == 2
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(a, p) for a, p in zip(before, state.ref_model.parameters()))  # frozen reference
    ro_after = generate(model, probe, dataclasses.replace(scfg, temperature=0))  # same object, new weights
    with torch.no_grad():
        lb = build_layout_batch(ro_after.sequences, ro_after.seq_step_map, ro_after.prompt_lens, ro_after.lengths,
                                8, tok.mask_token_id, "trace")
        lp_new = batch_logprobs(model, lb)
        lp_ref = batch_logprobs(state.ref_model, lb)
    torch.testing.assert_close(lp_new, ro_after.logp[lb.tgt_row, lb.resp_pos], atol=1e-5, rtol=0)
    assert not torch.allclose(lp_new, lp_ref)
    assert ro_before.tokens.shape == ro_after.tokens.shape
    assert m["kl"] == 0.0 and " kl 0.0000 " in step_line(m)  # measured: the first step's policy is the reference
    # kl_beta 0: no reference model, and no KL in the metrics (a 0.0 would read as "the policy has not moved")
    state = make_state(model, dataclasses.replace(rc, kl_beta=0.0))
    m = train_step(state, tok, task, task.train, dataclasses.replace(rc, kl_beta=0.0), scfg)
    assert state.ref_model is None and m["updates"] == 1 and "kl" not in m and " kl - " in step_line(m)


def test_train_step_trains_under_the_rollout_block_size(monkeypatch):
    """Rollouts decoded with another block size than the checkpoint's (SamplerConfig.block_size): the training
    layout uses the rollout's, the mask the samples were drawn under."""
    import lightningrl_fast.rl.trainer as trainer_mod

    seen = []

    def spy(groups, block_size, mask_id, mode):
        seen.append(block_size)
        return layout_stage(groups, block_size, mask_id, mode)

    monkeypatch.setattr(trainer_mod, "layout_stage", spy)
    task = HalfRightTask(max_operand=4)
    tok = task.tokenizer
    model = build_model(half_right_config(tok), dtype=torch.float32, seed=0).eval()  # block 8
    scfg = SamplerConfig(threshold=0.9, temperature=1.0, max_new_tokens=16, eos_ids=tuple(sorted(tok.eos_token_ids)),
                         block_size=4)
    rc = RLConfig(steps=1, prompts_per_step=2, group_size=4, lr=1e-3, filter_groups=False, max_refill_rounds=0,
                  logprob_mode="trace")
    train_step(make_state(model, rc), tok, task, task.train, rc, scfg)
    assert seen and set(seen) == {4}


def test_rollout_in_chunks_of_rollout_batch_size():
    """prompts x G decoded in chunks of rollout_batch_size on one Decoder: greedy gives what one call gives; under
    sampling, chunks draw from different seeds, so a group split across chunks still has independent samples."""
    task = HalfRightTask(max_operand=4)
    tok = task.tokenizer
    cfg = half_right_config(tok)
    model = build_model(cfg, dtype=torch.float64, seed=3).eval()
    eos = tuple(sorted(tok.eos_token_ids))
    greedy = SamplerConfig(threshold=0.9, temperature=0.0, max_new_tokens=20, eos_ids=eos)
    exs = task.train[:3]
    whole, ro_whole = rollout_stage(model, tok, task, exs, RLConfig(group_size=4), greedy, seed=1, group_base=0)
    parts, ro_parts = rollout_stage(model, tok, task, exs, RLConfig(group_size=4, rollout_batch_size=5), greedy,
                                    seed=1, group_base=0)
    assert len(parts) == len(whole) == 12 and parts.group_ids == whole.group_ids
    assert parts.texts == whole.texts and parts.resp_lens == whole.resp_lens and parts.tpf == whole.tpf
    assert parts.accuracy == whole.accuracy
    for a, b in zip(parts.sequences, whole.sequences):
        n = min(len(a), len(b))
        assert torch.equal(a[:n], b[:n])
    assert ro_parts.total_forwards > ro_whole.total_forwards  # three chunks: three prefills and their own steps
    sampled = dataclasses.replace(greedy, temperature=1.0, threshold=0.5)
    g, ro = rollout_stage(model, tok, task, exs[:1], RLConfig(group_size=4, rollout_batch_size=2), sampled, seed=1,
                          group_base=0)
    assert g.group_ids == [0, 0, 0, 0]
    assert not torch.equal(ro.tokens[0], ro.tokens[2]) or not torch.equal(ro.tokens[1], ro.tokens[3])
    with pytest.raises(ValueError, match="rollout_batch_size must be >= 1"):
        RLConfig(rollout_batch_size=0).validate()


def test_rollout_chunks_are_verified_beside_the_decode():
    """Each decoded chunk goes to the verifier on a background thread (while the next chunk decodes), in chunk
    order, with its own examples; the verdicts land on the right samples; a verifier error reaches the caller."""
    import threading

    class Recording(HalfRightTask):
        def __init__(self, fail=False):
            super().__init__(max_operand=4)
            self.calls, self.fail, self.right = [], fail, None

        def is_correct_batch(self, responses, examples):
            self.calls.append((threading.current_thread() is threading.main_thread(), len(responses),
                               [e.id for e in examples]))
            if self.fail:
                raise RuntimeError("verifier broke")
            return [e.id == self.right for e in examples]

    task = Recording()
    tok = task.tokenizer
    model = build_model(half_right_config(tok), dtype=torch.float64, seed=3).eval()
    scfg = SamplerConfig(threshold=0.9, temperature=0.0, max_new_tokens=20, eos_ids=tuple(sorted(tok.eos_token_ids)))
    exs = task.train[:3]
    task.right = exs[1].id  # the second prompt's samples are right: rows 4..7, split across chunks 0 and 1
    g, _ = rollout_stage(model, tok, task, exs, RLConfig(group_size=4, rollout_batch_size=5), scfg, seed=1,
                         group_base=0)
    assert [c[1] for c in task.calls] == [5, 5, 2] and not any(c[0] for c in task.calls)  # off the main thread
    want_ids = [exs[i // 4].id for i in range(12)]
    assert [i for c in task.calls for i in c[2]] == want_ids
    assert g.accuracy == [0.0] * 4 + [1.0] * 4 + [0.0] * 4
    with pytest.raises(RuntimeError, match="verifier broke"):
        rollout_stage(model, tok, Recording(fail=True), exs, RLConfig(group_size=4, rollout_batch_size=5), scfg,
                      seed=1, group_base=0)


def test_rollout_error_drops_the_chunks_not_yet_verified():
    """A decode error (or Ctrl-C) mid-rollout reaches the caller once the chunk being verified is done: the
    chunks still queued for the verifier are dropped, not verified first (slow sandboxes would delay the error)."""
    import threading

    from lightningrl_fast.sampler import Decoder

    release = threading.Event()

    class Slow(HalfRightTask):
        def __init__(self):
            super().__init__(max_operand=4)
            self.calls = 0

        def is_correct_batch(self, responses, examples):
            self.calls += 1
            release.wait(timeout=30)  # the first chunk's verification is still running when the decode fails
            return [False] * len(responses)

    class Failing(Decoder):
        def generate(self, prompts, cfg):
            self.n = getattr(self, "n", 0) + 1
            if self.n == 3:
                threading.Timer(2.0, release.set).start()  # lets the running verification end after the error
                raise RuntimeError("decode broke")
            return super().generate(prompts, cfg)

    task = Slow()
    tok = task.tokenizer
    model = build_model(half_right_config(tok), dtype=torch.float64, seed=3).eval()
    scfg = SamplerConfig(threshold=0.9, temperature=0.0, max_new_tokens=20, eos_ids=tuple(sorted(tok.eos_token_ids)))
    with pytest.raises(RuntimeError, match="decode broke"):
        rollout_stage(model, tok, task, task.train[:3], RLConfig(group_size=4, rollout_batch_size=4), scfg, seed=1,
                      group_base=0, decoder=Failing(model))
    assert task.calls == 1  # chunk 0 verified; chunk 1 (queued behind it) dropped


def test_cat_rollouts_pads_to_the_widest_chunk():
    model = tiny_rl_model()
    cfg = SamplerConfig(threshold=0.5, temperature=0.0, max_new_tokens=9, eos_ids=(3,))
    a, b = generate(model, [[5, 6]], cfg), generate(model, [[7] * 13, [8, 9, 10]], cfg)
    ab = cat_rollouts([a, b], MASK)
    assert a.sequences.shape[1] < b.sequences.shape[1] == ab.sequences.shape[1]
    assert torch.equal(ab.sequences[0, : a.sequences.shape[1]], a.sequences[0])
    wa = a.sequences.shape[1]
    assert (ab.sequences[0, wa:] == MASK).all() and (ab.seq_step_map[0, wa:] == -2).all()
    assert torch.equal(ab.sequences[1:], b.sequences) and torch.equal(ab.tokens, torch.cat([a.tokens, b.tokens]))
    assert ab.prompt_ids == a.prompt_ids + b.prompt_ids and ab.total_forwards == a.total_forwards + b.total_forwards
    assert ab.finish_reason == a.finish_reason + b.finish_reason and len(ab) == 3


def test_epochs_and_minibatches_reuse_one_rollout_batch():
    """2 epochs x 2 mini-batches = 4 optimizer steps on one rollout; from the second update on the policy has
    moved away from the rollout policy, so the ratio differs from 1 and a large lr drives it past the clip."""
    task = HalfRightTask(max_operand=4)
    tok = task.tokenizer
    cfg = half_right_config(tok)
    scfg = SamplerConfig(threshold=0.9, temperature=1.0, max_new_tokens=20, eos_ids=tuple(sorted(tok.eos_token_ids)))
    base = dict(steps=1, prompts_per_step=4, group_size=4, lr=3e-2, warmup_steps=1, kl_beta=0.0,
                filter_groups=False, max_refill_rounds=0, micro_batch_tokens=4096)
    one = make_state(build_model(cfg, dtype=torch.float32, seed=0).eval(), RLConfig(**base))
    m1 = train_step(one, tok, task, task.train, RLConfig(**base), scfg)
    rc = RLConfig(**base, updates_per_step=2, epochs_per_step=2)
    four = make_state(build_model(cfg, dtype=torch.float32, seed=0).eval(), rc)
    m4 = train_step(four, tok, task, task.train, rc, scfg)
    assert m1["updates"] == 1 and m4["updates"] == 4
    assert m1["clip_frac"] == 0.0 and m4["clip_frac"] > 0.0  # on-policy: ratio 1; reused: clipped tokens
    assert one.step == four.step == 1 and one.cursor == four.cursor == 4  # one rollout batch either way
    with pytest.raises(ValueError, match="epochs_per_step must be >= 1"):
        RLConfig(epochs_per_step=0).validate()


def test_rl_config_validation():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        RLConfig(group_size=1).validate()
    with pytest.raises(ValueError, match="logprob_mode"):
        RLConfig(logprob_mode="exact").validate()
    with pytest.raises(ValueError, match="lr must be a positive finite number, got -1.0"):
        RLConfig(lr=-1.0).validate()
    with pytest.raises(ValueError, match="grad_clip must be a positive finite number, got nan"):
        RLConfig(grad_clip=float("nan")).validate()


# ---------------------------------------------------------------------- REFERENCE §4 written out by hand (float64)

def hand_advantages(acc, tpf, gids, w, mode, dt=torch.float64):
    """z-score per group (population std, 0 where the std is 0) of each reward then r = z_acc + w z_tpf
    (decoupled), or of a + w s (sum); then (r - mean) / max(std, 1e-8) over the batch. Loops over the groups, every
    step in `dt` (float64: the oracle; float32: the error a float32 computation makes)."""
    acc, tpf, w = torch.tensor(acc, dtype=dt), torch.tensor(tpf, dtype=dt), torch.tensor(w, dtype=dt)

    def zs(vals):
        m = vals.mean()
        sd = ((vals - m) ** 2).mean().sqrt()
        return (vals - m) / sd if sd > 0 else torch.zeros_like(vals)

    r = torch.zeros(len(gids), dtype=dt)
    for g in set(gids):
        idx = torch.tensor([i for i, x in enumerate(gids) if x == g])
        if mode == "decoupled":
            r[idx] = zs(acc[idx]) + w * zs(tpf[idx])
        else:
            r[idx] = zs(acc[idx] + w * tpf[idx])
    m = r.mean()
    sd = ((r - m) ** 2).mean().sqrt()
    return (r - m) / torch.clamp(sd, min=1e-8)


def hand_keep(acc, tpf, gids, min_range):
    """A group is kept unless all its samples are wrong or its TPF spread max - min is below min_range."""
    keep = []
    for g in gids:
        idx = [i for i, x in enumerate(gids) if x == g]
        t = [tpf[i] for i in idx]
        keep.append(any(acc[i] > 0 for i in idx) and max(t) - min(t) >= min_range)
    return keep


@pytest.mark.parametrize("mode", ["decoupled", "sum"])
def test_advantages_and_filter_match_a_hand_written_oracle(mode):
    """Random rewards in 11 groups of 1..7 samples (97 in all), arbitrary unsorted group ids, some groups all
    right / all wrong / of one TPF (std 0), TPF spreads exactly at the filter's bound (kept: max - min >= bound)."""
    rng = torch.Generator().manual_seed(5)
    sizes = [7, 1, 5, 3, 6, 2, 7, 4, 5, 2, 55]
    assert sum(sizes) == 97
    ids = [-40, 3, 17, 9, 1000, 2, 5, 6, 7, 8, -1]
    gids, acc, tpf = [], [], []
    for k, (n, gid) in enumerate(zip(sizes, ids)):
        gids += [gid] * n
        a = (torch.rand(n, generator=rng) < 0.5).double().tolist()
        t = (1.0 + 7.0 * torch.rand(n, generator=rng, dtype=torch.float64)).tolist()
        if k == 3:
            a = [1.0] * n  # all right
        if k == 4:
            a = [0.0] * n  # all wrong
        if k == 5:
            t = [2.5] * n  # one TPF: z_tpf 0
        if k in (7, 8):
            a[0] = 1.0
            t = [1.25 + 0.25 * (i % 2) for i in range(n)]  # spread exactly 0.25 (binary-exact)
        acc += a
        tpf += t
    perm = torch.randperm(97, generator=rng).tolist()  # members of a group scattered over the batch
    acc, tpf, gids = [acc[i] for i in perm], [tpf[i] for i in perm], [gids[i] for i in perm]
    sc = Scored(torch.tensor(acc, dtype=torch.float64), torch.tensor(tpf, dtype=torch.float64), torch.tensor(gids))
    got = compute_advantages(sc, tpf_weight=0.7, mode=mode)
    want = hand_advantages(acc, tpf, gids, 0.7, mode)
    # float64 rewards: float64 advantages to float64 accuracy; float32 rewards: within 2x the error of the oracle
    # computed in float32 (both against the oracle on the float32-rounded rewards)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    acc32, tpf32 = sc.accuracy.float(), sc.tpf.float()
    want32 = hand_advantages(acc32.tolist(), tpf32.tolist(), gids, 0.7, mode)
    err_ref = (hand_advantages(acc32.tolist(), tpf32.tolist(), gids, 0.7, mode, torch.float32).double()
               - want32).abs().max().item()
    got32 = compute_advantages(Scored(acc32, tpf32, sc.group_ids), tpf_weight=0.7, mode=mode)
    assert got32.dtype == torch.float32 and (got32.double() - want32).abs().max().item() <= 2 * err_ref + 1e-7
    # integer / bool rewards (check_scored accepts them) count as float32: they were refused as "rewards must have
    # dtype in (float...)", naming a tensor the caller never passed
    ints = Scored(torch.tensor(acc).bool(), torch.tensor(tpf).round().long(), sc.group_ids)
    want_int = hand_advantages(acc, torch.tensor(tpf).round().tolist(), gids, 0.7, mode)
    assert (compute_advantages(ints, tpf_weight=0.7, mode=mode).double() - want_int).abs().max() < 1e-5
    for bound in (0.25, 0.2500001, 0.01, 0.0):
        assert keep_groups(sc, min_tpf_range=bound).tolist() == hand_keep(acc, tpf, gids, bound), bound
    kept = keep_groups(sc, min_tpf_range=0.25)
    assert 0 < int(kept.sum()) < 97
    assert keep_groups(sc, 0.25, drop_all_wrong=False).tolist() == hand_keep([1.0] * 97, tpf, gids, 0.25)


@pytest.mark.parametrize("adv_mode", ["decoupled", "sum"])
def test_update_stage_equals_a_hand_written_lightningrl_objective(monkeypatch, adv_mode):
    """update_stage (advantages from the groups' rewards, broadcast to each sample's tokens, "correct" = the
    verifier said so, frozen-reference KL, packed micro-batches) against REFERENCE §4 written out here from the
    padded forward's log-softmax (mask token left out, as the sampler never draws it): same loss, same KL, same
    gradients (captured just before the optimizer step)."""
    import lightningrl_fast.rl.trainer as trainer_mod

    model = tiny_rl_model(dtype=torch.float64, peaky=20.0)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(10, 100, (n,), generator=g).tolist() for n in [1, 6, 13, 3]]
    ro = generate(model, [p for p in prompts for _ in range(3)],
                  SamplerConfig(threshold=0.3, temperature=1.0, max_new_tokens=15, eos_ids=(3, 7), seed=4))
    acc = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # the last group: all wrong
    tpf = (ro.tpf + torch.rand(12, generator=g)).tolist()  # float32 values: Groups.scored() keeps them exactly
    groups = Groups(sequences=list(ro.sequences), step_maps=list(ro.seq_step_map),
                    prompt_lens=ro.prompt_lens.tolist(), resp_lens=ro.lengths.tolist(), accuracy=acc, tpf=tpf,
                    group_ids=[7, 7, 7, 2, 2, 2, 11, 11, 11, 4, 4, 4], texts=[""] * 12)
    rc = RLConfig(kl_beta=0.05, nll_weight=0.1, tpf_weight=0.7, adv_mode=adv_mode, group_size=3, prompts_per_step=4,
                  micro_batch_tokens=64, lr=1e-3, grad_clip=1e9)
    state = make_state(model, rc)
    with torch.no_grad():  # a reference away from the policy: the KL term and its gradient are not zero
        for p in state.ref_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    lb = layout_stage(groups, 4, MASK, rc.logprob_mode)
    adv = hand_advantages(acc, tpf, groups.group_ids, 0.7, adv_mode)
    # the trainer's advantages are float32 (Groups hold Python floats): the hand values within 2x the error of the
    # same formulas in float32, then the loss is checked to float64 accuracy on the trainer's own float32 values
    err_ref = (hand_advantages(acc, tpf, groups.group_ids, 0.7, adv_mode, torch.float32).double() - adv).abs().max()
    adv32 = trainer_mod.advantage_stage(groups, rc)
    assert adv32.dtype == torch.float32 and (adv32.double() - adv).abs().max() <= 2 * err_ref + 1e-7
    adv = adv32.double()

    with torch.no_grad():
        ref = padded_logp(state.ref_model, lb).float().double()  # the trainer keeps reference log-probs in float32
    correct = torch.tensor([a == 1.0 for a in acc])
    # Seq-Tok-Tok on-policy (old = logp detached: rho = 1, its gradient that of logp), eps 0.2
    logp = padded_logp(model, lb)
    want, want_kl, _ = hand_loss(logp, logp.detach(), ref, adv[lb.tgt_row], lb.tgt_row, correct, 0.05, 0.1,
                                 "seq-tok-tok")
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    grads = []
    real = trainer_mod.optimizer_stage

    def spy(st, cfg):
        grads.append([p.grad.clone() for p in st.model.parameters()])
        return real(st, cfg)

    monkeypatch.setattr(trainer_mod, "optimizer_stage", spy)
    m = update_stage(state, groups, rc, 4)
    assert m["updates"] == 1 and len(grads) == 1 and m["train_positions"] < lb.input_ids.numel()
    assert m["loss"] == pytest.approx(float(want.detach()), rel=1e-9)
    assert m["kl"] == pytest.approx(float(want_kl.detach()), rel=1e-9)
    assert float(want_kl.detach()) > 1e-4
    for a, b in zip(grads[0], want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def hand_loss(logp, old, ref, adv, row, correct, beta, mu, red, eps_low=0.2, eps_high=0.2):
    """REFERENCE §4 with any seq/tok reduction per term, looping over sequences (float64): rho = exp(clamp(logp - old,
    -10, 10)), pg = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A); k3 = exp(-d) - 1 + d, d = logp - ref; NLL =
    -logp over the tokens of verifier-correct sequences. "tok": mean over the tokens, "seq": mean over the sequences of
    the mean over their tokens. Returns (loss, the KL mean without beta, the fraction of tokens the clip decided)."""
    red_pg, red_kl, red_nll = red.split("-")

    def mean(vals, how, keep):
        seqs = sorted(set(row[keep].tolist()))
        if not seqs:
            return vals.sum() * 0.0
        if how == "tok":
            return vals[keep].mean()
        return sum(vals[keep & (row == s)].mean() for s in seqs) / len(seqs)

    rho = torch.exp((logp - old).clamp(-10.0, 10.0))
    u, c = rho * adv, rho.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    d = logp - ref
    every = torch.ones_like(row, dtype=torch.bool)
    kl = mean(torch.exp(-d) - 1.0 + d, red_kl, every)
    loss = mean(-torch.minimum(u, c), red_pg, every) + beta * kl + mu * mean(-logp, red_nll, correct[row])
    return loss, kl, float((c < u).double().mean())


def padded_logp(model, lb):
    """Per-target log-probs from the padded LayoutBatch forward's log-softmax, the mask token left out."""
    logits = model(lb.input_ids, lb.position_ids, lb.layout)[lb.tgt_row, lb.tgt_col].double()
    logits[:, MASK] = float("-inf")
    return torch.log_softmax(logits, -1).gather(1, lb.targets[:, None])[:, 0]


def test_loss_backward_stage_on_a_mini_batch_equals_the_hand_written_objective():
    """A mini-batch (rows 3..8 of 12) in several packed micro-batches, off-policy (some ratios clipped), with each
    reduction: the micro-batch losses add up to REFERENCE §4 over exactly those rows (the totals count their
    sequences, tokens, correct sequences and correct tokens; the rows around them stay out), the reported KL and
    clip fraction are the mini-batch's, and the gradients are the hand objective's."""
    model = tiny_rl_model(dtype=torch.float64, peaky=20.0)
    lb = varied_layout_batch(model, "trace", seed=6)
    rows = range(3, 9)
    assert len(list(micro_batches(lb, rows, 40, torch.device("cpu"), MASK))) >= 2
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        base = padded_logp(model, lb)
    old = base + 0.3 * torch.randn(lb.num_tokens, generator=g, dtype=torch.float64)
    ref = base + 0.3 * torch.randn(lb.num_tokens, generator=g, dtype=torch.float64)
    adv_tok = torch.randn(12, generator=g, dtype=torch.float64)[lb.tgt_row]
    correct = torch.tensor([True, False, False] * 4)  # rows 3 and 6 correct, 4, 5, 7, 8 wrong
    mine = (lb.tgt_row >= 3) & (lb.tgt_row < 9)
    assert int(mine.sum()) < lb.num_tokens and bool(mine[lb.tgt_row == 9].sum() == 0)
    for red in ("seq-seq-seq", "tok-seq-tok", "seq-tok-tok"):
        cfg = RLConfig(micro_batch_tokens=40, kl_beta=0.05, nll_weight=0.1, group_size=2, prompts_per_step=6,
                       eps_low=0.2, eps_high=0.28, reduction=red)
        model.zero_grad()
        agg = loss_backward_stage(model, lb, rows, adv_tok, old, ref, correct, cfg)
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        logp = padded_logp(model, lb)
        want, want_kl, frac = hand_loss(logp[mine], old[mine], ref[mine], adv_tok[mine], lb.tgt_row[mine], correct,
                                        0.05, 0.1, red, 0.2, 0.28)
        assert 0.05 < frac < 0.95
        assert agg["loss"] == pytest.approx(float(want.detach()), rel=1e-10), red
        assert agg["kl"] == pytest.approx(float(want_kl.detach()), rel=1e-10), red
        assert agg["clip_frac"] == pytest.approx(frac, abs=1e-6), red
        for a, b in zip(got, torch.autograd.grad(want, list(model.parameters()))):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_update_stage_reports_the_mean_over_its_updates(monkeypatch):
    """2 epochs x 2 mini-batches of 2 groups: the reported loss and KL are the means over the 4 updates of each
    mini-batch's objective (the optimizer is stubbed out, so the policy stays the rollout policy: old = policy,
    ratio 1 up to the float32 rounding of the old log-probs the trainer keeps), each mini-batch's objective written out
    over its own rows."""
    import lightningrl_fast.rl.trainer as trainer_mod

    model = tiny_rl_model(dtype=torch.float64, peaky=20.0)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(10, 100, (n,), generator=g).tolist() for n in [2, 9, 4, 5]]
    ro = generate(model, [p for p in prompts for _ in range(3)],
                  SamplerConfig(threshold=0.3, temperature=1.0, max_new_tokens=15, eos_ids=(3, 7), seed=5))
    acc = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    groups = Groups(sequences=list(ro.sequences), step_maps=list(ro.seq_step_map),
                    prompt_lens=ro.prompt_lens.tolist(), resp_lens=ro.lengths.tolist(), accuracy=acc,
                    tpf=(ro.tpf + torch.rand(12, generator=g)).tolist(), group_ids=[k // 3 for k in range(12)],
                    texts=[""] * 12)
    rc = RLConfig(kl_beta=0.05, nll_weight=0.1, group_size=3, prompts_per_step=4, micro_batch_tokens=64,
                  updates_per_step=2, epochs_per_step=2)
    state = make_state(model, rc)
    with torch.no_grad():
        for p in state.ref_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    calls = []

    def no_step(st, cfg):
        calls.append(1)
        st.optimizer.zero_grad(set_to_none=True)
        return True, 0.0

    monkeypatch.setattr(trainer_mod, "optimizer_stage", no_step)
    m = update_stage(state, groups, rc, 4)
    assert m["updates"] == 4 and len(calls) == 4
    lb = layout_stage(groups, 4, MASK, rc.logprob_mode)
    adv = trainer_mod.advantage_stage(groups, rc).double()[lb.tgt_row]
    correct = torch.tensor(acc) > 0
    with torch.no_grad():
        logp = padded_logp(model, lb)
        ref = padded_logp(state.ref_model, lb).float().double()
    losses, kls = [], []
    for lo in (0, 6):
        sel = (lb.tgt_row >= lo) & (lb.tgt_row < lo + 6)
        old = logp[sel].float().double()  # the trainer keeps the old log-probs in float32
        loss, kl, _ = hand_loss(logp[sel], old, ref[sel], adv[sel], lb.tgt_row[sel], correct, 0.05, 0.1, "seq-tok-tok")
        losses.append(float(loss))
        kls.append(float(kl))
    assert abs(losses[0] - losses[1]) > 1e-3
    assert m["loss"] == pytest.approx(sum(losses) / 2, rel=1e-9)
    assert m["kl"] == pytest.approx(sum(kls) / 2, rel=1e-9)
    assert m["clip_frac"] == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_clip_grads_takes_the_norm_in_fp32_whatever_the_gradient_dtype(dtype):
    """The one-process clip: the norm of bf16 / fp16 gradients to fp32 accuracy (torch's clip_grad_norm_ returned
    it in the gradients' dtype, ~3 digits in bf16), the gradients scaled by grad_clip / norm (rounded once to their
    dtype), left alone below the clip; fp32 gradients exactly as torch's clip_grad_norm_ leaves them; odd sizes,
    one empty parameter."""
    from lightningrl_fast.rl.trainer import clip_grads_, optimizer_stage

    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in ((97, 13), (123,), (0,), (11, 7))]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.37).to(dtype)
    exact = [p.grad.double().clone() for p in params]
    norm = math.sqrt(sum(float((e ** 2).sum()) for e in exact))
    got = clip_grads_(params, 1.0)
    assert got == pytest.approx(norm, rel=1e-6)
    for p, e in zip(params, exact):
        # one rounding to the gradient's dtype (and, in fp64, of the coefficient)
        fi = torch.finfo(dtype)
        torch.testing.assert_close(p.grad.double(), e / (norm + 1e-6), rtol=4 * fi.eps, atol=fi.tiny * fi.eps)
    before = [p.grad.clone() for p in params]
    assert clip_grads_(params, 10.0) == pytest.approx(1.0, rel=1e-2)  # below the clip: unchanged
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
    if dtype in (torch.float32, torch.float64):  # torch's own, bit for bit (the embedded default's runs reproduce)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 0.37).to(dtype)
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p, q in zip(params, theirs):
            q.grad = p.grad.clone()
        got, want = clip_grads_(params, 0.7), torch.nn.utils.clip_grad_norm_(theirs, 0.7)
        assert got == float(want) and all(torch.equal(p.grad, q.grad) for p, q in zip(params, theirs))
    params[1].grad[3] = float("inf")
    assert clip_grads_(params, 1.0) == float("inf")  # the caller skips the update and clears the gradients
    assert clip_grads_([], 1.0) == 0.0
    if dtype == torch.bfloat16:  # the single-process optimizer step reports this norm (a bf16 model)
        model = tiny_rl_model(dtype=dtype, peaky=1.0)
        rc = RLConfig(kl_beta=0.0, group_size=2, grad_clip=0.5, lr=1e-3)
        state = make_state(model, rc)
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=g) * 0.37).to(dtype)
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
        ok, got = optimizer_stage(state, rc)
        assert ok and got == pytest.approx(norm, rel=1e-6)


def test_optimizer_stage_clips_the_global_norm_and_skips_nonfinite_updates(monkeypatch):
    """The step sees the gradients scaled by min(1, grad_clip / ||g||) (global L2 norm over every parameter), and
    reports the norm before clipping; a non-finite norm skips the update and clears the gradients, so the next
    backward starts afresh (not NaN + g); max_nonfinite_steps non-finite updates in a row stop the run."""
    from lightningrl_fast.rl.trainer import optimizer_stage

    model = tiny_rl_model(dtype=torch.float32, peaky=1.0)
    rc = RLConfig(kl_beta=0.0, group_size=2, grad_clip=0.5, lr=1e-3, max_nonfinite_steps=2)
    state = make_state(model, rc)
    params = list(model.parameters())
    seen = []
    real_step = state.optimizer.step

    def spy(*a, **k):
        seen.append([p.grad.double().clone() for p in params])
        return real_step(*a, **k)

    monkeypatch.setattr(state.optimizer, "step", spy)
    g = torch.Generator().manual_seed(31)

    def backward(scale, nan=False):
        cs = [scale * torch.randn(p.shape, generator=g) for p in params]
        if nan:
            cs[3].view(-1)[5] = float("nan")
        sum((p * c).sum() for p, c in zip(params, cs)).backward()
        return [c.double() for c in cs]

    cs = backward(0.3)
    norm = sum((c ** 2).sum() for c in cs).sqrt().item()
    assert norm > 2 * rc.grad_clip
    ok, got_norm = optimizer_stage(state, rc)
    assert ok and got_norm == pytest.approx(norm, rel=1e-5) and len(seen) == 1
    for a, c in zip(seen[0], cs):
        torch.testing.assert_close(a, c * (rc.grad_clip / norm), rtol=1e-5, atol=1e-9)
    assert all(p.grad is None for p in params)
    before = [p.detach().clone() for p in params]
    backward(0.3, nan=True)
    ok, got_norm = optimizer_stage(state, rc)
    assert not ok and got_norm != got_norm and state.nonfinite_in_row == 1 and len(seen) == 1
    assert all(torch.equal(a, p) for a, p in zip(before, params)) and all(p.grad is None for p in params)
    cs = backward(1e-4)  # a small finite gradient: below the clip, stepped as it is
    ok, got_norm = optimizer_stage(state, rc)
    assert ok and state.nonfinite_in_row == 0 and len(seen) == 2
    for a, c in zip(seen[1], cs):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=0.0)
    for k in range(2):
        backward(0.3, nan=True)
        if k == 0:
            assert optimizer_stage(state, rc)[0] is False
        else:
            with pytest.raises(FloatingPointError, match="2 non-finite updates in a row"):
                optimizer_stage(state, rc)
