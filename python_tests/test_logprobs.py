"""The trainer's log-prob passes (rl/logprobs.py): training layouts against the sampler's trajectory, micro-batched
and packed passes against the padded batch, the streamed / offloaded reference, and the same passes on CUDA."""

import random

import pytest
import torch

from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.ops.masked_attn import MaskLayout
from lightningrl_fast.rl.logprobs import (LayoutBatch, batch_logprobs, build_layout_batch, host_copy,
                                          micro_batch_logprobs, pack_micro_batches, packed_length, streamed_logprobs)
from lightningrl_fast.rl.trainer import (Groups, RLConfig, layout_stage, logprob_stage, loss_backward_stage, make_state,
                                         micro_batches, reference_stage)
from lightningrl_fast.sampler import SamplerConfig, generate

from conftest import TINY_MASK, TINY_VOCAB, StandInStreams, fuzz_cases, tiny_rl_model, varied_layout_batch

MASK, V = TINY_MASK, TINY_VOCAB


@pytest.mark.parametrize("block", [4, 8])  # the model's block size (4), and decoding with another one
def test_trace_logprobs_equal_the_sampler_logprobs(block):
    model = tiny_rl_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 100, (n,), generator=g).tolist() for n in [1, 3, 4, 5, 9]]
    ro = generate(model, prompts, SamplerConfig(threshold=0.5, temperature=1.0, max_new_tokens=14, eos_ids=(3,),
                                                block_size=block))
    assert float(ro.tpf.max()) > 1.5  # several tokens per step, so rounds matter
    lb = build_layout_batch(ro.sequences, ro.seq_step_map, ro.prompt_lens, ro.lengths, block, MASK, "trace")
    assert lb.layout.num_copies > 2
    with torch.no_grad():
        lp = batch_logprobs(model, lb)
    recorded = ro.logp[lb.tgt_row, lb.resp_pos]
    assert lb.num_tokens == int(ro.lengths.sum())
    torch.testing.assert_close(lp.float(), recorded, rtol=0, atol=1e-5)
    # block proxy reads every response token with its whole block masked: a different (cheaper) estimate
    lbp = build_layout_batch(ro.sequences, ro.seq_step_map, ro.prompt_lens, ro.lengths, block, MASK, "block_proxy")
    assert lbp.layout.num_copies == 2 and torch.equal(lbp.targets, lb.targets)
    with pytest.raises(ValueError, match="logprob mode"):
        build_layout_batch(ro.sequences, ro.seq_step_map, ro.prompt_lens, ro.lengths, 4, MASK, "exact")


