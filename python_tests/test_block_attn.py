"""ops.block_attention: reference vs a naive loop (CPU), kernel vs float64 reference (GPU), opcheck, bad inputs."""

import pytest
import torch

from lightningrl_fast.ops.block_attn import block_attention, block_attention_reference


def make_inputs(bsz, c, hq, hkv, d, cap, cache_lens, chunk_lens, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = rnd(bsz, c, hq, d), rnd(bsz, c, hkv, d), rnd(bsz, c, hkv, d)
    kc, vc = rnd(bsz, cap, hkv, d), rnd(bsz, cap, hkv, d)  # random "old" cache content beyond the lengths too
    cl = torch.tensor(cache_lens, dtype=torch.int32, device=device)
    nl = torch.tensor(chunk_lens, dtype=torch.int32, device=device)
    return q, k, v, kc, vc, cl, nl


def naive(q, k, v, kc, vc, cl, nl, bs, scale):
    kc, vc = kc.clone(), vc.clone()
    bsz, c, hq, d = q.shape
    g = hq // kc.shape[2]
    out = torch.zeros_like(q)
    for b in range(bsz):
        c0, n = int(cl[b]), int(nl[b])
        kc[b, c0 : c0 + n], vc[b, c0 : c0 + n] = k[b, :n], v[b, :n]
        for i in range(n):
            p = c0 + i
            keys = list(range(c0)) + [c0 + j for j in range(n) if (c0 + j) // bs <= p // bs]
            for h in range(hq):
                s = torch.stack([(q[b, i, h] * kc[b, t, h // g]).sum() * scale for t in keys])
                w = torch.softmax(s, 0)
                out[b, i, h] = (w[:, None] * vc[b, keys, h // g]).sum(0)
    return out, kc, vc


@pytest.mark.parametrize(
    "c,cache_lens,chunk_lens,bs",
    [
        (4, [0, 8, 4], [4, 4, 0], 4),  # one denoising block, an idle row
        (8, [0, 4, 12], [8, 8, 5], 4),  # finished block + next block, a partial chunk
        (9, [0, 0, 8], [9, 1, 3], 8),  # prefill of odd prompt lengths
        (1, [3, 0, 7], [1, 1, 1], 1),  # block size 1 = causal decoding
    ],
)
def test_reference_matches_naive(c, cache_lens, chunk_lens, bs):
    args = make_inputs(3, c, 4, 2, 8, 24, cache_lens, chunk_lens, seed=c)
    q, k, v, kc, vc, cl, nl = args
    want, want_kc, want_vc = naive(q, k, v, kc, vc, cl, nl, bs, 8**-0.5)
    got = block_attention(q, k, v, kc, vc, cl, nl, bs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_opcheck():
    q, k, v, kc, vc, cl, nl = make_inputs(2, 4, 4, 2, 8, 12, [0, 4], [4, 3], dtype=torch.float32)
    torch.library.opcheck(torch.ops.lightningrl_fast.block_attention.default, (q, k, v, kc, vc, cl, nl, 4, 0.35))


def test_bad_inputs_raise_clear_errors():
    q, k, v, kc, vc, cl, nl = make_inputs(2, 4, 4, 2, 8, 12, [0, 4], [4, 4], dtype=torch.float32)
    with pytest.raises(TypeError, match="k_cache must have dtype"):
        block_attention(q, k, v, kc.double(), vc, cl, nl, 4)
    with pytest.raises(ValueError, match=r"k must have shape \[2, 4, 2, 8\]"):
        block_attention(q, k[:, :3], v, kc, vc, cl, nl, 4)
    with pytest.raises(TypeError, match="cache_lens must have dtype"):
        block_attention(q, k, v, kc, vc, cl.long(), nl, 4)
    with pytest.raises(ValueError, match="multiple of the cache's kv heads"):
        block_attention(q[:, :, :3], k, v, kc, vc, cl, nl, 4)
    with pytest.raises(ValueError, match="row 1: cache_lens \\+ chunk_lens = 13 exceeds the KV cache capacity 12"):
        block_attention(q, k, v, kc, vc, torch.tensor([0, 9], dtype=torch.int32), nl, 4)
    with pytest.raises(ValueError, match="chunk_lens <= chunk length 4"):
        block_attention(q, k, v, kc, vc, cl, torch.tensor([4, 5], dtype=torch.int32), 4)
    before = kc.clone()
    with pytest.raises(ValueError, match="exceeds"):
        block_attention(q, k, v, kc, vc, torch.tensor([0, 10], dtype=torch.int32), nl, 4)
    assert torch.equal(kc, before)  # nothing written on a rejected call


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs,c,cache_lens,chunk_lens", [
    (4, 4, [0, 97, 1024, 4], [4, 4, 4, 0]),
    (32, 64, [0, 32, 1024, 992], [64, 64, 33, 64]),
    (8, 1025, [0, 0, 8, 16], [1025, 97, 1, 1000]),
])
def test_gpu_matches_float64_reference(dtype, bs, c, cache_lens, chunk_lens):
    cap = 2048 + 1024
    args64 = make_inputs(4, c, 32, 8, 128, cap, cache_lens, chunk_lens, device="cuda", seed=bs)
    want = block_attention_reference(*[a.clone() for a in args64], bs)
    low = [a.to(dtype) if a.is_floating_point() else a for a in args64]
    low_ref = block_attention_reference(*[a.clone() for a in low], bs).double()
    kc_low = low[3].clone()
    got = block_attention(low[0], low[1], low[2], kc_low, low[4].clone(), low[5], low[6], bs).double()
    err_ref = (low_ref - want).abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 2 * err_ref + 1e-6, (err, err_ref)
    for b, (c0, n) in enumerate(zip(cache_lens, chunk_lens)):
        assert torch.equal(kc_low[b, c0 : c0 + n], low[1][b, :n])
