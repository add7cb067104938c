"""Random configurations (fuzz_cases) of ops.threshold_unmask's kernel: the draw (dtypes, modes and temperatures,
thresholds and quotas, masks, -inf / tied / peaked / constant / identical rows, EOS ids, row layouts, Philox seed
and offset; larger shapes on a GPU) and its check against the reference and float64, shared with the emulator's
random test (test_unmask_emu.py), and the CUDA kernel on the same draws (marked `gpu`)."""

import math
import random

import pytest
import torch
from conftest import EMU_GREEDY, fuzz_cases
from test_unmask import MODES, clone, compact_logits

from lightningrl_fast.ops.unmask import (
    BUCKET,
    BUCKET_TAG,
    kernel_supported,
    philox_uniform,
    pick_tokens_reference,
    threshold_unmask,
    threshold_unmask_reference,
)


# ------------------------------------------------------------------ random configurations (fuzzing)
# The draw and the check of the random-configuration tests: test_unmask_emu.py's (the emulated kernel) and
# test_gpu_random_config (the CUDA kernel) below.

_PAD = 1000.0  # fills the bytes around the rows of a padded layout: a read outside its row would win the pick


def _max_split(vocab, per_vec, greedy, noise):
    """unmask_max_split (csrc/kernels/unmask.cuh): the most chunks the launcher may cut a row into."""
    n = -(-vocab // BUCKET) // 8 if not greedy and noise == "two_level" else vocab // per_vec // 512
    return max(1, min(64, n))


def _fuzz_vocab(rng, per_vec, gpu=False):
    kind = rng.choices(["tiny", "small", "vector", "chunk", "bucket", "medium", "large"],
                       weights=[8, 15, 10, 12, 12, 15, 28] if gpu else [10, 25, 12, 15, 15, 18, 5])[0]
    if kind == "tiny":  # shorter than a few 16-byte vectors
        return rng.randint(1, 3 * per_vec + 1)
    if kind == "small":
        return rng.choice([111, 127, 128, 129, 255, 256, 257, rng.randint(2, 1100)])
    if kind == "vector":  # around a CTA's group of 4 vectors per thread (4 * 256 * per_vec tokens)
        return max(1, rng.randint(1, 3) * 1024 * per_vec + rng.randint(-per_vec - 1, per_vec + 1))
    if kind == "chunk":  # around unmask_max_split's steps (2 vectors per thread per chunk)
        return max(1, rng.randint(1, 12) * 512 * per_vec + rng.randint(-per_vec - 1, per_vec + 1))
    if kind == "bucket":  # around the two-level buckets of 1024 tokens
        return max(1, rng.randint(1, 24) * BUCKET + rng.choice([-per_vec, -1, 0, 1, per_vec - 1, per_vec, 7]))
    if kind == "medium":
        return rng.randint(1100, 30000)
    if gpu:  # Qwen2 / SDAR's vocabulary the most often
        return rng.choice([151936, 151936, 151936, 152064, rng.randint(30000, 160000)])
    return rng.choice([151936, 152064, rng.randint(30000, 160000)])


def _fuzz_logits(rng, g, b, s, vocab, dtype):
    """[b, s, vocab] logits in `dtype` (random, with the drawn features; on the generator's device) and the
    features' names."""
    dev = g.device
    scale = rng.choice([0.5, 1.0, 3.0, 8.0])
    x = torch.randn(b, s, vocab, generator=g, dtype=torch.float64, device=dev) * scale
    feats = [f"scale {scale}"]
    if rng.random() < 0.3:  # peaked (LLM-like): a few tokens far above the bulk
        k = min(vocab, rng.randint(1, 4))
        top = torch.randint(0, vocab, (b, s, k), generator=g, device=dev)
        bump = rng.uniform(5, 30) + 5 * torch.rand(b, s, k, generator=g, dtype=torch.float64, device=dev)
        x.scatter_add_(-1, top, bump)
        feats.append("peaked")
    x = x.to(dtype)
    if rng.random() < 0.2:  # -inf at random tokens (a row may end up all -inf: NaN conf, as the reference's)
        frac = rng.choice([0.1, 0.5, 0.9])
        x.masked_fill_(torch.rand(b, s, vocab, generator=g, device=dev) < frac, float("-inf"))
        feats.append(f"-inf at {frac} of the tokens")
    if rng.random() < 0.15:  # half the rows have one finite token (conf exactly 1)
        rows = torch.rand(b, s, generator=g, device=dev) < 0.5
        keep = torch.randint(0, vocab, (b, s, 1), generator=g, device=dev)
        val = x.gather(-1, keep).nan_to_num(neginf=0.0)
        x[rows] = float("-inf")
        x.scatter_(-1, keep, torch.where(rows[..., None], val, x.gather(-1, keep)))
        feats.append("one finite token")
    if rng.random() < 0.2:  # tied maxima: the row's max (or a new one) at a few more tokens, across chunks
        n = min(vocab, rng.randint(1, 5))
        ids = torch.randint(0, vocab, (b, s, n), generator=g, device=dev)
        top = x.amax(-1, keepdim=True).nan_to_num(neginf=1.0) + rng.choice([0.0, 2.0])
        x.scatter_(-1, ids, top.expand(b, s, n).to(dtype))
        feats.append(f"tied maxima x{n}")
    if rng.random() < 0.05:  # all-equal logits in some rows (conf 1/V, ties to the lowest id)
        rows = torch.rand(b, s, generator=g, device=dev) < 0.5
        x[rows] = rng.choice([0.0, 1.25, -3.5])
        feats.append("constant rows")
    if rng.random() < 0.03:  # one row all -inf (conf NaN on both sides)
        x[rng.randrange(b), rng.randrange(s)] = float("-inf")
        feats.append("an all -inf row")
    if rng.random() < 0.3:  # the sampler's mask token: one -inf column
        x[..., rng.randrange(vocab)] = float("-inf")
        feats.append("-inf column")
    same = rng.random() < 0.08
    if same:  # every row the same: equal conf at every position, quota ties go to the lowest positions
        x[:] = x[:1, :1].clone()
        feats.append("identical rows")
    return x, feats, same


def _fuzz_layout(rng, x, per_vec, same_alignment):
    """x laid out as the launcher accepts it (last dim dense; any row strides, any start), padded with _PAD;
    with `same_alignment` every row starts at the same offset modulo 16 bytes (identical rows then sum in the
    same order, as on the device)."""
    b, s, vocab = x.shape
    kind = rng.choices(["dense", "offset", "padded", "transposed", "broadcast"], weights=[3, 2, 4, 2, 1])[0]
    pad = rng.choice([0, 1, 3, per_vec, rng.randint(1, 40)]) if kind in ("padded", "transposed") else 0
    off = rng.randint(0, 2 * per_vec)
    if kind in ("dense", "offset"):
        off = off if kind == "offset" else 0
        if same_alignment and vocab % per_vec:
            kind = "padded"
        else:
            flat = torch.full((off + b * s * vocab + per_vec,), _PAD, dtype=x.dtype, device=x.device)
            out = flat[off:off + b * s * vocab].view(b, s, vocab)
            out.copy_(x)
            return out, f"{kind} (start +{off})"
    width = off + vocab + pad  # the row stride
    if same_alignment:
        width += -width % per_vec
    if kind == "padded":
        buf = torch.full((b, s, width), _PAD, dtype=x.dtype, device=x.device)
        out = buf[:, :, off:off + vocab]
    elif kind == "transposed":  # sequence stride < position stride
        buf = torch.full((s, b, width), _PAD, dtype=x.dtype, device=x.device)
        out = buf[:, :, off:off + vocab].transpose(0, 1)
    else:  # stride 0 over the batch: every sequence reads the same rows
        buf = torch.full((1, s, width), _PAD, dtype=x.dtype, device=x.device)
        out = buf[:, :, off:off + vocab].expand(b, s, vocab)
        out[:1].copy_(x[:1])
        return out, f"broadcast (row stride {width}, start +{off})"
    out.copy_(x)
    return out, f"{kind} (strides {tuple(out.stride())}, start +{off})"


def near_tie(logits, masked, quota, threshold, temperature, greedy, noise, seed, offset):
    """Why the kernel may legitimately differ from the reference on this draw, or None (ops/unmask.py: conf
    is fp32 on both sides, so a position whose float64 conf is within their rounding of the threshold, or of
    another conf at the quota boundary, may select differently; sampling scores within an ulp, or bucket scores
    within the fp32 error of a logsumexp, may pick differently). The rounding: ~1e-6 each, and the reference's
    logsumexp loses ulp(max |logit / T|) (conf 1.0 for a token only nearly certain when the logits are large).
    Runs on the logits' device (the reference's picks there)."""
    tok, conf, _ = pick_tokens_reference(logits, seed, offset, temperature, 0, 1.0, greedy, noise)
    b, s, vocab = logits.shape
    dev = logits.device
    scaled = logits.double() / (temperature if temperature > 0 else 1.0)
    conf64 = (scaled.gather(-1, tok[..., None]).squeeze(-1) - torch.logsumexp(scaled, -1)).exp()
    big = scaled.abs().nan_to_num(posinf=0.0).amax(-1) if vocab else scaled.new_zeros(b, s)
    eps = 3e-6 + 4e-7 * big  # relative
    tau = torch.tensor(threshold, dtype=torch.float32).item()
    rows = masked & (quota > 0)[:, None]
    for r in range(b):
        keep = rows[r] & ~conf64[r].isnan()
        c, e, xs = conf64[r][keep], eps[r][keep], logits[r][keep]
        # a token certain to 2^-26 gets conf exactly 1.0 on both sides
        near = ((c - tau).abs() <= e * abs(tau)) & ~((tau == 1.0) & (c > 1 - 2**-26)) & (abs(tau) < math.inf)
        if near.any():
            return f"sequence {r}: float64 conf {c[near].tolist()} near the threshold"
        q = int(quota[r]) - int(rows[r].sum() - c.numel())  # NaN confs rank first
        if 0 < q < c.numel():
            hi, lo = c.sort(descending=True).values[q - 1:q + 1].tolist()
            tol = e.max().item() * hi
            # an exact tie at the boundary goes to the lower positions on both sides when the fp32 confs tie too:
            # identical rows (laid out alike), or tokens certain to 2^-26 (conf 1.0); and no conf within rounding
            # of the tied value may overtake it
            if hi == lo:
                near = c[((c - hi).abs() <= tol) & (c != hi)]
            else:
                near = c.new_tensor([lo] if hi - lo <= 2 * tol else [])
            tied = xs[c == hi]
            exact = hi != lo or hi > 1 - 2**-26 or bool((tied == tied[:1]).all())
            if lo < tau and (near.numel() or not exact):
                return f"sequence {r}: float64 confs {hi}, {near.tolist()[:4]} at the quota boundary"
    if greedy or temperature <= 0:
        return None
    flat = logits.float().view(b * s, vocab)[rows.view(-1)] / temperature
    ids = torch.arange(b * s, device=dev).view(b, s)[rows].view(-1, 1)
    if flat.numel() == 0:
        return None

    def gumbel(ctr):
        return -torch.log(-torch.log(philox_uniform(seed, offset, ctr)))

    def gap(scores):  # best minus second best per row (inf where one candidate)
        if scores.shape[-1] < 2:
            return torch.full(scores.shape[:1], float("inf"), device=dev), scores[:, 0]
        top = scores.topk(2, dim=-1).values
        return torch.where(top[:, 1] == float("-inf"), float("inf"), top[:, 0] - top[:, 1]), top[:, 0]

    if noise == "two_level" and vocab > BUCKET:
        nb = -(-vocab // BUCKET)
        padded = torch.nn.functional.pad(flat, (0, nb * BUCKET - vocab), value=float("-inf"))
        mass = torch.logsumexp(padded.view(-1, nb, BUCKET), dim=-1)
        score = mass + gumbel(BUCKET_TAG + ids * nb + torch.arange(nb, device=dev))
        d, top = gap(score)
        if (d <= 1e-5 * top.abs().clamp_min(1.0)).any():
            return "two buckets' scores within the error of a logsumexp"
        j = score.argmax(-1, keepdim=True)
        t = (j * BUCKET + torch.arange(BUCKET, device=dev)).clamp_max(vocab - 1)
        inside = j * BUCKET + torch.arange(BUCKET, device=dev) < vocab
        tscore = (flat.gather(-1, t) + gumbel(ids * vocab + t)).masked_fill(~inside, float("-inf"))
    else:
        tscore = flat + gumbel(ids * vocab + torch.arange(vocab, device=dev))
    d, top = gap(tscore)
    if (d <= 1.5e-6 * top.abs().clamp_min(1.0)).any():
        return "two tokens' perturbed scores within an ulp"
    return None


GPU_FUZZ_LOGITS = 64 * 32 * 152064  # on a GPU: B x S x V at most (64 sequences, blocks of 32, vocabulary 152064)
GPU_FUZZ_ROWS = 4096  # on a GPU: B x S at most
GPU_FUZZ_PER_TOKEN = 1 << 27  # on a GPU, per-token sampling: B x S x V at most (the reference's Philox per token)


def draw_unmask_config(case, device="cpu", gpu=False) -> dict:
    """One random configuration of the kernel's whole space from the case seed (test_emulated_unmask_random_config
    lists what is drawn), its tensors on `device`: state [logits, tokens, masked, step_map, logp, conf] (logits at
    the drawn layout), extra [step, quota, eos_ids, seed, offset], the scalar arguments, the emulator's slots /
    split / order, the reference's inputs (ref_logits, ref_t), the dense logits and mask before the step (for the
    float64 check) and `config`, the configuration in words. Logits are redrawn until no near-tie decides the result
    (near_tie, on `device`). gpu=True (test_gpu_random_config): larger shapes besides (B to 64, S 32 the most often,
    vocabulary 151936 far more often; at most GPU_FUZZ_ROWS rows and GPU_FUZZ_LOGITS logits, GPU_FUZZ_PER_TOKEN
    for per-token sampling); slots / split / order are still drawn (emulator-only). gpu=False on the CPU draws as
    before the parameters existed."""
    rng = random.Random(case)
    g = torch.Generator(device).manual_seed(case)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    per_vec = 4 if dtype == torch.float32 else 8
    mode = rng.choice(list(MODES))
    greedy, noise = MODES[mode]
    if mode == "greedy":
        noise = rng.choice(["two_level", "per_token"])
        if rng.random() < 0.25:  # temperature <= 0 is greedy too
            greedy = False
    vocab = _fuzz_vocab(rng, per_vec, gpu)
    big = vocab > 40000
    s = rng.choices([1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, rng.randint(34, 100), rng.choice([255, 256, 1024])],
                    weights=[4, 2, 3, 8, 2, 2, 8, 2, 5, 3, 3, 24, 3, 2, 2] if gpu else
                    [6, 3, 4, 8, 3, 3, 8, 3, 5, 3, 3, 8, 3, 2, 1])[0]
    if gpu:
        b = rng.choices([1, 2, 3, 4, 5, 8, rng.randint(9, 24), 32, 64, rng.randint(25, 64)],
                        weights=[4, 3, 3, 3, 2, 3, 3, 3, 5, 3])[0]
    else:
        b = rng.choices([1, 2, 3, 4, 5, 8, rng.randint(9, 24)], weights=[6, 5, 5, 4, 3, 2, 1])[0]
    # keep a case cheap (for the emulator: at most ~1.5M logits and ~256 rows)
    rows_cap, logits_cap = (GPU_FUZZ_ROWS, GPU_FUZZ_LOGITS) if gpu else (256, 600_000 if big else 1_500_000)
    while b * s > rows_cap or b * s * vocab > logits_cap:
        if b > 1:
            b = max(1, b // 2)
        elif s > 1:
            s = max(1, s // 2)
        else:
            vocab = max(1, vocab // 2)
    if greedy:
        temperature = rng.choice([1.0, 1.0, 0.5, 2.0, 0.7, 1.3, rng.uniform(0.05, 4.0)])
    elif mode == "greedy":
        temperature = rng.choice([0.0, -1.0, -0.0])
    else:
        temperature = rng.choice([1.0, 1.0, 0.5, 2.0, 0.25, 0.7, 1.3, rng.uniform(0.05, 4.0), 1e-2, 30.0])
    sampling = not greedy and temperature > 0
    per_token_cap = GPU_FUZZ_PER_TOKEN if gpu else 300_000 if temperature > 1.5 else 800_000
    while noise == "per_token" and sampling and b * s * vocab > per_token_cap:
        b, s = (b // 2, s) if b > 1 else (b, s // 2) if s > 1 else (b, s)  # flat rows: a Philox draw per token
        vocab = vocab if b * s > 1 else min(vocab, 300_000)
    if sampling:  # the kernel samples the untruncated distribution; the op dispatches top-k >= V to it
        top_k, top_p = rng.choice([0, 0, vocab, vocab + rng.randint(1, 9)]), 1.0
    else:  # ignored by greedy picks
        top_k, top_p = rng.choice([0, 1, rng.randint(1, vocab + 2)]), rng.choice([1.0, 0.5, 0.9])
    threshold = rng.choice([0.0, 1.0, 0.9, 0.5, rng.random(), rng.uniform(0, 0.05), 2.0, -0.5, math.inf, -math.inf])
    frac = rng.choice([0.0, 1.0, 0.3, 0.7, rng.random()])
    quota = torch.tensor([rng.choice([1, 1, 2, 3, 0, -2, s, s + 3, rng.randint(1, max(1, s)), 2**31 - 1, -2**31])
                          for _ in range(b)], dtype=torch.int32, device=device)
    step = torch.tensor([rng.choice([0, 1, 7, -1, rng.randint(0, 2**31 - 1), -2**31]) for _ in range(b)],
                        dtype=torch.int32, device=device)
    n_eos = rng.choice([0, 1, 2, 3, 8, 100])
    eos = [rng.choice([rng.randrange(vocab), rng.randrange(vocab), vocab + rng.randint(0, 5), -1, 0])
           for _ in range(n_eos)]
    seed = torch.tensor([rng.randint(-2**63, 2**63 - 1)], device=device)
    offset = torch.tensor([rng.choice([0, 5, rng.randint(-2**63, 2**63 - 1)])], device=device)
    slots = rng.choice([132 * 4, 132 * 3, 114 * 4, 16, 1, rng.randint(1, 2000)])
    max_split = _max_split(vocab, per_vec, greedy or temperature <= 0, noise)
    split = rng.choice([0, 0, 1, rng.randint(1, max_split), max_split, rng.randint(1, 64)])
    while split > 1 and b * s * split > 1024:  # emulated CTAs
        split //= 2
    order = rng.choice([0, rng.getrandbits(63) | 1, EMU_GREEDY | rng.getrandbits(63)])

    for attempt in range(40):  # redraw the logits until no near-tie decides the result
        x, feats, same = _fuzz_logits(rng, g, b, s, vocab, dtype)
        masked = torch.rand(b, s, generator=g, device=device) < frac
        logits, layout = _fuzz_layout(rng, x, per_vec, same)
        dense = logits.contiguous()
        # sampling: the kernel multiplies by fl(1 / T), as torch does on CUDA; the CPU reference divides, so it
        # gets the logits so scaled (rounded once in fp32) and T = 1: the same scores, hence the same picks (on
        # CUDA the very product the reference's own x / T computes)
        inv_t = torch.tensor(1.0 / torch.tensor(temperature, dtype=torch.float32).item() if sampling else 1.0,
                             dtype=torch.float32)
        ref_logits, ref_t = (dense.float() * inv_t, 1.0) if sampling else (dense, temperature)
        why = near_tie(ref_logits, masked, quota, threshold, ref_t, greedy, noise, seed, offset)
        if why is None:
            break
    assert kernel_supported(logits, temperature, top_k, top_p, greedy)

    tokens = torch.where(masked, -5, torch.randint(0, vocab, (b, s), generator=g, device=device))
    if eos and rng.random() < 0.5:  # some already unmasked tokens are EOS ids, prompt (step_map < 0) or not
        tokens = torch.where(torch.rand(b, s, generator=g, device=device) < 0.3, eos[0], tokens)
        tokens = torch.where(masked, -5, tokens)
    step_map = torch.where(masked, -7, torch.randint(-2, 4, (b, s), generator=g, device=device)).int()
    logp = torch.where(masked, float("nan"), torch.rand(b, s, generator=g, device=device).log())
    conf = torch.where(masked, -9.0, logp.exp())
    state = [logits, tokens, masked.clone(), step_map, logp, conf]
    extra = [step, quota, torch.tensor(eos, dtype=torch.int64, device=device), seed, offset]
    # drawn last, so the draws above are those of the cases before layouts were drawn
    out_layout = rng.choice(["dense", "dense", "padded", "every other", "transposed"])
    in_layout = rng.choice(["dense", "every other"])
    # drawn after the layouts, likewise: none (the default numbering), a permutation, or any non-negative indices
    # (repeats included), laid out dense or every other element
    rows_kind = rng.choice(["none", "none", "permutation", "any"])
    noise_rows = None
    if rows_kind != "none":
        cpu_gen = torch.Generator().manual_seed(case)
        noise_rows = (torch.randperm(b, generator=cpu_gen) if rows_kind == "permutation"
                      else torch.randint(0, 3 * b + 5, (b,), generator=cpu_gen))
        noise_rows = _laid_out(noise_rows.to(device), in_layout)[0]
    # drawn after noise_rows, likewise: the logits as drawn ([B, S, V]) or compact ([M, V] + logit_rows)
    logit_rows = None
    if rng.random() < 0.25:
        state[0], logit_rows = compact_logits(dense, masked, quota, rng, g, same)
    config = (f"case {case}: {dtype} B={b} S={s} V={vocab} mode={mode} greedy={greedy} noise={noise} T={temperature} "
              f"top_k={top_k} top_p={top_p} tau={threshold} frac_masked={frac:.2f} ({int(masked.sum())} masked) "
              f"quota={quota.tolist()} step={step.tolist()} eos={eos} seed={seed.item()} offset={offset.item()} "
              f"{'(emulator only: ' if gpu else ''}slots={slots} split={split} (launcher max {max_split}) "
              f"order={order:#x}{')' if gpu else ''} layout={layout} outputs={out_layout} step/quota/eos={in_layout} "
              f"noise_rows={None if noise_rows is None else noise_rows.tolist()} "
              f"logits={'compact ' + str(list(state[0].shape)) if logit_rows is not None else 'full'} "
              f"logits: {', '.join(feats)}; redrawn {attempt}x" + (f" (still: {why})" if why else ""))
    return dict(state=state, extra=extra, threshold=threshold, temperature=temperature, greedy=greedy, noise=noise,
                top_k=top_k, top_p=top_p, slots=slots, split=split, order=order, ref_logits=ref_logits, ref_t=ref_t,
                dense=dense, masked=masked, config=config, out_layout=out_layout, in_layout=in_layout,
                noise_rows=noise_rows, logit_rows=logit_rows)


def _laid_out(t: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, base): a copy of t ([B, S] or [N]) as a view of `kind` into a larger `base` whose other elements hold
    a sentinel (so that a write outside the view shows): "dense" (base = view), "padded" (rows of S + 3 from column
    2), "every other" (every other column / element), "transposed" ([S, B] storage: batch stride 1)."""
    if kind == "dense":
        view = t.clone()
        return view, view
    sentinel = True if t.dtype == torch.bool else -3
    if t.ndim == 1:
        base = torch.full((2 * t.shape[0] + 1,), sentinel, dtype=t.dtype, device=t.device)
        view = base[1::2]
    elif kind == "padded":
        base = torch.full((t.shape[0], t.shape[1] + 3), sentinel, dtype=t.dtype, device=t.device)
        view = base[:, 2 : 2 + t.shape[1]]
    elif kind == "every other":
        base = torch.full((t.shape[0], 2 * t.shape[1]), sentinel, dtype=t.dtype, device=t.device)
        view = base[:, ::2]
    else:
        base = torch.full((t.shape[1], t.shape[0]), sentinel, dtype=t.dtype, device=t.device)
        view = base.t()
    view.copy_(t)
    return view, base


def _outside(view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The elements of `base` that `view` does not cover, as a flat tensor."""
    inside = torch.zeros(base.shape, dtype=torch.bool, device=base.device)
    inside.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()).fill_(True)
    return base[~inside]


def check_random_config(case, run, device="cpu", gpu=False):
    """The configuration draw_unmask_config(case, device, gpu) draws, run by `run(state, extra, cfg)` (the kernel, in
    place on `state`; -> its (block_done, eos_seen)) and compared with the reference on `device` (on CUDA the same
    Philox stream, logf and x * fl(1 / T) as the kernel): tokens, mask, step map and flags exactly (near ties were
    redrawn), logp / conf against float64 (_assert_same_step_fp64). A failure names the configuration."""
    c = draw_unmask_config(case, device, gpu)
    print(c["config"])
    ref = clone(c["state"])
    ref[0] = c["ref_logits"]
    want = threshold_unmask_reference(*ref, *c["extra"], c["threshold"], c["ref_t"], c["top_k"], c["top_p"],
                                      c["greedy"], c["noise"], c["noise_rows"])  # the full logits, no map
    # the kernel's inputs in the drawn layouts (a clone of a padded view is dense): the logits', the outputs' and
    # the per-sequence arrays'
    outs = [_laid_out(t, c["out_layout"]) for t in c["state"][1:]]
    ins = [_laid_out(t, c["in_layout"]) for t in c["extra"][:3]]
    got = [c["state"][0]] + [v for v, _ in outs]
    extra = [v for v, _ in ins] + clone(c["extra"][3:])
    around = [_outside(v, b).clone() for v, b in outs + ins]
    try:
        flags = run(got, extra, c)
        _assert_same_step_fp64(got, flags, ref, want, c["masked"], c["dense"], c["temperature"])
        for (v, b), before in zip(outs + ins, around):
            assert torch.equal(_outside(v, b), before), f"written outside a {c['out_layout']} output"
    except AssertionError as e:
        raise AssertionError(f"{c['config']}: {e}") from e


def _assert_same_step_fp64(got, got_flags, ref, want_flags, masked, logits, temperature, rtol=1e-5, atol=2e-6):
    """assert_same_step, with logp / conf of the written positions within rtol / atol of float64 plus twice the
    fp32 reference's error, at least its rounding of the pick's and the max's scaled logits (fl(x / T): 2^-24
    of their magnitudes each; the reference may be luckier on one position, and where |x / T| is large, T << 1,
    that error is far above rtol); every other position bit-equal. `masked`: the mask before the step."""
    for name, g, w in zip(["tokens", "masked", "step_map"], got[1:4], ref[1:4]):
        assert torch.equal(g, w), f"{name} differs at {(g != w).nonzero()[:5].tolist()}"
    assert torch.equal(got_flags[0], want_flags[0]), "block_done"
    assert torch.equal(got_flags[1], want_flags[1]), "eos_seen"
    scaled = logits.double() / (temperature if temperature > 0 else 1.0)
    tok = got[1].clamp(0, logits.shape[-1] - 1)
    s_pick = scaled.gather(-1, tok[..., None]).squeeze(-1)
    logp64 = s_pick - torch.logsumexp(scaled, -1)
    rounding = 2**-24 * (s_pick.abs() + scaled.amax(-1).abs()).nan_to_num(nan=0.0, posinf=0.0)  # of logp
    for name, g, w, r64, fl in (("logp", got[4], ref[4], logp64, rounding),
                                ("conf", got[5], ref[5], logp64.exp(), rounding * logp64.exp())):
        same = (g == w) | (g.isnan() & w.isnan())
        err_k, err_r = (g.double() - r64).abs(), (w.double() - r64).abs()
        close = (err_k <= 2 * torch.maximum(err_r, fl) + atol + rtol * r64.abs()) | (g.isnan() & r64.isnan())
        ok = same | (masked & ~got[2] & close)
        assert ok.all(), (f"{name} differs at {(~ok).nonzero()[:5].tolist()}: kernel {g[~ok][:5].tolist()}, "
                          f"reference {w[~ok][:5].tolist()}, float64 {r64[~ok][:5].tolist()}")


# ---------------------------------------------------------------------------- the CUDA kernel (GPU)


@pytest.fixture
def cuda_kernels(cuda_ext_with):
    """The CUDA kernel must be what runs, else a GPU test would compare the reference with itself."""
    return cuda_ext_with("threshold_unmask").threshold_unmask


GPU_FUZZ_CASES = 64  # estimated (not yet timed): ~1.4G logits over the 64 default cases, ~1 s for the largest


def op_runner(device):
    """`run` for check_random_config: the public op on `device` (on CUDA the kernel: every drawn configuration is
    kernel_supported; on the CPU the reference), its two flags checked for bytes other than 0 / 1 (on CUDA they come
    from at::empty: freed blocks of the caching allocator are filled with 0xA5 first, so a flag the kernel never
    wrote likely reads 0xA5; best effort)."""

    def run(state, extra, c):
        junk = [torch.full((512,), 0xA5, dtype=torch.uint8, device=device) for _ in range(64)]
        del junk
        flags = threshold_unmask(*state, *extra, threshold=c["threshold"], temperature=c["temperature"],
                                 top_k=c["top_k"], top_p=c["top_p"], greedy=c["greedy"], noise=c["noise"],
                                 noise_rows=c["noise_rows"], logit_rows=c["logit_rows"])
        for name, f in zip(("block_done", "eos_seen"), flags):
            assert f.device == state[0].device and f.dtype == torch.bool, (name, f.device, f.dtype)
            assert bool((f.view(torch.uint8) <= 1).all()), f"{name} left unwritten: {f.view(torch.uint8).tolist()}"
        return flags

    return run


@pytest.mark.gpu
@pytest.mark.parametrize("case", fuzz_cases(GPU_FUZZ_CASES))
def test_gpu_random_config(cuda_kernels, case):
    """The CUDA kernel through the public op on a random configuration of the emulator's space
    (test_unmask_emu.test_emulated_unmask_random_config: dtypes, modes incl. T <= 0, temperatures, thresholds,
    quotas, masks, -inf / tied / peaked / constant / identical rows, EOS ids, row layouts (misaligned, padded,
    transposed, broadcast), output layouts (padded, every other position, transposed; nothing outside written),
    strided step / quota / EOS arrays, Philox seed and offset) with larger shapes (B to 64, S 32 the most often,
    vocabulary 151936 far more often: draw_unmask_config(gpu=True)), the reference on CUDA; checked as there (near
    ties redrawn, so picks, selection, writes and flags exactly; logp / conf against float64). The split of a row is
    the launcher's for this GPU; the forced split, slot count and schedule seed are emulator-only (drawn, not used)."""
    check_random_config(case, op_runner("cuda"), "cuda", gpu=True)
