"""RMSNorm and fused q/k-norm + RoPE: the references against the model's eager modules, the kernels' device code
on the CPU emulator against float64 and the same-dtype PyTorch computation, the public ops' checks and
dispatch, and on a GPU (skipped without) the CUDA kernels themselves."""

import ctypes
import random

import pytest
import torch
from conftest import EMU_GREEDY, fuzz_cases, poisoned_cuda_outputs, same_layout_on

from lightningrl_fast.model import RMSNorm, apply_rope, rope_cos_sin
from lightningrl_fast.ops.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    qk_norm_rope,
    qk_norm_rope_reference,
    rms_norm,
    rms_norm_reference,
    rope_reference,
)

_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
EPS = 1e-6


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + 0.1).to(dtype)


def rope_inputs(b, n, h, d, dtype, seed=0):
    x = rand(b, n, h, d, dtype=dtype, seed=seed, scale=3.0)
    w = rand(d, dtype=dtype, seed=seed + 1) * 0.5 + 1.0
    pos = torch.randint(0, 4000, (b, n), generator=torch.Generator().manual_seed(seed + 2))
    cos, sin = rope_cos_sin(pos, d, 1e6, dtype)
    return x, w.to(dtype), cos, sin


def rms_norm_f64(x, w, eps):
    """The RMSNorm formula all in float64: the oracle of the error bounds. (rms_norm_reference(x.double(), ...) is
    not one: it takes the norm in float32 as the model's RMSNorm does, so against it the float32 PyTorch result
    seemed exact and the kernel's fp32 scale was held to within ~2 ulp of torch's own rounding of the sum.)"""
    x = x.double()
    return w.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def qk_norm_rope_f64(x, w, cos, sin, eps, w2=None, split=0):
    """qk_norm_rope_reference all in float64 (rms_norm_f64 per head, heads >= split with w2, then RoPE)."""
    if w2 is None:
        w2, split = w, x.shape[2]
    normed = torch.cat([rms_norm_f64(x[:, :, :split], w, eps), rms_norm_f64(x[:, :, split:], w2, eps)], dim=2)
    return rope_reference(normed, cos.double(), sin.double())


def assert_as_good_as_torch(got, x_dtype_result, ref64, what):
    """Every element within 2x the worst error of the same-dtype PyTorch computation against float64, plus two
    units in the last place of the dtype: the fp32 sum of squares is accumulated in another order, which moves
    the scale 1/rms by an ulp (a whole row then shifts by an ulp in fp32, or flips a rounding in bf16/fp16)."""
    assert not got.isnan().any(), f"{what}: NaN (an element not written?)"
    err_t = (x_dtype_result.double() - ref64).abs()
    err_k = (got.double() - ref64).abs()
    ulp = 2 * torch.finfo(got.dtype).eps * ref64.abs().clamp_min(1e-3)
    assert (err_k <= 2 * err_t.max() + ulp).all(), f"{what}: max error {err_k.max():.3e} vs torch {err_t.max():.3e}"


# --------------------------------------------------------------------------------- references vs the model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_references_are_the_models_eager_code(dtype):
    x = rand(3, 5, 64, dtype=dtype, scale=2.0)
    norm = RMSNorm(64, EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(64, dtype=dtype, seed=3))
    assert torch.equal(rms_norm_reference(x, norm.weight, EPS), norm(x))
    q, w, cos, sin = rope_inputs(2, 3, 4, 64, dtype)
    qn = RMSNorm(64, EPS).to(dtype)
    with torch.no_grad():
        qn.weight.copy_(w)
    assert torch.equal(qk_norm_rope_reference(q, w, cos, sin, EPS), apply_rope(qn(q), cos, sin))


def test_public_ops_on_cpu_run_the_reference_and_check_inputs():
    x = rand(4, 6, 32, dtype=torch.bfloat16)
    w = rand(32, dtype=torch.bfloat16, seed=1)
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_reference(x, w, EPS))
    q, wq, cos, sin = rope_inputs(2, 3, 4, 64, torch.float32)
    assert torch.equal(qk_norm_rope(q, wq, cos, sin, EPS), qk_norm_rope_reference(q, wq, cos, sin, EPS))
    with pytest.raises(ValueError, match=r"weight must have shape \[32\], got \[31\]"):
        rms_norm(x, w[:31], EPS)
    with pytest.raises(TypeError, match="x must have dtype in"):
        rms_norm(x.int(), w, EPS)
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="x must have 4 dimensions"):
        qk_norm_rope(q[0], wq, cos, sin, EPS)
    with pytest.raises(ValueError, match=r"cos must have shape \[2, 3, 64\]"):
        qk_norm_rope(q, wq, cos[:, :2], sin, EPS)
    with pytest.raises(TypeError, match="sin must have dtype in"):
        qk_norm_rope(q, wq, cos, sin.double(), EPS)
    with pytest.raises(ValueError, match="head_dim must be even"):
        qk_norm_rope(q[..., :63], wq[:63], cos[..., :63], sin[..., :63], EPS)
    r = rand(4, 6, 32, dtype=torch.bfloat16, seed=5)
    y, s = add_rms_norm(x, r, w, EPS)
    assert torch.equal(s, x + r) and torch.equal(y, rms_norm_reference(x + r, w, EPS))
    with pytest.raises(ValueError, match=r"residual must have shape \[4, 6, 32\], got \[4, 6, 31\]"):
        add_rms_norm(x, r[..., :31], w, EPS)
    with pytest.raises(TypeError, match="residual must have dtype in"):
        add_rms_norm(x, r.float(), w, EPS)
    q6, _, cos6, sin6 = rope_inputs(2, 3, 6, 64, torch.float32)
    wk = wq * 0.5
    both = qk_norm_rope(q6, wq, cos6, sin6, EPS, wk, 4)
    assert torch.equal(both[:, :, :4], qk_norm_rope(q6[:, :, :4], wq, cos6, sin6, EPS))
    assert torch.equal(both[:, :, 4:], qk_norm_rope(q6[:, :, 4:], wk, cos6, sin6, EPS))
    with pytest.raises(ValueError, match=r"split must be in \[0, heads = 6\], got 7"):
        qk_norm_rope(q6, wq, cos6, sin6, EPS, wk, 7)
    with pytest.raises(ValueError, match=r"weight2 must have shape \[64\]"):
        qk_norm_rope(q6, wq, cos6, sin6, EPS, wk[:32], 4)
    torch.library.opcheck(torch.ops.lightningrl_fast.rms_norm.default, (x, w, EPS))
    torch.library.opcheck(torch.ops.lightningrl_fast.add_rms_norm.default, (x, r, w, EPS))
    torch.library.opcheck(torch.ops.lightningrl_fast.qk_norm_rope.default, (q, wq, cos, sin, EPS, None, 0))
    torch.library.opcheck(torch.ops.lightningrl_fast.qk_norm_rope.default, (q6, wq, cos6, sin6, EPS, wk, 4))


