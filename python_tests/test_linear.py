"""ops.linear, the decode forward's skinny GEMM: the op's dispatch and errors (CPU), the kernel source under CPU
emulation (csrc/emu/linear_emu.cpp) against the float64 reference, the launch plan, the launcher's input checks,
and the built kernel against the float64 reference (GPU)."""

from __future__ import annotations

import math
import random
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import fuzz_cases

from lightningrl_fast.ops import linear as linear_mod
from lightningrl_fast.ops.linear import IMPL_ENV, gemm_impl, kernel_eligible, linear

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def make(m, n, k, dtype, seed=0, x_stride=None, device="cpu"):
    """x [m, k] (a view of rows x_stride apart when given) and w [n, k]: N(0, 1) / sqrt(k)-scaled, never zero."""
    g = torch.Generator().manual_seed(seed)
    xs = x_stride or k
    xbuf = torch.randn(m, xs, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / k**0.5
    x = xbuf.to(dtype).to(device)[:, :k]
    return x, w.to(dtype).to(device)


def check_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """got vs the float64 product of the same (rounded) inputs: max error within 2x that of F.linear in the same
    dtype (on x's device), and no NaN (every output written)."""
    want = x.double() @ w.double().T
    same = F.linear(x, w).double()
    assert got.shape == want.shape and got.dtype == x.dtype
    got = got.double()
    assert not got.isnan().any(), "NaN in the output: an element was not written"
    err = (got - want).abs().max().item()
    err_ref = (same - want).abs().max().item()
    assert err <= 2 * err_ref + 1e-7, (err, err_ref)
    return err, err_ref


# ----------------------------------------------------------------------------------- the op (CPU: reference)

def test_cpu_op_is_the_reference_for_every_impl(monkeypatch):
    x, w = make(5, 37, 24, torch.float32)
    for impl in ("cublas", "kernel"):
        assert torch.equal(linear(x, w, impl=impl), F.linear(x, w))
    monkeypatch.setenv(IMPL_ENV, "kernel")
    assert gemm_impl() == "kernel"
    x3 = torch.randn(2, 3, 24, dtype=torch.float64)
    assert torch.equal(linear(x3, w.double()), F.linear(x3, w.double()))


def test_opcheck():
    x, w = make(4, 16, 32, torch.float32)
    torch.library.opcheck(torch.ops.lightningrl_fast.linear.default, (x, w, True, False))
    for dtype in (torch.bfloat16, torch.float64):  # the fake's output dtype is x's, not a fixed one
        x, w = make(3, 8, 16, dtype)
        torch.library.opcheck(torch.ops.lightningrl_fast.linear.default, (x[None], w, True, True))


def test_bad_inputs_raise_clear_errors(monkeypatch):
    x, w = make(4, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="x's last dimension must equal weight's in_features \\(32\\)"):
        linear(x[:, :31], w)
    with pytest.raises(TypeError, match="weight must have dtype in \\(float32\\)"):
        linear(x, w.double())
    with pytest.raises(ValueError, match="weight must have 2 dimensions"):
        linear(x, w[None])
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        linear([1.0], w)
    with pytest.raises(ValueError, match=r"x's last dimension must equal .*got x of shape \[\]"):
        linear(torch.tensor(1.0), w[:, :1])  # 0-d x: was an IndexError without the rank check
    with pytest.raises(ValueError, match="impl must be one of cublas, kernel, got 'triton'"):
        linear(x, w, impl="triton")
    monkeypatch.setenv(IMPL_ENV, "fast")
    with pytest.raises(ValueError, match=f"{IMPL_ENV} must be one of cublas, kernel, got 'fast'"):
        linear(x, w)


def test_pdl_switch(monkeypatch):
    """LRF_PDL=0 turns programmatic dependent launch off (the C++ launchers read the same variable)."""
    from lightningrl_fast.ops._common import PDL_ENV, pdl_allowed

    monkeypatch.delenv(PDL_ENV, raising=False)
    assert pdl_allowed()
    monkeypatch.setenv(PDL_ENV, "0")
    assert not pdl_allowed()
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl_allowed()


def test_cuda_kernel_dispatch(monkeypatch):
    """`cuda_kernel` (every op's dispatch): the `_C` entry point only when EVERY tensor is on CUDA, the extension
    has it and LRF_DISABLE_KERNELS is not 1; else None (the reference). Stand-ins for CUDA tensors and `_C` (all
    it reads is `.is_cuda` and the attribute), so this runs without a GPU."""
    from types import SimpleNamespace

    from lightningrl_fast import _ext
    from lightningrl_fast.ops._common import cuda_kernel

    fake_ext = SimpleNamespace(linear=object())
    monkeypatch.setattr(_ext, "ext", lambda: fake_ext)
    monkeypatch.delenv("LRF_DISABLE_KERNELS", raising=False)
    gpu, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    assert cuda_kernel("linear", gpu, gpu) is fake_ext.linear
    assert cuda_kernel("linear", gpu, cpu) is None and cuda_kernel("linear", cpu, gpu) is None
    assert cuda_kernel("rms_norm", gpu) is None  # an entry point the extension lacks
    monkeypatch.setenv("LRF_DISABLE_KERNELS", "1")
    assert cuda_kernel("linear", gpu) is None
    monkeypatch.setenv("LRF_DISABLE_KERNELS", "0")
    assert cuda_kernel("linear", gpu) is fake_ext.linear
    monkeypatch.setattr(_ext, "ext", lambda: None)  # no extension built
    assert cuda_kernel("linear", gpu) is None


def test_kernel_eligibility_rules():
    x, w = make(4, 16, 32, torch.bfloat16)
    assert kernel_eligible(x, w)
    assert kernel_eligible(x[:1], w)
    assert not kernel_eligible(x.float(), w.float())  # fp32: cuBLAS
    assert not kernel_eligible(torch.zeros(65, 32, dtype=torch.bfloat16), w)  # > 64 rows
    assert not kernel_eligible(x[:, :28], w[:, :28])  # K % 8
    assert not kernel_eligible(x[:, 1:25], w[:, :24])  # rows not 16-byte aligned
    assert not kernel_eligible(x, w.t().contiguous().t())  # weight columns not dense
    xb, _ = make(4, 16, 32, torch.bfloat16, x_stride=48)
    assert kernel_eligible(xb, w)  # rows 48 elements apart: fine
    assert not kernel_eligible(torch.zeros(2, 5, 32, dtype=torch.bfloat16)[:, :4], w)  # no single row stride
    assert kernel_eligible(torch.zeros(2, 4, 32, dtype=torch.bfloat16), w)  # [2, 4, K] -> 8 rows
    # overlapping rows (expanded: stride 0, or a stride below K) are refused by the launcher: F.linear takes them
    assert not kernel_eligible(x[:1].expand(4, 32), w)
    assert not kernel_eligible(x, w[:1].expand(16, 32))
    flat = torch.zeros(64, dtype=torch.bfloat16)
    assert not kernel_eligible(flat.as_strided((4, 32), (8, 1)), w)
    assert kernel_eligible(x, w[:1].as_strided((1, 32), (0, 1)))  # one feature: its row stride is never used
    assert kernel_eligible(torch.zeros(64, 32, dtype=torch.bfloat16), w)  # 64 rows: the most the kernel takes
    assert not kernel_eligible(x, w[:0])  # no output features
    xs, _ = make(4, 16, 32, torch.bfloat16, x_stride=36)
    assert not kernel_eligible(xs, w)  # rows 36 elements (72 bytes) apart: not 16-byte aligned
    wbuf = torch.zeros(16, 64, dtype=torch.bfloat16)
    assert not kernel_eligible(x, wbuf[:, ::2])  # weight rows not dense (element stride 2)
    assert not kernel_eligible(x, torch.zeros(16, 36, dtype=torch.bfloat16)[:, :32])  # weight rows 72 bytes apart
    wflat = torch.zeros(16 * 32 + 8, dtype=torch.bfloat16)
    assert kernel_eligible(x, wflat[8 : 8 + 16 * 32].view(16, 32))  # 16 bytes in: aligned
    assert not kernel_eligible(x, wflat[1 : 1 + 16 * 32].view(16, 32))  # weight pointer 2 bytes past a boundary


def test_grad_enabled_inputs_take_the_reference(monkeypatch):
    """The kernel has no backward: with autograd on and a tensor that requires grad, F.linear runs."""
    calls = []
    monkeypatch.setattr(linear_mod, "_linear_op", lambda *a: calls.append(a))
    x, w = make(4, 16, 32, torch.float32)
    w.requires_grad_(True)
    y = linear(x, w, impl="kernel")
    assert y.requires_grad and not calls


def test_op_dispatch_by_impl_and_grad_mode(monkeypatch):
    """impl "cublas" (the default without $LRF_DECODE_GEMM) never enters the custom op; impl "kernel" does, with
    `pdl` passed on, also for weights that require grad under no_grad (the decode forward: nn.Linear parameters
    inside torch.no_grad())."""
    calls = []
    monkeypatch.setattr(linear_mod, "_linear_op", lambda *a: calls.append(a) or F.linear(a[0], a[1]))
    monkeypatch.delenv(IMPL_ENV, raising=False)
    assert gemm_impl() == "cublas"
    x, w = make(4, 16, 32, torch.float32)
    assert torch.equal(linear(x, w), F.linear(x, w)) and not calls
    assert torch.equal(linear(x, w, impl="cublas", pdl=True), F.linear(x, w)) and not calls
    linear(x, w, impl="kernel", pdl=True)
    assert len(calls) == 1 and calls[0][2:] == (True, True)
    w.requires_grad_(True)
    with torch.no_grad():
        linear(x, w, impl="kernel")
    assert len(calls) == 2 and calls[1][2:] == (True, False)


# ----------------------------------------------------------------------- the kernel source under emulation

@pytest.fixture(scope="module")
def emulator(emu_build):
    return emu_build("linear_emu.cpp")


def emu_linear(exe, tmp, x, w, fw, cluster, seed=0):
    """The emulated kernel with the given plan on x [m, k] and w [n, k] (rows x.stride(0) / w.stride(0) apart; a
    single row's stride is K, as the launcher passes it)."""
    m, k = x.shape
    n = w.shape[0]
    xs = x.stride(0) if m > 1 else k
    ws = w.stride(0) if n > 1 else k
    xfull = torch.as_strided(x, (m, xs), (xs, 1)) if m > 1 else x
    wfull = torch.as_strided(w, (n, ws), (ws, 1)) if n > 1 else w
    hdr = np.array([m, n, k, 0 if x.dtype == torch.bfloat16 else 1, fw, cluster, xs, ws, seed],
                   dtype=np.int32).tobytes()
    fin, fout = tmp / "in.bin", tmp / "out.bin"
    fin.write_bytes(hdr + bits(xfull).numpy().tobytes() + bits(wfull).numpy().tobytes())
    res = subprocess.run([str(exe), "run", str(fin), str(fout)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    raw = np.fromfile(fout, dtype=np.int16)
    return torch.from_numpy(raw.copy()).view(x.dtype).view(m, n)


EMU_CASES = [
    # dtype, m, n, k, x row stride, fw, cluster
    ("bf16", 1, 111, 64, None, 8, 1),  # one token, odd N in one tile
    ("fp16", 4, 97, 120, None, 1, 1),  # K not a multiple of 32: a partial chunk
    ("bf16", 7, 123, 200, 216, 2, 4),  # strided x, 3 n-tiles over clusters of 4
    ("bf16", 9, 130, 328, None, 4, 2),  # NT = 2
    ("fp16", 16, 64, 1024, None, 8, 8),  # NT = 2 full, a full cluster of 8
    ("bf16", 33, 40, 264, 272, 1, 8),  # NT = 8 (33 tokens), kw = 8 per CTA x 8 CTAs > chunks: idle warps
    ("fp16", 32, 48, 96, None, 2, 2),  # NT = 4 exactly full
    ("bf16", 64, 257, 512, None, 8, 4),  # the largest token count, odd N across tiles
    ("bf16", 3, 40, 1000, None, 8, 1),  # 32 chunks per warp (the last partial): 8 prefetched groups of 4
    ("fp16", 40, 20, 640, 648, 2, 1),  # NT = 8 (no prefetch): groups of 2, 2 and 1 chunks per warp
]


@pytest.mark.parametrize("dt,m,n,k,xs,fw,cluster", EMU_CASES)
def test_emulated_kernel_matches_reference(emulator, tmp_path, dt, m, n, k, xs, fw, cluster):
    x, w = make(m, n, k, DTYPES[dt], seed=m + n, x_stride=xs)
    got = emu_linear(emulator, tmp_path, x, w, fw, cluster, seed=n)
    check_close(got, x, w)


def test_emulated_kernel_is_deterministic_across_schedules(emulator, tmp_path):
    """The cluster reduction sums in a fixed order: other thread interleavings give the same bits."""
    x, w = make(12, 70, 384, torch.bfloat16, seed=3)
    a = emu_linear(emulator, tmp_path, x, w, 2, 4, seed=1)
    b = emu_linear(emulator, tmp_path, x, w, 2, 4, seed=99)
    assert torch.equal(bits(a), bits(b))


def test_emulated_plans_agree_with_each_other(emulator, tmp_path):
    """Every (fw, cluster) split of the same product is within rounding of the others (sanity of the split-K
    index math: a dropped or doubled chunk would show as a large difference)."""
    x, w = make(5, 50, 256, torch.float16, seed=5)
    outs = [emu_linear(emulator, tmp_path, x, w, fw, cl).double() for fw, cl in [(1, 1), (8, 1), (2, 8), (4, 2)]]
    want = x.double() @ w.double().T
    for o in outs:
        assert (o - want).abs().max().item() < 2e-3


def _plan_ok(n, k, sms, max_cluster, plan):
    """Whether `plan` (fw, cluster, ctas) is linear_plan's documented choice on an ideal GPU of `sms` SMs (2 CTAs
    each, clusters up to `max_cluster`), by brute force over every launchable shape: the widest feature tile whose
    best cluster size reaches 90% wave efficiency, else the most efficient shape (the widest on ties); a cluster
    of more than one CTA needs a 32-column chunk per warp."""
    chunks = -(-k // 32)
    slots = 2 * sms

    def eff(fw, cl):
        ctas = -(-n // (16 * fw)) * cl
        return ctas / (-(-ctas // slots) * slots)

    shapes = {(fw, cl): eff(fw, cl) for fw in (8, 4, 2, 1) for cl in (1, 2, 4, 8)
              if cl <= max_cluster and (cl == 1 or chunks >= cl * (8 // fw))}
    fw, cl, ctas = plan
    if (fw, cl) not in shapes or ctas != -(-n // (16 * fw)) * cl:
        return False
    best_of = {f: max(e for (f2, _), e in shapes.items() if f2 == f) for f in (8, 4, 2, 1)}
    if not math.isclose(shapes[fw, cl], best_of[fw], rel_tol=1e-9):
        return False  # not the best cluster size of its tile
    good = [f for f in (8, 4, 2, 1) if best_of[f] >= 0.9]
    if good:
        return fw == good[0]
    top = max(best_of.values())
    return fw == next(f for f in (8, 4, 2, 1) if best_of[f] > top - 1e-9)


def _emu_plan(exe, n, k, sms, max_cluster):
    out = subprocess.run([str(exe), "plan", str(n), str(k), str(sms), str(max_cluster)], capture_output=True,
                         text=True, check=True).stdout.split()
    return tuple(int(v) for v in out)


GPU_FUZZ_WEIGHT = 1 << 26  # on a GPU: weight elements (N x K) at most (its float64 copy for the reference: 512 MiB)


def _draw_linear(rng: random.Random, gpu: bool = False) -> dict:
    """One configuration the op's dispatch can send the kernel (see test_emulated_kernel_random_config). gpu=True
    (test_gpu_random_config): larger layers besides (K to 12288, N to ~40k or a model's width: 4096, 6144,
    12288, 24576, 151936), K cut to a multiple of 8 that keeps N x K within GPU_FUZZ_WEIGHT, and `pdl`; the plan
    and schedule seed are still drawn (the real launcher plans for its GPU). gpu=False draws as before the
    parameter existed."""
    c = {"dt": rng.choice(["bf16", "fp16"])}
    c["m"] = rng.randint(1, 64) if rng.random() < 0.5 else rng.choice([1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64])
    r = rng.random()
    if r < 0.4:  # around a 32-column chunk boundary
        c["k"] = max(8, 32 * rng.randint(1, 24) + rng.choice([-8, 0, 8, 16, 24]))
    elif r < 0.9:
        c["k"] = 8 * rng.randint(1, 1024 if gpu else 128)
    else:  # many chunks per warp (prefetch groups, partial last group)
        c["k"] = 8 * rng.randint(128, 1536 if gpu else 512)
    r = rng.random()
    if r < 0.15:
        c["n"] = rng.choice([1, 2, 3, 15, 16, 17])
    elif r < 0.5:  # at or just past a feature-tile boundary
        c["n"] = max(1, 16 * rng.choice([1, 2, 4, 8]) * rng.randint(1, 64 if gpu else 4) + rng.choice([-1, 0, 1, 8]))
    elif gpu and r < 0.6:  # a model's layer width (q/k/v or gate/up packed, o_proj, down, the LM head)
        c["n"] = rng.choice([4096, 6144, 12288, 24576, 151936])
    else:
        c["n"] = rng.randint(1, 40000 if gpu else 320)
    if gpu and c["n"] * c["k"] > GPU_FUZZ_WEIGHT:
        c["k"] = max(8, GPU_FUZZ_WEIGHT // c["n"] // 8 * 8)
    # strided x rows (a view of a wider buffer: 16-byte aligned, rows not overlapping); weight rows strided too
    # (a column block of a wider matrix), or dense (a packed q/k/v or gate/up row range is dense)
    c["xs"] = c["k"] + 8 * rng.randint(1, 24) if c["m"] > 1 and rng.random() < 0.4 else None
    c["ws"] = c["k"] + 8 * rng.randint(1, 24) if c["n"] > 1 and rng.random() < 0.3 else None
    chunks = -(-c["k"] // 32)
    if rng.random() < 0.5:  # the launcher's plan for some GPU
        c["plan_sms"], c["plan_max_cluster"] = rng.randint(1, 160), rng.choice([1, 2, 4, 8])
    else:  # any shape a plan (other occupancies) or the launcher's fallback (cluster 1) can launch
        c["fw"] = rng.choice([1, 2, 4, 8])
        c["cluster"] = rng.choice([cl for cl in (1, 2, 4, 8) if cl == 1 or chunks >= cl * (8 // c["fw"])])
    c["seed"] = rng.randrange(2**31)  # odd: the warp-greedy schedule
    # a launch plan of a large layer (not run)
    c["big_plan"] = (rng.randint(1, 1 << rng.randint(4, 18)), 8 * rng.randint(1, 1 << rng.randint(2, 12)),
                     rng.randint(1, 200), rng.choice([1, 2, 4, 8]))
    if gpu:
        c["pdl"] = rng.random() < 0.5
    return c


def _linear_inputs(c: dict, case: int, device="cpu"):
    """x [m, k] (rows c["xs"] apart when set) and w [n, k] (rows c["ws"] apart) of a drawn configuration, N(0, 1)
    / sqrt(k)-scaled, drawn on `device` from the case seed (on the CPU: make's x)."""
    m, n, k, dtype = c["m"], c["n"], c["k"], DTYPES[c["dt"]]
    seed = case % 2**31
    xbuf = torch.randn(m, c["xs"] or k, generator=torch.Generator(device).manual_seed(seed), dtype=torch.float64,
                       device=device)
    w = torch.randn(n, c["ws"] or k, generator=torch.Generator(device).manual_seed(seed + 1), dtype=torch.float64,
                    device=device) / k**0.5
    return xbuf.to(dtype)[:, :k], w.to(dtype)[:, :k]


@pytest.mark.parametrize("case", fuzz_cases(16))
def test_emulated_kernel_random_config(emulator, tmp_path, case):
    """A random configuration the op sends the kernel: bf16 / fp16; m 1..64 (uniform, or at / past the 8-token
    n-tile boundaries); K a multiple of 8 (around 32-column chunk boundaries, or up to 4096); N 1..~320 (odd, or
    at / past feature-tile boundaries); x rows strided or dense, weight rows strided or dense; the plan
    linear_plan picks for a random ideal GPU (checked against its documented rule by brute force, as is the plan
    of a random large layer), or any (fw, cluster) a plan or the fallback launch can take; a random schedule seed
    (odd: warp-greedy). Output poisoned by the driver; compared as test_emulated_kernel_matches_reference."""
    c = _draw_linear(random.Random(case))
    print("config:", c)
    bn, bk, bsms, bmc = c["big_plan"]
    bp = _emu_plan(emulator, bn, bk, bsms, bmc)
    assert _plan_ok(bn, bk, bsms, bmc, bp), ("big plan", bp, c)
    if "plan_sms" in c:
        plan = _emu_plan(emulator, c["n"], c["k"], c["plan_sms"], c["plan_max_cluster"])
        assert _plan_ok(c["n"], c["k"], c["plan_sms"], c["plan_max_cluster"], plan), ("plan", plan, c)
        c["fw"], c["cluster"] = plan[:2]
    x, w = _linear_inputs(c, case)
    got = emu_linear(emulator, tmp_path, x, w, c["fw"], c["cluster"], seed=c["seed"])
    err, err_ref = check_close(got, x, w)
    print("err", err, "F.linear err", err_ref)


@pytest.mark.parametrize(
    "n,k,sms,max_cluster,want",
    [
        (4096, 4096, 132, 8, (8, 8, 256)),  # o_proj of SDAR-8B: 32 tiles x 8 = 97% of one wave of 264 slots
        (6144, 4096, 132, 8, (4, 8, 768)),  # packed q/k/v: F = 128 gives 1.45 waves at best; F = 64: 2.9 of 3
        (24576, 4096, 132, 8, (8, 4, 768)),  # packed gate/up: 2.9 of 3 waves
        (4096, 12288, 132, 8, (8, 8, 256)),  # down_proj
        (151936, 4096, 132, 8, (8, 2, 2374)),  # lm_head: no split = 4.5 waves (89.9%), split 2 = 8.99 of 9
        (4096, 4096, 132, 1, (1, 1, 256)),  # no clusters (pre-sm_90): narrow tiles instead
        (111, 120, 132, 8, (1, 1, 7)),  # tiny: the most CTAs
    ],
)
def test_emulated_launch_plan(emulator, n, k, sms, max_cluster, want):
    out = subprocess.run([str(emulator), "plan", str(n), str(k), str(sms), str(max_cluster)], capture_output=True,
                         text=True, check=True).stdout.split()
    assert tuple(int(v) for v in out) == want


# ---------------------------------------------------------------------------------- the launcher's checks

def test_launcher_checks_inputs(cuda_ext_with):
    """The C++ launcher names the problem (CPU tensors: the device check comes last)."""
    mod = cuda_ext_with("linear")
    x, w = make(4, 16, 32, torch.bfloat16)
    cases = [
        ((x[0], w), "x must have 2 dimensions"),
        ((x.float(), w.float()), "x must have dtype in"),
        ((x, w.half()), "x and weight must have the same dtype"),
        ((x, w[:, :24]), r"x is \[M, K\] = \[4, 32\] but weight \[N, K\] is \[16, 24\]"),
        ((torch.zeros(65, 32, dtype=torch.bfloat16), w), "x must have 1..64 rows"),
        ((x[:, :28], w[:, :28]), "K \\(in_features\\) must be a positive multiple of 8, got 28"),
        ((x, torch.zeros(16, 40, dtype=torch.bfloat16)[:, 4:36]), "weight must have a dense last dimension and 16-byte aligned rows"),
        ((torch.zeros(4, 36, dtype=torch.bfloat16)[:, 4:], w), "x must have a dense last dimension and 16-byte aligned rows"),
        ((torch.zeros(32, 4, dtype=torch.bfloat16).t(), w), "x must have a dense last dimension"),
        ((x, w), "x must be a CUDA tensor, got device cpu"),
    ]
    for args, match in cases:
        with pytest.raises(RuntimeError, match=match):
            mod.linear(*args)


# ---------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [
    # m, n, k: odd sizes and the SDAR-8B decode shapes (q/k/v packed, o_proj, gate/up packed, down, lm_head slice)
    (1, 111, 64),
    (4, 97, 120),
    (7, 123, 1000),
    (4, 6144, 4096),
    (8, 4096, 4096),
    (32, 24576, 4096),
    (64, 4096, 12288),
    (33, 151936, 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_kernel_matches_reference(cuda_ext_with, dt, m, n, k):
    mod = cuda_ext_with("linear")
    x, w = make(m, n, k, DTYPES[dt], seed=m * n + k, device="cuda")
    for pdl in (False, True):
        got = mod.linear(x, w, pdl)
        check_close(got, x, w)


GPU_FUZZ_CASES = 64  # estimated (not yet timed) at a few ms each on an H100


def _check_random_linear(case, run, device="cuda"):
    """The configuration _draw_linear(gpu=True) draws from `case`, its inputs drawn on `device`
    (_linear_inputs), `run(x, w, c)` -> the product, checked by check_close as the emulator's random
    configurations; a failure names the configuration. -> (err, err_ref)"""
    c = _draw_linear(random.Random(case), gpu=True)
    print("linear GPU fuzz case", case, c)
    try:
        x, w = _linear_inputs(c, case, device)
        return check_close(run(x, w, c), x, w)
    except Exception as e:
        raise AssertionError(f"linear fuzz case {case} {c}: {type(e).__name__}: {e}") from e


@pytest.mark.gpu
@pytest.mark.parametrize("case", fuzz_cases(GPU_FUZZ_CASES))
def test_gpu_random_config(cuda_ext_with, case):
    """The built kernel (_C.linear, as test_gpu_kernel_matches_reference) on a random configuration of the
    emulator's space (test_emulated_kernel_random_config) with larger layers: bf16 / fp16, m 1..64, K to 12288,
    N to ~40k and the model's widths (the launcher plans each for this GPU), strided or dense x and weight rows,
    PDL on or off; checked by check_close. The drawn plan and schedule seed are emulator-only (not used here)."""
    mod = cuda_ext_with("linear")
    _check_random_linear(case, lambda x, w, c: mod.linear(x, w, c["pdl"]), "cuda")


@pytest.mark.gpu
def test_gpu_strided_rows_and_views(cuda_ext_with):
    mod = cuda_ext_with("linear")
    x, w = make(13, 300, 256, torch.bfloat16, x_stride=384, device="cuda")
    check_close(mod.linear(x, w, False), x, w)
    big = torch.randn(900, 256, device="cuda", dtype=torch.bfloat16)
    wv = big[200:500]  # a row range of a packed weight (as q/k/v views are)
    check_close(mod.linear(x, wv, False), x, wv)


@pytest.mark.gpu
def test_gpu_op_dispatch_and_determinism(cuda_ext_with):
    mod = cuda_ext_with("linear")
    x, w = make(32, 4096, 4096, torch.bfloat16, seed=1, device="cuda")
    a = linear(x.view(2, 16, 4096), w, impl="kernel")
    b = linear(x.view(2, 16, 4096), w, impl="kernel", pdl=True)
    assert a.shape == (2, 16, 4096)
    assert torch.equal(bits(a), bits(b)), "two launches of the same product differ"
    # the op ran the kernel (not its F.linear fallback): the same bits as a direct launch
    assert torch.equal(bits(a.view(32, 4096)), bits(mod.linear(x, w, False)))
    check_close(a.view(32, 4096), x, w)
    big = torch.randn(65, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(big, w, impl="kernel"), F.linear(big, w))  # > 64 rows: cuBLAS


@pytest.mark.gpu
def test_gpu_kernel_in_a_cuda_graph(cuda_ext_with):
    """Captured with PDL and clusters, replayed on new inputs copied into the static buffer."""
    mod = cuda_ext_with("linear")
    x, w = make(4, 6144, 4096, torch.bfloat16, seed=2, device="cuda")
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mod.linear(static_x, w, True)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        h = F.silu(static_x)  # a kernel before the GEMM, as in the decode step
        y = mod.linear(h, w, True)
    for seed in (3, 4):
        x2, _ = make(4, 6144, 4096, torch.bfloat16, seed=seed, device="cuda")
        static_x.copy_(x2)
        g.replay()
        torch.cuda.synchronize()
        check_close(y, F.silu(x2), w)



@pytest.mark.gpu
@pytest.mark.parametrize("pdl_env", ["1", "0"])
def test_gpu_pdl_chain_sees_the_whole_gemm_output(cuda_ext_with, monkeypatch, pdl_env):
    """The skinny GEMM lets its successor launch after its main loop (griddepcontrol.launch_dependents), and the
    norms / silu_mul / attention are launched with programmatic serialization (csrc/launch.h): each must still
    read the GEMM's complete output. The GEMM's output block is handed back by the caching allocator every
    iteration, so a successor reading before the GEMM finished would see the previous iteration's values."""
    mod = cuda_ext_with("linear", "rms_norm", "add_rms_norm", "silu_mul")
    monkeypatch.setenv("LRF_PDL", pdl_env)  # "0": every launch plain (the same results)
    _, w = make(8, 8192, 4096, torch.bfloat16, seed=1, device="cuda")  # 8192: the widest row rms_norm takes
    nw = torch.rand(8192, device="cuda", dtype=torch.bfloat16) + 0.5
    res = torch.randn(8, 8192, device="cuda", dtype=torch.bfloat16)
    got = []
    for seed in range(8):
        x, _ = make(8, 16, 4096, torch.bfloat16, seed=10 + seed, device="cuda")
        y = mod.linear(x, w, True)  # [8, 8192]: the reduction phase overlaps the next launches
        n = mod.rms_norm(y, nw, 1e-6)
        a, s = mod.add_rms_norm(y, res, nw, 1e-6)
        got.append((x, n, a, s, mod.silu_mul(y)))  # [8, 4096]
        del y
    torch.cuda.synchronize()
    for x, n, a, s, sm in got:
        y = mod.linear(x, w, False)
        torch.cuda.synchronize()  # nothing overlaps in the expected values
        exp_n = mod.rms_norm(y, nw, 1e-6)
        torch.cuda.synchronize()
        exp_a, exp_s = mod.add_rms_norm(y, res, nw, 1e-6)
        torch.cuda.synchronize()
        exp_sm = mod.silu_mul(y)
        torch.cuda.synchronize()
        assert torch.equal(n, exp_n) and torch.equal(a, exp_a) and torch.equal(s, exp_s)
        assert torch.equal(sm, exp_sm)


def _cuda_model():
    from lightningrl_fast.model import SDARConfig, build_model

    cfg = SDARConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, block_size=4, mask_token_id=999,
                     max_position_embeddings=512)
    return build_model(cfg, dtype=torch.float64, seed=0).eval().to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.filterwarnings("error:CUDA graph capture")  # graphs on must really be captured
def test_gpu_decode_forward_with_the_kernel_gemms(cuda_ext_with, monkeypatch):
    """The model's cached forward (packed q/k/v and gate/up, o_proj, down, LM head through ops.linear with PDL)
    gives the cuBLAS forward's logits to bf16 rounding, and the sampler (CUDA graphs on) decodes with it,
    deterministically."""
    import dataclasses

    from lightningrl_fast.model import KVCache
    from lightningrl_fast.sampler import SamplerConfig, generate

    cuda_ext_with("linear")
    m = _cuda_model()
    m.pack_decode_weights()
    ids = torch.randint(0, 998, (2, 8), device="cuda")
    lens = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    chunk = torch.tensor([8, 8], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        out = {}
        fallbacks = []
        reference = linear_mod.linear_reference
        for impl in ("cublas", "kernel"):
            monkeypatch.setenv(IMPL_ENV, impl)
            if impl == "kernel":  # every GEMM of this forward is kernel-eligible: none may fall back to F.linear
                monkeypatch.setattr(linear_mod, "linear_reference", lambda *a: fallbacks.append(a) or reference(*a))
            cache = KVCache.allocate(m.config, 2, 32, dtype=torch.bfloat16, device="cuda")
            out[impl] = m.forward_cached(ids, cache, lens, chunk).float()
        monkeypatch.setattr(linear_mod, "linear_reference", reference)
        assert not fallbacks, [tuple(a[1].shape) for a in fallbacks]
        # the PDL chain (the attention reads v straight from the q/k/v GEMM, two kernels back) changes no bit
        monkeypatch.setenv("LRF_PDL", "0")
        cache = KVCache.allocate(m.config, 2, 32, dtype=torch.bfloat16, device="cuda")
        assert torch.equal(m.forward_cached(ids, cache, lens, chunk).float(), out["kernel"])
        monkeypatch.delenv("LRF_PDL")
    scale = out["cublas"].abs().max().item()
    assert (out["kernel"] - out["cublas"]).abs().max().item() <= 0.03 * scale
    monkeypatch.setenv(IMPL_ENV, "kernel")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    cfg = SamplerConfig(threshold=0.5, temperature=1.0, max_new_tokens=12, eos_ids=(998,), cuda_graphs=True, seed=3)
    a, b = generate(m, prompts, cfg), generate(m, prompts, cfg)
    assert torch.equal(a.tokens, b.tokens)
    greedy = dataclasses.replace(cfg, temperature=0.0)
    g_on, g_off = generate(m, prompts, greedy), generate(m, prompts, dataclasses.replace(greedy, cuda_graphs=False))
    assert torch.equal(g_on.tokens, g_off.tokens) and torch.equal(g_on.step_map, g_off.step_map)


# ------------------------------------------------------------------------------------------- the benchmark

def test_bench_linear_cpu_final_json_line():
    import json
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "profiling" / "bench_linear.py"), "--cpu", "--tokens", "1,4"],
                          capture_output=True, text=True, timeout=300, cwd=str(repo))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["bench"] == "linear" and result["config"] == "tiny" and result["kernels"] is False
    assert [(r["proj"], r["M"]) for r in result["rows"]][:3] == [("qkv", 1), ("qkv", 4), ("o_proj", 1)]
    assert len(result["rows"]) == 10 and all(r["cublas_us"] > 0 for r in result["rows"])
    assert sum(line.startswith("{") for line in lines) == 1
    bad = subprocess.run([sys.executable, str(repo / "profiling" / "bench_linear.py"), "--cpu", "--tokens", "65"],
                         capture_output=True, text=True, timeout=300, cwd=str(repo))
    assert bad.returncode != 0 and "--tokens must be in 1..64" in bad.stderr
