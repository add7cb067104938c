"""rl/selection.py and the validation split: the split helpers, the selection rule against a brute-force ranking,
the best-model folder and its record across resumes, and `--select-best` / `--val-fraction` / `--val-data` through
the train CLI (smoke preset on CPU; the validation numbers scripted where the test needs a given choice)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from lightningrl_fast import config as C
from lightningrl_fast import run_setup as S
from lightningrl_fast import train as T
from lightningrl_fast.checkpoint import load_model
from lightningrl_fast.rl import logging as L
from lightningrl_fast.rl.checkpointing import read_trainer_state
from lightningrl_fast.rl.selection import (BEST_DIR, BEST_META, Candidate, Selection, reconcile, save_best,
                                           saved_step, split_by_hash)
from lightningrl_fast.tasks.synthetic import SyntheticArithmetic

torch.set_num_threads(1)

SMOKE = ["--preset", "smoke", "--threads", "1", "--eval-limit", "4", "--eval-thresholds", "0.9", "--no-plots",
         "--progress", "plain"]


@pytest.fixture
def cache_env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LRF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "sel-sft-cache"))


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in load_model(folder)[0].named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------------------
# splits
# ------------------------------------------------------------------------------------------------------------

class Row:
    def __init__(self, id):
        self.id = id


def test_split_by_hash_is_a_partition_independent_of_order():
    rows = [Row(f"gsm8k-{i}") for i in range(997)]
    kept, carved = split_by_hash(rows, 0.2)
    assert sorted(map(id, kept + carved)) == sorted(map(id, rows)) and not set(map(id, kept)) & set(map(id, carved))
    assert 0.15 < len(carved) / len(rows) < 0.25
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    assert {r.id for r in split_by_hash(shuffled, 0.2)[1]} == {r.id for r in carved}  # the same prompts
    assert {r.id for r in split_by_hash(rows[:500], 0.2)[1]} == {r.id for r in carved if int(r.id[6:]) < 500}
    assert {r.id for r in split_by_hash(rows, 0.3)[1]} > {r.id for r in carved}  # a larger fraction adds prompts
    assert split_by_hash(rows, 0.0) == (rows, [])
    anon = [object() for _ in range(50)]  # no id: the position decides
    assert len(split_by_hash(anon, 0.5)[1]) == len(split_by_hash(list(range(50)), 0.5)[1])


def test_synthetic_validation_split_leaves_the_test_split_unchanged():
    base, task = SyntheticArithmetic(), SyntheticArithmetic(val_fraction=0.1)
    assert base.val == [] and [e.id for e in task.test] == [e.id for e in base.test]
    assert sorted(e.id for e in task.train + task.val) == sorted(e.id for e in base.train)
    assert not {e.id for e in task.train} & {e.id for e in task.val} and 50 < len(task.val) < 95
    assert [e.id for e in task.train] == [e.id for e in base.train if e.id not in {v.id for v in task.val}]
    for bad in (-0.1, 0.8, 0.9):
        with pytest.raises(ValueError, match="val_fraction"):
            SyntheticArithmetic(val_fraction=bad)


def test_sft_cache_key_changes_with_the_validation_carve_only():
    def key(*argv):
        c = C.parse_config(["--preset", "smoke", *argv], check_paths=False)
        return S.sft_cache_key(c, S.embedded_model_config(c, S.make_synthetic_task(c).tokenizer))

    assert key("--val-fraction", "0") == key()  # runs without a validation split keep their cached warm-ups
    assert key("--val-fraction", "0.1") != key() and key("--val-fraction", "0.1") != key("--val-fraction", "0.2")
    assert key("--val-fraction", "0.1", "--select-best", "--eval-every", "3") == key("--val-fraction", "0.1")


# ------------------------------------------------------------------------------------------------------------
# the rule
# ------------------------------------------------------------------------------------------------------------

def brute_force(evals: list[Candidate], margin: float) -> Candidate:
    """REFERENCE §7's bar over all evaluations at once: within `margin` of the first one's accuracy, the highest
    TPF, then the higher accuracy, then the earlier step."""
    ok = [c for c in evals if c.acc >= evals[0].acc - margin - 1e-9]
    return sorted(ok, key=lambda c: (-c.tpf, -c.acc, c.step))[0]


def test_the_online_rule_equals_ranking_every_evaluation_at_the_end():
    rng = random.Random(0)
    for case in range(2000):
        n, margin = rng.randint(1, 12), rng.choice([0.0, 0.01, 0.05, 0.2])
        grid = rng.choice([True, False])  # accuracies on a grid of 1/69 (ties and exact margins happen)
        evals = [Candidate(10 * i, round(rng.randint(50, 69) / 69, 12) if grid else rng.random(),
                           rng.choice([2.0, 3.5, 4.0, 5.25]) if grid else rng.uniform(1, 8)) for i in range(n)]
        sel, saves = Selection(margin), []
        for c in evals:
            if sel.offer(c):
                saves.append(c.step)
        assert sel.start == evals[0] and sel.best == brute_force(evals, margin), (case, evals)
        assert saves[0] == 0 and saves[-1] == sel.best.step and saves == sorted(saves)


def test_hand_cases_of_the_rule():
    sel = Selection(0.01)
    assert sel.offer(Candidate(0, 0.90, 2.8))  # the start is always kept first
    assert not sel.offer(Candidate(10, 0.88, 6.0))  # two points down: never kept, however fast
    assert sel.offer(Candidate(20, 0.891, 4.0))  # within the point: faster wins
    assert sel.offer(Candidate(30, 0.95, 4.0))  # the same TPF, more accurate
    assert not sel.offer(Candidate(40, 0.95, 4.0))  # the same numbers later: the earlier step stays
    assert not sel.offer(Candidate(50, 0.99, 3.9))  # more accurate but slower
    assert sel.best == Candidate(30, 0.95, 4.0) and sel.start == Candidate(0, 0.90, 2.8)


def test_ties_go_to_accuracy_then_the_earlier_step():
    sel = Selection(0.0)
    for c in (Candidate(0, 0.5, 2.0), Candidate(10, 0.6, 3.0), Candidate(20, 0.7, 3.0), Candidate(30, 0.7, 3.0)):
        sel.offer(c)
    assert sel.best == Candidate(20, 0.7, 3.0)
    rec = Selection.from_dict(json.loads(json.dumps(sel.to_dict())), margin=0.05)
    assert (rec.start, rec.best, rec.margin) == (sel.start, sel.best, 0.05)
    assert Selection.from_dict({"start": None, "best": None}, 0.01) == Selection(0.01)


# ------------------------------------------------------------------------------------------------------------
# best-model on disk
# ------------------------------------------------------------------------------------------------------------

def tiny_model(seed: int = 0):
    from lightningrl_fast.model import SDARConfig, build_model

    tok = SyntheticArithmetic().tokenizer
    cfg = SDARConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=4,
                     mask_token_id=tok.mask_token_id, torch_dtype="float32", max_position_embeddings=64)
    return build_model(cfg, dtype=torch.float32, seed=seed), tok


def test_save_best_and_reconcile_on_resume(tmp_path, monkeypatch):
    model, tok = tiny_model()
    sel = Selection(0.01)
    sel.offer(Candidate(0, 0.5, 2.0))
    sel.offer(Candidate(4, 0.5, 3.0))
    save_best(tmp_path, model, tok, sel)
    assert saved_step(tmp_path) == 4 and same(weights(tmp_path / BEST_DIR), dict(model.named_parameters()))
    said = []
    assert reconcile(tmp_path, sel, said.append) == sel and not said  # the folder holds the recorded step
    older = Selection.from_dict({"start": {"step": 0, "acc": 0.5, "tpf": 2.0},
                                 "best": {"step": 2, "acc": 0.5, "tpf": 2.5}}, 0.01)
    got = reconcile(tmp_path, older, said.append)  # a checkpoint of step 2 whose kept step was overwritten
    assert got.best is None and got.start == older.start
    assert not (tmp_path / BEST_DIR).exists() and not (tmp_path / BEST_META).exists()
    moved = tmp_path / f"{BEST_DIR}-discarded"
    assert json.loads((moved / BEST_META).read_text())["step"] == 4 and (moved / "config.json").is_file()
    assert "holds step 4, not the kept step 2" in said[0]
    save_best(tmp_path, model, tok, sel)
    (tmp_path / BEST_META).unlink()  # a crash between the folder and its record
    assert saved_step(tmp_path) is None and reconcile(tmp_path, sel, said.append).best is None
    assert (tmp_path / f"{BEST_DIR}-discarded-1").is_dir() and "has no readable record" in said[-1]
    assert reconcile(tmp_path, sel, said.append).best is None and "are not in" in said[-1]  # nothing left
    # a crash after the new weights but before their record: no record names the folder's old step any more
    save_best(tmp_path, model, tok, sel)
    later = Selection(0.01, start=sel.start, best=Candidate(8, 0.5, 4.0))
    other, _ = tiny_model(seed=1)

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("lightningrl_fast.rl.selection.write_text_atomic", crash)
    with pytest.raises(OSError, match="disk full"):
        save_best(tmp_path, other, tok, later)
    assert saved_step(tmp_path) is None and reconcile(tmp_path, sel, said.append).best is None
    (tmp_path / BEST_META).write_text("{not json")
    assert saved_step(tmp_path) is None


# ------------------------------------------------------------------------------------------------------------
# the CLI
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,match", [
    (["--preset", "none", "--select-best", "--eval-every", "5"], "--select-best selects on a validation split"),
    (["--preset", "none", "--select-best", "--val-fraction", "0.1"], "give --eval-every N"),
    (["--val-fraction", "0"], r"validation split: .* or --no-select-best"),  # the default preset selects
    (["--eval-every", "0"], r"give --eval-every N \(or --no-select-best\)"),
    (["--val-fraction", "1"], r"--val-fraction must be in \[0, 1\)"),
    (["--val-fraction", "-0.1"], r"--val-fraction must be in \[0, 1\)"),
    (["--val-fraction", "0.85"], "leave no training prompts"),
    (["--select-margin", "1.5"], r"--select-margin must be in \[0, 1\]"),
    (["--val-fraction", "0", "--no-select-best", "--val-data", "x.jsonl"], "carves its own validation split"),
])
def test_bad_selection_settings_are_config_errors(argv, match):
    with pytest.raises(C.ConfigError, match=match):
        C.parse_config(argv, check_paths=False)
    C.parse_config(["--val-fraction", "0", "--no-select-best"], check_paths=False)  # no validation at all


def test_bad_validation_files_are_config_errors(tmp_path):
    data, model = tmp_path / "train.jsonl", tmp_path / "model"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = ["--model", str(model), "--task", "math", "--train-data", str(data)]
    with pytest.raises(C.ConfigError, match="--val-data .*missing.jsonl: no such file"):
        C.parse_config(base + ["--val-data", str(tmp_path / "missing.jsonl")])
    with pytest.raises(C.ConfigError, match="not both"):
        C.parse_config(base + ["--val-data", str(data), "--val-fraction", "0.2"])
    # the RFT baseline has no steps to choose among: --select-best is ignored there, not an error
    C.parse_config(["--baseline", "rft", "--select-best"], check_paths=False)


def test_cli_a_fraction_that_carves_nothing_is_a_config_error(tmp_path, cache_env, capsys):
    assert T.main(SMOKE + ["--out", str(tmp_path / "r"), "--val-fraction", "0.0001"]) == T.EXIT_CONFIG
    assert "carves no validation prompt" in capsys.readouterr().err


def scripted(monkeypatch, numbers: list[tuple[float, float]], sizes: list[int]):
    """Replace the validation evaluation by `numbers` (acc, tpf), one per call, in order; record the split sizes."""
    it = iter(numbers)

    def fake(ctx):
        sizes.append(len(ctx.val_examples))
        acc, tpf = next(it)
        return "val", {"acc": acc, "tpf": tpf}

    monkeypatch.setattr(T, "_step_eval", fake)


def test_cli_select_best_keeps_and_evaluates_the_chosen_steps_weights(tmp_path, cache_env, capsys, monkeypatch):
    """Validation numbers scripted so that step 2 is the one to keep (step 4 is faster but two points less
    accurate than before RL): best-model holds checkpoint-2's weights, not the last step's, and the summary's
    held-out sweep of the kept step is that of checkpoint-2's weights."""
    out, sizes, plotted = tmp_path / "run", [], {}
    scripted(monkeypatch, [(0.5, 2.0), (0.5, 3.0), (0.48, 9.0)], sizes)
    monkeypatch.setattr(L, "plot_training", lambda history, path, **kw: plotted.update(kw))
    argv = SMOKE + ["--out", str(out), "--steps", "4", "--eval-every", "2", "--save-every", "1",
                    "--keep-checkpoints", "10", "--val-fraction", "0.1", "--select-best", "--plots"]
    assert T.main(argv) == 0
    # the training plot gets every validation evaluation (the one before RL too) and the kept one
    assert plotted["evals"] == [{"step": 0, "acc": 0.5, "tpf": 2.0}, {"step": 2, "acc": 0.5, "tpf": 3.0},
                                {"step": 4, "acc": 0.48, "tpf": 9.0}]
    assert plotted["kept"] == {"step": 2, "acc": 0.5, "tpf": 3.0} and plotted["eval_label"] == "validation (greedy)"
    printed = capsys.readouterr().out
    n_val = len(SyntheticArithmetic(val_fraction=0.1).val)
    assert sizes == [n_val] * 3 and f"/ {n_val} validation examples" in printed
    assert "validation (greedy, tau 0.1) at step 0: acc 0.500 TPF 2.00  [kept: best-model]" in printed
    assert "select: kept step 2 (validation acc 0.500 TPF 3.00; before RL 0.500, margin 0.01)" in printed
    recs = L.read_metrics(out)
    assert [(m["step"], m.get("val_acc"), m.get("val_tpf")) for m in recs] == [
        (1, None, None), (2, 0.5, 3.0), (3, None, None), (4, 0.48, 9.0)]
    assert json.loads((out / BEST_META).read_text())["step"] == 2
    kept = weights(out / BEST_DIR)
    assert same(kept, weights(out / "checkpoint-2")) and not same(kept, weights(out / "checkpoint-4"))
    summary = json.loads((out / "summary.json").read_text())
    sel = summary["selection"]
    assert (sel["step"], sel["val_acc"], sel["val_tpf"], sel["val_acc_before"]) == (2, 0.5, 3.0, 0.5)
    assert "kept step 2 acc" in printed  # its column in the sweep table
    # the kept step's held-out sweep is the evaluation of checkpoint-2's weights
    cfg = C.parse_config(SMOKE + ["--out", str(tmp_path / "check"), "--val-fraction", "0.1"])
    ctx = S.build_context(cfg, say=lambda _m: None)
    ctx.model = load_model(out / "checkpoint-2")[0]
    ref = T._eval_sweep(ctx, "check", lambda _m: None)
    keys = ("acc", "tpf", "fwd_per_answer", "finished", "n", "well_formed")
    assert {t: {k: r[k] for k in keys} for t, r in ref.items()} == \
        {t: {k: r[k] for k in keys} for t, r in sel["eval"].items()}
    # the checkpoints carry the selection: the last one names step 2
    assert read_trainer_state(out / "checkpoint-4")["extra"]["selection"]["best"]["step"] == 2