def test_references_honour_eps_against_float64():
    """A non-default eps reaches the norm (the other checks use EPS = 1e-6), against the float64 formula
    x / sqrt(mean(x^2) + eps) * w (to float32 precision: the references take the norm in float32, as the model's
    RMSNorm); eps = 0 is allowed (a plain RMS), +-inf / NaN / negative are not."""
    x = rand(3, 16, dtype=torch.float64, scale=0.3)
    w = rand(16, dtype=torch.float64, seed=1)
    r = rand(3, 16, dtype=torch.float64, seed=2)
    for eps in (0.5, 0.0):
        want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
        torch.testing.assert_close(rms_norm(x, w, eps), want, rtol=1e-6, atol=1e-7)
        y, s = add_rms_norm(x, r, w, eps)
        torch.testing.assert_close(y, (x + r) / torch.sqrt(((x + r) ** 2).mean(-1, keepdim=True) + eps) * w,
                                   rtol=1e-6, atol=1e-7)
    q = rand(1, 2, 3, 16, dtype=torch.float64)
    one, zero = torch.ones(1, 2, 16, dtype=torch.float64), torch.zeros(1, 2, 16, dtype=torch.float64)
    torch.testing.assert_close(qk_norm_rope(q, w, one, zero, 0.5),  # cos 1, sin 0: RoPE is the identity
                               q / torch.sqrt((q * q).mean(-1, keepdim=True) + 0.5) * w, rtol=1e-6, atol=1e-7)
    for bad in (float("inf"), float("nan"), -1e-9):
        with pytest.raises(ValueError, match="eps must be finite and >= 0"):
            rms_norm(x, w, bad)
    with pytest.raises(TypeError, match="eps must be a number, got bool"):
        rms_norm(x, w, True)


def test_public_ops_refuse_scalars_mixed_devices_and_dtypes():
    """0-d inputs (were an IndexError without the rank checks), tensors on another device, a q/k-norm weight of
    another dtype (the output would not be x's dtype, which the op's fake declares)."""
    x, w = rand(4, 8), rand(8, seed=1)
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        rms_norm(torch.tensor(1.0), w[:1], EPS)
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        add_rms_norm(torch.tensor(1.0), torch.tensor(1.0), w[:1], EPS)
    with pytest.raises(ValueError, match="weight is on meta but the other inputs are on cpu"):
        rms_norm(x, w.to("meta"), EPS)
    with pytest.raises(ValueError, match="residual is on meta but the other inputs are on cpu"):
        add_rms_norm(x, x.to("meta"), w, EPS)
    q, wq, cos, sin = rope_inputs(2, 3, 4, 64, torch.float32)
    with pytest.raises(TypeError, match=r"weight must have dtype in \(float32\), got float64"):
        qk_norm_rope(q, wq.double(), cos, sin, EPS)
    # split = heads: every head takes `weight`; without weight2 the split is ignored
    assert torch.equal(qk_norm_rope(q, wq, cos, sin, EPS, wq * 0.5, 4), qk_norm_rope(q, wq, cos, sin, EPS))
    assert torch.equal(qk_norm_rope(q, wq, cos, sin, EPS, None, 99), qk_norm_rope(q, wq, cos, sin, EPS))