def test_layout_batch_copies_follow_the_trajectory():
    """The compact LayoutBatch (clean tokens + a round per position) expands to the copies REFERENCE §3 defines,
    built here row by row from the step map: trace copy r masks the response tokens unmasked in round >= r of
    their block (round = step - the block's first step), block proxy masks every generated token; the last copy
    is clean; each target is read in the copy of its round. It stores [N, n] tensors only, whatever the rounds."""
    model = tiny_rl_model()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, 100, (n,), generator=g).tolist() for n in [1, 4, 6, 11]]
    ro = generate(model, prompts, SamplerConfig(threshold=0.4, temperature=1.0, max_new_tokens=17, eos_ids=(3,)))
    bs = 4
    for mode in ("trace", "block_proxy"):
        lb = build_layout_batch(ro.sequences, ro.seq_step_map, ro.prompt_lens, ro.lengths, bs, MASK, mode)
        n, ncopies = lb.layout.n, lb.layout.num_copies
        assert lb.x0.shape == lb.rnd.shape == (4, n) and lb.rnd.dtype == torch.int16
        ids, pos = lb.inputs()
        assert torch.equal(ids, lb.input_ids) and torch.equal(pos, lb.position_ids)
        assert torch.equal(pos[:, :n], torch.arange(n).expand(4, n)) and torch.equal(pos[:, n:2 * n], pos[:, :n])
        most = 0  # the most rounds of any block
        for i in range(4):
            smap = ro.seq_step_map[i, :n].tolist()
            p0 = int(ro.prompt_lens[i])
            gen = [p for p in range(n) if p >= p0 and smap[p] >= 0]
            first = {p // bs: min(smap[q] for q in gen if q // bs == p // bs) for p in gen}
            rnd = {p: (smap[p] - first[p // bs] if mode == "trace" else 0) for p in gen}
            most = max(most, max(rnd.values()) + 1)
            for r in range(ncopies):
                want = ro.sequences[i, :n].clone()
                if r < ncopies - 1:
                    for p in gen:
                        if rnd[p] >= r:
                            want[p] = MASK
                assert torch.equal(ids[i, r * n:(r + 1) * n], want), (mode, i, r)
            for k in (lb.tgt_row == i).nonzero().squeeze(1).tolist():
                p = p0 + int(lb.resp_pos[k])
                assert int(lb.tgt_col[k]) == rnd[p] * n + p and int(lb.targets[k]) == int(ro.sequences[i, p])
        assert ncopies == most + 1 and (most > 1 or mode == "block_proxy")  # trace: several rounds in some block


@pytest.mark.parametrize("mode", ["block_proxy", "trace"])
def test_microbatched_backward_equals_one_batch(mode):
    model = tiny_rl_model(dtype=torch.float64, peaky=20.0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 100, (n,), generator=g).tolist() for n in [2, 5, 7, 3]]
    ro = generate(model, [p for p in prompts for _ in range(2)],
                  SamplerConfig(threshold=0.5, temperature=1.0, max_new_tokens=10, eos_ids=(3,)))
    groups = Groups(sequences=list(ro.sequences), step_maps=list(ro.seq_step_map), prompt_lens=ro.prompt_lens.tolist(),
                    resp_lens=ro.lengths.tolist(), accuracy=[1.0, 0.0] * 4, tpf=ro.tpf.tolist(),
                    group_ids=[0, 0, 1, 1, 2, 2, 3, 3], texts=[""] * 8)
    lb = layout_stage(groups, 4, MASK, mode)
    adv_tok = torch.randn(8, generator=g, dtype=torch.float64)[lb.tgt_row]
    correct = torch.tensor(groups.accuracy) > 0
    ref = -torch.rand(lb.num_tokens, generator=g, dtype=torch.float64)
    grads = []
    for budget in (10**6, lb.input_ids.shape[1] * 3):  # one micro-batch vs micro-batches of 3 rows
        model.zero_grad()
        cfg = RLConfig(micro_batch_tokens=budget, kl_beta=0.05, nll_weight=0.1, group_size=2, prompts_per_step=4)
        agg = loss_backward_stage(model, lb, range(8), adv_tok, None, ref, correct, cfg)
        grads.append(([p.grad.clone() for p in model.parameters()], agg["loss"]))
    for a, b in zip(grads[0][0], grads[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert grads[0][1] == pytest.approx(grads[1][1], rel=1e-9)


def reference_batch(model, mode="block_proxy"):
    """A LayoutBatch of 8 sampled rows (prompts of lengths 2..7) and a one-group-per-pair Groups."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 100, (n,), generator=g).tolist() for n in [2, 5, 7, 3]]
    ro = generate(model, [p for p in prompts for _ in range(2)],
                  SamplerConfig(threshold=0.5, temperature=1.0, max_new_tokens=10, eos_ids=(3,), seed=2))
    return build_layout_batch(ro.sequences, ro.seq_step_map, ro.prompt_lens, ro.lengths, 4, MASK, mode)


@pytest.mark.parametrize("mode", ["block_proxy", "trace"])
def test_streamed_reference_equals_the_per_micro_batch_forward(mode):
    """Layer-major evaluation of a host copy (chunks of micro-batches, one resident layer) gives the log-probs of
    the usual forward; the copy shares no storage with the policy."""
    model = tiny_rl_model(dtype=torch.float64)
    lb = reference_batch(model, mode)
    budget = 3 * lb.input_ids.shape[1]
    mbs = list(micro_batches(lb, range(8), budget, torch.device("cpu"), MASK))
    assert len(mbs) >= 2
    want = logprob_stage(model, lb, budget)
    ref = host_copy(model, pin=False)
    for chunk_tokens in (1, 2 * budget, 10**9):  # a chunk per micro-batch, a few chunks, one chunk
        got = streamed_logprobs(ref, lb, mbs, torch.device("cpu"), chunk_tokens)
        torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6)
    assert not any(p.requires_grad for p in ref.parameters())
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # the policy moves, the copy does not
    assert not torch.equal(next(model.parameters()), next(ref.parameters()))


def test_streamed_reference_overlaps_the_next_layers_copy_with_stand_in_streams(monkeypatch):
    """The CUDA ordering of `_LayerFeed`, run on the CPU with stand-in streams and events: layer i + 1's copy is
    queued on the side stream before layer i computes; a buffer is refilled only after the side stream waited for
    the event recorded after its last compute; a buffer computes only after the current stream waited for the event
    of its latest copy; the copies run inside the side stream's context; the current stream joins the side stream
    at the end. The log-probs equal the plain forward's (the copies run at once here)."""
    import lightningrl_fast.rl.logprobs as LP

    streams = StandInStreams()
    streams.install(monkeypatch, LP)
    log, sides = streams.log, streams.sides
    init, fill = LP._LayerFeed.__init__, LP._LayerFeed.fill
    cfg = SDARConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4, mask_token_id=TINY_MASK,
                     torch_dtype="float32", max_position_embeddings=256)
    model = build_model(cfg, dtype=torch.float64, seed=3).eval()  # 3 layers: buffers refilled within a chunk too
    ref = host_copy(model, pin=False)
    index = {id(layer): i for i, layer in enumerate(ref.model.layers)}

    def spy_init(self, *a):
        init(self, *a)
        self.side = streams.side()
        for k, buf in enumerate(self.bufs):
            buf.register_forward_pre_hook(lambda mod, args, k=k: log.append(("compute", k)))

    def spy_fill(self, k, layer):
        log.append(("fill", k, index[id(layer)]))
        fill(self, k, layer)

    monkeypatch.setattr(LP._LayerFeed, "__init__", spy_init)
    monkeypatch.setattr(LP._LayerFeed, "fill", spy_fill)
    lb = reference_batch(model, "trace")
    width = lb.input_ids.shape[1]
    mbs = list(micro_batches(lb, range(8), width, torch.device("cpu"), MASK))  # small micro-batches
    assert len(mbs) >= 4
    # chunks of several micro-batches (a layer computes on each before its buffer is released), several chunks
    got = streamed_logprobs(ref, lb, mbs, torch.device("cpu"), 2 * width)
    torch.testing.assert_close(got, logprob_stage(model, lb, width).float(), rtol=0, atol=1e-6)
    n_layers = len(ref.model.layers)
    assert len(sides) == 1 and n_layers >= 2 and log[-1] == ("join", sides[0])
    ready: dict = {}  # buffer -> [event of its latest copy, waited for yet]
    free: dict = {}  # buffer -> event recorded after its latest compute
    filled: dict = {}  # buffer -> layer it holds
    computes: list = []  # layer of each compute, in order
    released: dict = {}  # buffer -> its free event was recorded since its last fill
    last_fill = None
    for i, e in enumerate(log):
        if e[0] == "fill":
            k = e[1]
            assert (k in free) == (k in filled), f"buffer {k} refilled with no event after its last compute"
            if k in free:  # refilled: the side stream first waits for its last compute's event
                assert log[i + 1] == ("side waits", free[k]), log[i:i + 2]
            j = i + (2 if k in free else 1)
            assert log[j][0] == "enter" and log[j][1] is sides[0]
            end = next(x for x in range(j, len(log)) if log[x][0] == "exit")
            assert log[end - 1][0] == "side records"  # inside the side stream's context, after the copies
            ready[k], filled[k], last_fill, released[k] = [log[end - 1][1], False], e[2], e[2], False
        elif e[0] == "current waits":
            k = next(b for b, r in ready.items() if r[0] is e[1])
            ready[k][1] = True
        elif e[0] == "compute":
            k = e[1]
            assert ready[k][1], f"buffer {k} computed before the current stream waited for its copy"
            assert not released[k], f"buffer {k} computed after its free event (a refill may overwrite it meanwhile)"
            layer = filled[k]
            # the overlap: the next layer's copy was queued before this layer computes (the last layer has none)
            assert last_fill == min(layer + 1, n_layers - 1), (layer, last_fill)
            computes.append(layer)
        elif e[0] == "current records":
            assert log[i - 1][0] == "compute", "an event recorded after no compute"
            free[log[i - 1][1]] = e[1]
            released[log[i - 1][1]] = True
    # layer after layer within a chunk (each on every micro-batch of it), chunk after chunk
    assert all(b in (a, a + 1) or (a, b) == (n_layers - 1, 0) for a, b in zip(computes, computes[1:]))
    assert computes[0] == 0 and computes[-1] == n_layers - 1
    assert sum(e[0] == "fill" and e[2] == 0 for e in log) >= 2  # several chunks
    assert any(a == b for a, b in zip(computes, computes[1:]))  # a layer computing on several micro-batches


def loss_inputs(lb, seed):
    """Random per-token advantages (per sample), old and reference log-probs, and verifier flags for the 12 rows of
    a varied_batch."""
    g = torch.Generator().manual_seed(seed)
    adv_tok = torch.randn(12, generator=g, dtype=torch.float64)[lb.tgt_row]
    old = -torch.rand(lb.num_tokens, generator=g, dtype=torch.float64)
    ref = -torch.rand(lb.num_tokens, generator=g, dtype=torch.float64)
    return adv_tok, old, ref, torch.tensor([True, False] * 6)


@pytest.mark.parametrize("mode", ["block_proxy", "trace"])
def test_packed_micro_batches_equal_the_padded_batch(mode):
    """Packing (each sample cut to its own length and rounds, several samples per row, rows padded to fixed
    lengths or not) gives the log-probs of the padded LayoutBatch forward, every target exactly once, rows within
    the budget unless one sample alone exceeds it; and it processes fewer positions than the padded batch."""
    model = tiny_rl_model(dtype=torch.float64, peaky=20.0)
    lb = varied_layout_batch(model, mode)
    valid = lb.layout.lengths
    assert int(valid.max()) > 2 * int(valid.min())  # lengths differ: padding to the longest would waste
    with torch.no_grad():
        want = batch_logprobs(model, lb)
    padded_positions = lb.input_ids.numel()
    for budget in (1, 40, 100, 500, 10**6):
        for pad in (False, True):
            mbs = pack_micro_batches(lb, range(12), budget, pad_shapes=pad, pad_id=MASK)
            sel = torch.cat([mb.sel for mb in mbs])
            assert sorted(sel.tolist()) == list(range(lb.num_tokens))  # each target once
            got = torch.empty(lb.num_tokens, dtype=torch.float64)
            for mb in mbs:
                assert mb.used <= mb.positions
                assert mb.used <= budget or mb.layout.num_segments == 1
                assert torch.equal(mb.targets, lb.targets[mb.sel])
                if pad:
                    assert mb.positions == packed_length(mb.used, budget)
                else:
                    assert mb.positions == mb.used
                with torch.no_grad():
                    got[mb.sel] = micro_batch_logprobs(model, mb)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            if not pad:
                assert sum(mb.positions for mb in mbs) < padded_positions
    # a subset of rows (a mini-batch, in any order): exactly their targets, with the padded forward's log-probs
    for rows, budget in (([3, 7, 8], 10**6), ([11, 0, 5, 6], 40), ([9], 1)):
        mbs = pack_micro_batches(lb, rows, budget, pad_id=MASK)
        sel = torch.cat([mb.sel for mb in mbs])
        assert sorted(sel.tolist()) == torch.isin(lb.tgt_row, torch.tensor(rows)).nonzero().squeeze(1).tolist()
        for mb in mbs:
            assert set(mb.samples.tolist()) <= set(rows) and torch.equal(mb.targets, lb.targets[mb.sel])
            with torch.no_grad():
                torch.testing.assert_close(micro_batch_logprobs(model, mb), want[mb.sel], rtol=0, atol=1e-12)
    assert pack_micro_batches(lb, [], 100) == []
    with pytest.raises(ValueError, match="budget"):
        pack_micro_batches(lb, range(12), 0)
    with pytest.raises(ValueError, match="distinct rows"):
        pack_micro_batches(lb, [1, 2, 1], 100)
    with pytest.raises(ValueError, match="distinct rows"):
        pack_micro_batches(lb, [12], 100)


@pytest.mark.parametrize("mode", ["block_proxy", "trace"])
def test_packing_keeps_only_the_blocks_the_targets_need(mode):
    """A sample's segment is its clean copy cut before its last target block (nothing reads a clean block at or
    after it) and to its own length, plus one block per distinct (noisy copy, block) of its targets: fewer
    positions than whole copies (block proxy: x_t's prompt-only blocks go; trace: a round keeps only the blocks it
    unmasked something in), and the log-probs stay exact (test above)."""
    model = tiny_rl_model(dtype=torch.float64, peaky=20.0)
    lb = varied_layout_batch(model, mode)
    n_all, bs = lb.layout.n, lb.layout.block_size
    mbs = pack_micro_batches(lb, range(12), 10**6)
    t_copy, t_blk = lb.tgt_col // n_all, (lb.tgt_col % n_all) // bs
    want, whole, cut_blocks = 0, 0, 0
    for i in range(12):
        mine = lb.tgt_row == i
        if not bool(mine.any()):
            continue
        decoded = -(-int(lb.layout.lengths[i]) // bs) * bs
        clean = min(decoded, int(t_blk[mine].max()) * bs)  # clean blocks before the last block with a target
        want += len(set(zip(t_copy[mine].tolist(), t_blk[mine].tolist()))) * bs + clean
        whole += (int(t_copy[mine].max()) + 2) * decoded  # every noisy copy up to the last round, whole
        cut_blocks += (decoded - clean) // bs
    assert sum(mb.used for mb in mbs) == want < whole
    assert cut_blocks >= 12  # every sample's last block at least (was: kept, read by nothing)
    for mb in mbs:  # each segment: one contiguous run; noisy positions are whole blocks of one copy
        lay = mb.layout
        assert lay.num_segments == mb.samples.numel()
        noisy = lay.copy[0] >= 0
        assert int(noisy.sum()) % bs == 0


@pytest.mark.parametrize("mode", ["block_proxy", "trace"])
def test_packing_masks_the_keys_past_a_length_inside_a_block(mode):
    """Valid lengths that end inside a block (a hand-made LayoutBatch: check_layout_batch accepts it, build_layout_batch
    makes whole blocks): in every packed row a position is a valid key exactly when it lies in a segment and its
    position in the copy is below its sample's length (key_ok, checked position by position), and the packed
    log-probs are those of the padded forward, whose mask drops the keys at or past the length (REFERENCE §3: pad
    keys are masked)."""
    model = tiny_rl_model(dtype=torch.float64, peaky=20.0)
    lb = varied_layout_batch(model, mode)
    n, bs = lb.layout.n, lb.layout.block_size
    last = torch.zeros(12, dtype=torch.long).scatter_reduce(0, lb.tgt_row, lb.tgt_col % n, "amax")
    lengths = torch.minimum(last + 2, lb.layout.lengths.long())  # one position past each row's last target
    assert int((lengths % bs != 0).sum()) >= 4 and int((lengths < lb.layout.lengths).sum()) >= 4
    cut = LayoutBatch(lb.x0, lb.rnd, lb.mask_id, MaskLayout(n, lb.layout.num_copies, bs, lengths), lb.tgt_row,
                      lb.tgt_col, lb.targets, lb.resp_pos)
    with torch.no_grad():
        want = batch_logprobs(model, cut)
        assert (want - batch_logprobs(model, lb)).abs().max() > 1e-6  # the cut keys mattered to some targets
    for budget in (1, 100, 10**6):
        got, past = torch.empty_like(want), 0
        for mb in pack_micro_batches(cut, range(12), budget, pad_shapes=budget == 100, pad_id=MASK):
            seg = mb.layout.seg[0].long()
            inside = seg >= 0
            sample = mb.samples[seg.clamp_min(0)]
            assert torch.equal(mb.layout.key_ok[0], inside & (mb.position_ids[0] < lengths[sample]))
            past += int((inside & (mb.position_ids[0] >= lengths[sample])).sum())
            with torch.no_grad():
                got[mb.sel] = micro_batch_logprobs(model, mb)
        assert past > 0  # packed positions past a length (in the blocks the length ends in) exist and are masked
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_packed_length_is_a_few_multiples_of_128():
    seen = set()
    for used in range(1, 20000, 37):
        length = packed_length(used, 16384)
        assert length % 128 == 0 and length >= used
        assert length <= max(128 * 5, used * 1.25 + 128) and (used > 16384 or length <= 16384)
        seen.add(length)
    assert packed_length(16000, 16384) == 16384 and packed_length(16384, 16384) == 16384
    assert packed_length(16385, 16384) == 20480  # a sample larger than the budget runs alone
    assert len(seen) <= 4 * 8 + 4  # about four lengths per octave


def test_packed_loss_and_gradients_equal_the_padded_forward():
    """The training pass over packed micro-batches equals the fused loss over the padded LayoutBatch (one forward,
    every target read where build_layout_batch puts it): same loss, same gradients."""
    from lightningrl_fast.ops.grpo_loss import fused_linear_grpo_loss

    model = tiny_rl_model(dtype=torch.float64, peaky=20.0)
    lb = varied_layout_batch(model, "block_proxy", seed=6)
    adv_tok, old, ref, correct = loss_inputs(lb, seed=2)
    cfg = RLConfig(micro_batch_tokens=64, kl_beta=0.05, nll_weight=0.1, group_size=2, prompts_per_step=6)
    model.zero_grad()
    agg = loss_backward_stage(model, lb, range(12), adv_tok, old, ref, correct, cfg)
    got = [p.grad.clone() for p in model.parameters()]
    assert 0 < agg["used"] <= agg["positions"] < lb.input_ids.numel()
    model.zero_grad()
    h = model.hidden(lb.input_ids, lb.position_ids, lb.layout)[lb.tgt_row, lb.tgt_col]
    present = torch.unique(lb.tgt_row)
    totals = (len(present), lb.num_tokens, int(correct[present].sum()), int(correct[lb.tgt_row].sum()))
    loss, _, _ = fused_linear_grpo_loss(h, model.lm_head.weight, lb.targets, old, ref, adv_tok, lb.tgt_row, 12,
                                        correct, eps_low=0.2, eps_high=0.2, beta=0.05, mu=0.1,
                                        reduction="seq-tok-tok", totals=totals, suppress_token=MASK)
    loss.backward()
    assert agg["loss"] == pytest.approx(float(loss.detach()), rel=1e-10)
    for a, b in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_reference_offload_state_and_tied_embeddings():
    tied = SDARConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, block_size=4, mask_token_id=MASK, torch_dtype="float32",
                      tie_word_embeddings=True)
    model = build_model(tied, dtype=torch.float32, seed=1).eval()
    state = make_state(model, RLConfig(kl_beta=0.01, reference_offload=True, group_size=2))
    ref = state.ref_model
    assert ref.lm_head.weight is ref.model.embed_tokens.weight  # tie kept
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(model.parameters(), ref.parameters()))
    lb = reference_batch(tiny_rl_model(dtype=torch.float32))  # ids < V: valid for this model too
    rc = RLConfig(micro_batch_tokens=10**6)
    torch.testing.assert_close(reference_stage(state, lb, rc), logprob_stage(model, lb, rc.micro_batch_tokens))


@pytest.mark.gpu
@pytest.mark.timeout(400)  # compiles FlexAttention (forward, or forward + backward) per shape: minutes
def test_gpu_reference_stages_on_cuda():
    """The policy on the GPU: the old-policy pass takes the host LayoutBatch to the device, and a host-resident
    reference streamed layer by layer gives the log-probs of the same reference held on the GPU."""
    import copy

    model = tiny_rl_model(dtype=torch.float32)
    lb = reference_batch(model)
    cpu = logprob_stage(model, lb, 10**6)
    gpu_model = copy.deepcopy(model).cuda()
    torch.testing.assert_close(logprob_stage(gpu_model, lb, 10**6), cpu, rtol=0, atol=2e-4)
    state = make_state(gpu_model, RLConfig(kl_beta=0.01, reference_offload=True, group_size=2,
                                           micro_batch_tokens=lb.input_ids.shape[1] * 3))
    assert next(state.ref_model.parameters()).device.type == "cpu"
    torch.testing.assert_close(reference_stage(state, lb, RLConfig(micro_batch_tokens=lb.input_ids.shape[1] * 3)),
                               cpu, rtol=0, atol=2e-4)


@pytest.mark.gpu
@pytest.mark.timeout(400)  # compiles FlexAttention (forward) per shape: minutes
@pytest.mark.parametrize("lag", ["copy", "compute"])
def test_gpu_streamed_reference_never_races_its_layer_copies(monkeypatch, lag):
    """On a GPU, with one side made to lag (a long sleep queued before every layer's copy on the side stream, or
    before every layer's compute on the current stream): a layer computing before its copy landed ("copy"), or a
    buffer refilled while a layer still computes on it ("compute"), would change the log-probs. 3 layers (buffers
    refilled within a chunk), chunks of two or more micro-batches; equal to the plain forward on the GPU of the same
    weights (and so to the serial copies of before)."""
    import copy

    import lightningrl_fast.rl.logprobs as LP

    fill, take = LP._LayerFeed.fill, LP._LayerFeed.take

    def lagging_fill(self, k, layer):
        if self.side is not None:
            with torch.cuda.stream(self.side):
                torch.cuda._sleep(5_000_000)
        fill(self, k, layer)

    def lagging_take(self, k):
        buf = take(self, k)
        torch.cuda._sleep(5_000_000)  # on the current stream, after the wait for the copy: the compute lags
        return buf

    monkeypatch.setattr(LP._LayerFeed, *(("fill", lagging_fill) if lag == "copy" else ("take", lagging_take)))
    cfg = SDARConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4, mask_token_id=TINY_MASK,
                     torch_dtype="float32", max_position_embeddings=256)
    model = build_model(cfg, dtype=torch.float32, seed=3).eval()
    lb = reference_batch(model, "trace")
    width = lb.input_ids.shape[1]
    dev = torch.device("cuda")
    mbs = list(micro_batches(lb, range(8), width, torch.device("cpu"), MASK))  # host ids: embedded on the host
    want = logprob_stage(copy.deepcopy(model).to(dev), lb, width)
    ref = host_copy(model, pin=True)
    got = streamed_logprobs(ref, lb, mbs, dev, 2 * width)
    torch.testing.assert_close(got.cpu(), want.float().cpu(), rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.timeout(400)  # compiles FlexAttention (forward, or forward + backward) per shape: minutes
@pytest.mark.parametrize("mode", ["block_proxy", "trace"])
def test_gpu_packed_training_pass_matches_the_cpu(mode):
    """The training pass on CUDA (packed rows rounded to packed_length, FlexAttention forward and backward over the
    token tables, pinned non-blocking uploads) gives the float64 CPU loss and gradients to float32 accuracy."""
    import copy

    model = tiny_rl_model(dtype=torch.float64, peaky=20.0)
    lb = varied_layout_batch(model, mode)
    adv_tok, old, ref, correct = loss_inputs(lb, seed=3)
    cfg = RLConfig(micro_batch_tokens=256, kl_beta=0.05, nll_weight=0.1, group_size=2, prompts_per_step=6)
    cpu = loss_backward_stage(model, lb, range(12), adv_tok, old, ref, correct, cfg)
    gpu_model = copy.deepcopy(model).float().cuda()
    gpu_model.zero_grad()
    gpu = loss_backward_stage(gpu_model, lb, range(12), adv_tok.float(), old.float(), ref.float(), correct, cfg)
    assert gpu["positions"] % 128 == 0 and gpu["used"] == cpu["used"]
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=1e-4, abs=1e-5)
    for (name, a), b in zip(model.named_parameters(), gpu_model.parameters()):
        err = (b.grad.double().cpu() - a.grad).abs().max().item()
        assert err <= 1e-3 * max(1.0, a.grad.abs().max().item()), (name, err)


def test_passes_check_target_ids_once_on_the_host():
    model = tiny_rl_model(dtype=torch.float64)
    lb = reference_batch(model)
    lb.targets[3] = V  # not a vocabulary id
    with pytest.raises(ValueError, match=r"target token ids must lie in \[0, 111\), got .*\.\.111"):
        logprob_stage(model, lb, 10**6)
    cfg = RLConfig(micro_batch_tokens=10**6, group_size=2)
    adv = torch.zeros(lb.num_tokens, dtype=torch.float64)
    with pytest.raises(ValueError, match="target token ids"):
        loss_backward_stage(model, lb, range(8), adv, None, None, torch.zeros(8, dtype=torch.bool), cfg)


@pytest.mark.gpu
@pytest.mark.timeout(400)  # compiles FlexAttention (forward, or forward + backward) per shape: minutes
def test_gpu_training_passes_do_not_sync_per_micro_batch():
    """The packed passes upload without blocking and check ids once on the host: the number of host syncs of a
    log-prob pass and of a loss pass does not grow with the number of micro-batches."""
    import warnings

    model = tiny_rl_model(dtype=torch.float32).cuda()
    lb = varied_layout_batch(tiny_rl_model(dtype=torch.float64, peaky=20.0), "block_proxy")
    adv = torch.randn(lb.num_tokens)
    correct = torch.tensor([True, False] * 6)

    def syncs(fn):
        fn()  # compiles and caches first
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(x.message) for x in w)

    counts = {}
    for budget in (10**6, 128):  # one micro-batch vs several
        cfg = RLConfig(micro_batch_tokens=budget, kl_beta=0.0, group_size=2)
        n_mb = len(list(micro_batches(lb, range(12), budget, torch.device("cuda"))))
        counts[n_mb] = (syncs(lambda: logprob_stage(model, lb, budget)),
                        syncs(lambda: loss_backward_stage(model, lb, range(12), adv, None, None, correct, cfg)))
    (few, a), (many, b) = sorted(counts.items())
    assert many > few and a == b, counts


def draw_rollout_batch(case):
    """A random decoded batch and its LayoutBatch for `test_packed_random_config`: 1-14 rows (prompts of 1-40
    tokens, some repeated as a GRPO group would), a decoding block size of 2-8 (the layout's), a threshold and
    temperature that give 1 to many tokens per step, EOS early, late or never, max_new_tokens 1-40, either mode.
    Returns (model, rollout, lb, mode, rng)."""
    rng = random.Random(case)
    model = tiny_rl_model(seed=case % 7, dtype=torch.float64, peaky=rng.choice([5.0, 20.0, 60.0]))
    bs = rng.choice([2, 3, 4, 4, 5, 8])
    base = [[rng.randrange(10, 100) for _ in range(rng.choice([1, bs - 1 or 1, bs, bs + 1, rng.randint(1, 40)]))]
            for _ in range(rng.randint(1, 7))]
    prompts = [p for p in base for _ in range(rng.choice([1, 2]))]
    cfg = SamplerConfig(block_size=bs, threshold=rng.choice([0.0, 0.3, 0.7, 1.0]), max_new_tokens=rng.randint(1, 40),
                        temperature=rng.choice([0.0, 1.0]), eos_ids=tuple(rng.sample(range(3, 100), 3)),
                        seed=case)
    ro = generate(model, prompts, cfg)
    mode = rng.choice(["block_proxy", "trace"])
    lb = build_layout_batch(ro.sequences, ro.seq_step_map, ro.prompt_lens, ro.lengths, bs, MASK, mode)
    return model, ro, lb, mode, rng


@pytest.mark.parametrize("case", fuzz_cases(6))
def test_packed_random_config(case):
    """A drawn batch packed into micro-batches (a drawn budget from 1 position to all of them, padded shapes or
    not, a drawn subset of the rows in any order) gives the padded LayoutBatch forward's log-probs for exactly the
    subset's targets, each once, rows within the budget unless one sample alone exceeds it; one case in three also
    checks the micro-batched loss, KL, clip fraction and gradients of a drawn mini-batch (drawn reductions, clip
    bounds, KL and NLL weights, on- or off-policy) against the hand-written objective over the padded forward. In
    trace mode the padded forward first reproduces the log-prob the sampler recorded for every response token
    (float32)."""
    model, ro, lb, mode, rng = draw_rollout_batch(case)
    n = lb.num_rows  # every decoded row has a target (its response holds at least one token)
    assert lb.num_tokens == int(ro.lengths.sum())
    with torch.no_grad():
        want = batch_logprobs(model, lb)
    if mode == "trace":
        torch.testing.assert_close(want.float(), ro.logp[lb.tgt_row, lb.resp_pos], rtol=0, atol=1e-5)
    if rng.random() < 0.35:  # valid lengths ending inside a block, past each row's last target (hand-made: the
        n_, bs = lb.layout.n, lb.layout.block_size  # sampler decodes whole blocks)
        last = torch.zeros(n, dtype=torch.long).scatter_reduce(0, lb.tgt_row, lb.tgt_col % n_, "amax")
        extra = torch.tensor([rng.randint(1, bs) for _ in range(n)])
        lengths = torch.minimum(last + extra, lb.layout.lengths.long())
        lb = LayoutBatch(lb.x0, lb.rnd, lb.mask_id, MaskLayout(n_, lb.layout.num_copies, bs, lengths), lb.tgt_row,
                         lb.tgt_col, lb.targets, lb.resp_pos)
        with torch.no_grad():
            want = batch_logprobs(model, lb)
    rows = rng.sample(range(n), rng.randint(1, n))
    budget = rng.choice([1, 7, 40, 128, 300, 10**6])
    pad = rng.random() < 0.5
    mbs = pack_micro_batches(lb, rows, budget, pad_shapes=pad, pad_id=MASK)
    sel = torch.cat([mb.sel for mb in mbs])
    in_rows = torch.isin(lb.tgt_row, torch.tensor(rows, dtype=torch.int64))
    assert sorted(sel.tolist()) == in_rows.nonzero()[:, 0].tolist()
    for mb in mbs:
        assert set(mb.samples.tolist()) <= set(rows) and torch.equal(mb.targets, lb.targets[mb.sel])
        assert mb.used <= mb.positions and (mb.used <= budget or mb.layout.num_segments == 1)
        assert mb.positions == (packed_length(mb.used, budget) if pad else mb.used)
        with torch.no_grad():
            torch.testing.assert_close(micro_batch_logprobs(model, mb), want[mb.sel], rtol=0, atol=1e-12)
    if case % 3:
        return
    # the micro-batched loss of a drawn mini-batch (rows a..b-1) with drawn coefficients and reductions against
    # REFERENCE §4 written out over the padded forward (test_rl.hand_loss): loss, KL, clip fraction, gradients
    from test_rl import hand_loss, padded_logp

    a = rng.randrange(n)
    rows = range(a, rng.randint(a + 1, n))
    red = "-".join(rng.choice(["seq", "tok"]) for _ in range(3))
    # off-policy (old log-probs 0.3 away) or on-policy (ratio 1 up to rounding: not with a clip bound of 0, where
    # the rounding decides the branch and the product and torch's min / clamp backward differ by design on the tie)
    off = rng.choice([0.0, 0.3])
    eps_low, eps_high = rng.choice([0.0, 0.1, 0.2][not off:]), rng.choice([0.0, 0.2, 0.28][not off:])
    beta, mu = rng.choice([0.0, 0.01, 0.5]), rng.choice([0.0, 0.1, 1.0])
    g = torch.Generator().manual_seed(case)
    adv_tok = torch.randn(n, generator=g, dtype=torch.float64)[lb.tgt_row]
    old = want + off * torch.randn(lb.num_tokens, generator=g, dtype=torch.float64)
    ref = want + 0.3 * torch.randn(lb.num_tokens, generator=g, dtype=torch.float64)
    correct = torch.rand(n, generator=g) < 0.5
    cfg = RLConfig(micro_batch_tokens=budget, kl_beta=beta, nll_weight=mu, eps_low=eps_low, eps_high=eps_high,
                   reduction=red)
    model.zero_grad()
    agg = loss_backward_stage(model, lb, rows, adv_tok, old, ref, correct, cfg)
    got = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad()
    mine = (lb.tgt_row >= rows.start) & (lb.tgt_row < rows.stop)
    logp = padded_logp(model, lb)
    loss, kl, frac = hand_loss(logp[mine], old[mine], ref[mine], adv_tok[mine], lb.tgt_row[mine], correct, beta, mu,
                               red, eps_low, eps_high)
    assert agg["loss"] == pytest.approx(float(loss.detach()), rel=1e-10, abs=1e-14), (red, rows)
    # the KL is measured only where it is in the loss (beta 0: no reference model in a run)
    assert agg["kl"] == pytest.approx(float(kl.detach()) if beta else 0.0, rel=1e-10, abs=1e-14)
    assert agg["clip_frac"] == pytest.approx(frac, abs=1e-6)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    for a_, b_ in zip(got, grads):
        torch.testing.assert_close(a_, torch.zeros_like(a_) if b_ is None else b_, rtol=1e-9, atol=1e-12)
