"""rl/optim.py: AdamW with fp32 state and master weights for bf16/fp16 parameters."""

import copy

import pytest
import torch
from conftest import StandInStreams

from lightningrl_fast.rl.optim import MasterAdamW, make_optimizer


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(97, 13, generator=g) * 0.5).to(dtype)),
            torch.nn.Parameter(torch.randn(123, generator=g).to(dtype))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)


def test_fp32_parameters_follow_torch_adamw():
    a, b = _params(torch.float32), _params(torch.float32)
    ours = MasterAdamW(a, lr=3e-3, betas=(0.9, 0.98), weight_decay=0.1)
    ref = torch.optim.AdamW(b, lr=3e-3, betas=(0.9, 0.98), weight_decay=0.1, foreach=False)
    for step in range(7):
        _grads(a, step)
        _grads(b, step)
        ours.step()
        ref.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    assert "master" not in ours.state[a[0]]  # fp32 parameters are their own master


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_get_fp32_state_and_keep_small_updates(dtype):
    lo = _params(dtype)
    hi = [torch.nn.Parameter(p.detach().double()) for p in lo]  # float64 AdamW on the same start and grads
    opt = make_optimizer(lo, lr=1e-4)
    ref = torch.optim.AdamW(hi, lr=1e-4, weight_decay=0.0, foreach=False)
    assert isinstance(opt, MasterAdamW)
    start = [p.detach().clone() for p in lo]
    for step in range(20):
        _grads(lo, step)
        for p, q in zip(lo, hi):
            q.grad = p.grad.double()
        opt.step()
        ref.step()
    st = opt.state[lo[0]]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == st["master"].dtype == torch.float32
    for p, q in zip(lo, hi):
        # the master tracks the float64 run to fp32 rounding; the parameter is the master rounded once
        torch.testing.assert_close(opt.state[p]["master"].double(), q.detach(), rtol=0, atol=1e-6)
        assert torch.equal(p, opt.state[p]["master"].to(dtype))
    # lr 1e-4 x 20 steps moves weights ~2e-3: far below one bf16 ulp of weights near 1, yet the master keeps it
    moved = (opt.state[lo[0]]["master"] - start[0].float()).abs()
    assert moved.max() > 1e-3


def test_state_dict_round_trip_keeps_fp32_and_continues_exactly():
    a = _params(torch.bfloat16)
    opt = MasterAdamW(a, lr=1e-3)
    for step in range(3):
        _grads(a, step)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt2 = MasterAdamW(b, lr=1e-3)
    opt2.load_state_dict(sd)
    assert opt2.state[b[0]]["exp_avg"].dtype == torch.float32 and opt2.state[b[0]]["master"].dtype == torch.float32
    for step in range(3, 6):
        _grads(a, step)
        _grads(b, step)
        opt.step()
        opt2.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        assert torch.equal(opt.state[x]["master"], opt2.state[y]["master"])


def test_bad_hyper_parameters_are_named():
    with pytest.raises(ValueError, match="lr > 0"):
        MasterAdamW(_params(torch.bfloat16), lr=0.0)
    assert isinstance(make_optimizer(_params(torch.float32), lr=1e-3), torch.optim.AdamW)


# ------------------------------------------------------------------------------------------ optimizer offload