def test_opcheck_mixed_dtypes_and_permuted_layouts():
    """The fakes declare what the CPU path returns: the promoted dtype of x and a weight of another float dtype,
    and a contiguous output for permuted (dense but not contiguous) inputs. Was: the reference kept the input's
    permuted strides while the fakes (and the CUDA kernels) return contiguous tensors, a stride mismatch that
    opcheck's fake-tensor test reports (torch.compile would have traced the wrong layout)."""
    ops = torch.ops.lightningrl_fast
    xb, w32 = rand(3, 8, dtype=torch.bfloat16), rand(8, seed=1)
    assert rms_norm(xb, w32, EPS).dtype == torch.float32
    torch.library.opcheck(ops.rms_norm.default, (xb, w32, EPS))
    torch.library.opcheck(ops.add_rms_norm.default, (xb, xb * 2, w32, EPS))
    xt = rand(8, 3).t()  # [3, 8] with strides (1, 3)
    torch.library.opcheck(ops.rms_norm.default, (xt, w32, EPS))
    torch.library.opcheck(ops.add_rms_norm.default, (xt, rand(8, 3, seed=4).t(), w32, EPS))
    y, s = add_rms_norm(xt, xt, w32, EPS)
    assert y.is_contiguous() and s.is_contiguous() and rms_norm(xt, w32, EPS).is_contiguous()
    torch.testing.assert_close(rms_norm(xt, w32, EPS), rms_norm_reference(xt.contiguous(), w32, EPS))
    q, wq, cos, sin = rope_inputs(2, 3, 4, 64, torch.float32)
    qp = q.transpose(1, 2).contiguous().transpose(1, 2)  # heads outermost in memory
    torch.library.opcheck(ops.qk_norm_rope.default, (qp, wq, cos, sin, EPS, None, 0))
    assert qk_norm_rope(qp, wq, cos, sin, EPS).is_contiguous()


# ------------------------------------------------------------------- the device code on the CPU emulator


class Emulated:
    def __init__(self, lib):
        p, i32, i64, f32, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_uint64
        lib.emu_rms_norm.argtypes = [i32, p, p, p, i64, i64, i32, f32, p, i64, p, u64]
        lib.emu_qk_norm_rope.argtypes = [i32, p, p, p, i32, p, p, p, i32, i32, i32, i32, i64, i64, i64, f32, u64]
        self.lib = lib

    def rms_norm(self, x2, w, order=0, eps=EPS):
        y = torch.full(x2.shape, float("nan"), dtype=x2.dtype)  # poisoned: every element must be written
        self.lib.emu_rms_norm(_DT[x2.dtype], x2.data_ptr(), w.data_ptr(), y.data_ptr(), x2.shape[0], x2.stride(0),
                              x2.shape[1], eps, None, 0, None, order)
        return y

    def add_rms_norm(self, x2, r2, w, order=0, eps=EPS):
        y = torch.full(x2.shape, float("nan"), dtype=x2.dtype)
        s = torch.full(x2.shape, float("nan"), dtype=x2.dtype)
        self.lib.emu_rms_norm(_DT[x2.dtype], x2.data_ptr(), w.data_ptr(), y.data_ptr(), x2.shape[0], x2.stride(0),
                              x2.shape[1], eps, r2.data_ptr(), r2.stride(0), s.data_ptr(), order)
        return y, s

    def qk_norm_rope(self, x, w, cos, sin, order=0, w2=None, split=0, eps=EPS):
        b, n, h, d = x.shape
        y = torch.full((b, n, h, d), float("nan"), dtype=x.dtype)
        if w2 is None:
            w2, split = w, h
        self.lib.emu_qk_norm_rope(_DT[x.dtype], x.data_ptr(), w.data_ptr(), w2.data_ptr(), split, cos.data_ptr(),
                                  sin.data_ptr(), y.data_ptr(), b, n, h, d, x.stride(0), x.stride(1), x.stride(2),
                                  eps, order)
        return y


@pytest.fixture(scope="module")
def emu(emu_build):
    return Emulated(ctypes.CDLL(str(emu_build("rms_norm_emu.cpp", shared=True, cuda_headers=True))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 4096), (97, 136), (5, 2560), (3, 8192 // 2), (123, 64)])
def test_emulated_rms_norm(emu, dtype, rows, n):
    if dtype == torch.float32 and n > 4096:
        n = 4096
    x = rand(rows, n, dtype=dtype, seed=rows, scale=4.0)
    w = rand(n, dtype=dtype, seed=rows + 1)
    got = emu.rms_norm(x, w, order=EMU_GREEDY | rows if dtype == torch.bfloat16 else rows)
    ref64 = rms_norm_f64(x, w, EPS)
    assert_as_good_as_torch(got, rms_norm_reference(x, w, EPS), ref64, f"{dtype} {rows}x{n}")
    if dtype != torch.float32:  # 16-bit results equal eager's but where a rounding boundary is crossed
        same = (got == rms_norm_reference(x, w, EPS)).float().mean().item()
        assert same >= 0.98, same


def test_emulated_rms_norm_strided_rows_and_extremes(emu):
    big = rand(7, 2 * 512, dtype=torch.bfloat16, scale=3.0)
    x = big[:, 512:]  # rows 1024 elements apart
    w = rand(512, dtype=torch.bfloat16, seed=2)
    got = emu.rms_norm(x, w)
    assert torch.equal(got, emu.rms_norm(x.contiguous(), w))
    assert_as_good_as_torch(got, rms_norm_reference(x, w, EPS), rms_norm_f64(x, w, EPS),
                            "strided")
    # huge and tiny magnitudes: the fp32 sum of squares of 512 bf16 inputs of ~1e17 does not overflow (of ~1e18 it
    # does, ~5e38 > 3.4e38, in eager's fp32 norm as in the kernel: both give 0, which the float32-norm reference this
    # compared with matched, so the check passed with the kernel's output all zeros)
    for scale in (1e17, 1e-18):
        xs = (rand(3, 512, dtype=torch.float64, seed=4) * scale).to(torch.bfloat16)
        got = emu.rms_norm(xs, w)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), rms_norm_f64(xs, w, EPS), rtol=2e-2,
                                   atol=1e-2 if scale > 1 else 1e-2)


