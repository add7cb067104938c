"""Attention under a block-diffusion mask predicate, for full-sequence forwards and the training layouts.

A `MaskLayout` describes a sequence made of `num_copies` copies of length `n` that share position ids:
copies 0..R-1 are noisy (masked) copies, copy R (the last) is the clean sequence x_0. The predicate

    allow(q, k) = k valid and ( q clean, k clean, bk <= bq            # block-causal over x_0
                              or q noisy, k clean, bk < bq             # a noisy block reads the clean past
                              or q noisy, k in q's copy, bk == bq )    # and itself, bidirectionally

covers the three layouts the package needs (REFERENCE §3):
  R = 0  plain block-causal full-sequence forward (prefill, SFT, evaluation without cache);
  R = 1  the block-proxy layout [x_t ; x_0] of LightningRL / BD3-LM / SDAR training;
  R > 1  trace replay: one noisy copy per denoising round, then x_0.
Keys at in-copy positions >= lengths[b] are padding and never attended.

A `PackedLayout` puts several such sequences ("segments", each with its own n, copies and length) back to
back in one row, the way the trainer packs its micro-batches (rl/logprobs.py): a query sees keys of its own
segment only, under the same predicate, and positions outside every segment are padding. Packing removes
the padding of short sequences to the longest one, and gives every full micro-batch one shape.

Two implementations of the same predicate:
  * CUDA: FlexAttention with a `mask_mod`; the block mask is built once per layout (`prepare`) and
    reused by every layer (for a PackedLayout the mask_mod reads per-token tables of segment, copy and
    block, so blocks that straddle no segment are skipped whole). The sequence runs padded to a multiple of 128 (`flex_length`) to bound the shapes
    torch.compile specializes on, and the mask_mod reads the geometry from a device tensor, so a new n of
    the same padded length reuses the compiled kernels (`block_mask`).
  * elsewhere (CPU, float64 tests): SDPA over query tiles, the boolean mask of each tile computed from
    the predicate, so memory stays O(tile x N), never a dense N x N mask for long sequences. A PackedLayout
    gathers its segments of one (n, copies) into a batch and runs that (cost: the segments' own attention,
    never the packed row's N x N).
Rows with no visible key (an empty padded row) produce zeros in both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._common import check_tensor

_TILE_ELEMS = 1 << 22  # mask elements per query tile in the reference path
_FLEX_BLOCK = 128  # FlexAttention's block: the CUDA path pads the sequence to a multiple of it
# compiles one run may make of flex_attention and of create_block_mask (one per batch rows x padded length),
# and of every function
_FLEX_RECOMPILES = {"recompile_limit": 128, "accumulated_recompile_limit": 1024}


@dataclass(frozen=True, eq=False)
class MaskLayout:
    """Geometry of a (multi-copy) block-diffusion sequence; see the module docstring.

    n: length of one copy; num_copies: R + 1 (the clean copy is last); block_size: B;
    lengths: [batch] int tensor of valid tokens per copy, or None when every position is valid.
    """

    n: int
    num_copies: int
    block_size: int
    lengths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.n <= 0 or self.num_copies <= 0 or self.block_size <= 0:
            raise ValueError(
                f"MaskLayout needs n, num_copies, block_size > 0, got {self.n}, {self.num_copies}, {self.block_size}"
            )
        if self.lengths is not None:
            check_tensor("MaskLayout.lengths", self.lengths, ndim=1, dtypes=(torch.int32, torch.int64))

    @property
    def total(self) -> int:
        return self.n * self.num_copies

    @classmethod
    def block_causal(cls, n: int, block_size: int, lengths: torch.Tensor | None = None) -> "MaskLayout":
        return cls(n, 1, block_size, lengths)

    @classmethod
    def block_proxy(cls, n: int, block_size: int, lengths: torch.Tensor | None = None) -> "MaskLayout":
        return cls(n, 2, block_size, lengths)

    def allow(self, b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The predicate on broadcastable index tensors; see `mask_predicate`."""
        return mask_predicate(self.n, self.block_size, self.num_copies - 1, self.lengths, b, q_idx, kv_idx)


