"""Shared test setup: deterministic seeds, the `gpu` marker's auto-skip, per-dtype tolerances."""

from __future__ import annotations

import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seeds():
    """Every test starts from the same seeds (Python, torch CPU and CUDA)."""
    random.seed(0)
    torch.manual_seed(0)  # seeds CUDA too
    yield


_TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def tolerance(dtype: torch.dtype) -> dict:
    """`dict(rtol=..., atol=...)` for comparing a kernel in `dtype` against a float64 reference."""
    rtol, atol = _TOLERANCES[dtype]
    return {"rtol": rtol, "atol": atol}