@pytest.mark.parametrize("seed", [40, 104])
def test_emulated_rms_norm_fp32_outlier_rows_against_float64(emu, seed):
    """fp32 rows dominated by one outlier (as fuzz case 3001125 drew them): the kernel's results and torch's differ
    by up to ~4e-7 relative (two orders of an fp32 sum of squares), the kernel's 1.7e-7 / 2.1e-7 from float64 and
    torch's 2.5e-7 / 3.2e-7. Against the float32-norm rms_norm_reference(x.double(), ...) the oracle shared torch's
    rounding of the sum, so torch's error looked ~6e-8 and the kernel failed; rms_norm_f64 measures both from the
    true value."""
    x = rand(4, 512, dtype=torch.float32, seed=seed)
    x[:, seed % 512] *= 300
    w = rand(512, dtype=torch.float32, seed=seed + 1) * 0.5 + 1.0
    got = emu.rms_norm(x, w)
    assert_as_good_as_torch(got, rms_norm_reference(x, w, EPS), rms_norm_f64(x, w, EPS), f"outlier rows {seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,n,h,d", [(1, 1, 1, 128), (3, 5, 7, 128), (2, 9, 3, 64), (1, 97, 2, 64)])
def test_emulated_qk_norm_rope(emu, dtype, b, n, h, d):
    x, w, cos, sin = rope_inputs(b, n, h, d, dtype, seed=b * n + h)
    got = emu.qk_norm_rope(x, w, cos, sin, order=n)
    ref = qk_norm_rope_reference(x, w, cos, sin, EPS)
    ref64 = qk_norm_rope_f64(x, w, cos, sin, EPS)
    assert_as_good_as_torch(got, ref, ref64, f"{dtype} {b}x{n}x{h}x{d}")
    if dtype != torch.float32:
        same = (got == ref).float().mean().item()
        assert same >= 0.97, same


def test_emulated_qk_norm_rope_strided_heads(emu):
    """x is a slice of a wider [B, N, H + 2, D] tensor (the layout of a q/k view): same result as contiguous."""
    x, w, cos, sin = rope_inputs(2, 4, 5, 128, torch.bfloat16, seed=9)
    wide = torch.zeros(2, 4, 7, 128, dtype=torch.bfloat16)
    wide[:, :, 1:6] = x
    view = wide[:, :, 1:6]
    assert not view.is_contiguous()
    assert torch.equal(emu.qk_norm_rope(view, w, cos, sin), emu.qk_norm_rope(x, w, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 4096), (97, 136), (3, 2560)])
