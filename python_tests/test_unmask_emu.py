"""ops.threshold_unmask's CUDA kernel (csrc/kernels/unmask.cuh) run on the CPU by the emulator of device code
(csrc/emu/unmask_emu.cpp over the CUDA-builtins front-end), against the reference op: picks, selection, in-place
writes and flags exactly (the same Philox stream when sampling), log-probs and confidences within tolerance; the
split of a row over CTAs, the CTA-shared pruning threshold, misaligned and strided rows, edge cases, the full
151936 vocabulary. test_unmask.py holds the reference's own tests and the kernel's tests on a GPU."""

import ctypes
import math
import random

import pytest
import torch
from conftest import EMU_GREEDY, fuzz_cases
from test_unmask import MODES, assert_same_step, case, clone

from lightningrl_fast.ops.unmask import (
    BUCKET,
    BUCKET_TAG,
    kernel_supported,
    philox_uniform,
    pick_tokens_reference,
    threshold_unmask_reference,
)


_EMU_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class Emulated:
    """`_C.threshold_unmask`'s device code run by the CPU emulator (CPU tensors, [B, S] tensors contiguous)."""

    def __init__(self, lib):
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn = lib.emu_threshold_unmask
        fn.restype = i32
        fn.argtypes = [i32, p, i64, i64, i32, i32, i32, p, p, p, p, p, p, p, p, i32, p, p, ctypes.c_double,
                       ctypes.c_double, i32, i32, p, p, i64, i32, ctypes.c_uint64, p]
        self.fn = fn
        self.take_draws = lib.emu_take_gumbel_draws
        self.take_draws.restype = ctypes.c_uint64

    def __call__(self, logits, tokens, masked, step_map, logp, conf, step, quota, eos_ids, seed, offset,
                 threshold=0.9, temperature=1.0, greedy=False, noise="two_level", slots=528, split=0, order=1):
        b, s, vocab = logits.shape
        assert logits.stride(-1) == 1 or vocab == 1
        for t in (tokens, masked, step_map, logp, conf, step, quota, eos_ids, seed, offset):
            assert t.is_contiguous() and t.device.type == "cpu"
        # poisoned (byte 0xA5, neither False nor True): the kernel must write every sequence's flags
        done, eos_seen = torch.full((b,), 0xA5, dtype=torch.uint8), torch.full((b,), 0xA5, dtype=torch.uint8)
        nsplit = ctypes.c_int(0)
        rc = self.fn(_EMU_DTYPES[logits.dtype], logits.data_ptr(), logits.stride(0), logits.stride(1), b, s, vocab,
                     tokens.data_ptr(), masked.data_ptr(), step_map.data_ptr(), logp.data_ptr(), conf.data_ptr(),
                     step.data_ptr(), quota.data_ptr(), eos_ids.data_ptr(), eos_ids.numel(), seed.data_ptr(),
                     offset.data_ptr(), threshold, temperature, int(greedy), int(noise == "two_level"),
                     done.data_ptr(), eos_seen.data_ptr(),
                     slots, split, order, ctypes.byref(nsplit))
        assert rc == 0, "the kernel left a sequence or row counter non-zero"
        assert bool((done <= 1).all() and (eos_seen <= 1).all()), f"flags left unwritten: {done}, {eos_seen}"
        self.nsplit = nsplit.value
        return done.view(torch.bool), eos_seen.view(torch.bool)


@pytest.fixture(scope="module")
def emu(emu_build):
    """csrc/emu/unmask_emu.cpp (kernels/unmask.cuh over the CUDA-builtins front-end) as a ctypes library."""
    return Emulated(ctypes.CDLL(str(emu_build("unmask_emu.cpp", shared=True, cuda_headers=True))))