def mask_predicate(n, block_size, clean, lengths: torch.Tensor | None, b: torch.Tensor, q_idx: torch.Tensor,
                   kv_idx: torch.Tensor) -> torch.Tensor:
    """The layout predicate (the one definition of the mask; see the module docstring) on broadcastable index
    tensors. The geometry n (copy length), block_size and clean (index of the clean copy, num_copies - 1) are
    Python ints or 0-dim integer tensors: `block_mask` passes tensors so that a compiled flex_attention, which
    guards on the values of Python ints its mask_mod closes over, does not recompile for every n."""
    cq, ck = q_idx // n, kv_idx // n
    pq, pk = q_idx - cq * n, kv_idx - ck * n
    bq, bk = pq // block_size, pk // block_size
    q_clean, k_clean = cq == clean, ck == clean
    allow = (q_clean & k_clean & (bk <= bq)) | (~q_clean & k_clean & (bk < bq)) | (~q_clean & (ck == cq) & (bk == bq))
    if lengths is not None:
        allow = allow & (pk < lengths[b])
    return allow


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Segments packed back to back in rows of `total` positions (see the module docstring).

    Segment s occupies positions [start[s], start[s] + copies[s] * n[s]) of row `row[s]` and is a MaskLayout
    sequence of its own: copies[s] copies of length n[s] (the last one clean), lengths[s] valid tokens per copy.
    The segment fields are [S] int64 tensors on the host; segments may not overlap or leave their row.
    """

    rows: int
    total: int
    block_size: int
    row: torch.Tensor
    start: torch.Tensor
    n: torch.Tensor
    copies: torch.Tensor
    lengths: torch.Tensor

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.total <= 0 or self.block_size <= 0:
            raise ValueError(f"PackedLayout needs rows, total, block_size > 0, got {self.rows}, {self.total}, "
                             f"{self.block_size}")
        fields = ("row", "start", "n", "copies", "lengths")
        for name in fields:
            t = check_tensor(f"PackedLayout.{name}", getattr(self, name), ndim=1, dtypes=(torch.int32, torch.int64))
            if t.device.type != "cpu":
                raise ValueError(f"PackedLayout.{name} must be on the host (the layout is planned there), got {t.device}")
            if t.shape != self.row.shape:
                raise ValueError(f"PackedLayout.{name} has {t.shape[0]} segments but row has {self.row.shape[0]}")
        row, start, end = self.row.long(), self.start.long(), self.start.long() + self.copies.long() * self.n.long()
        bad = ((self.n <= 0) | (self.copies <= 0) | (self.lengths < 0) | (self.lengths > self.n) | (row < 0)
               | (row >= self.rows) | (start < 0) | (end > self.total)).nonzero()
        if bad.numel():
            s = int(bad[0])
            raise ValueError(f"PackedLayout segment {s} (row {int(row[s])}, start {int(start[s])}, n {int(self.n[s])}, "
                             f"copies {int(self.copies[s])}, length {int(self.lengths[s])}) does not fit a "
                             f"[{self.rows}, {self.total}] layout (needs n, copies > 0 and 0 <= length <= n)")
        order = torch.argsort(row * (self.total + 1) + start)
        r, a, e = row[order], start[order], end[order]
        clash = ((r[1:] == r[:-1]) & (a[1:] < e[:-1])).nonzero()
        if clash.numel():
            i = int(clash[0])
            raise ValueError(f"PackedLayout segments {int(order[i])} and {int(order[i + 1])} overlap in row {int(r[i])}")

    @property
    def num_segments(self) -> int:
        return int(self.row.numel())

    def seg_tokens(self) -> torch.Tensor:
        """[S] positions each segment occupies (copies x n)."""
        return self.copies.long() * self.n.long()

    def token_tables(self, length: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """Per-position tables [4, rows, length] int32 (length >= total; default total), what the predicate reads:
        0: the query's segment (-2 at padding); 1: the key's segment (-1 at padding and at invalid keys);
        2: copy index within the segment (-1 for the clean copy); 3: block index within the copy."""
        length = self.total if length is None else length
        seg_len = self.seg_tokens()
        nseg = self.num_segments
        tok_seg = torch.repeat_interleave(torch.arange(nseg), seg_len)  # [T] segment of each packed token
        first = torch.repeat_interleave(torch.cumsum(seg_len, 0) - seg_len, seg_len)
        off = torch.arange(tok_seg.numel()) - first  # [T] offset within its segment
        n = self.n.long()[tok_seg]
        c, p = off // n, off % n
        flat = self.row.long()[tok_seg] * length + self.start.long()[tok_seg] + off
        tabs = torch.empty(4, self.rows * length, dtype=torch.int32)
        tabs[0].fill_(-2)
        tabs[1].fill_(-1)
        tabs[2].fill_(-1)
        tabs[3].fill_(0)
        tabs[0, flat] = tok_seg.int()
        tabs[1, flat] = torch.where(p < self.lengths.long()[tok_seg], tok_seg, -1).int()
        tabs[2, flat] = torch.where(c == self.copies.long()[tok_seg] - 1, -1, c).int()
        tabs[3, flat] = (p // self.block_size).int()
        return tabs.view(4, self.rows, length).to(device)

    def groups(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """The segments grouped by shape, for the reference path: (n, copies, flat positions [k, copies * n] into
        the [rows * total] positions, lengths [k]) per distinct (n, copies)."""
        out = []
        key = self.n.long() * (int(self.copies.max()) + 1 if self.num_segments else 1) + self.copies.long()
        for kv in torch.unique(key).tolist():
            idx = (key == kv).nonzero().squeeze(1)
            n, c = int(self.n[idx[0]]), int(self.copies[idx[0]])
            base = self.row.long()[idx] * self.total + self.start.long()[idx]  # [k]
            out.append((n, c, base[:, None] + torch.arange(c * n), self.lengths[idx]))
        return out


def packed_predicate(tabs: torch.Tensor, b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """The layout predicate of a PackedLayout through its `token_tables`: same segment, key valid, and the
    MaskLayout predicate on (copy, block) within the segment."""
    cq, ck = tabs[2, b, q_idx], tabs[2, b, kv_idx]
    bq, bk = tabs[3, b, q_idx], tabs[3, b, kv_idx]
    q_clean, k_clean = cq < 0, ck < 0
    within = (k_clean & ((q_clean & (bk <= bq)) | (~q_clean & (bk < bq)))) | (~q_clean & (cq == ck) & (bk == bq))
    return (tabs[0, b, q_idx] == tabs[1, b, kv_idx]) & within


def flex_length(total: int) -> int:
    """The length the CUDA path runs at: `total` rounded up to FlexAttention's 128-token block, so that a training
    run whose sequence lengths vary step to step compiles for a few lengths, not for every one."""
    return -(-total // _FLEX_BLOCK) * _FLEX_BLOCK


def prepare(layout: MaskLayout | PackedLayout, batch: int, device: torch.device):
    """Build what `masked_attention` reuses across layers: a FlexAttention BlockMask on CUDA; elsewhere the
    segment groups of a PackedLayout (`PackedLayout.groups`), or None."""
    device = torch.device(device)
    if device.type == "cuda":
        return block_mask(layout, batch, device)
    return SegmentGroups(layout.groups()) if isinstance(layout, PackedLayout) else None


@dataclass(frozen=True)
class SegmentGroups:
    """The reference path's plan of a PackedLayout: `PackedLayout.groups()`, computed once per forward."""

    groups: list


