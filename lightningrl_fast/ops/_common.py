"""Input validation shared by the ops: every check raises an error that names the argument and the problem.

The Python side checks what a user can get wrong (shape, dtype, device, value ranges); the C++ launchers
check again with TORCH_CHECK so the extension is safe when called directly.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that `t` is a tensor with the given rank, dtype, shape (None = any size) and device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    return t


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; a host tensor bound for a GPU goes through page-locked memory without blocking, so the
    host does not wait for the stream's queued work (a pageable copy syncs the stream first)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        # a pinned tensor's pin_memory() is itself: copy it, so the caller may change it while the copy is in flight
        staged = (t.clone() if t.is_pinned() else t).pin_memory()
        return staged.to(device, non_blocking=True)
    return t.to(device)


def host_checks_allowed(device: torch.device) -> bool:
    """False while torch.compile traces or a CUDA graph is being captured on `device` (a host read of device
    values would break either); the ops' default for their optional host-side checks."""
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def same_device(*named: tuple[str, torch.Tensor]) -> torch.device:
    """Return the common device of the named tensors or raise naming the first one that differs."""
    dev = named[0][1].device
    for name, t in named[1:]:
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but {named[0][0]} is on {dev}")
    return dev


PDL_ENV = "LRF_PDL"  # "0": no programmatic dependent launch (pdl_allowed)


def pdl_allowed() -> bool:
    """False when LRF_PDL=0: no programmatic dependent launch anywhere (the launchers of csrc/launch.h read the
    same switch at every launch; the decode GEMM's `pdl` argument follows it). For A/B timing (bench_decode
    --pdl on,off) and debugging; on by default."""
    return not os.environ.get(PDL_ENV, "").startswith("0")


def cuda_kernel(name: str, *tensors: torch.Tensor):
    """The `_C` entry point `name` when every tensor is on CUDA and the extension provides it, else None.

    Ops call this inside their custom-op implementation: None means "run the pure-PyTorch reference".
    `LRF_DISABLE_KERNELS=1` in the environment forces the references everywhere (benchmarks, debugging).
    """
    if not all(t.is_cuda for t in tensors) or os.environ.get("LRF_DISABLE_KERNELS") == "1":
        return None
    from .._ext import ext

    mod = ext()
    return getattr(mod, name, None) if mod is not None else None
