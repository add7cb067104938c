"""silu(gate) * up of the decode MLP in one launch, on the packed gate/up GEMM output.

  * `silu_mul(gate_up)`: gate_up [..., 2 I] holds gate (the first I of the last dim) and up (the next I), as the
    packed `[gate_proj; up_proj]` weight of `SDARForCausalLM.pack_decode_weights` produces them; returns
    `F.silu(gate) * up` [..., I] in gate_up's dtype.

`silu_mul_reference` is the eager formula (the test oracle and the CPU path). The custom op runs `_C.silu_mul`
(csrc/silu_mul.cu) on CUDA tensors of bf16 / fp16 / fp32 when I is a multiple of the 16-byte vector and the rows
are 16-byte aligned with a dense last dim, else the reference. The kernel rounds where the eager code rounds
(the silu result to the dtype, then the product) with the same fp32 formula, so it differs from eager only
where the device's expf and the host's disagree in the last bit before rounding. Used by the model's cached
(decode) forward only; training keeps the eager modules and their autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightningrl_fast.ops._common import check_tensor, cuda_kernel

__all__ = ["silu_mul", "silu_mul_reference"]

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up with gate, up = gate_up.chunk(2, dim=-1)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _kernel_ok(gate_up: torch.Tensor) -> bool:
    per_vec = 16 // gate_up.element_size()
    n = gate_up.shape[-1]
    if gate_up.dtype not in KERNEL_DTYPES or n == 0 or n % (2 * per_vec) or gate_up.data_ptr() % 16:
        return False
    if gate_up.stride(-1) != 1 and n > 1:
        return False
    try:
        rows = gate_up.view(-1, n)  # one row stride (no copy), as the kernel needs
    except RuntimeError:
        return False
    return rows.shape[0] <= 1 or rows.stride(0) % per_vec == 0


@torch.library.custom_op("lightningrl_fast::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    fn = cuda_kernel("silu_mul", gate_up)
    if fn is not None and _kernel_ok(gate_up):
        return fn(gate_up)
    return silu_mul_reference(gate_up).contiguous()  # the fake's (and the kernel's) layout


@_silu_mul_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 I] (see the module docstring). Returns a new dense [..., I] tensor."""
    check_tensor("gate_up", gate_up, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must have an even last dimension (gate and up side by side), got shape "
                         f"{list(gate_up.shape)}")
    return _silu_mul_op(gate_up)
