"""AdamW for low-precision weights: bf16/fp16 parameters, fp32 optimizer state and fp32 master weights,
optionally kept in host memory (optimizer offload).

`torch.optim.AdamW` keeps its moments in the parameter's dtype, so a bf16 model would accumulate its Adam
moments in bf16 and add each update to a bf16 weight, where an update below 2^-8 of the weight is rounded
away. `MasterAdamW` keeps, per low-precision parameter, an fp32 master copy and fp32 moments in the
optimizer state (so `state_dict()` checkpoints them and a resume continues exactly), steps in fp32 and
writes the rounded master back into the parameter. fp32 parameters are updated in place, as AdamW does.

Offload (`offload=True`, RLConfig.optimizer_offload): the fp32 state (12 bytes per bf16 parameter, 8 per fp32
one) lives in pinned host memory instead of the GPU. A step streams it through the GPU in chunks of
`chunk_elems` elements: the chunk's master and moments are copied in (asynchronously, on the current stream),
updated there with the same arithmetic, and copied back, and the parameter gets its rounded master; the GPU holds
only one chunk's state at a time (16 bytes x `chunk_elems`, 256 MiB by default). Every copy and update is ordered
on one stream, so nothing waits for the host inside a step; `state_dict()` waits for the stream before it hands
the host tensors out. The cost is PCIe traffic: 2 x 12 bytes per bf16 parameter per step (SDAR-4B: ~106 GB, a few
seconds at 25-50 GB/s), small next to an RL step's rollouts. The result is bit-identical to the resident
optimizer (the same elementwise operations, chunk by chunk).

`make_optimizer` picks torch's AdamW when every parameter is fp32 and nothing is offloaded, `MasterAdamW`
otherwise.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")
DEFAULT_CHUNK = 1 << 24  # elements of one offloaded chunk: 16 bytes each on the GPU (g, m, v, master in fp32)


def _adamw_(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, lr: float, b1: float, b2: float,
            eps: float, wd: float, t: float) -> None:
    """One AdamW update of fp32 `w`, `m`, `v` (in place) with fp32 gradient `g`, bias-corrected at step `t`."""
    if wd:
        w.mul_(1.0 - lr * wd)
    m.lerp_(g, 1.0 - b1)
    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
    denom = (v.sqrt() / math.sqrt(1.0 - b2 ** t)).add_(eps)
    w.addcdiv_(m, denom, value=-lr / (1.0 - b1 ** t))


class MasterAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with fp32 state and fp32 master weights; with
    `offload` the state is kept in (pinned) host memory and streamed through the parameter's device per step."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 offload: bool = False, chunk_elems: int = DEFAULT_CHUNK) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"MasterAdamW: need lr > 0, eps > 0, weight_decay >= 0, betas in [0, 1); got lr {lr}, "
                             f"eps {eps}, weight_decay {weight_decay}, betas {betas}")
        if isinstance(chunk_elems, bool) or not isinstance(chunk_elems, int) or chunk_elems < 1:
            raise ValueError(f"MasterAdamW: chunk_elems must be a positive int, got {chunk_elems!r}")
        self.offload, self.chunk_elems = bool(offload), chunk_elems
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _host(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`t` as an fp32 contiguous host tensor for offloaded state, pinned when `p` lives on a GPU."""
        h = t.detach().to("cpu", torch.float32, copy=True).contiguous()
        return h.pin_memory() if p.device.type == "cuda" else h

    def _init_state(self, p: torch.Tensor, st: dict) -> None:
        st["step"] = torch.zeros((), dtype=torch.float32)
        if self.offload:
            st["exp_avg"] = self._host(torch.zeros(p.shape, dtype=torch.float32), p)
            st["exp_avg_sq"] = self._host(torch.zeros(p.shape, dtype=torch.float32), p)
            if p.dtype != torch.float32:
                st["master"] = self._host(p, p)
            return
        st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        if p.dtype != torch.float32:
            st["master"] = p.detach().float().clone(memory_format=torch.preserve_format)

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
                    self._init_state(p, st)
                st["step"] += 1
                t = float(st["step"])
                if self.offload:
                    self._offloaded_step(p, st, lr, b1, b2, eps, wd, t)
                    continue
                w = st.get("master", p)
                _adamw_(w, st["exp_avg"], st["exp_avg_sq"], p.grad.float(), lr, b1, b2, eps, wd, t)
                if w is not p:
                    p.copy_(w)
        return loss

    def _offloaded_step(self, p: torch.Tensor, st: dict, lr: float, b1: float, b2: float, eps: float, wd: float,
                        t: float) -> None:
        """The update of one parameter whose state lives in host memory: chunk by chunk through p's device (copies
        also on the CPU, where the same path runs in the tests)."""
        dev, n = p.device, p.numel()
        host = {k: st[k].view(-1) for k in STATE_KEYS if k in st}
        if p.is_contiguous():
            flat, grad, chunk = p.view(-1), p.grad.reshape(-1), self.chunk_elems
        else:  # a strided parameter (none in this package's models): one chunk, in p's shape
            flat, grad, chunk = None, p.grad, n
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            shape = (b - a,) if flat is not None else p.shape
            m = host["exp_avg"][a:b].to(dev, non_blocking=True, copy=True).view(shape)
            v = host["exp_avg_sq"][a:b].to(dev, non_blocking=True, copy=True).view(shape)
            if "master" in host:
                w = host["master"][a:b].to(dev, non_blocking=True, copy=True).view(shape)
            else:  # fp32 parameter: its own master, updated in place
                w = flat[a:b] if flat is not None else p
            _adamw_(w, m, v, (grad[a:b] if flat is not None else grad).float(), lr, b1, b2, eps, wd, t)
            host["exp_avg"][a:b].copy_(m.view(-1), non_blocking=True)
            host["exp_avg_sq"][a:b].copy_(v.view(-1), non_blocking=True)
            if "master" in host:
                host["master"][a:b].copy_(w.view(-1), non_blocking=True)
                (flat[a:b] if flat is not None else p).copy_(w)

    def _wait_for_copies(self) -> None:
        """Offloaded state is written back by asynchronous copies: wait for them before the host reads it."""
        if self.offload and torch.cuda.is_available():
            for dev in {p.device for g in self.param_groups for p in g["params"] if p.device.type == "cuda"}:
                torch.cuda.current_stream(dev).synchronize()

    def state_dict(self) -> dict:
        self._wait_for_copies()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the moments and master weights stay fp32 (torch casts state to the parameter's dtype),
        on the parameter's device, or in (pinned) host memory when offloaded, whichever way they were saved."""
        self._wait_for_copies()  # no copy of the old state may still be in flight into what gets replaced
        # torch's load_state_dict would first move every state tensor to its parameter's device, cast to its dtype:
        # all the optimizer state on the GPU at once, which an offloaded run has no room for. It gets the groups
        # only; the state is placed here, one tensor at a time.
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for p, i in zip(params, ids):
            for k, v in state_dict["state"].get(i, {}).items():
                if not (torch.is_tensor(v) and v.is_floating_point()):
                    self.state[p][k] = v
                elif k == "step":
                    self.state[p][k] = v.to(device="cpu", dtype=torch.float32, copy=True)
                elif self.offload:
                    self.state[p][k] = self._host(v.reshape(p.shape), p)
                else:
                    self.state[p][k] = v.to(device=p.device, dtype=torch.float32, copy=True)

def make_optimizer(params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                   weight_decay: float = 0.0, offload: bool = False) -> torch.optim.Optimizer:
    """torch's AdamW when every parameter is fp32 and the state stays with the parameters, else MasterAdamW (fp32
    state and master weights; in host memory with `offload`)."""
    params = list(params)
    if all(p.dtype == torch.float32 for p in params) and not offload:
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    return MasterAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, offload=offload)
