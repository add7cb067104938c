"""AdamW for low-precision weights: bf16/fp16 parameters, fp32 optimizer state and fp32 master weights,
optionally kept in host memory (optimizer offload).

`torch.optim.AdamW` keeps its moments in the parameter's dtype, so a bf16 model would accumulate its Adam
moments in bf16 and add each update to a bf16 weight, where an update below 2^-8 of the weight is rounded
away. `MasterAdamW` keeps, per low-precision parameter, an fp32 master copy and fp32 moments in the
optimizer state (so `state_dict()` checkpoints them and a resume continues exactly), steps in fp32 and
writes the rounded master back into the parameter. fp32 parameters are updated in place, as AdamW does.

Offload (`offload=True`, RLConfig.optimizer_offload): the fp32 state (12 bytes per bf16 parameter, 8 per fp32 one)
lives in pinned host memory instead of the GPU. A step streams it through the GPU in chunks of `chunk_elems`
elements: the chunk's master and moments are copied in (asynchronously, on the current stream), updated there with
the same arithmetic, and copied back, and the parameter gets its rounded master. Two sets of chunk buffers are used
in turn (`_Staging`), and on CUDA the copies back run on a side stream: chunk i's copy back overlaps chunk i+1's
copy in (PCIe moves both directions at once, so a step that is copy-bound takes about half the time of copying in
and out one after the other); the copy in to a set waits (on the device) for the copy back that last used it. The
GPU holds the two sets plus one chunk's gradient and denominator (32 bytes x `chunk_elems`: 512 MiB by default).
Nothing waits for the host inside a step; at its end the current stream joins the side stream, and an event after
that orders the next step (on whatever stream) and `state_dict()` (the host waits for it). `overlap=False` keeps
every copy on the current stream (the bench's comparison). The host tensors are views into a few power-of-two slabs
(`carve_host`): torch's pinned allocator rounds each allocation up to a power of two, a third more host memory for
an SDAR model's state if every tensor were its own allocation. The cost is PCIe traffic: 2 x 12 bytes per bf16
parameter per step (SDAR-4B: ~106 GB, a few seconds at 25-50 GB/s), small next to an RL step's rollouts. The result
is bit-identical to the resident MasterAdamW (the same elementwise operations, chunk by chunk): to the resident run
of a bf16/fp16 model; an fp32 model without offload gets torch's AdamW, equal on the CPU, within the last bit on
CUDA (its foreach path divides where this one multiplies by the reciprocal).

`make_optimizer` picks torch's AdamW when every parameter is fp32 and nothing is offloaded, `MasterAdamW`
otherwise.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")
DEFAULT_CHUNK = 1 << 24  # elements of one offloaded chunk
# GPU bytes per element of an offloaded chunk: two sets of master, m, v (fp32), the fp32 gradient and the update's
# denominator (fp32)
STAGING_BYTES_PER_ELEMENT = 32


def _adamw_(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, lr: float, b1: float, b2: float,
            eps: float, wd: float, t: float) -> None:
    """One AdamW update of fp32 `w`, `m`, `v` (in place) with fp32 gradient `g`, bias-corrected at step `t`."""
    if wd:
        w.mul_(1.0 - lr * wd)
    m.lerp_(g, 1.0 - b1)
    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
    denom = v.sqrt().div_(math.sqrt(1.0 - b2 ** t)).add_(eps)  # in place: one temporary, not two
    w.addcdiv_(m, denom, value=-lr / (1.0 - b1 ** t))


def carve_host(numels: list[int], pin: bool, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Flat uninitialized host tensors of `dtype` of the given sizes, carved from a few slabs (pinned when `pin`):
    the offloaded optimizer state here, the offloaded KL reference's weights (rl/logprobs.host_copy).

    torch's pinned-memory allocator rounds every allocation up to a power of two: one allocation per state tensor
    would take a third more host memory for an SDAR model (a 201 MB MLP-weight moment takes 256 MiB, a 2.5 GB
    embedding one 4 GiB). The tensors are packed first-fit-decreasing into slabs of 2^k elements (at least 256 MiB
    and at least the largest tensor), each slab allocated at the power of two its contents round to: the waste is
    what first-fit leaves free in the slabs (small next to the whole: most tensors are far smaller than a slab)
    plus the rounding of the last one (`offloaded_state_bytes` counts it). A checkpoint of the state saves whole
    slabs (torch.save writes a view's storage), so it carries the same slack, zeroed."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(numels)
    for size, used, items in carve_plan(numels):
        slab = torch.empty(size, dtype=dtype, pin_memory=pin)
        slab[used:].zero_()  # the slack is saved with the slab in a checkpoint: deterministic bytes
        for i, off in items:
            out[i] = slab[off: off + numels[i]]
    return out


def carve_plan(numels: list[int]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """`carve_host`'s packing: per slab (allocated elements, used elements, [(tensor index, offset)]).
    `sum(size for size, _, _ in carve_plan(numels))` elements is what carving these sizes pins."""
    if not numels:
        return []
    cap = max(1 << 26, 1 << (max(numels) - 1).bit_length())  # elements per slab
    bins: list[list] = []  # [used elements, [(tensor index, offset)]]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        for b in bins:
            if b[0] + numels[i] <= cap:
                b[1].append((i, b[0]))
                b[0] += numels[i]
                break
        else:
            bins.append([numels[i], [(i, 0)]])
    return [(1 << max(0, (used - 1).bit_length()), used, items) for used, items in bins]


def state_keys(p: torch.Tensor) -> tuple[str, ...]:
    """The fp32 state tensors of parameter `p`: the two moments, and a master copy unless `p` is fp32 itself."""
    return STATE_KEYS if p.dtype != torch.float32 else STATE_KEYS[:2]


def offloaded_state_bytes(params: Iterable[torch.Tensor]) -> int:
    """Pinned host bytes MasterAdamW(offload=True) allocates for these parameters (`state_keys`), slab rounding
    included."""
    numels = [p.numel() for p in params for _ in state_keys(p)]
    return 4 * sum(size for size, _, _ in carve_plan(numels))


class MasterAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with fp32 state and fp32 master weights; with
    `offload` the state is kept in (pinned) host memory and streamed through the parameter's device per step."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 offload: bool = False, chunk_elems: int = DEFAULT_CHUNK, overlap: bool = True) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"MasterAdamW: need lr > 0, eps > 0, weight_decay >= 0, betas in [0, 1); got lr {lr}, "
                             f"eps {eps}, weight_decay {weight_decay}, betas {betas}")
        if isinstance(chunk_elems, bool) or not isinstance(chunk_elems, int) or chunk_elems < 1:
            raise ValueError(f"MasterAdamW: chunk_elems must be a positive int, got {chunk_elems!r}")
        self.offload, self.chunk_elems, self.overlap = bool(offload), chunk_elems, bool(overlap)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _init_state(self, p: torch.Tensor, st: dict) -> None:
        st["step"] = torch.zeros((), dtype=torch.float32)
        for k in state_keys(p):
            st[k] = (p.detach().float().clone(memory_format=torch.preserve_format) if k == "master" else
                     torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format))

    def _place_offloaded(self, entries: list[tuple[torch.Tensor, str, torch.Tensor | None]]) -> None:
        """Offloaded state: for each (parameter, key, value) an fp32 host tensor in the parameter's shape, carved from
        shared slabs (`carve_host`), pinned when parameters live on a GPU, holding `value` (None: zeros for a
        moment, the parameter itself for "master")."""
        pin = any(p.device.type == "cuda" for p, _, _ in entries)
        for (p, k, v), h in zip(entries, carve_host([p.numel() for p, _, _ in entries], pin)):
            h = h.view(p.shape)
            if v is not None:
                h.copy_(v.reshape(p.shape))
            elif k == "master":
                h.copy_(p.detach())
            else:
                h.zero_()
            self.state[p][k] = h

    def _init_offloaded(self) -> None:
        """The state of every parameter with a gradient and no state yet, allocated together (one packing of the
        slabs); as in the resident path, a parameter gets its state (and its master) at its first gradient."""
        new = [p for g in self.param_groups for p in g["params"] if p.grad is not None and not self.state[p]]
        for p in new:
            self.state[p]["step"] = torch.zeros((), dtype=torch.float32)
        self._place_offloaded([(p, k, None) for p in new for k in state_keys(p)])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.offload:
            self._update()
            return loss
        self._after_last_copies()
        staging: dict[torch.device, _Staging] = {}
        try:
            self._init_offloaded()
            staging.update(self._staging())
            self._update(staging)
        finally:  # also after an error mid-step: what was copied back so far is what the next reader waits for
            for s in staging.values():
                s.join()
            self._record_copies()
        return loss

    def _staging(self) -> dict[torch.device, "_Staging"]:
        """Per device, the chunk buffers of this step: as large as a chunk, or the largest parameter with a
        gradient when all are smaller (a strided parameter goes through in one piece)."""
        sizes: dict[torch.device, int] = {}
        master: dict[torch.device, bool] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    n = min(p.numel(), self.chunk_elems) if p.is_contiguous() else p.numel()
                    sizes[p.device] = max(sizes.get(p.device, 0), n)
                    master[p.device] = master.get(p.device, False) or p.dtype != torch.float32
        return {d: _Staging(d, n, master[d], self.overlap) for d, n in sizes.items()}

    def _update(self, staging: dict[torch.device, "_Staging"] | None = None) -> None:
        """One AdamW step of every parameter with a gradient (resident state in place, offloaded state streamed
        through `staging`)."""
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
                    assert staging is not None
                    self._offloaded_step(p, st, staging[p.device], lr, b1, b2, eps, wd, t)
                    continue
                w = st.get("master", p)
                _adamw_(w, st["exp_avg"], st["exp_avg_sq"], p.grad.float(), lr, b1, b2, eps, wd, t)
                if w is not p:
                    p.copy_(w)

    def _offloaded_step(self, p: torch.Tensor, st: dict, stage: "_Staging", lr: float, b1: float, b2: float,
                        eps: float, wd: float, t: float) -> None:
        """The update of one parameter whose state lives in host memory: chunk by chunk through p's device (copies
        also on the CPU, where the same path runs in the tests)."""
        n = p.numel()
        host = {k: st[k].view(-1) for k in STATE_KEYS if k in st}
        if p.is_contiguous():
            flat, grad, chunk = p.view(-1), p.grad.reshape(-1), self.chunk_elems
        else:  # a strided parameter (none in this package's models): one chunk, in p's shape
            flat, grad, chunk = None, p.grad, n
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            shape = (b - a,) if flat is not None else p.shape
            s, bufs = stage.take()
            dev_views = {k: bufs[k][: b - a] for k in host}
            for k, d in dev_views.items():
                d.copy_(host[k][a:b], non_blocking=True)
            m, v = dev_views["exp_avg"].view(shape), dev_views["exp_avg_sq"].view(shape)
            if "master" in host:
                w = dev_views["master"].view(shape)
            else:  # fp32 parameter: its own master, updated in place
                w = flat[a:b] if flat is not None else p
            _adamw_(w, m, v, (grad[a:b] if flat is not None else grad).float(), lr, b1, b2, eps, wd, t)
            if "master" in host:
                (flat[a:b] if flat is not None else p).copy_(w)
            stage.copy_back(s, [(host[k][a:b], d) for k, d in dev_views.items()])

    def _cuda_devices(self) -> set[torch.device]:
        return {p.device for g in self.param_groups for p in g["params"] if p.device.type == "cuda"}

    def _record_copies(self) -> None:
        """An event after this step's copies back to host memory, per device (`_events`)."""
        self._events = {}
        for dev in self._cuda_devices():
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            self._events[dev] = ev

    def _after_last_copies(self) -> None:
        """A step on another stream than the last one reads the host state only after the last copies back."""
        for dev, ev in getattr(self, "_events", {}).items():
            torch.cuda.current_stream(dev).wait_event(ev)

    def _wait_for_copies(self) -> None:
        """Offloaded state is written back by asynchronous copies: the host waits for them before reading it."""
        for ev in getattr(self, "_events", {}).values():
            ev.synchronize()

    def __getstate__(self) -> dict:
        """For deepcopy / pickle: torch's keeps only defaults, state and groups; the offload switch is ours, and
        the host state must not be read while copies back are in flight."""
        self._wait_for_copies()
        return {**super().__getstate__(), "offload": self.offload, "chunk_elems": self.chunk_elems,
                "overlap": self.overlap}

    def __setstate__(self, state: dict) -> None:
        """Unpickling (the keys present), and torch's load_state_dict, which ends with a __setstate__ of the state
        and groups alone: the switches absent from `state` keep this optimizer's values (they used to fall back
        to the defaults, so a resumed --optimizer-offload run went resident: the whole state on the GPU)."""
        state = dict(state)
        self.offload = bool(state.pop("offload", getattr(self, "offload", False)))
        self.chunk_elems = int(state.pop("chunk_elems", getattr(self, "chunk_elems", DEFAULT_CHUNK)))
        self.overlap = bool(state.pop("overlap", getattr(self, "overlap", True)))
        super().__setstate__(state)

    def state_dict(self) -> dict:
        """torch's state dict, after the copies back of the last step. With offload its tensors are live views of
        the pinned state: save them before the next step."""
        self._wait_for_copies()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the moments and master weights stay fp32 (torch casts state to the parameter's dtype),
        on the parameter's device, or in (pinned) host memory when offloaded, whichever way they were saved.
        Registered load_state_dict pre-/post-hooks see the parameter groups only, not the state (none are used
        in this package)."""
        self._wait_for_copies()  # no copy of the old state may still be in flight into what gets replaced
        # torch's load_state_dict would first move every state tensor to its parameter's device, cast to its dtype:
        # all the optimizer state on the GPU at once, which an offloaded run has no room for. It gets the groups
        # only; the state is placed here, one tensor at a time.
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        offloaded = []
        for p, i in zip(params, ids):
            for k, v in state_dict["state"].get(i, {}).items():
                if not (torch.is_tensor(v) and v.is_floating_point()):
                    self.state[p][k] = v
                elif k == "step":
                    self.state[p][k] = v.to(device="cpu", dtype=torch.float32, copy=True)
                elif self.offload:
                    offloaded.append((p, k, v))
                else:
                    self.state[p][k] = v.to(device=p.device, dtype=torch.float32, copy=True)
        self._place_offloaded(offloaded)


class _Staging:
    """One step's chunk buffers on one device: two sets of fp32 (master,) exp_avg, exp_avg_sq, used in turn. On CUDA
    (with `overlap`) the copies back to host memory run on a side stream, after the chunk's update; the next copy
    in to the same set waits for them on the device (`take`), and `join` makes the current stream wait for all of
    them. Elsewhere (or without overlap) every copy is on the current stream, in order."""

    def __init__(self, dev: torch.device, elems: int, master: bool, overlap: bool) -> None:
        keys = STATE_KEYS if master else STATE_KEYS[:2]
        self.dev = dev
        self.sets = [{k: torch.empty(elems, dtype=torch.float32, device=dev) for k in keys} for _ in range(2)]
        self.side = torch.cuda.Stream(dev) if overlap and dev.type == "cuda" else None
        self.freed: list[Any] = [None, None]  # per set: an event after its last copies back (side stream)
        self.turn = 0

    def take(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The next set (its index and buffers); the current stream waits until its last copies back are done."""
        s, self.turn = self.turn, self.turn ^ 1
        if self.freed[s] is not None:
            torch.cuda.current_stream(self.dev).wait_event(self.freed[s])
        return s, self.sets[s]

    def copy_back(self, s: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (host, device) pair's device buffer of set `s` into the host tensor, after the work queued so
        far on the current stream (the chunk's update)."""
        if self.side is None:
            for h, d in pairs:
                h.copy_(d, non_blocking=True)
            return
        self.side.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(self.side):
            for h, d in pairs:
                h.copy_(d, non_blocking=True)
            self.freed[s] = self.side.record_event()

    def join(self) -> None:
        """The current stream waits for every copy back (before the buffers are freed and the step's event)."""
        if self.side is not None:
            torch.cuda.current_stream(self.dev).wait_stream(self.side)


def make_optimizer(params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                   weight_decay: float = 0.0, offload: bool = False) -> torch.optim.Optimizer:
    """torch's AdamW when every parameter is fp32 and the state stays with the parameters, else MasterAdamW (fp32
    state and master weights; in host memory with `offload`)."""
    params = list(params)
    if all(p.dtype == torch.float32 for p in params) and not offload:
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    return MasterAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, offload=offload)
