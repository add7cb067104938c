"""rl/checkpointing.py: atomic save/load of the RL state, exact resume, kill safety, non-finite refusal, pruning,
the frozen reference policy. CPU, tiny model, a few seconds."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import assert_same_opt, opt_by_index

import lightningrl_fast
from lightningrl_fast.checkpoint import CheckpointError, load_model, save_model
from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.rl import checkpointing as ckpt
from lightningrl_fast.rl.checkpointing import (NonFiniteModelError, load_checkpoint, resolve_checkpoint,
                                               save_checkpoint)
from lightningrl_fast.rl.trainer import RLConfig, make_state, train_step
from lightningrl_fast.sampler import SamplerConfig
from lightningrl_fast.tasks.synthetic import SyntheticArithmetic
from lightningrl_fast.tokenizer import load_tokenizer

torch.set_num_threads(1)

TASK = SyntheticArithmetic()
TOK = TASK.tokenizer


def tiny_model(seed: int = 0):
    cfg = SDARConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=8,
                     mask_token_id=TOK.mask_token_id, max_position_embeddings=64, torch_dtype="float32")
    # std 0.2 (not 0.02): confident enough that a low threshold gives TPF spread within groups
    return build_model(cfg, seed=seed).init_weights(std=0.2, generator=torch.Generator().manual_seed(seed)).eval()


def rl_cfg(**kw) -> RLConfig:
    base = dict(steps=3, prompts_per_step=2, group_size=4, lr=1e-3, warmup_steps=2, filter_groups=False,
                kl_beta=0.01, seed=3)
    base.update(kw)
    return RLConfig(**base)


# a low threshold on the random model gives TPF spread within groups: nonzero advantages, real updates
SCFG = SamplerConfig(threshold=0.1, temperature=1.0, max_new_tokens=16, eos_ids=tuple(sorted(TOK.eos_token_ids)))


def step(state, cfg):
    return train_step(state, TOK, TASK, TASK.train, cfg, SCFG)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def fresh_state_from(folder: Path, cfg: RLConfig):
    """What a new process does: model from the checkpoint folder, new optimizer, then load_checkpoint."""
    model, _ = load_model(folder)
    return make_state(model, cfg)


# ------------------------------------------------------------------------------------------------------------


def test_round_trip_restores_everything(tmp_path):
    cfg = rl_cfg()
    state = make_state(tiny_model(), cfg)
    step(state, cfg)
    random.seed(11)
    torch.manual_seed(11)
    folder = save_checkpoint(tmp_path, state, {"note": "x", "nan": float("nan")}, config=cfg, tokenizer=TOK,
                             metrics_len=7)
    expect_py, expect_torch = random.random(), torch.rand(3)
    assert folder == tmp_path.absolute() / "checkpoint-1"
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-1"
    # the folder is a complete SDAR model folder
    m2, _ = load_model(folder)
    assert_same(params(m2), params(state.model))
    assert load_tokenizer(folder).encode("1+2?") == TOK.encode("1+2?")

    other = make_state(tiny_model(seed=5), cfg)
    random.seed(0)
    torch.manual_seed(0)
    got = load_checkpoint(tmp_path, other, config=cfg)
    assert got.step == 1 and got.metrics_len == 7 and got.extra["note"] == "x"
    assert other.step == state.step and other.cursor == state.cursor and other.nonfinite_in_row == 0
    assert_same(params(other.model), params(state.model))
    assert_same(params(other.ref_model), params(state.ref_model))
    assert other.scheduler.state_dict() == state.scheduler.state_dict()
    s1, s2 = state.optimizer.state_dict(), other.optimizer.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for name, v in s1["state"][k].items():
            assert torch.equal(v, s2["state"][k][name]), (k, name)
    assert random.random() == expect_py and torch.equal(torch.rand(3), expect_torch)


def test_resume_reproduces_uninterrupted_run_bit_for_bit(tmp_path):
    cfg = rl_cfg()
    # uninterrupted: 3 steps
    a = make_state(tiny_model(), cfg)
    for _ in range(2):
        step(a, cfg)
    after2 = params(a.model)
    m3 = step(a, cfg)
    assert any(not torch.equal(after2[n], p) for n, p in a.model.named_parameters()), "step 3 changed nothing"
    # interrupted: 2 steps, save, a fresh "process" loads and runs 1 step
    b = make_state(tiny_model(), cfg)
    for _ in range(2):
        step(b, cfg)
    save_checkpoint(tmp_path, b, config=cfg, tokenizer=TOK)
    del b
    random.seed(12345)
    torch.manual_seed(12345)
    c = fresh_state_from(tmp_path / "checkpoint-2", cfg)
    load_checkpoint(tmp_path, c, config=cfg)
    assert c.step == 2
    m3c = step(c, cfg)
    assert_same(params(c.model), params(a.model))
    assert c.cursor == a.cursor and c.step == a.step == 3
    for k in ("acc", "tpf", "loss", "kl", "grad_norm", "lr", "tokens"):
        assert m3c[k] == m3[k], k


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # the test's spy
def test_logged_lr_is_the_rate_the_update_used():
    """metrics["lr"] is the learning rate the step's optimizer update ran with (warm-up: step k of W uses lr k / W),
    not the next step's."""
    cfg = rl_cfg(warmup_steps=4)
    state = make_state(tiny_model(), cfg)
    used = []
    real = state.optimizer.step

    def spy(*a, **k):
        used.append(state.optimizer.param_groups[0]["lr"])
        return real(*a, **k)

    state.optimizer.step = spy
    logged = [step(state, cfg).get("lr") for _ in range(3)]
    assert len(used) == 3 and logged == used  # every step updated (no group filter here)
    assert used == pytest.approx([cfg.lr * k / 4 for k in (1, 2, 3)])


