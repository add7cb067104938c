"""The LM-head row kernel of the GRPO loss (csrc/kernels/grpo_loss.cuh: log-softmax statistics, the fused GRPO
terms and d loss / d logits in place) on the CPU emulator of device code (csrc/emu/grpo_loss_emu.cpp), against
float64 from the same logits, within 2x the error of the same-dtype PyTorch computation (ops.grpo_loss's
_KernelModel, the model of the `_C` entry points). The GEMMs around the kernel are cuBLAS in the extension and
not emulated; test_grpo_loss.py covers the chunk loop (its PyTorch model on the CPU, the real thing on a GPU),
test_grpo_loss_emu_random.py random configurations of both kernels, with this file's helpers."""

import ctypes
import math

import pytest
import torch
from conftest import EMU_GREEDY

from lightningrl_fast.ops import grpo_loss as _gl

_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
LOGPROBS, GRPO, GRAD = 0, 1, 2
NAN = float("nan")


def acc_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


class Emulated:
    """emu_lm_head_rows through ctypes. Per-token arrays are [T] in the accumulation dtype; outputs come back
    poisoned (NaN) wherever the kernel did not write."""

    def __init__(self, lib):
        p, i32, i64, f64, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_uint64
        lib.emu_lm_head_rows.argtypes = [i32, i32, i32, p, i64, i64, i64, i64, i64, i32, p, p, p, p, p, p, p,
                                         f64, f64, f64, f64, p, p, p, p, p, p, u64]
        lib.emu_lm_head_rows.restype = i32
        self.lib = lib

    def run(self, logits, targets, mode, *, row0=0, tokens=None, suppress=-1, entropy=False, write_grad=True,
            old=None, ref=None, adv=None, w_pg=None, w_kl=None, w_nll=None, clip=(0.8, 1.28), beta=0.0, mu=0.0,
            lse_in=None, grad_logp=None, order=0):
        """Runs the kernel over `logits` ([rows, V], changed in place in GRPO / gradient mode). Returns
        (vec_path_taken, logp, lse, entropy, terms) over all T tokens."""
        rows, vocab = logits.shape
        T = tokens if tokens is not None else row0 + rows
        acc = acc_of(logits.dtype)
        out = lambda *s: torch.full(s, NAN, dtype=acc)  # noqa: E731
        logp, lse, ent, terms = out(T), out(T), out(T), out(4, T)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        vec = self.lib.emu_lm_head_rows(
            _DT[logits.dtype], mode, int(entropy), logits.data_ptr(), rows, vocab, row0, T, suppress, int(write_grad),
            targets.data_ptr(), ptr(old), ptr(ref), ptr(adv), ptr(w_pg), ptr(w_kl), ptr(w_nll), clip[0], clip[1],
            beta, mu, ptr(lse_in), ptr(grad_logp), logp.data_ptr() if mode != GRAD else None,
            lse.data_ptr() if mode != GRAD else None, ent.data_ptr() if entropy else None,
            terms.data_ptr() if mode == GRPO else None, order)
        return bool(vec), logp, lse, ent, terms


@pytest.fixture(scope="module")
def emu(emu_build):
    return Emulated(ctypes.CDLL(str(emu_build("grpo_loss_emu.cpp", shared=True, cuda_headers=True))))


