"""Random configurations (fuzz_cases) of the GRPO loss's kernels on the CPU emulator of device code
(csrc/emu/grpo_loss_emu.cpp): the LM-head row kernel in every mode (log-probs, gradient, fused GRPO terms with
or without entropy) and group_normalize, drawn over the launcher's whole space and checked against float64 (an
extended-precision oracle where float64 itself is the kernel's dtype). test_grpo_loss_emu.py holds the
hand-picked cases and the shared helpers. The same draws and checks run on a GPU in test_grpo_loss.py's
test_gpu_random_config, through _LmHeadThroughGemm (the real chunk loop of `_C`); its code runs here on the
emulated row kernel (test_gpu_random_config_code_on_the_emulator)."""

import ctypes
import math
import random

import numpy as np
import pytest
import torch
from conftest import EMU_GREEDY, fuzz_cases
from test_grpo_loss_emu import (GRAD, GRPO, LOGPROBS, NAN, Emulated, acc_of, emu_group_normalize, grad_of,
                                softmax_stats, within_2x)

from lightningrl_fast.ops import grpo_loss as _gl


@pytest.fixture(scope="module")
def emu(emu_build):
    return Emulated(ctypes.CDLL(str(emu_build("grpo_loss_emu.cpp", shared=True, cuda_headers=True))))


# ------------------------------------------------------------------ random configurations (fuzzing)

_M64 = (1 << 64) - 1


def _group_hash(keys: np.ndarray) -> np.ndarray:
    """group_normalize.cuh's group_hash (splitmix64 finalizer) of int64 keys, as uint64."""
    x = keys.astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


def _colliding_ids(rng, count, cap):
    """`count` distinct int64 keys whose hash slots (cap a power of two) lie in 4 consecutive slots: long probe
    chains that wrap around the end of the table (cap-2 .. cap+1), or cross a 1024-slot tile of the offset scan, or
    anywhere."""
    first = rng.choice([cap - 2, cap - 2, rng.randrange(cap)] + ([1022, cap - 1026] if cap > 1024 else []))
    want = {(first + i) % cap for i in range(4)}
    found: list[int] = []
    start = rng.randrange(-(2**62), 2**62)
    while len(found) < count:
        cand = np.arange(start, start + 65536, dtype=np.int64)
        slots = _group_hash(cand) & np.uint64(cap - 1)
        found += cand[np.isin(slots, np.array(sorted(want), dtype=np.uint64))].tolist()
        start += 65536
    return found[:count]


