"""The compiled extension: importable, and a CUDA build where one is expected (CI sets LRF_EXPECT_CUDA_BUILD=1)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

import lightningrl_fast
from lightningrl_fast import _ext

from conftest import find_cuobjdump, sass_functions

EXPECT_CUDA_BUILD = os.environ.get("LRF_EXPECT_CUDA_BUILD") == "1"


def _C_or_skip():
    try:
        return importlib.import_module("lightningrl_fast._C")
    except ImportError as e:
        if EXPECT_CUDA_BUILD:
            # e.g. the source tree (no _C) shadows the installed package: say which one was imported
            pytest.fail(f"lightningrl_fast._C does not import ({e}); package imported from {lightningrl_fast.__file__}")
        pytest.skip(f"lightningrl_fast._C is not built ({e})")


def test_extension_imports():
    C = _C_or_skip()
    assert _ext.ext() is C
    assert isinstance(C.has_cuda(), bool)
    assert isinstance(C.cuda_archs(), str)


def test_cuda_build_when_expected():
    C = _C_or_skip()
    if not EXPECT_CUDA_BUILD:
        pytest.skip("LRF_EXPECT_CUDA_BUILD is not set")
    assert C.has_cuda(), "built without CUDA although LRF_EXPECT_CUDA_BUILD=1 (nvcc / CUDA_HOME missing?)"
    assert "90a" in C.cuda_archs().split(";") or os.environ.get("LRF_CUDA_ARCHS"), C.cuda_archs()
    for name in ("add_rms_norm", "block_attention", "fused_linear_grpo_loss", "kv_cache_write", "linear",
                 "qk_norm_rope", "rms_norm", "silu_mul", "threshold_unmask"):
        assert hasattr(C, name), name
    assert _ext.has_cuda_kernels() or not C.has_cuda()


def test_cpu_only_build_has_no_cuda_entry_points():
    C = _C_or_skip()
    if C.has_cuda():
        pytest.skip("CUDA build")
    assert C.cuda_archs() == ""
    assert not any(hasattr(C, n) for n in ("kv_cache_write", "linear", "rms_norm", "silu_mul", "threshold_unmask"))


def test_readme_quotes_ci_run_verbatim():
    """README (Development, Tests) shows .ci/run exactly: the documented test command is the real one."""
    repo = Path(__file__).resolve().parents[1]
    readme, script = repo / "README.md", repo / ".ci" / "run"
    if not readme.is_file() or not script.is_file():
        pytest.skip("not run from a checkout")
    text = readme.read_text()
    assert "The test command: `bash .ci/run`" in text
    assert f"```bash\n{script.read_text()}```" in text, "README's copy of .ci/run is out of date"


def _sass_or_skip() -> dict[str, str]:
    """{kernel: SASS} of the built CUDA extension; skipped for a CPU-only build, failed in CI without cuobjdump."""
    C = _C_or_skip()
    if not C.has_cuda():
        pytest.skip("CPU-only build")
    exe = find_cuobjdump()
    if exe is None:
        if EXPECT_CUDA_BUILD:
            pytest.fail("no cuobjdump (CUDA toolkit or triton package)")
        pytest.skip("no cuobjdump")
    return sass_functions(exe, C.__file__)


def test_tensor_core_kernels_sass_has_the_intended_instructions():
    """The sm_90a SASS (no GPU needed) of both block-attention variants: the mma.sync kernel issues HMMA.16816,
    the wgmma kernel HGMMA 64x64x16 (S = Q K^T, K-major B) and 64xDx16 with a transposed (MN-major) B (O += P V)
    behind warpgroup fences and async-proxy fences; and of the decode skinny GEMM. None touches local memory."""
    funcs = _sass_or_skip()
    attn = {n: body for n, body in funcs.items() if "block_attn_kernel" in n}
    wg = {n: b for n, b in attn.items() if "Lb1E" in n}
    mma = {n: b for n, b in attn.items() if "Lb0E" in n}
    assert len(wg) == 4 and len(mma) == 4, sorted(attn)  # bf16 / fp16 x head dim 64 / 128
    for n, body in wg.items():
        d = 128 if "Li128E" in n else 64
        assert "HGMMA.64x64x16.F32" in body, n
        assert f"HGMMA.64x{d}x16.F32" in body and ".tnspB" in body, n
        assert "WARPGROUP.ARRIVE" in body and "WARPGROUP.DEPBAR" in body and "FENCE.VIEW.ASYNC.S" in body, n
        assert "HMMA" not in body.replace("HGMMA", ""), n
    for n, body in mma.items():
        assert "HMMA.16816.F32" in body and "HGMMA" not in body, n
    for n, body in attn.items():
        assert "LDL" not in body and "STL" not in body, f"{n} uses local memory"
    # the decode skinny GEMM (csrc/kernels/linear.cuh): W by 16-byte streaming loads (no L1 allocation, 256-byte
    # L2 prefetch) into HMMA, griddepcontrol.wait (ACQBULK) for PDL, the cluster barrier, no local memory
    lin = {n: body for n, body in funcs.items() if "linear_kernel" in n}
    assert len(lin) == 8, sorted(lin)  # bf16 / fp16 x 1, 2, 4, 8 n-tiles
    for n, body in lin.items():
        assert "LDG.E.NA.LTC256B.128.CONSTANT" in body and "HMMA.16816.F32" in body, n
        assert "ACQBULK" in body and "UCGABAR_ARV" in body and "UCGABAR_WAIT" in body, n
        # the PDL prefetch: weight loads are issued before griddepcontrol.wait (ptxas hoists a wait it may)
        assert body.index("LDG.E.NA.LTC256B.128.CONSTANT") < body.index("ACQBULK"), n
        assert "LDL" not in body and "STL" not in body, f"{n} uses local memory"
        # griddepcontrol.launch_dependents (PREEXIT) after the main loop's last wait, before the partial tiles
        assert body.rindex("ACQBULK") < body.index("PREEXIT") < body.index("STS"), n


def _first(body: str, ops: tuple[str, ...]) -> int:
    """Offset of the first instruction of `body` whose opcode is one of ops (len(body) if none)."""
    import re

    m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?(" + "|".join(ops) + r")[\s.]", body)
    return m.start() if m else len(body)


def test_programmatically_launched_kernels_wait_before_touching_memory():
    """The launchers start the norms, q/k-norm + RoPE, silu_mul and both block-attention kernels with
    programmatic stream serialization (csrc/launch.h): each may run while the kernel before it on the stream is
    still writing its input, which is safe only because griddepcontrol.wait (ACQBULK) comes before its first
    global load or store (and before its cp.async copies). Checked on the sm_90a SASS."""
    funcs = _sass_or_skip()
    stems = {"rms_norm_kernel": 6, "qk_norm_rope_kernel": 6, "silu_mul_kernel": 3, "block_attn_kernel": 8,
             "block_attn_combine_kernel": 4}
    memory_ops = ("LDG", "STG", "LDGSTS", "LD", "ST", "ATOMG", "RED", "UTMALDG", "UBLKCP")
    for stem, count in stems.items():
        found = {n: b for n, b in funcs.items() if stem + "I" in n}
        assert len(found) == count, (stem, sorted(found))
        for n, body in found.items():
            wait = _first(body, ("ACQBULK",))
            assert wait < len(body), f"{n}: no griddepcontrol.wait"
            assert wait < _first(body, memory_ops), f"{n}: a global memory access before griddepcontrol.wait"
