"""ops.threshold_unmask's CUDA kernel (csrc/kernels/unmask.cuh) run on the CPU by the emulator of device code
(csrc/emu/unmask_emu.cpp over the CUDA-builtins front-end), against the reference op: picks, selection, in-place
writes and flags exactly (the same Philox stream when sampling), log-probs and confidences within tolerance; the
split of a row over CTAs, the CTA-shared pruning threshold, misaligned and strided rows, strided outputs, edge cases,
the full 151936 vocabulary. test_unmask.py holds the reference's own tests and the kernel's tests on a GPU."""

import ctypes
import random

import pytest
import torch
from conftest import EMU_GREEDY, fuzz_cases
from test_unmask import MODES, assert_same_step, case, clone, compact_logits
from test_unmask_random import check_random_config, near_tie

from lightningrl_fast.ops.unmask import threshold_unmask_reference


_EMU_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class Emulated:
    """`_C.threshold_unmask`'s device code run by the CPU emulator (CPU tensors; any strides, as the launcher takes
    them: the [B, S] arrays' two, the [B] / [E] arrays' one)."""

    def __init__(self, lib):
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn = lib.emu_threshold_unmask
        fn.restype = i32
        fn.argtypes = [i32, p, i64, i64, i32, i32, i32, p, p, p, p, p, p, p, p, i32, p, p, ctypes.c_double,
                       ctypes.c_double, i32, i32, p, p, i64, i32, ctypes.c_uint64, p, p, p, i64, p, i64, i64, i64]
        self.fn = fn
        self.take_draws = lib.emu_take_gumbel_draws
        self.take_draws.restype = ctypes.c_uint64

    def __call__(self, logits, tokens, masked, step_map, logp, conf, step, quota, eos_ids, seed, offset,
                 threshold=0.9, temperature=1.0, greedy=False, noise="two_level", slots=528, split=0, order=1,
                 noise_rows=None, logit_rows=None):
        b, s = tokens.shape
        vocab = logits.shape[-1]
        assert logits.dim() == (2 if logit_rows is not None else 3)
        assert logits.stride(-1) == 1 or vocab == 1
        ss = 0 if logit_rows is not None else logits.stride(1)  # compact logits: rows at stride(0) via the map
        for t in (tokens, masked, step_map, logp, conf, step, quota, eos_ids, seed, offset):
            assert t.device.type == "cpu"
        strides = torch.tensor([x for t in (tokens, masked, step_map, logp, conf) for x in t.stride()]
                               + [t.stride(0) for t in (step, quota, eos_ids)], dtype=torch.int64)
        # poisoned (byte 0xA5, neither False nor True): the kernel must write every sequence's flags
        done, eos_seen = torch.full((b,), 0xA5, dtype=torch.uint8), torch.full((b,), 0xA5, dtype=torch.uint8)
        nsplit = ctypes.c_int(0)
        rc = self.fn(_EMU_DTYPES[logits.dtype], logits.data_ptr(), logits.stride(0), ss, b, s, vocab,
                     tokens.data_ptr(), masked.data_ptr(), step_map.data_ptr(), logp.data_ptr(), conf.data_ptr(),
                     step.data_ptr(), quota.data_ptr(), eos_ids.data_ptr(), eos_ids.numel(), seed.data_ptr(),
                     offset.data_ptr(), threshold, temperature, int(greedy), int(noise == "two_level"),
                     done.data_ptr(), eos_seen.data_ptr(),
                     slots, split, order, ctypes.byref(nsplit), strides.data_ptr(),
                     None if noise_rows is None else noise_rows.data_ptr(),
                     0 if noise_rows is None else noise_rows.stride(0),
                     None if logit_rows is None else logit_rows.data_ptr(),
                     *((0, 0, 0) if logit_rows is None else (*logit_rows.stride(), logits.shape[0])))
        assert rc == 0, "the kernel left a sequence or row counter non-zero"
        assert bool((done <= 1).all() and (eos_seen <= 1).all()), f"flags left unwritten: {done}, {eos_seen}"
        self.nsplit = nsplit.value
        return done.view(torch.bool), eos_seen.view(torch.bool)


@pytest.fixture(scope="module")
def emu(emu_build):
    """csrc/emu/unmask_emu.cpp (kernels/unmask.cuh over the CUDA-builtins front-end) as a ctypes library."""
    return Emulated(ctypes.CDLL(str(emu_build("unmask_emu.cpp", shared=True, cuda_headers=True))))


def run_both(emu, state, extra, threshold, temperature, greedy, noise="two_level", noise_rows=None, **emu_kw):
    ref = clone(state)
    want = threshold_unmask_reference(*ref, *extra, threshold, temperature, 0, 1.0, greedy, noise, noise_rows)
    got = clone(state)
    flags = emu(*got, *extra, threshold=threshold, temperature=temperature, greedy=greedy, noise=noise,
                noise_rows=noise_rows, **emu_kw)
    return got, flags, ref, want