def test_reference_is_the_initial_policy_after_resume(tmp_path):
    cfg = rl_cfg()
    state = make_state(tiny_model(), cfg)
    initial = params(state.model)
    step(state, cfg)
    step(state, cfg)
    save_checkpoint(tmp_path, state, config=cfg)
    assert (tmp_path / "reference" / "config.json").is_file()
    resumed = fresh_state_from(tmp_path / "checkpoint-2", cfg)  # make_state copies the RESUMED weights...
    load_checkpoint(tmp_path, resumed, config=cfg)
    assert_same(params(resumed.ref_model), initial)  # ...load_checkpoint puts the initial policy back
    assert not all(torch.equal(initial[n], p) for n, p in resumed.model.named_parameters())


def test_reference_dir_is_recorded_and_checked(tmp_path):
    init_dir = tmp_path / "init"
    model = tiny_model()
    save_model(model, model.config, init_dir, tokenizer=TOK)
    cfg = rl_cfg()
    state = make_state(load_model(init_dir)[0], cfg)
    step(state, cfg)
    out = tmp_path / "run"
    save_checkpoint(out, state, config=cfg, reference_dir=init_dir)
    assert not (out / "reference").exists()  # no copy of the --model folder
    ok = fresh_state_from(out / "checkpoint-1", cfg)
    assert load_checkpoint(out, ok).reference_dir == init_dir.absolute()
    # the initial-policy folder changes after the run started: refused
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_model(model, model.config, init_dir, tokenizer=TOK)
    with pytest.raises(CheckpointError, match="changed since the run started"):
        load_checkpoint(out, fresh_state_from(out / "checkpoint-1", cfg))
    # the fingerprint taken when the run loaded the folder catches a change made before the first save
    fp = ckpt.fingerprint(init_dir)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_model(model, model.config, init_dir, tokenizer=TOK)
    save_checkpoint(tmp_path / "run2", state, config=cfg, reference_dir=init_dir, reference_fingerprint=fp)
    with pytest.raises(CheckpointError, match="changed since the run started"):
        load_checkpoint(tmp_path / "run2", fresh_state_from(tmp_path / "run2" / "checkpoint-1", cfg))
    # kl_beta 0 checkpoints cannot feed a kl_beta > 0 run (the initial policy is unknown)
    cfg0 = rl_cfg(kl_beta=0.0)
    s0 = make_state(tiny_model(), cfg0)
    assert s0.ref_model is None
    save_checkpoint(tmp_path / "run0", s0, config=cfg0)
    with pytest.raises(CheckpointError, match="without a reference"):
        load_checkpoint(tmp_path / "run0", make_state(tiny_model(), cfg))


