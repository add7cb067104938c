"""rl/distributed.py and the data-parallel RL step: 2 CPU processes over gloo stand in for 2 GPUs over NCCL.

The contract checked: a step on 2 ranks (each with half the groups) computes the same loss, gradient norm and
weights as one process with all the groups; the ranks' weights stay bitwise equal; the rollout split draws
the same prompts as one process; sharded checkpoints save and resume per rank; the CLI runs under torchrun.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import assert_same_opt, opt_by_index

import lightningrl_fast
from lightningrl_fast.checkpoint import CheckpointError
from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.rl import distributed as D
from lightningrl_fast.rl.checkpointing import load_checkpoint, save_checkpoint_ranks, shard_file
from lightningrl_fast.rl.trainer import Groups, RLConfig, collect_groups, make_state, update_stage
from lightningrl_fast.sampler import SamplerConfig, generate
from lightningrl_fast.tasks.synthetic import SyntheticArithmetic

MASK, V = 110, 111
WORLD = 2


# ------------------------------------------------------------------------------------------------------------
# pure functions
# ------------------------------------------------------------------------------------------------------------

def test_partition_balances_and_is_deterministic():
    sizes = [100, 7, 50, 50, 3, 99, 1]
    own = D.partition(sizes, 3)
    assert own == D.partition(sizes, 3) and set(own) == {0, 1, 2}
    load = [sum(s for s, o in zip(sizes, own) if o == r) for r in range(3)]
    assert max(load) - min(load) <= max(sizes)  # greedy: within one tensor of each other
    # 100 -> r0, 99 -> r1, 50 -> r2, 50 -> r2, 7 -> r1, 3 -> r0 (tie with r2: lower rank), 1 -> r2
    assert own == [0, 1, 2, 2, 0, 1, 2] and load == [103, 106, 101]
    assert D.partition(sizes, 1) == [0] * len(sizes)
    with pytest.raises(ValueError, match="3 ranks but only 2 parameter tensors"):
        D.partition([5, 6], 3)


def test_resolve_device_names_the_problem(monkeypatch):
    assert D.resolve_device("cpu") == torch.device("cpu")
    assert D.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="--device 'gpu7'"):
        D.resolve_device("gpu7")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda:0: CUDA is not available"):
        D.resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert D.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="--device cuda:2: this machine has 2 GPU"):
        D.resolve_device("cuda:2")


def test_training_bytes_and_env_parsing():
    b = D.training_bytes(8_000_000_000, 2, 4, reference=True)
    assert b == {"weights": 16e9, "gradients": 16e9, "optimizer": 24e9, "reference": 16e9}
    assert D.training_bytes(10, 4, 1, reference=False)["optimizer"] == 80  # fp32: moments only, no master copy
    assert D.env_from_environment({}) == D.SINGLE
    e = D.env_from_environment({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"})
    assert (e.rank, e.world, e.local_rank, e.active, e.main) == (2, 4, 0, True, False)
    with pytest.raises(ValueError, match="must be integers"):
        D.env_from_environment({"WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="0 <= RANK < WORLD_SIZE"):
        D.env_from_environment({"WORLD_SIZE": "2", "RANK": "2"})


def test_one_rank_is_a_plain_run():
    env = D.SINGLE
    assert D.all_sum(env, [1, 2.5]) == [1.0, 2.5] and D.all_gather(env, "x") == ["x"]
    assert D.broadcast(env, {"a": 1}) == {"a": 1}


def test_memory_problem_names_sizes_and_options():
    gib = 2**30
    n8 = 8_190_000_000  # SDAR-8B, bf16
    msg = D.memory_problem(n8, 2, 1, True, 80 * gib)
    assert msg.startswith("training state needs 137.3 GiB per GPU (weights 15.3, gradients 15.3, optimizer 91.5, "
                          "reference 15.3 GiB; 8.19 B parameters, 1 rank(s)) but the GPU has 80.0 GiB")
    # the suggestion leaves 20% for activations and the KV cache: 5 ranks need 64.1 GiB > 64, so 6
    assert "torchrun --nproc-per-node 6" in msg and "--kl-beta 0" not in msg  # 122 GiB without it: still too big
    assert D.memory_problem(n8, 2, 4, True, 80 * gib) is None  # 68.7 GiB
    assert "--reference-offload" in D.memory_problem(n8, 2, 4, True, 70 * gib)  # 68.7 > 0.95 x 70; 53.4 without
    assert D.memory_problem(4_410_000_000, 2, 1, True, 139 * gib) is None  # SDAR-4B on one H200
    # SDAR-4B with a reference on a 70 GiB GPU: 74.0 GiB; on 2 ranks 49.3 <= 0.8 x 70, the fewest that fit
    assert "torchrun --nproc-per-node 2 " in D.memory_problem(4_410_000_000, 2, 1, True, 70 * gib)


def test_optimizer_offload_in_the_memory_plan():
    gib = 2**30
    n4, n8 = 4_410_000_000, 8_190_000_000
    b = D.training_bytes(n8, 2, 1, reference=False, optimizer_offload=True)
    # 16M-element chunks: two sets of fp32 w, m, v (the copies back of one overlap the copies in of the next), g, denom
    assert b["optimizer"] == D.OFFLOAD_STAGING_BYTES == 512 * 2**20
    assert round(sum(b.values()) / gib, 1) == 31.0  # SDAR-8B on one GPU with both offloads (README table)
    assert D.training_bytes(100, 2, 1, False, optimizer_offload=True)["optimizer"] == 1200  # smaller than a chunk
    # as allocated: the optimizer shard of the largest rank and the reference copy, in power-of-two slabs
    from lightningrl_fast.rl.optim import MasterAdamW, carve_plan, offloaded_state_bytes

    m = tiny_model(dtype=torch.bfloat16)
    params = list(m.parameters())
    assert D.host_plan(m, 1, False, False) == 0
    one = D.host_plan(m, 1, False, True)
    assert one == offloaded_state_bytes(params) >= 12 * sum(p.numel() for p in params)
    owners = D.partition([p.numel() for p in params], 2)
    shards = [offloaded_state_bytes([p for p, o in zip(params, owners) if o == r]) for r in range(2)]
    assert D.host_plan(m, 2, False, True) == max(shards) < one
    ref = 2 * sum(s for s, _, _ in carve_plan([t.numel() for t in m.state_dict().values()]))
    assert D.host_plan(m, 2, True, True) == max(shards) + ref
    opt = MasterAdamW(params, offload=True)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # what the optimizer pins is what the plan says
    slabs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for st in opt.state.values()
             for t in st.values() if t.dim() > 0}
    assert sum(slabs.values()) == one
    # SDAR-4B on one 80 GB GPU with a reference: offloading the optimizer is the suggestion that fits
    msg = D.memory_problem(n4, 2, 1, True, 70 * gib)
    assert "--optimizer-offload (the fp32 optimizer state in host memory" in msg
    assert D.memory_problem(n4, 2, 1, True, 70 * gib, optimizer_offload=True) is None
    # SDAR-8B on a 40 GB GPU: only both offloads together fit
    msg = D.memory_problem(n8, 2, 1, True, 40 * gib)
    assert "--optimizer-offload together with --reference-offload" in msg
    assert D.memory_problem(n8, 2, 1, False, 40 * gib, optimizer_offload=True) is None
    # pinned host memory: counted for every rank on the machine, refused with the sizes, unknown = not checked
    assert D.host_memory_problem(0, 8, 1, "") is None and D.host_memory_problem(10 * gib, 8, None, "x") is None
    assert D.host_memory_problem(10 * gib, 8, 100 * gib, "optimizer state") is None  # 80 <= 90
    msg = D.host_memory_problem(12 * gib, 8, 100 * gib, "optimizer state + frozen reference")
    assert msg.startswith("the offloaded training state needs 96.0 GiB of pinned host memory (12.0 GiB per rank x 8 "
                          "rank(s) on this machine: optimizer state + frozen reference) but 100.0 GiB is available")
    assert isinstance(D.available_host_bytes(), (int, type(None)))


def _fake_host(tmp_path: Path, cgroup_line: str, files: dict[str, str], mem_available_kb: int = 64 << 20):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 999999999 kB\nMemAvailable: {mem_available_kb} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(proc), str(root)


def test_available_host_memory_is_capped_by_the_memory_cgroup(tmp_path):
    """A container or batch job's memory limit caps what the run may pin (MemAvailable shows the whole machine);
    reclaimable file cache does not count as used; no limit, or nothing readable, leaves MemAvailable."""
    gib = 2**30
    # cgroup v2, a job's own folder (no cgroup namespace): 100 GiB limit, 70 GiB used of which 30 GiB inactive cache
    proc, root = _fake_host(tmp_path / "v2", "0::/slurm/job_7\n", {
        "slurm/job_7/memory.max": f"{100 * gib}\n", "slurm/job_7/memory.current": f"{70 * gib}\n",
        "slurm/job_7/memory.stat": f"anon {40 * gib}\ninactive_file {30 * gib}\n"})
    assert D.cgroup_room(proc, root) == 60 * gib
    assert D.available_host_bytes(proc, root) == 60 * gib  # below MemAvailable's 64 GiB
    # cgroup v1 seen from inside a container (its root is the container's group): 8 GiB limit, 2 GiB used
    proc, root = _fake_host(tmp_path / "v1", "4:memory:/docker/abc\n0::/\n", {
        "memory/memory.limit_in_bytes": f"{8 * gib}\n", "memory/memory.usage_in_bytes": f"{2 * gib}\n"})
    assert D.available_host_bytes(proc, root) == 6 * gib
    # no limit (v2 "max", v1's ~2^63): MemAvailable alone
    proc, root = _fake_host(tmp_path / "nolimit", "0::/\n", {"memory.max": "max\n", "memory.current": "5\n"})
    assert D.cgroup_room(proc, root) is None and D.available_host_bytes(proc, root) == 64 * gib
    proc, root = _fake_host(tmp_path / "v1none", "4:memory:/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"})
    assert D.available_host_bytes(proc, root) == 64 * gib
    assert D.available_host_bytes(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_memory_check_passes_on_cpu():
    m = tiny_model()
    plan = D.check_training_memory(m, torch.device("cpu"), 1, reference=True)
    n = sum(p.numel() for p in m.parameters())
    assert plan["weights"] == 8 * n and plan["optimizer"] == 12 * n  # fp64 weights: fp32 master + moments


def test_reduce_and_clip_against_a_float64_oracle(monkeypatch):
    """reduce_and_clip on rank 1 of 2, with the two collectives replaced by their definitions (the other rank's
    gradient added into the owner's copy; its partial sum of squares added to this rank's): the returned norm is
    the global L2 norm of the summed gradients, an owner's gradient is that sum scaled by
    max_norm / (norm + 1e-6) when that is below 1 (torch's clip_grad_norm_ formula), a parameter owned by the other
    rank keeps no gradient, a missing gradient counts as zeros, and a non-finite norm clears every gradient."""
    import math

    shapes, owners = [(3, 4), (5,), (2, 2), (7,)], [0, 1, 1, 0]
    env = D.DistEnv(1, 2, 1)

    def run(scale, max_norm, poison=False):
        g = torch.Generator().manual_seed(4)
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        mine = [torch.randn(s, generator=g, dtype=torch.float64) * scale for s in shapes]
        other = [torch.randn(s, generator=g, dtype=torch.float64) * scale for s in shapes]
        mine[2] = None  # no gradient on this rank
        if poison:
            other[3][1] = float("inf")
        for p, m in zip(params, mine):
            p.grad = None if m is None else m.float()
        total = [(o if m is None else m.float().double() + o.float().double()) for m, o in zip(mine, other)]
        other_sq = sum(float(t.square().sum()) for t, o in zip(total, owners) if o == 0)
        norm = math.sqrt(sum(float(t.square().sum()) for t in total))
        contributions = iter(other)

        def reduce(t, dst=0, **kw):
            c = next(contributions)
            if dst == env.rank:
                t += c.float()

        def all_reduce(t, **kw):
            t += other_sq

        monkeypatch.setattr(D.dist, "reduce", reduce)
        monkeypatch.setattr(D.dist, "all_reduce", all_reduce)
        got = D.reduce_and_clip(env, params, owners, max_norm)
        monkeypatch.undo()
        return got, norm, params, total

    got, norm, params, total = run(1e-4, 1e-4)  # a small norm: the 1e-6 of the clip coefficient matters
    assert got == pytest.approx(norm, rel=1e-6) and norm > 1e-4
    coef = 1e-4 / (norm + 1e-6)
    for p, t, o in zip(params, total, owners):
        if o == env.rank:
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad.double(), t * coef, rtol=1e-6, atol=0)
        else:
            assert p.grad is None
    got, norm, params, total = run(1.0, 1e3)  # below max_norm: the summed gradients unscaled
    assert got == pytest.approx(norm, rel=1e-6)
    for p, t, o in zip(params, total, owners):
        assert (p.grad is None) == (o != env.rank)
        if p.grad is not None:
            torch.testing.assert_close(p.grad.double(), t, rtol=1e-6, atol=0)
    got, norm, _, _ = run(1.0, 1e3)
    got, norm2, params, total = run(1.0, 0.8 * norm)  # a coefficient just below 1 clips too (not only small ones)
    assert norm2 == norm and got == pytest.approx(norm, rel=1e-6)
    for p, t, o in zip(params, total, owners):
        if o == env.rank:
            torch.testing.assert_close(p.grad.double(), t * (0.8 * norm / (norm + 1e-6)), rtol=1e-6, atol=0)
    got, _, params, _ = run(1.0, 1.0, poison=True)
    assert math.isinf(got) and all(p.grad is None for p in params)


def test_small_collectives_with_two_ranks(monkeypatch):
    """all_sum adds in float64 (a count past 2**24 stays exact), all_max takes the maximum; the other rank's values
    stand in through a replaced all_reduce that applies the requested op."""
    env = D.DistEnv(0, 2, 0)
    other = torch.tensor([3.0, -1.0, 0.25], dtype=torch.float64)

    def all_reduce(t, op=D.dist.ReduceOp.SUM, **kw):
        assert t.dtype == torch.float64
        if op == D.dist.ReduceOp.MAX:
            torch.maximum(t, other[: t.numel()], out=t)
        else:
            assert op == D.dist.ReduceOp.SUM
            t += other[: t.numel()]

    monkeypatch.setattr(D.dist, "all_reduce", all_reduce)
    assert D.all_sum(env, [2**24 + 1, 2, 0.5]) == [2**24 + 4, 1.0, 0.75]
    assert D.all_max(env, [1, 5, 0.5]) == [3.0, 5.0, 0.5]


def test_env_and_init_defaults(monkeypatch):
    """LOCAL_RANK absent: the rank itself (one node); `init` without a timeout (the eval and generate CLIs) waits
    the 60 minutes --dist-timeout-min defaults to; a gloo group on CPU."""
    e = D.env_from_environment({"WORLD_SIZE": "2", "RANK": "1"})
    assert (e.rank, e.world, e.local_rank) == (1, 2, 1)
    seen = {}
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(D.dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    env, dev = D.init(D.DistEnv(1, 2, 1), torch.device("cpu"))
    assert seen["backend"] == "gloo" and (seen["rank"], seen["world_size"]) == (1, 2)
    assert seen["timeout"].total_seconds() == 3600 and env.device == "cpu" and dev.type == "cpu"
    from lightningrl_fast.config import OPTIONS

    assert OPTIONS["dist_timeout_min"].default == 60.0


def test_shutdown_waits_for_the_other_ranks_only_after_success(monkeypatch):
    """ok: a barrier (no rank tears its end down while another still works), then the group is destroyed; after
    an error: no barrier (the others may never reach it), a gloo group destroyed at once, an NCCL one left alone."""
    env = D.DistEnv(0, 2, 0)
    for ok, backend, want in ((True, "gloo", ["barrier", "destroy"]), (False, "gloo", ["destroy"]),
                              (False, "nccl", []), (True, "nccl", ["barrier", "destroy"])):
        calls = []
        monkeypatch.setattr(D.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(D.dist, "get_backend", lambda b=backend: b)
        monkeypatch.setattr(D.dist, "barrier", lambda: calls.append("barrier"))
        monkeypatch.setattr(D.dist, "destroy_process_group", lambda: calls.append("destroy"))
        D.shutdown(env, ok=ok)
        assert calls == want, (ok, backend)
    calls.clear()
    D.shutdown(D.SINGLE)  # one rank: nothing to leave
    assert calls == []


# ------------------------------------------------------------------------------------------------------------
# multi-process scenarios (spawned workers; everything they use is defined at module level)
# ------------------------------------------------------------------------------------------------------------

def tiny_model(seed=0, dtype=torch.float64):
    cfg = SDARConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, block_size=4, mask_token_id=MASK, torch_dtype="float32",
                     max_position_embeddings=256)
    m = build_model(cfg, dtype=dtype, seed=seed).eval()
    m.lm_head.weight.data *= 20.0
    return m


def fixed_groups(model) -> Groups:
    """4 groups x 2 sampled rollouts with made-up rewards (the same on every rank: CPU decoding is deterministic).
    With tpf_weight 0.5 the groups' rewards r are +-0.5, 0, +-0.5, +-1.5: the batch std of groups {0, 2} (0.5),
    of {1, 3} (1.06) and of all four (0.83) differ, so rank-local batch normalization would change the update."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 100, (n,), generator=g).tolist() for n in [2, 5, 7, 3]]
    ro = generate(model, [p for p in prompts for _ in range(2)],
                  SamplerConfig(threshold=0.5, temperature=1.0, max_new_tokens=10, eos_ids=(3,), seed=5))
    return Groups(sequences=list(ro.sequences), step_maps=list(ro.seq_step_map), prompt_lens=ro.prompt_lens.tolist(),
                  resp_lens=ro.lengths.tolist(), accuracy=[1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0],
                  tpf=[2.0, 3.0, 1.0, 1.0, 4.0, 2.0, 3.0, 5.0], group_ids=[0, 0, 1, 1, 2, 2, 3, 3], texts=[""] * 8)


def take_groups(groups: Groups, which: list[int]) -> Groups:
    out = Groups()
    keep = [gid in which for gid in groups.group_ids]
    out.extend(groups, keep)
    return out


UPDATE_CFG = dict(kl_beta=0.05, nll_weight=0.1, tpf_weight=0.5, group_size=2, prompts_per_step=4,
                  updates_per_step=2, lr=1e-2,
                  grad_clip=0.05, micro_batch_tokens=10**6)


def scenario_update(env: D.DistEnv, out: Path, skewed: bool = False, offload: bool = False) -> dict:
    """Two mini-batches (two optimizer steps) on rank r's groups r, r + 2 (world 1: all four); skewed: rank 0
    has all four and rank 1 none (it only joins the collectives). On the rank's device (cpu, or cuda:<rank>)."""
    model = tiny_model(dtype=torch.float64 if env.device == "cpu" else torch.float32).to(env.device)
    groups = fixed_groups(model)
    mine = take_groups(groups, [g for g in range(4) if (env.rank == 0 if skewed else g % env.world == env.rank)])
    rc = RLConfig(**UPDATE_CFG, optimizer_offload=offload)
    state = make_state(model, rc, env)
    m = update_stage(state, mine, rc)
    owned = [i for i, p in enumerate(model.parameters()) if p in state.optimizer.state]
    return {"metrics": m, "weights": [p.detach().cpu().clone() for p in model.parameters()], "owned": owned}


class HalfRightTask(SyntheticArithmetic):
    def is_correct(self, response, ex):
        return len(response) % 2 == 0


def scenario_collect(env: D.DistEnv, out: Path) -> dict:
    """Greedy rollouts of 3 prompts x 2 samples split over the ranks (2 + 1 prompts)."""
    task = HalfRightTask(max_operand=4)
    tok = task.tokenizer
    cfg = SDARConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=8,
                     mask_token_id=tok.mask_token_id, torch_dtype="float32", max_position_embeddings=64)
    model = build_model(cfg, dtype=torch.float64, seed=3).eval()
    rc = RLConfig(prompts_per_step=3, group_size=2, filter_groups=False, max_refill_rounds=0, kl_beta=0.0)
    state = make_state(model, rc, env)
    scfg = SamplerConfig(threshold=0.9, temperature=0.0, max_new_tokens=16, eos_ids=tuple(sorted(tok.eos_token_ids)))
    groups, stats = collect_groups(state, tok, task, task.train, rc, scfg)
    return {"texts": groups.texts, "group_ids": groups.group_ids, "cursor": state.cursor,
            "prompts": [s[:n].tolist() for s, n in zip(groups.sequences, groups.prompt_lens)]}