def test_emulated_add_rms_norm(emu, dtype, rows, n):
    """The residual add equals the eager one exactly (one rounding of x + r), and the norm of the sum is as good
    as the same-dtype PyTorch computation; strided residual rows (a wider buffer) give the same result."""
    x = rand(rows, n, dtype=dtype, seed=rows, scale=4.0)
    wide = rand(rows, n + 16, dtype=dtype, seed=rows + 7, scale=2.0)
    r = wide[:, 8 : 8 + n]
    w = rand(n, dtype=dtype, seed=rows + 1)
    y, s = emu.add_rms_norm(x, r, w, order=rows)
    y_ref, s_ref = add_rms_norm_reference(x, r, w, EPS)
    assert torch.equal(s, s_ref)
    ref64 = rms_norm_f64(s_ref, w, EPS)
    assert_as_good_as_torch(y, y_ref, ref64, f"{dtype} {rows}x{n}")
    y2, s2 = emu.add_rms_norm(x, r.contiguous(), w)
    assert torch.equal(y2, y) and torch.equal(s2, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split", [0, 3, 7])
def test_emulated_qk_norm_rope_two_weights(emu, dtype, split):
    """Heads h >= split take the second weight: the same as two separate launches, on a q/k view of a packed
    [B, N, Hq + 2 Hkv, D] projection output."""
    b, n, hq, hkv, d = 2, 5, 4, 3, 128
    qkv, w, cos, sin = rope_inputs(b, n, hq + 2 * hkv, d, dtype, seed=split)
    w2 = rand(d, dtype=dtype, seed=11) * 0.5 + 1.0
    h = hq + hkv
    qk = qkv[:, :, :h]
    split = min(split, h)
    got = emu.qk_norm_rope(qk, w, cos, sin, w2=w2, split=split)
    want = torch.cat([emu.qk_norm_rope(qk[:, :, :split].contiguous(), w, cos, sin),
                      emu.qk_norm_rope(qk[:, :, split:].contiguous(), w2, cos, sin)], dim=2)
    assert torch.equal(got, want)
    ref64 = qk_norm_rope_f64(qk, w, cos, sin, EPS, w2, split)
    assert_as_good_as_torch(got, qk_norm_rope_reference(qk, w, cos, sin, EPS, w2, split), ref64, f"split {split}")


def _fuzz_values(rng, g, shape, dtype, kind, scale):
    """Random inputs of `shape` (never zeros): normal around a small offset, rows with one outlier, or rows of one
    repeated value with a little noise (the normalized values land near +-1, on rounding boundaries); finite."""
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * scale + 0.1 * scale
    if kind == "outlier":
        flat = x.view(-1, shape[-1])
        flat[torch.arange(flat.shape[0]), torch.randint(0, shape[-1], (flat.shape[0],), generator=g)] *= 300
    elif kind == "flat":
        x = scale * (rng.choice([1.0, -1.0, 0.75, 3.0]) + 1e-3 * torch.randn(*shape, generator=g,
                                                                                 dtype=torch.float64))
    big = torch.finfo(dtype).max / 4  # finite, and so is a residual sum
    return x.clamp(-big, big).to(dtype)


def _fuzz_rows_view(rng, g, rows, n, dtype, kind, scale):
    """[rows, n] of random values whose rows lie `stride` >= n elements apart (a multiple of the 16-byte vector)
    in a larger buffer, 16-byte aligned (what the rms_norm launcher accepts); the padding holds values too."""
    per_vec = 16 // torch.empty(0, dtype=dtype).element_size()
    stride = n + per_vec * rng.choice([0, 0, 0, 1, 2, 7])
    start = per_vec * rng.choice([0, 0, 1, 3])
    buf = _fuzz_values(rng, g, (start + rows * stride + per_vec,), dtype, "normal", scale)
    view = buf[start : start + rows * stride].view(rows, stride)[:, :n] if rows else buf[:0].view(0, stride)[:, :n]
    view.copy_(_fuzz_values(rng, g, (rows, n), dtype, kind, scale))
    return view, stride


def _draw_rms_norm_family(case, gpu=False):
    """The random configuration of case `case` (see test_emulated_rms_norm_family_random_config) -> a dict: "what"
    (its description), "op", "eps", "kind", "order" and the CPU inputs of the op ("x", "w"; "r" and "r_is_x";
    "cos", "sin", "w2", "split"). `gpu`: sizes past the emulator's cost cap (rms_norm / add_rms_norm up to 3000
    rows, 2^21 elements; qk_norm_rope B <= 8, N <= 200, H <= 40, 2^21 elements: grids of many CTAs); the emulator's
    draws are unchanged by the parameter (the same random numbers in the same order)."""
    rng = random.Random(case)
    g = torch.Generator().manual_seed(case)
    op = rng.choice(["rms_norm", "add_rms_norm", "qk_norm_rope"])
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    eps = rng.choice([EPS, EPS, 1e-5, 0.0, 0.5])
    kind = rng.choice(["normal", "normal", "outlier", "flat"])
    scales = [1.0, 1.0, 4.0, 1e-3, 1e3] + ([1e15, 1e-15, 1e8, 1e-8] if dtype != torch.float16 else [])
    scale = rng.choice(scales)
    order = rng.choice([0, rng.getrandbits(62) + 1, EMU_GREEDY | rng.getrandbits(62)])
    c = dict(op=op, eps=eps, kind=kind, order=order)
    what = (f"case {case}: op={op} dtype={dtype} eps={eps} values={kind} scale={scale} "
            + ("(order: the emulator's)" if gpu else f"order={order:#x}"))

    if op in ("rms_norm", "add_rms_norm"):
        per_vec = 16 // torch.empty(0, dtype=dtype).element_size()
        # vectors per row, up to the kernel's 8 per thread of 128 (N <= 8192 bf16 / fp16, 4096 fp32)
        nvec = rng.choice([1, 2, 3, 31, 32, 33, 127, 128, 129, 255, 256, 257, 383, 384, 385, 511, 512, 513, 767,
                           1023, 1024, rng.randint(1, 1024), rng.randint(1, 300)])
        n = nvec * per_vec
        rows = rng.choice([0, 1, 1, 2, 3, rng.randint(1, 9)]) if n <= 2048 else rng.choice([1, 2, 3])
        if gpu and rng.random() < 0.4:
            rows = min(rng.choice([rng.randint(10, 300), rng.randint(300, 3000)]), (1 << 21) // n)
        c["x"], xs = _fuzz_rows_view(rng, g, rows, n, dtype, kind, scale)
        w = _fuzz_values(rng, g, (n,), dtype, "normal", 1.0) * 0.5 + 1.0
        c["w"] = w.to(dtype)
        what += f" rows={rows} n={n} x_stride={xs}"
        if op == "add_rms_norm":
            c["r_is_x"] = rng.random() < 0.1
            c["r"], rs = (c["x"], xs) if c["r_is_x"] else _fuzz_rows_view(rng, g, rows, n, dtype, kind, scale)
            what += f" r_stride={rs} residual_is_x={c['r_is_x']}"
    else:
        D = rng.choice([64, 128])
        B, N, H = rng.randint(1, 3), rng.choice([1, 2, 3, 5, rng.randint(1, 9)]), rng.choice([1, 2, 3, 4, 7, 8])
        if gpu and rng.random() < 0.5:
            B, N, H = rng.randint(1, 8), rng.choice([rng.randint(1, 32), rng.randint(32, 200)]), rng.choice(
                [rng.randint(1, 16), 16, 32, 40])
            N = max(1, min(N, (1 << 21) // (B * H * D)))
        # x: a view of a padded [B, N, H, D] buffer, outer dims in a random memory order, at any element offset
        outer = [0, 1, 2]
        rng.shuffle(outer)
        extent = {0: B + rng.choice([0, 0, 1]), 1: N + rng.choice([0, 0, 2]), 2: H + rng.choice([0, 0, 1, 3])}
        strides, cur = {}, D + rng.choice([0, 0, 0, 1, 8])
        for d in reversed(outer):
            strides[d] = cur
            cur *= extent[d]
        offset = rng.choice([0, 0, 1, 3, 8])
        buf = _fuzz_values(rng, g, (offset + cur,), dtype, "normal", scale)
        buf.as_strided((B, N, H, D), (strides[0], strides[1], strides[2], 1), offset).copy_(
            _fuzz_values(rng, g, (B, N, H, D), dtype, kind, scale))
        if rng.random() < 0.1:  # read-only, so an expanded (stride-0) batch or token dim is allowed
            strides[rng.choice([0, 1])] = 0
        c["x"] = x = buf.as_strided((B, N, H, D), (strides[0], strides[1], strides[2], 1), offset)
        c["w"] = (_fuzz_values(rng, g, (D,), dtype, "normal", 1.0) * 0.5 + 1.0).to(dtype)
        two = rng.random() < 0.5
        c["w2"] = (_fuzz_values(rng, g, (D,), dtype, "normal", 1.0) * 0.3 + 0.5).to(dtype) if two else None
        c["split"] = split = rng.choice([0, H, rng.randint(0, H)]) if two else 0
        max_pos = rng.choice([8, 4096, 40960, 1_000_000])
        theta = rng.choice([1e4, 1e6])
        pos = torch.randint(0, max_pos, (B, N), generator=g)
        c["cos"], c["sin"] = rope_cos_sin(pos, D, theta, dtype)
        what += (f" B={B} N={N} H={H} D={D} x strides={x.stride()} offset={offset} two_weights={two} split={split} "
                 f"max_pos={max_pos} theta={theta}")
    c["what"] = what
    return c


def _check_rms_norm_family_random_config(case, kernels, device, gpu=False):
    """Draws case `case` (_draw_rms_norm_family), runs the op on its inputs moved to `device` with their layouts
    (same_layout_on; a residual that is x stays x) through `kernels` (an object with Emulated's rms_norm /
    add_rms_norm / qk_norm_rope methods) and checks the results: within 2x the same-dtype PyTorch error (eager on
    `device`) against float64 (+2 ulp), the residual sum exactly eager's, and for 16-bit results with >= 2048
    elements the share equal to eager's."""
    c = _draw_rms_norm_family(case, gpu)
    what, op, eps, order = c["what"], c["op"], c["eps"], c["order"]
    print(what)
    dev = {k: None if v is None else same_layout_on(v, device)
           for k, v in c.items() if k in ("x", "w", "r", "cos", "sin", "w2")}
    if c.get("r_is_x"):
        dev["r"] = dev["x"]
    x, w = c["x"], c["w"]
    if op == "rms_norm":
        got = kernels.rms_norm(dev["x"], dev["w"], order=order, eps=eps).cpu()
        normed = x
        same_dtype = rms_norm_reference(dev["x"], dev["w"], eps).cpu()
        ref64 = rms_norm_f64(x, w, eps)
    elif op == "add_rms_norm":
        got, s = (t.cpu() for t in kernels.add_rms_norm(dev["x"], dev["r"], dev["w"], order=order, eps=eps))
        same_dtype, s_ref = (t.cpu() for t in add_rms_norm_reference(dev["x"], dev["r"], dev["w"], eps))
        assert torch.equal(s, s_ref), f"{what}: the residual sum differs from eager's x + residual"
        normed = s_ref
        ref64 = rms_norm_f64(s_ref, w, eps)
    else:
        args = (dev["w"], dev["cos"], dev["sin"])
        got = kernels.qk_norm_rope(dev["x"], *args, order=order, w2=dev["w2"], split=c["split"], eps=eps).cpu()
        normed = x
        same_dtype = qk_norm_rope_reference(dev["x"], *args, eps, dev["w2"], c["split"]).cpu()
        ref64 = qk_norm_rope_f64(x, w, c["cos"], c["sin"], eps, c["w2"], c["split"])
    if got.numel() == 0:
        assert got.shape == same_dtype.shape, what
        return
    # the draw keeps eager's fp32 sum of squares finite: an overflow makes every norm 0, the kernel's and eager's
    # alike, and the float64 bound vacuous
    assert torch.isfinite(normed.float().pow(2).sum(-1)).all(), what
    assert_as_good_as_torch(got, same_dtype, ref64, what)
    # the share equal to eager's assumes elements cross rounding boundaries independently; a flat row holds a few
    # distinct values (fp16 1000 +- 1 in steps of 0.5), whose elements all flip together when one value's
    # normalized product sits on a boundary (case 16002545: 505 of 3080, the kernel the closer to float64 in 320)
    if got.dtype != torch.float32 and c["kind"] != "flat" and got.numel() >= 2048:
        same = (got == same_dtype).float().mean().item()
        assert same >= (0.98 if op != "qk_norm_rope" else 0.97), f"{what}: {same:.3f} equal to eager"


@pytest.mark.parametrize("case", fuzz_cases(100))
def test_emulated_rms_norm_family_random_config(emu, case):
    """One random configuration per case. op: rms_norm, add_rms_norm or qk_norm_rope; dtype fp32 / bf16 / fp16;
    eps (0, 1e-6, 1e-5, 0.5); values normal, with an outlier per row, or flat (near +-1 after the norm), at a
    scale from 1e-15 to 1e15 (fp16: 1e-3 .. 1e3); the emulator's thread-interleaving seed (warp-greedy bit).
    rms_norm / add_rms_norm: rows 0 .. 9, N a multiple of the 16-byte vector with N / vector at and around the
    block's thread and register-tile boundaries (1 .. 1024 vectors), x and residual rows strided in larger
    buffers (16-byte aligned, as the launcher accepts), residual is x. qk_norm_rope: D 64 / 128, B, N, H small,
    x a view of a padded buffer in a random dim order at any element offset (a stride-0 batch or token dim
    too), RoPE positions 0 .. 1e6 with theta 1e4 / 1e6, one weight or two with split 0 .. H. Checked as the
    fixed emulator tests are: within 2x the same-dtype PyTorch error against float64 (+2 ulp), the residual sum
    exactly equal, and for 16-bit results with >= 2048 elements the share equal to eager's."""
    _check_rms_norm_family_random_config(case, emu, "cpu")


@pytest.mark.parametrize("case", [3001125, 16002545])
def test_emulated_rms_norm_family_campaign_cases(emu, case):
    """Random configurations a fuzz campaign failed, kept (each prints its drawn configuration): 3001125, fp32 rows
    with an outlier, against the float32-norm oracle that rms_norm_f64 replaced; 16002545, fp16 flat rows, whose
    elements of one value flip a rounding together, which the share-equal-to-eager check took for a bad kernel."""
    test_emulated_rms_norm_family_random_config(emu, case)


# ------------------------------------------------------------------------- the C++ launchers' own checks


@pytest.fixture
def cuda_ext(cuda_ext_with):
    return cuda_ext_with("rms_norm", "add_rms_norm", "qk_norm_rope")


def test_launcher_checks_inputs(cuda_ext):
    """CPU tensors: the device check comes last, so every other check runs without a GPU."""
    C = cuda_ext
    x, w = rand(3, 64, dtype=torch.bfloat16), rand(64, dtype=torch.bfloat16)
    for args, match in [
        ((x.int(), w, EPS), "x must have dtype in"),
        ((x, w.half(), EPS), "x and weight must have the same dtype"),
        ((x, w[:32], EPS), r"weight must have shape \[N\] = \[64\], got \[32\]"),
        ((x[:, :60], w[:60], EPS), r"multiple of 8 up to \d+, got 60 "),
        ((x, w, float("nan")), "eps must be finite and >= 0, got nan"),
        ((x, w, -0.25), r"eps must be finite and >= 0, got -0.25"),
        ((x, w, EPS), "x must be a CUDA tensor"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            C.rms_norm(*args)
    r = rand(3, 64, dtype=torch.bfloat16, seed=4)
    for args, match in [
        ((x, r[:, :32], w, EPS), r"residual must have x's shape \[3, 64\], got \[3, 32\]"),
        ((x, r.half(), w, EPS), "x and residual must have the same dtype"),
        ((x, torch.zeros(3, 72, dtype=torch.bfloat16)[:, 1:65], w, EPS), r"residual must have a dense last dimension and 16-byte aligned rows, got strides \[72, 1\]"),
        ((x, r, w, EPS), "x must be a CUDA tensor"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            C.add_rms_norm(*args)
    q, wq, cos, sin = rope_inputs(2, 3, 4, 64, torch.bfloat16)
    for args, match in [
        ((q[0], wq, cos, sin, EPS), "x must have 4 dimensions"),
        ((q, wq, cos[:, :2], sin, EPS), r"cos must have shape \[B, N, D\]"),
        ((q, wq, cos, sin.float(), EPS), "x and sin must have the same dtype"),
        ((q[..., :32], wq[:32], cos[..., :32].contiguous(), sin[..., :32].contiguous(), EPS),
         "head_dim must be 64 or 128"),
        ((q, wq, cos.transpose(0, 1), sin, EPS), r"cos must have shape"),
        ((q, wq, cos, sin, EPS, wq[:32], 2), r"weight2 must have shape \[D\]"),
        ((q, wq, cos, sin, EPS, wq, 5), r"split must be in \[0, heads = 4\], got 5"),
        ((q, wq, cos, sin, EPS), "x must be a CUDA tensor"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            C.qk_norm_rope(*args)


# ------------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_kernels_match_the_reference(cuda_ext, dtype):
    for rows, n in [(1, 4096), (97, 2560), (123, 136)]:
        x = rand(rows, n, dtype=dtype, seed=rows, scale=4.0).cuda()
        w = rand(n, dtype=dtype, seed=1).cuda()
        got = cuda_ext.rms_norm(x, w, EPS)
        assert_as_good_as_torch(got.cpu(), rms_norm_reference(x, w, EPS).cpu(),
                                rms_norm_f64(x.cpu(), w.cpu(), EPS), f"rms {rows}x{n}")
        assert torch.equal(rms_norm(x, w, EPS), got)  # the public op runs the kernel
    for b, n, h, d in [(3, 5, 7, 128), (1, 97, 2, 64), (64, 8, 32, 128)]:
        x, w, cos, sin = (t.cuda() for t in rope_inputs(b, n, h, d, dtype, seed=h))
        got = cuda_ext.qk_norm_rope(x, w, cos, sin, EPS)
        ref64 = qk_norm_rope_f64(*(t.cpu() for t in (x, w, cos, sin)), EPS)
        assert_as_good_as_torch(got.cpu(), qk_norm_rope_reference(x, w, cos, sin, EPS).cpu(), ref64,
                                f"rope {b}x{n}x{h}x{d}")
        assert torch.equal(qk_norm_rope(x, w, cos, sin, EPS), got)
        w2 = (w.float() * 0.5 + 0.25).to(dtype)
        split = h // 2
        got2 = cuda_ext.qk_norm_rope(x, w, cos, sin, EPS, w2, split)
        ref64 = qk_norm_rope_f64(*(t.cpu() for t in (x, w, cos, sin, w2)), EPS, split=split)
        assert_as_good_as_torch(got2.cpu(), qk_norm_rope_reference(x, w, cos, sin, EPS, w2, split).cpu(), ref64,
                                f"rope two weights {b}x{n}x{h}x{d}")
        assert torch.equal(got2[:, :, :split], got[:, :, :split])
        for rows, n_ in [(1, 4096), (97, 2560), (123, 136)]:
            x = rand(rows, n_, dtype=dtype, seed=rows, scale=4.0).cuda()
            r = rand(rows, n_, dtype=dtype, seed=rows + 9, scale=2.0).cuda()
            w = rand(n_, dtype=dtype, seed=1).cuda()
            y, s = cuda_ext.add_rms_norm(x, r, w, EPS)
            y_ref, s_ref = add_rms_norm_reference(x, r, w, EPS)
            assert torch.equal(s, s_ref)
            assert_as_good_as_torch(y.cpu(), y_ref.cpu(), rms_norm_f64(s_ref.cpu(), w.cpu(), EPS),
                                    f"add_rms {rows}x{n_}")
            assert torch.equal(add_rms_norm(x, r, w, EPS)[0], y)


class _OnCuda:
    """The CUDA launchers (_C) behind Emulated's methods, for the random configurations: outputs poisoned
    (poisoned_cuda_outputs, in the launchers' allocation order) and returned on the CPU; the emulator's order seed
    ignored."""

    def __init__(self, C):
        self.C = C

    def rms_norm(self, x, w, order=0, eps=EPS):
        with poisoned_cuda_outputs(x.numel() * x.element_size()):
            return self.C.rms_norm(x, w, eps).cpu()

    def add_rms_norm(self, x, r, w, order=0, eps=EPS):
        with poisoned_cuda_outputs(x.numel() * x.element_size(), x.numel() * x.element_size()):
            return tuple(t.cpu() for t in self.C.add_rms_norm(x, r, w, eps))

    def qk_norm_rope(self, x, w, cos, sin, order=0, w2=None, split=0, eps=EPS):
        with poisoned_cuda_outputs(x.numel() * x.element_size()):
            return self.C.qk_norm_rope(x, w, cos, sin, eps, w2, split).cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("case", fuzz_cases(100))
def test_gpu_random_config(cuda_ext, case):
    """test_emulated_rms_norm_family_random_config's configurations on the CUDA kernels (_C.rms_norm /
    add_rms_norm / qk_norm_rope on the drawn strided / offset / expanded layouts), with more rows and heads (up to
    3000 rows, B x N x H up to 8 x 200 x 40: grids of many CTAs), the outputs poisoned, the same checks (eager on
    the GPU as the same-dtype computation). The emulator's thread-interleaving seed is not drawn here: the
    hardware picks the order."""
    _check_rms_norm_family_random_config(case, _OnCuda(cuda_ext), "cuda", gpu=True)


@pytest.mark.gpu
def test_gpu_graph_capture_and_opcheck(cuda_ext):
    x = rand(8, 4096, dtype=torch.bfloat16).cuda()
    w = rand(4096, dtype=torch.bfloat16, seed=1).cuda()
    q, wq, cos, sin = (t.cuda() for t in rope_inputs(2, 4, 32, 128, torch.bfloat16))
    r = rand(8, 4096, dtype=torch.bfloat16, seed=3).cuda()
    wk = (wq.float() * 0.5).to(torch.bfloat16)

    def step():
        return (rms_norm(x, w, EPS), qk_norm_rope(q, wq, cos, sin, EPS), *add_rms_norm(x, r, w, EPS),
                qk_norm_rope(q, wq, cos, sin, EPS, wk, 24))

    want = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    # new inputs that are not a multiple of the old ones (an RMSNorm of 2x is the RMSNorm of x, up to eps)
    x.add_(0.25)
    q.add_(0.25)
    graph.replay()
    torch.cuda.synchronize()
    for got, eager in zip(outs, step()):
        assert torch.equal(got, eager)
    for got, before in zip(outs, want):
        assert not torch.equal(got, before)  # every output was recomputed from the new inputs
    torch.library.opcheck(torch.ops.lightningrl_fast.rms_norm.default, (x, w, EPS))
    torch.library.opcheck(torch.ops.lightningrl_fast.add_rms_norm.default, (x, r, w, EPS))
    torch.library.opcheck(torch.ops.lightningrl_fast.qk_norm_rope.default, (q, wq, cos, sin, EPS, None, 0))
    torch.library.opcheck(torch.ops.lightningrl_fast.qk_norm_rope.default, (q, wq, cos, sin, EPS, wk, 24))


@pytest.mark.gpu
def test_gpu_cached_forward_with_fused_norms_matches_the_eager_model(cuda_ext, monkeypatch):
    """The model's decode forward (fused norms + q/k-norm/RoPE), unpacked and with packed q/k/v and gate/up
    weights, against the same weights with every kernel off (eager modules, reference ops): bf16 logits within
    bf16 tolerance."""
    from lightningrl_fast.model import KVCache, SDARConfig, build_model

    cfg = SDARConfig(vocab_size=111, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=128, block_size=4, mask_token_id=110,
                     torch_dtype="bfloat16", max_position_embeddings=256)
    model = build_model(cfg, dtype=torch.bfloat16, seed=0).eval().cuda()
    ids = torch.randint(0, 110, (3, 8), device="cuda")
    lens = torch.tensor([0, 4, 8], dtype=torch.int32, device="cuda")

    def run():
        cache = KVCache.allocate(cfg, 3, 16, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            return model.forward_cached(ids, cache, torch.zeros(3, dtype=torch.int32, device="cuda"), lens).float()

    fused = run()
    model.pack_decode_weights()  # q/k/v and gate/up as one GEMM each: strided q/k/v views into the kernels
    packed = run()
    monkeypatch.setenv("LRF_DISABLE_KERNELS", "1")
    eager = run()
    for b, n in enumerate([0, 4, 8]):
        torch.testing.assert_close(fused[b, :n], eager[b, :n], rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(packed[b, :n], eager[b, :n], rtol=3e-2, atol=3e-2)