def test_cli_resume_keeps_or_discards_the_kept_step(tmp_path, cache_env, capsys, monkeypatch):
    """Resumed from the latest checkpoint, the run keeps best-model (it holds the recorded step) and evaluates
    nothing extra; resumed from an older checkpoint whose record names a step the folder no longer holds, the
    folder goes aside and the selection restarts with the resumed weights."""
    out, sizes = tmp_path / "run", []
    scripted(monkeypatch, [(0.5, 2.0), (0.5, 3.0), (0.6, 4.0)], sizes)
    argv = SMOKE + ["--out", str(out), "--steps", "4", "--eval-every", "2", "--save-every", "1",
                    "--keep-checkpoints", "10", "--val-fraction", "0.1", "--select-best"]
    assert T.main(argv) == 0
    assert json.loads((out / BEST_META).read_text())["step"] == 4
    capsys.readouterr()
    sizes.clear()
    scripted(monkeypatch, [(0.6, 5.0)], sizes)  # one evaluation: step 6 (the last)
    assert T.main(["--resume", str(out), "--steps", "6"]) == 0
    assert len(sizes) == 1 and json.loads((out / BEST_META).read_text())["step"] == 6
    assert not (out / f"{BEST_DIR}-discarded").exists()
    capsys.readouterr()
    sizes.clear()
    # from checkpoint-2 (its record: step 2 kept) while best-model holds step 6
    scripted(monkeypatch, [(0.5, 3.0), (0.3, 8.0)], sizes)  # the resumed step 2, then step 4 (too inaccurate)
    assert T.main(["--resume", str(out / "checkpoint-2"), "--steps", "4"]) == 0
    printed = capsys.readouterr().out
    assert f"holds step 6, not the kept step 2: moved to {out / (BEST_DIR + '-discarded')}" in printed
    assert json.loads((out / f"{BEST_DIR}-discarded" / BEST_META).read_text())["step"] == 6
    assert len(sizes) == 2 and json.loads((out / BEST_META).read_text())["step"] == 2
    assert same(weights(out / BEST_DIR), weights(out / "checkpoint-2"))
    assert json.loads((out / "summary.json").read_text())["selection"]["step"] == 2


