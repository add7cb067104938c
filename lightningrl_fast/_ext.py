"""Loads the compiled extension `lightningrl_fast._C` once.

`ext()` returns the module, or None when it is not built (every op then runs its pure-PyTorch reference,
with one warning saying so). `has_cuda_kernels()` is True when `_C` was compiled with its CUDA kernels.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

import torch

_BUILD_HINT = (
    "build it with `pip install --no-build-isolation .` from the repository "
    "(with nvcc / CUDA_HOME for the CUDA kernels; README, Development)"
)


@functools.lru_cache(maxsize=None)
def ext() -> ModuleType | None:
    """The `lightningrl_fast._C` module, or None (warned once) when it cannot be imported."""
    try:
        from lightningrl_fast import _C
    except ImportError as e:
        warnings.warn(
            f"lightningrl_fast._C is not available ({e}); all ops fall back to the pure-PyTorch reference "
            f"implementations (correct but slow on GPU): {_BUILD_HINT}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return _C


@functools.lru_cache(maxsize=None)
def has_cuda_kernels() -> bool:
    """True when `_C` is built with its CUDA kernels (warns once when a GPU is there but they are not)."""
    mod = ext()
    if mod is None:
        return False
    if mod.has_cuda():
        return True
    if torch.cuda.is_available():
        warnings.warn(
            "lightningrl_fast._C was built without CUDA kernels; ops on CUDA tensors use the pure-PyTorch "
            f"reference: {_BUILD_HINT}",
            RuntimeWarning,
            stacklevel=2,
        )
    return False
