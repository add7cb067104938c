"""masked_attention (mask-predicate attention for full sequences and training layouts) vs a naive loop."""

import math
import shutil

import pytest
import torch

from lightningrl_fast.ops.masked_attn import MaskLayout, masked_attention, masked_attention_reference


def naive_allow(n, copies, bs, length, q, k):
    cq, ck, pq, pk = q // n, k // n, q % n, k % n
    if pk >= length:
        return False
    bq, bk, clean = pq // bs, pk // bs, copies - 1
    if cq == clean and ck == clean:
        return bk <= bq
    if cq != clean and ck == clean:
        return bk < bq
    return cq == ck and bk == bq


def naive_attention(q, k, v, n, copies, bs, lengths, scale):
    bsz, hq, N, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(bsz):
        length = n if lengths is None else int(lengths[b])
        for h in range(hq):
            for i in range(N):
                keys = [j for j in range(N) if naive_allow(n, copies, bs, length, i, j)]
                if not keys:
                    continue
                s = torch.stack([(q[b, h, i] * k[b, h // g, j]).sum() * scale for j in keys])
                p = torch.softmax(s, 0)
                out[b, h, i] = sum(p[t] * v[b, h // g, j] for t, j in enumerate(keys))
    return out


@pytest.mark.parametrize("n,copies,bs", [(7, 1, 4), (9, 2, 4), (10, 3, 3), (5, 1, 1)])
def test_reference_matches_naive(n, copies, bs):
    torch.manual_seed(n * 10 + copies)
    bsz, hq, hkv, d = 2, 4, 2, 8
    N = n * copies
    q = torch.randn(bsz, hq, N, d, dtype=torch.float64)
    k = torch.randn(bsz, hkv, N, d, dtype=torch.float64)
    v = torch.randn(bsz, hkv, N, d, dtype=torch.float64)
    lengths = torch.tensor([n, max(1, n - 3)])
    lay = MaskLayout(n, copies, bs, lengths)
    got = masked_attention(q, k, v, lay)
    want = naive_attention(q, k, v, n, copies, bs, lengths, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_tiling_does_not_change_result(monkeypatch):
    import lightningrl_fast.ops.masked_attn as ma

    torch.manual_seed(0)
    q = torch.randn(1, 2, 97 * 2, 16, dtype=torch.float64)
    k, v = torch.randn_like(q), torch.randn_like(q)
    lay = MaskLayout.block_proxy(97, 8, torch.tensor([90]))
    whole = masked_attention_reference(q, k, v, lay)
    monkeypatch.setattr(ma, "_TILE_ELEMS", 16 * 97 * 2)  # forces tiles of 16 queries
    tiled = masked_attention_reference(q, k, v, lay)
    torch.testing.assert_close(tiled, whole, rtol=0, atol=1e-12)


def test_empty_rows_are_zero_and_grad_flows():
    q = torch.randn(1, 1, 8, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    lay = MaskLayout.block_causal(8, 4, torch.tensor([0]))
    out = masked_attention(q, k, k, lay)
    assert torch.equal(out, torch.zeros_like(out))
    lay = MaskLayout.block_causal(8, 4, torch.tensor([5]))
    masked_attention(q, k, k, lay).sum().backward()
    assert torch.isfinite(q.grad).all()


def test_bad_inputs():
    q = torch.randn(1, 4, 8, 4)
    k = torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        masked_attention(q, k, k, MaskLayout.block_causal(8, 4))
    k = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="does not match the layout"):
        masked_attention(q, k, k, MaskLayout.block_proxy(8, 4))
    with pytest.raises(ValueError, match="n, num_copies, block_size > 0"):
        MaskLayout(8, 1, 0)
    with pytest.raises(ValueError, match="rows but the batch"):
        masked_attention(q, k, k, MaskLayout.block_causal(8, 4, torch.tensor([3, 4])))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("n,copies,bs,lengths", [(97, 2, 4, [97, 61]), (128, 1, 8, None), (123, 3, 3, [1, 123])])
def test_padded_flex_path_matches_reference(n, copies, bs, lengths):
    """The CUDA path's padding (flex_length, the padded block mask, zero-padded q/k/v cut back to N) run with
    eager flex_attention on CPU (forward only: flex has no CPU backward) equals the reference."""
    from torch.nn.attention.flex_attention import flex_attention

    from lightningrl_fast.ops.masked_attn import block_mask, flex_length, flex_masked_attention

    torch.manual_seed(n + copies)
    N = n * copies
    assert flex_length(N) % 128 == 0 and 0 <= flex_length(N) - N < 128
    lens = torch.tensor(lengths) if lengths is not None else None
    lay = MaskLayout(n, copies, bs, lens)
    q = torch.randn(2, 4, N, 16, dtype=torch.float64)
    k = torch.randn(2, 2, N, 16, dtype=torch.float64)
    v = torch.randn(2, 2, N, 16, dtype=torch.float64)
    plan = block_mask(lay, 2, torch.device("cpu"))
    assert tuple(plan.shape[-2:]) == (flex_length(N), flex_length(N))
    got = flex_masked_attention(flex_attention, q, k, v, plan, 0.3)
    want = masked_attention_reference(q, k, v, lay, 0.3)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.timeout(400)  # compiles FlexAttention (forward, or forward + backward) per shape: minutes
def test_flex_compiles_past_the_default_recompile_limit():
    """A training run meets many (rows, length) shapes: more than dynamo's default 8 compiles of flex_attention
    must still run the fused kernel (the unfused fallback would warn and materialize the scores)."""
    import contextlib
    import warnings

    import torch._dynamo

    torch.manual_seed(2)
    strict = (torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
              if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit") else contextlib.nullcontext())
    with warnings.catch_warnings(), strict:
        warnings.simplefilter("error")  # eager flex_attention warns that it materializes the scores
        for i in range(9):  # one past dynamo's default limit of 8 (each compile costs seconds)
            rows, n = 1 + i % 3, 40 + 64 * i
            q = torch.randn(rows, 4, n * 2, 64, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(rows, 2, n * 2, 64, dtype=torch.bfloat16, device="cuda")
            lay = MaskLayout.block_proxy(n, 4, torch.full((rows,), n - 3, device="cuda"))
            got = masked_attention(q, k, k, lay).double()
            want = masked_attention_reference(q.double(), k.double(), k.double(), lay)
            assert (got - want).abs().max().item() < 0.05


@pytest.mark.gpu
@pytest.mark.timeout(400)  # compiles FlexAttention (forward, or forward + backward) per shape: minutes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flex_matches_reference_on_gpu(dtype):
    torch.manual_seed(1)
    n, copies, bs = 123, 2, 8
    q = torch.randn(2, 8, n * copies, 64, dtype=torch.float64, device="cuda")
    k = torch.randn(2, 2, n * copies, 64, dtype=torch.float64, device="cuda")
    v = torch.randn_like(k)
    lay = MaskLayout(n, copies, bs, torch.tensor([n, 97], device="cuda"))
    want = masked_attention_reference(q, k, v, lay)
    low = masked_attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), lay).double()
    got = masked_attention(q.to(dtype), k.to(dtype), v.to(dtype), lay).double()
    valid = torch.cat([torch.arange(n * copies, device="cuda") % n < length for length in (n, 97)]).view(2, 1, -1, 1)
    err_ref = ((low - want) * valid).abs().max().item()
    err = ((got - want) * valid).abs().max().item()
    assert err <= 2 * err_ref + 1e-3, (err, err_ref)
    assert math.isfinite(err)


def _old_int_mask_mod(n, copies, bs, lengths):
    """The mask_mod as block_mask built it before the geometry moved into a tensor (closure over Python ints)."""
    total, clean = n * copies, copies - 1

    def mask_mod(b, h, q_idx, kv_idx):
        cq, ck = q_idx // n, kv_idx // n
        pq, pk = q_idx - cq * n, kv_idx - ck * n
        bq, bk = pq // bs, pk // bs
        qc, kc = cq == clean, ck == clean
        allow = (qc & kc & (bk <= bq)) | (~qc & kc & (bk < bq)) | (~qc & (ck == cq) & (bk == bq))
        if lengths is not None:
            allow = allow & (pk < lengths[b])
        return allow & (q_idx < total) & (kv_idx < total)

    return mask_mod


@pytest.mark.parametrize("n,copies,bs,lengths", [(97, 1, 4, None), (97, 2, 4, [97, 61]), (40, 2, 8, [1, 40]),
                                                 (33, 3, 3, [33, 0]), (64, 2, 16, None), (128, 1, 8, [100, 128])])
def test_block_mask_predicate_matches_layout(n, copies, bs, lengths):
    """block_mask's tensor-geometry mask_mod is the layout predicate (naive loop, MaskLayout.allow with ints) on
    every (row, q, kv) of the padded square, padding excluded, and gives the same BlockMask as the old
    int-closure mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask

    from lightningrl_fast.ops.masked_attn import block_mask, flex_length

    lens = torch.tensor(lengths) if lengths is not None else None
    lay = MaskLayout(n, copies, bs, lens)
    total, padded = n * copies, flex_length(n * copies)
    plan = block_mask(lay, 2, torch.device("cpu"))
    b = torch.arange(2).view(2, 1, 1)
    q = torch.arange(padded).view(1, -1, 1)
    k = torch.arange(padded).view(1, 1, -1)
    got = plan.mask_mod(b, torch.zeros((), dtype=torch.long), q, k).expand(2, padded, padded)
    inside = (q < total) & (k < total)
    assert torch.equal(got, (lay.allow(b, q, k) & inside).expand(2, padded, padded))
    want = torch.zeros(2, padded, padded, dtype=torch.bool)
    for row in range(2):
        length = n if lens is None else int(lens[row])
        for i in range(total):
            for j in range(total):
                want[row, i, j] = naive_allow(n, copies, bs, length, i, j)
    assert torch.equal(got, want)
    old = create_block_mask(_old_int_mask_mod(n, copies, bs, lens), 2 if lens is not None else None, None,
                            padded, padded, device="cpu")
    assert plan.shape == old.shape
    assert torch.equal(plan.to_dense(), old.to_dense())
    assert torch.equal(plan.kv_num_blocks, old.kv_num_blocks) and torch.equal(plan.full_kv_num_blocks, old.full_kv_num_blocks)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("with_lengths", [True, False])
def test_compiled_flex_does_not_recompile_for_new_lengths(with_lengths):
    """The decoded length n changes almost every RL step: layouts whose lengths pad to the same flex_length must
    share one compiled flex_attention (the mask geometry is a tensor, guarded on metadata, not a Python int
    guarded on its value), and give the reference result."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    from lightningrl_fast.ops.masked_attn import block_mask, flex_length, flex_masked_attention

    torch._dynamo.reset()
    cnt = CompileCounter()
    flex = torch.compile(flex_attention, backend=cnt, dynamic=False)  # dynamic=False as the CUDA path compiles it
    torch.manual_seed(3)
    for n, copies in [(40, 2), (44, 2), (48, 2), (52, 2), (61, 2), (97, 1)]:
        assert flex_length(n * copies) == 128
        lens = torch.tensor([n, n - 3]) if with_lengths else None
        lay = MaskLayout(n, copies, 4, lens)
        q = torch.randn(2, 4, n * copies, 16, dtype=torch.float64)
        k = torch.randn(2, 2, n * copies, 16, dtype=torch.float64)
        v = torch.randn(2, 2, n * copies, 16, dtype=torch.float64)
        got = flex_masked_attention(flex, q, k, v, block_mask(lay, 2, torch.device("cpu")), 0.25)
        torch.testing.assert_close(got, masked_attention_reference(q, k, v, lay, 0.25), rtol=1e-10, atol=1e-10)
    assert cnt.frame_count == 1, f"flex_attention compiled {cnt.frame_count} times for one padded length"
    torch._dynamo.reset()


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler")
def test_compiled_block_mask_build_matches_eager_and_compiles_once():
    """block_mask(compiled=True) (the CUDA default: no dense [rows, N, N] intermediate) builds the same BlockMask
    as the eager build, with one inductor compile for every layout of one padded length."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lightningrl_fast.ops.masked_attn import block_mask

    torch._dynamo.reset()
    counters.clear()
    for n, copies, bs, lengths in [(40, 2, 4, [40, 37]), (52, 2, 4, [1, 52]), (97, 1, 8, [97, 90]), (33, 3, 3, [33, 0])]:
        lay = MaskLayout(n, copies, bs, torch.tensor(lengths))
        got = block_mask(lay, 2, torch.device("cpu"), compiled=True)
        want = block_mask(lay, 2, torch.device("cpu"), compiled=False)
        assert got.shape == want.shape
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


# --- PackedLayout: several sequences back to back per row (the trainer's packed micro-batches) ---------------

# (row, start, n, copies, length) per segment; row length 70 (not a multiple of 128), gaps and a tail of padding
SEGMENTS = [(0, 0, 8, 2, 7), (0, 16, 12, 3, 12), (0, 52, 4, 2, 3), (0, 60, 5, 1, 5), (1, 3, 12, 2, 9),
            (1, 27, 1, 1, 1), (1, 40, 8, 2, 8), (1, 56, 7, 2, 0)]


def packed_layout(segments=SEGMENTS, rows=2, total=70, bs=4):
    from lightningrl_fast.ops.masked_attn import PackedLayout

    row, start, n, copies, length = (torch.tensor(x) for x in zip(*segments))
    return PackedLayout.from_segments(rows, total, bs, row, start, n, copies, length)


def naive_packed_allow(segments, bs, row, i, j):
    for r, a, n, copies, length in segments:
        if r == row and a <= i < a + n * copies:
            return a <= j < a + n * copies and naive_allow(n, copies, bs, length, i - a, j - a)
    return False


def test_packed_predicate_matches_naive():
    """token_tables + packed_predicate (and block_mask's mask_mod over the padded square) on every (row, q, kv):
    the MaskLayout predicate inside each segment, nothing across segments or at padding."""
    from lightningrl_fast.ops.masked_attn import block_mask, flex_length, packed_predicate

    lay = packed_layout()
    padded = flex_length(70)
    b = torch.arange(2).view(2, 1, 1)
    q = torch.arange(padded).view(1, -1, 1)
    k = torch.arange(padded).view(1, 1, -1)
    tabs = lay.token_tables(padded)
    got = packed_predicate(tabs, b, q, k)
    want = torch.zeros(2, padded, padded, dtype=torch.bool)
    for row in range(2):
        for i in range(70):
            for j in range(70):
                want[row, i, j] = naive_packed_allow(SEGMENTS, 4, row, i, j)
    assert want.any() and torch.equal(got, want)
    plan = block_mask(lay, 2, torch.device("cpu"), compiled=False)
    assert torch.equal(plan.mask_mod(b, torch.zeros((), dtype=torch.long), q, k).expand(2, padded, padded), want)


def test_packed_reference_equals_each_segment_alone():
    """Forward and gradients of a packed batch equal each segment run alone under its MaskLayout (float64);
    padding positions give zeros and receive no gradient."""
    torch.manual_seed(7)
    lay = packed_layout()
    q = torch.randn(2, 4, 70, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 70, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 70, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, 70, 8, dtype=torch.float64)
    out = masked_attention(q, k, v, lay, softmax_scale=0.4)
    (out * w).sum().backward()
    covered = torch.zeros(2, 70, dtype=torch.bool)
    for r, a, n, copies, length in SEGMENTS:
        sl = slice(a, a + n * copies)
        covered[r, sl] = True
        qs, ks, vs = (t.detach()[r:r + 1, :, sl].clone().requires_grad_() for t in (q, k, v))
        want = naive_attention(qs.detach(), ks.detach(), vs.detach(), n, copies, 4, [length], 0.4)
        torch.testing.assert_close(out[r:r + 1, :, sl], want, rtol=0, atol=1e-12)
        alone = masked_attention_reference(qs, ks, vs, MaskLayout(n, copies, 4, torch.tensor([length])), 0.4)
        (alone * w[r:r + 1, :, sl]).sum().backward()
        for packed_t, seg_t in zip((q, k, v), (qs, ks, vs)):
            torch.testing.assert_close(packed_t.grad[r:r + 1, :, sl], seg_t.grad, rtol=0, atol=1e-12)
    pad = ~covered
    assert pad.any()
    assert torch.equal(out.detach().transpose(1, 2)[pad], torch.zeros_like(out.detach().transpose(1, 2)[pad]))
    for t in (q, k, v):
        assert torch.equal(t.grad.transpose(1, 2)[pad], torch.zeros_like(t.grad.transpose(1, 2)[pad]))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("ragged", [False, True])
def test_packed_flex_path_matches_reference(ragged):
    """The CUDA path of a PackedLayout (padded block mask over token tables, eager flex_attention on CPU, forward)
    equals the reference, for whole-copy and ragged segments."""
    from torch.nn.attention.flex_attention import flex_attention

    from lightningrl_fast.ops.masked_attn import block_mask, flex_masked_attention

    torch.manual_seed(8)
    lay = ragged_layout(**RAGGED)[0] if ragged else packed_layout()
    rows, total = lay.rows, lay.total
    q = torch.randn(rows, 4, total, 16, dtype=torch.float64)
    k = torch.randn(rows, 2, total, 16, dtype=torch.float64)
    v = torch.randn(rows, 2, total, 16, dtype=torch.float64)
    got = flex_masked_attention(flex_attention, q, k, v, block_mask(lay, rows, torch.device("cpu")), 0.3)
    torch.testing.assert_close(got, masked_attention(q, k, v, lay, softmax_scale=0.3), rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_compiled_flex_compiles_once_for_packed_layouts_of_one_length():
    """Every full packed micro-batch has the same row length but other segments: one compile serves them all."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    from lightningrl_fast.ops.masked_attn import block_mask, flex_masked_attention

    torch._dynamo.reset()
    cnt = CompileCounter()
    flex = torch.compile(flex_attention, backend=cnt, dynamic=False)
    torch.manual_seed(9)
    for segs in (SEGMENTS, [(0, 0, 32, 2, 29)], [(0, 5, 8, 3, 8), (0, 40, 12, 2, 5)], [(1, 1, 4, 1, 4)]):
        lay = packed_layout(segs)
        q = torch.randn(2, 4, 70, 16, dtype=torch.float64)
        k = torch.randn(2, 2, 70, 16, dtype=torch.float64)
        v = torch.randn(2, 2, 70, 16, dtype=torch.float64)
        got = flex_masked_attention(flex, q, k, v, block_mask(lay, 2, torch.device("cpu")), 0.25)
        torch.testing.assert_close(got, masked_attention(q, k, v, lay, softmax_scale=0.25), rtol=1e-10, atol=1e-10)
    assert cnt.frame_count == 1, f"flex_attention compiled {cnt.frame_count} times for one packed length"
    torch._dynamo.reset()


def test_packed_layout_bad_inputs():
    from lightningrl_fast.ops.masked_attn import PackedLayout

    with pytest.raises(ValueError, match="overlap in row 0"):
        packed_layout([(0, 0, 8, 2, 8), (0, 10, 4, 1, 4)])
    with pytest.raises(ValueError, match="segment 1 .* does not fit"):
        packed_layout([(0, 0, 8, 2, 8), (0, 60, 8, 2, 8)])  # ends at 76 > 70
    with pytest.raises(ValueError, match="segment 0 .* does not fit"):
        packed_layout([(2, 0, 8, 1, 8)])  # row 2 of 2
    with pytest.raises(ValueError, match="length <= n"):
        packed_layout([(0, 0, 8, 1, 9)])
    lay = packed_layout()
    tables = dict(seg=lay.seg, copy=lay.copy, block=lay.block, key_ok=lay.key_ok)
    split = lay.seg.clone()
    split[0, 65] = 0  # segment 0 again after others: not one contiguous run
    with pytest.raises(ValueError, match="segment 0 is not one contiguous run"):
        PackedLayout(4, **dict(tables, seg=split))
    across = torch.full((2, 4), -1)
    across[0, 2:], across[1, :2] = 0, 0  # contiguous in flat positions, but over two rows
    with pytest.raises(ValueError, match="segment 0 is not one contiguous run of one row"):
        PackedLayout(4, across, torch.full((2, 4), -1), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        PackedLayout(4, **dict(tables, key_ok=lay.key_ok[:, :5]))
    with pytest.raises(TypeError, match="key_ok must have dtype"):
        PackedLayout(4, **dict(tables, key_ok=lay.key_ok.int()))
    with pytest.raises(ValueError, match="block >= 0"):
        PackedLayout(4, **dict(tables, block=lay.block - 1))
    with pytest.raises(ValueError, match="segment ids must be < the number of positions"):
        PackedLayout(4, **dict(tables, seg=torch.where(lay.seg == 0, 2**40, lay.seg.long())))
    q = torch.randn(1, 4, 70, 8)
    with pytest.raises(ValueError, match="PackedLayout has 2 rows but the batch is 1"):
        masked_attention(q, q[:, :2], q[:, :2], lay)
    q = torch.randn(2, 4, 64, 8)
    with pytest.raises(ValueError, match="does not match the layout \\(70 packed positions\\)"):
        masked_attention(q, q[:, :2], q[:, :2], lay)


RAGGED = dict(n=12, copies=3, bs=4, length=10, keep=[(1, 2), (0, 1), (1, 0)], pad=5)


def ragged_layout(n, copies, bs, length, keep, pad):
    """One segment that is not whole copies: the noisy (copy, block) pieces `keep`, in that order, then the clean
    copy, then `pad` padding positions. Returns (layout, cols: the MaskLayout position of each kept position)."""
    from lightningrl_fast.ops.masked_attn import PackedLayout

    piece_pos = [(c, b, j) for c, b in keep for j in range(bs)]
    cols = [c * n + b * bs + j for c, b, j in piece_pos] + [(copies - 1) * n + p for p in range(n)]
    used, total = len(cols), len(cols) + pad
    seg, cpy = torch.full((1, total), -1), torch.full((1, total), -1)
    blk, ok = torch.zeros(1, total, dtype=torch.long), torch.zeros(1, total, dtype=torch.bool)
    seg[0, :used] = 0
    cpy[0, :used] = torch.tensor([c for c, _, _ in piece_pos] + [-1] * n)
    blk[0, :used] = torch.tensor([b for _, b, _ in piece_pos] + [p // bs for p in range(n)])
    ok[0, :used] = torch.tensor([b * bs + j < length for _, b, j in piece_pos] + [p < length for p in range(n)])
    return PackedLayout(bs, seg, cpy, blk, ok), torch.tensor(cols)


def test_packed_reference_handles_ragged_segments():
    """A segment need not be whole copies (the trainer keeps only the noisy blocks with targets): a layout of some
    noisy blocks plus the clean copy equals the full MaskLayout sequence on the positions kept; padding gives
    zeros whatever its values."""
    torch.manual_seed(12)
    r = RAGGED
    q, k, v = (torch.randn(1, h, r["n"] * r["copies"], 8, dtype=torch.float64) for h in (4, 2, 2))
    full = masked_attention_reference(q, k, v, MaskLayout(r["n"], r["copies"], r["bs"], torch.tensor([r["length"]])))
    lay, cols = ragged_layout(**r)
    used = cols.numel()
    packed = [torch.cat([t[:, :, cols], torch.randn(1, t.shape[1], r["pad"], 8, dtype=torch.float64)], 2)
              for t in (q, k, v)]
    got = masked_attention(*packed, lay)
    torch.testing.assert_close(got[:, :, :used], full[:, :, cols], rtol=0, atol=1e-12)
    assert torch.equal(got[:, :, used:], torch.zeros_like(got[:, :, used:]))


def test_packed_reference_query_tiles_match_a_dense_oracle(monkeypatch):
    """The packed reference split into query tiles of 16 (the other packed tests fit one tile): segments of
    97 x 2, 13 x 2 and 40 x 3 positions in three length buckets, GQA 6/2, against a dense float64 softmax under
    the mask built position by position from the naive rule (rows with no key: zeros)."""
    import lightningrl_fast.ops.masked_attn as ma

    segs, rows, total, bs = [(0, 0, 97, 2, 90), (0, 200, 13, 2, 11), (1, 5, 40, 3, 33)], 2, 230, 4
    lay = packed_layout(segs, rows=rows, total=total, bs=bs)
    monkeypatch.setattr(ma, "_TILE_ELEMS", 1)  # tile = the 16-query minimum
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(rows, h, total, 8, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    got = masked_attention(q, k, v, lay, softmax_scale=0.3)
    mask = torch.tensor([[[naive_packed_allow(segs, bs, r, i, j) for j in range(total)] for i in range(total)]
                         for r in range(rows)])  # [rows, total, total]
    kk, vv = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)  # q head h reads kv head h // 3
    s = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(~mask[:, None], float("-inf"))
    want = torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ vv
    assert mask.any(-1).sum() > 200 and not mask.any(-1).all()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.timeout(400)  # compiles FlexAttention (forward, or forward + backward) per shape: minutes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_packed_flex_matches_reference(dtype):
    """The compiled FlexAttention path of a packed micro-batch (one row of 1024 positions: segments of odd sizes,
    rounds and lengths, then padding), forward and backward, within 2x the error of the same-dtype reference."""
    torch.manual_seed(11)
    segs = [(0, 0, 97, 2, 93), (0, 194, 64, 3, 64), (0, 386, 123, 2, 123), (0, 632, 8, 1, 5), (0, 640, 200, 1, 181)]
    lay = packed_layout(segs, rows=1, total=1024, bs=8)
    shapes = ((1, 8, 1024, 64), (1, 2, 1024, 64), (1, 2, 1024, 64))
    q64, k64, v64 = (torch.randn(s, dtype=torch.float64, device="cuda", requires_grad=True) for s in shapes)
    w = torch.randn(shapes[0], dtype=torch.float64, device="cuda")

    def run(dtype_, force_reference):
        ts = [t.detach().to(dtype_).requires_grad_() for t in (q64, k64, v64)]
        if force_reference:
            from lightningrl_fast.ops.masked_attn import packed_attention_reference
            out = packed_attention_reference(*ts, lay)
        else:
            out = masked_attention(*ts, lay)
        (out.double() * w).sum().backward()
        return [out.double()] + [t.grad.double() for t in ts]

    want = run(torch.float64, True)
    low = run(dtype, True)
    got = run(dtype, False)
    for name, g, lo, wt in zip(("out", "dq", "dk", "dv"), got, low, want):
        err, err_ref = (g - wt).abs().max().item(), (lo - wt).abs().max().item()
        assert math.isfinite(err) and err <= 2 * err_ref + 1e-3, (name, err, err_ref)
