"""AdamW for low-precision weights: bf16/fp16 parameters, fp32 optimizer state and fp32 master weights.

`torch.optim.AdamW` keeps its moments in the parameter's dtype, so a bf16 model would accumulate its Adam
moments in bf16 and add each update to a bf16 weight, where an update below 2^-8 of the weight is rounded
away. `MasterAdamW` keeps, per low-precision parameter, an fp32 master copy and fp32 moments in the
optimizer state (so `state_dict()` checkpoints them and a resume continues exactly), steps in fp32 and
writes the rounded master back into the parameter. fp32 parameters are updated in place, as AdamW does.
`make_optimizer` picks torch's AdamW when every parameter is fp32 and `MasterAdamW` otherwise.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch


class MasterAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with fp32 state and fp32 master weights."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"MasterAdamW: need lr > 0, eps > 0, weight_decay >= 0, betas in [0, 1); got lr {lr}, "
                             f"eps {eps}, weight_decay {weight_decay}, betas {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MasterAdamW does not support sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    if p.dtype != torch.float32:
                        st["master"] = p.detach().float().clone(memory_format=torch.preserve_format)
                w = st.get("master", p)
                g = p.grad.float()
                st["step"] += 1
                t = float(st["step"])
                if wd:
                    w.mul_(1.0 - lr * wd)
                st["exp_avg"].lerp_(g, 1.0 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1.0 - b2)
                denom = (st["exp_avg_sq"].sqrt() / math.sqrt(1.0 - b2 ** t)).add_(eps)
                w.addcdiv_(st["exp_avg"], denom, value=-lr / (1.0 - b1 ** t))
                if w is not p:
                    p.copy_(w)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the moments and master weights stay fp32 (torch casts state to the parameter's dtype)."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for p, i in zip(params, ids):
            for k, v in state_dict["state"].get(i, {}).items():
                if torch.is_tensor(v) and v.is_floating_point():
                    dev = p.device if k != "step" else v.device
                    self.state[p][k] = v.to(device=dev, dtype=torch.float32, copy=True)


def make_optimizer(params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """torch's AdamW when every parameter is fp32, else MasterAdamW (fp32 state and master weights)."""
    params = list(params)
    if all(p.dtype == torch.float32 for p in params):
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    return MasterAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
