"""ops.threshold_unmask: one denoising step's token choice and unmasking for a batch of blocks.

For every row (one sequence's current block of S positions) and every still-masked position:
  * the tempered distribution softmax(logits / T) over the vocabulary;
  * the pick: argmax of the logits when greedy (ties go to the lowest token id), otherwise a Gumbel-max
    sample from the top-k / top-p truncated tempered distribution, the Gumbel noise drawn from
    Philox4x32-10 keyed by (seed, offset) — a counter-based stream that a CUDA kernel reproduces exactly and
    that stays valid under CUDA-graph replay (bump `offset` per step). Two ways to spend the noise, both
    exact samples of the same distribution (they give different tokens for the same seed):
      - noise="two_level" (default): the vocabulary is cut into buckets of BUCKET = 1024 token ids; a bucket
        is drawn by Gumbel-max over the buckets' log-masses logsumexp(s_bucket) (noise counter
        BUCKET_TAG + row * n_buckets + bucket), then a token by Gumbel-max inside that bucket (noise counter
        row * V + token). P(bucket) = its mass, P(token | bucket) = its share of it: one noise value per
        bucket and per token of one bucket, so the CUDA kernel reads the logits once at the greedy scan's speed;
      - noise="per_token": Gumbel-max over the whole row with one noise value per token (counter row * V +
        token); the kernel prunes tokens that cannot win, but on flat logits it is bound by the RNG;
    `row` is the flat index b * S + s, or noise_rows[b] * S + s when `noise_rows` names each sequence's index in
    a numbering of the caller's (the decoder's rows in the request, which compaction moves);
  * conf = probability of the pick under the UNtruncated tempered distribution, logp = log(conf).
Then per row: unmask the `quota[b]` most confident masked positions (ties to the lowest position) plus
every masked position with conf >= threshold. "Top-1 + threshold" (LightningRL, Fast-dLLM) is quota 1;
SDAR's quota rule passes B//S + (s < B%S). quota 0 marks an inactive row: nothing is touched.
Outputs are written in place (tokens, masked, step_map, logp, conf at the unmasked positions only);
returned are block_done [B] (no mask left) and eos_seen [B] (a generated token of the block is an EOS id;
positions with step_map < 0 are prompt tokens and never count).

CUDA: `_C.threshold_unmask` (csrc/unmask.cu, csrc/kernels/unmask.cuh + unmask_scan.cuh) does the whole step in one
launch and one pass over the logits, without host synchronization (graph-capturable; bump `offset` between replays)
and without allocating anything per call but the two [B] bool outputs (persistent workspaces hold its cross-CTA
partials: one per stream for eager launches, one per device for captured ones, grown by eager calls; it must not
grow during a graph capture, so run the op once eagerly first).
Its picks equal the reference's: greedy exactly; sampling uses the same Philox stream and the same fp32
arithmetic (x * (1/T) then + Gumbel, torch's logf), so a pick can only differ where two tokens' perturbed
scores are within an ulp and the two sides' logf differ (the reference on the CPU), and, two-level, where two
buckets' perturbed scores are within the fp32 error of a bucket's logsumexp (summed in another order).
conf / logp match to ~1e-6 relative (to ~2^-24 (|s_pick| + |s_max|) where the scaled logits s = x / T are large,
T << 1), so a position at the threshold or tied in conf with another to that precision may select differently.
Used when `kernel_supported(...)` holds; otherwise (float64 logits, top-k/top-p truncation while sampling,
more than 1024 positions per row, a vocabulary past 2^31 - 2^16) the op runs the reference on the GPU —
correct, but several passes over fp32 copies of the logits, a slice of sequences at a time (PICK_SLICE_ELEMS
logits: its temporaries stay a few hundred MB whatever the batch). Not supported: NaN or +inf logits (the reference's NaN ordering is not
reproduced); -inf logits are fine.
"""

from __future__ import annotations

import math
import struct

import torch

from ._common import FLOAT_DTYPES, check_float, check_int, check_no_overlap, check_tensor, cuda_kernel

BUCKET = 1024  # two-level sampling: token ids per bucket (csrc/kernels/unmask_scan.cuh kBucket)
BUCKET_TAG = 1 << 62  # two-level sampling: Philox counters of the bucket noise start here (kBucketTag)
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF
_FLT_MAX = 3.4028234663852886e38