def make_logits(rows, vocab, dtype, seed, special=()):
    """Random logits in `dtype` (spread 4); `special` rows: "neg_inf" (a third of the entries -inf), "equal"."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 4
    for r, kind in special:
        if kind == "neg_inf":
            x[r, torch.randperm(vocab, generator=g)[: vocab // 3]] = float("-inf")
        elif kind == "equal":
            x[r] = 1.5
    return x.to(dtype)


def softmax_stats(logits, suppress, dtype):
    """lse, entropy and softmax of logits (already rounded to the buffer dtype) computed in `dtype`."""
    x = logits.to(dtype, copy=True)  # a copy: the caller's logits keep their suppressed column
    if suppress >= 0:
        x[:, suppress] = float("-inf")
    lse = torch.logsumexp(x, -1)
    q = torch.exp(x - lse[:, None])
    ent = -(q * torch.where(q > 0, x - lse[:, None], 0.0)).sum(-1)
    return x, lse, ent, q


def grad_of(logits, lse, targets, g, suppress, dtype):
    """g * (onehot(target) - softmax), 0 at `suppress`, in `dtype` (float64 oracle or the same-dtype model)."""
    x = logits.to(dtype)
    dl = -g.to(dtype)[:, None] * torch.exp(x - lse.to(dtype)[:, None])
    ok = (targets >= 0) & (targets < x.shape[1]) & (targets != suppress)
    rows = torch.arange(x.shape[0])[ok]
    dl[rows, targets[ok]] += g.to(dtype)[ok]
    if suppress >= 0:
        dl[:, suppress] = 0.0
    return dl


def err(a, b):
    """max |a - b| over finite-and-equal-infinity positions (both inf of one sign count 0)."""
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())
    return float(torch.where(same, 0.0, (a - b).abs()).max()) if a.numel() else 0.0


def within_2x(got, want64, model, floor=1e-12):
    """got's error against float64 at most twice the same-dtype model's, plus `floor` x max(1, max |want|). In
    float64 the model IS the oracle (error 0) while the kernel merges in another order: 64 ulps of slack there."""
    e_got, e_model = err(got, want64), err(model, want64)
    if got.dtype == torch.float64:
        floor = max(floor, 64 * torch.finfo(torch.float64).eps)
    finite = want64[want64.isfinite()]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    assert e_got <= 2 * e_model + floor * scale, (e_got, e_model)


# vocab 111: no vector path in any dtype; 152 / 1000: 16-byte vectors for bf16/fp16 (and fp32 at 1000); 3001: odd,
# several iterations per thread
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("vocab,suppress", [(111, -1), (152, 7), (1000, 999), (3001, 0)])
def test_emulated_logprobs_and_entropy(emu, dtype, vocab, suppress):
    rows = 5
    logits = make_logits(rows, vocab, dtype, seed=vocab, special=[(1, "neg_inf"), (3, "equal")])
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1))
    targets[2] = (suppress + 1) % vocab
    keep = logits.clone()
    vec, logp, lse, ent, _ = emu.run(logits, targets, LOGPROBS, suppress=suppress, entropy=True, order=vocab)
    es = logits.element_size()
    assert vec == ((vocab * es) % 16 == 0)
    assert torch.equal(logits.view(torch.uint8), keep.view(torch.uint8))  # log-prob mode only reads the logits
    acc = acc_of(dtype)
    for got, idx in ((lse, 1), (ent, 2)):
        want64 = softmax_stats(keep, suppress, torch.float64)[idx]
        model = softmax_stats(keep, suppress, acc)[idx]
        within_2x(got, want64, model, floor=4 * torch.finfo(acc).eps)
    x64, lse64 = softmax_stats(keep, suppress, torch.float64)[:2]
    xm, lsem = softmax_stats(keep, suppress, acc)[:2]
    r = torch.arange(rows)
    within_2x(logp, x64[r, targets] - lse64, xm[r, targets] - lsem, floor=4 * torch.finfo(acc).eps)
    assert abs(float(ent[3]) - math.log(vocab - (suppress >= 0))) < 1e-3  # all-equal row: uniform over the rest


def test_emulated_suppressed_and_out_of_range_targets(emu):
    """A target at the suppressed id has log-prob -inf; an out-of-range one reads nothing and gives NaN (the
    Python side validates targets first); neither moves the gradient of another column."""
    vocab, sup = 152, 5
    logits = make_logits(3, vocab, torch.float32, seed=3)
    targets = torch.tensor([sup, vocab + 4, 9])
    _, logp, lse, _, _ = emu.run(logits.clone(), targets, LOGPROBS, suppress=sup)
    assert logp[0] == float("-inf") and logp[1].isnan() and logp[2].isfinite()
    _, logp_none, _, _, _ = emu.run(logits.clone(), torch.tensor([-1, 3, -2]), LOGPROBS)  # nothing suppressed
    assert logp_none[0].isnan() and logp_none[2].isnan() and logp_none[1].isfinite()  # -1 is out of range, not -inf
    g = torch.tensor([0.5, -1.0, 2.0])
    buf = logits.clone()
    emu.run(buf, targets, GRAD, suppress=sup, lse_in=lse, grad_logp=g)
    want = grad_of(logits, lse, targets, g, sup, torch.float64)
    assert torch.all(buf[:, sup] == 0)
    within_2x(buf, want, grad_of(logits, lse, targets, g, sup, torch.float32), floor=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("vocab", [111, 1000])
def test_emulated_gradient_mode(emu, dtype, vocab):
    """Backward of log-probs: the row becomes g * (onehot - softmax) from the given lse, rounded once to the
    buffer dtype; a chunk in the middle of T (row0) reads its own lse / g entries only."""
    rows, row0, T, sup = 6, 4, 13, 3
    logits = make_logits(rows, vocab, dtype, seed=vocab + 1, special=[(2, "neg_inf")])
    targets = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(2))
    acc = acc_of(dtype)
    lse_rows = softmax_stats(logits, sup, torch.float64)[1]
    lse_all = torch.full((T,), NAN, dtype=acc)
    lse_all[row0 : row0 + rows] = lse_rows.to(acc)
    g_all = torch.full((T,), NAN, dtype=acc)
    g_all[row0 : row0 + rows] = torch.randn(rows, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(acc)
    g_all[row0 + 1] = 0.0  # a token without gradient: zeros written
    buf = logits.clone()
    emu.run(buf, targets, GRAD, row0=row0, tokens=T, suppress=sup, lse_in=lse_all, grad_logp=g_all, order=rows)
    y, lse_c, g_c = targets[row0 : row0 + rows], lse_all[row0 : row0 + rows], g_all[row0 : row0 + rows]
    want = grad_of(logits, lse_c, y, g_c, sup, torch.float64)
    model = grad_of(logits, lse_c, y, g_c, sup, acc).to(dtype)  # _KernelModel._softmax_grad: Acc, then one rounding
    within_2x(buf, want, model, floor=1e-30)
    assert torch.all(buf[1] == 0)


def grpo_inputs(T, seed, acc, *, beta=0.02, mu=0.1):
    """Advantages and reduction weights of T tokens (w_kl only with beta, w_nll only with mu); old / ref: None."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda s=1.0: (torch.randn(T, generator=g, dtype=torch.float64) * s).to(acc)  # noqa: E731
    d = dict(adv=rnd(), w_pg=rnd(0.1).abs(), old=None, ref=None, w_kl=None, w_nll=None)
    if beta:
        d["w_kl"] = rnd(0.1).abs()
    if mu:
        d["w_nll"] = (rnd() > 0).to(acc) * 0.05
    return d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("on_policy,beta,mu", [(False, 0.02, 0.1), (True, 0.0, 0.0), (False, 0.0, 0.1)])
