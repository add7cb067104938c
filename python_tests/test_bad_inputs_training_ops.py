"""Bad input to the training-side ops: masked_attention and its layouts (ops/masked_attn.py), the log-prob layouts and
their packing (rl/logprobs.py), scoring, filtering and advantages (rl/advantages.py). Each case raises an error that
names the problem; every test marked "was:" failed before its fix (a traceback from deep inside, or a silently wrong
result: a wrapped int32 table, log-probs read at padding or in the copy that shows the token, a -inf log-prob, a
group dropped for a NaN TPF, one sample's correctness broadcast to others). CPU, float64, well under a second each.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.ops.masked_attn import MaskLayout, PackedLayout, masked_attention
from lightningrl_fast.rl.advantages import Scored, compute_advantages, keep_groups, score_rollout
from lightningrl_fast.rl.logprobs import (build_layout_batch, check_targets, host_copy, micro_batch_logprobs,
                                          pack_micro_batches, streamed_logprobs)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread, restored after

MASK, V, BS = 99, 100, 4
T = torch.tensor


def qkv(b=1, hq=2, hkv=1, n=8, d=4, dtype=torch.float64):
    return (torch.randn(b, hq, n, d, dtype=dtype), torch.randn(b, hkv, n, d, dtype=dtype),
            torch.randn(b, hkv, n, d, dtype=dtype))


# -- masked_attention -------------------------------------------------------------------------------------------------

def test_masked_attention_refuses_bad_dtypes_heads_layout_and_scale():
    """Was: integer q/k/v -> "value cannot be converted to type int64_t without overflow" from SDPA; mixed dtypes ->
    SDPA's error from deep inside; 0 kv heads -> ZeroDivisionError; layout None -> AttributeError; a NaN
    softmax_scale -> NaN output."""
    lay = MaskLayout.block_causal(8, 4)
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q must have dtype in \(float16, bfloat16, float32, float64\), got int64"):
        masked_attention(q.long(), k.long(), v.long(), lay)
    with pytest.raises(TypeError, match="k has dtype float32 but q has float64"):
        masked_attention(q, k.float(), v, lay)
    with pytest.raises(TypeError, match="v has dtype bfloat16 but q has float64"):
        masked_attention(q, k, v.bfloat16(), lay)
    with pytest.raises(ValueError, match=r"kv heads \(0\), which must be >= 1"):
        masked_attention(q[:, :0], k[:, :0], v[:, :0], lay)
    with pytest.raises(TypeError, match="layout must be a MaskLayout or a PackedLayout, got NoneType"):
        masked_attention(q, k, v, None)
    with pytest.raises(ValueError, match="softmax_scale must not be NaN"):
        masked_attention(q, k, v, lay, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="softmax_scale must be a number"):
        masked_attention(q, k, v, lay, softmax_scale="0.5")


def test_mask_layout_geometry_is_integers_and_lengths_lie_in_0_n():
    """Was: n = 8.5 or True accepted (a float geometry downstream), n = "8" a TypeError from a comparison; host
    lengths > n or < 0 accepted silently (and a LayoutBatch with lengths > n crashed in iter_micro_batches with an
    IndexError)."""
    with pytest.raises(TypeError, match="MaskLayout.n must be an integer, got float 8.5"):
        MaskLayout(8.5, 1, 4)
    with pytest.raises(TypeError, match="MaskLayout.n must be an integer, got bool"):
        MaskLayout(True, 1, 4)
    with pytest.raises(TypeError, match="MaskLayout.block_size must be an integer, got str"):
        MaskLayout(8, 1, "4")
    with pytest.raises(ValueError, match=r"MaskLayout.lengths must lie in \[0, n = 8\].*got 3\.\.9"):
        MaskLayout(8, 2, 4, T([3, 9]))
    with pytest.raises(ValueError, match=r"MaskLayout.lengths must lie in \[0, n = 8\].*got -1\.\.8"):
        MaskLayout(8, 2, 4, T([-1, 8]))
    lay = MaskLayout(T(8), 2, 4, T([0, 8]))  # a 0-d integer tensor is an integer; length 0 is an empty row
    assert type(lay.n) is int and lay.total == 16
    q, k, v = qkv(b=2, n=16)
    assert torch.equal(masked_attention(q, k, v, lay)[0], torch.zeros_like(q[0]))


def packed_rows(blocks):
    """One row of a clean copy whose positions carry the given block labels (segment 0, every key valid)."""
    m = len(blocks)
    return PackedLayout(2, torch.zeros(1, m, dtype=torch.long), torch.full((1, m), -1),
                        T([blocks]), torch.ones(1, m, dtype=torch.bool))


def test_packed_layout_refuses_tables_past_int32():
    """Was: block (or copy) labels past int32 accepted and wrapped when the predicate's int32 tables were built:
    block 2**32 read as block 0, so a later block attended bidirectionally with block 0 (a silently wrong
    result). The largest int32 label is still ordered after 0."""
    torch.manual_seed(0)
    q, k, v = qkv(n=4)
    want = masked_attention(q, k, v, packed_rows([0, 0, 1, 1]))
    got = masked_attention(q, k, v, packed_rows([0, 0, 2**31 - 1, 2**31 - 1]))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match=r"PackedLayout.block values must be <= 2147483647 \(int32 tables\), got "
                                         r"4294967296"):
        packed_rows([0, 0, 2**32, 2**32])
    with pytest.raises(ValueError, match="PackedLayout.copy values must be <= 2147483647"):
        PackedLayout(2, torch.zeros(1, 2, dtype=torch.long), T([[2**32, -1]]), torch.zeros(1, 2, dtype=torch.long),
                     torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="PackedLayout.block_size must be an integer, got float 2.5"):
        PackedLayout(2.5, *(getattr(packed_rows([0, 0]), f) for f in ("seg", "copy", "block", "key_ok")))


def test_from_segments_refuses_ragged_or_non_integer_tables():
    """Was: tables of different lengths -> IndexError; n = 4.5 truncated to 4 silently; a bool row read as row 1;
    block_size 0 -> ZeroDivisionError from torch."""
    with pytest.raises(ValueError, match=r"one row, start, n, copies and length per segment, got \{'row': 2"):
        PackedLayout.from_segments(1, 8, 4, [0, 0], [0], [4], [1], [4])
    with pytest.raises(ValueError, match="n must be a 1-D sequence of integers"):
        PackedLayout.from_segments(1, 8, 4, [0], [0], [4.5], [1], [4])
    with pytest.raises(ValueError, match="row must be a 1-D sequence of integers"):
        PackedLayout.from_segments(2, 8, 4, [True], [0], [4], [1], [4])
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        PackedLayout.from_segments(1, 8, 0, [0], [0], [4], [1], [4])
    empty = PackedLayout.from_segments(1, 8, 4, [], [], [], [], [])  # no segments: all padding, as before
    assert empty.used == 0


def test_gradients_are_finite_for_rows_that_see_nothing():
    """Confirmation (no defect): queries with no visible key (padding, a segment whose keys are all invalid, an
    empty MaskLayout row) give zeros and finite gradients, in float64, float32 and bfloat16."""
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        seg = T([[0, 0, 0, 0, 1, 1, 1, 1, -1, -1]])
        ok = T([[False] * 4 + [True] * 4 + [False] * 2])
        packed = PackedLayout(4, seg, torch.full((1, 10), -1), torch.zeros(1, 10, dtype=torch.long), ok)
        for lay, b, n in ((packed, 1, 10), (MaskLayout(8, 2, 4, T([0, 3])), 2, 16)):
            ts = [t.requires_grad_() for t in qkv(b=b, n=n, dtype=dtype)]
            out = masked_attention(*ts, lay)
            (out.double() ** 2).sum().backward()
            assert all(bool(torch.isfinite(t.grad).all()) for t in ts), (dtype, lay)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


# -- build_layout_batch -----------------------------------------------------------------------------------------------

def rows(smaps, prompt_lens, resp_lens, seq=None):
    """Arguments of build_layout_batch for rows of 12 positions (block size 4)."""
    smap = T(smaps, dtype=torch.int32)
    seq = torch.arange(10, 10 + smap.numel()).view(smap.shape) if seq is None else seq
    return seq, smap, T(prompt_lens), T(resp_lens)


GOOD = [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # prompt 2, then two tokens per step, block after block


@pytest.mark.parametrize("smap,plen,rlen,match", [
    # was: silent: targets read at undecoded (padding) positions, their "log-probs" those of the mask token
    (GOOD[:10] + [-2, -2], 2, 10, r"prompt_len 2 \+ resp_len 10 exceeds its decoded length 10"),
    (GOOD, -1, 3, "prompt_lens and resp_lens must be >= 0, got row 0: -1, 3"),  # was: silent garbage targets
    (GOOD, 2, -3, "prompt_lens and resp_lens must be >= 0, got row 0: 2, -3"),  # was: silently no targets
    # was: silent: a prompt token scored as a response token decoded at "step -1"
    ([-1, -1, -1, 0, 1, 1, 2, 2, 3, 3, 3, 3], 2, 8, r"step_map must be -1 over the prompt \(2 positions\)"),
    # was: silent: an undecoded hole read as response, the decoded block past it cut off
    ([-1, -1, 0, 0, -2, -2, -2, -2, 3, 3, 3, 3], 2, 2, r"got \[-1 x2, 0 x2, -2 x4, 3 x4\]"),
    (GOOD[:10] + [-5, -5], 2, 8, "step_map must be -1 over the prompt"),  # was: step -5 accepted as a step
    (GOOD[:9] + [-2, -2, -2], 2, 7, r"decoded length 9 \(prompt \+ decoded blocks\) is not whole blocks of 4"),
])
def test_build_layout_batch_refuses_rows_the_sampler_cannot_record(smap, plen, rlen, match):
    for mode in ("block_proxy", "trace"):
        with pytest.raises(ValueError, match=match):
            build_layout_batch(*rows([smap], [plen], [rlen]), BS, MASK, mode)


def test_build_layout_batch_refuses_bad_shapes_types_and_empty_input():
    """Was: an empty batch -> max() RuntimeError; prompt_lens of another N -> IndexError; a list -> TypeError from
    indexing; 1-D sequences -> unpacking error; block_size 0 -> ZeroDivisionError; a float step map truncated; a
    step map of -2 only -> "MaskLayout needs n > 0"."""
    seq, smap, p, r = rows([GOOD], [2], [10])
    with pytest.raises(ValueError, match=r"at least one row and one position, got sequences of shape \[0, 12\]"):
        build_layout_batch(seq[:0], smap[:0], p[:0], r[:0], BS, MASK)
    with pytest.raises(ValueError, match=r"prompt_lens must have shape \[1\], got \[2\]"):
        build_layout_batch(seq, smap, T([2, 2]), r, BS, MASK)
    with pytest.raises(TypeError, match="resp_lens must be a torch.Tensor, got list"):
        build_layout_batch(seq, smap, p, [10], BS, MASK)
    with pytest.raises(ValueError, match="sequences must have 2 dimensions"):
        build_layout_batch(seq[0], smap[0], p, r, BS, MASK)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        build_layout_batch(seq, smap, p, r, 0, MASK)
    with pytest.raises(TypeError, match="step_map must have dtype in"):
        build_layout_batch(seq, smap.float(), p, r, BS, MASK)
    with pytest.raises(ValueError, match="no row has a decoded position"):
        build_layout_batch(seq, torch.full_like(smap, -2), T([0]), T([0]), BS, MASK)
    # int32 lengths and tokens are fine; a row without response tokens gives no targets
    lb = build_layout_batch(seq.repeat(2, 1).int(), smap.repeat(2, 1).long(), T([2, 2], dtype=torch.int32),
                            T([10, 0], dtype=torch.int32), BS, MASK, "trace")
    assert lb.num_tokens == 10 and lb.tgt_row.unique().tolist() == [0]


def tiny_model():
    cfg = SDARConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, block_size=BS, mask_token_id=MASK, torch_dtype="float32",
                     max_position_embeddings=64)
    return build_model(cfg, dtype=torch.float64, seed=0).eval()


def logprobs(lb):
    model = tiny_model()
    out = torch.empty(lb.num_tokens, dtype=torch.float64)
    with torch.no_grad():
        for mb in pack_micro_batches(lb, range(lb.num_rows), 1000, pad_id=MASK):
            out[mb.sel] = micro_batch_logprobs(model, mb)
    return out


def test_build_layout_batch_refuses_the_mask_token_as_a_response_token():
    """Was: accepted; its log-prob is -inf (the mask token is out of the softmax), a NaN ratio in the loss."""
    seq, smap, p, r = rows([GOOD], [2], [10])
    seq[0, 5] = MASK
    with pytest.raises(ValueError, match="row 0: the mask token 99 at decoded response position 5"):
        build_layout_batch(seq, smap, p, r, BS, MASK, "block_proxy")


def test_trace_mode_refuses_blocks_decoded_out_of_order():
    """Was: silent: block 1 decoded while block 0 still had a masked token (steps 1, 2 before block 0's step 3) was
    replayed against a complete block 0, not the context the sampler saw. A gap in one block's steps is fine (the
    copies in between hold the same state) and gives the log-probs of the gap-free trace."""
    interleaved = [-1, -1, 0, 3, 1, 1, 2, 2, 4, 4, 4, 4]
    with pytest.raises(ValueError, match="row 0: a block's tokens were unmasked before the previous block was"):
        build_layout_batch(*rows([interleaved], [2], [10]), BS, MASK, "trace")
    build_layout_batch(*rows([interleaved], [2], [10]), BS, MASK, "block_proxy")  # the proxy ignores the steps
    gap = build_layout_batch(*rows([[-1, -1, 0, 0, 1, 4, 4, 4, 5, 5, 5, 5]], [2], [10]), BS, MASK, "trace")
    tight = build_layout_batch(*rows([[-1, -1, 0, 0, 1, 2, 2, 2, 3, 3, 3, 3]], [2], [10]), BS, MASK, "trace")
    assert gap.layout.num_copies == 5 and tight.layout.num_copies == 3
    torch.testing.assert_close(logprobs(gap), logprobs(tight), rtol=0, atol=1e-12)


# -- iter_micro_batches / check_targets -------------------------------------------------------------------------------

def batch():
    return build_layout_batch(*rows([GOOD, GOOD[:8] + [-2] * 4], [2, 2], [10, 6]), BS, MASK, "trace")


def test_iter_micro_batches_refuses_non_integer_budget_and_rows():
    """Was: budget 10.5 or NaN accepted (NaN put every sample in one micro-batch); rows 0.5 truncated to 0 and True
    read as row 1; a bare int -> "'int' object is not iterable"."""
    lb = batch()
    for budget in (10.5, float("nan"), "10"):
        with pytest.raises(TypeError, match="micro-batch budget must be an integer"):
            pack_micro_batches(lb, [0], budget)
    with pytest.raises(TypeError, match=r"rows\[i\] must be an integer, got float 0.5"):
        pack_micro_batches(lb, [0.5], 100)
    with pytest.raises(TypeError, match=r"rows\[i\] must be an integer, got bool"):
        pack_micro_batches(lb, [True], 100)
    with pytest.raises(TypeError, match="rows must be a sequence of row indices, got int"):
        pack_micro_batches(lb, 1, 100)
    assert len(pack_micro_batches(lb, T([1, 0]), 100)) == 1  # a 1-D integer tensor of rows is fine


def test_iter_micro_batches_refuses_an_inconsistent_layout_batch():
    """Was: a hand-built LayoutBatch whose fields disagree ran on: targets read in the clean copy (a duplicated clean
    block, the token shown to the query that predicts it) or past the row's valid length, targets that are not
    the tokens at their positions: silently wrong log-probs; out-of-range rows/columns or short tables: tracebacks
    from inside the packing."""
    lb = batch()
    n = lb.layout.n
    clean = lb.layout.num_copies - 1
    cases = [
        (dict(tgt_col=lb.tgt_col % n + clean * n), r"LayoutBatch.tgt_col must lie in \[0, 24\)"),
        (dict(tgt_row=lb.tgt_row + 5), r"LayoutBatch.tgt_row must lie in \[0, 2\), got 5\.\.6"),
        (dict(targets=lb.targets[:-1]), r"LayoutBatch.tgt_row must have shape \[15\], got \[16\]"),
        (dict(rnd=lb.rnd[:, :5]), r"LayoutBatch.rnd must have shape \[2, 12\]"),
        (dict(layout=MaskLayout(n, 3, BS, T([12]))), r"LayoutBatch.layout.lengths must have shape \[2\]"),
        (dict(layout=MaskLayout(8, 3, BS, T([8, 8]))), "x0 has 12 positions per row but its layout's copy length is 8"),
        (dict(layout=MaskLayout(n, 3, BS, T([4, 8]))), r"target 2 \(row 0, copy 0, position 4\) lies past its row's "
                                                       r"valid length"),
        (dict(tgt_col=torch.where(lb.rnd[lb.tgt_row, lb.tgt_col % n] == 1, lb.tgt_col + n, lb.tgt_col - n).clamp_min(0)
              % (2 * n)), "is not masked in the copy it is read in"),
        (dict(targets=lb.targets.flip(0)), "differs from the clean token x0 at its position"),
        (dict(layout=None), "LayoutBatch.layout must be a MaskLayout, got NoneType"),
        (dict(tgt_col=lb.tgt_col.float()), "LayoutBatch.tgt_col must have dtype in"),
    ]
    for change, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            pack_micro_batches(dataclasses.replace(lb, **change), [0, 1], 100)
    with pytest.raises(TypeError, match="expected a LayoutBatch, got NoneType"):
        pack_micro_batches(None, [0], 100)


def test_a_checked_layout_batch_is_checked_again_after_any_change():
    """The layout check runs once per batch (the trainer packs one batch per pass and mini-batch), but a field
    changed in place or replaced after a passing check is checked again: a stale pass would pack wrong targets."""
    lb = batch()
    assert len(pack_micro_batches(lb, [0, 1], 100)) >= 1  # checked, passes
    lb.targets[2] = (lb.targets[2] + 1) % MASK  # in place: the version counter moves
    with pytest.raises(ValueError, match="differs from the clean token x0"):
        pack_micro_batches(lb, [0, 1], 100)
    lb = batch()
    pack_micro_batches(lb, [0, 1], 100)
    lb.tgt_row = lb.tgt_row + 5  # a new object in the field
    with pytest.raises(ValueError, match="LayoutBatch.tgt_row must lie in"):
        pack_micro_batches(lb, [0, 1], 100)
    lb = batch()
    pack_micro_batches(lb, [0, 1], 100)
    lb.layout.lengths[0] = 4  # inside the (frozen) layout, in place
    with pytest.raises(ValueError, match="lies past its row's valid length"):
        pack_micro_batches(lb, [0, 1], 100)


def test_check_targets_checks_every_token_the_forward_embeds():
    """Was: only the targets were checked, so a prompt or padding id outside the vocabulary reached the embedding
    (a device-side assert on CUDA, where the passes skip the model's id check), and a target equal to the mask
    token passed (log-prob -inf, a NaN ratio in the loss); vocab "100" -> a TypeError from a comparison."""
    lb = batch()
    check_targets(lb, V)
    bad = dataclasses.replace(lb, x0=torch.where(torch.arange(12) < 2, V + 5, lb.x0))  # prompt ids only
    with pytest.raises(ValueError, match=r"LayoutBatch token ids \(x0: .*\) must lie in \[0, 100\), got 12\.\.105"):
        check_targets(bad, V)
    with pytest.raises(ValueError, match=r"LayoutBatch.mask_id must lie in \[0, 90\)"):
        check_targets(dataclasses.replace(lb, x0=lb.x0 % 50, targets=lb.targets % 50), 90)
    with pytest.raises(TypeError, match="vocab must be an integer, got str"):
        check_targets(lb, "100")
    x0 = lb.x0.clone()
    x0[0, 5] = MASK  # a hand-built batch (build_layout_batch refuses it) whose target 3 is the mask token
    masked = dataclasses.replace(lb, x0=x0, targets=x0[lb.tgt_row, lb.tgt_col % lb.layout.n])
    assert logprobs(masked)[3] == -float("inf")  # what the passes would compute
    with pytest.raises(ValueError, match=r"target 3 is the mask token 99 \(out of the softmax: log-prob -inf\)"):
        check_targets(masked, V)


def test_streamed_logprobs_chunk_tokens_is_a_positive_integer():
    """Was: chunk_tokens NaN (or 1e9 as a float) accepted: every micro-batch in one chunk, their hidden states all
    on the device at once."""
    lb = batch()
    ref = host_copy(tiny_model(), pin=False)
    mbs = pack_micro_batches(lb, range(lb.num_rows), 16, pad_id=MASK)
    for bad in (float("nan"), 1e9, 0):
        with pytest.raises((TypeError, ValueError), match="chunk_tokens must be"):
            streamed_logprobs(ref, lb, mbs, torch.device("cpu"), chunk_tokens=bad)
    got = streamed_logprobs(ref, lb, mbs, torch.device("cpu"), chunk_tokens=32)
    torch.testing.assert_close(got.double(), logprobs(lb), rtol=0, atol=1e-6)  # float32 output of a float64 model


# -- score_rollout / keep_groups / compute_advantages -----------------------------------------------------------------

def test_score_rollout_refuses_mismatched_lengths_and_non_boolean_flags():
    """Was: silent: one verifier result (or one eos flag) broadcast over two samples; an integer eos_found of 3 gave
    accuracy 3; a string verdict -> "too many dimensions 'str'"."""
    tpf, eos, gids = T([2.0, 3.0]), T([True, False]), T([0, 0])
    with pytest.raises(ValueError, match="correct has 1 entries but tpf has 2 samples"):
        score_rollout([True], tpf, eos, gids)
    with pytest.raises(ValueError, match=r"eos_found must have shape \[2\], got \[1\]"):
        score_rollout([True, True], tpf, T([True]), gids)
    with pytest.raises(TypeError, match=r"eos_found must have dtype in \(bool\), got int64"):
        score_rollout([True, True], tpf, T([3, 1]), gids)
    with pytest.raises(ValueError, match=r"Scored.group_ids must have shape \[2\], got \[1\]"):
        score_rollout([True, True], tpf, eos, T([0]))
    with pytest.raises(TypeError, match="correct must hold booleans, got 'yes'"):
        score_rollout(["yes", True], tpf, eos, gids)
    with pytest.raises(ValueError, match="Scored.tpf contains NaN or inf"):
        score_rollout([True, True], T([float("nan"), 3.0]), eos, gids)
    assert score_rollout([True, 1], tpf, eos, gids).accuracy.tolist() == [1.0, 0.0]


def test_keep_groups_refuses_mismatched_or_non_finite_scores():
    """Was: accuracy/tpf of 3 samples with group ids of 2 -> a mask of 2 (a sample silently lost); tpf of another
    length -> a scatter RuntimeError; a NaN TPF silently dropped its group; NaN min_tpf_range dropped every group;
    float group ids accepted; an empty batch -> max() RuntimeError (now: nothing kept)."""
    with pytest.raises(ValueError, match=r"Scored.group_ids must have shape \[3\], got \[2\]"):
        keep_groups(Scored(T([1.0, 0.0, 1.0]), T([2.0, 1.0, 3.0]), T([0, 0])))
    with pytest.raises(ValueError, match=r"Scored.tpf must have shape \[2\], got \[1\]"):
        keep_groups(Scored(T([1.0, 0.0]), T([2.0]), T([0, 0])))
    with pytest.raises(ValueError, match="Scored.tpf contains NaN or inf"):
        keep_groups(Scored(T([1.0, 0.0]), T([float("nan"), 1.0]), T([0, 0])))
    with pytest.raises(ValueError, match="min_tpf_range must not be NaN"):
        keep_groups(Scored(T([1.0, 0.0]), T([2.0, 1.0]), T([0, 0])), min_tpf_range=float("nan"))
    with pytest.raises(TypeError, match=r"Scored.group_ids must have dtype in \(int32, int64\), got float32"):
        keep_groups(Scored(T([1.0, 0.0]), T([2.0, 1.0]), T([0.0, 0.0])))
    assert keep_groups(Scored(T([]), T([]), T([], dtype=torch.long))).tolist() == []


def test_compute_advantages_edge_cases():
    """Was: tpf_weight "a" -> "new(): invalid data type 'str'"; a Scored of lists -> a torch.stack TypeError.
    Confirmed (no defect): a group of one sample and an all-equal group give advantages 0, not a division by 0;
    group ids need not be contiguous or sorted; an empty batch is refused by name; NaN rewards are refused."""
    with pytest.raises(TypeError, match="tpf_weight must be a number, got str"):
        compute_advantages(Scored(T([1.0, 0.0]), T([2.0, 1.0]), T([0, 0])), tpf_weight="a")
    with pytest.raises(TypeError, match="Scored.accuracy must be a torch.Tensor, got list"):
        compute_advantages(Scored([1.0, 0.0], [2.0, 1.0], [0, 0]))
    assert torch.equal(compute_advantages(Scored(T([1.0, 1.0, 0.0]), T([2.0, 2.0, 5.0]), T([3, 3, 7]))), torch.zeros(3))
    sc = Scored(T([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), T([2.0, 1.0, 3.0, 5.0], dtype=torch.float64),
                T([9, 5, 9, 5]))
    # z(acc) + z(tpf) within each group: group 9 acc [1, 1] -> [0, 0], tpf [2, 3] -> [-1, 1]; group 5 both [-1, 1]
    r = T([0.0 - 1.0, -1.0 - 1.0, 0.0 + 1.0, 1.0 + 1.0], dtype=torch.float64)
    torch.testing.assert_close(compute_advantages(sc), (r - r.mean()) / r.std(unbiased=False), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="rewards has no samples"):
        compute_advantages(Scored(T([]), T([]), T([], dtype=torch.long)))
    with pytest.raises(ValueError, match="Scored.accuracy contains NaN or inf"):
        compute_advantages(Scored(T([float("nan"), 0.0]), T([2.0, 1.0]), T([0, 0])))
