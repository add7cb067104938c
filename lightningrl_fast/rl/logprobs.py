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
all of them, so the GPU holds two layers of the reference instead of all of it (SDAR-8B: 15.3 GiB saved per
GPU, for ~16 GB of host-to-device copies per chunk); on CUDA the next layer's copy runs on a side stream while
the current one computes (`_LayerFeed`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from ..model import SDARForCausalLM, rope_cos_sin
from ..ops._common import check_int, check_tensor, upload
from ..ops.grpo_loss import linear_logprobs
from ..ops.masked_attn import MaskLayout, PackedLayout, prepare, round_3_bits

MODES = ("block_proxy", "trace")
_INT_DTYPES = (torch.int32, torch.int64)


@dataclass
class LayoutBatch:
    """One training forward: several copies of each sequence plus where each target token is read.

    Stored compactly (the copies differ only in which response tokens are masked): the clean tokens x0 and, per
    position, its round `rnd`; noisy copy r holds the mask token wherever rnd >= r, x0 elsewhere, and the last
    copy is x0. So a trace-mode batch of R rounds costs N x n x 10 bytes on the host, not N x (R + 1) x n x 8;
    `input_ids` / `inputs(rows)` build the copies for the padded forward."""

    x0: torch.Tensor  # [N, n] int64 clean tokens (whole blocks)
    rnd: torch.Tensor  # [N, n] int16 round of a response position (block proxy: 0), -1 elsewhere
    mask_id: int
    layout: MaskLayout  # n, num_copies (rounds + 1), block size, valid lengths
    tgt_row: torch.Tensor  # [T] int64 row of each target token
    tgt_col: torch.Tensor  # [T] int64 column (in the copies) where its logits are read
    targets: torch.Tensor  # [T] int64 token ids
    resp_pos: torch.Tensor  # [T] int64 index of the token within its response
    # what check_layout_batch last passed (its fields with their in-place versions); not an input
    _checked: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def num_rows(self) -> int:
        return int(self.x0.shape[0])

    def tokens(self, rows: torch.Tensor, copy: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token ids at (row, copy, position in the copy), broadcast together: the mask token where the noisy copy
        masks the position, the clean token otherwise."""
        noisy = copy < self.layout.num_copies - 1
        return torch.where(noisy & (self.rnd[rows, pos] >= copy), self.mask_id, self.x0[rows, pos])

    def inputs(self, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, position_ids) [r, copies * n] int64 of the padded forward over rows `rows` (all copies
        materialized: r x copies x n x 8 bytes each)."""
        n, ncopies = self.layout.n, self.layout.num_copies
        x0, rnd = self.x0[rows], self.rnd[rows]
        copies = [torch.where(rnd >= r, self.mask_id, x0) for r in range(ncopies - 1)]
        pos = torch.arange(n, device=x0.device)
        return torch.cat(copies + [x0], dim=1), pos.repeat(ncopies).expand(x0.shape[0], -1)

    @property
    def input_ids(self) -> torch.Tensor:
        """[N, copies * n] every row's copies (built on each access)."""
        return self.inputs()[0]

    @property
    def position_ids(self) -> torch.Tensor:
        """[N, copies * n] (an expanded view)."""
        n, ncopies = self.layout.n, self.layout.num_copies
        return torch.arange(n, device=self.x0.device).repeat(ncopies).expand(self.num_rows, -1)

    def to(self, device: torch.device | str) -> "LayoutBatch":
        """The same batch with its tensors on `device` (the layout's lengths stay: `prepare` moves them)."""
        return LayoutBatch(self.x0.to(device), self.rnd.to(device), self.mask_id, self.layout, self.tgt_row.to(device),
                           self.tgt_col.to(device), self.targets.to(device), self.resp_pos.to(device))


def build_layout_batch(sequences: torch.Tensor, step_map: torch.Tensor, prompt_lens: torch.Tensor,
                       resp_lens: torch.Tensor, block_size: int, mask_id: int, mode: str = "block_proxy") -> LayoutBatch:
    """Build the training forward for decoded rows.

    sequences [N, L] int64 decoded tokens (prompt + blocks); step_map [N, L] int32 over the same positions
    (-1 prompt, >= 0 the step that unmasked it, -2 never decoded); prompt_lens, resp_lens [N] (the response
    tokens to score: up to and including the first EOS).
    """
    if mode not in MODES:
        raise ValueError(f"logprob mode must be one of {MODES}, got {mode!r}")
    bs = check_int("block_size", block_size, lo=1)
    mask_id = check_int("mask_id", mask_id, lo=0)
    check_tensor("sequences", sequences, ndim=2, dtypes=_INT_DTYPES)
    nrows, length = sequences.shape
    if step_map.shape != sequences.shape:
        raise ValueError(f"step_map shape {tuple(step_map.shape)} != sequences shape {tuple(sequences.shape)}")
    dev = sequences.device
    check_tensor("step_map", step_map, dtypes=_INT_DTYPES, device=dev)
    check_tensor("prompt_lens", prompt_lens, shape=(nrows,), dtypes=_INT_DTYPES, device=dev)
    check_tensor("resp_lens", resp_lens, shape=(nrows,), dtypes=_INT_DTYPES, device=dev)
    if nrows == 0 or length == 0:
        raise ValueError(f"build_layout_batch needs at least one row and one position, got sequences of shape "
                         f"{list(sequences.shape)}")
    prompt_lens, resp_lens = prompt_lens.long(), resp_lens.long()
    decoded = step_map != -2
    valid = decoded.sum(1)  # [N] decoded length (whole blocks)
    _check_decoded_rows(sequences, step_map, prompt_lens, resp_lens, valid, bs, mask_id, mode)
    n = int(valid.max())
    if n == 0:
        raise ValueError("build_layout_batch: no row has a decoded position (step_map is -2 everywhere)")
    x0 = sequences[:, :n]
    smap = step_map[:, :n].long()
    pos = torch.arange(n, device=dev)
    is_resp = (pos[None] >= prompt_lens[:, None]) & (pos[None] < valid[:, None])  # [N, n] all generated positions
    is_tgt = (pos[None] >= prompt_lens[:, None]) & (pos[None] < (prompt_lens + resp_lens)[:, None])  # [N, n]
    if mode == "block_proxy":
        rnd = torch.where(is_resp, 0, -1)  # [N, n] one noisy copy: every response position masked
        ncopies = 2
    else:
        nblk = n // bs
        blk = (pos // bs).expand(nrows, n)
        big = torch.iinfo(torch.int64).max
        first = torch.full((nrows, nblk), big, device=dev).scatter_reduce(
            1, blk, torch.where(is_resp, smap, big), reduce="amin")  # [N, nblk] first step of each block
        rnd = torch.where(is_resp, smap - first.gather(1, blk), -1)  # [N, n] round of each token
        ncopies = (int(rnd.max()) + 1 if bool(is_resp.any()) else 1) + 1
    if ncopies - 1 > torch.iinfo(torch.int16).max:
        raise ValueError(f"{ncopies - 1} rounds in one block: more than a LayoutBatch can index")
    tgt_row, tgt_p = is_tgt.nonzero(as_tuple=True)
    tgt_col = rnd[tgt_row, tgt_p].clamp_min(0) * n + tgt_p
    layout = MaskLayout(n, ncopies, bs, valid.clamp_min(1))
    return LayoutBatch(x0, rnd.to(torch.int16), mask_id, layout, tgt_row, tgt_col, x0[tgt_row, tgt_p],
                       tgt_p - prompt_lens[tgt_row])


def _first_bad_row(bad: torch.Tensor) -> int:
    """The first row of a [N, ...] bool tensor with a True entry, or -1."""
    rows = bad.reshape(bad.shape[0], -1).any(1).nonzero()
    return int(rows[0]) if rows.numel() else -1


def _check_decoded_rows(sequences, step_map, prompt_lens, resp_lens, valid, bs: int, mask_id: int, mode: str) -> None:
    """build_layout_batch's rows are what the sampler records (one host pass per batch; raises naming the first
    bad row): step_map is -1 over the prompt, >= 0 over the decoded response, then -2 to the end; the decoded
    length (prompt + blocks) is whole blocks; 0 <= prompt_len, 0 <= resp_len and prompt_len + resp_len <= decoded
    length; no decoded response token is the mask token (its log-prob is -inf: the mask token is out of the
    softmax); trace mode: blocks were decoded one after the other (a block's first step after the previous
    block's last), which the replay of rounds assumes."""
    nrows, length = sequences.shape
    pos = torch.arange(length, device=sequences.device)[None]  # [1, L]
    checks = [
        ((prompt_lens < 0) | (resp_lens < 0), lambda i: f"prompt_lens and resp_lens must be >= 0, got row {i}: "
                                                        f"{int(prompt_lens[i])}, {int(resp_lens[i])}"),
        (prompt_lens + resp_lens > valid, lambda i: f"row {i}: prompt_len {int(prompt_lens[i])} + resp_len "
                                                    f"{int(resp_lens[i])} exceeds its decoded length {int(valid[i])}"),
    ]
    in_prompt = pos < prompt_lens[:, None]
    in_resp = ~in_prompt & (pos < valid[:, None])
    want = torch.where(in_prompt, -1, torch.where(in_resp, 0, -2))  # [N, L] -1 prompt, 0 (>= 0) response, -2 after
    off = torch.where(in_resp, step_map < 0, step_map != want)
    checks.append((off, lambda i: f"row {i}: step_map must be -1 over the prompt ({int(prompt_lens[i])} positions), "
                                  f">= 0 over the decoded response and -2 after it, got "
                                  f"{_runs(step_map[i].tolist())}"))
    checks.append((valid % bs != 0, lambda i: f"row {i}: decoded length {int(valid[i])} (prompt + decoded blocks) is "
                                              f"not whole blocks of {bs}"))
    masked = in_resp & (sequences == mask_id)
    checks.append((masked, lambda i: f"row {i}: the mask token {mask_id} at decoded response position "
                                     f"{int(masked[i].nonzero()[0])} (the sampler never unmasks to it)"))
    if mode == "trace":
        nblk = -(-length // bs)
        blk = (pos // bs).expand(nrows, length)
        smap = step_map.long()
        big = torch.iinfo(torch.int64).max
        first = torch.full((nrows, nblk), big, device=sequences.device).scatter_reduce(
            1, blk, torch.where(in_resp, smap, big), reduce="amin")
        last = torch.full((nrows, nblk), -1, device=sequences.device).scatter_reduce(
            1, blk, torch.where(in_resp, smap, -1), reduce="amax")
        before = torch.cat([torch.full((nrows, 1), -1, device=sequences.device), last.cummax(1).values[:, :-1]], 1)
        checks.append(((first != big) & (first <= before), lambda i: f"row {i}: a block's tokens were unmasked before "
                                                                     f"the previous block was complete (step_map "
                                                                     f"{_runs(step_map[i].tolist())}); trace mode "
                                                                     f"replays blocks decoded one after the other"))
    for bad, message in checks:
        i = _first_bad_row(bad)
        if i >= 0:
            raise ValueError(f"build_layout_batch: {message(i)}")


def _runs(values: list, most: int = 12) -> str:
    """A short text of a step-map row: runs of equal values as value x count, at most `most` runs."""
    out: list[list] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    text = ", ".join(f"{v}" if c == 1 else f"{v} x{c}" for v, c in out[:most])
    return f"[{text}{', ...' if len(out) > most else ''}]"


@dataclass
class MicroBatch:
    """One packed training forward: some samples of a LayoutBatch back to back in one row (a PackedLayout).

    Sample i becomes one segment: the noisy blocks that hold its targets (one block of one noisy copy each), then
    the blocks of its clean copy before the last of those noisy blocks (within its decoded length). Nothing else
    is needed: a noisy block attends to itself and to earlier clean blocks, a clean block to clean blocks up to
    its own, and nothing attends to a noisy block. Its targets are read at columns
    read_col of the row's hidden states; `sel` says which of the LayoutBatch's targets they are
    (lb.targets[sel], lb.tgt_row[sel], ...)."""

    input_ids: torch.Tensor  # [1, P] int64 (pad id at padding)
    position_ids: torch.Tensor  # [1, P] int64
    layout: PackedLayout
    sel: torch.Tensor  # [t] int64 indices into the LayoutBatch's targets
    read_col: torch.Tensor  # [t] int64
    targets: torch.Tensor  # [t] int64 token ids (lb.targets[sel])
    samples: torch.Tensor  # [s] int64 the LayoutBatch rows packed here, in segment order

    @property
    def positions(self) -> int:
        """Positions one forward processes (padding included)."""
        return int(self.input_ids.numel())

    @property
    def used(self) -> int:
        """Positions inside segments."""
        return self.layout.used

    def to(self, device: torch.device | str) -> "MicroBatch":
        """The tensors the forward reads on `device` (the layout stays on the host; `prepare` moves what it needs);
        copies to a GPU do not block the host."""
        return MicroBatch(upload(self.input_ids, device), upload(self.position_ids, device), self.layout, self.sel,
                          upload(self.read_col, device), upload(self.targets, device), self.samples)


_LENGTH_QUANTUM = 128  # FlexAttention's block: packed rows on CUDA are a multiple of it


def packed_length(used: int, budget: int) -> int:
    """The row length a CUDA micro-batch of `used` positions runs at: a multiple of 128 with 3 significant bits
    (4 lengths per octave: 1024, 1280, 1536, 1792, 2048, ...), at most the budget's multiple of 128 when `used`
    fits the budget. So a run compiles FlexAttention for a few lengths (full micro-batches all run at the
    budget's), and a partial one pads at most ~25%."""
    m = round_3_bits(-(-used // _LENGTH_QUANTUM))
    cap = -(-budget // _LENGTH_QUANTUM)
    return (min(m, cap) if used <= budget else m) * _LENGTH_QUANTUM


def _best_fit(sizes: list[int], order: list[int], budget: int) -> list[list[int]]:
    """Best-fit decreasing bin packing of items `order` (largest first) into bins of `budget`; an item larger than
    the budget gets a bin of its own. Returns the bins (item lists) in creation order."""
    import bisect

    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin index) of bins that can take more
    for i in order:
        size = sizes[i]
        if size > budget:
            bins.append([i])
            continue
        j = bisect.bisect_left(free, (size, -1))  # the tightest bin it fits
        if j < len(free):
            cap, b = free.pop(j)
            bins[b].append(i)
            if cap - size > 0:
                bisect.insort(free, (cap - size, b))
        else:
            bins.append([i])
            if budget - size > 0:
                bisect.insort(free, (budget - size, len(bins) - 1))
    return bins


def check_layout_batch(lb: LayoutBatch) -> None:
    """A LayoutBatch's fields agree (on the host, once per packing; build_layout_batch makes them so, a batch built
    by hand is checked here): x0 [N, n] and rnd [N, n] integers with n = layout.n, layout.lengths [N] (or None),
    the target tables [T] integers, each target read in a noisy copy where its position is masked (rnd >= copy) and
    inside its row's valid length, and `targets` the clean tokens there. Raises ValueError / TypeError naming the
    field. A batch that passed is not checked again while its fields are the same objects, unchanged in place
    (each tensor's version counter): the trainer packs one batch once per pass and mini-batch."""
    if not isinstance(lb, LayoutBatch):
        raise TypeError(f"expected a LayoutBatch, got {type(lb).__name__}")
    key = _check_key(lb)
    if _same_key(lb._checked, key):
        return
    _check_layout_fields(lb)
    lb._checked = key


def _check_key(lb: LayoutBatch) -> tuple:
    """What a passed check depends on: every field object (kept, so a freed object's id is never reused as a
    match) with its in-place version for tensors."""
    lay = lb.layout
    objs = (lb.x0, lb.rnd, lb.mask_id, lay, getattr(lay, "lengths", None), lb.targets, lb.tgt_row, lb.tgt_col,
            lb.resp_pos)
    return tuple((o, _version(o)) for o in objs)


def _version(o: object) -> int | None:
    if not isinstance(o, torch.Tensor):
        return None
    try:
        return o._version
    except RuntimeError:  # an inference-mode tensor has no version counter: -1 never matches, always checked
        return -1


def _same_key(a: tuple | None, b: tuple) -> bool:
    return (a is not None and len(a) == len(b)
            and all(x[0] is y[0] and x[1] == y[1] and y[1] != -1 for x, y in zip(a, b)))


def _check_layout_fields(lb: LayoutBatch) -> None:
    lay = lb.layout
    if not isinstance(lay, MaskLayout):
        raise TypeError(f"LayoutBatch.layout must be a MaskLayout, got {type(lay).__name__}")
    check_tensor("LayoutBatch.x0", lb.x0, ndim=2, dtypes=_INT_DTYPES)
    nrows, n = lb.x0.shape
    if n != lay.n:
        raise ValueError(f"LayoutBatch.x0 has {n} positions per row but its layout's copy length is {lay.n}")
    check_tensor("LayoutBatch.rnd", lb.rnd, shape=(nrows, n), dtypes=(torch.int16,) + _INT_DTYPES, device=lb.x0.device)
    if lay.lengths is not None:
        check_tensor("LayoutBatch.layout.lengths", lay.lengths, shape=(nrows,))
    check_int("LayoutBatch.mask_id", lb.mask_id, lo=0)
    check_tensor("LayoutBatch.targets", lb.targets, ndim=1, dtypes=_INT_DTYPES, device=lb.x0.device)
    t = lb.targets.shape[0]
    for name in ("tgt_row", "tgt_col", "resp_pos"):
        check_tensor(f"LayoutBatch.{name}", getattr(lb, name), shape=(t,), dtypes=_INT_DTYPES, device=lb.x0.device)
    if t == 0:
        return
    row, col = lb.tgt_row, lb.tgt_col
    if int(row.min()) < 0 or int(row.max()) >= nrows:
        raise ValueError(f"LayoutBatch.tgt_row must lie in [0, {nrows}), got {int(row.min())}..{int(row.max())}")
    noisy = (lay.num_copies - 1) * n  # targets are read in a noisy copy
    if int(col.min()) < 0 or int(col.max()) >= noisy:
        raise ValueError(f"LayoutBatch.tgt_col must lie in [0, {noisy}) (the {lay.num_copies - 1} noisy copies of "
                         f"{n} positions), got {int(col.min())}..{int(col.max())}")
    copy, pos = col // n, col % n
    valid = lay.lengths.to(row.device).long()[row] if lay.lengths is not None else torch.full_like(row, n)
    checks = (
        (lb.rnd[row, pos].long() < copy, "is not masked in the copy it is read in (rnd < its copy): the input "
                                         "would show the token it predicts"),
        (pos >= valid, "lies past its row's valid length (layout.lengths)"),
        (lb.targets != lb.x0[row, pos], "differs from the clean token x0 at its position"),
    )
    for bad, what in checks:
        k = bad.nonzero()
        if k.numel():
            k = int(k[0])
            raise ValueError(f"LayoutBatch target {k} (row {int(row[k])}, copy {int(copy[k])}, position "
                             f"{int(pos[k])}) {what}")


def pack_micro_batches(lb: LayoutBatch, rows: Sequence[int], budget: int, pad_shapes: bool = False,
                       pad_id: int = 0) -> list[MicroBatch]:
    """`iter_micro_batches` as a list."""
    return list(iter_micro_batches(lb, rows, budget, pad_shapes, pad_id))


def iter_micro_batches(lb: LayoutBatch, rows: Sequence[int], budget: int, pad_shapes: bool = False,
                       pad_id: int = 0) -> Iterator[MicroBatch]:
    """Pack the samples `rows` (distinct) of `lb` into micro-batches of at most `budget` positions (a sample longer
    than the budget gets one of its own); every target of those rows is in exactly one micro-batch.

    Each sample keeps only what its targets need (see MicroBatch): its clean copy cut before its last noisy
    block (and to its own decoded length), and the noisy blocks holding targets (block proxy: the response blocks
    of x_t, not its prompt-only blocks; trace: per round only the blocks that unmask something in it), so no
    sample pays for the longest one or for the most rounds. `pad_shapes` (CUDA) rounds each row to
    `packed_length`: a few shapes per run for the compiled attention; otherwise rows are exactly as long as their
    segments. Samples without targets are left
    out. Exact: every kept position sees what it sees in the LayoutBatch, and padding is never attended.
    The plan (which samples go where) is made, and input errors raised, at the call; each micro-batch is built
    when the iteration asks for it, so a training loop packs the next one while the GPU runs the current one."""
    check_layout_batch(lb)
    n_all, ncopies, bs = lb.layout.n, lb.layout.num_copies, lb.layout.block_size
    nrows = lb.num_rows
    if isinstance(rows, torch.Tensor) and rows.dim() == 1:
        rows = rows.tolist()  # floats and bools stay what they are: check_int refuses them
    try:
        rows = list(rows)
    except TypeError:
        raise TypeError(f"rows must be a sequence of row indices, got {type(rows).__name__}") from None
    rows_t = torch.tensor([check_int("rows[i]", r) for r in rows], dtype=torch.int64)
    budget = check_int("micro-batch budget", budget)
    if rows_t.numel() == 0:
        return iter(())
    if budget < 1:
        raise ValueError(f"micro-batch budget must be >= 1 position, got {budget}")
    if n_all % bs:
        raise ValueError(f"the LayoutBatch's copy length {n_all} is not a multiple of its block size {bs}")
    if torch.unique(rows_t).numel() != rows_t.numel() or int(rows_t.min()) < 0 or int(rows_t.max()) >= nrows:
        raise ValueError(f"rows must be distinct rows of the LayoutBatch (0..{nrows - 1})")
    nblk = n_all // bs
    valid = lb.layout.lengths.long() if lb.layout.lengths is not None else torch.full((nrows,), n_all)
    # only the targets of `rows` take part (a mini-batch's plan costs its own targets, not the whole batch's)
    member = torch.zeros(nrows, dtype=torch.bool)
    member[rows_t] = True
    t_idx = member[lb.tgt_row].nonzero().squeeze(1)  # [T'] indices into lb's targets, ascending
    t_row, t_col_in = lb.tgt_row[t_idx], lb.tgt_col[t_idx]  # [T']
    t_copy, t_pos = t_col_in // n_all, t_col_in % n_all  # [T']
    # the noisy pieces: distinct (sample, copy, block) of the targets, sorted by sample then copy then block
    pieces, t_piece = torch.unique((t_row * ncopies + t_copy) * nblk + t_pos // bs, return_inverse=True)
    p_sample, p_copy, p_blk = pieces // (ncopies * nblk), (pieces // nblk) % ncopies, pieces % nblk
    n_noisy = torch.bincount(p_sample, minlength=nrows)  # [N]
    # clean blocks: those before the sample's last noisy block (a noisy block b reads clean blocks < b, and a clean
    # block only earlier ones: nothing reads the rest), within its decoded length
    last_blk = torch.zeros(nrows, dtype=torch.int64).scatter_reduce_(0, p_sample, p_blk, reduce="amax")  # [N]
    n_clean = torch.minimum(-(-valid // bs), last_blk)  # [N]
    seg_len = (n_noisy + n_clean) * bs  # [N]
    cand = rows_t[n_noisy[rows_t] > 0]
    sizes = seg_len.tolist()
    bins = _best_fit(sizes, sorted(cand.tolist(), key=lambda i: (-sizes[i], i)), budget)
    # every sample's bin and offset; every noisy piece's place in its bin's row; each target's read position
    bin_of = torch.full((nrows,), -1, dtype=torch.int64)
    off_of = torch.zeros(nrows, dtype=torch.int64)
    local_of = torch.zeros(nrows, dtype=torch.int64)  # segment id of a sample within its bin
    for b, members in enumerate(bins):
        m = torch.tensor(members)
        bin_of[m] = b
        off_of[m] = torch.cumsum(seg_len[m], 0) - seg_len[m]
        local_of[m] = torch.arange(len(members))
    first_piece = torch.cumsum(n_noisy, 0) - n_noisy  # [N] index of each sample's first noisy piece
    p_dst = off_of[p_sample] + (torch.arange(pieces.numel()) - first_piece[p_sample]) * bs  # [pieces]
    t_bin = bin_of[t_row]  # [T'] (every target of `rows` has a bin: its sample has a noisy piece)
    t_col = p_dst[t_piece] + t_pos % bs  # [T'] read column in its bin's row
    t_split = torch.split(torch.argsort(t_bin, stable=True), torch.bincount(t_bin, minlength=len(bins)).tolist())
    p_bin = bin_of[p_sample]  # [pieces] (every piece is of a sample of `rows`: it has a bin)
    p_split = torch.split(torch.argsort(p_bin, stable=True), torch.bincount(p_bin, minlength=len(bins)).tolist())
    j = torch.arange(bs)

    def rows_of_plan() -> Iterator[MicroBatch]:  # the plan's micro-batches, one at a time
        for b, members in enumerate(bins):
            m = torch.tensor(members)
            # the bin's pieces: its noisy pieces, then every member's clean blocks (after its noisy ones)
            noisy = p_split[b]
            c_sample = torch.repeat_interleave(m, n_clean[m])
            c_blk = torch.arange(c_sample.numel()) - torch.repeat_interleave(torch.cumsum(n_clean[m], 0) - n_clean[m],
                                                                            n_clean[m])
            sample = torch.cat([p_sample[noisy], c_sample])  # [pieces]
            copy = torch.cat([p_copy[noisy], torch.full_like(c_sample, ncopies - 1)])
            blk = torch.cat([p_blk[noisy], c_blk])
            dst = torch.cat([p_dst[noisy], off_of[c_sample] + (n_noisy[c_sample] + c_blk) * bs])
            used = int(seg_len[m].sum())
            length = packed_length(used, budget) if pad_shapes else used
            col = (dst[:, None] + j).reshape(-1)  # [used] every piece's positions in the row
            src = (blk * bs)[:, None] + j  # [pieces, B] positions within the copy
            src_row = sample[:, None].expand(-1, bs)
            ids = torch.full((1, length), pad_id, dtype=torch.int64)
            pos = torch.zeros((1, length), dtype=torch.int64)
            ids[0, col] = lb.tokens(src_row, copy[:, None], src).reshape(-1)
            pos[0, col] = src.reshape(-1)
            seg = torch.full((1, length), -1, dtype=torch.int32)
            cpy = torch.full((1, length), -1, dtype=torch.int32)
            bl = torch.zeros((1, length), dtype=torch.int32)
            ok = torch.zeros((1, length), dtype=torch.bool)
            seg[0, col] = local_of[src_row].reshape(-1).int()
            cpy[0, col] = torch.where(copy == ncopies - 1, -1, copy)[:, None].expand(-1, bs).reshape(-1).int()
            bl[0, col] = blk[:, None].expand(-1, bs).reshape(-1).int()
            ok[0, col] = ((blk * bs)[:, None] + j < valid[sample][:, None]).reshape(-1)
            sel = t_idx[t_split[b]]
            yield MicroBatch(ids, pos, PackedLayout(bs, seg, cpy, bl, ok), sel, t_col[t_split[b]], lb.targets[sel], m)

    return rows_of_plan()


def batch_logprobs(model: SDARForCausalLM, lb: LayoutBatch, chunk: int = 4096) -> torch.Tensor:
    """Per-target log-probs [T] (differentiable when grad is enabled) of a LayoutBatch under `model`."""
    hidden = model.hidden(lb.input_ids, lb.position_ids, lb.layout)  # [N, copies*n, H]
    h = hidden[lb.tgt_row, lb.tgt_col]  # [T, H]
    return linear_logprobs(h, model.lm_head.weight, lb.targets, chunk=chunk, suppress_token=model.config.mask_token_id)


def _reference_tensors(model: SDARForCausalLM) -> dict[str, torch.Tensor]:
    """What `host_copy` copies: the state dict, less a tied lm_head (the embedding serves it)."""
    return {k: v.detach() for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}


def _by_dtype(tensors: dict[str, torch.Tensor]) -> dict[torch.dtype, list[str]]:
    """Names of `tensors` per dtype (one set of slabs each), dtypes in a fixed order."""
    out: dict[torch.dtype, list[str]] = {}
    for k in sorted(tensors, key=lambda k: str(tensors[k].dtype)):
        out.setdefault(tensors[k].dtype, []).append(k)
    return out


def host_copy_bytes(model: SDARForCausalLM) -> int:
    """Pinned host bytes `host_copy(model)` allocates, slab rounding included (`optim.carve_plan`)."""
    from .optim import carve_plan

    src = _reference_tensors(model)
    return sum(sum(size for size, _, _ in carve_plan([src[k].numel() for k in names])) * src[names[0]].element_size()
               for names in _by_dtype(src).values())


def host_copy(model: SDARForCausalLM, pin: bool | None = None) -> SDARForCausalLM:
    """A frozen copy of `model` in host memory, made one tensor at a time (never a second full copy on the GPU);
    pinned (page-locked, for fast copies to the GPU) by default when CUDA is available, the tensors carved from a
    few power-of-two slabs (`optim.carve_host`: pinning each tensor alone rounds it up to a power of two)."""
    from .optim import carve_host

    pin = torch.cuda.is_available() if pin is None else pin
    with torch.device("meta"):
        ref = SDARForCausalLM(model.config)
    src = _reference_tensors(model)
    if not pin:
        sd = {k: v.to("cpu", copy=True) for k, v in src.items()}
    else:  # carved from pinned slabs, one set per dtype
        sd = {}
        for dtype, names in _by_dtype(src).items():
            for k, h in zip(names, carve_host([src[k].numel() for k in names], True, dtype)):
                sd[k] = h.view(src[k].shape).copy_(src[k])
    ref.load_state_dict(sd, assign=True, strict=not model.config.tie_word_embeddings)
    if model.config.tie_word_embeddings:
        ref.lm_head.weight = ref.model.embed_tokens.weight
    return ref.eval().requires_grad_(False)


def micro_batch_logprobs(model: SDARForCausalLM, mb: MicroBatch, chunk: int = 4096,
                         check_values: bool | None = None) -> torch.Tensor:
    """Per-target log-probs [t] of a MicroBatch (already on the model's device) under `model`. `check_values=False`
    when the caller has run `check_targets` on the LayoutBatch (no device sync per micro-batch)."""
    hidden = model.hidden(mb.input_ids, mb.position_ids, mb.layout)  # [1, P, H]
    h = hidden[0, mb.read_col]  # [t, H]
    return linear_logprobs(h, model.lm_head.weight, mb.targets, chunk=chunk, suppress_token=model.config.mask_token_id,
                           check_values=check_values)


def check_targets(lb: LayoutBatch, vocab: int) -> None:
    """The LayoutBatch's target ids, and the token ids its forwards embed (x0 and the mask token), are vocabulary
    ids, and no target is the mask token (the passes take it out of the softmax): checked once per pass on the
    host, so that the passes' ops need not read their device copies back (a sync per micro-batch)."""
    vocab = check_int("vocab", vocab, lo=1)
    t = lb.targets
    if t.numel() and not (0 <= int(t.min()) and int(t.max()) < vocab):
        raise ValueError(f"target token ids must lie in [0, {vocab}), got {int(t.min())}..{int(t.max())}")
    x0 = lb.x0  # the context the forwards embed (an id outside the vocabulary is a device assert on CUDA)
    if x0.numel() and not (0 <= int(x0.min()) and int(x0.max()) < vocab):
        raise ValueError(f"LayoutBatch token ids (x0: prompts, responses and padding) must lie in [0, {vocab}), got "
                         f"{int(x0.min())}..{int(x0.max())}")
    if not 0 <= lb.mask_id < vocab:
        raise ValueError(f"LayoutBatch.mask_id must lie in [0, {vocab}), got {lb.mask_id}")
    hit = (t == lb.mask_id).nonzero()
    if hit.numel():  # the passes leave the mask token out of the softmax: its log-prob would be -inf
        raise ValueError(f"target {int(hit[0])} is the mask token {lb.mask_id} (out of the softmax: log-prob -inf)")


class _LayerFeed:
    """Decoder layers of a host-resident model brought to `device` in turn, into two device copies of one layer used
    alternately. On CUDA a layer's copy in runs on a side stream (`fill`), after the compute that last used its
    buffer (an event recorded by `done`), and the compute waits for it (`take`): layer i + 1 crosses PCIe while
    layer i computes. Elsewhere every copy is on the current stream, in order."""

    def __init__(self, template: torch.nn.Module, device: torch.device) -> None:
        self.bufs = [copy.deepcopy(template).to(device) for _ in range(2)]
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device
        self.ready: list = [None, None]  # per buffer: event after its copy in (side stream)
        self.free: list = [None, None]  # per buffer: event after its last compute (current stream)

    def fill(self, k: int, layer: torch.nn.Module) -> None:
        """Start copying `layer`'s weights into buffer k (after the compute queued on it so far)."""
        pairs = list(zip(self.bufs[k].parameters(), layer.parameters()))
        if self.side is None:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            return
        if self.free[k] is not None:
            self.side.wait_event(self.free[k])
        with torch.cuda.stream(self.side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            self.ready[k] = self.side.record_event()

    def take(self, k: int) -> torch.nn.Module:
        """Buffer k for compute on the current stream, once its copy in is done (a wait on the device)."""
        if self.ready[k] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[k])
        return self.bufs[k]

    def done(self, k: int) -> None:
        """The compute queued on buffer k is its last until it is filled again."""
        if self.side is not None:
            self.free[k] = torch.cuda.current_stream(self.device).record_event()

    def join(self) -> None:
        """The current stream waits for every copy (before the buffers are freed)."""
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)


@torch.no_grad()
def streamed_logprobs(model: SDARForCausalLM, lb: LayoutBatch, mbs: Iterable[MicroBatch],
                      device: torch.device, chunk_tokens: int) -> torch.Tensor:
    """Per-target log-probs [T] (float32, CPU) of a host-resident `model`, computed on `device` layer by layer.

    `mbs`: the micro-batches (`iter_micro_batches` of lb). They are taken in chunks of at most `chunk_tokens`
    positions (their hidden states stay on the device meanwhile, chunk_tokens x hidden x 2 bytes in bf16); per
    chunk, each decoder layer is copied into one of two device-resident layers (`_LayerFeed`: the next one's copy
    overlaps this one's compute on CUDA) and applied to every micro-batch of the chunk, then the final norm and the
    LM head (copied once per call). Equals the per-micro-batch forward of the same weights on the device (tested)."""
    cfg = model.config
    chunk_tokens = check_int("chunk_tokens", chunk_tokens, lo=1)
    check_targets(lb, cfg.vocab_size)
    out = torch.empty(lb.num_tokens)
    layers = list(model.model.layers)
    feed = _LayerFeed(layers[0], device)  # two layers' memory on the device, refilled layer after layer
    norm = copy.deepcopy(model.model.norm).to(device)
    head = model.lm_head.weight.to(device, non_blocking=True)
    chunks: list[list[MicroBatch]] = [[]]
    for mb in mbs:
        if chunks[-1] and sum(m.positions for m in chunks[-1]) + mb.positions > chunk_tokens:
            chunks.append([])
        chunks[-1].append(mb)
    try:
        for chunk in chunks:
            subs = [mb.to(device) for mb in chunk]
            xs, ropes, plans = [], [], []
            for host_mb, sub in zip(chunk, subs):
                x = upload(model.model.embed_tokens(host_mb.input_ids), device)  # [1, P, H] embedded on host
                xs.append(x)
                ropes.append(rope_cos_sin(sub.position_ids, cfg.head_dim, cfg.rope_theta, x.dtype))
                plans.append(prepare(sub.layout, 1, device))
            feed.fill(0, layers[0])
            for i in range(len(layers)):
                if i + 1 < len(layers):
                    feed.fill((i + 1) % 2, layers[i + 1])  # crosses while layer i computes (CUDA)
                work = feed.take(i % 2)
                for k, sub in enumerate(subs):
                    xs[k] = work(xs[k], *ropes[k], sub.layout, plans[k])
                feed.done(i % 2)
            for host_mb, sub, x in zip(chunk, subs, xs):
                h = norm(x)[0, sub.read_col]  # [t, H]
                out[host_mb.sel] = linear_logprobs(h, head, sub.targets, chunk=4096,
                                                   suppress_token=cfg.mask_token_id, check_values=False).float().cpu()
    finally:
        feed.join()  # also on an error: no copy is left pending into buffers about to be freed
    return out