def _draw_group_normalize(rng, gpu=False):
    """A random group_normalize case -> (config, (rewards, group_ids, weights as float64)). `gpu`: also sizes past
    the emulator's cost cap (S up to 60000); the emulator's draws are unchanged by the parameter."""
    c = {"kind": "group_normalize", "dtype": rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.float64])}
    r = rng.random()
    S = (rng.choice([1, 2, 3, 31, 32, 33, 1023, 1024, 1025]) if r < 0.15 else rng.randint(1, 600) if r < 0.9
         else rng.randint(600, 4000))
    if gpu and rng.random() < 0.25:
        S = rng.choice([4095, 4096, 4097, 8192, rng.randint(4000, 60000)])
    c["S"] = S
    layout = rng.choice(["equal", "equal", "random", "big+small"])
    if layout == "equal":
        g = min(S, rng.choice([1, 2, 3, 4, 8, 16, 31, 32, 33, 34, 64, 100, S]))
        sizes = [g] * (S // g) + ([S % g] if S % g else [])
    else:
        sizes = []
        while sum(sizes) < S:
            sizes.append(rng.randint(1, 8) if rng.random() < 0.7 else rng.randint(20, 80))
            if layout == "big+small" and len(sizes) == 1:
                sizes[0] = rng.randint(1, S)
        sizes[-1] -= sum(sizes) - S
        sizes = [s for s in sizes if s > 0]
    c["layout"], c["groups"] = layout, len(sizes)
    ids = np.repeat(np.arange(len(sizes)), sizes)
    c["scattered"] = rng.random() < 0.7
    if c["scattered"]:
        ids = ids[np.random.default_rng(rng.randrange(2**32)).permutation(S)]
    cap = 32
    while cap < 2 * S:
        cap *= 2
    keys = rng.choice(["small", "huge", "negative", "colliding"])
    c["keys"] = keys
    G = len(sizes)
    if keys == "huge":
        table = [rng.randrange(-(2**63), 2**63) for _ in range(G)]
        table[0] = -(2**63)
        table[-1] = 2**63 - 1 if G > 1 else table[-1]
    elif keys == "negative":
        table = [-1 - 3 * i for i in range(G)]
    elif keys == "colliding":  # up to 64 groups in one probe chain, the rest anywhere
        nc = min(G, 64)
        table = _colliding_ids(rng, nc, cap) + [rng.randrange(2**40) * 2**20 + i for i in range(G - nc)]
    else:
        table = list(range(G))
    if len(set(table)) != G:  # random huge / colliding ids that met: make them distinct again
        table = list(dict.fromkeys(table))
        table += [2**62 + i for i in range(G - len(table))]
    group_ids = torch.tensor(table, dtype=torch.int64)[torch.from_numpy(ids)]
    R = rng.randint(1, 4)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    cols, kinds = [], []
    for _ in range(R):
        kind = rng.choice(["binary", "normal", "int", "constant", "offset", "per_group"])
        kinds.append(kind)
        if kind == "binary":
            col = (torch.rand(S, generator=g) < rng.random()).double()
        elif kind == "normal":
            col = torch.randn(S, generator=g, dtype=torch.float64) * rng.choice([0.01, 1.0, 30.0])
        elif kind == "int":
            col = torch.randint(0, 6, (S,), generator=g).double()
        elif kind == "constant":
            col = torch.full((S,), rng.uniform(-3, 3), dtype=torch.float64)
        elif kind == "offset":  # well conditioned: the offset a few spreads
            col = rng.uniform(-4, 4) + torch.randn(S, generator=g, dtype=torch.float64)
        else:  # constant within each group: std 0 in every group
            col = torch.randn(G, generator=g, dtype=torch.float64)[torch.from_numpy(ids)]
        cols.append(col)
    c["columns"] = kinds
    rewards = torch.stack(cols, 1).to(c["dtype"])
    wk = rng.choice(["ones", "linspace", "normal", "with_zero"])
    c["weights"] = wk
    w = {"ones": torch.ones(R, dtype=torch.float64), "linspace": torch.linspace(1.0, 0.25, R, dtype=torch.float64),
         "normal": torch.randn(R, generator=g, dtype=torch.float64)}.get(wk)
    if w is None:
        w = torch.rand(R, generator=g, dtype=torch.float64)
        w[rng.randrange(R)] = 0.0
    c["weight_dtype"] = rng.choice([torch.float64, torch.float32, torch.bfloat16])  # the op takes any float dtype
    w = w.to(c["weight_dtype"]).double()  # the launcher converts weights to float64
    c["mode"] = rng.choice(["decoupled", "sum"])
    c["order"] = rng.choice([0, rng.randrange(1, 2**62), EMU_GREEDY | rng.randrange(2**62)])
    return c, (rewards, group_ids, w)


def _zscore_ext(x: np.ndarray, inv: np.ndarray, ngroups: int) -> np.ndarray:
    """_group_zscore in numpy longdouble (means shifted by the group's first value, as there: 0 where the group's
    values are all equal)."""
    first = np.full(ngroups, x.shape[0])
    np.minimum.at(first, inv, np.arange(x.shape[0]))
    shift = x[first][inv]
    cnt = np.zeros(ngroups, dtype=x.dtype)
    np.add.at(cnt, inv, np.ones_like(x))
    tot = np.zeros(ngroups, dtype=x.dtype)
    np.add.at(tot, inv, x - shift)
    mean = shift + (tot / cnt)[inv]
    var = np.zeros(ngroups, dtype=x.dtype)
    np.add.at(var, inv, (x - mean) ** 2)
    sd = np.sqrt(var / cnt)[inv]
    return np.where(sd > 0, (x - mean) / np.where(sd > 0, sd, 1), 0)


def group_normalize_ext(rewards, group_ids, weights, mode):
    """group_normalize_reference in x87 extended precision (numpy longdouble): the oracle of float64 results, where
    the float64 reference is itself off by the conditioning of the z-scores (eps |mean| / std per group; it was
    5.5e-14 off in a group of 6 where the kernel was 4.3e-14 off). The weighted sum of the "sum" mode is taken
    from float64 (the kernel's and the reference's value, in their order): the z-score jumps at std == 0, so it
    must see the same ties. Returns float64, or None where longdouble is no wider than float64."""
    L = np.longdouble
    if np.finfo(L).eps > 1e-18:
        return None
    _, inv = torch.unique(group_ids, return_inverse=True)
    inv, ngroups = inv.numpy(), int(inv.max()) + 1
    r = rewards.double()
    if mode == "decoupled":
        rl, wl = r.numpy().astype(L), weights.double().numpy().astype(L)
        total = sum(wl[j] * _zscore_ext(rl[:, j], inv, ngroups) for j in range(rl.shape[1]))
    else:
        total = _zscore_ext((r * weights.double()).sum(1).numpy().astype(L), inv, ngroups)
    mean = total.mean()
    sd = max(np.sqrt(((total - mean) ** 2).mean()), L(1e-8))
    return torch.from_numpy(((total - mean) / sd).astype(np.float64))


def _check_group_normalize_case(run, c, data):
    """`run(rewards, group_ids, weights, c)` -> the kernel's advantages (CPU) of a drawn case (weights: float64,
    rounded through c["weight_dtype"] already)."""
    rewards, ids, weights = data
    got = run(rewards, ids, weights, c)
    want = _gl.group_normalize_reference(rewards.double(), ids, weights, c["mode"])
    model = _gl.group_normalize_reference(rewards, ids, weights, c["mode"])  # float64 arithmetic, float32 output
    assert got.isfinite().all()
    if rewards.dtype == torch.float64:
        exact = group_normalize_ext(rewards, ids, weights, c["mode"])
        if exact is None:  # no wider type: the float64 reference as the oracle, as the fixed tests
            e = float((got - want).abs().max())
            assert e <= 64 * torch.finfo(torch.float64).eps * max(1.0, float(want.abs().max())), e
        else:  # within 2x the float64 reference's error (+ within_2x's 64 ulps)
            within_2x(got, exact, want)
    else:
        within_2x(got, want, model, floor=2 * torch.finfo(torch.float32).eps)


def _draw_vocab(rng, n_vec, gpu=False):
    r = rng.random()
    if r < 0.3:
        V = rng.choice([1, 2, 3, 7, 31, 111, 255, 256, 257, 1001])
    elif r < 0.6:  # one loop iteration of the block covers 256 vectors (vector path) or 256 elements (scalar)
        base = 256 * rng.choice([1, n_vec]) * rng.randint(1, 3)
        V = max(1, base + rng.choice([-n_vec, -1, 0, 1, n_vec]))
    elif r < 0.95:
        V = rng.randint(1, 3000)
    else:
        V = rng.randint(3000, 20000)
    if gpu:  # also a Qwen-sized vocabulary (151936) and around it, and large ones
        r = rng.random()
        if r < 0.08:
            V = rng.choice([151936, 151936, 151936 + 1, 151936 - n_vec, 152064])
        elif r < 0.2:
            V = rng.randint(20000, 160000)
    return V


def _draw_lm_head(rng, gpu=False):
    """A random LM-head row-kernel case (a config dict). `gpu`: for _LmHeadThroughGemm, also more rows and larger
    vocabularies (rows x V up to 6e5 elements), the launcher's chunk size, the hidden size of the one-hot GEMM
    and whether grad_hidden is asked for; no misaligned buffer (the launcher's chunk buffer is its own, aligned);
    the emulator's draws are unchanged by the parameter."""
    c = {"kind": rng.choice(["logprobs", "grad", "grpo", "grpo"])}
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.float64])
    es = torch.finfo(dtype).bits // 8
    c["dtype"] = dtype
    V = _draw_vocab(rng, 16 // es, gpu)
    c["vocab"] = V
    c["rows"] = rng.randint(1, max(1, min(8, 40000 // V)))
    if gpu and rng.random() < 0.5:
        c["rows"] = rng.randint(1, max(1, min(rng.choice([16, 100]), 600_000 // V)))
    c["row0"] = rng.choice([0, rng.randint(0, 6)])
    c["tokens"] = c["row0"] + c["rows"] + rng.randint(0, 3)
    # (V = 1 with its one id suppressed would leave an empty softmax: lse -inf, logp / entropy undefined)
    c["suppress"] = rng.choice([-1, -1, 0, V - 1, rng.randrange(V)]) if V > 1 else -1
    c["misaligned"] = rng.random() < 0.1 and not gpu  # a buffer es bytes off a 16-byte boundary: the scalar path
    if gpu:
        rows = c["rows"]
        c["chunk"] = rng.choice([1, 2, 3, rows, rows, rows + 1, 1024, rng.randint(1, rows)])
        c["hidden"] = rows + rng.choice([0, 0, 1, 3, 8, rng.randint(0, 64)])
        c["grad_hidden"] = rng.random() < 0.7
    c["spread"] = rng.choice([0.5, 4.0, 4.0, 30.0])
    c["specials"] = [rng.choice(["none", "none", "none", "neg_inf", "equal", "offset", "peaked"]) for _ in range(c["rows"])]
    c["order"] = rng.choice([0, rng.randrange(1, 2**62), EMU_GREEDY | rng.randrange(2**62)])
    if c["kind"] == "logprobs":
        c["entropy"] = rng.random() < 0.5
    if c["kind"] == "grpo":
        c["on_policy"] = rng.random() < 0.4
        c["beta"] = rng.choice([0.0, 0.0, 0.02, 0.1, -0.05, rng.uniform(0, 1)])
        c["mu"] = rng.choice([0.0, 0.0, 0.1, 1.0, rng.uniform(0, 1)])
        c["eps"] = (rng.choice([0.0, 0.1, 0.2, 0.28, 0.5, 1.0, 2.0, math.inf]),
                    rng.choice([0.0, 0.1, 0.2, 0.28, 0.5, 1.0, 2.0, math.inf]))
        c["write_grad"] = rng.random() < 0.8
        c["entropy"] = rng.random() < 0.3
    return c


def _lm_head_inputs(rng, c, gpu=False):
    """Logits [rows, V] (in a misaligned buffer when drawn) and targets [T] of an LM-head case. `gpu` (the logits
    of a GEMM, _LmHeadThroughGemm): the -inf logits become their row's max - 200 (e^-200 underflows in float32:
    -inf's place in a float32 softmax, with a finite logp when a target lands there), and GRPO targets avoid the
    suppressed id (logp -inf: with beta = 0 a NaN gradient row, which the grad_weight GEMM that carries the
    gradient out would spread over every column through 0 x NaN); the draws are the emulator's otherwise."""
    dtype, V, rows, sup = c["dtype"], c["vocab"], c["rows"], c["suppress"]
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(rows, V, generator=g, dtype=torch.float64) * c["spread"]
    for r, kind in enumerate(c["specials"]):
        if kind == "neg_inf" and V > 2:  # some or most entries -inf; an entry other than `suppress` stays finite
            n_inf = rng.choice([V // 3, V - 2])
            x[r, torch.randperm(V, generator=g)[:n_inf]] = float("-inf")
            if not (x[r].isfinite() & (torch.arange(V) != sup)).any():
                x[r, (sup + 1) % V] = 0.0
        elif kind == "equal":
            x[r] = 1.5
        elif kind == "offset":
            x[r] += rng.choice([-1000.0, 1000.0])
        elif kind == "peaked":
            x[r, rng.randrange(V)] += 50.0
    logits = x.to(dtype)
    if c["misaligned"]:
        store = torch.empty(rows * V + 16, dtype=dtype)
        buf = store[1 : 1 + rows * V].view(rows, V)
        buf.copy_(logits)
        logits = buf
    T, row0 = c["tokens"], c["row0"]
    targets = torch.randint(0, V, (T,), generator=g)
    finite_logp = c["kind"] == "grpo" and c["beta"] != 0  # an infinite logp has an infinite KL: not drawn there
    not_suppressed = c["kind"] == "grpo" and gpu
    for r in range(rows):
        choices = ["random", "random", "first", "last", "argmax"]
        if not finite_logp:
            choices += ["neg_inf"] if not_suppressed else ["suppressed", "neg_inf"]
        if c["kind"] != "grpo":  # the Python side validates targets: out-of-range ids reach the kernel only directly
            choices += ["out"]
        how = rng.choice(choices)
        row = logits[r].double()
        ok = torch.arange(V) != c["suppress"] if finite_logp or not_suppressed else torch.ones(V, dtype=torch.bool)
        if finite_logp:
            ok &= row.isfinite()
        ok = ok.nonzero().flatten().tolist()
        if how == "first":
            y = 0
        elif how == "last":
            y = V - 1
        elif how == "argmax":
            y = int(row.argmax())
        elif how == "suppressed":
            y = c["suppress"] if c["suppress"] >= 0 else rng.randrange(V)
        elif how == "neg_inf":
            infs = (~row.isfinite()).nonzero().flatten().tolist()
            y = rng.choice(infs) if infs else rng.randrange(V)
        elif how == "out":
            y = rng.choice([-1, -2, V, V + 7, -(2**40), 2**40])
        else:
            y = int(targets[row0 + r])
        if (finite_logp or not_suppressed) and y not in ok:
            y = rng.choice(ok)
        targets[row0 + r] = y
    if gpu:
        x = logits.double()
        top = torch.where(x.isfinite(), x, float("-inf")).amax(-1, keepdim=True)
        logits = torch.where(x == float("-inf"), top - 200.0, x).to(c["dtype"])
    return logits, targets


def oracle_stats(logits, suppress):
    """The float64 oracle of softmax_stats for any logits: log-softmax, lse and entropy computed from the logits
    shifted by their row max (as torch.log_softmax does), so that rows of large logits (+-1000) keep float64's
    accuracy. softmax_stats's x - lse, the formula of the PyTorch reference path and of the kernel, loses
    |lse| x eps there (an error of 2e-13 in the entropy of such a row: more than the kernel's). Returns (log-softmax
    [rows, V], lse, entropy)."""
    x = logits.to(torch.float64, copy=True)
    if suppress >= 0:
        x[:, suppress] = float("-inf")
    m = x.max(-1).values
    m = torch.where(m.isfinite(), m, 0.0)
    d = x - m[:, None]
    ls = torch.logsumexp(d, -1)
    logq = d - ls[:, None]
    q = logq.exp()
    return logq, m + ls, -(q * torch.where(q > 0, logq, 0.0)).sum(-1)


def _pick_logp(logq_or_x, lse, targets):
    """logp of each row's target (x - lse with lse given, or the log-softmax itself with lse None): -inf at the
    suppressed id, NaN for an out-of-range id (the kernel's contract)."""
    V = logq_or_x.shape[1]
    ok = (targets >= 0) & (targets < V)
    lp = logq_or_x[torch.arange(logq_or_x.shape[0]), targets.clamp(0, V - 1)]
    if lse is not None:
        lp = lp - lse
    return torch.where(ok, lp, torch.full_like(lp, NAN))


def _grad_floor(want, acc):
    """within_2x's floor for a gradient: 2 units of the accumulation dtype at the largest |want| (floor x scale =
    2 eps(acc) max |want|). For float32 logits the gradient is float32 arithmetic with no rounding to a coarser
    dtype after it (one exp, one product: up to an ulp on the host, expf's 2 ulps on the GPU), and twice the
    same-dtype model's error is no bound when few entries are large: a kernel entry 0.82 ulp off failed against
    a model whose worst entry was 0.19 ulp off (V = 2089, g = 0.022). Negligible against bf16 / fp16 rounding;
    float64 has within_2x's 64 ulps anyway."""
    finite = want[want.isfinite()].abs()
    amax = float(finite.max()) if finite.numel() else 0.0
    return max(1e-30, 2 * torch.finfo(acc).eps * amax / max(1.0, amax))


def _check_lm_head_case(run, rng, c, gpu=False):
    """Draws the inputs of LM-head case `c`, runs `run` (Emulated.run's signature and results: the vector-path flag
    or None where it is not observable, logp, lse, entropy and terms over all T tokens, the gradient written into
    the logits) and checks the results against float64."""
    dtype, V, rows, row0, T, sup = c["dtype"], c["vocab"], c["rows"], c["row0"], c["tokens"], c["suppress"]
    acc = acc_of(dtype)
    logits, targets = _lm_head_inputs(rng, c, gpu)
    c["targets"] = targets[row0 : row0 + rows].tolist()
    print("config:", c)
    keep = logits.clone()
    y = targets[row0 : row0 + rows]
    sl = slice(row0, row0 + rows)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    es = logits.element_size()
    want_vec = logits.data_ptr() % 16 == 0 and (V * es) % 16 == 0  # the launcher's rule
    logq64, lse64, ent64 = oracle_stats(keep, sup)  # the float64 oracle
    lp64 = _pick_logp(logq64, None, y)
    xm, lsem, entm = softmax_stats(keep, sup, acc)[:3]  # the same-dtype PyTorch computation
    lpm = _pick_logp(xm, lsem, y)
    eps = torch.finfo(acc).eps

    def untouched(*ts):
        for t in ts:
            assert t[..., :row0].isnan().all() and t[..., row0 + rows :].isnan().all(), "wrote outside the chunk"

    if c["kind"] == "logprobs":
        vec, logp, lse, ent, _ = run(logits, targets, LOGPROBS, row0=row0, tokens=T, suppress=sup,
                                     entropy=c["entropy"], order=c["order"])
        assert vec is None or vec == want_vec
        assert torch.equal(logits.view(torch.uint8), keep.view(torch.uint8))  # log-prob mode only reads
        untouched(logp, lse, ent)
        within_2x(lse[sl], lse64, lsem, floor=4 * eps)
        within_2x(logp[sl], lp64, lpm, floor=4 * eps)
        if c["entropy"]:
            within_2x(ent[sl], ent64, entm, floor=4 * eps)
        else:
            assert ent.isnan().all()
        return
    if c["kind"] == "grad":
        lse_all = torch.full((T,), NAN, dtype=acc)
        lse_all[sl] = lse64.to(acc)
        g_all = torch.full((T,), NAN, dtype=acc)
        gv = torch.randn(rows, generator=g, dtype=torch.float64) * rng.choice([0.01, 1.0, 100.0])
        gv[torch.rand(rows, generator=g) < 0.2] = 0.0  # tokens without gradient: zeros written
        g_all[sl] = gv.to(acc)
        vec, *_ = run(logits, targets, GRAD, row0=row0, tokens=T, suppress=sup, lse_in=lse_all, grad_logp=g_all,
                      order=c["order"])
        assert vec is None or vec == want_vec
        want = grad_of(keep, lse_all[sl], y, g_all[sl], sup, torch.float64)
        model = grad_of(keep, lse_all[sl], y, g_all[sl], sup, acc).to(dtype)
        within_2x(logits, want, model, floor=_grad_floor(want, acc))
        assert torch.all(logits[g_all[sl] == 0] == 0)
        if sup >= 0:
            assert torch.all(logits[:, sup] == 0)
        return
    # GRPO
    beta, mu = c["beta"], c["mu"]
    eps_low, eps_high = c["eps"]
    rnd = lambda s=1.0: torch.randn(T, generator=g, dtype=torch.float64) * s  # noqa: E731
    adv = rnd()
    adv[torch.rand(T, generator=g) < 0.2] = 0.0  # a group with equal rewards
    w_pg = rnd(0.1).abs()
    w_pg[torch.rand(T, generator=g) < 0.1] = 0.0
    inp = dict(adv=adv.to(acc), w_pg=w_pg.to(acc), old=None, ref=None, w_kl=None, w_nll=None)
    if not c["on_policy"]:
        # d = logp - old = -shift, kept 0.01 away from the clip bounds and the ratio clamp's +-10 (a d at a bound
        # flips with the rounding of logp: no well-defined answer there)
        bounds = [10.0, -10.0]
        if eps_low < 1:
            bounds.append(math.log(1 - eps_low))
        if math.isfinite(eps_high):
            bounds.append(math.log1p(eps_high))
        shifts = []
        for _ in range(rows):
            while True:
                s = rng.choice([0.5, -0.5, 0.05, -0.05, 12.0, -12.0, 0.3, -0.3, rng.uniform(-3, 3),
                                rng.uniform(-15, 15)])
                if all(abs(-s - b) > 0.01 for b in bounds):
                    break
            shifts.append(s)
        old = torch.full((T,), NAN, dtype=acc)
        old[sl] = (lp64 + torch.tensor(shifts, dtype=torch.float64)).to(acc)
        inp["old"] = old
        c["shifts"] = shifts
    if beta != 0:
        ref = torch.full((T,), NAN, dtype=acc)
        ref[sl] = (lp64 + rng.choice([0.2, 2.0]) * torch.randn(rows, generator=g, dtype=torch.float64)).to(acc)
        inp["ref"] = ref
        inp["w_kl"] = rnd(0.1).abs().to(acc)
    if mu != 0:
        inp["w_nll"] = ((rnd() > 0).double() * rng.choice([0.05, 1.0])).to(acc)
    vec, logp, lse, ent, terms = run(
        logits, targets, GRPO, row0=row0, tokens=T, suppress=sup, entropy=c["entropy"],
        write_grad=c["write_grad"], clip=(1.0 - eps_low, 1.0 + eps_high), old=inp["old"], ref=inp["ref"],
        adv=inp["adv"], w_pg=inp["w_pg"], w_kl=inp["w_kl"], w_nll=inp["w_nll"], beta=beta, mu=mu,
        order=c["order"])
    assert vec is None or vec == want_vec
    untouched(logp, lse, terms, ent)
    kw = dict(eps_low=eps_low, eps_high=eps_high, beta=beta, mu=mu)
    pick = lambda v: None if v is None else v[sl].double()  # noqa: E731
    g64, terms64 = _gl._grpo_dlogp(lp64, pick(inp["old"]), pick(inp["ref"]), inp["adv"][sl].double(),
                                   inp["w_pg"][sl].double(), pick(inp["w_kl"]), pick(inp["w_nll"]), **kw)
    pickm = lambda v: None if v is None else v[sl]  # noqa: E731
    gm, termsm = _gl._grpo_dlogp(lpm, pickm(inp["old"]), pickm(inp["ref"]), inp["adv"][sl], inp["w_pg"][sl],
                                 pickm(inp["w_kl"]), pickm(inp["w_nll"]), **kw)
    floor = 8 * eps
    within_2x(logp[sl], lp64, lpm, floor=floor)
    within_2x(lse[sl], lse64, lsem, floor=floor)
    within_2x(terms[:, sl], terms64, termsm, floor=floor)
    if c["entropy"]:
        within_2x(ent[sl], ent64, entm, floor=4 * eps)
    else:
        assert ent.isnan().all()
    if not c["write_grad"]:
        assert torch.equal(logits.view(torch.uint8), keep.view(torch.uint8))
        return
    # Pass 2 given the kernel's own forward scalars (logp and lse, checked against float64 above): g from its
    # logp and the softmax from its lse, in float64 and in the same dtype. From lp64 instead, a sub-ulp difference
    # of one token's logp is amplified into g (1 - exp(-dr) with dr small, a few rows of a tiny vocabulary) beyond
    # twice the same-dtype model's luckier rounding: a float32 logp 0.7 ulp off gave 2.3x the model's error.
    lpk = logp[sl]
    gk64, _ = _gl._grpo_dlogp(lpk.double(), pick(inp["old"]), pick(inp["ref"]), inp["adv"][sl].double(),
                              inp["w_pg"][sl].double(), pick(inp["w_kl"]), pick(inp["w_nll"]), **kw)
    gkm, _ = _gl._grpo_dlogp(lpk, pickm(inp["old"]), pickm(inp["ref"]), inp["adv"][sl], inp["w_pg"][sl],
                             pickm(inp["w_kl"]), pickm(inp["w_nll"]), **kw)
    want = grad_of(keep, lse[sl], y, gk64, sup, torch.float64)
    model = grad_of(keep, lse[sl], y, gkm, sup, acc).to(dtype)
    within_2x(logits, want, model, floor=_grad_floor(want, acc))


class _LmHeadThroughGemm:
    """Emulated.run's interface on `_C`'s LM-head entry points (linear_logprobs, linear_logprobs_backward,
    fused_linear_grpo_loss: the CUDA extension's, or stand-ins with their signatures), for the random
    configurations of the row kernel on a GPU. Those entry points take hidden states and the LM head, not logits:
    hidden [rows, H] has row t one-hot at column cols[t] and the head W [V, H] holds logits row t in column cols[t]
    (random values elsewhere), so that logits = hidden @ W^T, the launcher's cuBLAS GEMM, is exact in every dtype
    (one product by 1, the rest exact zeros; TF32 off) and the row kernel sees the drawn logits (checked against
    the same GEMM in PyTorch). The gradient comes back exactly the same way: grad_W = dlogits^T @ hidden,
    accumulated over the chunks, holds token t's d loss / d logits in column cols[t] and zeros elsewhere (checked);
    grad_hidden = dlogits @ W, when c["grad_hidden"], is checked per element within the GEMM's rounding-error
    bound of the float64 product. The chunk's per-token arrays [row0, row0 + rows) go to one call over `rows`
    tokens in chunks of c["chunk"] (the launcher's row0 is its own chunk's); outputs outside come back NaN. GRPO:
    the fused entry point returns no lse, so linear_logprobs' lse of the same logits (the same statistics code)
    stands in. Returns vec None: the launcher's chunk buffer is aligned and its path is not observable."""

    def __init__(self, C, device, c):
        self.C, self.device, self.c = C, torch.device(device), c

    def __call__(self, logits, targets, mode, *, row0=0, tokens=None, suppress=-1, entropy=False, write_grad=True,
                 old=None, ref=None, adv=None, w_pg=None, w_kl=None, w_nll=None, clip=(0.8, 1.28), beta=0.0, mu=0.0,
                 lse_in=None, grad_logp=None, order=0):
        C, dev, c = self.C, self.device, self.c
        rows, V = logits.shape
        dtype, acc = logits.dtype, acc_of(logits.dtype)
        T = tokens if tokens is not None else row0 + rows
        H, chunk = c["hidden"], c["chunk"]
        g = torch.Generator().manual_seed(V * 1009 + rows * 31 + H)
        cols = torch.randperm(H, generator=g)[:rows]
        hidden = torch.zeros(rows, H, dtype=dtype)
        hidden[torch.arange(rows), cols] = 1.0
        weight = torch.randn(V, H, generator=g).to(dtype)
        weight[:, cols] = logits.t()
        h, w = hidden.to(dev), weight.to(dev)
        assert torch.equal((h @ w.t()).cpu(), logits), "the one-hot GEMM is not exact (TF32?)"
        sl = slice(row0, row0 + rows)
        y = targets[sl].to(dev)
        tok = lambda v: None if v is None else v[sl].to(dev)  # noqa: E731
        out = lambda *shape: torch.full(shape, NAN, dtype=acc)  # noqa: E731
        logp, lse, ent, terms = out(T), out(T), out(T), out(4, T)
        need_h = c["grad_hidden"]
        gh = gw = None
        if mode == LOGPROBS:
            lp, ls, en = C.linear_logprobs(h, w, y, suppress, chunk, entropy)
        elif mode == GRAD:
            gh, gw = C.linear_logprobs_backward(h, w, y, tok(lse_in), tok(grad_logp), suppress, chunk, need_h, True)
        else:
            eps_low, eps_high = c["eps"]
            assert clip == (1.0 - eps_low, 1.0 + eps_high)
            lp, tm, en, gh, gw = C.fused_linear_grpo_loss(
                h, w, y, tok(old), tok(ref), tok(adv), tok(w_pg), tok(w_kl), tok(w_nll), eps_low, eps_high, beta, mu,
                suppress, chunk, need_h and write_grad, write_grad, entropy)
            assert tm.dtype == acc and tm.device.type == dev.type and tm.shape == (4, rows)
            terms[:, sl] = tm.cpu()
            _, ls, _ = C.linear_logprobs(h, w, y, suppress, chunk, False)
        if mode != GRAD:
            assert lp.dtype == acc and lp.device.type == dev.type and (en is not None) == entropy
            logp[sl], lse[sl] = lp.cpu(), ls.cpu()
            if entropy:
                ent[sl] = en.cpu()
        if mode == LOGPROBS or not write_grad:
            assert gh is None and gw is None
            return None, logp, lse, ent, terms
        gw = gw.cpu()
        assert gw.dtype == dtype and gw.shape == (V, H)
        rest = torch.ones(H, dtype=torch.bool)
        rest[cols] = False
        assert torch.all(gw[:, rest] == 0), "grad_weight: a column of no token is not zero"
        dl = gw[:, cols].t()
        if need_h:
            want = dl.double() @ weight.double()
            fin, fa = torch.finfo(dtype), torch.finfo(acc)
            bound = (fin.eps * want.abs() + V * fa.eps * (dl.double().abs() @ weight.double().abs())
                     + fin.smallest_normal * fin.eps)
            got = gh.cpu().double()
            bad = ~((got - want).abs() <= bound) & (want.abs() <= fin.max / 2)  # (fp16 may overflow, float64 not)
            assert gh.dtype == dtype and not bad.any(), (
                f"grad_hidden: {int(bad.sum())} elements past the GEMM's error bound, e.g. {float(got[bad][0])} for "
                f"{float(want[bad][0])} (bound {float(bound[bad][0])})")
        else:
            assert gh is None
        logits.copy_(dl)
        return None, logp, lse, ent, terms


class _EmulatedC:
    """`_C`'s LM-head entry points on the CPU, for _LmHeadThroughGemm without a GPU: csrc/grpo_loss.cu's chunk
    loop (run_chunks: one [min(chunk, T), V] buffer, logits = hidden_chunk @ W^T, the row kernel with row0 = the
    chunk's first token, grad_hidden rows and grad_W accumulated in the weight dtype) in PyTorch around the
    emulated row kernel."""

    def __init__(self, emu):
        self.emu = emu

    def _run(self, hidden, weight, targets, suppress, chunk, mode, need_h, need_w, **kw):
        T, V = hidden.shape[0], weight.shape[0]
        acc = acc_of(hidden.dtype)
        res = [torch.full((T,), NAN, dtype=acc) for _ in range(3)] + [torch.full((4, T), NAN, dtype=acc)]
        gh = torch.empty_like(hidden) if need_h else None
        gw = (torch.zeros_like(weight) if T == 0 else torch.empty_like(weight)) if need_w else None
        buf = torch.empty(min(chunk, T), V, dtype=hidden.dtype)
        for t0 in range(0, T, chunk):
            n = min(chunk, T - t0)
            logits = buf[:n]
            torch.mm(hidden[t0 : t0 + n], weight.t(), out=logits)
            _, *outs = self.emu.run(logits, targets, mode, row0=t0, tokens=T, suppress=suppress,
                                    write_grad=need_h or need_w, **kw)
            for r, o in zip(res, outs):
                r[..., t0 : t0 + n] = o[..., t0 : t0 + n]
            if mode != LOGPROBS:
                if gh is not None:
                    gh[t0 : t0 + n] = logits @ weight
                if gw is not None:
                    gw.copy_(logits.t() @ hidden[t0 : t0 + n] + (gw if t0 else 0))
        return res, gh, gw

    def linear_logprobs(self, hidden, weight, targets, suppress_token, chunk, with_entropy):
        (logp, lse, ent, _), _, _ = self._run(hidden, weight, targets, suppress_token, chunk, LOGPROBS, False, False,
                                              entropy=with_entropy)
        return logp, lse, ent if with_entropy else None

    def linear_logprobs_backward(self, hidden, weight, targets, lse, grad_logp, suppress_token, chunk,
                                 need_grad_hidden, need_grad_weight):
        _, gh, gw = self._run(hidden, weight, targets, suppress_token, chunk, GRAD, need_grad_hidden, need_grad_weight,
                              lse_in=lse, grad_logp=grad_logp)
        return gh, gw

    def fused_linear_grpo_loss(self, hidden, weight, targets, old_logp, ref_logp, advantages, w_pg, w_kl, w_nll,
                               eps_low, eps_high, beta, mu, suppress_token, chunk, need_grad_hidden, need_grad_weight,
                               with_entropy):
        (logp, _, ent, terms), gh, gw = self._run(
            hidden, weight, targets, suppress_token, chunk, GRPO, need_grad_hidden, need_grad_weight,
            entropy=with_entropy, old=old_logp, ref=ref_logp, adv=advantages, w_pg=w_pg, w_kl=w_kl, w_nll=w_nll,
            clip=(1.0 - eps_low, 1.0 + eps_high), beta=beta, mu=mu)
        return logp, terms, ent if with_entropy else None, gh, gw


def _check_random_config(case, lm_head_runner, run_group_normalize, gpu=False):
    """Case `case`: a group_normalize case (a third) checked through `run_group_normalize(rewards, group_ids,
    weights, config)`, or an LM-head row-kernel case through `lm_head_runner(config)` (a function with
    Emulated.run's signature). `gpu`: the draws' GPU sizes and inputs (see _draw_lm_head, _lm_head_inputs,
    _draw_group_normalize). A failure names the case and its configuration."""
    rng = random.Random(case)
    c = {}
    try:
        if rng.random() < 1 / 3:
            c, data = _draw_group_normalize(rng, gpu)
            print("config:", c)
            _check_group_normalize_case(run_group_normalize, c, data)
        else:
            c = _draw_lm_head(rng, gpu)
            _check_lm_head_case(lm_head_runner(c), rng, c, gpu)
    except AssertionError as e:
        raise AssertionError(f"case {case}, config {c}: {e}") from e


@pytest.mark.parametrize("case", fuzz_cases(40))
def test_emulated_grpo_loss_random_config(emu, case):
    """A random configuration of one of the emulated kernels of this file. The LM-head row kernel (a quarter each
    log-probs, gradient; half GRPO): float32 / bf16 / fp16 / float64 logits; V from 1 to 20000 (odd, powers of
    two, at / past the block's 256-vector and 256-element iterations; large ones rare) so both the vector and the
    scalar path run (a misaligned buffer sometimes); 1..8 rows of a chunk at a random row0 inside T tokens;
    suppress none / 0 / V-1 / any; rows with -inf entries, all-equal, offset by +-1000, peaked; targets random,
    first, last, argmax, at the suppressed id or a -inf logit (not with beta != 0: an infinite KL), out of range
    (log-probs and gradient modes only: the Python side validates them); entropy on / off; gradient mode: g with
    exact zeros; GRPO: on / off policy (ratios on both clip sides and past the +-10 clamp, never within 0.01 of a
    bound), eps_low / eps_high from 0 to inf, beta (negative too) and mu zero or not, zero advantages and weights,
    write_grad on / off. group_normalize (a third of the cases): S 1..4000, equal or mixed group sizes (per-thread
    and per-warp groups), members scattered or contiguous, group ids small / huge / negative / hash-colliding
    (probe chains wrapping the table), 1..4 reward columns (binary, normal, integer, constant, offset, constant
    per group), weights of any float dtype, decoupled / sum. A random schedule (launch order, seeded, warp-greedy).
    Checked as the fixed tests of this file check."""
    _check_random_config(case, lambda c: emu.run,
                         lambda r, ids, w, c: emu_group_normalize(emu, r, ids, w, c["mode"], order=c["order"]))


@pytest.mark.parametrize("case", fuzz_cases(4))
def test_gpu_random_config_code_on_the_emulator(emu, case):
    """test_grpo_loss.py's test_gpu_random_config (the GPU-sized draws, _LmHeadThroughGemm's one-hot GEMMs around
    the chunk loop, group_normalize's public op) on the CPU, with `_C` replaced by _EmulatedC (the chunk loop in
    PyTorch around the emulated row kernel) and group_normalize by its emulation: so that the GPU test's own code
    runs where no GPU is, and a change that breaks it shows before a GPU is lent."""
    _check_random_config(case, lambda c: _LmHeadThroughGemm(_EmulatedC(emu), "cpu", c),
                         lambda r, ids, w, c: emu_group_normalize(emu, r, ids, w.to(c["weight_dtype"]), c["mode"]),
                         gpu=True)
