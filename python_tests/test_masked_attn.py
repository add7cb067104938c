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