def run_both(emu, state, extra, threshold, temperature, greedy, noise="two_level", **emu_kw):
    ref = clone(state)
    want = threshold_unmask_reference(*ref, *extra, threshold, temperature, 0, 1.0, greedy, noise)
    got = clone(state)
    flags = emu(*got, *extra, threshold=threshold, temperature=temperature, greedy=greedy, noise=noise, **emu_kw)
    return got, flags, ref, want




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("b,s,vocab,split", [(3, 4, 111, 0), (2, 8, 1000, 3), (1, 32, 5003, 0), (2, 3, 4099, 5),
                                              (1, 3, 20011, 40), (2, 2, 111, 40), (2, 3, 9216, 0)])
def test_emulated_kernel_matches_reference(emu, dtype, mode, b, s, vocab, split):
    """Picks, selection, in-place writes and flags equal the reference's (same Philox stream when sampling);
    `split` forces chunks per row (0 = the launcher's choice; 40 > 32 lanes per merge group; with vocab 111
    most chunks are empty; two-level: more chunks than buckets), blocks run in a shuffled order, their threads
    interleaved at random."""
    greedy, noise = MODES[mode]
    state, extra = case(b, s, vocab, dtype, seed=vocab + s)
    got, flags, ref, want = run_both(emu, state, extra, 0.3, 1.0, greedy, noise, split=split,
                                     order=vocab if vocab % 2 else EMU_GREEDY | vocab)
    assert split == 0 or emu.nsplit == split
    assert_same_step(got, flags, ref, want)


@pytest.mark.parametrize("order", [0, 7, EMU_GREEDY | 7])
def test_emulated_sampling_prunes_with_the_cta_threshold(emu, order):
    """LLM-like rows (a few tokens 25-30 above N(0, 2) noise): the picks still equal the reference's exactly,
    and the warps share the CTA's threshold (the best score so far, and s_max - 2.82 before any noise), so
    most of the bulk is pruned without drawing noise. With per-warp thresholds only, the seven warps that never
    meet a dominant token drew noise for nearly all of their tokens (> 80% of the row)."""
    b, s, vocab = 2, 4, 20011
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(b, s, vocab, generator=g) * 2
    top = torch.randint(0, vocab, (b, s, 4), generator=g)
    logits.scatter_add_(-1, top, 25 + 5 * torch.rand(b, s, 4, generator=g))
    state, extra = case(b, s, vocab, torch.float32, seed=3, frac_masked=1.0, quota=(1, 2))
    state[0] = logits
    emu.take_draws()
    got, flags, ref, want = run_both(emu, state, extra, 0.5, 1.0, False, "per_token", split=1, order=order)
    assert_same_step(got, flags, ref, want)
    draws = emu.take_draws()
    assert 0 < draws < 0.5 * b * s * vocab, f"{draws} noise draws for {b * s * vocab} tokens"
    # flat logits (all within 17 of each other): every token is a candidate, nothing may be skipped
    state[0] = torch.randn(b, s, vocab, generator=g)
    got, flags, ref, want = run_both(emu, state, extra, 0.5, 1.0, False, "per_token", split=1, order=order)
    assert_same_step(got, flags, ref, want)
    assert emu.take_draws() > 0.9 * b * s * vocab


@pytest.mark.parametrize("split", [1, 3])
def test_emulated_two_level_draws_one_value_per_bucket_and_per_token_of_one(emu, split):
    """Two-level sampling draws exactly n_buckets + (the chosen bucket's size) noise values per scanned row,
    on flat and on peaked logits alike (per-token sampling drew > 90% of the row on flat logits)."""
    b, s, vocab = 2, 4, 20011  # 20 buckets, the last one of 555 tokens
    g = torch.Generator().manual_seed(8)
    for peaked in (False, True):
        state, extra = case(b, s, vocab, torch.float32, seed=3, frac_masked=0.75, quota=(1, 2))
        state[0] = torch.randn(b, s, vocab, generator=g)
        if peaked:
            state[0][..., 19500] += 30.0  # the pick is in the short last bucket
        emu.take_draws()
        got, flags, ref, want = run_both(emu, state, extra, 0.5, 1.0, False, split=split, order=5)
        assert_same_step(got, flags, ref, want)
        rows = int(state[2].sum())
        draws = emu.take_draws()
        if peaked:
            assert draws == rows * (20 + 555)
        else:
            assert rows * (20 + 555) <= draws <= rows * (20 + 1024)


