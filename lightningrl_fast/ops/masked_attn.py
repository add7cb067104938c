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

A `PackedLayout` puts several such sequences ("segments") back to back in one row, the way the trainer packs
its micro-batches (rl/logprobs.py). It is given position by position (segment, copy, block, key valid), so a
segment may be any subset of whole blocks of its copies: the trainer keeps only the noisy blocks that hold
targets and the clean blocks before the last of them. A query sees keys of its own segment only, under the same
predicate on (copy, block), and positions outside every segment are padding. Packing removes the padding of
short sequences to the longest one, and gives every full micro-batch one shape.

Two implementations of the same predicate:
  * CUDA: FlexAttention with a `mask_mod`; the block mask is built once per layout (`prepare`) and
    reused by every layer (for a PackedLayout the mask_mod reads the per-position tables, and query/key block
    pairs of different segments are skipped whole). The sequence runs padded to a multiple of 128
    (`flex_length`) to bound the shapes torch.compile specializes on, and the mask_mod reads the geometry from
    device tensors, so a new n (or new segments) of the same padded length reuses the compiled kernels.
  * elsewhere (CPU, float64 tests): SDPA over query tiles, the boolean mask of each tile computed from
    the predicate, so memory stays O(tile x N), never a dense N x N mask for long sequences. A PackedLayout
    gathers its segments of similar length into a batch and runs that (cost: the segments' own attention,
    never the packed row's N x N).
Rows with no visible key (an empty padded row) produce zeros in both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._common import FLOAT_DTYPES, check_float, check_int, check_tensor, upload

_TILE_ELEMS = 1 << 22  # mask elements per query tile in the reference path
_FLEX_BLOCK = 128  # FlexAttention's block: the CUDA path pads the sequence to a multiple of it
# compiles one run may make of flex_attention and of create_block_mask (one per batch rows x padded length),
# and of every function
_FLEX_RECOMPILES = {"recompile_limit": 128, "accumulated_recompile_limit": 1024}
_INT32_MAX = torch.iinfo(torch.int32).max  # the token tables (PackedLayout.token_tables) are int32


@dataclass(frozen=True, eq=False)
class MaskLayout:
    """Geometry of a (multi-copy) block-diffusion sequence; see the module docstring.

    n: length of one copy; num_copies: R + 1 (the clean copy is last); block_size: B;
    lengths: [batch] int tensor of valid tokens per copy (0..n; checked when on the host), or None when every
    position is valid.
    """

    n: int
    num_copies: int
    block_size: int
    lengths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("n", "num_copies", "block_size"):
            check_int(f"MaskLayout.{name}", getattr(self, name))
        if self.n <= 0 or self.num_copies <= 0 or self.block_size <= 0:
            raise ValueError(
                f"MaskLayout needs n, num_copies, block_size > 0, got {self.n}, {self.num_copies}, {self.block_size}"
            )
        for name in ("n", "num_copies", "block_size"):  # a numpy or 0-d tensor integer as a Python int
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.lengths is not None:
            check_tensor("MaskLayout.lengths", self.lengths, ndim=1, dtypes=(torch.int32, torch.int64))
            # host lengths only (planned there): a device tensor would cost a sync per layout
            if self.lengths.device.type == "cpu" and self.lengths.numel() and not torch.compiler.is_compiling():
                lo, hi = int(self.lengths.min()), int(self.lengths.max())
                if lo < 0 or hi > self.n:
                    raise ValueError(f"MaskLayout.lengths must lie in [0, n = {self.n}] (valid tokens per copy), got "
                                     f"{lo}..{hi}")

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
    """Sequences ("segments") packed back to back in rows of `total` positions (see the module docstring),
    described position by position, so a segment may leave out pieces nothing needs (the trainer drops the
    noisy blocks that hold no target: nothing else attends to a noisy block).

    seg [rows, total] int: segment id (>= 0; each id one contiguous run of one row), -1 at padding;
    copy [rows, total] int: -1 for a position of the clean copy, r >= 0 for noisy copy r;
    block [rows, total] int: the position's block (of block_size positions) within its copy;
    key_ok [rows, total] bool: the position may be attended (inside its sequence's valid length).
    All on the host. allow(q, k) = seg[q] == seg[k] >= 0, key_ok[k], and the MaskLayout predicate on
    (copy, block): both clean and bk <= bq, q noisy and k clean and bk < bq, q noisy and k the same noisy copy
    and bk == bq. `from_segments` builds the rectangular case: whole MaskLayout sequences back to back.
    """

    block_size: int
    seg: torch.Tensor
    copy: torch.Tensor
    block: torch.Tensor
    key_ok: torch.Tensor

    def __post_init__(self) -> None:
        if check_int("PackedLayout.block_size", self.block_size) <= 0:
            raise ValueError(f"PackedLayout needs block_size > 0, got {self.block_size}")
        object.__setattr__(self, "block_size", int(self.block_size))
        check_tensor("PackedLayout.seg", self.seg, ndim=2, dtypes=(torch.int32, torch.int64))
        shape = tuple(self.seg.shape)
        if shape[0] == 0 or shape[1] == 0:
            raise ValueError(f"PackedLayout needs rows and positions, got seg of shape {list(shape)}")
        for name in ("copy", "block"):
            check_tensor(f"PackedLayout.{name}", getattr(self, name), shape=shape, dtypes=(torch.int32, torch.int64))
        check_tensor("PackedLayout.key_ok", self.key_ok, shape=shape, dtypes=(torch.bool,))
        for name in ("seg", "copy", "block", "key_ok"):
            if getattr(self, name).device.type != "cpu":
                raise ValueError(f"PackedLayout.{name} must be on the host (the layout is planned there), got "
                                 f"{getattr(self, name).device}")
        if bool((self.copy < -1).any()) or bool((self.block < 0).any()) or bool((self.seg < -1).any()):
            raise ValueError("PackedLayout needs seg >= -1, copy >= -1 and block >= 0 everywhere")
        for name in ("copy", "block"):  # the predicate reads int32 tables: a larger value would wrap silently
            top = int(getattr(self, name).max())
            if top > _INT32_MAX:
                raise ValueError(f"PackedLayout.{name} values must be <= {_INT32_MAX} (int32 tables), got {top}")
        if int(self.seg.max()) >= self.seg.numel():
            raise ValueError(f"PackedLayout segment ids must be < the number of positions ({self.seg.numel()}), got "
                             f"{int(self.seg.max())}")
        row, start, end = self.spans()
        count = torch.bincount(self.seg[self.seg >= 0].long(), minlength=row.numel())
        split = (((end - start) != count) | (row != (end - 1) // self.total)) & (count > 0)
        if bool(split.any()):
            s = int(split.nonzero()[0])
            raise ValueError(f"PackedLayout segment {s} is not one contiguous run of one row ({int(count[s])} positions "
                             f"spread over flat positions {int(start[s])}..{int(end[s]) - 1})")

    @property
    def rows(self) -> int:
        return self.seg.shape[0]

    @property
    def total(self) -> int:
        return self.seg.shape[1]

    @property
    def num_segments(self) -> int:
        return int(torch.unique(self.seg[self.seg >= 0]).numel())

    @property
    def used(self) -> int:
        """Positions inside segments."""
        return int((self.seg >= 0).sum())

    def spans(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row [S], start [S], end [S]) of each segment id 0..S-1 as flat positions row * total + col (start =
        end = 0 for an unused id)."""
        inside = self.seg >= 0
        ids = self.seg[inside].long()
        nseg = int(ids.max()) + 1 if ids.numel() else 0
        flat = torch.arange(self.rows * self.total).view(self.rows, self.total)[inside]
        big = self.rows * self.total
        start = torch.full((nseg,), big, dtype=torch.int64).scatter_reduce(0, ids, flat, "amin")
        end = torch.zeros(nseg, dtype=torch.int64).scatter_reduce(0, ids, flat + 1, "amax")
        start = torch.where(end > 0, start, 0)
        return start // self.total, start, end

    @classmethod
    def from_segments(cls, rows: int, total: int, block_size: int, row, start, n, copies, lengths) -> "PackedLayout":
        """Whole MaskLayout sequences back to back: segment s at [start[s], start[s] + copies[s] * n[s]) of row
        row[s], copies[s] copies of length n[s] (the last one clean), lengths[s] valid positions per copy."""
        rows, total = check_int("rows", rows, lo=1), check_int("total", total, lo=1)
        block_size = check_int("block_size", block_size, lo=1)
        named = dict(row=row, start=start, n=n, copies=copies, lengths=lengths)
        for name, x in named.items():
            x = torch.as_tensor(x)
            if x.dim() != 1 or (x.numel() and (x.dtype == torch.bool or x.is_floating_point() or x.is_complex())):
                raise ValueError(f"PackedLayout.from_segments: {name} must be a 1-D sequence of integers (one per "
                                 f"segment), got {x.dtype} of shape {list(x.shape)}")
            named[name] = x.long().cpu()
        sizes = {name: x.numel() for name, x in named.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"PackedLayout.from_segments needs one row, start, n, copies and length per segment, got "
                             f"{sizes}")
        row, start, n, copies, lengths = named.values()
        end = start + copies * n
        bad = ((n <= 0) | (copies <= 0) | (lengths < 0) | (lengths > n) | (row < 0) | (row >= rows) | (start < 0)
               | (end > total)).nonzero()
        if bad.numel():
            s = int(bad[0])
            raise ValueError(f"PackedLayout segment {s} (row {int(row[s])}, start {int(start[s])}, n {int(n[s])}, "
                             f"copies {int(copies[s])}, length {int(lengths[s])}) does not fit a [{rows}, {total}] "
                             f"layout (needs n, copies > 0 and 0 <= length <= n)")
        order = torch.argsort(row * (total + 1) + start)
        r, a, e = row[order], start[order], end[order]
        clash = ((r[1:] == r[:-1]) & (a[1:] < e[:-1])).nonzero()
        if clash.numel():
            i = int(clash[0])
            raise ValueError(f"PackedLayout segments {int(order[i])} and {int(order[i + 1])} overlap in row {int(r[i])}")
        seg_len = copies * n
        tok_seg = torch.repeat_interleave(torch.arange(seg_len.numel()), seg_len)  # [T] segment of each position
        off = torch.arange(tok_seg.numel()) - torch.repeat_interleave(torch.cumsum(seg_len, 0) - seg_len, seg_len)
        c, p = off // n[tok_seg], off % n[tok_seg]
        flat = row[tok_seg] * total + start[tok_seg] + off
        seg = torch.full((rows * total,), -1, dtype=torch.int32)
        cpy = torch.full((rows * total,), -1, dtype=torch.int32)
        blk = torch.zeros(rows * total, dtype=torch.int32)
        ok = torch.zeros(rows * total, dtype=torch.bool)
        seg[flat] = tok_seg.int()
        cpy[flat] = torch.where(c == copies[tok_seg] - 1, -1, c).int()
        blk[flat] = (p // block_size).int()
        ok[flat] = p < lengths[tok_seg]
        return cls(block_size, *(t.view(rows, total) for t in (seg, cpy, blk, ok)))

    def token_tables(self, length: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """What the predicate reads, [4, rows, length] int32 (length >= total; default total): 0: the query's
        segment (-2 at padding); 1: the key's segment (-1 at padding and where key_ok is False); 2: copy (-1 clean);
        3: block."""
        length = self.total if length is None else length
        tabs = torch.zeros(4, self.rows, length, dtype=torch.int32)
        tabs[0].fill_(-2)
        tabs[1].fill_(-1)
        inside = self.seg >= 0
        t = self.total
        tabs[0, :, :t] = torch.where(inside, self.seg, -2)
        tabs[1, :, :t] = torch.where(inside & self.key_ok, self.seg, -1)
        tabs[2, :, :t] = self.copy
        tabs[3, :, :t] = self.block
        return upload(tabs, device)

    def groups(self, min_bucket: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The segments grouped by length, for the reference path: per group (flat positions [k, L] into the
        [rows * total] positions, clamped; in-segment [k, L] bool), L the segments' length rounded up to 3
        significant bits (at least `min_bucket`), so a group pads its segments by at most ~25%."""
        _, start, end = self.spans()
        lens = end - start
        used = (lens > 0).nonzero().squeeze(1)
        if used.numel() == 0:
            return []
        bucket = torch.tensor([round_3_bits(max(int(x), min_bucket)) for x in lens[used].tolist()])
        out = []
        for length in torch.unique(bucket).tolist():
            sel = used[bucket == length]
            pos = start[sel, None] + torch.arange(length)  # [k, L]
            inside = pos < end[sel, None]
            out.append((torch.where(inside, pos, start[sel, None]), inside))
        return out


def round_3_bits(m: int) -> int:
    """m (> 0) rounded up to 3 significant bits (4 values per octave: 8, 10, 12, 14, 16, 20, ...)."""
    if m > 4:
        step = 1 << (m.bit_length() - 3)
        m = -(-m // step) * step
    return m


def _within(cq: torch.Tensor, ck: torch.Tensor, bq: torch.Tensor, bk: torch.Tensor) -> torch.Tensor:
    """The predicate inside one segment, on (copy, block) of query and key (copy -1 = clean)."""
    q_clean, k_clean = cq < 0, ck < 0
    return (k_clean & ((q_clean & (bk <= bq)) | (~q_clean & (bk < bq)))) | (~q_clean & (cq == ck) & (bk == bq))


def packed_predicate(tabs: torch.Tensor, b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """The layout predicate of a PackedLayout through its `token_tables`: same segment, key valid, and the
    MaskLayout predicate on (copy, block) within the segment."""
    within = _within(tabs[2, b, q_idx], tabs[2, b, kv_idx], tabs[3, b, q_idx], tabs[3, b, kv_idx])
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
    return SegmentGroups.of(layout) if isinstance(layout, PackedLayout) else None


@dataclass(frozen=True)
class SegmentGroups:
    """The reference path's plan of a PackedLayout, computed once per forward: `PackedLayout.groups()` and the
    token tables flattened to [4, rows * total]."""

    groups: list
    tabs: torch.Tensor

    @classmethod
    def of(cls, layout: "PackedLayout") -> "SegmentGroups":
        return cls(layout.groups(), layout.token_tables().view(4, layout.rows * layout.total))


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
    # both uploaded without blocking the host (a plain host-to-GPU copy waits for the queued work first)
    lengths = upload(layout.lengths, device) if layout.lengths is not None else None
    total = layout.total
    geo = upload(torch.tensor([layout.n, layout.block_size, layout.num_copies - 1, total], dtype=torch.int32), device)

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
    """The reference path of a PackedLayout: the segments of each length bucket (`PackedLayout.groups`) gathered
    into one batch, SDPA over query tiles under the predicate computed from the token tables, the outputs put
    back in one scatter; padding positions give zeros. q [R, Hq, P, D], k/v [R, Hkv, P, D] -> [R, Hq, P, D]."""
    rows, hq, total, d = q.shape
    hkv = k.shape[1]
    groups = groups if groups is not None else SegmentGroups.of(layout)
    qf, kf, vf = (t.transpose(1, 2).reshape(rows * total, t.shape[1], d) for t in (q, k, v))  # [R * P, H, D]
    tabs = groups.tabs.to(q.device)
    where, vals = [], []
    for pos, inside in groups.groups:
        pos, inside = pos.to(q.device), inside.to(q.device)
        nseg, length = pos.shape
        qs = torch.where(inside, tabs[0, pos], -2)  # [k, L] padding slots see and are seen by nothing
        ks = torch.where(inside, tabs[1, pos], -1)
        cp, bl = tabs[2, pos], tabs[3, pos]
        qg = qf[pos].transpose(1, 2)  # [k, Hq, L, D]
        kg, vg = (t[pos].transpose(1, 2).repeat_interleave(hq // hkv, dim=1) for t in (kf, vf))  # [k, Hq, L, D]
        tile = max(16, min(length, _TILE_ELEMS // max(1, nseg * length)))
        outs = []
        for t0 in range(0, length, tile):
            sl = slice(t0, t0 + tile)
            allow = (qs[:, sl, None] == ks[:, None, :]) & _within(cp[:, sl, None], cp[:, None, :], bl[:, sl, None],
                                                                   bl[:, None, :])  # [k, T, L]
            o = F.scaled_dot_product_attention(qg[:, :, sl], kg, vg, attn_mask=allow[:, None], scale=softmax_scale)
            outs.append(torch.where(allow.any(-1)[:, None, :, None], o, torch.zeros((), dtype=o.dtype, device=o.device)))
        o = torch.cat(outs, dim=2).transpose(1, 2).reshape(nseg * length, hq, d)  # [k * L, Hq, D]
        keep = inside.reshape(-1)
        where.append(pos.reshape(-1)[keep])
        vals.append(o[keep])
    out = q.new_zeros(rows * total, hq, d)
    if where:
        out = out.index_copy(0, torch.cat(where), torch.cat(vals))
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
    q, k, v share one float dtype and device; Hq a multiple of Hkv >= 1. Differentiable (training uses it).
    Returns [B, Hq, N, D] in q's dtype.
    """
    if not isinstance(layout, (MaskLayout, PackedLayout)):
        raise TypeError(f"layout must be a MaskLayout or a PackedLayout, got {type(layout).__name__}")
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=4, shape=(q.shape[0], None, q.shape[2], q.shape[3]), device=q.device)
    check_tensor("v", v, shape=tuple(k.shape), device=q.device)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')} but q has "
                            f"{str(q.dtype).replace('torch.', '')} (q, k and v need one dtype)")
    if softmax_scale is not None:
        check_float("softmax_scale", softmax_scale)
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]}), which must be >= 1")
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
