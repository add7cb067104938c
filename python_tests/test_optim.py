"""rl/optim.py: AdamW with fp32 state and master weights for bf16/fp16 parameters."""

import copy

import pytest
import torch

from lightningrl_fast.rl.optim import MasterAdamW, make_optimizer


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(97, 13, generator=g) * 0.5).to(dtype)),
            torch.nn.Parameter(torch.randn(123, generator=g).to(dtype))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


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