def test_emulated_split_choice_fills_the_gpu(emu):
    """One sequence of 32 rows over 151936 tokens is split so that >= 95% of 132 x 4 CTA slots are busy."""
    state, extra = case(1, 32, 151936, torch.bfloat16, seed=0, frac_masked=0.0)  # nothing masked: no scan
    emu(*state, *extra, greedy=True, slots=132 * 4)
    assert emu.nsplit * 32 >= 0.95 * 528 and emu.nsplit <= 64
    emu(*state, *extra, greedy=False, noise="two_level", slots=132 * 4)  # whole buckets: <= 149 / 8 chunks
    assert emu.nsplit * 32 >= 0.95 * 528 and emu.nsplit <= 18


@pytest.mark.parametrize("noise", ["two_level", "per_token"])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_emulated_sampling_temperature(emu, temperature, noise):
    """T != 1: the kernel multiplies by 1/T (as torch does on CUDA); the CPU reference divides, so a pick may
    differ only where two perturbed scores are within an ulp: tau 0 writes every pick, compare them."""
    state, extra = case(2, 16, 3001, torch.float32, seed=5, frac_masked=1.0)
    got, flags, ref, want = run_both(emu, state, extra, 0.0, temperature, False, noise)
    same = (got[1] == ref[1]).float().mean().item()
    assert same >= 0.97, same
    agree = got[1] == ref[1]
    torch.testing.assert_close(got[4][agree], ref[4][agree], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", list(MODES))
def test_emulated_misaligned_strided_rows(emu, dtype, mode):
    """Rows that start off a 16-byte boundary (scalar head + vectors + scalar tail; two-level: scalar reads)
    and padded row strides."""
    greedy, noise = MODES[mode]
    state, extra = case(2, 5, 2100, dtype, seed=11)
    buf = torch.full((2, 5, 2103), 77.0, dtype=dtype)  # 77 is never read
    buf[:, :, 1:2101] = state[0]
    strided = buf[:, :, 1:2101]
    assert strided.data_ptr() % 16 != 0
    ref = clone(state)
    want = threshold_unmask_reference(*ref, *extra, 0.5, 1.0, 0, 1.0, greedy, noise)
    got = [strided] + clone(state[1:])
    flags = emu(*got, *extra, threshold=0.5, greedy=greedy, noise=noise, split=3)
    assert_same_step(got, flags, ref, want)


@pytest.mark.parametrize("mode", list(MODES))
def test_emulated_edge_cases(emu, mode):
    greedy, noise = MODES[mode]
    # nothing masked: a no-op; flags from the current state (prompt EOS at step_map < 0 does not count)
    state, extra = case(3, 4, 111, torch.float32, seed=1, frac_masked=0.0)
    state[1][0, 1], state[3][0, 1] = 3, -1  # a prompt token that is an EOS id
    state[1][1, 2], state[3][1, 2] = 7, 4  # a generated EOS
    got, flags, ref, want = run_both(emu, state, extra, 0.9, 1.0, greedy, noise)
    assert_same_step(got, flags, ref, want)
    assert all(torch.equal(a, b) for a, b in zip(got, state)) and flags[0].all()
    assert flags[1].tolist() == [False, True, False]

    # tau 0 unmasks every masked position of active rows; tau 1 exactly quota of them
    state, extra = case(4, 8, 257, torch.bfloat16, seed=2, frac_masked=1.0)
    for tau in (0.0, 1.0):
        got, flags, ref, want = run_both(emu, state, extra, tau, 1.0, greedy, noise)
        assert_same_step(got, flags, ref, want)
        left = got[2].sum(1).tolist()
        assert left == ([0, 0, 8, 0] if tau == 0.0 else [7, 6, 8, 5])

    # -inf logits (the mask token, half the vocabulary, all but one token) and all-equal logits
    b, s, vocab = 3, 4, 151
    logits = torch.randn(b, s, vocab)
    logits[..., 150] = float("-inf")
    logits[0, :, ::2] = float("-inf")
    logits[1] = float("-inf")
    logits[1, :, 42] = 5.0
    logits[2] = 1.25
    state = [logits, torch.zeros(b, s, dtype=torch.long), torch.ones(b, s, dtype=torch.bool),
             torch.full((b, s), -1, dtype=torch.int32), torch.zeros(b, s), torch.zeros(b, s)]
    extra = [torch.ones(b, dtype=torch.int32), torch.ones(b, dtype=torch.int32), torch.tensor([42]),
             torch.tensor([9]), torch.tensor([1])]
    got, flags, ref, want = run_both(emu, state, extra, 0.0, 1.0, greedy, noise)
    assert_same_step(got, flags, ref, want)
    assert (got[1][1] == 42).all() and torch.equal(got[5][1], torch.ones(s))  # exactly 1, as the reference
    if greedy:
        assert (got[1][2] == 0).all()  # ties go to the lowest token id
    torch.testing.assert_close(got[5][2], torch.full((s,), 1 / vocab))
    assert flags[1].tolist() == [False, True, False] or not greedy

    # tiny vocabularies (shorter than one 16-byte vector)
    for vocab, dtype in ((1, torch.float32), (3, torch.float32), (7, torch.bfloat16), (9, torch.float16)):
        state, extra = case(2, 3, vocab, dtype, seed=vocab)
        got, flags, ref, want = run_both(emu, state, extra, 0.5, 1.0, greedy, noise, split=1)
        assert_same_step(got, flags, ref, want)


def test_emulated_ties_go_to_lowest_index_across_chunks(emu):
    """Greedy: equal maxima in different chunks -> the lowest token id; equal conf -> the lowest positions.
    (vocab a multiple of 8: every row has the same 16-byte alignment, hence the same summation order and
    bit-equal confidences; rows aligned differently may differ in the last ulp of conf.)"""
    b, s, vocab = 1, 8, 5008
    logits = torch.randn(b, s, vocab).to(torch.bfloat16)
    for t in (4000, 17, 2500, 4999):
        logits[..., t] = 9.0
    state = [logits, torch.zeros(b, s, dtype=torch.long), torch.ones(b, s, dtype=torch.bool),
             torch.zeros(b, s, dtype=torch.int32), torch.zeros(b, s), torch.zeros(b, s)]
    state[0][:] = state[0][:, :1]  # identical rows: equal confidence at every position
    extra = [torch.ones(b, dtype=torch.int32), torch.tensor([3], dtype=torch.int32), torch.tensor([0]),
             torch.tensor([0]), torch.tensor([0])]
    got, flags, ref, want = run_both(emu, state, extra, 1.0, 1.0, True, split=7, order=3)
    assert_same_step(got, flags, ref, want)
    assert got[2].tolist() == [[False] * 3 + [True] * 5] and (got[1][0, :3] == 17).all()


def test_emulated_full_vocabulary(emu):
    """vocab 151936 (Qwen2/SDAR), bf16, the launcher's split for a 132-SM GPU, masked and unmasked rows."""
    state, extra = case(1, 4, 151936, torch.bfloat16, seed=4, frac_masked=0.75, quota=(2,))
    state[0][..., 151669] = float("-inf")
    for greedy, noise in MODES.values():
        got, flags, ref, want = run_both(emu, state, extra, 0.9, 1.0, greedy, noise, slots=132 * 4, order=7)
        assert emu.nsplit > 1
        assert_same_step(got, flags, ref, want)


# ------------------------------------------------------------------ random configurations (fuzzing)

_PAD = 1000.0  # fills the bytes around the rows of a padded layout: a read outside its row would win the pick


def _max_split(vocab, per_vec, greedy, noise):
    """unmask_max_split (csrc/kernels/unmask.cuh): the most chunks the launcher may cut a row into."""
    n = -(-vocab // BUCKET) // 8 if not greedy and noise == "two_level" else vocab // per_vec // 512
    return max(1, min(64, n))


def _fuzz_vocab(rng, per_vec):
    kind = rng.choices(["tiny", "small", "vector", "chunk", "bucket", "medium", "large"],
                       weights=[10, 25, 12, 15, 15, 18, 5])[0]
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
    return rng.choice([151936, 152064, rng.randint(30000, 160000)])


def _fuzz_logits(rng, g, b, s, vocab, dtype):
    """[b, s, vocab] logits in `dtype` (random, with the drawn features) and the features' names."""
    scale = rng.choice([0.5, 1.0, 3.0, 8.0])
    x = torch.randn(b, s, vocab, generator=g, dtype=torch.float64) * scale
    feats = [f"scale {scale}"]
    if rng.random() < 0.3:  # peaked (LLM-like): a few tokens far above the bulk
        k = min(vocab, rng.randint(1, 4))
        top = torch.randint(0, vocab, (b, s, k), generator=g)
        x.scatter_add_(-1, top, rng.uniform(5, 30) + 5 * torch.rand(b, s, k, generator=g, dtype=torch.float64))
        feats.append("peaked")
    x = x.to(dtype)
    if rng.random() < 0.2:  # -inf at random tokens (a row may end up all -inf: NaN conf, as the reference's)
        frac = rng.choice([0.1, 0.5, 0.9])
        x.masked_fill_(torch.rand(b, s, vocab, generator=g) < frac, float("-inf"))
        feats.append(f"-inf at {frac} of the tokens")
    if rng.random() < 0.15:  # half the rows have one finite token (conf exactly 1)
        rows = torch.rand(b, s, generator=g) < 0.5
        keep = torch.randint(0, vocab, (b, s, 1), generator=g)
        val = x.gather(-1, keep).nan_to_num(neginf=0.0)
        x[rows] = float("-inf")
        x.scatter_(-1, keep, torch.where(rows[..., None], val, x.gather(-1, keep)))
        feats.append("one finite token")
    if rng.random() < 0.2:  # tied maxima: the row's max (or a new one) at a few more tokens, across chunks
        n = min(vocab, rng.randint(1, 5))
        ids = torch.randint(0, vocab, (b, s, n), generator=g)
        top = x.amax(-1, keepdim=True).nan_to_num(neginf=1.0) + rng.choice([0.0, 2.0])
        x.scatter_(-1, ids, top.expand(b, s, n).to(dtype))
        feats.append(f"tied maxima x{n}")
    if rng.random() < 0.05:  # all-equal logits in some rows (conf 1/V, ties to the lowest id)
        rows = torch.rand(b, s, generator=g) < 0.5
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
            flat = torch.full((off + b * s * vocab + per_vec,), _PAD, dtype=x.dtype)
            out = flat[off:off + b * s * vocab].view(b, s, vocab)
            out.copy_(x)
            return out, f"{kind} (start +{off})"
    width = off + vocab + pad  # the row stride
    if same_alignment:
        width += -width % per_vec
    if kind == "padded":
        buf = torch.full((b, s, width), _PAD, dtype=x.dtype)
        out = buf[:, :, off:off + vocab]
    elif kind == "transposed":  # sequence stride < position stride
        buf = torch.full((s, b, width), _PAD, dtype=x.dtype)
        out = buf[:, :, off:off + vocab].transpose(0, 1)
    else:  # stride 0 over the batch: every sequence reads the same rows
        buf = torch.full((1, s, width), _PAD, dtype=x.dtype)
        out = buf[:, :, off:off + vocab].expand(b, s, vocab)
        out[:1].copy_(x[:1])
        return out, f"broadcast (row stride {width}, start +{off})"
    out.copy_(x)
    return out, f"{kind} (strides {tuple(out.stride())}, start +{off})"


def _near_tie(logits, masked, quota, threshold, temperature, greedy, noise, seed, offset):
    """Why the kernel may legitimately differ from the reference on this draw, or None (ops/unmask.py: conf
    is fp32 on both sides, so a position whose float64 conf is within their rounding of the threshold, or of
    another conf at the quota boundary, may select differently; sampling scores within an ulp, or bucket scores
    within the fp32 error of a logsumexp, may pick differently). The rounding: ~1e-6 each, and the reference's
    logsumexp loses ulp(max |logit / T|) (conf 1.0 for a token only nearly certain when the logits are large)."""
    tok, conf, _ = pick_tokens_reference(logits, seed, offset, temperature, 0, 1.0, greedy, noise)
    b, s, vocab = logits.shape
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
    ids = torch.arange(b * s).view(b, s)[rows].view(-1, 1)
    if flat.numel() == 0:
        return None

    def gumbel(ctr):
        return -torch.log(-torch.log(philox_uniform(seed, offset, ctr)))

    def gap(scores):  # best minus second best per row (inf where one candidate)
        if scores.shape[-1] < 2:
            return torch.full(scores.shape[:1], float("inf")), scores[:, 0]
        top = scores.topk(2, dim=-1).values
        return torch.where(top[:, 1] == float("-inf"), float("inf"), top[:, 0] - top[:, 1]), top[:, 0]

    if noise == "two_level" and vocab > BUCKET:
        nb = -(-vocab // BUCKET)
        padded = torch.nn.functional.pad(flat, (0, nb * BUCKET - vocab), value=float("-inf"))
        mass = torch.logsumexp(padded.view(-1, nb, BUCKET), dim=-1)
        score = mass + gumbel(BUCKET_TAG + ids * nb + torch.arange(nb))
        d, top = gap(score)
        if (d <= 1e-5 * top.abs().clamp_min(1.0)).any():
            return "two buckets' scores within the error of a logsumexp"
        j = score.argmax(-1, keepdim=True)
        t = (j * BUCKET + torch.arange(BUCKET)).clamp_max(vocab - 1)
        inside = j * BUCKET + torch.arange(BUCKET) < vocab
        tscore = (flat.gather(-1, t) + gumbel(ids * vocab + t)).masked_fill(~inside, float("-inf"))
    else:
        tscore = flat + gumbel(ids * vocab + torch.arange(vocab))
    d, top = gap(tscore)
    if (d <= 1.5e-6 * top.abs().clamp_min(1.0)).any():
        return "two tokens' perturbed scores within an ulp"
    return None


@pytest.mark.parametrize("case", fuzz_cases(16))
def test_emulated_unmask_random_config(emu, case):
    """One random configuration per case seed, against the reference as the fixed tests compare (picks,
    selection, writes and flags exactly, the same Philox stream when sampling; logp / conf within tolerance):
    dtype; batch; block size S (1, 4, 8, 32, odd, rarely up to 1024); vocabulary (tiny, odd, at and around the
    vector groups, chunk steps and buckets; rarely ~152k); the launcher's split for a drawn GPU size, or a forced
    one (mostly within the launcher's range); greedy (also as T <= 0, with top-k / top-p the op ignores),
    per-token or two-level sampling (T incl. 1, powers of two and odd values; top-k off or >= V, which the op
    dispatches to the kernel); threshold (0, 1, in between, +-inf, > 1), quota per sequence (<= 0 inactive,
    1, k, > S); none / some / all positions masked; -inf, tied, peaked, constant and identical rows; step,
    EOS ids (none, in and out of the vocabulary); row layouts (dense, misaligned start, padded rows, transposed
    batch / positions, a broadcast batch); Philox seed and offset; the emulator's schedule (launch order,
    random interleavings, warp-greedy). Draws whose expected result hangs on a near-tie the kernel may round
    the other way (ops/unmask.py) are redrawn. Outputs and flags poisoned."""
    rng = random.Random(case)
    g = torch.Generator().manual_seed(case)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    per_vec = 4 if dtype == torch.float32 else 8
    mode = rng.choice(list(MODES))
    greedy, noise = MODES[mode]
    if mode == "greedy":
        noise = rng.choice(["two_level", "per_token"])
        if rng.random() < 0.25:  # temperature <= 0 is greedy too
            greedy = False
    vocab = _fuzz_vocab(rng, per_vec)
    big = vocab > 40000
    s = rng.choices([1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, rng.randint(34, 100), rng.choice([255, 256, 1024])],
                    weights=[6, 3, 4, 8, 3, 3, 8, 3, 5, 3, 3, 8, 3, 2, 1])[0]
    b = rng.choices([1, 2, 3, 4, 5, 8, rng.randint(9, 24)], weights=[6, 5, 5, 4, 3, 2, 1])[0]
    # keep a case cheap for the emulator: at most ~1.5M logits and ~256 rows
    while b * s > 256 or b * s * vocab > (600_000 if big else 1_500_000):
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
    while noise == "per_token" and sampling and b * s * vocab > (300_000 if temperature > 1.5 else 800_000):
        b, s = (b // 2, s) if b > 1 else (b, s // 2) if s > 1 else (b, s)  # flat rows: a Philox draw per token
        vocab = vocab if b * s > 1 else min(vocab, 300_000)
    if sampling:  # the kernel samples the untruncated distribution; the op dispatches top-k >= V to it
        top_k, top_p = rng.choice([0, 0, vocab, vocab + rng.randint(1, 9)]), 1.0
    else:  # ignored by greedy picks
        top_k, top_p = rng.choice([0, 1, rng.randint(1, vocab + 2)]), rng.choice([1.0, 0.5, 0.9])
    threshold = rng.choice([0.0, 1.0, 0.9, 0.5, rng.random(), rng.uniform(0, 0.05), 2.0, -0.5, math.inf, -math.inf])
    frac = rng.choice([0.0, 1.0, 0.3, 0.7, rng.random()])
    quota = torch.tensor([rng.choice([1, 1, 2, 3, 0, -2, s, s + 3, rng.randint(1, max(1, s)), 2**31 - 1, -2**31])
                          for _ in range(b)], dtype=torch.int32)
    step = torch.tensor([rng.choice([0, 1, 7, -1, rng.randint(0, 2**31 - 1), -2**31]) for _ in range(b)],
                        dtype=torch.int32)
    n_eos = rng.choice([0, 1, 2, 3, 8, 100])
    eos = [rng.choice([rng.randrange(vocab), rng.randrange(vocab), vocab + rng.randint(0, 5), -1, 0])
           for _ in range(n_eos)]
    seed = torch.tensor([rng.randint(-2**63, 2**63 - 1)])
    offset = torch.tensor([rng.choice([0, 5, rng.randint(-2**63, 2**63 - 1)])])
    slots = rng.choice([132 * 4, 132 * 3, 114 * 4, 16, 1, rng.randint(1, 2000)])
    max_split = _max_split(vocab, per_vec, greedy or temperature <= 0, noise)
    split = rng.choice([0, 0, 1, rng.randint(1, max_split), max_split, rng.randint(1, 64)])
    while split > 1 and b * s * split > 1024:  # emulated CTAs
        split //= 2
    order = rng.choice([0, rng.getrandbits(63) | 1, EMU_GREEDY | rng.getrandbits(63)])

    for attempt in range(40):  # redraw the logits until no near-tie decides the result
        x, feats, same = _fuzz_logits(rng, g, b, s, vocab, dtype)
        masked = torch.rand(b, s, generator=g) < frac
        logits, layout = _fuzz_layout(rng, x, per_vec, same)
        dense = logits.contiguous()
        # sampling: the kernel multiplies by fl(1 / T), as torch does on CUDA; the CPU reference divides, so it
        # gets the logits so scaled (rounded once in fp32) and T = 1: the same scores, hence the same picks
        inv_t = torch.tensor(1.0 / torch.tensor(temperature, dtype=torch.float32).item() if sampling else 1.0,
                             dtype=torch.float32)
        ref_logits, ref_t = (dense.float() * inv_t, 1.0) if sampling else (dense, temperature)
        why = _near_tie(ref_logits, masked, quota, threshold, ref_t, greedy, noise, seed, offset)
        if why is None:
            break
    assert kernel_supported(logits, temperature, top_k, top_p, greedy)

    tokens = torch.where(masked, torch.full((b, s), -5), torch.randint(0, vocab, (b, s), generator=g))
    if eos and rng.random() < 0.5:  # some already unmasked tokens are EOS ids, prompt (step_map < 0) or not
        tokens = torch.where(torch.rand(b, s, generator=g) < 0.3, torch.tensor(eos[0]), tokens)
        tokens = torch.where(masked, -5, tokens)
    step_map = torch.where(masked, -7, torch.randint(-2, 4, (b, s), generator=g)).int()
    logp = torch.where(masked, float("nan"), torch.rand(b, s, generator=g).log())
    conf = torch.where(masked, -9.0, logp.exp())
    state = [logits, tokens, masked.clone(), step_map, logp, conf]
    extra = [step, quota, torch.tensor(eos, dtype=torch.int64), seed, offset]
    config = (f"case {case}: {dtype} B={b} S={s} V={vocab} mode={mode} greedy={greedy} noise={noise} T={temperature} "
              f"top_k={top_k} top_p={top_p} tau={threshold} frac_masked={frac:.2f} ({int(masked.sum())} masked) "
              f"quota={quota.tolist()} step={step.tolist()} eos={eos} seed={seed.item()} offset={offset.item()} "
              f"slots={slots} split={split} (launcher max {max_split}) order={order:#x} layout={layout} "
              f"logits: {', '.join(feats)}; redrawn {attempt}x" + (f" (still: {why})" if why else ""))
    print(config)

    ref = clone(state)
    ref[0] = ref_logits
    want = threshold_unmask_reference(*ref, *extra, threshold, ref_t, top_k, top_p, greedy, noise)
    got = clone(state)
    got[0] = logits
    flags = emu(*got, *extra, threshold=threshold, temperature=temperature, greedy=greedy, noise=noise, slots=slots,
                split=split, order=order)
    assert split == 0 or emu.nsplit == split, config
    _assert_same_step_fp64(got, flags, ref, want, masked, dense, temperature)


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



def test_emulated_conf_of_a_nearly_certain_token_follows_float64(emu):
    """x / T = 142 and 128 (bf16, T = 0.25; the rest ~e^-240): the pick's float64 conf is 1 - 8.3e-7. The
    kernel keeps it ((s_pick - s_max) - log(1 + 8.3e-7)); the fp32 reference's logsumexp rounds at ulp(142)
    and says 1.0. So at tau 1 only the truly certain position (one finite token) is unmasked by the kernel,
    both by the reference: a near tie of the threshold that the random-configuration test must redraw (its
    float64 check), not an exact 1.0."""
    b, s, vocab = 1, 2, 2048
    logits = torch.full((b, s, vocab), -30.0, dtype=torch.bfloat16)
    logits[0, 0, 100], logits[0, 0, 7] = 35.5, 32.0
    logits[0, 1] = float("-inf")
    logits[0, 1, 5] = 3.0
    state = [logits, torch.zeros(b, s, dtype=torch.long), torch.ones(b, s, dtype=torch.bool),
             torch.zeros(b, s, dtype=torch.int32), torch.zeros(b, s), torch.zeros(b, s)]
    extra = [torch.ones(b, dtype=torch.int32), torch.ones(b, dtype=torch.int32), torch.tensor([0]),
             torch.tensor([0]), torch.tensor([0])]
    got, flags, ref, want = run_both(emu, state, extra, 1.0, 0.25, True)
    assert ref[2].tolist() == [[False, False]] and ref[5].tolist() == [[1.0, 1.0]]
    assert got[2].tolist() == [[True, False]] and got[1][0, 1] == 5 and got[5][0, 1] == 1.0
    assert _near_tie(logits, state[2], extra[1], 1.0, 0.25, True, "two_level", 0, 0) is not None
    # the kernel's conf at tau 0 is the float64 one to an ulp
    got = clone(state)
    emu(*got, *extra, threshold=0.0, temperature=0.25, greedy=True)
    want64 = torch.softmax(logits[0, 0].double() / 0.25, 0)[100].item()
    assert got[1][0, 0] == 100 and abs(got[5][0, 0].item() - want64) <= 6e-8 and want64 < 1 - 8e-7
