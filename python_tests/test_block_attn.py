"""ops.block_attention: reference vs a naive loop (CPU), opcheck, bad inputs; the check and the random
configurations (draw and layouts) shared with the emulator tests (test_block_attn_emu.py: the CUDA kernel's source
under CPU emulation); the built kernel vs the float64 reference (GPU)."""

import random

import numpy as np
import pytest
import torch
from conftest import fuzz_cases

from lightningrl_fast import _ext
from lightningrl_fast.ops.block_attn import (VARIANT_ENV, VARIANTS, block_attention, block_attention_reference,
                                             kernel_supports, kernel_variant)


def make_inputs(bsz, c, hq, hkv, d, cap, cache_lens, chunk_lens, dtype=torch.float64, device="cpu", seed=0):
    if torch.device(device).type == "cuda":  # drawn on the GPU: CPU float64 draws of 5k-position caches took seconds
        g = torch.Generator(device=device).manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=g, device=device).to(dtype)  # noqa: E731
    else:
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


def test_reference_honours_softmax_scale_and_gqa_groups_of_three():
    """A non-default softmax_scale reaches the attention (the other CPU checks use d^-0.5, which SDPA also takes
    by itself), and q head h reads kv head h // 3 (6 q heads over 2 kv heads), at an odd capacity."""
    q, k, v, kc, vc, cl, nl = make_inputs(3, 9, 6, 2, 8, 97, [0, 61, 80], [9, 7, 9], seed=5)
    want, want_kc, want_vc = naive(q, k, v, kc, vc, cl, nl, 4, 0.3)
    got = block_attention(q, k, v, kc, vc, cl, nl, 4, softmax_scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_reference_out_of_range_rows_write_nothing_and_output_zeros():
    """With the host check off (the sampler's hot loop), the CPU reference treats each kind of bad row as the
    kernel does: it writes nothing and outputs zeros, while the good rows are exact."""
    # rows: good, cl + nl > capacity, cl < 0, nl < 0, nl > C, good (exactly filling the cache)
    cache_lens, chunk_lens = [3, 20, -1, 2, 0, 17], [4, 5, 3, -1, 6, 5]
    B, C, cap = 6, 5, 22
    q, k, v, kc, vc, cl, nl = make_inputs(B, C, 4, 2, 8, cap, cache_lens, chunk_lens, seed=9)
    kc0, vc0 = kc.clone(), vc.clone()
    got = block_attention(q, k, v, kc, vc, cl, nl, 4, check_lengths=False)
    for b in (1, 2, 3, 4):
        assert torch.equal(got[b], torch.zeros_like(got[b])), f"row {b}: output not zero"
        assert torch.equal(kc[b], kc0[b]) and torch.equal(vc[b], vc0[b]), f"row {b}: cache written"
    good = [0, 5]
    want, want_kc, want_vc = naive(q[good], k[good], v[good], kc0[good], vc0[good], cl[good], nl[good], 4, 8**-0.5)
    torch.testing.assert_close(got[good], want, rtol=1e-10, atol=1e-10)
    assert torch.equal(kc[good], want_kc) and torch.equal(vc[good], want_vc)


def test_opcheck():
    q, k, v, kc, vc, cl, nl = make_inputs(2, 4, 4, 2, 8, 12, [0, 4], [4, 3], dtype=torch.float32)
    torch.library.opcheck(torch.ops.lightningrl_fast.block_attention.default, (q, k, v, kc, vc, cl, nl, 4, 0.35))
    for dtype in (torch.bfloat16, torch.float64):  # the fake's output has q's dtype and shape
        q, k, v, kc, vc, cl, nl = make_inputs(2, 4, 6, 2, 8, 12, [0, 4], [4, 3], dtype=dtype)
        torch.library.opcheck(torch.ops.lightningrl_fast.block_attention.default, (q, k, v, kc, vc, cl, nl, 4, 0.35))


def test_kernel_variant_default_and_names(monkeypatch):
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    assert kernel_variant() == VARIANTS["auto"] == 0
    assert [kernel_variant(n) for n in ("auto", "mma", "wgmma")] == [0, 1, 2]
    monkeypatch.setenv(VARIANT_ENV, "wgmma")
    assert kernel_variant() == 2 and kernel_variant("mma") == 1
    monkeypatch.setenv(VARIANT_ENV, "fast")
    with pytest.raises(ValueError, match=f"{VARIANT_ENV} must be one of auto, mma, wgmma, got 'fast'"):
        kernel_variant()


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
    with pytest.raises(ValueError, match="variant must be one of auto, mma, wgmma, got 'tensor'"):
        block_attention(q, k, v, kc, vc, cl, nl, 4, variant="tensor")
    with pytest.raises(ValueError, match="row 1: cache_lens \\+ chunk_lens = 13 exceeds the KV cache capacity 12"):
        block_attention(q, k, v, kc, vc, torch.tensor([0, 9], dtype=torch.int32), nl, 4)
    with pytest.raises(ValueError, match="chunk_lens <= chunk length 4"):
        block_attention(q, k, v, kc, vc, cl, torch.tensor([4, 5], dtype=torch.int32), 4)
    before = kc.clone()
    with pytest.raises(ValueError, match="exceeds"):
        block_attention(q, k, v, kc, vc, torch.tensor([0, 10], dtype=torch.int32), nl, 4)
    assert torch.equal(kc, before)  # nothing written on a rejected call
    cases = [  # (argument index, replacement, error, match)
        (3, kc[:1], ValueError, r"k_cache must have shape \[2, \*, \*, 8\], got \[1, 12, 2, 8\]"),
        (4, vc[:, :11], ValueError, r"v_cache must have shape \[2, 12, 2, 8\], got \[2, 11, 2, 8\]"),
        (4, vc.double(), TypeError, r"v_cache must have dtype in \(float32\)"),
        (1, k[:, :, :1], ValueError, r"k must have shape \[2, 4, 2, 8\], got \[2, 4, 1, 8\]"),
        (6, nl[:1], ValueError, r"chunk_lens must have shape \[2\], got \[1\]"),
        (5, torch.tensor([-1, 0], dtype=torch.int32), ValueError, "cache_lens/chunk_lens must be >= 0"),
        # int32 cache_lens + chunk_lens past 2^31 must not wrap around to a small (fitting) sum
        (5, torch.tensor([2**31 - 1, 0], dtype=torch.int32), ValueError,
         "= 2147483651 exceeds the KV cache capacity 12"),
    ]
    for i, new, error, match in cases:
        args = [q, k, v, kc.clone(), vc.clone(), cl, nl]
        args[i] = new
        if i == 3:
            args[4] = vc[: new.shape[0], :, : new.shape[2]].clone()
        with pytest.raises(error, match=match):
            block_attention(*args, 4)
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a positive multiple of the cache's kv heads \(0\)"):
        block_attention(q, k[:, :, :0], v[:, :, :0], kc[:, :, :0], vc[:, :, :0], cl, nl, 4)  # was ZeroDivisionError
    kq = torch.zeros(2, 12, 2, 8)  # q inside k_cache: the cache write would overwrite queries before they are read
    with pytest.raises(ValueError, match="k_cache is written in place and must not share memory with q"):
        block_attention(kq.view(-1)[16 : 16 + q.numel()].view(q.shape), k, v, kq, vc.clone(), cl, nl, 4)



# ------------------------------------------------------------------------------------------- shared checks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def misaligned_view(shape, dtype, device="cpu", shift=1):
    """A dense tensor of `shape` whose data pointer is `shift` elements past a 16-byte boundary."""
    buf = torch.empty(int(np.prod(shape)) + 8, dtype=dtype, device=device)
    return buf[shift : shift + int(np.prod(shape))].view(shape)


def test_kernel_supports_only_caches_it_can_move_in_16_byte_units():
    """Dispatch (CPU-checkable metadata): dtype, head dim and a cache layout the kernel's 16-byte copies accept;
    any other cache view takes the reference instead of a launcher error."""
    q = torch.empty(2, 4, 8, 128, dtype=torch.bfloat16)
    kc = torch.empty(2, 64, 2, 128, dtype=torch.bfloat16)
    assert kernel_supports(q, kc, kc.clone())
    assert kernel_supports(q, kc[:, 8:40], kc[:, :32])  # a window of a larger cache: strides stay aligned
    assert not kernel_supports(q.float(), kc.float(), kc.float())
    assert not kernel_supports(q[..., :96], kc[..., :96], kc[..., :96])
    assert not kernel_supports(q, misaligned_view(kc.shape, kc.dtype), kc)  # pointer 2 bytes past a boundary
    assert not kernel_supports(q, kc, torch.empty(2, 64, 2, 129, dtype=kc.dtype)[..., :128])  # 258-byte head stride
    assert not kernel_supports(q, kc.transpose(-1, -2).contiguous().transpose(-1, -2), kc)  # strided last dim
    assert kernel_supports(q, kc[:1].expand(1, 64, 2, 128).clone()[:, :, :1], kc[:, :, :1])  # one head, size-1 dims
    wide = torch.empty(2, 64, 2, 136, dtype=torch.bfloat16)[..., :128]  # heads 272 bytes apart: 16-byte multiples
    assert kernel_supports(q, wide, wide.clone())
    odd = torch.empty(2, 64, 1, 128, dtype=torch.bfloat16).as_strided((2, 64, 1, 128), (8192, 128, 3, 1))
    assert kernel_supports(q[:, :, :4], odd, odd.clone())  # a size-1 dim's stride (6 bytes) is never used


def bits(t: torch.Tensor) -> torch.Tensor:
    """16-bit payload of a bf16/fp16 tensor (bitwise comparison, NaN poison included)."""
    return t.contiguous().view(torch.int16)


def poison_from(cache: torch.Tensor, cache_lens) -> torch.Tensor:
    """NaN at every position >= cache_lens[b]: the chunk write covers [cl, cl + n); a kernel that read a key
    position it must not (stale chunk rows in the cache, positions past the chunk) turns the output NaN."""
    out = cache.clone()
    for b, c0 in enumerate(cache_lens):
        out[b, max(c0, 0):] = float("nan")
    return out


def expected_caches(kc, vc, k, v, cache_lens, chunk_lens):
    kc, vc = kc.clone(), vc.clone()
    L, C = kc.shape[1], k.shape[1]
    for b, (c0, n) in enumerate(zip(cache_lens, chunk_lens)):
        if c0 >= 0 and 0 <= n <= C and c0 + n <= L:
            kc[b, c0 : c0 + n], vc[b, c0 : c0 + n] = k[b, :n], v[b, :n]
    return kc, vc


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance of two bf16/fp16 tensors in representable steps (+0 and -0 are 0 apart)."""

    def ordered(t):
        x = bits(t).to(torch.int32)
        return torch.where(x < 0, -(x & 0x7FFF), x)  # sign-magnitude bits -> integers in value order

    return (ordered(a) - ordered(b)).abs()


def test_ulps_apart():
    for dt in (torch.bfloat16, torch.float16):
        one = torch.tensor([1.0], dtype=dt)
        steps = (bits(one).to(torch.int32) + torch.tensor([0, 1, 2])).to(torch.int16).view(dt)
        assert ulps_apart(steps, one.expand(3)).tolist() == [0, 1, 2]
        assert ulps_apart(-steps, -one.expand(3)).tolist() == [0, 1, 2]
        zero = torch.zeros(1, dtype=dt)
        tiny = torch.tensor([1], dtype=torch.int16).view(dt)  # the smallest positive subnormal
        assert ulps_apart(-zero, zero).item() == 0 and ulps_apart(-tiny, tiny).item() == 2
        assert ulps_apart(-one, one).item() == 2 * bits(one).item()


def check_kernel(run, dtype, bsz, c, hq, hkv, d, cap, cache_lens, chunk_lens, bs, device="cpu", seed=0, scale=None):
    """run(q, k, v, k_cache, v_cache, cache_lens, chunk_lens, block_size, scale) -> (out, k_cache, v_cache)
    against the float64 reference: error within 2x the same-dtype PyTorch reference's (or, elementwise, one
    representable step from PyTorch's same-dtype result: kernel and PyTorch round values that differ slightly
    before rounding, which next to a rounding midpoint lands them on neighbouring values), zero rows past
    chunk_lens, caches bit-exact (chunk rows written, every other position untouched). scale: d^-0.5 if None."""
    args64 = make_inputs(bsz, c, hq, hkv, d, cap, cache_lens, chunk_lens, device=device, seed=seed)
    scale = d**-0.5 if scale is None else scale
    want = block_attention_reference(*[a.clone() for a in args64], bs, scale)
    low = [a.to(dtype) if a.is_floating_point() else a for a in args64]
    low_ref_lp = block_attention_reference(*[a.clone() for a in low], bs, scale)
    low_ref = low_ref_lp.double()
    q, k, v, kc, vc, cl, nl = low
    kc_in, vc_in = poison_from(kc, cache_lens), poison_from(vc, cache_lens)
    got_lp, kc_out, vc_out = run(q, k, v, kc_in.clone(), vc_in.clone(), cl, nl, bs, scale)
    assert got_lp.shape == q.shape and got_lp.dtype == dtype
    got = got_lp.double()
    assert not got.isnan().any(), "NaN in the output (a key position outside the mask was read)"
    err = (got - want).abs().max().item()
    err_ref = (low_ref - want).abs().max().item()
    # (the max-error bound alone fails a correct kernel where PyTorch's rounding happened to land closer to the
    # float64 value than a half step: test_emulated_check_allows_one_step_rounding_flip)
    off = ((got - want).abs() > 2 * err_ref + 1e-6) & (ulps_apart(got_lp, low_ref_lp.to(got_lp.device)) > 1)
    assert not off.any(), (err, err_ref, f"first element off: {[int(x) for x in off.nonzero()[0]]}")
    for b, n in enumerate(chunk_lens):
        assert torch.equal(got[b, n:], torch.zeros_like(got[b, n:])), f"row {b}: output past chunk_lens not zero"
    want_kc, want_vc = expected_caches(kc_in, vc_in, k, v, cache_lens, chunk_lens)
    assert torch.equal(bits(kc_out), bits(want_kc.to(kc_out.device))), "k_cache differs from the expected write"
    assert torch.equal(bits(vc_out), bits(want_vc.to(vc_out.device))), "v_cache differs from the expected write"
    return err, err_ref


# ------------------------------------------------------------- random configurations (emulator and GPU)

def contiguous_layout(tensors: dict) -> dict:
    """`layout` of emu_runner / layout_runner: each tensor as itself (storage = its elements, offset 0, dense
    strides)."""
    return {name: (t.reshape(-1), 0, t.stride()[:3]) for name, t in tensors.items()}


RESIDENT = (264, 228, 396, 528, 24)  # resident CTAs the split heuristic may see: 132 SMs x 2, 114 x 2, 132 x 3,
# 132 x 4 (head dim 64), a small device
FUZZ_COST = 500  # emulated CTA-tiles per case (about 2 ms each on one core)
FUZZ_ELEMS = 1 << 21  # elements per cache at most (input drawing and transfer)
GPU_FUZZ_ELEMS = 1 << 28  # on a GPU: float64 elements of the reference's largest tensors (B x Hq x L x max(C, D))


def strided_copy(t, pads=(0, 0, 0), offset=0, unit_strides=(None, None, None)):
    """(storage, offset, strides) for emu_runner's / layout_runner's `layout`: t [B, R, H, D] at a view whose dims
    0-2 are `pads` elements wider than dense (multiples of 8: 16-byte units, as the launcher needs), `offset`
    elements into a NaN-filled storage on t's device; a dim of size 1 takes its stride from `unit_strides` (any
    value: never multiplied by a nonzero index, and the launcher does not check it)."""
    B, R, H, D = t.shape
    strides = [0, 0, D + pads[2]]
    strides[1] = H * strides[2] + pads[1]
    strides[0] = R * strides[1] + pads[0]
    for dim, st in enumerate(unit_strides):
        if st is not None and t.shape[dim] == 1:
            strides[dim] = st
    n = offset + sum((size - 1) * st for size, st in zip(t.shape[:3], strides)) + D if t.numel() else offset
    storage = torch.full((n,), float("nan"), dtype=t.dtype, device=t.device)
    torch.as_strided(storage, t.shape, (*strides, 1), offset).copy_(t)
    return storage, offset, tuple(strides)


def fused_qkv(q, k, v, extra=0):
    """q, k, v as the model hands them over: views of one [B, C, (Hq + 2 Hkv) D + extra] projection output."""
    (B, C, Hq, D), Hkv = q.shape, k.shape[2]
    W = (Hq + 2 * Hkv) * D + extra
    buf = torch.full((B * C * W,), float("nan"), dtype=q.dtype, device=q.device)
    views = {}
    for name, t, off in (("q", q, 0), ("k", k, Hq * D), ("v", v, (Hq + Hkv) * D)):
        torch.as_strided(buf, t.shape, (C * W, W, D, 1), off).copy_(t)
        views[name] = (buf, off, (C * W, W, D))
    return views


def draw_layout(rng):
    """A random `layout` for emu_runner / layout_runner among those the launcher hands the kernel (16-byte aligned
    views): q / k / v contiguous, views of a fused projection, or padded; each cache contiguous, a window of a
    longer (or multi-layer) cache, or padded (e.g. heads 136 elements apart); odd strides on size-1 dims.
    -> (layout, words)"""
    def pads(hi):
        return tuple(8 * rng.randint(0, hi) for _ in range(3))

    def unit_strides():
        return tuple(rng.choice([None, rng.randint(1, 5000)]) for _ in range(3))

    qkv_kind = rng.choice(["contiguous", "fused", "padded"])
    qkv = dict(extra=8 * rng.choice([0, 0, 1, 6]), pads={n: pads(3) for n in "qkv"},
               offsets={n: 8 * rng.randint(0, 5) for n in "qkv"}, unit={n: unit_strides() for n in "qkv"})
    caches = {}
    for name in ("k_cache", "v_cache"):
        kind = rng.choice(["contiguous", "window", "padded"])
        caches[name] = dict(kind=kind, longer=rng.randint(0, 70), start=rng.random(), layer=rng.randint(0, 2),
                            pads=pads(2), offset=8 * rng.randint(0, 5), unit=unit_strides())

    def layout(tensors):
        views = contiguous_layout(tensors)
        if qkv_kind == "fused":
            views.update(fused_qkv(tensors["q"], tensors["k"], tensors["v"], qkv["extra"]))
        elif qkv_kind == "padded":
            for n in "qkv":
                views[n] = strided_copy(tensors[n], qkv["pads"][n], qkv["offsets"][n], qkv["unit"][n])
        for name, c in caches.items():
            t = tensors[name]
            B, L, H, D = t.shape
            if c["kind"] == "window":  # positions [w0, w0 + L) of a capacity-(L + longer) cache of layer `layer`
                w0 = int(c["start"] * (c["longer"] + 1))
                start = (c["layer"] * B * (L + c["longer"]) + w0) * H * D
                views[name] = strided_copy(t, (c["longer"] * H * D, 0, 0), start)
            elif c["kind"] == "padded":
                views[name] = strided_copy(t, c["pads"], c["offset"], c["unit"])
        return views

    words = f"q/k/v {qkv_kind}" + "".join(f", {n} {c['kind']}" for n, c in caches.items())
    return layout, words


def draw_config(rng, splits_of=None, gpu=False):
    """One configuration the launcher accepts and the op's dispatch sends to the kernel (see
    test_emulated_random_config). For the emulator (gpu=False), `splits_of(base_ctas, capacity, rows_per_cta,
    resident)` is the launcher's split heuristic, and the configuration is redrawn until its emulation costs at
    most FUZZ_COST CTA-tiles. For a GPU (gpu=True, test_gpu_random_config): larger shapes besides (up to 32 rows,
    8 kv heads: 32 q / 8 kv among the choices, caches of up to ~10k positions, prefill chunks of 131-1100), the
    variant "auto" too, the heuristic's splits left to the launcher (splits 0, splits_of unused), redrawn until the
    float64 reference's largest tensors have at most GPU_FUZZ_ELEMS elements. With gpu=False a seed draws what it
    drew before the parameter existed (a campaign's failed case still reproduces)."""
    while True:
        dt, d = rng.choice(["bf16", "fp16"]), rng.choice([64, 128])
        variant = rng.choice(["mma", "wgmma"] + (["auto"] if gpu else []))
        hkv = rng.choice([1, 1, 2, 2, 3, 4] + ([8, 8, 8] if gpu else []))
        g = rng.choice([1, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 9, 12, 16] + ([4, 4] if gpu else []))
        bsz = rng.choice([1, 1, 2, 2, 3, 4, 5] + ([8, 13, 16, 24, 32, 32] if gpu else []))
        bs = rng.choice([1, 2, 3, 4, 4, 5, 7, 8, 8, 16, 32, 32, 33, 64, 100, 1000, 2**31 - 1])
        r = rng.random()
        if gpu and r >= 0.9:  # a prefill of whole prompts
            c = rng.randint(131, 1100)
        elif r < 0.3:
            c = rng.randint(1, 9)
        elif r < 0.55:  # one block, or a finished block + the next
            c = bs * rng.choice([1, 1, 2]) if bs <= 64 else rng.randint(1, 130)
        elif r < 0.8:  # C * G at / next to a 64-row tile boundary
            c = max(1, -(-64 * rng.randint(1, 3) // g) + rng.choice([-1, 0, 0, 1]))
        else:
            c = rng.randint(1, 130)

        def chunk_len():
            r = rng.random()
            return c if r < 0.45 else 0 if r < 0.6 else 1 if r < 0.7 else rng.randint(0, c)

        m = rng.choice([1, 8, 32]) if gpu else 1  # on a GPU: caches of up to ~300, ~2.4k or ~9.6k positions
        odd_top, tiles, aligned_top, top = 200 * m, 4 * m, 256 * m, 300 * m

        def cache_len(n):
            r = rng.random()
            if r < 0.2:
                return 0
            if r < 0.35:
                return rng.randrange(1, odd_top, 2)  # odd
            if r < 0.5:  # the chunk starts at a key-tile boundary
                return 64 * rng.randint(1, tiles) + rng.choice([-1, 0, 1])
            if r < 0.65:
                return max(0, 64 * rng.randint(1, tiles) - n + rng.choice([-1, 0, 1]))  # ... or ends at one
            if r < 0.85:
                return bs * rng.randint(0, aligned_top // bs)  # block-aligned (the sampler's)
            return rng.randint(0, top)

        chunk_lens = [chunk_len() for _ in range(bsz)]
        cache_lens = [cache_len(n) for n in chunk_lens]
        need = max(c0 + n for c0, n in zip(cache_lens, chunk_lens))
        split_mode = rng.random()
        heuristic = split_mode >= 0.75
        r = rng.random() * (0.6 if heuristic else 1.0) + (0.4 if heuristic else 0.0)
        slack = 0 if r < 0.25 else rng.randint(1, 7) if r < 0.5 else rng.randint(8, 100) if r < 0.75 else \
            rng.randint(400, 2500)  # long capacities: the split heuristic splits
        cap = need + slack  # 0: an empty cache (every row idle)
        bad = None
        if rng.random() < 0.12:  # a row whose lengths are out of range (the sampler's check_lengths=False calls)
            b, bad = rng.randrange(bsz), rng.choice(["cache_lens < 0", "chunk_lens < 0", "chunk_lens > C",
                                                     "past capacity", "near int32 max"])
            if bad == "cache_lens < 0":
                cache_lens[b] = -rng.randint(1, 70)
            elif bad == "chunk_lens < 0":
                chunk_lens[b] = -rng.randint(1, 3)
            elif bad == "chunk_lens > C":
                chunk_lens[b] = c + rng.randint(1, 3)
            elif bad == "past capacity":
                chunk_lens[b] = rng.randint(1, c)
                cache_lens[b] = cap - chunk_lens[b] + rng.randint(1, 3)
            else:
                cache_lens[b], chunk_lens[b] = 2**31 - 1 - rng.randint(0, 3), rng.randint(1, c)
        kv_tiles = [-(-(c0 + n) // 64) for c0, n in zip(cache_lens, chunk_lens)
                    if c0 >= 0 and 0 <= n <= c and c0 + n <= cap]
        m_tiles = -(-c * g // 64)
        r = split_mode
        if r < 0.3:
            splits, how = 1, "1"
        elif r < 0.55:
            splits, how = rng.randint(2, 8), "random"
        elif r < 0.7:
            splits, how = min(64, max(kv_tiles, default=0) + rng.randint(1, 8)), "more than tiles"
        elif r < 0.75:
            splits, how = 64, "64 (the cap)"
        elif gpu:
            splits, how = 0, "heuristic (the launcher's, on this GPU)"
        else:
            resident = rng.choice(RESIDENT)
            splits = splits_of(m_tiles * bsz * hkv, cap, min(c * g, 64), resident)
            how = f"heuristic ({resident} resident CTAs)"
        if gpu:
            if bsz * hkv * g * cap * max(c, d) > GPU_FUZZ_ELEMS:
                continue
        else:
            ctas = m_tiles * bsz * hkv
            cost = ctas * splits + m_tiles * hkv * sum(kv_tiles)
            if cost > FUZZ_COST or bsz * cap * hkv * d > FUZZ_ELEMS:
                continue
        layout, layout_words = draw_layout(rng)
        return dict(dtype=dt, d=d, variant=variant, hq=hkv * g, hkv=hkv, bsz=bsz, c=c, block_size=bs,
                    cache_lens=cache_lens, chunk_lens=chunk_lens, cap=cap, bad_row=bad, splits=splits,
                    splits_from=how, defer=rng.random() < 0.5, emu_seed=rng.getrandbits(31),
                    scale=None if rng.random() < 0.7 else rng.choice([0.0, 0.02, 0.3, -0.25, 1.0]),
                    layout=layout, layout_words=layout_words)



# ------------------------------------------------------------------------------------------------------ GPU


@pytest.fixture
def cuda_kernels(cuda_ext_with):
    """The CUDA kernel must be what runs, else a GPU test would compare the reference with itself."""
    cuda_ext_with("block_attention")


def op_runner(variant="auto", check_lengths=None, device="cuda"):
    """The public op on `device` (CUDA: host length check + custom op + kernel) with the kernel variant `variant`;
    check_lengths as the op's (False: out-of-range rows reach the kernel, as the sampler's calls)."""

    def run(q, k, v, kc, vc, cl, nl, bs, scale):
        args = [t.to(device) for t in (q, k, v, kc, vc, cl, nl)]
        out = block_attention(*args, bs, scale, check_lengths=check_lengths, variant=variant)
        return out, args[3], args[4]

    return run


def direct_runner(num_splits, variant="auto"):
    def run(q, k, v, kc, vc, cl, nl, bs, scale):
        args = [t.cuda() for t in (q, k, v, kc, vc, cl, nl)]
        out = _ext.ext().block_attention(*args, bs, scale, num_splits, VARIANTS[variant])
        return out, args[3], args[4]

    return run


KERNEL_VARIANTS = ["mma", "wgmma"]  # the wgmma one needs an sm_90 GPU (H100/H200), like the project's targets


GPU_CASES = [
    # block, C, cache_lens, chunk_lens (4 rows; 32 q / 8 kv heads, head_dim 128)
    (4, 4, [0, 97, 1024, 4], [4, 4, 4, 0]),  # one denoising block, an idle row
    (8, 16, [0, 8, 2048, 1000], [16, 8, 16, 13]),  # finished block + next block, partial chunks
    (32, 64, [0, 32, 1024, 992], [64, 64, 33, 64]),
    (32, 32, [4096, 0, 3000, 17], [32, 32, 1, 32]),
    (8, 1025, [0, 0, 8, 16], [1025, 97, 1, 1000]),  # prefill of whole prompts, odd lengths
    (4, 1, [0, 5, 100, 4100], [1, 1, 1, 1]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs,c,cache_lens,chunk_lens", GPU_CASES)
def test_gpu_matches_float64_reference(cuda_kernels, dtype, bs, c, cache_lens, chunk_lens, variant):
    cap = 4096 + 1025 + 3
    check_kernel(op_runner(variant), dtype, 4, c, 32, 8, 128, cap, cache_lens, chunk_lens, bs, device="cuda",
                 seed=bs + c)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
@pytest.mark.parametrize("bs,c,cache_lens,chunk_lens", [GPU_CASES[0], GPU_CASES[2], (4, 8, [0, 3000, 511, 64], [8, 8, 8, 5])])
def test_gpu_forced_splits(cuda_kernels, num_splits, bs, c, cache_lens, chunk_lens, variant):
    check_kernel(direct_runner(num_splits, variant), torch.bfloat16, 4, c, 32, 8, 128, 4096, cache_lens, chunk_lens, bs,
                 device="cuda", seed=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("d,hq,hkv", [(64, 16, 8), (128, 8, 8), (128, 64, 8), (64, 4, 1), (128, 12, 4)])
@pytest.mark.parametrize("bs,c,cache_lens,chunk_lens", [(4, 8, [0, 97, 1024], [8, 4, 8]), (32, 97, [0, 64, 5], [97, 64, 3])])
def test_gpu_head_dims_and_groups(cuda_kernels, d, hq, hkv, bs, c, cache_lens, chunk_lens, variant):
    check_kernel(op_runner(variant), torch.float16, 3, c, hq, hkv, d, 1200, cache_lens, chunk_lens, bs, device="cuda",
                 seed=d + hq)


@pytest.mark.gpu
def test_gpu_wgmma_variant_on_rollout_shapes(cuda_kernels):
    """The shapes the wgmma variant is for (LightningRL rollouts: block 32, many rows, long caches; a prefill):
    within the bf16 bound of the float64 reference, and within a few bf16 ulps of the mma.sync variant."""
    for bsz, c, bs, cache_lens, chunk_lens, cap in (
        (16, 64, 32, [2048 - 32 * i for i in range(16)], [64 - (i % 3) * 16 for i in range(16)], 2400),
        (2, 1031, 32, [0, 0], [1031, 700], 1100),
    ):
        err, err_ref = check_kernel(direct_runner(0, "wgmma"), torch.bfloat16, bsz, c, 32, 8, 128, cap, cache_lens,
                                    chunk_lens, bs, device="cuda", seed=c)
        args = make_inputs(bsz, c, 32, 8, 128, cap, cache_lens, chunk_lens, dtype=torch.bfloat16, device="cuda", seed=c)
        out_mma = direct_runner(0, "mma")(*[a.clone() for a in args], bs, 128**-0.5)[0].double()
        out_wg = direct_runner(0, "wgmma")(*[a.clone() for a in args], bs, 128**-0.5)[0].double()
        assert (out_wg - out_mma).abs().max().item() <= 4 * err_ref + 1e-6  # both within 2x of the reference


@pytest.mark.gpu
@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
def test_gpu_strided_and_misaligned_inputs(cuda_kernels, variant):
    """q/k/v as views of a fused projection (strided, aligned: read in place) or misaligned (copied)."""
    B, C, Hq, Hkv, D, L, bs = 3, 8, 8, 2, 128, 300, 4
    cache_lens, chunk_lens = [0, 100, 292], [8, 5, 8]
    q, k, v, kc, vc, cl, nl = make_inputs(B, C, Hq, Hkv, D, L, cache_lens, chunk_lens, dtype=torch.bfloat16, device="cuda")
    want = block_attention_reference(*(t.double() for t in (q, k, v, kc.clone(), vc.clone())), cl, nl, bs)
    fused = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=2)  # [B, C, (Hq + 2 Hkv) D]
    qs, ks, vs = (fused[..., a : a + n * D].unflatten(2, (n, D)) for a, n in ((0, Hq), (Hq * D, Hkv), ((Hq + Hkv) * D, Hkv)))
    assert not qs.is_contiguous()

    def misaligned(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        return out

    for qq, kk, vv in ((qs, ks, vs), (misaligned(q), misaligned(k), misaligned(v))):
        kc2, vc2 = kc.clone(), vc.clone()
        got = block_attention(qq, kk, vv, kc2, vc2, cl, nl, bs, variant=variant).double()
        assert (got - want).abs().max().item() < 3e-2
        assert torch.equal(bits(kc2[1, 100:105]), bits(k[1, :5]))


@pytest.mark.gpu
def test_gpu_misaligned_cache_takes_the_reference(cuda_kernels):
    """A cache view the kernel cannot move in 16-byte units (data pointer 2 bytes off) is not an error: the op runs
    the reference (the cache write through kv_cache_write's byte-granular kernel), same result, cache written."""
    B, C, Hq, Hkv, D, L, bs = 2, 8, 8, 2, 128, 64, 4
    q, k, v, kc, vc, cl, nl = make_inputs(B, C, Hq, Hkv, D, L, [0, 37], [8, 5], dtype=torch.bfloat16, device="cuda")
    want = block_attention_reference(*(t.double() for t in (q, k, v, kc.clone(), vc.clone())), cl, nl, bs)
    kc2, vc2 = misaligned_view(kc.shape, kc.dtype, "cuda"), misaligned_view(vc.shape, vc.dtype, "cuda", shift=3)
    kc2.copy_(kc)
    vc2.copy_(vc)
    assert not kernel_supports(q, kc2, vc2)
    got = block_attention(q, k, v, kc2, vc2, cl, nl, bs).double()
    ref = block_attention_reference(q, k, v, kc.clone(), vc.clone(), cl, nl, bs).double()
    assert (got - want).abs().max().item() <= 2 * (ref - want).abs().max().item() + 1e-6
    assert torch.equal(bits(kc2[1, 37:42]), bits(k[1, :5])) and torch.equal(bits(vc2[0, :8]), bits(v[0]))
    assert torch.equal(bits(kc2[1, 42:]), bits(kc[1, 42:]))  # nothing past the chunk


@pytest.mark.gpu
@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
def test_gpu_lengths_past_capacity_never_write_out_of_bounds(cuda_kernels, variant):
    """_C called directly (no host check): bad rows write nothing, inside or outside their cache, and output zeros."""
    B, C, Hkv, D, L = 4, 8, 2, 128, 64
    dtype = torch.bfloat16
    guard = 4096
    storage = torch.full(((B * L) * Hkv * D + guard,), float("nan"), dtype=dtype, device="cuda")
    kc = storage[: B * L * Hkv * D].view(B, L, Hkv, D)
    vstore = storage.clone()
    vc = vstore[: B * L * Hkv * D].view(B, L, Hkv, D)
    q = torch.randn(B, C, 8, D, device="cuda").to(dtype)
    k, v = torch.randn(B, C, Hkv, D, device="cuda").to(dtype), torch.randn(B, C, Hkv, D, device="cuda").to(dtype)
    kc[:, :60] = 1.0
    vc[:, :60] = 1.0
    before_k, before_v = storage.clone(), vstore.clone()
    for cache_lens, chunk_lens in (([0, 60, 0, 58], [8, 8, 0, 6]), ([-3, 0, 2, 63], [8, 9, 1, 2])):
        cl = torch.tensor(cache_lens, dtype=torch.int32, device="cuda")
        nl = torch.tensor(chunk_lens, dtype=torch.int32, device="cuda")
        storage.copy_(before_k)
        vstore.copy_(before_v)
        out = _ext.ext().block_attention(q, k, v, kc, vc, cl, nl, 4, D**-0.5, 0, VARIANTS[variant])
        torch.cuda.synchronize()
        want_k, want_v = expected_caches(before_k[: B * L * Hkv * D].view(B, L, Hkv, D),
                                         before_v[: B * L * Hkv * D].view(B, L, Hkv, D), k, v, cache_lens, chunk_lens)
        assert torch.equal(bits(kc), bits(want_k)) and torch.equal(bits(vc), bits(want_v))
        assert torch.equal(bits(storage[B * L * Hkv * D :]), bits(before_k[B * L * Hkv * D :]))
        for b, (c0, n) in enumerate(zip(cache_lens, chunk_lens)):
            if not (c0 >= 0 and 0 <= n <= C and c0 + n <= L):
                assert torch.equal(out[b], torch.zeros_like(out[b])), b
            else:
                assert not out[b].isnan().any()
        with pytest.raises(ValueError, match="cache_lens|chunk_lens"):
            block_attention(q, k, v, kc, vc, cl, nl, 4)  # the public op checks on the host first


@pytest.mark.gpu
def test_gpu_launcher_checks_inputs(cuda_kernels):
    """The C++ launcher is safe to call directly: its TORCH_CHECKs name the argument."""
    kernel = _ext.ext().block_attention
    q, k, v, kc, vc, cl, nl = make_inputs(2, 4, 4, 2, 128, 16, [0, 4], [4, 4], dtype=torch.bfloat16, device="cuda")
    a = dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc, cache_lens=cl, chunk_lens=nl, block_size=4, softmax_scale=0.1)
    for change, match in [
        (dict(q=q.float()), "q must have dtype in"),
        (dict(q=q.cpu()), "q must be a CUDA tensor"),
        (dict(k=k[:, :3]), "k must have shape"),
        (dict(v_cache=vc.half()), "q and v_cache must have the same dtype"),
        (dict(cache_lens=cl.long()), "cache_lens must have dtype"),
        (dict(chunk_lens=nl.cpu()), "chunk_lens is on"),
        (dict(cache_lens=torch.zeros(4, dtype=torch.int32, device="cuda")[::2]), "cache_lens must be contiguous"),
        (dict(q=q[:, :, :3]), "must be a positive multiple of the cache's kv heads"),
        (dict(block_size=0), "block_size must be positive"),
        (dict(softmax_scale=float("nan")), "softmax_scale must be finite"),
        (dict(num_splits=65), "num_splits must be in"),
        (dict(variant=3), "variant must be 0 \\(automatic\\), 1 \\(mma.sync\\) or 2 \\(wgmma\\), got 3"),
        (dict(softmax_scale=1e39), "out of the fp32 range"),
        (dict(q=q[:, :, :0]), "must be a positive multiple of the cache's kv heads"),
        (dict(k_cache=kc[:1].expand(kc.shape)), "k_cache is written in place and must not"),
        (dict(v_cache=kc), "k_cache and v_cache are both written in place"),
        # the launch writes the chunk's cache rows while other CTAs read q / k / v: none may live in a cache
        (dict(k=kc.view(-1)[: k.numel()].view(k.shape)), "k_cache is written in place and must not share memory with k "),
        (dict(q=vc.view(-1)[: q.numel()].view(q.shape)), "v_cache is written in place and must not share memory with q "),
    ]:
        with pytest.raises(RuntimeError, match=match):
            kernel(**(a | change))
    q96, k96, v96, kc96, vc96, _, _ = make_inputs(2, 4, 4, 2, 96, 16, [0, 4], [4, 4], dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        kernel(q96, k96, v96, kc96, vc96, cl, nl, 4, 0.1)
    buf = torch.zeros(kc.numel() + 1, dtype=kc.dtype, device="cuda")
    with pytest.raises(RuntimeError, match="k_cache must have a dense last dimension"):
        kernel(**(a | dict(k_cache=buf[1:].view(kc.shape))))
    before = kc.clone()
    for change in (dict(q=q.float()), dict(num_splits=65), dict(variant=-1)):  # a rejected call writes nothing
        with pytest.raises(RuntimeError):
            kernel(**(a | change))
    assert torch.equal(bits(kc), bits(before))


@pytest.mark.gpu
def test_gpu_public_op_runs_the_kernel(cuda_kernels, monkeypatch):
    import lightningrl_fast.ops.block_attn as mod

    def no_reference(*a, **k):
        raise AssertionError("the reference ran instead of the CUDA kernel")

    monkeypatch.setattr(mod, "block_attention_reference", no_reference)
    q, k, v, kc, vc, cl, nl = make_inputs(2, 4, 4, 2, 128, 16, [0, 4], [4, 4], dtype=torch.bfloat16, device="cuda")
    block_attention(q, k, v, kc, vc, cl, nl, 4)
    for name in KERNEL_VARIANTS:  # the variant reaches the kernel: the public op equals the direct call bitwise
        want = _ext.ext().block_attention(q, k, v, kc.clone(), vc.clone(), cl, nl, 4, 128**-0.5, 0, VARIANTS[name])
        assert torch.equal(bits(block_attention(q, k, v, kc.clone(), vc.clone(), cl, nl, 4, variant=name)), bits(want))
        monkeypatch.setenv("LRF_BLOCK_ATTN_VARIANT", name)
        assert torch.equal(bits(block_attention(q, k, v, kc.clone(), vc.clone(), cl, nl, 4)), bits(want))
    monkeypatch.delenv("LRF_BLOCK_ATTN_VARIANT")
    q, k, v, kc, vc, cl, nl = make_inputs(2, 4, 4, 2, 128, 16, [0, 4], [4, 4], dtype=torch.float32, device="cuda")
    with pytest.raises(AssertionError, match="reference ran"):  # fp32: not a kernel dtype, the reference path
        block_attention(q, k, v, kc, vc, cl, nl, 4)


@pytest.mark.gpu
def test_gpu_opcheck(cuda_kernels):
    q, k, v, kc, vc, cl, nl = make_inputs(2, 8, 8, 2, 128, 40, [0, 9], [8, 5], dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.lightningrl_fast.block_attention.default, (q, k, v, kc, vc, cl, nl, 4, 0.088))


# random configurations on the GPU: the emulator's draw (draw_config) with larger shapes, at the drawn layouts

GPU_FUZZ_CASES = 48  # estimated (not yet timed) at under 0.2 s each on an H100, the float64 reference at up to
# GPU_FUZZ_ELEMS included


def layout_runner(run, layout):
    """`run` given q / k / v / the caches as the views `layout` makes (draw_layout's {name: (storage, offset,
    strides)}) of storages of their own on the tensors' device, for the op to read and write in place; afterwards
    every storage element outside the caches' views must be unchanged (q / k / v storages entirely)."""

    def wrapped(q, k, v, kc, vc, cl, nl, bs, scale):
        tensors = {"q": q, "k": k, "v": v, "k_cache": kc, "v_cache": vc}
        placed = layout(tensors)  # (held: its storages' ids stay unique while in use)
        storages, views = {}, {}
        for name, (storage, offset, strides) in placed.items():
            if id(storage) not in storages:  # fused q / k / v: one storage, cloned once
                storages[id(storage)] = storage.clone()
            st = storages[id(storage)]
            views[name] = torch.as_strided(st, tensors[name].shape, (*strides, 1), offset)
            assert torch.equal(bits(views[name]), bits(tensors[name])), name
        keep = {key: torch.ones(st.numel(), dtype=torch.bool, device=st.device) for key, st in storages.items()}
        for name in ("k_cache", "v_cache"):
            _, offset, strides = placed[name]
            torch.as_strided(keep[id(placed[name][0])], kc.shape, (*strides, 1), offset).fill_(False)
        before = {key: st.clone() for key, st in storages.items()}
        out, kc_out, vc_out = run(views["q"], views["k"], views["v"], views["k_cache"], views["v_cache"], cl, nl, bs,
                                  scale)
        for key, st in storages.items():
            assert torch.equal(bits(st[keep[key]]), bits(before[key][keep[key]])), "written outside the caches' views"
        return out, kc_out, vc_out

    return wrapped


def random_config_runner(cfg):
    """The CUDA entry point for a configuration of draw_config(gpu=True): forced splits through _C
    (direct_runner), the launcher's heuristic (splits 0) through the public op, its host check off where a row is
    out of range; the op must send the drawn views to the kernel (kernel_supports), not to the reference."""
    if cfg["splits"]:
        return direct_runner(cfg["splits"], cfg["variant"])
    op = op_runner(cfg["variant"], check_lengths=False if cfg["bad_row"] else None)

    def run(q, k, v, kc, vc, *rest):
        assert kernel_supports(q, kc, vc), "the op would run the reference at these views"
        return op(q, k, v, kc, vc, *rest)

    return run


def check_random_config(case, runner, device="cuda"):
    """The configuration draw_config(gpu=True) draws from `case`, run by `runner(cfg)` (a check_kernel `run`) at
    the drawn layout (layout_runner), inputs drawn on `device`, checked by check_kernel as the emulator's random
    configurations; a failure names the configuration. -> (err, err_ref)"""
    cfg = draw_config(random.Random(case), gpu=True)
    words = {key: val for key, val in cfg.items() if key != "layout"}
    print("block_attn GPU fuzz case", case, words)
    try:
        return check_kernel(layout_runner(runner(cfg), cfg["layout"]), DTYPES[cfg["dtype"]], cfg["bsz"], cfg["c"],
                            cfg["hq"], cfg["hkv"], cfg["d"], cfg["cap"], cfg["cache_lens"], cfg["chunk_lens"],
                            cfg["block_size"], device=device, seed=case, scale=cfg["scale"])
    except Exception as e:
        raise AssertionError(f"block_attn fuzz case {case} {words}: {type(e).__name__}: {e}") from e


@pytest.mark.gpu
@pytest.mark.parametrize("case", fuzz_cases(GPU_FUZZ_CASES))
def test_gpu_random_config(cuda_kernels, case):
    """The built kernel on a random configuration of the emulator's space (test_block_attn_emu.py's
    test_emulated_random_config), larger: dtype, head dim, the variant (mma.sync / wgmma / the launcher's
    choice), 1-8 kv heads and GQA groups 1-16 (32 q / 8 kv among them), 1-32 rows, block sizes 1 to 2^31 - 1,
    chunks of 1-130 (at / next to the 64-row tiles) and prefills to 1100, idle / partial rows, caches to ~10k
    positions (odd, at key-tile boundaries, block-aligned) plus 0-2500 slack, sometimes an out-of-range row,
    splits 1 / 2-8 / more than the key tiles / 64 through _C or the launcher's heuristic through the public op, the
    softmax scale, q/k/v and cache layouts (views of fresh storages; nothing outside the caches' views written).
    Checked by check_kernel. The emulator's schedule seed and deferred copies are drawn but not used here (the
    hardware schedules), and the heuristic sees this GPU's resident CTAs, not RESIDENT's."""
    check_random_config(case, random_config_runner, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("B", [1, 24])  # batch 1 splits the keys (+ the combine launch); 24 rows may not
def test_gpu_cuda_graph_capture(cuda_kernels, B, variant):
    C, Hq, Hkv, D, L, bs = 8, 32, 8, 128, 2048, 4
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(B)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device="cuda", dtype=dtype)  # noqa: E731
    q, k, v = rnd(B, C, Hq, D), rnd(B, C, Hkv, D), rnd(B, C, Hkv, D)
    kc, vc = rnd(B, L, Hkv, D), rnd(B, L, Hkv, D)
    cl = torch.zeros(B, dtype=torch.int32, device="cuda")
    nl = torch.full((B,), C, dtype=torch.int32, device="cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        block_attention(q, k, v, kc, vc, cl, nl, bs, variant=variant)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block_attention(q, k, v, kc, vc, cl, nl, bs, variant=variant)

    for step in range(3):  # new values and lengths in the captured inputs
        q.copy_(rnd(B, C, Hq, D)), k.copy_(rnd(B, C, Hkv, D)), v.copy_(rnd(B, C, Hkv, D))
        c0 = torch.randint(0, L - C, (B,), generator=g).int()
        c0[0] = 1500 + 4 * step
        n = torch.randint(0, C + 1, (B,), generator=g).int()
        n[0] = C - step
        cl.copy_(c0)
        nl.copy_(n)
        ref_kc, ref_vc = kc.clone(), vc.clone()
        want = block_attention_reference(q.double(), k.double(), v.double(), ref_kc.double(), ref_vc.double(), cl, nl, bs)
        kv_want = expected_caches(ref_kc, ref_vc, k, v, c0.tolist(), n.tolist())
        graph.replay()
        torch.cuda.synchronize()
        assert (out.double() - want).abs().max().item() < 3e-2, step
        assert torch.equal(bits(kc), bits(kv_want[0])) and torch.equal(bits(vc), bits(kv_want[1]))