def test_nonfinite_model_is_never_saved(tmp_path):
    cfg = rl_cfg(kl_beta=0.0)
    state = make_state(tiny_model(), cfg)
    save_checkpoint(tmp_path, state, config=cfg)
    state.step = 1
    with torch.no_grad():
        state.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteModelError, match="up_proj"):
        save_checkpoint(tmp_path, state, config=cfg)
    assert not (tmp_path / "checkpoint-1").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert resolve_checkpoint(tmp_path).name == "checkpoint-0"


def test_keep_last_k(tmp_path):
    cfg = rl_cfg(kl_beta=0.0)
    state = make_state(tiny_model(), cfg)
    for s in range(1, 5):
        state.step = s
        save_checkpoint(tmp_path, state, config=cfg, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4", "latest"]
    # re-saving an existing step replaces it in place
    with torch.no_grad():
        state.model.lm_head.weight.zero_()
    save_checkpoint(tmp_path, state, config=cfg, keep=2)
    assert torch.count_nonzero(load_model(tmp_path / "checkpoint-4")[0].lm_head.weight) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4", "latest"]


@pytest.mark.parametrize("stage", ["model_written", "state_written", "renamed"])
def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch, stage):
    cfg = rl_cfg(kl_beta=0.0)
    state = make_state(tiny_model(), cfg)
    state.step = 1
    save_checkpoint(tmp_path, state, config=cfg)
    good = params(state.model)
    state.step = 2
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)

    def crash(s):
        if s == stage:
            raise KeyboardInterrupt(f"killed at {s}")

    monkeypatch.setattr(ckpt, "_crash_point", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, state, config=cfg)
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-1"
    fresh = make_state(tiny_model(seed=9), cfg)
    assert load_checkpoint(tmp_path, fresh).step == 1
    assert_same(params(fresh.model), good)
    hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert hidden == []  # an exception (unlike a kill) cleans its temporary folder
    if stage == "renamed":  # the new folder is complete, only `latest` was not moved yet
        assert load_checkpoint(tmp_path / "checkpoint-2", make_state(tiny_model(), cfg)).step == 2
    else:
        assert not (tmp_path / "checkpoint-2").exists()
    monkeypatch.setattr(ckpt, "_crash_point", lambda s: None)
    save_checkpoint(tmp_path, state, config=cfg)
    assert resolve_checkpoint(tmp_path).name == "checkpoint-2"