def scenario_reshard_up(env: D.DistEnv, out: Path) -> dict:
    """Load the one-process checkpoint the test saved in out/one into 2 ranks."""
    rc = RLConfig(**dict(UPDATE_CFG, kl_beta=0.0))
    fresh = make_state(tiny_model(seed=9), rc, env)
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load_checkpoint(out / "one", fresh, config=rc, env=env)
    return {"opt": opt_by_index(fresh), "warned": any("redistributed" in str(x.message) for x in w),
            "lr": fresh.optimizer.param_groups[0]["lr"]}


def scenario_checkpoint(env: D.DistEnv, out: Path) -> dict:
    """Save a sharded checkpoint after one update, then restore it into a fresh state."""
    model = tiny_model()
    rc = RLConfig(**dict(UPDATE_CFG, kl_beta=0.0))
    state = make_state(model, rc, env)
    update_stage(state, take_groups(fixed_groups(model), [g for g in range(4) if g % env.world == env.rank]), rc)
    state.scheduler.step()
    state.step, state.cursor = 1, 4
    folder = save_checkpoint_ranks(env, out / "run", state, {"note": "x"}, config=rc)
    fresh = make_state(tiny_model(seed=9), rc, env)
    load_checkpoint(folder, fresh, config=rc, env=env)
    same_opt = all(torch.equal(a, b) for pa, pb in zip(model.parameters(), fresh.model.parameters())
                   if pa in state.optimizer.state
                   for a, b in zip(state.optimizer.state[pa].values(), fresh.optimizer.state[pb].values()))
    n_state = len(fresh.optimizer.state)
    return {"folder": str(folder), "same_opt": same_opt, "n_state": n_state, "step": fresh.step,
            "opt": opt_by_index(state),
            "cursor": fresh.cursor, "same_weights": all(torch.equal(a, b) for a, b in
                                                        zip(model.parameters(), fresh.model.parameters()))}


