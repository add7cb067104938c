"""[log-probs] Per-token log-probs of sampled responses under the block-diffusion training layouts.

Two layouts (REFERENCE §3), both one forward over copies of each sequence that share position ids:
  * "block_proxy" (LightningRL, BD3-LM, SDAR training): [x_t ; x_0] where x_t masks every response token.
    A response token's log-prob is read at its x_t position: "how likely is this token when its whole
    block is still masked". Cheap (2 copies), an approximation of the sampled trajectory.
  * "trace" (TraceRL / DiRL; exact): replays the sampled trajectory by rounds. Within a block the steps
    that unmasked tokens are consecutive (every active step unmasks >= 1 token of the current block), so a
    token's round is step - first_step(its block). Copy r masks every token whose round >= r (the state
    right before round r) and its targets are the tokens of round r. R = max rounds <= block size copies,
    then x_0. The log-probs equal what the sampler recorded (train/rollout consistency; tested).
Token ids come straight from the rollout (never re-tokenized). Keys past a row's decoded length are
padding and never attended. The mask token is excluded from the softmax, as the sampler excludes it.

A frozen reference kept in host memory (`host_copy`, RLConfig.reference_offload) is evaluated layer-major by
`streamed_logprobs`: each decoder layer's weights cross to the GPU once per chunk of micro-batches and run on
all of them, so the GPU holds one layer of the reference instead of all of it (SDAR-8B: 15.3 GiB saved per
GPU, for ~16 GB of host-to-device copies per chunk).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch

from ..model import SDARForCausalLM, rope_cos_sin
from ..ops.grpo_loss import linear_logprobs
from ..ops.masked_attn import MaskLayout, prepare

MODES = ("block_proxy", "trace")


@dataclass
class LayoutBatch:
    """One training forward: inputs of several copies plus where each target token is read."""

    input_ids: torch.Tensor  # [N, copies * n] int64
    position_ids: torch.Tensor  # [N, copies * n] int64
    layout: MaskLayout
    tgt_row: torch.Tensor  # [T] int64 row of each target token
    tgt_col: torch.Tensor  # [T] int64 column (in the copies) where its logits are read
    targets: torch.Tensor  # [T] int64 token ids
    resp_pos: torch.Tensor  # [T] int64 index of the token within its response

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    def to(self, device: torch.device | str) -> "LayoutBatch":
        """The same batch with its tensors on `device` (the layout's lengths stay: `prepare` moves them)."""
        return LayoutBatch(self.input_ids.to(device), self.position_ids.to(device), self.layout,
                           self.tgt_row.to(device), self.tgt_col.to(device), self.targets.to(device),
                           self.resp_pos.to(device))

    def rows(self, r0: int, r1: int) -> "LayoutBatch":
        """The sub-batch of rows [r0, r1) (micro-batching)."""
        sel = (self.tgt_row >= r0) & (self.tgt_row < r1)
        lens = self.layout.lengths[r0:r1] if self.layout.lengths is not None else None
        lay = MaskLayout(self.layout.n, self.layout.num_copies, self.layout.block_size, lens)
        return LayoutBatch(self.input_ids[r0:r1], self.position_ids[r0:r1], lay, self.tgt_row[sel] - r0,
                           self.tgt_col[sel], self.targets[sel], self.resp_pos[sel])


def build_layout_batch(sequences: torch.Tensor, step_map: torch.Tensor, prompt_lens: torch.Tensor,
                       resp_lens: torch.Tensor, block_size: int, mask_id: int, mode: str = "block_proxy") -> LayoutBatch:
    """Build the training forward for decoded rows.

    sequences [N, L] int64 decoded tokens (prompt + blocks); step_map [N, L] int32 over the same positions
    (-1 prompt, >= 0 the step that unmasked it, -2 never decoded); prompt_lens, resp_lens [N] (the response
    tokens to score: up to and including the first EOS).
    """
    if mode not in MODES:
        raise ValueError(f"logprob mode must be one of {MODES}, got {mode!r}")
    nrows, length = sequences.shape
    if step_map.shape != sequences.shape:
        raise ValueError(f"step_map shape {tuple(step_map.shape)} != sequences shape {tuple(sequences.shape)}")
    dev = sequences.device
    bs = block_size
    decoded = step_map != -2
    valid = decoded.sum(1)  # [N] decoded length (whole blocks)
    n = int(valid.max())
    n = -(-n // bs) * bs
    x0 = sequences[:, :n]
    smap = step_map[:, :n].long()
    pos = torch.arange(n, device=dev)
    is_resp = (pos[None] >= prompt_lens[:, None]) & (pos[None] < valid[:, None])  # [N, n] all generated positions
    is_tgt = (pos[None] >= prompt_lens[:, None]) & (pos[None] < (prompt_lens + resp_lens)[:, None])  # [N, n]
    if mode == "block_proxy":
        xt = torch.where(is_resp, mask_id, x0)
        copies = [xt]
        tgt_copy = torch.zeros_like(smap)
    else:
        nblk = n // bs
        blk = (pos // bs).expand(nrows, n)
        big = torch.iinfo(torch.int64).max
        first = torch.full((nrows, nblk), big, device=dev).scatter_reduce(
            1, blk, torch.where(is_resp, smap, big), reduce="amin")  # [N, nblk] first step of each block
        rnd = torch.where(is_resp, smap - first.gather(1, blk), -1)  # [N, n] round of each token
        rounds = int(rnd.max()) + 1 if bool(is_resp.any()) else 1
        copies = [torch.where(is_resp & (rnd >= r), mask_id, x0) for r in range(rounds)]
        tgt_copy = rnd.clamp_min(0)
    ncopies = len(copies) + 1
    input_ids = torch.cat(copies + [x0], dim=1)  # [N, ncopies * n]
    position_ids = pos.repeat(ncopies).expand(nrows, -1)
    tgt_row, tgt_p = is_tgt.nonzero(as_tuple=True)
    tgt_col = tgt_copy[tgt_row, tgt_p] * n + tgt_p
    layout = MaskLayout(n, ncopies, bs, valid.clamp_min(1))
    return LayoutBatch(input_ids, position_ids, layout, tgt_row, tgt_col, x0[tgt_row, tgt_p], tgt_p - prompt_lens[tgt_row])


def batch_logprobs(model: SDARForCausalLM, lb: LayoutBatch, chunk: int = 4096) -> torch.Tensor:
    """Per-target log-probs [T] (differentiable when grad is enabled) of a LayoutBatch under `model`."""
    hidden = model.hidden(lb.input_ids, lb.position_ids, lb.layout)  # [N, copies*n, H]
    h = hidden[lb.tgt_row, lb.tgt_col]  # [T, H]
    return linear_logprobs(h, model.lm_head.weight, lb.targets, chunk=chunk, suppress_token=model.config.mask_token_id)


def host_copy(model: SDARForCausalLM, pin: bool | None = None) -> SDARForCausalLM:
    """A frozen copy of `model` in host memory, made one tensor at a time (never a second full copy on the GPU);
    pinned (page-locked, for fast copies to the GPU) by default when CUDA is available."""
    pin = torch.cuda.is_available() if pin is None else pin
    with torch.device("meta"):
        ref = SDARForCausalLM(model.config)
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        t = v.detach().to("cpu", copy=True)
        sd[k] = t.pin_memory() if pin else t
    ref.load_state_dict(sd, assign=True, strict=not model.config.tie_word_embeddings)
    if model.config.tie_word_embeddings:
        ref.lm_head.weight = ref.model.embed_tokens.weight
    return ref.eval().requires_grad_(False)


@torch.no_grad()
def streamed_logprobs(model: SDARForCausalLM, lb: LayoutBatch, ranges: Sequence[tuple[int, int]],
                      device: torch.device, chunk_tokens: int) -> torch.Tensor:
    """Per-target log-probs [T] (float32, CPU) of a host-resident `model`, computed on `device` layer by layer.

    `ranges`: the micro-batches (row ranges of lb). They are taken in chunks of at most `chunk_tokens` tokens
    (their hidden states stay on the device meanwhile, chunk_tokens x hidden x 2 bytes in bf16); per chunk,
    each decoder layer is copied into one device-resident layer and applied to every micro-batch of the chunk,
    then the final norm and the LM head (copied once per call). Equals the per-micro-batch forward of the
    same weights on the device (tested)."""
    cfg = model.config
    out = torch.empty(lb.num_tokens)
    layers = list(model.model.layers)
    work = copy.deepcopy(layers[0]).to(device)  # one layer's memory on the device, refilled layer after layer
    norm = copy.deepcopy(model.model.norm).to(device)
    head = model.lm_head.weight.to(device, non_blocking=True)
    per_row = lb.input_ids.shape[1]
    chunks: list[list[tuple[int, int]]] = [[]]
    for r in ranges:
        if chunks[-1] and (sum(b - a for a, b in chunks[-1]) + r[1] - r[0]) * per_row > chunk_tokens:
            chunks.append([])
        chunks[-1].append(r)
    for chunk in chunks:
        host_subs = [lb.rows(r0, r1) for r0, r1 in chunk]
        subs = [sub.to(device) for sub in host_subs]
        xs, ropes, plans = [], [], []
        for host_sub, sub in zip(host_subs, subs):
            x = model.model.embed_tokens(host_sub.input_ids.cpu())  # [rows, N, H] on the host (.cpu(): a no-op there)
            if device.type == "cuda":
                x = x.pin_memory()  # page-locked: the upload below is an async DMA, not a staged synchronous copy
            x = x.to(device, non_blocking=True)
            xs.append(x)
            ropes.append(rope_cos_sin(sub.position_ids, cfg.head_dim, cfg.rope_theta, x.dtype))
            plans.append(prepare(sub.layout, sub.input_ids.shape[0], device))
        for layer in layers:
            for dst, src in zip(work.parameters(), layer.parameters()):
                dst.copy_(src, non_blocking=True)
            for k, sub in enumerate(subs):
                xs[k] = work(xs[k], *ropes[k], sub.layout, plans[k])
        for (r0, r1), sub, x in zip(chunk, subs, xs):
            sel = ((lb.tgt_row >= r0) & (lb.tgt_row < r1)).nonzero().squeeze(1)
            h = norm(x)[sub.tgt_row, sub.tgt_col]  # [t, H]
            out[sel] = linear_logprobs(h, head, sub.targets, chunk=4096, suppress_token=cfg.mask_token_id).float().cpu()
    return out