def philox_uniform(seed: int | torch.Tensor, offset: int | torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Uniform floats in (0, 1) from Philox4x32-10: key = seed, counter = (counter, offset); first output word.

    seed, offset: ints or 0-d/1-element int64 tensors (device tensors keep it free of host syncs);
    counter: int64 tensor of element indices. Returns float32 of the same shape:
    u = ((x >> 9) + 0.5) * 2^-23, exactly representable in float32, so a CUDA kernel gets bit-identical values.
    """
    seed = torch.as_tensor(seed, dtype=torch.int64, device=counter.device).reshape(())
    offset = torch.as_tensor(offset, dtype=torch.int64, device=counter.device).reshape(())
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    c0 = counter & _U32
    c1 = (counter >> 32) & _U32
    c2 = (offset & _U32).expand_as(counter)
    c3 = ((offset >> 32) & _U32).expand_as(counter)
    for _ in range(10):
        p0 = c0 * _M0  # wraps in int64; the low 64 bits are the exact unsigned product
        p1 = c2 * _M1
        hi0, lo0 = (p0 >> 32) & _U32, p0 & _U32
        hi1, lo1 = (p1 >> 32) & _U32, p1 & _U32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
    return ((c0 >> 9).to(torch.float32) + 0.5) * (2.0**-23)


def _truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p set to -inf (the top-1 token is always kept)."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # mass before this token already reaches top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def _gumbel(seed, offset, counter: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return -torch.log(-torch.log(philox_uniform(seed, offset, counter).to(dtype)))


def _two_level_pick(scaled: torch.Tensor, seed, offset, rows: torch.Tensor) -> torch.Tensor:
    """Two-level Gumbel-max over the last dim of `scaled` [B, S, V] (module docstring): token ids [B, S]. `rows`
    [B, S] int64: the flat row whose noise counters each position uses."""
    bsz, s, vocab = scaled.shape
    nb = -(-vocab // BUCKET)
    dev = scaled.device
    rows = rows[..., None]  # [B, S, 1]
    padded = torch.nn.functional.pad(scaled, (0, nb * BUCKET - vocab), value=float("-inf"))
    mass = torch.logsumexp(padded.view(bsz, s, nb, BUCKET), dim=-1)  # [B, S, nb]
    bucket_ctr = BUCKET_TAG + rows * nb + torch.arange(nb, device=dev)  # [B, S, nb]
    bucket = (mass + _gumbel(seed, offset, bucket_ctr, scaled.dtype)).argmax(-1, keepdim=True)  # [B, S, 1]
    # the bucket's token ids [B, S, W]; a vocabulary smaller than a bucket draws noise for its own ids only (each
    # token's noise is keyed by its id, so the picks are the same as over the padded bucket, at a fraction of it)
    t = bucket * BUCKET + torch.arange(min(BUCKET, vocab), device=dev)
    inside = t < vocab
    t = t.clamp_max(vocab - 1)
    score = scaled.gather(-1, t) + _gumbel(seed, offset, rows * vocab + t, scaled.dtype)
    score = score.masked_fill(~inside, float("-inf"))
    return t.gather(-1, score.argmax(-1, keepdim=True)).squeeze(-1)


# logits elements per slice of pick_tokens_reference: its temporaries (fp32 copies, a sort with int64 indices for
# top-p, int64 noise counters for per-token noise) are a few times the slice, not a few times [B, S, V]
# (rollouts at batch 256 x block 32 x vocab 151936 sampling with top-p would need ~40 GB at once, ~100 GB per-token)
PICK_SLICE_ELEMS = 1 << 25


def pick_tokens_reference(logits, seed, offset, temperature, top_k, top_p, greedy, noise="two_level",
                          noise_rows=None, logit_rows=None):
    """Per position: (token [B, S] int64, conf [B, S] fp32, logp [B, S] fp32) — see the module docstring.
    `noise_rows` [B] int64 or None: position (b, s) draws the noise of flat row noise_rows[b] * S + s (default
    b * S + s). `logit_rows` [B, S] int64 or None: `logits` is a compact [M, V] and position (b, s) reads its row
    logit_rows[b, s] clamped into [0, M) (as the kernel does; the picks of positions the caller will not select
    are meaningless then). Runs on slices of whole sequences of about PICK_SLICE_ELEMS logits (static sizes: no
    host sync, capturable)."""
    if logit_rows is not None:
        (bsz, s), vocab = logit_rows.shape, logits.shape[-1]
        logit_rows = logit_rows.clamp(0, logits.shape[0] - 1)
    else:
        bsz, s, vocab = logits.shape
    seq = noise_rows if noise_rows is not None else torch.arange(bsz, device=logits.device, dtype=torch.int64)
    rows = seq.to(torch.int64)[:, None] * s + torch.arange(s, device=logits.device)  # [B, S] noise rows

    def part(b0: int, b1: int) -> torch.Tensor:  # [b1 - b0, S, V] the slice's logits
        return logits[b0:b1] if logit_rows is None else logits[logit_rows[b0:b1]]

    per = max(1, PICK_SLICE_ELEMS // max(1, s * vocab))  # sequences per slice
    if bsz <= per or torch.compiler.is_compiling():  # compiled: one graph, not one unrolled per slice (and fused)
        return _pick_slice(part(0, bsz), rows, seed, offset, temperature, top_k, top_p, greedy, noise)
    parts = [_pick_slice(part(b0, b0 + per), rows[b0:b0 + per], seed, offset, temperature, top_k, top_p, greedy,
                         noise) for b0 in range(0, bsz, per)]
    return tuple(torch.cat(p) for p in zip(*parts))


def _pick_slice(logits, rows, seed, offset, temperature, top_k, top_p, greedy, noise):
    """`pick_tokens_reference` of the sequences `logits` [b, S, V], position (i, s) drawing the noise of flat row
    rows[i, s]."""
    vocab = logits.shape[-1]
    lf = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    temp = temperature if temperature > 0 else 1.0
    scaled = lf / temp
    logz = torch.logsumexp(scaled, dim=-1, keepdim=True)
    if greedy or temperature <= 0:
        tok = lf.argmax(-1)  # first maximal index
    elif noise == "two_level":
        tok = _two_level_pick(_truncate(scaled, top_k, top_p), seed, offset, rows)
    else:
        counter = rows[..., None] * vocab + torch.arange(vocab, device=logits.device, dtype=torch.int64)
        tok = (_truncate(scaled, top_k, top_p) + _gumbel(seed, offset, counter, lf.dtype)).argmax(-1)
    logp = (scaled.gather(-1, tok[..., None]) - logz).squeeze(-1)
    return tok, logp.exp().float(), logp.float()


def select_unmask_reference(conf, masked, quota, threshold):
    """[B, S] bool: the quota[b] most confident masked positions plus masked positions with conf >= threshold."""
    score = conf.float().masked_fill(~masked, float("-inf"))
    order = score.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    active = (quota > 0)[:, None]
    return masked & active & ((rank < quota[:, None].to(rank.dtype)) | (conf >= threshold))


def threshold_unmask_reference(logits, tokens, masked, step_map, logp, conf, step, quota, eos_ids, seed, offset,
                               threshold, temperature, top_k, top_p, greedy, noise="two_level", noise_rows=None,
                               logit_rows=None):
    """Pure-PyTorch threshold_unmask (in place). Returns (block_done [B] bool, eos_seen [B] bool)."""
    tok, c, lp = pick_tokens_reference(logits, seed, offset, temperature, top_k, top_p, greedy, noise, noise_rows,
                                       logit_rows)
    sel = select_unmask_reference(c, masked, quota, threshold)  # [B, S]
    tokens.copy_(torch.where(sel, tok, tokens))
    step_map.copy_(torch.where(sel, step.to(step_map.dtype)[:, None], step_map))
    logp.copy_(torch.where(sel, lp, logp))
    conf.copy_(torch.where(sel, c, conf))
    masked.copy_(masked & ~sel)
    is_eos = torch.isin(tokens, eos_ids) & (step_map >= 0) & ~masked
    return ~masked.any(-1), is_eos.any(-1)


KERNEL_MAX_POSITIONS = 1024  # csrc/kernels/unmask_scan.cuh kUnmaskMaxPositions
KERNEL_MAX_VOCAB = 2**31 - 2**16  # csrc/unmask.cu: token ids and in-row offsets are int32
NOISE_MODES = ("two_level", "per_token")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_supported(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, greedy: bool,
                     positions: int | None = None) -> bool:
    """True when `_C.threshold_unmask` handles these arguments (dtype and vocabulary of `logits`, positions per
    sequence: `positions`, default logits.shape[1] (compact logits: pass it), sampling options)."""
    vocab = logits.shape[-1]
    s = logits.shape[1] if positions is None else positions
    sampling = not greedy and temperature > 0
    truncated = (0 < top_k < vocab) or top_p < 1.0
    return (logits.dtype in KERNEL_DTYPES and s <= KERNEL_MAX_POSITIONS and vocab <= KERNEL_MAX_VOCAB
            and not (sampling and truncated))


def check_sampling_args(threshold: float, temperature: float, top_k: int, top_p: float,
                        noise: str) -> tuple[float, float, int, float, str]:
    """The scalar arguments of `threshold_unmask` as (float, float, int, float, str), or a ValueError / TypeError
    naming the bad one: threshold a number (+-inf allowed, not NaN); temperature not NaN, <= 0 (greedy) or with a
    finite float32 inverse (what the kernel multiplies by); top_k an integer >= 0; top_p in (0, 1]; noise one of
    NOISE_MODES."""
    threshold = check_float("threshold", threshold, allow_inf=True)
    temperature = check_float("temperature", temperature, allow_inf=True)
    if temperature > 0:  # the kernel's 1.0f / float(temperature), in Python floats (no tensor op in the step)
        t32 = struct.unpack("f", struct.pack("f", temperature))[0] if temperature <= _FLT_MAX else math.inf
        if not (t32 > 0 and 1.0 / t32 <= _FLT_MAX and 0 < t32 < math.inf):
            raise ValueError(f"temperature {temperature} is out of the float32 range (1 / temperature must be a finite "
                             f"positive float32; <= 0 means greedy)")
    top_k = check_int("top_k", top_k)
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    top_p = check_float("top_p", top_p, allow_inf=True, allow_nan=True)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if noise not in NOISE_MODES:
        raise ValueError(f"noise must be one of {NOISE_MODES}, got {noise!r}")
    return threshold, temperature, top_k, top_p, noise


@torch.library.custom_op(
    "lightningrl_fast::threshold_unmask", mutates_args=("tokens", "masked", "step_map", "logp", "conf")
)
def _threshold_unmask_op(
    logits: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor, step_map: torch.Tensor, logp: torch.Tensor,
    conf: torch.Tensor, step: torch.Tensor, quota: torch.Tensor, eos_ids: torch.Tensor, seed: torch.Tensor,
    offset: torch.Tensor, threshold: float, temperature: float, top_k: int, top_p: float, greedy: bool,
    noise: str, noise_rows: torch.Tensor | None = None, logit_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = cuda_kernel("threshold_unmask", logits)
    if kernel is not None and kernel_supported(logits, temperature, top_k, top_p, greedy, tokens.shape[1]):
        if logits.shape[-1] > 1 and logits.stride(-1) != 1:
            logits = logits.contiguous()  # the kernel reads rows as dense vectors
        return kernel(logits, tokens, masked, step_map, logp, conf, step, quota, eos_ids, seed, offset,
                      threshold, temperature, top_k, top_p, greedy, noise == "two_level", noise_rows, logit_rows)
    return threshold_unmask_reference(logits, tokens, masked, step_map, logp, conf, step, quota, eos_ids, seed,
                                      offset, threshold, temperature, top_k, top_p, greedy, noise, noise_rows,
                                      logit_rows)


@_threshold_unmask_op.register_fake
def _(logits, tokens, masked, step_map, logp, conf, step, quota, eos_ids, seed, offset,
      threshold, temperature, top_k, top_p, greedy, noise, noise_rows=None, logit_rows=None):
    b = tokens.shape[0]
    return logits.new_empty((b,), dtype=torch.bool), logits.new_empty((b,), dtype=torch.bool)


def threshold_unmask(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    masked: torch.Tensor,
    step_map: torch.Tensor,
    logp: torch.Tensor,
    conf: torch.Tensor,
    step: torch.Tensor,
    quota: torch.Tensor,
    eos_ids: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    threshold: float = 0.9,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    noise: str = "two_level",
    noise_rows: torch.Tensor | None = None,
    logit_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One unmasking step for B blocks of S positions over a vocabulary of V (in place; see module docstring).

    logits [B, S, V] float16/bfloat16/float32/float64; tokens [B, S] int64; masked [B, S] bool;
    step_map [B, S] int32; logp, conf [B, S] float32; step, quota [B] int32; eos_ids [E] int64;
    seed, offset [1] int64. temperature <= 0 means greedy. noise: "two_level" or "per_token" (how sampling
    spends its Gumbel noise; both exact). top_k >= V is the same as 0 (off). noise_rows [B] int64 or None: sequence
    b draws the noise of sequence noise_rows[b] of the default numbering (its positions' flat rows noise_rows[b] * S
    + s instead of b * S + s), so a caller that moves a sequence to another row between steps (the decoder's
    compaction) can keep its noise; values >= 0 (not checked: a read of device values), distinct unless the same
    noise is wanted. logit_rows [B, S] int64 or None: `logits` is then a compact [M, V] (M >= 1) holding rows for
    the positions that are scanned only (masked, in a sequence with quota > 0; the decoder's packed steps compute
    the LM head there alone), position (b, s) reading row logit_rows[b, s]; other positions' entries are never read;
    a value outside [0, M) reads row 0 or M - 1 (clamped, not checked: a read of device values). Returns
    (block_done [B], eos_seen [B]) bool. The five outputs must not share memory with one another or with an input
    (ValueError); the scalars follow `check_sampling_args`.
    """
    check_tensor("logits", logits, ndim=3 if logit_rows is None else 2, dtypes=FLOAT_DTYPES)
    if logit_rows is None:
        b, s, vocab = logits.shape
    else:
        check_tensor("tokens", tokens, ndim=2, dtypes=(torch.int64,), device=logits.device)
        (b, s), vocab = tokens.shape, logits.shape[-1]
        check_tensor("logit_rows", logit_rows, shape=(b, s), dtypes=(torch.int64,), device=logits.device)
        if logits.shape[0] < 1:
            raise ValueError(f"logits with logit_rows must have at least one row, got shape {list(logits.shape)}")
    dev = logits.device
    check_tensor("tokens", tokens, shape=(b, s), dtypes=(torch.int64,), device=dev)
    check_tensor("masked", masked, shape=(b, s), dtypes=(torch.bool,), device=dev)
    check_tensor("step_map", step_map, shape=(b, s), dtypes=(torch.int32,), device=dev)
    check_tensor("logp", logp, shape=(b, s), dtypes=(torch.float32,), device=dev)
    check_tensor("conf", conf, shape=(b, s), dtypes=(torch.float32,), device=dev)
    check_tensor("step", step, shape=(b,), dtypes=(torch.int32,), device=dev)
    check_tensor("quota", quota, shape=(b,), dtypes=(torch.int32,), device=dev)
    check_tensor("eos_ids", eos_ids, ndim=1, dtypes=(torch.int64,), device=dev)
    check_tensor("seed", seed, shape=(1,), dtypes=(torch.int64,), device=dev)
    check_tensor("offset", offset, shape=(1,), dtypes=(torch.int64,), device=dev)
    if noise_rows is not None:
        check_tensor("noise_rows", noise_rows, shape=(b,), dtypes=(torch.int64,), device=dev)
    if vocab < 1 or s < 1:
        raise ValueError(f"logits must have at least one position and one token, got {s} positions and {vocab} tokens")
    threshold, temperature, top_k, top_p, noise = check_sampling_args(threshold, temperature, top_k, top_p, noise)
    check_no_overlap([("tokens", tokens), ("masked", masked), ("step_map", step_map), ("logp", logp), ("conf", conf)],
                     [("logits", logits), ("step", step), ("quota", quota), ("eos_ids", eos_ids), ("seed", seed),
                      ("offset", offset)] + [(n, t) for n, t in (("noise_rows", noise_rows), ("logit_rows", logit_rows))
                                             if t is not None])
    # quota < 0 acts as 0 (inactive row) and eos_ids outside the vocabulary never match: checking either would read
    # device values on the host (a sync in the captured decode step), so neither is an error
    return _threshold_unmask_op(logits, tokens, masked, step_map, logp, conf, step, quota, eos_ids, seed, offset,
                                threshold, temperature, min(top_k, vocab), top_p, bool(greedy), noise, noise_rows,
                                logit_rows)