def _mixed_params(dtype, seed=0):
    """Odd sizes, and one parameter that is a strided (transposed) view."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(97, 13, generator=g) * 0.5).to(dtype)),
            torch.nn.Parameter(torch.randn(123, generator=g).to(dtype)),
            torch.nn.Parameter(torch.randn(11, 7, generator=g).to(dtype).t())]


def _run(params, opt, steps, first=0):
    for step in range(first, first + steps):
        _grads(params, step)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_offloaded_state_is_bit_identical_to_the_resident_one(dtype):
    """The offloaded step streams the state chunk by chunk (here 10 elements: chunks straddle rows, the last one
    short) with the resident step's arithmetic: weights, moments and masters equal bit for bit, fp32 included
    (offloaded fp32 parameters are their own master). The strided parameter goes as one chunk."""
    a, b = _mixed_params(dtype), _mixed_params(dtype)
    assert not a[2].is_contiguous()
    res = MasterAdamW(a, lr=3e-3, betas=(0.9, 0.98), weight_decay=0.1)
    off = MasterAdamW(b, lr=3e-3, betas=(0.9, 0.98), weight_decay=0.1, offload=True, chunk_elems=10)
    _run(a, res, 6)
    _run(b, off, 6)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        for k in ("exp_avg", "exp_avg_sq", "master"):
            assert (k in res.state[x]) == (k in off.state[y]) == (k != "master" or dtype != torch.float32)
            if k in off.state[y]:
                assert off.state[y][k].device.type == "cpu" and off.state[y][k].is_contiguous()
                assert torch.equal(res.state[x][k], off.state[y][k].view(x.shape)), k


def test_offload_overlap_protocol_with_stand_in_streams(monkeypatch):
    """The CUDA overlap's ordering, run on the CPU with stand-in streams and events: a chunk's copies back are
    queued on the side stream after it waited for the current stream (the chunk's update), inside the side
    stream's context, and close with an event; a set is filled again only after the current stream waited for
    the event of that set's last copies back; every step ends with the current stream joining the side stream,
    and only then records the step's event. The results still equal the resident step bit for bit (the copies run
    at once here)."""
    import lightningrl_fast.rl.optim as O

    streams = StandInStreams()
    streams.install(monkeypatch, O)
    log, sides = streams.log, streams.sides
    init, take, back = O._Staging.__init__, O._Staging.take, O._Staging.copy_back

    def spy_init(self, *a):
        init(self, *a)
        self.side = streams.side()

    def spy_take(self):
        s, bufs = take(self)
        log.append(("take", s))
        return s, bufs

    def spy_back(self, s, pairs):
        log.append(("back", s))
        back(self, s, pairs)

    monkeypatch.setattr(O._Staging, "__init__", spy_init)
    monkeypatch.setattr(O._Staging, "take", spy_take)
    monkeypatch.setattr(O._Staging, "copy_back", spy_back)
    record = O.MasterAdamW._record_copies
    monkeypatch.setattr(O.MasterAdamW, "_record_copies", lambda self: (log.append(("step event",)), record(self)))
    a, b = _mixed_params(torch.bfloat16), _mixed_params(torch.bfloat16)
    res = MasterAdamW(a, lr=3e-3, weight_decay=0.1)
    off = MasterAdamW(b, lr=3e-3, weight_decay=0.1, offload=True, chunk_elems=10)
    steps, chunks = 3, sum(-(-p.numel() // 10) if p.is_contiguous() else 1 for p in b)
    for step in range(steps):
        _run(a, res, 1, first=step)
        _run(b, off, 1, first=step)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        assert torch.equal(res.state[x]["master"], off.state[y]["master"].view(x.shape))
    assert len(sides) == steps
    assert [e[0] for e in log].count("take") == [e[0] for e in log].count("back") == steps * chunks
    joins = [i for i, e in enumerate(log) if e[0] == "join"]
    assert [log[i][1] for i in joins] == sides
    # the step's event (what state_dict() and the next step wait for) after the join, so it covers the copies back
    assert all(log[i + 1] == ("step event",) for i in joins)
    start = 0
    for side, end in zip(sides, joins):  # one step's log
        last_event: dict[int, object] = {}
        step_log = log[start:end]
        for i, e in enumerate(step_log):
            if e[0] == "take":
                s = e[1]
                if s in last_event:  # filled again: after the current stream waited for its copies back
                    assert step_log[i - 1] == ("current waits", last_event[s])
                else:
                    assert step_log[i - 1][0] != "current waits"
            if e[0] == "back":
                assert [x[0] for x in step_log[i + 1: i + 5]] == ["side waits current", "enter", "side records", "exit"]
                assert step_log[i + 2][1] is side and step_log[i + 4][1] is side
                last_event[e[1]] = step_log[i + 3][1]
        assert [e[1] for e in step_log if e[0] == "take"] == [k % 2 for k in range(chunks)]  # the sets in turn
        assert log[end - 1][0] == "exit"  # the join follows the last copies back
        start = end + 2  # past the join and the step's event


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_load_state_dict_keeps_the_offload_switches(dtype):
    """torch's load_state_dict ends with a __setstate__ of the state and groups alone, which used to reset offload,
    chunk_elems and overlap to their defaults: a resumed --optimizer-offload run then held its whole state on the
    GPU. They stay as the optimizer was made, the loaded state is placed as offloaded state, and the next step
    streams it (and equals the resident one)."""
    import lightningrl_fast.rl.optim as O

    a, b = _mixed_params(dtype), _mixed_params(dtype)
    res = MasterAdamW(a, lr=3e-3, weight_decay=0.1)
    off = MasterAdamW(b, lr=3e-3, weight_decay=0.1, offload=True, chunk_elems=16, overlap=False)
    _run(a, res, 2)
    _run(b, off, 2)
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    again = MasterAdamW(c, lr=3e-3, weight_decay=0.1, offload=True, chunk_elems=16, overlap=False)
    placed = []
    real = O.MasterAdamW._place_offloaded
    again._place_offloaded = lambda entries: (placed.append(len(entries)), real(again, entries))[1]
    again.load_state_dict(copy.deepcopy(off.state_dict()))
    assert (again.offload, again.chunk_elems, again.overlap) == (True, 16, False)
    assert placed and placed[0] == sum(len(O.state_keys(p)) for p in c)
    streamed = []
    again._offloaded_step = (lambda f: lambda *args: (streamed.append(1), f(*args))[1])(again._offloaded_step)
    _run(a, res, 1, first=2)
    _run(c, again, 1, first=2)
    assert len(streamed) == len(c)
    for x, y in zip(a, c):
        assert torch.equal(x, y)


def test_offloaded_state_dict_round_trips_both_ways():
    """A checkpoint of an offloaded optimizer resumes into a resident one and back, continuing exactly; the
    loaded state is fp32, in host memory when offloaded and with the parameter otherwise."""
    a = _params(torch.bfloat16)
    off = MasterAdamW(a, lr=1e-3, offload=True, chunk_elems=64)
    _run(a, off, 3)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    res = MasterAdamW(b, lr=1e-3)
    res.load_state_dict(copy.deepcopy(off.state_dict()))
    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    off2 = MasterAdamW(c, lr=1e-3, offload=True, chunk_elems=7)
    off2.load_state_dict(copy.deepcopy(res.state_dict()))
    assert off2.state[c[0]]["master"].dtype == torch.float32 and off2.state[c[0]]["master"].shape == c[0].shape
    for params, opt in ((a, off), (b, res), (c, off2)):
        _run(params, opt, 3, first=3)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)
        assert torch.equal(off.state[x]["exp_avg_sq"], off2.state[z]["exp_avg_sq"])


def test_offload_options_are_checked_and_chosen():
    with pytest.raises(ValueError, match="chunk_elems must be a positive int"):
        MasterAdamW(_params(torch.bfloat16), offload=True, chunk_elems=0)
    opt = make_optimizer(_params(torch.float32), lr=1e-3, offload=True)  # fp32 too: torch's AdamW keeps it resident
    assert isinstance(opt, MasterAdamW) and opt.offload


@pytest.mark.parametrize("offload", [False, True])
def test_deepcopy_and_pickle_keep_the_optimizer_working(offload):
    """torch's Optimizer pickles only defaults, state and groups: the offload switch travels too, and a copy made
    after two steps takes the third exactly as an uninterrupted optimizer does."""
    import pickle

    ref_params = _params(torch.bfloat16)
    ref = MasterAdamW(ref_params, lr=1e-3, offload=offload, chunk_elems=33)
    _run(ref_params, ref, 3)
    a = _params(torch.bfloat16)
    opt = MasterAdamW(a, lr=1e-3, offload=offload, chunk_elems=33)
    _run(a, opt, 2)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.offload == offload and clone.chunk_elems == 33
        b = [p for g in clone.param_groups for p in g["params"]]
        _run(b, clone, 1, first=2)
        for x, y in zip(ref_params, b):
            assert torch.equal(x, y)
            assert torch.equal(ref.state[x]["exp_avg"], clone.state[y]["exp_avg"])


def test_offloaded_state_comes_with_the_first_gradient():
    """As in the resident path: a parameter without a gradient gets no state (no pinned memory, no step-0 entry in
    the checkpoint); its master is taken when its first gradient comes."""
    a = _params(torch.bfloat16)
    opt = MasterAdamW(a, lr=1e-3, offload=True)
    a[0].grad = torch.ones_like(a[0])
    opt.step()
    assert opt.state[a[0]] and a[1] not in opt.state
    assert len(opt.state_dict()["state"]) == 1
    with torch.no_grad():
        a[1].add_(1.0)  # changed outside the optimizer before its first gradient
    a[1].grad = torch.zeros_like(a[1])
    opt.step()
    assert torch.equal(opt.state[a[1]]["master"], a[1].float())


@pytest.mark.gpu
def test_gpu_offloaded_state_lives_in_pinned_host_memory_and_matches():
    """On a GPU: the offloaded state is pinned host memory, the step equals the resident one bit for bit, and the
    GPU holds one chunk's state at a time (peak well under the resident state's size)."""
    dev = torch.device("cuda")
    a = [torch.nn.Parameter(p.detach().to(dev)) for p in _mixed_params(torch.bfloat16)]
    a.append(torch.nn.Parameter(torch.randn(1 << 20, device=dev).to(torch.bfloat16)))
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    res = MasterAdamW(a, lr=3e-3, weight_decay=0.1)
    off = MasterAdamW(b, lr=3e-3, weight_decay=0.1, offload=True, chunk_elems=1 << 16)
    _run(a, res, 3)
    _run(b, off, 1)
    resident_state = sum(12 * p.numel() for p in b)  # ~12.6 MB; one chunk's temporaries ~1.5 MB
    for step in (1, 2):
        _grads(b, step)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        off.step()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base < resident_state / 4
    # the copies back of a step that is still running: state_dict() must wait for them (a long GPU sleep first)
    res_next = MasterAdamW([torch.nn.Parameter(p.detach().clone()) for p in a], lr=3e-3, weight_decay=0.1)
    res_next.load_state_dict(copy.deepcopy(res.state_dict()))
    nxt = [p for g in res_next.param_groups for p in g["params"]]
    _grads(nxt, 3)
    res_next.step()
    _grads(b, 3)
    torch.cuda._sleep(200_000_000)
    off.step()
    sd_now = {i: {k: v.clone() for k, v in st.items()} for i, st in off.state_dict()["state"].items()}
    for i, (x, y) in enumerate(zip(nxt, b)):
        for k in ("exp_avg", "exp_avg_sq", "master"):
            assert torch.equal(res_next.state[x][k].cpu(), sd_now[i][k].view(x.shape)), (i, k)
    # a step on a side stream starts only after the last copies back
    side = torch.cuda.Stream()
    _grads(nxt, 4)
    res_next.step()
    _grads(b, 4)
    torch.cuda._sleep(200_000_000)
    off.step()
    with torch.cuda.stream(side):
        _grads(b, 5)
        off.step()  # ordered after the default stream's step only by the optimizer's own event
    side.wait_stream(torch.cuda.current_stream())  # the resident reference has no such event: order it by hand
    with torch.cuda.stream(side):
        _grads(nxt, 5)
        res_next.step()
    torch.cuda.synchronize()
    for x, y in zip(nxt, b):
        assert torch.equal(x, y)
        assert torch.equal(res_next.state[x]["exp_avg"].cpu(), off.state[y]["exp_avg"].view(x.shape))
    a, res = nxt, res_next
    sd = off.state_dict()  # waits for the copies back
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    off2 = MasterAdamW(c, lr=3e-3, weight_decay=0.1, offload=True, chunk_elems=1 << 16)
    off2.load_state_dict(copy.deepcopy(sd))
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y)
        for st in (off.state[y], off2.state[z]):  # made by the steps, and loaded from a checkpoint
            assert all(st[k].device.type == "cpu" and st[k].is_pinned() for k in ("exp_avg", "exp_avg_sq", "master"))
        assert torch.equal(res.state[x]["master"].cpu(), off.state[y]["master"].view(x.shape))
    assert len(sd["state"]) == len(b)


@pytest.mark.gpu
def test_gpu_overlapped_copies_back_never_race_the_next_chunk(monkeypatch):
    """On a GPU, with the side stream made to lag (a long sleep queued on it before every chunk's copies back):
    if a set's buffers were filled again before their copies back had run, the host would get a later chunk's
    values. Overlapped, serial (`overlap=False`) and resident steps agree bit for bit, over several steps and
    with a parameter whose chunks alternate between the two sets an odd number of times."""
    import lightningrl_fast.rl.optim as O

    back = O._Staging.copy_back

    def lagging(self, s, pairs):
        if self.side is not None:
            with torch.cuda.stream(self.side):
                torch.cuda._sleep(2_000_000)
        back(self, s, pairs)

    monkeypatch.setattr(O._Staging, "copy_back", lagging)
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    shapes = [(1023, 37), (4099,), (5, 3)]
    base = [torch.randn(s, generator=g).to(dev, torch.bfloat16) for s in shapes]
    groups = [[torch.nn.Parameter(t.clone()) for t in base] for _ in range(3)]
    opts = [MasterAdamW(groups[0], lr=3e-3, weight_decay=0.1),
            MasterAdamW(groups[1], lr=3e-3, weight_decay=0.1, offload=True, chunk_elems=997),
            MasterAdamW(groups[2], lr=3e-3, weight_decay=0.1, offload=True, chunk_elems=997, overlap=False)]
    for step in range(4):
        for ps, opt in zip(groups, opts):
            _grads(ps, step)
            opt.step()
    torch.cuda.synchronize()
    for x, y, z in zip(*groups):
        assert torch.equal(x, y) and torch.equal(x, z)
        for k in ("exp_avg", "exp_avg_sq", "master"):
            want = opts[0].state[x][k].cpu()
            assert torch.equal(want, opts[1].state[y][k].view(x.shape)), k
            assert torch.equal(want, opts[2].state[z][k].view(x.shape)), k


def test_carve_host_packs_state_into_power_of_two_slabs(monkeypatch):
    """Offloaded state tensors are views into a few slabs whose sizes are powers of two (what torch's pinned
    allocator would round each allocation to anyway): disjoint, of the asked sizes, first-fit decreasing."""
    from lightningrl_fast.rl.optim import carve_host

    real_empty = torch.empty

    def garbage_empty(*args, **kwargs):  # fresh memory from the OS is zero: make the slab's slack visible
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", garbage_empty)

    sizes = [97 * 13, 123, 5, 1 << 20, 77]
    views = carve_host(sizes, pin=False)
    assert [v.numel() for v in views] == sizes and all(v.dtype == torch.float32 and v.dim() == 1 for v in views)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # all of it fits one 256 MiB slab
    spans = sorted((v.storage_offset(), v.storage_offset() + v.numel()) for v in views)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
    slab = views[0].untyped_storage().nbytes() // 4
    assert slab == 1 << (sum(sizes) - 1).bit_length()  # the used part, rounded up to a power of two
    whole = torch.empty(0).set_(views[0].untyped_storage())
    assert bool((whole[sum(sizes):] == 0).all())  # the slack is zeroed (a checkpoint saves whole slabs)
    for i, v in enumerate(views):
        v.fill_(i)
    assert all(bool((v == i).all()) for i, v in enumerate(views))
    # past one slab's capacity (2^26 elements): a second slab; 40M + 20M share the first (untouched memory)
    big = carve_host([40_000_000, 30_000_000, 20_000_000], pin=False)
    ptrs = [v.untyped_storage().data_ptr() for v in big]
    assert ptrs[0] == ptrs[2] != ptrs[1]
    assert sorted(v.untyped_storage().nbytes() for v in big[:2]) == [4 << 25, 4 << 26]
    assert carve_host([], pin=False) == []


# ------------------------------------------------------------------------------------------ against the paper

def _adamw_float64(w0, grads, lrs, b1, b2, eps, wd):
    """AdamW as Loshchilov & Hutter (2019), Algorithm 2, with torch's lr-scaled decoupled decay, written out in
    float64 Python scalars: per step t = 1, 2, ...: w <- w (1 - lr_t wd); m <- b1 m + (1 - b1) g;
    v <- b2 v + (1 - b2) g^2; m_hat = m / (1 - b1^t); v_hat = v / (1 - b2^t);
    w <- w - lr_t m_hat / (sqrt(v_hat) + eps)."""
    import math

    w, m, v = [float(x) for x in w0], [0.0] * len(w0), [0.0] * len(w0)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        for i, gi in enumerate(float(x) for x in g):
            w[i] *= 1.0 - lr * wd
            m[i] = b1 * m[i] + (1.0 - b1) * gi
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi
            m_hat, v_hat = m[i] / (1.0 - b1 ** t), v[i] / (1.0 - b2 ** t)
            w[i] -= lr * m_hat / (math.sqrt(v_hat) + eps)
    return tuple(torch.tensor(x, dtype=torch.float64) for x in (w, m, v))


@pytest.mark.parametrize("dtype,offload", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False),
                                          (torch.float32, True)])
def test_master_adamw_equals_a_float64_adamw_written_from_the_paper(dtype, offload):
    """An independent oracle (not torch's AdamW): a large eps (0.05, so where it enters the denominator matters:
    after the bias correction of sqrt(v), as in the paper), distinct betas, decoupled weight decay, a learning rate
    that a LambdaLR schedule changes every step (the optimizer must read the group's current lr), a gradient that is
    exactly zero for one step (it still counts as a step), and offloaded chunks of 7 elements."""
    b1, b2, eps, wd, base_lr = 0.8, 0.95, 0.05, 0.2, 0.05
    g = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter((torch.randn(3, 11, generator=g) * 2.0).to(dtype))
    w0 = p.detach().double().flatten()
    opt = MasterAdamW([p], lr=base_lr, betas=(b1, b2), eps=eps, weight_decay=wd, offload=offload, chunk_elems=7)
    factors = [0.25, 0.5, 1.0, 0.7, 0.3, 0.9]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factors[min(s, len(factors) - 1)])
    grads, lrs = [], []
    for step in range(len(factors)):
        grad = torch.randn(3, 11, generator=g).to(dtype) * (0.0 if step == 2 else 1.0)
        grads.append(grad.double().flatten())
        lrs.append(base_lr * factors[step])
        p.grad = grad
        opt.step()
        sched.step()
    w, m, v = _adamw_float64(w0, grads, lrs, b1, b2, eps, wd)
    st = opt.state[p]
    assert float(st["step"]) == len(factors)
    master = st["master"] if dtype != torch.float32 else p.detach()
    torch.testing.assert_close(master.double().flatten(), w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st["exp_avg"].double().flatten(), m, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(st["exp_avg_sq"].double().flatten(), v, rtol=1e-5, atol=1e-7)
    assert torch.equal(p.detach(), master.view(p.shape).to(dtype))  # the parameter is its master, rounded once
    assert float((w - w0).abs().max()) > 0.05  # it moved by far more than the tolerance


def test_load_state_dict_copies_the_state_it_is_given():
    """load_state_dict takes copies: an optimizer loaded straight from another's live state_dict() (no deepcopy, as
    a resume in one process or a resharding does) steps without touching the other's moments, masters or step
    count. Was a risk of `.to(..., copy=False)`: fp32 state on the same device would be shared."""
    for dtype in (torch.bfloat16, torch.float32):
        a = _params(dtype)
        src = MasterAdamW(a, lr=1e-3, weight_decay=0.1)
        _run(a, src, 2)
        before = copy.deepcopy(src.state_dict())
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        dst = MasterAdamW(b, lr=1e-3, weight_decay=0.1)
        dst.load_state_dict(src.state_dict())
        assert float(dst.state[b[0]]["step"]) == 2.0
        _run(b, dst, 2, first=2)
        after = src.state_dict()
        for i, st in before["state"].items():
            for k, v in st.items():
                assert torch.equal(after["state"][i][k], v), (dtype, i, k)
        assert float(dst.state[b[0]]["step"]) == 4.0


def test_make_optimizer_passes_betas_and_weight_decay_to_master_adamw():
    for offload in (False, True):
        opt = make_optimizer(_params(torch.bfloat16), lr=2e-3, betas=(0.8, 0.9), weight_decay=0.3, offload=offload)
        assert isinstance(opt, MasterAdamW) and opt.offload == offload
        group = opt.param_groups[0]
        assert (group["lr"], group["betas"], group["weight_decay"]) == (2e-3, (0.8, 0.9), 0.3)


def test_carve_plan_sizes_and_offloaded_bytes():
    """Exact plans: a slab is the power of two its contents need (a power-of-two fill is not doubled), an exact fit
    shares the slab, and the pinned bytes count the slab rounding."""
    from lightningrl_fast.rl.optim import carve_plan, offloaded_state_bytes

    assert carve_plan([1]) == [(1, 1, [(0, 0)])]
    assert carve_plan([5, 3]) == [(8, 8, [(0, 0), (1, 5)])]
    assert carve_plan([1 << 20]) == [(1 << 20, 1 << 20, [(0, 0)])]
    assert carve_plan([1 << 25, 1 << 25]) == [(1 << 26, 1 << 26, [(0, 0), (1, 1 << 25)])]  # exactly one slab
    assert carve_plan([3, 1 << 26]) == [(1 << 26, 1 << 26, [(1, 0)]), (4, 3, [(0, 0)])]  # full slab: the next one
    # a bf16 parameter of 100 elements: master + 2 moments = 300 fp32 elements, one slab of 512; fp32: 2 x 100 -> 256
    assert offloaded_state_bytes([torch.zeros(100, dtype=torch.bfloat16)]) == 4 * 512
    assert offloaded_state_bytes([torch.zeros(10, 10)]) == 4 * 256