def block_mask(layout: MaskLayout | PackedLayout, batch: int, device: torch.device, compiled: bool | None = None):
    """The layout's FlexAttention BlockMask over `flex_length(layout.total)` positions (any device); the padding
    past `total` sees nothing and is seen by nothing.

    The geometry reaches the mask_mod as a device tensor, not as Python ints: dynamo guards on the value of an
    int a mask_mod closes over (the compiled flex_attention would recompile, forward and backward, for every
    decoded length n, and past the recompile limit fall back to the unfused path), but only on a tensor's
    metadata, so one compile serves every layout of the same (rows, padded length).
    `compiled` (default: on CUDA) builds the block mask with a compiled create_block_mask, without the dense
    [rows, padded, padded] boolean intermediate of the eager build."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = torch.device(device)
    if compiled is None:
        compiled = device.type == "cuda"
    build = _compiled_create_block_mask() if compiled else create_block_mask
    padded = flex_length(layout.total)
    if isinstance(layout, PackedLayout):
        if batch != layout.rows:
            raise ValueError(f"the batch has {batch} rows but the PackedLayout {layout.rows}")
        tabs = layout.token_tables(padded, device)  # [4, rows, padded]: padding sees and is seen by nothing

        def packed_mod(b, h, q_idx, kv_idx):
            return packed_predicate(tabs, b, q_idx, kv_idx)

        with _recompile_limits():
            return build(packed_mod, batch, None, padded, padded, device=device)
    lengths = layout.lengths.to(device) if layout.lengths is not None else None
    total = layout.total
    geo = torch.tensor([layout.n, layout.block_size, layout.num_copies - 1, total], dtype=torch.int32, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        allow = mask_predicate(geo[0], geo[1], geo[2], lengths, b, q_idx, kv_idx)
        return allow & (q_idx < geo[3]) & (kv_idx < geo[3])

    with _recompile_limits():
        return build(mask_mod, batch if lengths is not None else None, None, padded, padded, device=device)


def _recompile_limits():
    """dynamo's recompile limits raised (never lowered) to _FLEX_RECOMPILES, as a config patch."""
    import torch._dynamo

    cfg = torch._dynamo.config
    limits = {name: max(getattr(cfg, name), want) for name, want in _FLEX_RECOMPILES.items() if hasattr(cfg, name)}
    return cfg.patch(**limits)


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_masked_attention(flex, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan,
                          softmax_scale: float | None = None) -> torch.Tensor:
    """`flex` (flex_attention, compiled or not) at the padded length of `plan`: q/k/v are zero-padded along the
    sequence to flex_length(N) and the output is cut back to N (the padded rows see no key and give zeros).

    A compiled flex_attention specializes on every shape (batch rows, padded length) it meets; dynamo's default
    limit of 8 recompiles would make it fall back, silently, to the unfused path that materializes the scores
    (out of memory at training lengths), so the limit is raised for this call only."""
    n = q.shape[2]
    padded = plan.shape[-2] if plan is not None else flex_length(n)
    if padded != n:
        q, k, v = (F.pad(t, (0, 0, 0, padded - n)) for t in (q, k, v))
    with _recompile_limits():
        out = flex(q, k, v, block_mask=plan, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, :n]


