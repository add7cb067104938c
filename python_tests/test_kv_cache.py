"""kv_cache_write: reference vs a naive per-element loop (CPU), input errors, opcheck, the CUDA kernel's source
under the CPU emulator (csrc/emu/kv_cache_emu.cpp, with the launcher's plan), CUDA kernel (GPU)."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch
from conftest import EMU_GREEDY, fuzz_cases

from lightningrl_fast.ops.kv_cache import kv_cache_write, kv_cache_write_reference

_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-exact equality (NaN poison included)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    a, e = actual.contiguous().view(_INT_VIEW[actual.dtype]), expected.contiguous().view(_INT_VIEW[expected.dtype])
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} elements differ, first at {bad[0].tolist()}"


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """A cache full of values the op must never write: NaN and 1e4 alternating."""
    t = torch.full(shape, 1e4, dtype=dtype, device=device)
    t.view(-1)[::2] = float("nan")
    return t


def naive_write(k_cache, v_cache, k, v, cache_lens, chunk_lens) -> None:
    """The contract, one element at a time."""
    B, _, H, D = k_cache.shape
    for b in range(B):
        s, n = int(cache_lens[b]), int(chunk_lens[b])
        for t in range(n):
            for h in range(H):
                for d in range(D):
                    k_cache[b, s + t, h, d] = k[b, t, h, d]
                    v_cache[b, s + t, h, d] = v[b, t, h, d]


def make_case(B, L, C, H, D, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, C, H, D, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(B, C, H, D, generator=g).to(dtype=dtype, device=device)
    # mixed rows: empty cache + full chunk, cache filled to the end, empty chunk, random
    cache_lens = [0, L - C, int(torch.randint(0, L - C + 1, (1,), generator=g))]
    chunk_lens = [C, C, 0]
    for _ in range(3, B):
        n = int(torch.randint(0, C + 1, (1,), generator=g))
        cache_lens.append(int(torch.randint(0, L - n + 1, (1,), generator=g)))
        chunk_lens.append(n)
    lens = [torch.tensor(x[:B], dtype=torch.int32, device=device) for x in (cache_lens, chunk_lens)]
    return k, v, lens[0], lens[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("C", [1, 4, 9])
@pytest.mark.parametrize("L", [97, 123])
def test_reference_matches_naive_loop(dtype, C, L):
    B, H, D = 5, 2, 3
    k, v, cache_lens, chunk_lens = make_case(B, L, C, H, D, dtype)
    k_cache, v_cache = poisoned((B, L, H, D), dtype), poisoned((B, L, H, D), dtype)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    naive_write(k_want, v_want, k, v, cache_lens, chunk_lens)
    kv_cache_write(k_cache, v_cache, k, v, cache_lens, chunk_lens)
    assert_bits_equal(k_cache, k_want)
    assert_bits_equal(v_cache, v_want)


def test_untouched_outside_written_ranges():
    B, L, C, H, D = 3, 123, 9, 2, 4
    k, v, cache_lens, chunk_lens = make_case(B, L, C, H, D, torch.float32)
    k_cache, v_cache = poisoned((B, L, H, D), torch.float32), poisoned((B, L, H, D), torch.float32)
    before = k_cache.clone()
    kv_cache_write(k_cache, v_cache, k, v, cache_lens, chunk_lens)
    pos = torch.arange(L)
    written = (pos >= cache_lens[:, None].long()) & (pos < (cache_lens + chunk_lens)[:, None].long())  # [B, L]
    assert written.sum() == chunk_lens.sum()
    assert_bits_equal(k_cache[~written], before[~written])
    assert_bits_equal(k_cache[written], torch.cat([k[b, : chunk_lens[b]] for b in range(B)]))


def test_strided_views_and_lengths_not_advanced():
    """Caches as views of a [layers, B, L, H, D] buffer, k/v as head slices of a wider tensor."""
    B, L, C, H, D = 3, 97, 4, 2, 6
    big_k, big_v = poisoned((2, B, L, H, D), torch.float32), poisoned((2, B, L, H, D), torch.float32)
    wide = torch.randn(B, C, 2 * H, D)
    k, v = wide[:, :, :H], wide[:, :, H:]
    _, _, cache_lens, chunk_lens = make_case(B, L, C, H, D, torch.float32)
    lens_before = (cache_lens.clone(), chunk_lens.clone())
    k_want, v_want = big_k[1].clone(), big_v[1].clone()
    naive_write(k_want, v_want, k, v, cache_lens, chunk_lens)
    other_layer = big_k[0].clone()
    kv_cache_write(big_k[1], big_v[1], k, v, cache_lens, chunk_lens)
    assert_bits_equal(big_k[1], k_want)
    assert_bits_equal(big_v[1], v_want)
    assert_bits_equal(big_k[0], other_layer)
    assert torch.equal(cache_lens, lens_before[0]) and torch.equal(chunk_lens, lens_before[1])


def test_empty_batch_and_empty_chunk():
    k_cache, v_cache = poisoned((0, 8, 1, 4), torch.float32), poisoned((0, 8, 1, 4), torch.float32)
    z = torch.zeros(0, dtype=torch.int32)
    kv_cache_write(k_cache, v_cache, torch.zeros(0, 2, 1, 4), torch.zeros(0, 2, 1, 4), z, z)
    k_cache, v_cache = poisoned((2, 8, 1, 4), torch.float32), poisoned((2, 8, 1, 4), torch.float32)
    before = k_cache.clone()
    lens = torch.zeros(2, dtype=torch.int32)
    kv_cache_write(k_cache, v_cache, torch.zeros(2, 0, 1, 4), torch.zeros(2, 0, 1, 4), lens, lens)
    assert_bits_equal(k_cache, before)


def test_out_of_range_row_skipped_and_flagged_without_host_check():
    B, L, C, H, D = 3, 16, 4, 1, 2
    k, v = torch.randn(B, C, H, D), torch.randn(B, C, H, D)
    cache_lens = torch.tensor([0, 14, 3], dtype=torch.int32)  # row 1: 14 + 4 > 16
    chunk_lens = torch.tensor([4, 4, 2], dtype=torch.int32)
    k_cache, v_cache = poisoned((B, L, H, D), torch.float32), poisoned((B, L, H, D), torch.float32)
    before = k_cache.clone()
    flag = torch.zeros(1, dtype=torch.int32)
    kv_cache_write(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag=flag, check_lengths=False)
    assert int(flag) == 1
    assert_bits_equal(k_cache[1], before[1])
    assert_bits_equal(k_cache[0, :4], k[0])
    assert_bits_equal(k_cache[2, 3:5], k[2, :2])
    flag.zero_()
    kv_cache_write(k_cache, v_cache, k, v, cache_lens, torch.tensor([4, 2, 2], dtype=torch.int32), error_flag=flag)
    assert int(flag) == 0


def test_empty_chunk_still_checks_lengths():
    k_cache, v_cache = poisoned((2, 8, 1, 4), torch.float32), poisoned((2, 8, 1, 4), torch.float32)
    k = v = torch.zeros(2, 0, 1, 4)
    bad, zero = torch.tensor([0, 9], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="row 1 does not fit"):
        kv_cache_write(k_cache, v_cache, k, v, bad, zero)
    flag = torch.zeros(1, dtype=torch.int32)
    kv_cache_write(k_cache, v_cache, k, v, bad, zero, error_flag=flag, check_lengths=False)
    assert int(flag) == 1


def _good_args(dtype=torch.float32):
    B, L, C, H, D = 2, 10, 3, 2, 4
    return dict(
        k_cache=torch.zeros(B, L, H, D, dtype=dtype), v_cache=torch.zeros(B, L, H, D, dtype=dtype),
        k=torch.randn(B, C, H, D).to(dtype), v=torch.randn(B, C, H, D).to(dtype),
        cache_lens=torch.tensor([0, 7], dtype=torch.int32), chunk_lens=torch.tensor([3, 3], dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(k_cache=torch.zeros(2, 10, 2, 4, dtype=torch.int32)), TypeError, "k_cache must have dtype"),
        (dict(k=torch.zeros(2, 3, 2, 4, dtype=torch.float16)), TypeError, "k must have dtype"),
        (dict(cache_lens=torch.tensor([0, 7])), TypeError, "cache_lens must have dtype"),
        (dict(k_cache=torch.zeros(2, 10, 8)), ValueError, "k_cache must have 4 dimensions"),
        (dict(v_cache=torch.zeros(2, 11, 2, 4)), ValueError, r"v_cache must have shape \[2, 10, 2, 4\]"),
        (dict(k=torch.zeros(2, 3, 1, 4)), ValueError, r"k must have shape \[2, \*, 2, 4\]"),
        (dict(v=torch.zeros(2, 4, 2, 4)), ValueError, r"v must have shape \[2, 3, 2, 4\]"),
        (dict(chunk_lens=torch.tensor([3], dtype=torch.int32)), ValueError, "chunk_lens must have shape"),
        (dict(k=torch.zeros(2, 3, 2, 4, device="meta")), ValueError, "k is on meta"),
        (dict(cache_lens=torch.tensor([0, 8], dtype=torch.int32)), ValueError, r"row 1 does not fit.*L=10"),
        (dict(cache_lens=torch.tensor([-1, 0], dtype=torch.int32)), ValueError, "row 0 does not fit"),
        (dict(chunk_lens=torch.tensor([4, 0], dtype=torch.int32)), ValueError, r"row 0 does not fit.*C=3"),
        (dict(chunk_lens=torch.tensor([-2, 0], dtype=torch.int32)), ValueError, "row 0 does not fit"),
        (dict(k_cache=torch.zeros(2, 10, 4, 2).transpose(2, 3)), ValueError, "k_cache must have a contiguous last"),
        (dict(k_cache=[[0.0]]), TypeError, "k_cache must be a torch.Tensor"),
        (dict(v_cache=torch.zeros(2, 10, 2, 4, dtype=torch.float64)), TypeError,
         r"v_cache must have dtype in \(float32\)"),
        (dict(chunk_lens=torch.tensor([3, 3])), TypeError, r"chunk_lens must have dtype in \(int32\), got int64"),
        (dict(cache_lens=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
         r"cache_lens must have shape \[2\], got \[2, 1\]"),
        (dict(chunk_lens=torch.tensor([3, 3], dtype=torch.int32, device="meta")), ValueError, "chunk_lens is on meta"),
        (dict(v_cache=torch.zeros(2, 10, 4, 2).transpose(2, 3)), ValueError, "v_cache must have a contiguous last"),
    ],
)
def test_bad_inputs_raise(change, error, match):
    args = _good_args() | change
    with pytest.raises(error, match=match):
        kv_cache_write(**args)


def test_bad_error_flag_raises():
    with pytest.raises(TypeError, match="error_flag must have dtype"):
        kv_cache_write(**_good_args(), error_flag=torch.zeros(1))
    with pytest.raises(ValueError, match="error_flag must have at least one element"):
        kv_cache_write(**_good_args(), error_flag=torch.zeros(0, dtype=torch.int32))
    with pytest.raises(ValueError, match="error_flag is on meta but the other inputs are on cpu"):
        kv_cache_write(**_good_args(), error_flag=torch.zeros(1, dtype=torch.int32, device="meta"))


def test_chunk_inside_its_own_cache_is_refused():
    """v (read) lying inside v_cache (written): the write would read values it has already overwritten."""
    a = _good_args()
    a["v"] = a["v_cache"][:, 2:5]
    before = a["k_cache"].clone()
    with pytest.raises(ValueError, match=r"v_cache is written in place and must not share memory with v \(also read"):
        kv_cache_write(**a)
    assert torch.equal(a["k_cache"], before)


def test_kernel_gets_dense_lengths_and_dense_rows(monkeypatch):
    """The CUDA launcher reads cache_lens / chunk_lens densely and k / v rows as vectors: strided lengths and a
    strided last dim of k / v are made dense before the op (a stand-in for the kernel, on the CPU, records what it
    is given and writes with the reference)."""
    from lightningrl_fast.ops import kv_cache as kv_mod

    seen = []

    def kernel(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag):
        seen.append((cache_lens.is_contiguous(), chunk_lens.is_contiguous(), k.stride(-1), v.stride(-1)))
        kv_cache_write_reference(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag)

    monkeypatch.setattr(kv_mod, "cuda_kernel", lambda name, *tensors: kernel)
    a = _good_args()
    k, v = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (a["k"], a["v"]))  # last dim strided
    lens = torch.tensor([0, 9, 7, 9], dtype=torch.int32)[::2]
    n = torch.tensor([3, 0, 2, 0], dtype=torch.int32)[::2]
    k_want, v_want = a["k_cache"].clone(), a["v_cache"].clone()
    naive_write(k_want, v_want, k, v, lens, n)
    kv_cache_write(a["k_cache"], a["v_cache"], k, v, lens, n)
    assert seen == [(True, True, 1, 1)]
    assert_bits_equal(a["k_cache"], k_want)
    assert_bits_equal(a["v_cache"], v_want)


def test_reference_is_vectorized_oracle_for_bad_rows():
    """The reference itself (what the custom op runs on CPU) skips and flags out-of-range rows."""
    a = _good_args()
    a["cache_lens"] = torch.tensor([0, 8], dtype=torch.int32)
    flag = torch.zeros(2, dtype=torch.int32)
    kv_cache_write_reference(**a, error_flag=flag)
    assert flag.tolist() == [1, 0]
    assert torch.equal(a["k_cache"][0, :3], a["k"][0]) and not a["k_cache"][1].any()


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_reference_random_lengths_with_clamped_targets_and_bad_rows(monkeypatch, dtype, static):
    """Both ways of the reference: the static-shape one (CUDA's: no host sync, capturable) writes every (row, chunk
    token) pair somewhere, clamping targets past the cache into it, so several pairs can land on one position: each
    must carry the value the position ends with; the CPU's copies only the pairs that copy. Random small shapes
    (chunks longer than the cache too), lengths from -2 to past the cache: equal to the element loop, bad rows
    untouched and flagged, the rest of the cache untouched."""
    import lightningrl_fast.ops.kv_cache as K

    monkeypatch.setattr(K, "_write_pairs", K._write_static if static else K._write_pairs)
    g = torch.Generator().manual_seed(3)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    for _ in range(300):
        B, L, C, H, D = rnd(1, 5), rnd(1, 12), rnd(1, 9), rnd(1, 3), rnd(1, 4)
        k_cache, v_cache = poisoned((B, L, H, D), dtype), poisoned((B, L, H, D), dtype)
        k = torch.randn(B, C, H, D, generator=g).to(dtype)
        v = torch.randn(B, C, H, D, generator=g).to(dtype)
        cache_lens = torch.tensor([rnd(-2, L + 2) for _ in range(B)], dtype=torch.int32)
        chunk_lens = torch.tensor([rnd(-1, C + 1) for _ in range(B)], dtype=torch.int32)
        ok = [0 <= s and 0 <= n <= C and s + n <= L for s, n in zip(cache_lens.tolist(), chunk_lens.tolist())]
        k_want, v_want = k_cache.clone(), v_cache.clone()
        for b in [b for b in range(B) if ok[b]]:
            s0, n0 = int(cache_lens[b]), int(chunk_lens[b])
            k_want[b, s0:s0 + n0], v_want[b, s0:s0 + n0] = k[b, :n0], v[b, :n0]
        flag = torch.zeros(1, dtype=torch.int32)
        kv_cache_write_reference(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag=flag)
        assert_bits_equal(k_cache, k_want)
        assert_bits_equal(v_cache, v_want)
        assert flag.item() == (not all(ok))


@pytest.mark.parametrize("with_flag", [False, True])
def test_opcheck(with_flag):
    a = _good_args()
    flag = torch.zeros(1, dtype=torch.int32) if with_flag else None
    torch.library.opcheck(
        torch.ops.lightningrl_fast.kv_cache_write.default,
        (a["k_cache"], a["v_cache"], a["k"], a["v"], a["cache_lens"], a["chunk_lens"], flag),
    )


# ------------------------------------------------- the kernel's device code on the CPU (csrc/emu emulator)


@pytest.fixture(scope="module")
def emu(emu_build):
    lib = ctypes.CDLL(str(emu_build("kv_cache_emu.cpp", shared=True, cuda_headers=True)))
    p, i64, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
    lib.emu_kv_cache_write.argtypes = [p, p, p, p, p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, i64, u64, p, p]
    lib.emu_kv_cache_write.restype = ctypes.c_int
    return lib


def emu_write(lib, k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag=None, max_blocks=0, order=0):
    """The emulated kernel in place; returns (copy unit in bytes, threads, blocks)."""
    strides = [torch.tensor(t.stride()[:3], dtype=torch.int64) for t in (k_cache, v_cache, k, v)]
    threads, blocks = ctypes.c_int(), ctypes.c_int()
    B, L, H, D = k_cache.shape
    unit = lib.emu_kv_cache_write(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
                                  *(s.data_ptr() for s in strides), k_cache.element_size(), cache_lens.data_ptr(),
                                  chunk_lens.data_ptr(), None if error_flag is None else error_flag.data_ptr(), B,
                                  k.shape[1], L, H, D, max_blocks, order, ctypes.byref(threads), ctypes.byref(blocks))
    return unit, threads.value, blocks.value


def shifted(shape, dtype, shift):
    """A dense tensor of `shape` whose data pointer is `shift` elements past a 16-byte boundary (poisoned)."""
    n = int(torch.tensor(shape).prod())
    return poisoned((n + 8,), dtype)[shift : shift + n].view(shape)


# (dtype, D, element shift of the caches): the copy unit the launcher picks is 16 / 8 / 4 / 2 bytes
EMU_CASES = [
    (torch.bfloat16, 128, 0, 16), (torch.float32, 3, 0, 4), (torch.float16, 4, 0, 8), (torch.float16, 2, 0, 4),
    (torch.bfloat16, 3, 0, 2), (torch.float16, 64, 1, 2), (torch.float64, 5, 0, 8), (torch.float32, 36, 2, 8),
]


@pytest.mark.parametrize("dtype,D,shift,unit", EMU_CASES)
def test_emulated_kernel_matches_reference_bit_exact(emu, dtype, D, shift, unit):
    """Mixed rows (empty cache + full chunk, cache filled to the end, empty chunk, random), caches poisoned and
    offset from a 16-byte boundary where asked: exactly the reference's writes, nothing else touched."""
    B, L, C, H = 5, 23, 4, 3
    k, v, cl, nl = make_case(B, L, C, H, D, dtype, seed=D)
    kc, vc = shifted((B, L, H, D), dtype, shift), shifted((B, L, H, D), dtype, shift)
    want_k, want_v = kc.clone(), vc.clone()
    kv_cache_write_reference(want_k, want_v, k, v, cl, nl)
    flag = torch.zeros(1, dtype=torch.int32)
    got_unit, threads, blocks = emu_write(emu, kc, vc, k, v, cl, nl, flag, order=EMU_GREEDY | D if D % 2 else D)
    assert got_unit == unit
    assert threads % 32 == 0 and threads >= min(256, H * D * k.element_size() // unit) and blocks == B * C
    assert_bits_equal(kc, want_k)
    assert_bits_equal(vc, want_v)
    assert int(flag) == 0


def test_emulated_strided_views_grid_stride_and_bad_rows(emu):
    """k / v as views of a fused projection and the caches as a window of a larger buffer (strided, aligned);
    a grid capped at 3 blocks strides over all B x C pairs; rows out of range write nothing and set the flag."""
    B, L, C, H, D, dtype = 6, 40, 5, 2, 16, torch.bfloat16
    g = torch.Generator().manual_seed(11)
    fused = torch.randn(B, C, 3 * H * D, generator=g).to(dtype)
    k = fused[..., H * D : 2 * H * D].unflatten(-1, (H, D))
    v = fused[..., 2 * H * D :].unflatten(-1, (H, D))
    big_k, big_v = poisoned((B, L + 8, H + 1, D), dtype), poisoned((B, L + 12, H, D), dtype)
    kc, vc = big_k[:, 4 : 4 + L, 1:], big_v[:, 2 : 2 + L]  # different row / batch strides for k and v
    cl = torch.tensor([0, 35, 38, -1, 10, 20], dtype=torch.int32)
    nl = torch.tensor([5, 5, 3, 2, 6, 0], dtype=torch.int32)  # row 2: 38 + 3 > 40; row 3: -1; row 4: 6 > C
    keep_k, keep_v = big_k.clone(), big_v.clone()
    want_k, want_v = kc.clone(), vc.clone()
    ok = torch.tensor([True, True, False, False, False, True])
    kv_cache_write_reference(want_k, want_v, k, v, torch.where(ok, cl, 0), torch.where(ok, nl, 0))
    flag = torch.zeros(1, dtype=torch.int32)
    unit, _, blocks = emu_write(emu, kc, vc, k, v, cl, nl, flag, max_blocks=3, order=5)
    assert unit == 16 and blocks == 3
    assert_bits_equal(kc, want_k)
    assert_bits_equal(vc, want_v)
    assert int(flag) == 1
    rest_k = torch.ones_like(big_k, dtype=torch.bool)
    rest_k[:, 4 : 4 + L, 1:] = False
    assert_bits_equal(big_k[rest_k], keep_k[rest_k])  # nothing outside the cache window
    rest_v = torch.ones_like(big_v, dtype=torch.bool)
    rest_v[:, 2 : 2 + L] = False
    assert_bits_equal(big_v[rest_v], keep_v[rest_v])


def test_emulated_empty_chunk_still_checks_lengths(emu):
    """C == 0: one block per row checks the lengths (a bad row sets the flag), nothing is written."""
    B, L, H, D, dtype = 3, 8, 2, 8, torch.float16
    k = torch.empty(B, 0, H, D, dtype=dtype)
    kc, vc = poisoned((B, L, H, D), dtype), poisoned((B, L, H, D), dtype)
    keep = kc.clone()
    for cache_lens, want_flag in (([0, 8, 3], 0), ([0, 9, 3], 1)):
        flag = torch.zeros(1, dtype=torch.int32)
        _, _, blocks = emu_write(emu, kc, vc, k, k, torch.tensor(cache_lens, dtype=torch.int32),
                                 torch.zeros(B, dtype=torch.int32), flag)
        assert blocks == B and int(flag) == want_flag
        assert_bits_equal(kc, keep)


_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _fuzz_layout(rng, shape, n_tensors, expandable=False, align=1):
    """Memory layouts for `n_tensors` tensors of `shape` [B, rows, H, D] in one flat buffer: the outer dims (and,
    for two tensors, a 'which tensor' dim: a fused k/v cache or projection) in a random memory order, each padded,
    the last dim dense, the data `shift` elements past the buffer's start. Returns (buffer elements, [(offset,
    strides)] per tensor). `expandable`: a read-only tensor's batch or head dim may have stride 0. `align` > 1:
    the shift and the head stride a multiple of `align` elements (16-byte units where D allows)."""
    outer = [0, 1, 2] + (["pair"] if n_tensors == 2 else [])
    rng.shuffle(outer)
    D = shape[3]
    extent = {d: shape[d] + (rng.choice([0, 0, 1, 3]) if rng.random() < 0.4 else 0) for d in (0, 1, 2)}
    extent["pair"] = 2 + rng.choice([0, 0, 1])
    cur = max(D + (rng.choice([1, 2, 8]) * align if rng.random() < 0.3 else 0), 1)
    strides = {}
    for d in reversed(outer):
        strides[d] = cur
        cur *= max(extent[d], 1)
    if expandable and rng.random() < 0.15:
        strides[rng.choice([0, 2])] = 0
    shift = rng.choice([0, 0, 1, 2, 3, 4, 5, 7, 8]) * align
    which = rng.sample(range(extent["pair"]), 2) if n_tensors == 2 else [0]
    out = [(shift + which[i] * strides.get("pair", 0), (strides[0], strides[1], strides[2], 1))
           for i in range(n_tensors)]
    return shift + cur + 1, out


def _fuzz_lengths(rng, B, C, L, p_bad):
    """Per row (cache_len, chunk_len): in range (random, an empty chunk, a chunk ending at capacity) or, with
    probability p_bad, out of range (negative start or length, length past C, end past L, int32 extremes)."""
    cl, nl, bad = [], [], []
    for _ in range(B):
        if rng.random() < p_bad:
            kind = rng.randrange(6)
            n = rng.randint(0, C)
            if kind == 0:
                s = rng.choice([-1, -rng.randint(1, 50), _I32_MIN])
            elif kind == 1:
                s, n = rng.randint(0, max(L, 0)), rng.choice([-1, -rng.randint(1, 50), _I32_MIN])
            elif kind == 2:
                s, n = rng.randint(0, 3), rng.choice([C + 1, C + rng.randint(1, 50), _I32_MAX])
            elif kind == 3:
                s = max(L - n, 0) + rng.randint(1, 5)  # end past capacity (n = 0: the start itself)
            elif kind == 4:
                s = rng.choice([_I32_MAX, _I32_MAX - rng.randint(0, 3)])  # the int32 sum would wrap
                n = max(n, 1)
            else:
                s = L + rng.randint(1, 3)
                n = 0
            cl.append(s)
            nl.append(n)
            bad.append(True)
            continue
        n = rng.choice([rng.randint(0, min(C, L)), 0, min(C, L)])
        s = rng.choice([rng.randint(0, L - n), 0, L - n])
        cl.append(s)
        nl.append(n)
        bad.append(False)
    return cl, nl, bad


def _copy_unit(ptrs_strides, head_bytes):
    """The launcher's copy unit, recomputed: the largest power of two <= 16 dividing the head's bytes, every
    pointer and every byte stride."""
    bits = head_bytes
    for ptr, strides in ptrs_strides:
        for x in (ptr, *strides):
            bits |= x
    unit = 16
    while unit > 1 and bits % unit:
        unit //= 2
    return unit


GPU_FUZZ_ELEMS = 1 << 25  # on a GPU: elements of each cache (B x L x H x D) at most


def _draw_kv_cache_write(rng, gpu=False) -> dict:
    """One random configuration of the KV-cache write (see test_emulated_kv_cache_write_random_config). gpu=True
    (test_gpu_random_config): larger shapes besides (B to 32, H to 8, head dims 64 / 128 more often, C to 64 or a
    1025-token prefill, L to 8192; redrawn until a cache has at most GPU_FUZZ_ELEMS elements); the grid cap and
    schedule seed are still drawn (emulator-only). gpu=False draws as before the parameter existed."""
    while True:
        dtype = rng.choice([torch.float64, torch.float32, torch.float16, torch.bfloat16])
        es = torch.empty(0, dtype=dtype).element_size()
        D = rng.choice([0] * 1 + [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129,
                                  160] + [rng.randint(1, 160)] * 4 + ([64, 128] * 6 if gpu else []))
        align = 16 // es if rng.random() < 0.4 else 1  # 16-byte aligned pointers and strides (the uint4 copy)
        if align > 1 and D % align:
            D = max(align, D // align * align)
        H = rng.choice([0, 1, 1, 2, 3, 4, 5]) if rng.random() < 0.1 else rng.randint(1, 8 if gpu else 4)
        B = rng.choice([0, 1, 2, 3, 5, 6]) if rng.random() < 0.2 else rng.randint(1, 32 if gpu else 4)
        C = rng.choice([0, 1, 2, 3, 4, 8, 9] + ([16, 31, 32, 64, 1025] if gpu else []))
        top = 8192 if gpu else 40
        L = rng.choice([C, C + 1, rng.randint(0, top), rng.randint(C, top), max(C - 1, 0)])
        if not gpu or B * max(L, C) * H * D <= GPU_FUZZ_ELEMS:
            break
    fused_cache, fused_kv, k_is_v = rng.random() < 0.3, rng.random() < 0.3, rng.random() < 0.08
    p_bad = rng.choice([0.0, 0.0, 0.2, 0.5])
    cl, nl, bad = _fuzz_lengths(rng, B, C, L, p_bad)
    flag_kind = rng.choice(["none", "clean", "clean", "dirty", "strided"])
    pairs = B * max(C, 1)
    max_blocks = rng.choice([0, 0, rng.randint(1, max(pairs, 1))])
    order = rng.choice([0, rng.getrandbits(62) + 1, EMU_GREEDY | rng.getrandbits(62)])

    def layouts(shape, fused, expandable):
        if fused:
            n, lay = _fuzz_layout(rng, shape, 2, align=align)
            return [n], [(0, *lay[0]), (0, *lay[1])]
        n0, (l0,) = _fuzz_layout(rng, shape, 1, expandable, align)
        n1, (l1,) = _fuzz_layout(rng, shape, 1, expandable, align)
        return [n0, n1], [(0, *l0), (1, *l1)]

    cache_sizes, cache_lays = layouts((B, L, H, D), fused_cache, False)
    kv_sizes, kv_lays = layouts((B, C, H, D), fused_kv and not k_is_v, True)
    flag_fill = None
    if flag_kind != "none":
        flag_fill = [0] * (rng.randint(1, 3) * (2 if flag_kind == "strided" else 1))
        if flag_kind == "dirty":
            flag_fill = [rng.choice([0, 1, 7, -5]) for _ in range(len(flag_fill))]
    return dict(dtype=dtype, es=es, align=align, B=B, L=L, C=C, H=H, D=D, cl=cl, nl=nl, bad=bad,
                cache_sizes=cache_sizes, cache_lays=cache_lays, kv_sizes=kv_sizes, kv_lays=kv_lays, k_is_v=k_is_v,
                flag_kind=flag_kind, flag_fill=flag_fill, pairs=pairs, max_blocks=max_blocks, order=order)


def _check_random_kv_cache_write(case, write, device="cpu", gpu=False):
    """The configuration _draw_kv_cache_write(gpu=gpu) draws from `case`, its buffers built on `device`, written by
    `write(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag, cfg)` (in place) and compared bit-exact with
    the reference's write on copies of the whole buffers: exactly the reference's writes, nothing else touched,
    the same flag; a failure names the configuration. -> write's result"""
    c = _draw_kv_cache_write(random.Random(case), gpu)
    dtype, B, L, C, H, D = c["dtype"], c["B"], c["L"], c["C"], c["H"], c["D"]
    config = (f"dtype={dtype} align={c['align']} B={B} L={L} C={C} H={H} D={D} cache_lens={c['cl']} "
              f"chunk_lens={c['nl']} bad={c['bad']} cache layouts={c['cache_lays']} (buffers {c['cache_sizes']}) "
              f"kv layouts={c['kv_lays']} (buffers {c['kv_sizes']}) k_is_v={c['k_is_v']} flag={c['flag_kind']} "
              f"max_blocks={c['max_blocks']} order={c['order']:#x}")
    print(config)

    g = torch.Generator(device).manual_seed(case)
    cache_bufs = [poisoned((n,), dtype, device) for n in c["cache_sizes"]]
    kv_bufs = [(torch.randn(n, generator=g, dtype=torch.float64, device=device) * 3 + 0.5).to(dtype)
               for n in c["kv_sizes"]]

    def view(bufs, lay, shape):
        which, offset, strides = lay
        return bufs[which].as_strided(shape, strides, bufs[which].storage_offset() + offset)

    kc, vc = (view(cache_bufs, lay, (B, L, H, D)) for lay in c["cache_lays"])
    k, v = (view(kv_bufs, lay, (B, C, H, D)) for lay in c["kv_lays"])
    if c["k_is_v"]:
        v = k
    cache_lens, chunk_lens = (torch.tensor(x, dtype=torch.int32, device=device) for x in (c["cl"], c["nl"]))
    flag_buf = flag = None
    if c["flag_kind"] != "none":
        flag_buf = torch.tensor(c["flag_fill"], dtype=torch.int32, device=device)
        flag = flag_buf[::2] if c["flag_kind"] == "strided" else flag_buf

    want_bufs = [b.clone() for b in cache_bufs]
    want_kc, want_vc = (view(want_bufs, lay, (B, L, H, D)) for lay in c["cache_lays"])
    want_flag_buf = None if flag_buf is None else flag_buf.clone()
    want_flag = None if flag_buf is None else (want_flag_buf[::2] if c["flag_kind"] == "strided" else want_flag_buf)
    kv_cache_write_reference(want_kc, want_vc, k, v, cache_lens, chunk_lens, want_flag)

    try:
        result = write(kc, vc, k, v, cache_lens, chunk_lens, flag, c)
        for got_buf, want_buf in zip(cache_bufs, want_bufs):
            assert_bits_equal(got_buf, want_buf)
        if flag_buf is not None:
            assert torch.equal(flag_buf, want_flag_buf), (flag_buf, want_flag_buf)
    except Exception as e:
        raise AssertionError(f"kv_cache_write fuzz case {case}: {config}: {type(e).__name__}: {e}") from e
    return result


@pytest.mark.parametrize("case", fuzz_cases(100))
def test_emulated_kv_cache_write_random_config(emu, case):
    """One random configuration per case: dtype (fp64 / fp32 / fp16 / bf16), head dim D (1 .. 160, the 16-byte
    unit boundaries, rarely 0) and heads H (0 .. 5), batch B (0 .. 6), chunk C (0 .. 9) and capacity L (0 .. 40,
    also L < C), caches and k / v as strided views of padded buffers (random dim order, fused k/v caches or
    projections interleaved in one buffer, stride-0 batch/head of k / v, pointers shifted off 16 bytes: every copy
    unit 16 / 8 / 4 / 2 bytes), k is v, rows in and out of range (negative, past C, past L, int32 extremes),
    an error flag or none (dirty or clean, strided), a capped grid (grid-stride loop), the block order and thread
    interleaving seed (warp-greedy bit). Bit-exact against the reference on copies of the whole buffers: exactly
    the reference's writes, nothing else touched, the same flag; the launcher's copy unit, block size and grid."""

    def write(kc, vc, k, v, cache_lens, chunk_lens, flag, c):
        unit, threads, blocks = emu_write(emu, kc, vc, k, v, cache_lens, chunk_lens, flag, max_blocks=c["max_blocks"],
                                          order=c["order"])
        es = c["es"]
        want_unit = _copy_unit([(t.data_ptr(), [s * es for s in t.stride()[:3]]) for t in (kc, vc, k, v)], c["D"] * es)
        assert unit == want_unit
        units = c["H"] * (c["D"] * es // want_unit)
        assert threads == min(max(-(-units // 32) * 32, 32), 256)
        assert blocks == (min(c["pairs"], c["max_blocks"]) if c["max_blocks"] else c["pairs"])

    _check_random_kv_cache_write(case, write)


def test_launcher_checks_inputs(cuda_ext_with):
    """The C++ launcher is safe to call directly: its TORCH_CHECKs name the argument (CPU tensors: the
    device check comes last, so every other check runs here without a GPU)."""
    mod = cuda_ext_with("kv_cache_write")
    a = _good_args()
    shared = torch.zeros(2 * 10 * 2 * 4)  # one buffer: a cache [2, 10, 2, 4] and a dense k / v inside its rows
    cache_in, inside = shared.view(2, 10, 2, 4), shared[16:64].view(2, 3, 2, 4)
    cases = [
        (dict(k_cache=a["k_cache"][0]), "k_cache must have 4 dimensions"),
        (dict(v_cache=a["v_cache"][:, :5]), r"v_cache must have shape \[B, L, H, D\] = \[2, 10, 2, 4\], got \[2, 5, 2, 4\]"),
        (dict(k=a["k"][:1]), r"k must have shape \[B, C, H, D\]"),
        (dict(chunk_lens=a["chunk_lens"][:1]), r"chunk_lens must have shape \[B\] = \[2\]"),
        (dict(k_cache=a["k_cache"].to(torch.int32)), "k_cache must have dtype in"),
        (dict(k=a["k"].half()), "k_cache and k must have the same dtype"),
        (dict(cache_lens=a["cache_lens"].long()), "cache_lens must have dtype Int"),
        (dict(chunk_lens=a["chunk_lens"].to("meta")), "k_cache is on cpu but chunk_lens is on meta"),
        # strided (non-contiguous over B, L) caches pass every check but the device one
        (dict(v_cache=a["v_cache"].transpose(0, 1).contiguous().transpose(0, 1)), "k_cache must be a CUDA tensor"),
        (dict(k=torch.zeros(2, 3, 4, 2).transpose(2, 3)), "k must have a contiguous last dimension"),
        (dict(error_flag=torch.zeros(1)), "error_flag must have dtype Int"),
        (dict(error_flag=torch.zeros(0, dtype=torch.int32)), "error_flag must have at least one element"),
        # caches written in place: no element shared within one, nor between the two
        (dict(k_cache=torch.zeros(1, 10, 2, 4).expand(2, 10, 2, 4)), "k_cache is written in place and must not"),
        (dict(v_cache=torch.zeros(2, 10, 1, 4).expand(2, 10, 2, 4)), "v_cache is written in place and must not"),
        (dict(v_cache=a["k_cache"]), "k_cache and v_cache are both written in place"),
        # ... nor with what the launch reads (other blocks read k / v / the lengths while one writes its rows)
        (dict(k_cache=cache_in, k=inside), "k_cache is written in place and must not share memory with k "),
        (dict(v_cache=cache_in, v=inside), "v_cache is written in place and must not share memory with v "),
        (dict(k_cache=cache_in, cache_lens=shared[:2].view(torch.int32)),
         "k_cache is written in place and must not share memory with cache_lens"),
        (dict(error_flag=a["k_cache"].view(torch.int32)), "k_cache and error_flag are both written in place"),
        (dict(error_flag=a["chunk_lens"]), "error_flag is written in place and must not share memory with chunk_lens"),
        ({}, "k_cache must be a CUDA tensor, got device cpu"),
    ]
    for change, match in cases:
        with pytest.raises(RuntimeError, match=match):
            mod.kv_cache_write(**(a | change))


# ---------------------------------------------------------------------------------------------- GPU


@pytest.fixture
def cuda_kernels(cuda_ext_with):
    """The CUDA kernel must be what runs, else a GPU test would compare the reference with itself."""
    cuda_ext_with("kv_cache_write")


GPU_FUZZ_CASES = 64  # estimated (not yet timed) at a few ms each on an H100


@pytest.mark.gpu
@pytest.mark.parametrize("case", fuzz_cases(GPU_FUZZ_CASES))
def test_gpu_random_config(cuda_kernels, case):
    """The CUDA kernel through the public op (its host check off: out-of-range rows reach the kernel) on a random
    configuration of the emulator's space (test_emulated_kv_cache_write_random_config) with larger shapes (B to 32,
    H to 8, C to 64 or 1025, L to 8192): dtypes, head dims at the copy-unit boundaries, strided / fused / expanded
    / shifted layouts, k is v, rows out of range, the error flag; checked bit-exact against the reference as
    there. The grid cap and schedule seed are emulator-only (not used here: the launcher sizes its grid, the
    hardware schedules)."""

    def write(kc, vc, k, v, cache_lens, chunk_lens, flag, c):
        kv_cache_write(kc, vc, k, v, cache_lens, chunk_lens, error_flag=flag, check_lengths=False)

    _check_random_kv_cache_write(case, write, "cuda", gpu=True)


def _check_cuda_vs_reference(B, L, C, H, D, dtype, k_fn=lambda t: t, cache_fn=None):
    k, v, cache_lens, chunk_lens = make_case(B, L, C, H, D, dtype)
    make_cache = cache_fn or (lambda: poisoned((B, L, H, D), dtype))
    k_cache, v_cache = make_cache(), make_cache()
    k_gpu, v_gpu = k_fn(k.cuda()), k_fn(v.cuda())
    kc_gpu, vc_gpu = k_cache.cuda(), v_cache.cuda()
    kv_cache_write_reference(k_cache, v_cache, k, v, cache_lens, chunk_lens)
    kv_cache_write(kc_gpu, vc_gpu, k_gpu, v_gpu, cache_lens.cuda(), chunk_lens.cuda())
    assert_bits_equal(kc_gpu.cpu(), k_cache)
    assert_bits_equal(vc_gpu.cpu(), v_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 128, 40, 33])  # 33: no 16-byte unit -> narrower copies
@pytest.mark.parametrize("C", [1, 4, 9])
def test_cuda_matches_reference_bit_exact(cuda_kernels, dtype, D, C):
    _check_cuda_vs_reference(B=3, L=123, C=C, H=2, D=D, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_misaligned_and_strided(cuda_kernels, dtype):
    B, L, C, H, D = 3, 97, 5, 3, 64

    def misaligned(t):  # same values, base pointer one element past a 16-byte boundary
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        return out

    _check_cuda_vs_reference(B, L, C, H, D, dtype, k_fn=misaligned)

    def head_slice(t):  # stride over a wider head dimension
        wide = torch.zeros(t.shape[0], t.shape[1], 2 * t.shape[2], t.shape[3], dtype=t.dtype, device=t.device)
        wide[:, :, 1::2] = t
        return wide[:, :, 1::2]

    _check_cuda_vs_reference(B, L, C, H, D, dtype, k_fn=head_slice)


@pytest.mark.gpu
def test_cuda_out_of_range_row_skipped_and_flagged(cuda_kernels):
    B, L, C, H, D = 3, 16, 4, 2, 64
    k, v = torch.randn(B, C, H, D, device="cuda"), torch.randn(B, C, H, D, device="cuda")
    k_cache, v_cache = poisoned((B, L, H, D), torch.float32, "cuda"), poisoned((B, L, H, D), torch.float32, "cuda")
    before = k_cache.clone()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    for cache_lens, chunk_lens in (([0, 14, 3], [4, 4, 2]), ([0, -1, 3], [4, 1, 2]), ([0, 1, 3], [4, 5, 2])):
        cl = torch.tensor(cache_lens, dtype=torch.int32, device="cuda")
        nl = torch.tensor(chunk_lens, dtype=torch.int32, device="cuda")
        flag.zero_()
        kv_cache_write(k_cache, v_cache, k, v, cl, nl, error_flag=flag, check_lengths=False)
        assert int(flag) == 1
        assert_bits_equal(k_cache[1].cpu(), before[1].cpu())
        assert_bits_equal(k_cache[0, :4].cpu(), k[0].cpu())
        with pytest.raises(ValueError, match="row 1 does not fit"):
            kv_cache_write(k_cache, v_cache, k, v, cl, nl)


@pytest.mark.gpu
def test_cuda_empty_shapes(cuda_kernels):
    z = torch.zeros(0, dtype=torch.int32, device="cuda")
    empty = torch.zeros(0, 8, 1, 4, device="cuda")
    kv_cache_write(empty, empty.clone(), torch.zeros(0, 2, 1, 4, device="cuda"), torch.zeros(0, 2, 1, 4, device="cuda"), z, z)
    k_cache = poisoned((2, 8, 1, 4), torch.float32, "cuda")
    before = k_cache.clone()
    k = torch.zeros(2, 0, 1, 4, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    lens = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    kv_cache_write(k_cache, k_cache.clone(), k, k, lens, torch.zeros_like(lens), error_flag=flag)
    assert int(flag) == 0
    lens[1] = 9  # C == 0 still checks the lengths on the device
    kv_cache_write(k_cache, k_cache.clone(), k, k, lens, torch.zeros_like(lens), error_flag=flag, check_lengths=False)
    assert int(flag) == 1
    assert_bits_equal(k_cache.cpu(), before.cpu())


@pytest.mark.gpu
def test_cuda_many_pairs_grid_stride(cuda_kernels):
    """More (row, token) pairs than the kernel's grid cap (1 << 20)."""
    B, C, H, D = 3, 400_000, 1, 8
    L = C + 5
    _check_cuda_vs_reference(B, L, C, H, D, torch.float16,
                             cache_fn=lambda: torch.full((B, L, H, D), 7.0, dtype=torch.float16))


@pytest.mark.gpu
def test_cuda_graph_capture(cuda_kernels):
    B, L, C, H, D = 4, 64, 4, 2, 128
    dtype = torch.bfloat16
    k = torch.zeros(B, C, H, D, dtype=dtype, device="cuda")
    v = torch.zeros_like(k)
    cache_lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    chunk_lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    k_cache, v_cache = poisoned((B, L, H, D), dtype, "cuda"), poisoned((B, L, H, D), dtype, "cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        kv_cache_write(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag=flag)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv_cache_write(k_cache, v_cache, k, v, cache_lens, chunk_lens, error_flag=flag)

    ref_k, ref_v = k_cache.cpu(), v_cache.cpu()
    for step in range(3):  # replay with new lengths and values written into the captured inputs
        k.copy_(torch.randn(B, C, H, D))
        v.copy_(torch.randn(B, C, H, D))
        cl = torch.tensor([4 * step, 4 * step + 1, 0, L - C], dtype=torch.int32)
        nl = torch.tensor([4, 3, step, 4], dtype=torch.int32)
        cache_lens.copy_(cl)
        chunk_lens.copy_(nl)
        graph.replay()
        kv_cache_write_reference(ref_k, ref_v, k.cpu(), v.cpu(), cl, nl)
        torch.cuda.synchronize()
        assert_bits_equal(k_cache.cpu(), ref_k)
        assert_bits_equal(v_cache.cpu(), ref_v)
    assert int(flag) == 0
    cache_lens.fill_(L)  # over capacity on replay: nothing written, flag raised
    graph.replay()
    assert int(flag) == 1
    assert_bits_equal(k_cache.cpu(), ref_k)