def test_emulated_fused_grpo_rows(emu, dtype, on_policy, beta, mu):
    """GRPO mode: logp, the four terms and the in-place gradient of a chunk (row0 > 0) against float64 from the same
    logits (_grpo_dlogp, the PyTorch model of grpo_dlogp); old log-probs spread so that both clip sides, the ratio
    clamp (|d| > 10) and unclipped tokens occur; per-token outputs outside the chunk stay untouched."""
    rows, vocab, row0, T, sup = 9, 1000, 3, 15, 11
    acc = acc_of(dtype)
    logits = make_logits(rows, vocab, dtype, seed=int(on_policy) + 10 * int(beta > 0))
    targets = torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(7))
    x64, lse64 = softmax_stats(logits, sup, torch.float64)[:2]
    y = targets[row0 : row0 + rows]
    lp64 = x64[torch.arange(rows), y] - lse64
    inp = grpo_inputs(T, seed=rows, acc=acc, beta=beta, mu=mu)
    if not on_policy:
        shift = torch.tensor([0.0, 0.5, -0.5, 0.05, -0.05, 12.0, -12.0, 0.3, -0.3], dtype=torch.float64)
        old = torch.full((T,), NAN, dtype=acc)
        old[row0 : row0 + rows] = (lp64 + shift).to(acc)  # d = logp - old = -shift (up to rounding)
        inp["old"] = old
    if beta:
        ref = torch.full((T,), NAN, dtype=acc)
        ref[row0 : row0 + rows] = (lp64 + 0.2 * torch.randn(rows, dtype=torch.float64)).to(acc)
        inp["ref"] = ref
    kw = dict(eps_low=0.2, eps_high=0.28, beta=beta, mu=mu)
    buf = logits.clone()
    _, logp, lse, _, terms = emu.run(buf, targets, GRPO, row0=row0, tokens=T, suppress=sup, clip=(0.8, 1.28),
                                     old=inp["old"], ref=inp["ref"], adv=inp["adv"], w_pg=inp["w_pg"],
                                     w_kl=inp["w_kl"], w_nll=inp["w_nll"], beta=beta, mu=mu, order=3)
    sl = slice(row0, row0 + rows)
    for t in (logp, lse):
        assert t[:row0].isnan().all() and t[row0 + rows :].isnan().all()
    assert terms[:, :row0].isnan().all() and terms[:, row0 + rows :].isnan().all()
    pick = lambda v: None if v is None else v[sl].double()  # noqa: E731
    g64, terms64 = _gl._grpo_dlogp(lp64, pick(inp["old"]), pick(inp["ref"]), inp["adv"][sl].double(),
                                   inp["w_pg"][sl].double(), pick(inp["w_kl"]), pick(inp["w_nll"]), **kw)
    xm, lsem = softmax_stats(logits, sup, acc)[:2]
    lpm = xm[torch.arange(rows), y] - lsem
    pickm = lambda v: None if v is None else v[sl]  # noqa: E731
    gm, termsm = _gl._grpo_dlogp(lpm, pickm(inp["old"]), pickm(inp["ref"]), inp["adv"][sl], inp["w_pg"][sl],
                                 pickm(inp["w_kl"]), pickm(inp["w_nll"]), **kw)
    floor = 8 * torch.finfo(acc).eps
    within_2x(logp[sl], lp64, lpm, floor=floor)
    within_2x(terms[:, sl], terms64, termsm, floor=floor)
    if not on_policy:
        assert terms[3, sl].sum() >= 1 and terms[3, sl].sum() < rows  # some clipped, some not
    want = grad_of(logits, lse64, y, g64, sup, torch.float64)
    model = grad_of(logits, lsem, y, gm, sup, acc).to(dtype)
    within_2x(buf, want, model, floor=1e-30)


