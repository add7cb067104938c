"""RMSNorm and the fused q/k-norm + rotary embedding of the decode path.

  * `rms_norm(x, weight, eps)`: Qwen3's RMSNorm over the last dim, `weight * (x / rms(x)).to(x.dtype)` with the
    norm in float32 (the model's `RMSNorm` module).
  * `add_rms_norm(x, residual, weight, eps) -> (y, s)`: s = x + residual (rounded to the dtype, the eager
    residual add) and y = rms_norm(s): a decoder layer's residual add and the next norm in one launch.
  * `qk_norm_rope(x, weight, cos, sin, eps, weight2=None, split=0)`: the per-head RMSNorm of q or k
    [B, N, H, D] followed by rotate-half RoPE with cos/sin [B, N, D] (what `Attention._qkv` does with
    `q_norm`/`k_norm` and `apply_rope`). With `weight2`, heads h >= split are normalized with it: the q and k
    heads of one packed q/k/v projection output in one launch.

Each has a pure-PyTorch reference (`*_reference`, the exact eager formulas: the test oracle and the CPU path)
and a custom op that runs `_C.rms_norm` / `_C.add_rms_norm` / `_C.qk_norm_rope` (csrc/rms_norm.cu) on CUDA tensors of bf16 / fp16 /
fp32 when the layout allows (rms_norm: N a multiple of the 16-byte vector up to 8192 bf16 elements, 16-byte
aligned rows; qk_norm_rope: head_dim 64 or 128), else the reference. One launch replaces the ~10 small eager
launches of each norm (and RoPE).

The kernels round where the eager code rounds; only their fp32 sum of squares is accumulated in another order,
so an element can differ from the reference by one unit in the last place of the storage type. The model uses
these ops in its cached (decode) forward only (eight launches per layer become three); training forwards keep the eager modules, whose autograd they
rely on.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightningrl_fast.ops._common import check_float, check_int, check_tensor, cuda_kernel

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference", "qk_norm_rope",
           "qk_norm_rope_reference"]

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), the norm in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_reference(x + residual), x + residual): the eager residual add, then the norm."""
    s = x + residual
    return rms_norm_reference(s, weight, eps), s


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [B, N, H, D], cos/sin [B, N, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rot * sin[:, :, None]


def qk_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           eps: float, weight2: torch.Tensor | None = None, split: int = 0) -> torch.Tensor:
    if weight2 is None:
        return rope_reference(rms_norm_reference(x, weight, eps), cos, sin)
    normed = torch.cat([rms_norm_reference(x[:, :, :split], weight, eps),
                        rms_norm_reference(x[:, :, split:], weight2, eps)], dim=2)
    return rope_reference(normed, cos, sin)


def _rms_kernel_ok(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    per_vec = 16 // x.element_size()
    n = x.shape[-1]
    return (x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and weight.is_contiguous() and n % per_vec == 0
            and 0 < n <= 8 * 128 * per_vec and x.is_contiguous() and x.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0
            and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()
                                      and residual.data_ptr() % 16 == 0)))


def _check_eps(eps: object) -> float:
    """eps as a float: a number (TypeError otherwise), finite and >= 0 (ValueError)."""
    eps = check_float("eps", eps, allow_inf=True, allow_nan=True)
    if not (eps >= 0.0 and eps < float("inf")):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return eps


@torch.library.custom_op("lightningrl_fast::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    fn = cuda_kernel("rms_norm", x, weight)
    if fn is not None and _rms_kernel_ok(x, weight):
        return fn(x, weight, eps)
    return rms_norm_reference(x, weight, eps).contiguous()  # the fake's (and the kernel's) layout


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., N] with weight [N] (see the module docstring)."""
    check_tensor("x", x, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    check_tensor("weight", weight, shape=(x.shape[-1],), device=x.device,
                 dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
    eps = _check_eps(eps)
    return _rms_norm_op(x, weight, eps)


@torch.library.custom_op("lightningrl_fast::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    fn = cuda_kernel("add_rms_norm", x, residual, weight)
    if fn is not None and _rms_kernel_ok(x, weight, residual):
        return fn(x, residual, weight, eps)
    y, s = add_rms_norm_reference(x, residual, weight, eps)
    return y.contiguous(), s.contiguous()  # the fake's (and the kernel's) layout


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    s = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    return torch.empty(x.shape, dtype=torch.promote_types(s.dtype, weight.dtype), device=x.device), s


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [..., N] of one dtype (see the module docstring)."""
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    check_tensor("x", x, dtypes=floats)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    check_tensor("residual", residual, shape=tuple(x.shape), dtypes=(x.dtype,), device=x.device)
    check_tensor("weight", weight, shape=(x.shape[-1],), device=x.device, dtypes=floats)
    eps = _check_eps(eps)
    return _add_rms_norm_op(x, residual, weight, eps)


@torch.library.custom_op("lightningrl_fast::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float, weight2: Optional[torch.Tensor], split: int) -> torch.Tensor:
    fn = cuda_kernel("qk_norm_rope", x, weight, cos, sin)
    weights = (weight,) if weight2 is None else (weight, weight2)
    if (fn is not None and x.dtype in KERNEL_DTYPES and x.shape[-1] in (64, 128) and x.stride(-1) == 1
            and all(t.dtype == x.dtype and t.is_contiguous() for t in (*weights, cos, sin))):
        return fn(x, weight, cos, sin, eps, weight2, split)
    return qk_norm_rope_reference(x, weight, cos, sin, eps, weight2, split).contiguous()  # as the fake and kernel


@_qk_norm_rope_op.register_fake
def _(x, weight, cos, sin, eps, weight2, split):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                 weight2: torch.Tensor | None = None, split: int = 0) -> torch.Tensor:
    """RMSNorm of each head vector of x [B, N, H, D] (weight [D]; heads h >= split with weight2 [D] when given)
    then RoPE with cos/sin [B, N, D]. Returns a new dense [B, N, H, D] tensor."""
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    check_tensor("x", x, ndim=4, dtypes=floats)
    b, n, h, d = x.shape
    if d % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {d}")
    check_tensor("weight", weight, shape=(d,), dtypes=(x.dtype,), device=x.device)
    if weight2 is not None:
        check_tensor("weight2", weight2, shape=(d,), dtypes=(x.dtype,), device=x.device)
        split = check_int("split", split)
        if not 0 <= split <= h:
            raise ValueError(f"split must be in [0, heads = {h}], got {split}")
    check_tensor("cos", cos, shape=(b, n, d), dtypes=(x.dtype,), device=x.device)
    check_tensor("sin", sin, shape=(b, n, d), dtypes=(x.dtype,), device=x.device)
    eps = _check_eps(eps)
    return _qk_norm_rope_op(x, weight, cos, sin, eps, weight2, split if weight2 is not None else 0)
