"""Input validation shared by the ops: every check raises an error that names the argument and the problem.

The Python side checks what a user can get wrong (shape, dtype, device, value ranges); the C++ launchers
check again with TORCH_CHECK so the extension is safe when called directly. Also the dispatch helpers:
`cuda_kernel` (the `_C` entry point or None = the reference; LRF_DISABLE_KERNELS=1), `pdl_allowed` (LRF_PDL).
"""

from __future__ import annotations

import math
import operator
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


def check_int(name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as a Python int (any integer: int, a numpy integer, a 0-d integer tensor; not a bool or a float),
    with lo <= value <= hi where given."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool {value}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        want = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {want}, got {v}")
    return v


def check_float(name: str, value: object, *, allow_inf: bool = False, allow_nan: bool = False,
                lo: float | None = None) -> float:
    """`value` as a Python float: a real number (not a bool; NaN only with allow_nan, +-inf only with allow_inf),
    >= lo if given."""
    if isinstance(value, bool) or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}") from None
    if math.isnan(v) and not allow_nan:
        raise ValueError(f"{name} must not be NaN")
    if math.isinf(v) and not allow_inf:
        raise ValueError(f"{name} must be finite, got {v}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def aligned16(t: torch.Tensor) -> bool:
    """True when t's last dim is dense and its data pointer and every other byte stride are multiples of 16 bytes
    (dims of size 1 excepted): the layout a kernel can move in 16-byte vectors. Metadata only."""
    if t.dim() == 0 or (t.shape[-1] > 1 and t.stride(-1) != 1) or t.data_ptr() % 16:
        return False
    es = t.element_size()
    return all(size <= 1 or (st * es) % 16 == 0 for size, st in zip(t.shape[:-1], t.stride()[:-1]))


def _is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Every element of the layout's memory span belongs to it exactly once (a permutation of a contiguous one)."""
    expected = 1
    for size, st in sorted((d for d in zip(shape, stride) if d[0] != 1), key=lambda d: d[1]):
        if st != expected:
            return False
        expected *= size
    return True


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte) of t's elements."""
    last = sum((size - 1) * st for size, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_no_overlap(written: Sequence[tuple[str, torch.Tensor]], read: Sequence[tuple[str, torch.Tensor]] = ()) -> None:
    """Raise ValueError when a tensor an op writes in place is certain to share memory with itself (an expanded,
    stride-0 view: its rows would overwrite each other), with another written tensor or with an input the op reads
    (what it reads may already be overwritten). Metadata only (no device access; the tensors are on one device),
    a few microseconds when every tensor is contiguous in a storage of its own. Layouts whose overlap is not certain
    (two interleaved strided views of one buffer) are let through, as torch's own checks do. Skipped while
    torch.compile traces (fake tensors have no data pointers)."""
    if torch.compiler.is_compiling():
        return
    nw = len(written)
    by_storage: dict[int, list[int]] = {}  # only tensors of one storage can share memory
    named = (*written, *read)
    for j, (name, t) in enumerate(named):
        if t.numel() == 0 or t.is_meta:
            continue
        if j < nw and t.numel() > 1 and not t.is_contiguous():
            shape, stride = t.shape, t.stride()
            span = 1 + sum((size - 1) * st for size, st in zip(shape, stride))
            if t.numel() > span or any(st == 0 and size > 1 for size, st in zip(shape, stride)):
                raise ValueError(f"{name} is written in place and must not have elements that share memory (an "
                                 f"expanded view?), got shape {list(shape)} and strides {list(stride)}")
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(j)
    for group in by_storage.values():
        for i, ja in enumerate(group[:-1]):
            if ja >= nw:
                break  # indices ascend: the rest are read-only inputs
            name, a = named[ja]
            a0, a1 = _span(a)
            for jb in group[i + 1 :]:
                other, b = named[jb]
                b0, b1 = _span(b)
                if not (a0 < b1 and b0 < a1):
                    continue
                # the spans intersect: certain overlap when both start at the same element, or one tensor fills its
                # span and the other has its first or last element inside it
                if (a0 == b0 or (_is_dense(a.shape, a.stride()) and (a0 <= b0 < a1 or a0 < b1 <= a1))
                        or (_is_dense(b.shape, b.stride()) and (b0 <= a0 < b1 or b0 < a1 <= b1))):
                    verb = "written" if jb < nw else "read"
                    raise ValueError(f"{name} is written in place and must not share memory with {other} (also "
                                     f"{verb} by this op)")


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