def test_cli_eval_every_without_validation_evaluates_the_held_out_set(tmp_path, cache_env):
    out = tmp_path / "run"
    assert T.main(SMOKE + ["--out", str(out), "--steps", "2", "--eval-every", "2", "--no-save-final"]) == 0
    recs = L.read_metrics(out)
    assert "eval_acc" in recs[1] and "val_acc" not in recs[1] and not (out / BEST_DIR).exists()
    assert "selection" not in json.loads((out / "summary.json").read_text())


def _gsm8k(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"question": f"What is {i}+1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(n)))
    return path


def test_cli_math_file_with_a_validation_carve_and_file(tmp_path, capsys, ascii_checkpoint):
    """--val-fraction carves the training file by the examples' ids (the same rows as split_by_hash says),
    --max-train-examples counts what is left; --val-data takes a file; --select-best runs on either."""
    from lightningrl_fast.tasks import load_examples

    model = ascii_checkpoint(tmp_path / "model")
    train = _gsm8k(tmp_path / "train.jsonl", 12)
    rows = list(load_examples(str(train)).examples)
    kept, carved = split_by_hash(rows, 0.3)
    assert 0 < len(carved) < 12
    base = ["--model", str(model), "--task", "math", "--train-data", str(train), "--steps", "1",
            "--prompts-per-step", "1", "--group-size", "2", "--max-new-tokens", "8", "--eval-thresholds", "0.9",
            "--kl-beta", "0", "--no-save-final", "--threads", "1", "--no-plots", "--progress", "off"]
    assert T.main(base + ["--out", str(tmp_path / "a"), "--val-fraction", "0.3", "--eval-every", "1",
                          "--select-best", "--max-train-examples", "3"]) == 0
    printed = capsys.readouterr().out
    assert f"{len(carved)} of the training examples held out for validation, {len(kept)} left" in printed
    assert f"3 train / 0 eval / {len(carved)} validation examples" in printed
    assert json.loads((tmp_path / "a" / BEST_META).read_text())["step"] in (0, 1)
    val = _gsm8k(tmp_path / "val.jsonl", 5)
    assert T.main(base + ["--out", str(tmp_path / "b"), "--val-data", str(val), "--eval-every", "1",
                          "--select-best"]) == 0
    assert "12 train / 0 eval / 5 validation examples" in capsys.readouterr().out
    assert not split_by_hash(rows, 1e-6)[1]
    assert T.main(base + ["--out", str(tmp_path / "c"), "--val-fraction", "1e-6"]) == T.EXIT_ERROR
    assert "leaves 12 to train on and 0 to validate on" in capsys.readouterr().err
