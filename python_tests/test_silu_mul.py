"""silu(gate) * up: the reference against the eager MLP formula, the kernel's device code on the CPU emulator
against float64 and the same-dtype PyTorch computation, the public op's checks and dispatch, the launcher's own
checks, and on a GPU (skipped without) the CUDA kernel itself."""

import ctypes
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import EMU_GREEDY, fuzz_cases, poisoned_cuda_outputs, same_layout_on

from lightningrl_fast.ops.silu_mul import silu_mul, silu_mul_reference

_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def rand(*shape, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + 0.1).to(dtype)


def assert_as_good_as_torch(got, same_dtype, ref64, what):
    """Within 2x the worst error of the same-dtype PyTorch computation against float64, plus one unit in the last
    place (the device's / host's expf may differ from torch's in the last bit before the rounding)."""
    assert not got.isnan().any(), f"{what}: NaN (an element not written?)"
    err_t = (same_dtype.double() - ref64).abs()
    err_k = (got.double() - ref64).abs()
    ulp = 2 * torch.finfo(got.dtype).eps * ref64.abs().clamp_min(1e-6)
    assert (err_k <= 2 * err_t.max() + ulp).all(), f"{what}: max error {err_k.max():.3e} vs torch {err_t.max():.3e}"


def test_reference_is_the_mlp_formula_and_the_public_op_checks_inputs():
    gu = rand(3, 5, 2 * 48, dtype=torch.bfloat16)
    gate, up = gu[..., :48], gu[..., 48:]
    assert torch.equal(silu_mul_reference(gu), F.silu(gate) * up)
    assert torch.equal(silu_mul(gu), silu_mul_reference(gu))  # the CPU path is the reference
    with pytest.raises(ValueError, match=r"gate_up must have an even last dimension .* got shape \[3, 5, 95\]"):
        silu_mul(gu[..., :95])
    with pytest.raises(TypeError, match="gate_up must have dtype in"):
        silu_mul(gu.int())
    torch.library.opcheck(torch.ops.lightningrl_fast.silu_mul.default, (gu,))


def test_scalar_input_permuted_layout_and_kernel_layout_rule():
    """A 0-d gate_up is refused by name (was an IndexError without the rank check); a permuted (dense, not
    contiguous) input gives the contiguous output the fake declares (was: the reference kept the input's strides,
    a fake/real stride mismatch under opcheck); `_kernel_ok` (the CUDA dispatch, metadata only) wants rows one
    16-byte multiple apart."""
    from lightningrl_fast.ops.silu_mul import _kernel_ok

    with pytest.raises(ValueError, match=r"gate_up must have an even last dimension .* got shape \[\]"):
        silu_mul(torch.tensor(1.0))
    gu = rand(16, 3).t()  # [3, 16] with strides (1, 3)
    out = silu_mul(gu)
    assert out.is_contiguous() and torch.equal(out, silu_mul_reference(gu.contiguous()))
    torch.library.opcheck(torch.ops.lightningrl_fast.silu_mul.default, (gu,))
    buf = torch.zeros(4, 40, dtype=torch.bfloat16)
    assert _kernel_ok(buf[:, :32])  # rows 80 bytes apart
    assert not _kernel_ok(torch.zeros(4, 36, dtype=torch.bfloat16)[:, :32])  # rows 72 bytes apart
    assert _kernel_ok(torch.zeros(1, 36, dtype=torch.bfloat16)[:, :32])  # one row: its stride is never used
    assert not _kernel_ok(buf[:, :24])  # I = 12: not whole 16-byte vectors
    assert not _kernel_ok(buf.double()[:, :32])  # float64: the reference