def test_emulated_grpo_without_gradient_leaves_logits(emu):
    """write_grad false (a frozen head and no grad_hidden): the loss terms only, the logits buffer unchanged."""
    rows, vocab = 4, 152
    logits = make_logits(rows, vocab, torch.bfloat16, seed=4)
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(4))
    inp = grpo_inputs(rows, seed=4, acc=torch.float32, beta=0.0, mu=0.0)
    buf = logits.clone()
    _, logp, _, _, terms = emu.run(buf, targets, GRPO, write_grad=False, adv=inp["adv"], w_pg=inp["w_pg"])
    assert torch.equal(buf.view(torch.int16), logits.view(torch.int16))
    assert logp.isfinite().all() and torch.equal(terms[2], torch.ones(rows))  # on-policy: ratio exactly 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_emulated_grpo_rows_with_entropy(emu, dtype):
    """fused_linear_grpo_loss(with_entropy=True) runs the GRPO kernel with the entropy (kEntropy): each row's
    entropy as in log-prob mode, every other output bit for bit that of the run without it. (The emulator ran
    GRPO mode without the entropy whatever it was asked, so that kernel variant went untested.)"""
    rows, vocab, sup = 5, 152, 4
    acc = acc_of(dtype)
    logits = make_logits(rows, vocab, dtype, seed=12, special=[(1, "neg_inf")])
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(12))
    targets[1] = int((logits[1].isfinite() & (torch.arange(vocab) != sup)).nonzero()[0])  # a finite logp
    inp = grpo_inputs(rows, seed=12, acc=acc)
    inp["ref"] = (torch.randn(rows, generator=torch.Generator().manual_seed(13)) - 5).to(acc)
    runs = []
    for entropy in (False, True):
        buf = logits.clone()
        _, logp, lse, ent, terms = emu.run(buf, targets, GRPO, suppress=sup, entropy=entropy, adv=inp["adv"],
                                           w_pg=inp["w_pg"], ref=inp["ref"], w_kl=inp["w_kl"], w_nll=inp["w_nll"],
                                           beta=0.02, mu=0.1, order=7)
        runs.append(((buf, logp, lse, terms), ent))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert runs[0][1].isnan().all()
    eps = torch.finfo(acc).eps
    within_2x(runs[1][1], softmax_stats(logits, sup, torch.float64)[2], softmax_stats(logits, sup, acc)[2],
              floor=4 * eps)


