"""The decode forward's GEMM, y = x W^T, with a skinny-GEMM CUDA kernel for few tokens.

  * `linear(x, weight, impl=None, pdl=False)`: x [..., K], weight [N, K] (an nn.Linear's weight, no bias) ->
    [..., N] in x's dtype. What `F.linear(x, weight)` returns up to the order of the fp32 sums (tensor-core
    accumulation, as cuBLAS's): about one unit in the last place of the dtype.

Why a kernel: a denoising step of a batch-1 model multiplies 4-64 tokens by every weight once, so the step is a
stream of the weights and its speed is the share of copy bandwidth the GEMMs reach. `_C.linear`
(csrc/linear.cu, device code csrc/kernels/linear.cuh) reads W with 16-byte streaming loads straight into the
tensor-core fragments, splits K over the CTAs of a thread-block cluster, and sums the partials in a fixed order
through distributed shared memory (no workspace, CUDA-graph safe; deterministic for a given GPU: the launch plan,
and with it the order of the sum, depends on the device's SM count and occupancy, so the bits may differ between
GPU models).

Which path runs:
  * impl "cublas": `F.linear` (the reference; the CPU path).
  * impl "kernel": `_C.linear` when x and weight are bf16/fp16 CUDA tensors of one dtype, rows M = x.numel() / K
    is 1..64, K is a multiple of 8, weight has 16-byte aligned dense rows and x's rows are one 16-byte aligned
    stride apart; `F.linear` otherwise.
  * impl None: $LRF_DECODE_GEMM (default "cublas" until the kernel has been measured on an H100:
    profiling/bench_linear.py).
`pdl=True` launches the kernel with programmatic dependent launch: its first weight loads overlap the tail of
the kernel before it on the stream. Only for callers that know that kernel does not write `weight` (the model's
decode forward: the one before each GEMM is a norm, the attention or silu_mul).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from lightningrl_fast.ops._common import FLOAT_DTYPES, check_tensor, cuda_kernel

__all__ = ["linear", "linear_reference", "gemm_impl", "IMPLS", "IMPL_ENV", "MAX_KERNEL_ROWS"]

IMPLS = ("cublas", "kernel")
IMPL_ENV = "LRF_DECODE_GEMM"  # the implementation when the caller names none
MAX_KERNEL_ROWS = 64  # kernels::kLinearMaxTokens
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def gemm_impl(impl: str | None = None) -> str:
    """`impl`, or $LRF_DECODE_GEMM when None (default "cublas"); raises on an unknown name."""
    name = impl if impl is not None else os.environ.get(IMPL_ENV, "cublas")
    if name not in IMPLS:
        src = "impl" if impl is not None else IMPL_ENV
        raise ValueError(f"{src} must be one of {', '.join(IMPLS)}, got {name!r}")
    return name


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight): the oracle and the CPU path."""
    return F.linear(x, weight)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [M, K] without a copy, or None when its rows are not one stride apart."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def kernel_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `_C.linear` can take (x, weight) as they are (see the module docstring)."""
    k = x.shape[-1]
    if x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype or k == 0 or k % 8:
        return False
    m = x.numel() // k
    if not 1 <= m <= MAX_KERNEL_ROWS or weight.shape[0] == 0:
        return False
    x2 = _rows(x)  # rows must not overlap (an expanded x has stride 0: the launcher refuses it, F.linear takes it)
    if x2 is None or x2.stride(1) != 1 or (m > 1 and (x2.stride(0) % 8 or x2.stride(0) < k)) or x2.data_ptr() % 16:
        return False
    n = weight.shape[0]
    return (weight.stride(1) == 1 and weight.stride(0) % 8 == 0 and (n == 1 or weight.stride(0) >= k)
            and weight.data_ptr() % 16 == 0)


@torch.library.custom_op("lightningrl_fast::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, use_kernel: bool, pdl: bool) -> torch.Tensor:
    fn = cuda_kernel("linear", x, weight) if use_kernel else None
    if fn is not None and kernel_eligible(x, weight):
        y = fn(_rows(x), weight, pdl)  # [M, N]
        return y.view(*x.shape[:-1], weight.shape[0])
    return linear_reference(x, weight)


@_linear_op.register_fake
def _(x, weight, use_kernel, pdl):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, impl: str | None = None, pdl: bool = False) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] (see the module docstring). No autograd through the kernel: the
    decode forward runs under no_grad; training keeps nn.Linear."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dimension must equal weight's in_features ({weight.shape[1]}), got x of shape "
                         f"{list(x.shape)}")
    use_kernel = gemm_impl(impl) == "kernel"
    if not use_kernel or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return linear_reference(x, weight)
    return _linear_op(x, weight, use_kernel, bool(pdl))