class Emulated:
    def __init__(self, lib):
        p, i32, i64, u32, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint, ctypes.c_uint64
        lib.emu_silu_mul.argtypes = [i32, p, p, i64, i64, i32, u32, u64]
        self.lib = lib

    def silu_mul(self, gu2, grid=None, order=0):
        rows, two_i = gu2.shape
        inner = two_i // 2
        y = torch.full((rows, inner), float("nan"), dtype=gu2.dtype)  # poisoned: every element must be written
        per_vec = 16 // gu2.element_size()
        if grid is None:
            grid = max(1, -(-rows * (inner // per_vec) // 256))
        self.lib.emu_silu_mul(_DT[gu2.dtype], gu2.data_ptr(), y.data_ptr(), rows, gu2.stride(0), inner, grid, order)
        return y


@pytest.fixture(scope="module")
def emu(emu_build):
    return Emulated(ctypes.CDLL(str(emu_build("silu_mul_emu.cpp", shared=True, cuda_headers=True))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inner", [(1, 12288), (97, 136), (123, 8), (8, 2048)])
def test_emulated_silu_mul(emu, dtype, rows, inner):
    gu = rand(rows, 2 * inner, dtype=dtype, seed=rows)
    got = emu.silu_mul(gu, order=rows)
    ref = silu_mul_reference(gu)
    ref64 = silu_mul_reference(gu.double())
    assert_as_good_as_torch(got, ref, ref64, f"{dtype} {rows}x{inner}")
    if dtype != torch.float32:  # 16-bit results equal eager's but where an expf last bit crosses a rounding
        same = (got == ref).float().mean().item()
        assert same >= 0.99, same


def test_emulated_silu_mul_grid_stride_strided_rows_and_extremes(emu):
    """Fewer CTAs than vectors (the grid-stride loop), rows of a wider buffer, and inputs where exp(-g)
    overflows (g = -100: silu -> -0) or vanishes (g = 100: silu -> g)."""
    gu = rand(37, 2 * 256, dtype=torch.bfloat16, seed=3)
    assert torch.equal(emu.silu_mul(gu, grid=3), emu.silu_mul(gu))
    wide = rand(37, 2 * 256 + 64, dtype=torch.bfloat16, seed=4)
    view = wide[:, 32 : 32 + 512]
    assert torch.equal(emu.silu_mul(view), emu.silu_mul(view.contiguous()))
    ext = torch.tensor([[-100.0, 100.0, -1e30, 0.0, 5.0, -5.0, 1e-3, -1e-3] * 2], dtype=torch.float32)
    got = emu.silu_mul(ext)
    assert torch.isfinite(got).all()
    assert torch.equal(got, silu_mul_reference(ext))


# gate values where exp(-g) overflows (g <= -88.73), underflows, or silu is near its minimum / identity
# (+-1e25 times an up of at most ~1e9 stays finite in fp32 / bf16)
_GATE_EDGES = [-1e25, -104.0, -103.9, -88.8, -88.72, -87.3, -20.0, -5.0, -1.2785, -1e-3, 1e-3, 5.0, 20.0, 88.8, 100.0,
               1e25]


def _draw_silu_mul(case, gpu=False):
    """The random configuration of case `case` (see test_emulated_silu_mul_random_config) -> (description, gate_up
    [rows, 2 I] on the CPU, strided in its buffer, grid, order seed). `gpu`: sizes past the emulator's cost cap
    (up to 3 x 2^18 vectors, past the launcher's grid of 132 x 16 CTAs of 256 threads: the grid-stride loop on a
    real GPU); the emulator's draws are unchanged by the parameter (the same random numbers in the same order)."""
    rng = random.Random(case)
    g = torch.Generator().manual_seed(case)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    per_vec = 16 // torch.empty(0, dtype=dtype).element_size()
    ivec = rng.choice([1, 2, 3, 31, 32, 33, 255, 256, 257, 511, 512, 513, 1024, 1536, rng.randint(1, 600)])
    inner = ivec * per_vec
    rows = rng.choice([0, 1, 1, 2, 3, 7, rng.randint(1, 40)])
    if gpu and rng.random() < 0.25:
        rows = rng.randint(41, 5000)
    rows = min(rows, max(1, (3 << 18 if gpu else 8192) // ivec))  # emulator: at most 32 CTAs
    pad = per_vec * rng.choice([0, 0, 0, 1, 2, 5])
    start = per_vec * rng.choice([0, 0, 1, 3])
    stride = 2 * inner + pad
    scale = rng.choice([1.0, 3.0, 3.0, 1e-3, 30.0] + ([1e4, 1e8] if dtype != torch.float16 else []))
    p_edge = rng.choice([0.0, 0.0, 0.05, 0.3])
    vecs = rows * ivec
    full_grid = min(-(-vecs // 256), 132 * 16)
    grid = rng.choice([full_grid, full_grid, rng.randint(1, max(full_grid, 1))]) if vecs else 1
    order = rng.choice([0, rng.getrandbits(62) + 1, EMU_GREEDY | rng.getrandbits(62)])
    what = (f"case {case}: dtype={dtype} rows={rows} inner={inner} stride={stride} start={start} scale={scale} "
            f"p_edge={p_edge} " + ("(grid, order: the emulator's)" if gpu else
                                   f"grid={grid} (launcher's {full_grid}) order={order:#x}"))

    vals = torch.randn(start + max(rows, 1) * stride, generator=g, dtype=torch.float64) * scale + 0.1 * scale
    col = (torch.arange(vals.numel()) - start) % stride
    edge = (torch.rand(vals.shape, generator=g, dtype=torch.float64) < p_edge) & (col < inner)  # gates only
    edges = torch.tensor(_GATE_EDGES, dtype=torch.float64)
    vals = torch.where(edge, edges[torch.randint(0, len(_GATE_EDGES), vals.shape, generator=g)], vals)
    if dtype == torch.float16:  # finite inputs and products: |silu(g) * u| <= 200 * 200 < 65504
        vals = vals.clamp(-200.0, 200.0)
    buf = vals.to(dtype)
    gu = buf[start : start + rows * stride].view(rows, stride)[:, : 2 * inner] if rows else buf[:0].view(0, 2 * inner)
    return what, gu, grid, order


def _check_silu_mul_random_config(case, run, device, gpu=False):
    """Draws case `case` (_draw_silu_mul), runs `run(gate_up, grid, order)` on gate_up moved to `device` with its
    layout (same_layout_on) and checks the result: within 2x the same-dtype PyTorch error (eager on `device`)
    against float64 (+1 ulp), and for 16-bit results with >= 2048 elements the share equal to eager's."""
    what, gu, grid, order = _draw_silu_mul(case, gpu)
    print(what)
    gu_dev = same_layout_on(gu, device)
    got = run(gu_dev, grid, order).cpu()
    ref = silu_mul_reference(gu_dev).cpu()
    assert got.shape == ref.shape and torch.isfinite(ref).all(), what  # (an inf would void the error bound)
    if got.numel() == 0:
        return
    assert_as_good_as_torch(got, ref, silu_mul_reference(gu.double()), what)
    if gu.dtype != torch.float32 and got.numel() >= 2048:
        same = (got == ref).float().mean().item()
        assert same >= 0.99, f"{what}: {same:.4f} equal to eager"


@pytest.mark.parametrize("case", fuzz_cases(100))
def test_emulated_silu_mul_random_config(emu, case):
    """One random configuration per case: dtype fp32 / bf16 / fp16; rows 0 .. 40; I a multiple of the 16-byte
    vector (1 .. 1536 vectors: the 256-thread block's boundaries); gate_up rows strided in a larger buffer (a
    16-byte multiple apart, 16-byte aligned: what the launcher accepts); the launcher's grid or a smaller one
    (grid-stride loop); gate and up at a scale from 1e-3 to 1e8 (fp16: up to 30) with some gates at the edges of
    expf (overflow, underflow, +-1e25; fp16: its range); the thread-interleaving seed (warp-greedy bit).
    Checked as the fixed emulator tests are: within 2x the same-dtype PyTorch error against float64 (+1 ulp), and
    for 16-bit results with >= 2048 elements the share equal to eager's."""
    _check_silu_mul_random_config(case, lambda gu, grid, order: emu.silu_mul(gu, grid=grid, order=order), "cpu")


@pytest.fixture
def cuda_ext(cuda_ext_with):
    return cuda_ext_with("silu_mul")


def test_launcher_checks_inputs(cuda_ext):
    """CPU tensors: the device check comes last, so every other check runs without a GPU."""
    C = cuda_ext
    gu = rand(3, 64, dtype=torch.bfloat16)
    for args, match in [
        ((gu.int(),), "gate_up must have dtype in"),
        ((gu[:, :40],), "must be a positive multiple of 16, got 40"),
        ((torch.zeros(3, 80, dtype=torch.bfloat16)[:, 1:65],), "16-byte aligned rows"),
        ((gu,), "gate_up must be a CUDA tensor"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            C.silu_mul(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_kernel_matches_the_reference(cuda_ext, dtype):
    for rows, inner in [(1, 12288), (97, 136), (8, 2048), (4097, 64)]:
        gu = rand(rows, 2 * inner, dtype=dtype, seed=rows).cuda()
        got = cuda_ext.silu_mul(gu)
        ref = silu_mul_reference(gu)
        assert_as_good_as_torch(got.cpu(), ref.cpu(), silu_mul_reference(gu.cpu().double()), f"{rows}x{inner}")
        if dtype != torch.float32:
            assert (got == ref).float().mean().item() >= 0.99
        assert torch.equal(silu_mul(gu), got)  # the public op runs the kernel
    odd = rand(5, 2 * 13, dtype=dtype).cuda()  # I = 13: not a vector multiple -> the reference
    assert torch.equal(silu_mul(odd), silu_mul_reference(odd))


@pytest.mark.gpu
def test_gpu_graph_capture_and_opcheck(cuda_ext):
    gu = rand(8, 2 * 12288, dtype=torch.bfloat16).cuda()
    want = silu_mul(gu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_mul(gu)
    gu.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, silu_mul(gu)) and not torch.equal(out, want)
    torch.library.opcheck(torch.ops.lightningrl_fast.silu_mul.default, (gu,))


@pytest.mark.gpu
@pytest.mark.parametrize("case", fuzz_cases(60))
def test_gpu_random_config(cuda_ext, case):
    """test_emulated_silu_mul_random_config's configurations on the CUDA kernel (_C.silu_mul, the launcher's own
    grid), with more rows (up to 3 x 2^18 vectors: the grid-stride loop past the launcher's 132 x 16 CTAs), the
    output poisoned (poisoned_cuda_outputs), the same checks (eager on the GPU as the same-dtype computation).
    The emulator's grid and thread-interleaving seed are not drawn here: the launcher picks the grid, the
    hardware the order."""

    def run(gu, grid, order):
        with poisoned_cuda_outputs(gu.shape[0] * gu.shape[1] // 2 * gu.element_size()):
            return cuda_ext.silu_mul(gu).cpu()

    _check_silu_mul_random_config(case, run, "cuda", gpu=True)