def test_emulated_rows_are_bitwise_identical_across_schedules_and_paths(emu):
    """The block-wide merge has a fixed order: any block order or thread interleaving gives the same bits; the
    scalar path (a buffer 2 bytes off a 16-byte boundary) agrees with the vector path within rounding."""
    rows, vocab = 4, 1000
    logits = make_logits(rows, vocab, torch.bfloat16, seed=9, special=[(2, "neg_inf")])
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(9))
    targets[2] = int(logits[2].isfinite().nonzero()[3])  # a target at a -inf logit has an infinite loss
    inp = grpo_inputs(rows, seed=9, acc=torch.float32)
    inp["ref"] = torch.randn(rows) - 5
    results = []
    for order in (0, 1, 77, EMU_GREEDY | 5):
        buf = logits.clone()
        vec, logp, lse, _, terms = emu.run(buf, targets, GRPO, suppress=2, adv=inp["adv"], w_pg=inp["w_pg"],
                                           ref=inp["ref"], w_kl=inp["w_kl"], w_nll=inp["w_nll"], beta=0.02, mu=0.1,
                                           order=order)
        assert vec
        results.append((buf, logp, lse, terms))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    store = torch.empty(rows * vocab + 8, dtype=torch.bfloat16)
    off = store[1 : 1 + rows * vocab].view(rows, vocab)
    off.copy_(logits)
    vec, logp, lse, _, terms = emu.run(off, targets, GRPO, suppress=2, adv=inp["adv"], w_pg=inp["w_pg"],
                                       ref=inp["ref"], w_kl=inp["w_kl"], w_nll=inp["w_nll"], beta=0.02, mu=0.1)
    assert not vec
    torch.testing.assert_close(lse, results[0][2], rtol=1e-6, atol=1e-6)
    assert off.isfinite().all()
    torch.testing.assert_close(off.float(), results[0][0].float(), rtol=1e-2, atol=1e-6)


# ------------------------------------------------------------------ group_normalize (one CTA, cub stand-ins)


def emu_group_normalize(emu, rewards, group_ids, weights, mode, order=0):
    lib = emu.lib
    if not getattr(lib, "_gn_typed", False):
        p, i32, i64, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64
        lib.emu_group_normalize.argtypes = [i32, p, p, p, p, i32, i64, i64, u64]
        lib.emu_group_normalize.restype = i64
        lib._gn_typed = True
    S, R = rewards.shape
    out = torch.full((S,), NAN, dtype=acc_of(rewards.dtype))
    r, g, w = rewards.contiguous(), group_ids.to(torch.int64).contiguous(), weights.to(torch.float64).contiguous()
    lib.emu_group_normalize(_DT[rewards.dtype], r.data_ptr(), g.data_ptr(), w.data_ptr(), out.data_ptr(),
                            int(mode == "decoupled"), S, R, order)
    return out