@pytest.mark.parametrize("noise", ["two_level", "per_token"])
@pytest.mark.parametrize("split", [0, 3])
def test_emulated_noise_rows(emu, noise, split):
    """noise_rows (a sequence's noise keyed by another row index; strided, as the launcher takes it): the
    kernel's counters follow it in both noise modes, the bucket draws included, and with rows split over CTAs
    (the row's own index still addresses logits, partials and counters); identical to the reference."""
    b, s, vocab = 4, 3, 3001
    state, extra = case(b, s, vocab, torch.bfloat16, seed=77, frac_masked=0.9, quota=(1, 2, 1, 3))
    rows = torch.tensor([9, -1, 6, -1, 0, -1, 2, -1])[::2]  # every other element: stride 2
    got, flags, ref, want = run_both(emu, state, extra, 0.4, 0.9, False, noise, noise_rows=rows, split=split,
                                     order=5)
    assert_same_step(got, flags, ref, want)
    plain = clone(state)
    emu(*plain, *extra, threshold=0.4, temperature=0.9, greedy=False, noise=noise, split=split)
    assert not torch.equal(plain[1], got[1])  # the default numbering draws other noise


@pytest.mark.parametrize("mode", ["greedy", "two_level", "per_token"])
@pytest.mark.parametrize("split", [0, 4])
def test_emulated_logit_rows(emu, mode, split):
    """Compact logits (logit_rows): the kernel reads each scanned position's row through the map (rows shuffled
    among junk rows; with V 3001 no row stride is a whole number of 16 bytes, so most rows are misaligned; junk map
    entries elsewhere, out of range too), a row split over CTAs included, and gives the full layout's reference step exactly."""
    greedy, noise = MODES[mode]
    b, s, vocab = 5, 4, 3001
    state, extra = case(b, s, vocab, torch.bfloat16, seed=78, frac_masked=0.7, quota=(1, 0, 2, 1, 3))
    compact, rows = compact_logits(state[0], state[2], extra[1], random.Random(split + 7),
                                   torch.Generator().manual_seed(3))
    ref = clone(state)
    want = threshold_unmask_reference(*ref, *extra, 0.5, 0.9, 0, 1.0, greedy, noise)
    got = [compact] + clone(state[1:])
    flags = emu(*got, *extra, threshold=0.5, temperature=0.9, greedy=greedy, noise=noise, split=split, order=9,
                logit_rows=rows)
    assert_same_step(got, flags, ref, want)
    # out-of-range entries at scanned positions read the first / last row (clamped), as with the map clamped
    scanned = (state[2] & (extra[1] > 0)[:, None]).nonzero().tolist()
    wild = rows.clone()
    wild[tuple(scanned[0])], wild[tuple(scanned[-1])] = -3, 2**40
    a, b_ = [compact] + clone(state[1:]), [compact] + clone(state[1:])
    fa = emu(*a, *extra, threshold=0.5, temperature=0.9, greedy=greedy, noise=noise, split=split, logit_rows=wild)
    fb = emu(*b_, *extra, threshold=0.5, temperature=0.9, greedy=greedy, noise=noise, split=split,
             logit_rows=wild.clamp(0, compact.shape[0] - 1))
    assert_same_step(a, fa, b_, fb, rtol=0, atol=0)




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


@pytest.mark.parametrize("case", fuzz_cases(16))
def test_emulated_unmask_random_config(emu, case):
    """One random configuration per case seed (test_unmask_random.draw_unmask_config), against the reference as
    the fixed tests compare (picks, selection, writes and flags exactly, the same Philox stream when sampling;
    logp / conf against float64, test_unmask_random._assert_same_step_fp64):
    dtype; batch; block size S (1, 4, 8, 32, odd, rarely up to 1024); vocabulary (tiny, odd, at and around the
    vector groups, chunk steps and buckets; rarely ~152k); the launcher's split for a drawn GPU size, or a forced
    one (mostly within the launcher's range); greedy (also as T <= 0, with top-k / top-p the op ignores),
    per-token or two-level sampling (T incl. 1, powers of two and odd values; top-k off or >= V, which the op
    dispatches to the kernel); threshold (0, 1, in between, +-inf, > 1), quota per sequence (<= 0 inactive,
    1, k, > S); none / some / all positions masked; -inf, tied, peaked, constant and identical rows; step,
    EOS ids (none, in and out of the vocabulary); row layouts (dense, misaligned start, padded rows, transposed
    batch / positions, a broadcast batch); the outputs' layout (dense, padded rows, every other position,
    transposed; nothing outside them written) and the step / quota / EOS arrays' (dense, every other element);
    noise_rows (none, a permutation, any indices; dense or every other element); the logits full or compact
    (logit_rows: the scanned positions' rows shuffled among junk rows, at a padded row stride);
    Philox seed and offset; the emulator's schedule (launch order,
    random interleavings, warp-greedy). Draws whose expected result hangs on a near-tie the kernel may round
    the other way (ops/unmask.py) are redrawn. Outputs and flags poisoned."""

    def run(state, extra, c):
        flags = emu(*state, *extra, threshold=c["threshold"], temperature=c["temperature"], greedy=c["greedy"],
                    noise=c["noise"], slots=c["slots"], split=c["split"], order=c["order"],
                    noise_rows=c["noise_rows"], logit_rows=c["logit_rows"])
        assert c["split"] == 0 or emu.nsplit == c["split"], f"the emulator ran split {emu.nsplit}"
        return flags

    check_random_config(case, run)


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
    assert near_tie(logits, state[2], extra[1], 1.0, 0.25, True, "two_level", 0, 0) is not None
    # the kernel's conf at tau 0 is the float64 one to an ulp
    got = clone(state)
    emu(*got, *extra, threshold=0.0, temperature=0.25, greedy=True)
    want64 = torch.softmax(logits[0, 0].double() / 0.25, 0)[100].item()
    assert got[1][0, 0] == 100 and abs(got[5][0, 0].item() - want64) <= 6e-8 and want64 < 1 - 8e-7