def test_killed_process_midway_leaves_previous_checkpoint(tmp_path):
    """A real process dies (os._exit) after the weights of checkpoint 2 are written, before its state file."""
    script = textwrap.dedent(f"""
        import os, torch
        torch.set_num_threads(1)
        from lightningrl_fast.model import SDARConfig, build_model
        from lightningrl_fast.rl import checkpointing as ckpt
        from lightningrl_fast.rl.trainer import RLConfig, make_state
        cfg = SDARConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=8,
                         mask_token_id=3, max_position_embeddings=64, torch_dtype="float32")
        state = make_state(build_model(cfg, seed=0), RLConfig(kl_beta=0.0))
        state.step = 1
        ckpt.save_checkpoint({str(tmp_path)!r}, state)
        state.step = 2
        with torch.no_grad():
            for p in state.model.parameters():
                p.add_(1.0)
        def crash(stage):
            if stage == "model_written":
                os._exit(17)
        ckpt._crash_point = crash
        ckpt.save_checkpoint({str(tmp_path)!r}, state)
        os._exit(0)
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(lightningrl_fast.__file__).parent.parent))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 17, r.stderr
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-2.tmp-")]
    assert leftovers, "expected the killed save's temporary folder"
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-1"
    assert not (tmp_path / "checkpoint-2").exists()
    cfg = RLConfig(kl_beta=0.0)
    state = make_state(tiny_model(seed=4), cfg)
    assert load_checkpoint(tmp_path, state).step == 1
    assert_same(params(state.model), params(build_model(state.model.config, seed=0)))  # what the child saved first
    # the next save (another process) removes the dead save's leftovers
    state.step = 2
    save_checkpoint(tmp_path, state)
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert resolve_checkpoint(tmp_path).name == "checkpoint-2"


def test_resolve_errors_and_fallbacks(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(ValueError, match="holds no checkpoint"):
        resolve_checkpoint(tmp_path)
    cfg = rl_cfg(kl_beta=0.0)
    state = make_state(tiny_model(), cfg)
    state.step = 4
    save_checkpoint(tmp_path, state)
    (tmp_path / "latest").unlink()  # killed before the first `latest`: the highest complete checkpoint
    assert resolve_checkpoint(tmp_path).name == "checkpoint-4"
    (tmp_path / "latest").write_text("checkpoint-9\n")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_checkpoint(tmp_path)


def test_load_into_a_different_model_is_refused(tmp_path):
    cfg = rl_cfg(kl_beta=0.0)
    save_checkpoint(tmp_path, make_state(tiny_model(), cfg))
    bigger = SDARConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=8,
                        mask_token_id=TOK.mask_token_id, torch_dtype="float32")
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(tmp_path, make_state(build_model(bigger), cfg))


def test_extra_must_be_json(tmp_path):
    state = make_state(tiny_model(), rl_cfg(kl_beta=0.0))
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(tmp_path, state, {"bad": object()})


def test_write_text_atomic_keeps_the_earlier_file_on_failure(tmp_path, monkeypatch):
    """The one whole-file writer (run summary, run config, metrics rewrite, `latest`, eval results): a write that
    fails before the rename leaves the earlier file untouched and no temporary beside it."""
    from lightningrl_fast import _jsonfile

    target = tmp_path / "summary.json"
    _jsonfile.write_text_atomic(target, "first\n")
    assert target.read_text() == "first\n"

    def broken_fsync(fd):
        raise KeyboardInterrupt  # an interrupt between writing and renaming

    monkeypatch.setattr(_jsonfile.os, "fsync", broken_fsync)
    with pytest.raises(KeyboardInterrupt):
        _jsonfile.write_text_atomic(target, "second, never whole\n")
    assert target.read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    monkeypatch.undo()
    _jsonfile.write_text_atomic(target, "ünïcode\n", sync_dir=True)
    assert target.read_text(encoding="utf-8") == "ünïcode\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_optimizer_offload_steps_and_resumes_like_the_resident_optimizer(tmp_path):
    """RL steps with the optimizer state offloaded (RLConfig.optimizer_offload) equal the resident optimizer's bit
    for bit (bf16 weights: fp32 master + moments either way), and an offloaded run's checkpoint resumes into a
    resident one exactly (the state dict is the same), and into an offloaded one that stays offloaded."""
    cfg, cfg_off = rl_cfg(), rl_cfg(optimizer_offload=True)
    a = make_state(tiny_model().to(torch.bfloat16), cfg)
    b = make_state(tiny_model().to(torch.bfloat16), cfg_off)
    assert b.optimizer.offload and not a.optimizer.offload
    for _ in range(2):
        step(a, cfg)
        step(b, cfg_off)
    assert_same(params(a.model), params(b.model))
    save_checkpoint(tmp_path, b, config=cfg_off, tokenizer=TOK)
    c = fresh_state_from(tmp_path / "checkpoint-2", cfg)  # resumed without the offload
    load_checkpoint(tmp_path, c, config=cfg)
    assert not c.optimizer.offload
    d = fresh_state_from(tmp_path / "checkpoint-2", cfg_off)  # and with it: still offloaded after the load
    load_checkpoint(tmp_path, d, config=cfg_off)
    assert d.optimizer.offload  # (the load used to switch it off: a resumed offloaded run went resident)
    m3, m3c, m3d = step(a, cfg), step(c, cfg), step(d, cfg_off)
    assert_same(params(c.model), params(a.model))
    assert_same(params(d.model), params(a.model))
    assert m3c["loss"] == m3["loss"] and m3c["grad_norm"] == m3["grad_norm"] == m3d["grad_norm"]


# ------------------------------------------------------------------------------------------------------------
# counters, RNG, rotation, set-aside, sharded state and changed optimizer settings (mutation audit)


def test_counters_and_every_rng_stream_are_restored(tmp_path):
    """step, cursor, the non-finite counter (nonzero: a run killed after two skipped updates must not get a fresh
    allowance) and the python, torch and numpy RNG streams all come back as saved."""
    np = pytest.importorskip("numpy")
    cfg = rl_cfg(kl_beta=0.0)
    state = make_state(tiny_model(), cfg)
    state.step, state.cursor, state.nonfinite_in_row = 5, 13, 2
    random.seed(21)
    torch.manual_seed(21)
    np.random.seed(21)
    save_checkpoint(tmp_path, state, config=cfg)
    expect = (random.random(), torch.rand(3), np.random.rand(3))
    random.seed(0)
    torch.manual_seed(0)
    np.random.seed(0)
    fresh = make_state(tiny_model(seed=5), cfg)
    got = load_checkpoint(tmp_path, fresh, config=cfg)
    assert (got.step, fresh.step, fresh.cursor, fresh.nonfinite_in_row) == (5, 5, 13, 2)
    assert random.random() == expect[0]
    assert torch.equal(torch.rand(3), expect[1])
    assert (np.random.rand(3) == expect[2]).all()


def test_rotation_orders_by_step_and_never_deletes_the_checkpoint_just_saved(tmp_path):
    """keep=2 over steps 8..11 keeps checkpoint-10 and -11 (by step: 'checkpoint-10' < 'checkpoint-9' as names);
    without `latest` the highest step is resumed; re-saving an older step keeps that folder (the one `latest`
    now names) and deletes nothing newer."""
    cfg = rl_cfg(kl_beta=0.0)
    state = make_state(tiny_model(), cfg)
    for s in (8, 9, 10, 11):
        state.step = s
        save_checkpoint(tmp_path, state, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-11", "latest"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-11"]
    (tmp_path / "latest").unlink()
    assert resolve_checkpoint(tmp_path).name == "checkpoint-11"
    state.step = 9
    save_checkpoint(tmp_path, state, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-11", "checkpoint-9", "latest"]
    assert (tmp_path / "latest").read_text() == "checkpoint-9\n"
    state.step = 12
    save_checkpoint(tmp_path, state, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-11", "checkpoint-12", "latest"]


def test_set_aside_later_moves_the_later_checkpoints_and_records(tmp_path):
    """Resuming checkpoint-1 (saved when metrics.jsonl had 2 records) of a run at step 3: checkpoint-2 and -3 and
    records 3..5 go to discarded-1/, `latest` names checkpoint-1; nothing later: nothing moves."""
    import json

    for s in (1, 2, 3):
        (tmp_path / f"checkpoint-{s}").mkdir()
        (tmp_path / f"checkpoint-{s}" / "trainer_state.pt").write_bytes(b"x")
    records = [{"step": s, "loss": s / 10} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "latest").write_text("checkpoint-3\n")
    assert ckpt.set_aside_later(tmp_path, tmp_path / "checkpoint-3", 5) == (None, [], 0)
    dest, moved, n = ckpt.set_aside_later(tmp_path, tmp_path / "checkpoint-1", 2)
    assert (dest, moved, n) == (tmp_path / "discarded-1", ["checkpoint-2", "checkpoint-3"], 3)
    assert [json.loads(x) for x in (dest / "metrics.jsonl").read_text().splitlines()] == records[2:]
    assert sorted(p.name for p in dest.iterdir()) == ["checkpoint-2", "checkpoint-3", "metrics.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "discarded-1", "latest", "metrics.jsonl"]
    assert (tmp_path / "latest").read_text() == "checkpoint-1\n"


def test_sharded_checkpoint_loads_per_rank_and_reshards_in_one_process(tmp_path):
    """A 2-rank checkpoint made in one process (no process group: the two ranks' optimizers over one model, the
    rank-1 shard staged as save_checkpoint_ranks stages it): each rank gets its own optimizer shard and its own RNG
    streams back; 1 or 3 ranks get every parameter's state exactly once, from whichever shard held it, rank 1 its
    saved RNG, the others rank 0's; a shard of another step or rank is refused."""
    from lightningrl_fast.rl.distributed import DistEnv

    cfg = rl_cfg(kl_beta=0.0)
    model = tiny_model()
    envs = [DistEnv(r, 2, r) for r in range(2)]
    states = [make_state(model, cfg, env) for env in envs]
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        for s in states:
            s.optimizer.step()
            s.scheduler.step()
    for s in states:
        s.step, s.cursor = 2, 6
    mine = [opt_by_index(s) for s in states]
    assert mine[0] and mine[1] and not set(mine[0]) & set(mine[1])
    every = {**mine[0], **mine[1]}
    assert sorted(every) == list(range(len(list(model.parameters()))))
    random.seed(101)
    torch.manual_seed(101)
    staged = tmp_path / "staged-rank1.pt"
    torch.save({"rank": 1, "world_size": 2, "step": 2, "optimizer": states[1].optimizer.state_dict(),
                "rng": ckpt.rng_state()}, staged)
    draws = {1: (random.random(), torch.rand(2))}
    random.seed(100)
    torch.manual_seed(100)
    folder = save_checkpoint(tmp_path / "run", states[0], config=cfg, rank_files={ckpt.shard_file(1): staged},
                             world_size=2)
    draws[0] = (random.random(), torch.rand(2))
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".pt") == ["optimizer-rank1.pt", "trainer_state.pt"]

    def load(env, warns):
        fresh = make_state(tiny_model(seed=9), cfg, env)
        random.seed(0)
        torch.manual_seed(0)
        if warns:
            with pytest.warns(UserWarning, match="redistributed"):
                load_checkpoint(folder, fresh, config=cfg, env=env)
        else:
            load_checkpoint(folder, fresh, config=cfg, env=env)
        assert (fresh.step, fresh.cursor) == (2, 6)
        assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.lr)  # warm-up done: step 2 of 2
        rng = (random.random(), torch.rand(2))
        return opt_by_index(fresh), rng

    for r, env in enumerate(envs):
        got, rng = load(env, warns=False)
        assert_same_opt(got, mine[r])
        assert rng[0] == draws[r][0] and torch.equal(rng[1], draws[r][1]), r
    got, rng = load(DistEnv(), warns=True)
    assert_same_opt(got, every)
    assert rng[0] == draws[0][0] and torch.equal(rng[1], draws[0][1])
    three = [load(DistEnv(r, 3, r), warns=True) for r in range(3)]
    assert sum(len(x[0]) for x in three) == len(every)
    assert_same_opt({i: st for x in three for i, st in x[0].items()}, every)
    for r, (_, rng) in enumerate(three):
        want = draws[1] if r == 1 else draws[0]
        assert rng[0] == want[0] and torch.equal(rng[1], want[1]), r
    shard = torch.load(folder / ckpt.shard_file(1), weights_only=True)
    torch.save(dict(shard, step=1), folder / ckpt.shard_file(1))  # a stale shard of another save
    with pytest.raises(CheckpointError, match="holds rank 1 step 1, expected rank 1 step 2"):
        load(envs[1], warns=False)
    torch.save(dict(shard, rank=0), folder / ckpt.shard_file(1))  # another rank's shard under this name
    with pytest.raises(CheckpointError, match="holds rank 0 step 2, expected rank 1 step 2"):
        load(envs[1], warns=False)