def group_case(S, gsize, R, dtype, seed, *, huge_ids=False):
    """Rewards (some columns 0/1 like a correctness reward, others continuous), members of each group scattered."""
    g = torch.Generator().manual_seed(seed)
    ngroups = (S + gsize - 1) // gsize
    ids = torch.arange(S) // gsize
    ids = ids[torch.randperm(S, generator=g)]
    if huge_ids:  # arbitrary int64 ids: negative, near the limits
        table = torch.randint(-(2**62), 2**62, (ngroups,), generator=g, dtype=torch.int64)
        table[0], table[-1] = -(2**63), 2**63 - 1
        ids = table[ids]
    cols = [(torch.rand(S, generator=g) < 0.5).double() if j % 2 == 0 else torch.randn(S, generator=g,
                                                                                      dtype=torch.float64)
            for j in range(R)]
    rewards = torch.stack(cols, 1).to(dtype)
    weights = torch.linspace(1.0, 0.25, R, dtype=torch.float64)
    return rewards, ids, weights


@pytest.mark.parametrize("mode", ["decoupled", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("S,gsize,R", [(97, 1, 2), (123, 3, 3), (32, 8, 1), (1, 1, 1), (300, 100, 2), (301, 40, 1),
                                       (2500, 7, 2)])
def test_emulated_group_normalize_matches_float64(emu, mode, dtype, S, gsize, R):
    """Small groups (a thread each), groups of >= 33 (a warp each), several sort tiles (S > 1024 threads), one
    sample; arbitrary int64 ids (S = 2500). The kernel computes in double: float32 output within 2x of the float32
    reference's error, float64 output within a few ulps."""
    rewards, ids, weights = group_case(S, gsize, R, dtype, seed=S + gsize, huge_ids=S == 2500)
    got = emu_group_normalize(emu, rewards, ids, weights, mode, order=S if S % 2 else EMU_GREEDY | S)
    want = _gl.group_normalize_reference(rewards.double(), ids, weights, mode)
    model = _gl.group_normalize_reference(rewards, ids, weights.to(rewards.dtype), mode)
    assert got.isfinite().all()
    if dtype == torch.float64:
        assert float((got - want).abs().max()) <= 64 * torch.finfo(torch.float64).eps * max(1.0, float(want.abs().max()))
    else:
        within_2x(got, want, model, floor=2 * torch.finfo(torch.float32).eps)
    if gsize == 1:
        assert torch.equal(got, torch.zeros_like(got))  # every group has std 0: z = 0, batch std floored


@pytest.mark.parametrize("gsize", [10, 50])  # groups reduced by a thread each / by a warp each
def test_emulated_group_normalize_is_bitwise_deterministic_and_exact_on_ties(emu, gsize):
    """The hash, the stable sort and the fixed-order sums make the result independent of the thread schedule; a
    group whose rewards are all equal gets exactly 0 before the batch z-score (shifted means)."""
    rewards, ids, weights = group_case(1500, gsize, 2, torch.float64, seed=3)
    tie = ids == ids[0]
    rewards[tie] = torch.tensor([0.1, 0.7], dtype=torch.float64)  # a sum of copies of 0.1 is not exact
    outs = [emu_group_normalize(emu, rewards, ids, weights, "decoupled", order=o) for o in (0, 1, 99, EMU_GREEDY | 3)]
    for o in outs[1:]:
        assert torch.equal(outs[0].view(torch.int64), o.view(torch.int64))
    want = _gl.group_normalize_reference(rewards, ids, weights, "decoupled")
    assert float((outs[0] - want).abs().max()) <= 64 * torch.finfo(torch.float64).eps * float(want.abs().max())
    # the tied group's z-scores are exactly 0: its advantage is the batch z-score of 0 (an unshifted mean would give
    # z = +-1 from rounding noise over a rounding-noise std)
    total = torch.zeros(1500, dtype=torch.float64)
    for j, w in enumerate(weights.tolist()):
        for g in ids.unique():
            m = ids == g
            col = rewards[m, j]
            sd = col.std(correction=0)
            total[m] += w * ((col - col.mean()) / sd if not m.equal(tie) and sd > 0 else 0.0)
    tied = float((0 - total.mean()) / total.std(correction=0))
    assert float((outs[0][tie] - tied).abs().max()) < 1e-12
