"""The compiled extension: importable, and a CUDA build where one is expected (CI sets LRF_EXPECT_CUDA_BUILD=1)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

import lightningrl_fast
from lightningrl_fast import _ext

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
    for name in ("add_rms_norm", "block_attention", "fused_linear_grpo_loss", "kv_cache_write", "qk_norm_rope",
                 "rms_norm", "silu_mul", "threshold_unmask"):
        assert hasattr(C, name), name
    assert _ext.has_cuda_kernels() or not C.has_cuda()


def test_cpu_only_build_has_no_cuda_entry_points():
    C = _C_or_skip()
    if C.has_cuda():
        pytest.skip("CUDA build")
    assert C.cuda_archs() == ""
    assert not any(hasattr(C, n) for n in ("kv_cache_write", "rms_norm", "silu_mul", "threshold_unmask"))


def test_readme_quotes_ci_run_verbatim():
    """README (Development, Tests) shows .ci/run exactly: the documented test command is the real one."""
    repo = Path(__file__).resolve().parents[1]
    readme, script = repo / "README.md", repo / ".ci" / "run"
    if not readme.is_file() or not script.is_file():
        pytest.skip("not run from a checkout")
    text = readme.read_text()
    assert "The test command: `bash .ci/run`" in text
    assert f"```bash\n{script.read_text()}```" in text, "README's copy of .ci/run is out of date"