SCENARIOS = {"update": scenario_update, "update_skewed": lambda env, out: scenario_update(env, out, skewed=True),
             "update_offload": lambda env, out: scenario_update(env, out, offload=True),
             "collect": scenario_collect, "checkpoint": scenario_checkpoint, "reshard_up": scenario_reshard_up}


def _worker(rank: int, world: int, port: int, out: str, name: str, device: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    env, _ = D.init(D.DistEnv(rank, world, rank), torch.device(device), timeout_min=3)
    try:
        torch.save(SCENARIOS[name](env, Path(out)), Path(out) / f"{name}-rank{rank}.pt")
    finally:
        D.shutdown(env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(name: str, tmp_path: Path, world: int = WORLD, device: str = "cpu") -> list[dict]:
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path), name, device), nprocs=world, join=True)
    return [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("name", ["update", "update_skewed"])
def test_two_ranks_update_equals_one_process(tmp_path, name):
    torch.set_num_threads(1)
    one = scenario_update(D.SINGLE, tmp_path)
    r0, r1 = run_ranks(name, tmp_path)
    for a, b in zip(r0["weights"], r1["weights"]):  # the owners' broadcasts keep the ranks identical
        assert torch.equal(a, b)
    init = [p.detach() for p in tiny_model().parameters()]
    for w1, wd, w0 in zip(one["weights"], r0["weights"], init):
        torch.testing.assert_close(wd, w1, rtol=0, atol=1e-6)
    assert max(float((w1 - w0).abs().max()) for w1, w0 in zip(one["weights"], init)) > 1e-3  # it did move
    m1, md = one["metrics"], r0["metrics"]
    assert md["updates"] == m1["updates"] == 2
    # global totals: the same loss scale as one process (a rank-local total would be off by about 2x); the second
    # update starts from fp32 master weights, so it may differ in the last fp32 bits
    for k in ("loss", "kl", "clip_frac", "grad_norm"):
        assert md[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-9), k
    assert m1["grad_norm"] > UPDATE_CFG["grad_clip"]  # the clipping path ran
    n = len(init)
    assert sorted(r0["owned"] + r1["owned"]) == list(range(n)) and r0["owned"] and r1["owned"]  # ZeRO-1 shards


def test_two_ranks_with_the_optimizer_state_offloaded_equal_the_resident_run(tmp_path):
    """ZeRO-1 shards with --optimizer-offload: each rank streams only the state of the parameters it owns, and the
    two ranks end bit-identical to the same run with the state resident."""
    torch.set_num_threads(1)
    (tmp_path / "res").mkdir()
    (tmp_path / "off").mkdir()
    res, off = run_ranks("update", tmp_path / "res"), run_ranks("update_offload", tmp_path / "off")
    for r in range(WORLD):
        assert off[r]["owned"] == res[r]["owned"] and off[r]["owned"]
        assert all(torch.equal(a, b) for a, b in zip(off[r]["weights"], res[r]["weights"]))
        assert off[r]["metrics"]["loss"] == res[r]["metrics"]["loss"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_two_ranks_over_nccl(tmp_path):
    """The same step over NCCL on cuda:0 and cuda:1 (fp32): the ranks stay bitwise equal and match one process
    (to fp32 reduction-order noise, amplified at most ~lr/10 by Adam on near-zero gradients)."""
    one = scenario_update(D.DistEnv(device="cuda:0"), tmp_path)
    r0, r1 = run_ranks("update", tmp_path, device="cuda")
    for a, b, w1 in zip(r0["weights"], r1["weights"], one["weights"]):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, w1, rtol=0, atol=1e-3)
    assert r0["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-5)


def test_two_ranks_draw_the_prompts_of_one_process(tmp_path):
    torch.set_num_threads(1)
    one = scenario_collect(D.SINGLE, tmp_path)
    r0, r1 = run_ranks("collect", tmp_path)
    assert r0["cursor"] == r1["cursor"] == one["cursor"] == 3
    assert len(r0["texts"]) == 4 and len(r1["texts"]) == 2  # 2 + 1 prompts, 2 samples each
    assert r0["prompts"] + r1["prompts"] == one["prompts"] and r0["texts"] + r1["texts"] == one["texts"]
    assert r0["group_ids"] + r1["group_ids"] == one["group_ids"] == [0, 0, 1, 1, 2, 2]


def test_sharded_checkpoint_resumes_per_rank(tmp_path):
    r0, r1 = run_ranks("checkpoint", tmp_path)
    folder = Path(r0["folder"])
    assert r1["folder"] == r0["folder"] and (folder / shard_file(1)).is_file()
    assert not list((tmp_path / "run").glob(".*shard*"))  # staging files moved or removed
    for r in (r0, r1):
        assert r["same_opt"] and r["same_weights"] and r["n_state"] > 0 and (r["step"], r["cursor"]) == (1, 4)
    assert r0["opt"] and r1["opt"] and not set(r0["opt"]) & set(r1["opt"])  # disjoint shards
    every = {**r0["opt"], **r1["opt"]}
    rc = RLConfig(**dict(UPDATE_CFG, kl_beta=0.0))
    # resharded to one process: every parameter's state, from whichever shard held it
    one = make_state(tiny_model(seed=9), rc)
    with pytest.warns(UserWarning, match="redistributed"):
        load_checkpoint(folder, one, config=rc)
    assert_same_opt(opt_by_index(one), every)
    assert one.optimizer.param_groups[0]["lr"] == pytest.approx(UPDATE_CFG["lr"] * 2 / 10)  # warm-up: step 2 of 10
    # the gathered state is the shards' loaded tensors, not copies (was: cloned, so a resume that resharded an
    # offloaded optimizer held this rank's state twice in host memory until it was placed)
    from lightningrl_fast.rl.checkpointing import _reshard_optimizer, read_trainer_state

    ts = read_trainer_state(folder)
    n = len(list(one.model.parameters()))
    got = _reshard_optimizer(Path(ts["path"]), ts, 2, n, None, D.SINGLE)["state"]
    held0 = [i for i, o in enumerate(ts["owners"]) if o == 0]
    checked = 0
    for local, entry in ts["optimizer"]["state"].items():
        for k, v in entry.items():
            if torch.is_tensor(v) and v.numel() > 1:
                assert got[held0[int(local)]][k].data_ptr() == v.data_ptr(), (local, k)
                checked += 1
    assert checked >= 2
    # and back to two ranks from a one-process checkpoint
    save_checkpoint_ranks(D.SINGLE, tmp_path / "one-run", one, config=rc)
    (tmp_path / "one").symlink_to(tmp_path / "one-run" / "checkpoint-1")
    u0, u1 = run_ranks("reshard_up", tmp_path)
    assert u0["warned"] and u1["warned"] and not set(u0["opt"]) & set(u1["opt"])
    assert_same_opt({**u0["opt"], **u1["opt"]}, every)
    (folder / shard_file(1)).unlink()
    with pytest.raises(CheckpointError, match="shard of rank 1"):
        load_checkpoint(folder, make_state(tiny_model(), rc, D.DistEnv(1, 2, 1)), config=rc, env=D.DistEnv(1, 2, 1))


def cli_env(tmp_path: Path) -> dict:
    return dict(os.environ, LRF_CACHE_DIR=str(tmp_path / "cache"),
                PYTHONPATH=str(Path(lightningrl_fast.__file__).parent.parent))


def torchrun(args: list[str], env: dict, nproc: int = 2, module: str = "train") -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node nproc -m lightningrl_fast.<module> args` (nproc 1: plain
    `python -m`), which must succeed."""
    launch = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else [])
    r = subprocess.run([sys.executable, *launch, "-m", f"lightningrl_fast.{module}", *args], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def synth_checkpoint(folder: Path) -> Path:
    """A random 2-layer SDAR model over the synthetic task's characters (block 4), saved with its tokenizer."""
    from lightningrl_fast.checkpoint import save_model

    tok = SyntheticArithmetic().tokenizer
    cfg = SDARConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=4,
                     mask_token_id=tok.mask_token_id, torch_dtype="float32", max_position_embeddings=128)
    return save_model(build_model(cfg, dtype=torch.float32, seed=0), cfg, folder, tokenizer=tok)


SMOKE_DP = ["--preset", "smoke", "--threads", "1", "--eval-limit", "5", "--eval-thresholds", "0.9", "--no-plots",
            "--progress", "plain", "--prompts-per-step", "3", "--device", "cpu"]


def test_cli_under_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m lightningrl_fast.train` on CPU: one log, one metrics file, a checkpoint with
    both shards; it resumes in one process (resharded, warned) and that checkpoint again on two ranks."""
    out = tmp_path / "run"
    env = cli_env(tmp_path)
    r = torchrun(SMOKE_DP + ["--out", str(out)], env)
    assert r.stdout.count("run: ") == 1 and "x 2 ranks" in r.stdout  # rank 0 alone prints
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in recs] == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"]["0.9"]["n"] == 5  # 3 + 2 examples over the two ranks, merged
    ck = out / "checkpoint-2"
    assert (ck / shard_file(1)).is_file() and (ck / "trainer_state.pt").is_file()
    r1 = subprocess.run([sys.executable, "-m", "lightningrl_fast.train", "--resume", str(out), "--steps", "3",
                         "--progress", "plain"], env=env, capture_output=True, text=True, timeout=300)
    assert r1.returncode == 0 and "redistributed" in r1.stderr, r1.stdout[-2000:] + r1.stderr[-2000:]
    assert not (out / "checkpoint-3" / shard_file(1)).exists()  # a one-process checkpoint
    r2 = torchrun(["--resume", str(out), "--steps", "4", "--progress", "plain"], env)
    assert "resume: step 3" in r2.stdout
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert (out / "checkpoint-4" / shard_file(1)).is_file()


def test_torchrun_select_best(tmp_path):
    """--select-best on two ranks: the validation evaluations are merged over the ranks (one line each, printed
    once), rank 0 alone writes best-model, which holds the weights of the step its record names, and the kept
    step's held-out sweep covers every example."""
    from lightningrl_fast.checkpoint import load_model

    out, env = tmp_path / "run", cli_env(tmp_path)
    r = torchrun(SMOKE_DP + ["--out", str(out), "--steps", "3", "--val-fraction", "0.1", "--eval-every", "1",
                             "--select-best", "--save-every", "1", "--keep-checkpoints", "5"], env)
    assert r.stdout.count("validation (greedy") == 4 and r.stdout.count("select: kept") == 1
    step = json.loads((out / "best-model.json").read_text())["step"]
    ref = out / f"checkpoint-{step}" if step else next((tmp_path / "cache").glob("sft-*"))
    wb, wr = (dict(load_model(x)[0].named_parameters()) for x in (out / "best-model", ref))
    assert all(torch.equal(wb[n], wr[n]) for n in wb)
    sel = json.loads((out / "summary.json").read_text())["selection"]
    assert sel["step"] == step and sel["eval"]["0.9"]["n"] == 5
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("val_acc" in m for m in recs) and len(recs) == 3


def test_torchrun_resume_on_the_same_ranks_is_bit_exact(tmp_path):
    """2 steps on 2 ranks == 1 step, then a 2-rank resume for the second: same weights, same rollouts (each
    rank's optimizer shard, RNG states and the global data cursor come back)."""
    from lightningrl_fast.checkpoint import load_model

    env = cli_env(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    torchrun(SMOKE_DP + ["--out", str(a), "--steps", "2"], env)
    torchrun(SMOKE_DP + ["--out", str(b), "--steps", "1"], env)
    torchrun(["--resume", str(b), "--steps", "2", "--progress", "plain"], env)
    wa, wb = (dict(load_model(x / "checkpoint-2")[0].named_parameters()) for x in (a, b))
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    ma, mb = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b))
    assert [m["tokens"] for m in ma] == [m["tokens"] for m in mb] and [m["loss"] for m in ma] == [m["loss"] for m in mb]


def test_eval_cli_under_torchrun_equals_one_process(tmp_path):
    """`torchrun -m lightningrl_fast.eval`: two ranks decode alternate examples; the points are those of one
    process (greedy decoding), written once by rank 0."""
    env = cli_env(tmp_path)
    args = ["--model", str(synth_checkpoint(tmp_path / "m")), "--task", "synthetic", "--limit", "7", "--thresholds",
            "0.5,0.9", "--batch-size", "2", "--device", "cpu", "--quiet"]
    one, two = (torchrun(args + ["--out", str(tmp_path / d)], env, n, "eval") for n, d in ((1, "one"), (2, "two")))
    assert two.stdout.count("wrote ") == one.stdout.count("wrote ") and "x 2 ranks" in two.stdout  # rank 0 alone
    a, b = (json.loads(next((tmp_path / d).glob("*.json")).read_text()) for d in ("one", "two"))
    assert len(a["points"]) == len(b["points"]) == 2
    for pa, pb in zip(a["points"], b["points"]):
        for k in ("n", "correct", "accuracy", "finished", "mean_tpf", "forwards_per_answer", "tokens", "forwards",
                  "truncated", "well_formed"):
            assert pa[k] == pytest.approx(pb[k], rel=1e-12), k
    assert a["aup"] == pytest.approx(b["aup"])


def test_generate_cli_under_torchrun_writes_what_one_process_writes(tmp_path):
    """`torchrun -m lightningrl_fast.generate`: batches alternate between two ranks (sampling: each batch keeps its
    one-process seed); rank 0 writes the rows in input order, byte for byte those of one process."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"{i % 9}+{(i * 5) % 9}+3?"}) + "\n" for i in range(7)))
    env = cli_env(tmp_path)
    args = ["--model", str(synth_checkpoint(tmp_path / "m")), "--prompts", str(prompts), "--batch-size", "2",
            "--no-chat", "--max-new-tokens", "12", "--temperature", "1", "--threshold", "0.5", "--device", "cpu",
            "--quiet"]
    two = torchrun(args + ["--out", str(tmp_path / "two.jsonl")], env, 2, "generate")
    torchrun(args + ["--out", str(tmp_path / "one.jsonl")], env, 1, "generate")
    assert "x 2 ranks" in two.stdout and two.stdout.count("tokens/s") == 1
    a, b = (tmp_path / "one.jsonl").read_text(), (tmp_path / "two.jsonl").read_text()
    assert a == b and [json.loads(x)["id"] for x in b.splitlines()] == list(range(7))


TEARDOWN_SCRIPT = """
import os, sys, weakref
import torch
import torch.distributed as dist
from lightningrl_fast.rl import distributed as D

env, _ = D.init(D.env_from_environment(), torch.device("cpu"))
with torch.device("meta"):  # as checkpoint.load_model: the first init there imports torch._dynamo and through it
    torch.nn.Embedding(4, 2)  # torch.distributed.nn, whose defaults would keep the group (no longer: D.init)
D.all_gather(env, env.rank)
group = weakref.ref(dist.group.WORLD)
D.shutdown(env)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(f"rank {env.rank}: freed {group() is None}, gloo threads {sum('gloo' in n for n in names)}")
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists the process's threads in /proc")
def test_shutdown_frees_the_group_and_stops_gloo_threads(tmp_path):
    """`shutdown` leaves nothing of the group running. A module imported after `init_process_group` whose
    defaults keep `group.WORLD` (torch.distributed.nn, imported by the first module built on the meta device, as
    in every CLI's model load) kept the gloo backend and its worker threads alive into interpreter exit, where a
    worker still releasing a finished collective's tensors takes the GIL and the rank aborts (SIGABRT, "terminate
    called without an active exception"; rare, under machine load)."""
    script = tmp_path / "teardown.py"
    script.write_text(TEARDOWN_SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script)], env=cli_env(tmp_path), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in range(2):
        assert f"rank {rank}: freed True, gloo threads 0" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_torchrun_configuration_errors(monkeypatch, capsys):
    """Found once the torchrun variables are read, before any process group or model: exit status 2."""
    from lightningrl_fast import train as T

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert T.main(["--preset", "smoke", "--progress", "off", "--baseline", "rft"]) == T.EXIT_CONFIG
    assert "--baseline rft runs in one process" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--device cuda:1: with 2 ranks each rank uses cuda:<LOCAL_RANK>"):
        D.init(D.DistEnv(0, 2, 0), torch.device("cuda", 1))
    with pytest.raises(ValueError, match="support cuda and cpu devices"):
        D.init(D.DistEnv(0, 2, 0), torch.device("meta"))