def test_leftovers_of_dead_saves_are_removed_and_an_orphaned_backup_is_put_back(tmp_path):
    """The next save cleans what dead saves (a pid that is not alive) left: temporary and deleting folders go, a
    `.checkpoint-<s>.old-*` backup whose checkpoint-<s> is missing (killed between the two fallback renames) is
    renamed back; a live process's temporary folder is left alone."""
    import shutil

    cfg = rl_cfg(kl_beta=0.0)
    state = make_state(tiny_model(), cfg)
    state.step = 3
    save_checkpoint(tmp_path, state)
    dead = 999999999
    shutil.copytree(tmp_path / "checkpoint-3", tmp_path / f".checkpoint-2.old-{dead}-deadbeef")
    (tmp_path / f".checkpoint-4.tmp-{dead}-cafe0000").mkdir()
    (tmp_path / f".checkpoint-1.del-{dead}-0000beef").mkdir()
    alive = tmp_path / f".checkpoint-5.tmp-{os.getpid()}-11110000"
    alive.mkdir()
    state.step = 6
    save_checkpoint(tmp_path, state, keep=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [alive.name, "checkpoint-2", "checkpoint-3", "checkpoint-6", "latest"])
    assert (tmp_path / "checkpoint-2" / "trainer_state.pt").is_file()