def masked_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MaskLayout, softmax_scale: float | None = None
) -> torch.Tensor:
    """Query-tiled SDPA under the layout predicate. q [B, Hq, N, D], k/v [B, Hkv, N, D] -> [B, Hq, N, D]."""
    bsz, hq, n_tot, d = q.shape
    hkv = k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    tile = max(16, min(n_tot, _TILE_ELEMS // max(1, n_tot * bsz)))
    b_idx = torch.arange(bsz, device=q.device).view(bsz, 1, 1, 1)
    kv_idx = torch.arange(n_tot, device=q.device).view(1, 1, 1, n_tot)
    lay = layout if layout.lengths is None else MaskLayout(layout.n, layout.num_copies, layout.block_size, layout.lengths.to(q.device))
    outs = []
    for t0 in range(0, n_tot, tile):
        q_idx = torch.arange(t0, min(n_tot, t0 + tile), device=q.device).view(1, 1, -1, 1)
        allow = lay.allow(b_idx, q_idx, kv_idx)  # [B, 1, T, N]
        o = F.scaled_dot_product_attention(q[:, :, t0 : t0 + tile], k, v, attn_mask=allow, scale=softmax_scale)
        outs.append(torch.where(allow.any(-1, keepdim=True), o, torch.zeros((), dtype=o.dtype, device=o.device)))
    return torch.cat(outs, dim=2)


def packed_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                               groups: SegmentGroups | None = None, softmax_scale: float | None = None) -> torch.Tensor:
    """The reference path of a PackedLayout: the segments of each (n, copies) gathered into one batch and run
    through `masked_attention_reference`, the outputs put back; padding positions give zeros.
    q [R, Hq, P, D], k/v [R, Hkv, P, D] -> [R, Hq, P, D]."""
    rows, hq, total, d = q.shape
    groups = groups if groups is not None else SegmentGroups(layout.groups())
    flat = [t.transpose(1, 2).reshape(rows * total, t.shape[1], d) for t in (q, k, v)]  # [R * P, H, D]
    out = q.new_zeros(rows * total, hq, d)
    for n, copies, idx, lengths in groups.groups:
        idx = idx.to(q.device)
        qg, kg, vg = (t[idx].transpose(1, 2) for t in flat)  # [k, H, copies * n, D]
        o = masked_attention_reference(qg, kg, vg, MaskLayout(n, copies, layout.block_size, lengths), softmax_scale)
        out = out.index_copy(0, idx.reshape(-1), o.transpose(1, 2).reshape(-1, hq, d))
    return out.view(rows, total, hq, d).transpose(1, 2)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: MaskLayout | PackedLayout,
    plan=None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of q [B, Hq, N, D] over k, v [B, Hkv, N, D] under `layout` (N = layout.total; B = layout.rows for
    a PackedLayout).

    `plan` is `prepare(layout, B, device)`, built once per forward and shared by the layers.
    Differentiable (training uses it). Returns [B, Hq, N, D] in q's dtype.
    """
    check_tensor("q", q, ndim=4)
    check_tensor("k", k, ndim=4, shape=(q.shape[0], None, q.shape[2], q.shape[3]), device=q.device)
    check_tensor("v", v, shape=tuple(k.shape), device=q.device)
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if q.shape[2] != layout.total:
        what = f"{layout.total} packed positions" if isinstance(layout, PackedLayout) else f"{layout.num_copies} x {layout.n}"
        raise ValueError(f"sequence length {q.shape[2]} does not match the layout ({what})")
    packed = isinstance(layout, PackedLayout)
    if packed and layout.rows != q.shape[0]:
        raise ValueError(f"the PackedLayout has {layout.rows} rows but the batch is {q.shape[0]}")
    if not packed and layout.lengths is not None and layout.lengths.shape[0] != q.shape[0]:
        raise ValueError(f"layout.lengths has {layout.lengths.shape[0]} rows but the batch is {q.shape[0]}")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        if plan is None:
            plan = prepare(layout, q.shape[0], q.device)
        return flex_masked_attention(_compiled_flex(), q, k, v, plan, softmax_scale)
    if packed:
        return packed_attention_reference(q, k, v, layout, plan if isinstance(plan, SegmentGroups) else None,
                                          softmax_scale)
    return masked_attention_reference(q, k, v, layout, softmax_scale)
