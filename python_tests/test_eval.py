"""eval: the AUP metric against hand-computed values, `evaluate` on the synthetic task, the CLI (JSON, PNG, overlays)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightningrl_fast import eval as ev
from lightningrl_fast import eval_results as evr
from lightningrl_fast.checkpoint import load_model, save_model
from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.sampler import SamplerConfig
from lightningrl_fast.tasks.synthetic import ArithExample, SyntheticArithmetic

BLOCK = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread, restored after


# ------------------------------------------------------------------------------------------------------------
# AUP (d3LLM): rho_1 y_1 + sum of trapezoids of y W(y), W(y) = min(exp(-3 (1 - y / y_max)), 1), y in percent
# ------------------------------------------------------------------------------------------------------------

def test_aup_single_point_is_the_rectangle():
    assert ev.aup([(2.0, 80.0)]) == pytest.approx(160.0)
    assert ev.aup([(2.0, 80.0)], y_max=100.0) == pytest.approx(160.0)  # the first term is not weighted


def test_aup_flat_curve():
    # 80*1 + (2-1)*(80+80)/2 + (4-2)*(80+80)/2 = 80 + 80 + 160
    assert ev.aup([(1, 80), (2, 80), (4, 80)]) == pytest.approx(320.0)
    # the same flat curve judged against a better run (y_max 100): W(80) = exp(-0.6)
    w = math.exp(-0.6)
    assert ev.aup([(2, 80), (4, 80)], y_max=100) == pytest.approx(160 + 2 * 80 * w)
    assert ev.aup([(2, 80), (4, 80)], y_max=100) == pytest.approx(247.80986177504423)


def test_aup_monotone_decreasing_curve():
    # y_max 90: W(87) = exp(-3 * 3/90) = exp(-0.1), W(85) = exp(-3 * 5/90) = exp(-1/6)
    want = 90 * 1 + (3 - 1) * (87 * math.exp(-0.1) + 90) / 2 + (5 - 3) * (85 * math.exp(-1 / 6) + 87 * math.exp(-0.1)) / 2
    assert want == pytest.approx(409.3926573539591)
    assert ev.aup([(1, 90), (3, 87), (5, 85)]) == pytest.approx(want)
    assert ev.aup([(5, 85), (1, 90), (3, 87)]) == pytest.approx(want)  # input order does not matter


def test_aup_monotone_increasing_curve():
    # 80*1 + (2-1) * (90*W(90) + 80*W(80)) / 2, W(90) = 1, W(80) = exp(-1/3)
    assert ev.aup([(1, 80), (2, 90)]) == pytest.approx(80 + (90 + 80 * math.exp(-1 / 3)) / 2)
    assert ev.aup([(1, 80), (2, 90)]) == pytest.approx(153.66125242295158)


def test_aup_drops_points_more_than_five_below_the_first():
    # y_1 = 90 -> floor 85: (2, 84) is dropped, (3, 86) kept
    assert ev.aup([(1, 90), (2, 84), (3, 86)]) == pytest.approx(90 + 2 * (86 * math.exp(-3 * 4 / 90) + 90) / 2)
    assert ev.aup([(1, 90), (2, 85)]) == pytest.approx(90 + (85 * math.exp(-3 * 5 / 90) + 90) / 2)  # exactly 5: kept


def test_aup_edge_cases_and_errors():
    assert ev.aup([(1, 0), (3, 0)]) == 0.0
    assert ev.aup([(1.0, 100), (2.0, 100)]) == pytest.approx(200.0)
    assert evr.aup_weight(50, 0) == 1.0
    for bad in ([], [(0, 50)], [(-1, 50)], [(1, 101)], [(1, -1)], [(float("nan"), 50)]):
        with pytest.raises(ValueError):
            ev.aup(bad)


# ------------------------------------------------------------------------------------------------------------
# evaluate
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def synth_ckpt(tmp_path_factory) -> Path:
    tok = SyntheticArithmetic().tokenizer
    cfg = SDARConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=BLOCK,
                     mask_token_id=tok.mask_token_id, torch_dtype="float32", max_position_embeddings=128)
    folder = tmp_path_factory.mktemp("synth") / "base"
    save_model(build_model(cfg, dtype=torch.float32, seed=0), cfg, folder, tokenizer=tok)
    return folder


class ParityTask:
    """Correct iff the true answer is even: accuracy is known whatever the random model writes."""

    name = "parity"

    def build_prompt(self, ex):
        return ex.prompt

    def score(self, response, ex):
        return float(self.is_correct(response, ex))

    def is_correct(self, response, ex):
        return ex.answer % 2 == 0


def _cfg(tok, **kw):
    return SamplerConfig(temperature=0, max_new_tokens=12, eos_ids=tuple(sorted(tok.eos_token_ids)), **kw)


def test_evaluate_synthetic_numbers_in_range(synth_ckpt):
    task = SyntheticArithmetic()
    model, _ = load_model(synth_ckpt)
    exs = task.test[:6]
    res = ev.evaluate(model, task.tokenizer, task, exs, [0.5, 0.9], _cfg(task.tokenizer), batch_size=4)
    assert [p["threshold"] for p in res["points"]] == [0.5, 0.9]
    for p in res["points"]:
        assert p["n"] == 6 and 0 <= p["correct"] <= 6 and p["accuracy"] == p["correct"] / 6
        assert 1.0 <= p["mean_tpf"] <= BLOCK
        assert p["tokens"] <= 6 * 12 and p["tokens_per_s"] > 0 and p["forwards_per_s"] > 0
        assert p["forwards"] >= math.ceil(12 / BLOCK) and 0 <= p["truncated"] <= 6
        # every answer takes at least one forward per response token / TPF, and the batch's engine forwards
        # serve all its rows at once
        assert p["tokens"] / 6 / p["mean_tpf"] <= p["forwards_per_answer"] + 1e-9
        assert p["forwards_per_answer"] <= p["forwards"]
    # the bookkeeping, value by value, against the sampler and the verifier called here on the same batches of 4
    # (greedy: the batches' seeds do not matter)
    from lightningrl_fast.sampler import generate

    tok = task.tokenizer
    for p in res["points"]:
        tpf, row_fwd, tokens, fwd, trunc, correct = [], [], 0, 0, 0, 0
        for b0 in (0, 4):
            batch = exs[b0:b0 + 4]
            ro = generate(model, [tok.encode(task.build_prompt(e)) for e in batch],
                          _cfg(tok, threshold=p["threshold"]))
            tpf += ro.tpf.tolist()
            row_fwd += ro.forwards.tolist()
            tokens, fwd = tokens + int(ro.lengths.sum()), fwd + ro.total_forwards
            trunc += sum(r == "length" for r in ro.finish_reason)
            for j, e in enumerate(batch):
                ids = ro.response_ids(j)
                ids = ids[:-1] if bool(ro.eos_found[j]) else ids
                correct += bool(ro.eos_found[j]) and task.is_correct(tok.decode(ids), e)
        assert (p["tokens"], p["forwards"], p["truncated"], p["correct"]) == (tokens, fwd, trunc, correct)
        assert p["mean_tpf"] == pytest.approx(sum(tpf) / 6, rel=1e-12)
        assert p["forwards_per_answer"] == pytest.approx(sum(row_fwd) / 6, rel=1e-12)
        assert p["finished"] == pytest.approx(1 - trunc / 6, rel=1e-12)
    assert res["aup"] == pytest.approx(ev.aup([(p["mean_tpf"], 100 * p["accuracy"]) for p in res["points"]]))
    assert res["aup"] >= 0 and math.isfinite(res["aup"])
    assert res["n_examples"] == 6 and res["sampler"]["block_size"] == BLOCK and "threshold" not in res["sampler"]
    assert all(0 <= p["well_formed"] <= p["finished"] <= 1 and p["accuracy"] <= p["verifier_accuracy"]
               for p in res["points"])


def test_evaluate_accuracy_and_aup_bookkeeping(synth_ckpt):
    task = SyntheticArithmetic()
    model, _ = load_model(synth_ckpt)
    exs = task.test[:8]
    want = sum(e.answer % 2 == 0 for e in exs) / len(exs)
    cfg = _cfg(task.tokenizer)
    res = ev.evaluate(model, task.tokenizer, ParityTask(), exs, [0.2, 0.95], cfg, batch_size=3,
                      keep_responses=True, truncated_is_wrong=False)
    assert all(p["accuracy"] == want and p["verifier_accuracy"] == want for p in res["points"])
    pts = [(p["mean_tpf"], 100 * want) for p in res["points"]]
    assert res["aup"] == pytest.approx(ev.aup(pts)) and res["aup_y_max"] == pytest.approx(100 * want)
    resp = res["points"][0]["responses"]
    assert len(resp) == 8 and all(r["verified"] == (e.answer % 2 == 0) for r, e in zip(resp, exs))
    # default: a response cut at max_new_tokens is wrong whatever the verifier says
    strict = ev.evaluate(model, task.tokenizer, ParityTask(), exs, [0.2], cfg, batch_size=3, keep_responses=True)
    p = strict["points"][0]
    assert p["verifier_accuracy"] == want
    assert p["correct"] == sum(r["verified"] and r["eos"] for r in p["responses"])
    assert p["finished"] == sum(r["eos"] for r in p["responses"]) / 8 == 1 - p["truncated"] / 8
    assert "well_formed" not in p  # only for the synthetic task itself


def test_evaluate_restores_mode_and_block_size(synth_ckpt):
    task = SyntheticArithmetic()
    model, _ = load_model(synth_ckpt)
    model.train()
    ev.evaluate(model, task.tokenizer, task, task.test[:2], [0.9], _cfg(task.tokenizer, block_size=8))
    assert model.training and model.config.block_size == BLOCK
    with pytest.raises(ValueError, match="no examples"):
        ev.evaluate(model, task.tokenizer, task, [], [0.9], _cfg(task.tokenizer))


def test_make_task_and_synthetic_data(tmp_path):
    assert ev.make_task("code", workers=3).workers == 3
    assert ev.make_task("synthetic", None).name == "synthetic"
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps({"operands": [1, 2, 3]}) + "\n\n" + json.dumps({"prompt": "4+5+6?"}) + "\n")
    assert ev.load_synthetic(f, None) == [ArithExample((1, 2, 3)), ArithExample((4, 5, 6))]
    f.write_text(json.dumps({"operands": [1, 2]}) + "\n" + json.dumps({"prompt": "hello"}) + "\n")
    with pytest.raises(ev.CLIError, match=f"{f}:2:"):
        ev.load_synthetic(f, None)
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps({"operands": [7, 8]}).encode() + b"\n")  # a BOM leads
    assert ev.load_synthetic(f, None) == [ArithExample((7, 8))]
    f.write_text(json.dumps({"operands": [True, 2]}))
    with pytest.raises(ev.CLIError, match=f"{f}:1: expected"):
        ev.load_synthetic(f, None)
    f.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ev.CLIError, match="not UTF-8"):
        ev.load_synthetic(f, None)


# ------------------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------------------

def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_cli_synthetic_json_png_and_overlay(synth_ckpt, tmp_path, capsys):
    out = tmp_path / "res"
    args = ["--model", str(synth_ckpt), "--task", "synthetic", "--limit", "5", "--thresholds", "0.5,0.9",
            "--out", str(out), "--batch-size", "4", "--device", "cpu", "--quiet"]
    assert ev.main(args + ["--label", "base"]) == 0
    printed = capsys.readouterr().out
    assert "AUP" in printed and "accuracy%" in printed and "mean_tpf" in printed
    base = json.loads((out / "base.synthetic.json").read_text())
    assert base["label"] == "base" and base["task"] == "synthetic" and base["data"] == "synthetic:test"
    assert len(base["points"]) == 2 and base["n_examples"] == 5
    assert base["data_rows"] == {"rows": len(SyntheticArithmetic().test), "skipped": 0, "skipped_rows": []}
    for p in base["points"]:
        assert 0 <= p["accuracy"] <= 1 and 1 <= p["mean_tpf"] <= BLOCK and p["forwards"] > 0
    assert base["sampler"]["max_new_tokens"] == SyntheticArithmetic().max_response_tokens()
    assert (out / "base.synthetic.png").is_file() == _has_matplotlib()

    # an earlier run with a better curve, overlaid: AUPs are recomputed under the shared y_max
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"label": "fake", "points": [{"threshold": 0.9, "accuracy": 0.9, "mean_tpf": 2.0},
                                                             {"threshold": 0.5, "accuracy": 0.8, "mean_tpf": 4.0}]}))
    assert ev.main(args + ["--label", "trained", "--overlay", str(out / "base.synthetic.json"), str(other)]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "trained.synthetic.json").read_text())
    y_max = max(90.0, *(100 * p["accuracy"] for p in res["points"]))
    assert res["aup_shared_y_max"] == pytest.approx(y_max)
    assert res["overlays"]["fake"]["aup_shared"] == pytest.approx(ev.aup([(2.0, 90.0), (4.0, 80.0)], y_max=y_max))
    assert res["overlays"]["base"]["aup"] == pytest.approx(base["aup"])
    assert "fake" in printed and "base" in printed
    assert (out / "trained.synthetic.png").is_file() == _has_matplotlib()


def test_load_data_reports_skipped_rows(tmp_path):
    import argparse

    rows = tmp_path / "m.jsonl"
    rows.write_text("\n".join([json.dumps({"prompt": "1+1?", "answer": "2"}), "{broken",
                               json.dumps({"prompt": "2+2?", "answer": ""}), json.dumps({"prompt": "3?", "answer": 3})]))
    args = argparse.Namespace(task="math", data=str(rows), format=None, limit=None)
    with pytest.warns(UserWarning, match="skipped 2 malformed"):
        exs, info = ev.load_data(args, ev.make_task("math", None))
    assert [e.answer for e in exs] == ["2", "3"]
    assert info["rows"] == 4 and info["skipped"] == 2
    assert info["skipped_rows"][0].startswith(f"{rows}:2: bad JSON") and f"{rows}:3: plain: key 'answer' is empty" \
        == info["skipped_rows"][1]


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib is not installed")
def test_plot_curves_writes_png(tmp_path):
    runs = [{"label": "a", "aup": 10.0, "points": [{"threshold": 0.9, "accuracy": 0.5, "mean_tpf": 1.5},
                                                   {"threshold": 0.5, "accuracy": 0.4, "mean_tpf": 3.0}]},
            {"label": "b", "points": [{"threshold": 0.9, "accuracy": 0.7, "mean_tpf": 2.0}]}]
    path = tmp_path / "sub" / "c.png"
    assert ev.plot_curves(runs, path, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors(synth_ckpt, tmp_path, capsys):
    base = ["--model", str(synth_ckpt), "--out", str(tmp_path / "o"), "--quiet"]
    cases = [
        (["--task", "math"], "needs --data"),
        (["--task", "synthetic", "--thresholds", "a,b"], "--thresholds"),
        (["--task", "synthetic", "--thresholds", "0.5,2"], "[0, 1]"),
        (["--task", "synthetic", "--overlay", str(tmp_path / "none.json")], "does not exist"),
        (["--task", "synthetic", "--limit", "0"], "--limit"),
        (["--task", "math", "--data", str(tmp_path / "none.jsonl")], "does not exist"),
    ]
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{\"label\": \"x\"}")
    cases.append((["--task", "synthetic", "--overlay", str(bad_json)], "no \"points\" list"))
    for extra, msg in cases:
        assert ev.main(base + extra) == 2, extra
        assert msg in capsys.readouterr().err, extra
    assert ev.main(["--model", str(tmp_path / "nope"), "--task", "synthetic"]) == 2
    assert "does not exist" in capsys.readouterr().err
    code_rows = tmp_path / "mbpp.jsonl"
    code_rows.write_text(json.dumps({"task_id": 1, "text": "add", "code": "def f(a,b): return a+b",
                                     "test_list": ["assert f(1,2)==3"]}) + "\n")
    assert ev.main(base + ["--task", "math", "--data", str(code_rows)]) == 2
    assert "'code' problems" in capsys.readouterr().err


def test_cli_names_an_example_too_long_for_the_model_before_decoding(tmp_path, capsys, ascii_checkpoint):
    model = ascii_checkpoint(tmp_path / "model")
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"question": "What is 1+2?", "answer": "#### 3"}) + "\n"
                    + json.dumps({"question": "What is 1+1?" + " pad" * 200, "answer": "#### 2"}) + "\n")
    rc = ev.main(["--model", str(model), "--task", "math", "--data", str(data), "--max-new-tokens", "16",
                  "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "example 'long/2': the prompt does not fit:" in err and "+ max_new_tokens 16 = " in err
    assert "more than the 512 the cache holds" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------------------
# bad input to the command line: one `error:` line, before decoding, no lost results
# ------------------------------------------------------------------------------------------------------------

def _synth_args(model, out, *extra) -> list[str]:
    return ["--model", str(model), "--task", "synthetic", "--limit", "2", "--thresholds", "0.9", "--max-new-tokens",
            "8", "--batch-size", "2", "--out", str(out), "--device", "cpu", "--quiet", *extra]


def _one_error_line(capsys, *named: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for s in named:
        assert s in err, (s, err)
    return err


def _run_folder(synth_ckpt: Path, run: Path) -> Path:
    """A training run's output folder as train.py leaves it: run/checkpoint-1 and `latest` naming it."""
    import shutil

    from lightningrl_fast.rl.checkpointing import LATEST, TRAINER_STATE

    shutil.copytree(synth_ckpt, run / "checkpoint-1")
    (run / "checkpoint-1" / TRAINER_STATE).write_bytes(b"")
    (run / LATEST).write_text("checkpoint-1\n")
    return run


def test_cli_default_label_names_the_run_and_never_overwrites_another_models_results(synth_ckpt, tmp_path, capsys):
    """Was: the label was the checkpoint folder's name, so `--model runs/A` and `--model runs/B` at the same step
    both wrote checkpoint-1.synthetic.json and the second silently replaced the first."""
    run_a, run_b = _run_folder(synth_ckpt, tmp_path / "runs" / "A"), _run_folder(synth_ckpt, tmp_path / "runs" / "B")
    out = tmp_path / "res"
    assert ev.main(_synth_args(run_a, out)) == 0
    assert ev.main(_synth_args(run_b, out)) == 0
    capsys.readouterr()
    a_file, b_file = out / "A-checkpoint-1.synthetic.json", out / "B-checkpoint-1.synthetic.json"
    assert json.loads(a_file.read_text())["model_path"] == str((run_a / "checkpoint-1").resolve())
    assert json.loads(b_file.read_text())["model_path"] == str((run_b / "checkpoint-1").resolve())
    assert ev.default_label(run_a / "checkpoint-1") == "A-checkpoint-1" and ev.default_label(synth_ckpt) == "base"
    # a label that names another model's results: refused before decoding, the file untouched
    before = a_file.read_bytes()
    assert ev.main(_synth_args(run_b, out, "--label", "A-checkpoint-1")) == 2
    _one_error_line(capsys, str(a_file), "holds the results of another model", str((run_a / "checkpoint-1").resolve()))
    assert a_file.read_bytes() == before
    # a file there that is not a results file of this tool: not overwritten either
    (out / "notes.synthetic.json").write_text("my notes")
    assert ev.main(_synth_args(run_a, out, "--label", "notes")) == 2
    _one_error_line(capsys, "notes.synthetic.json exists and is not a results file")
    assert (out / "notes.synthetic.json").read_text() == "my notes"
    # the same model again (given as its run folder or its checkpoint folder): replaced
    assert ev.main(_synth_args(run_a / "checkpoint-1", out)) == 0
    assert json.loads(a_file.read_text())["model"] == str(run_a / "checkpoint-1")


def test_cli_prompt_whose_last_block_passes_the_positions_is_named_before_decoding(tmp_path, capsys,
                                                                                   ascii_checkpoint):
    """Was: the up-front check counted prompt + max_new_tokens only; with the last block rounded up to the
    block size the sampler refused it mid-run as `prompt 0` (a batch-local index)."""
    from lightningrl_fast.tokenizer import load_tokenizer

    model = ascii_checkpoint(tmp_path / "model", 512)
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "What is 1+2?", "answer": "#### 3"}) + "\n"
                    + json.dumps({"question": "What is 2+2?", "answer": "#### 4"}) + "\n")
    task = ev.make_task("math", None)
    exs, _ = ev.load_data(ev.build_parser().parse_args(["--model", "m", "--task", "math", "--data", str(data)]), task)
    n = len(ev._encode(load_tokenizer(model), task, exs)[0])
    # prompt + max_new_tokens = 512 positions fit the cache, but block 3 ends the last block at 513
    rc = ev.main(["--model", str(model), "--task", "math", "--data", str(data), "--max-new-tokens", str(512 - n),
                  "--block-size", "3", "--out", str(tmp_path / "o"), "--device", "cpu", "--quiet"])
    assert rc == 2
    _one_error_line(capsys, f"example '{exs[0].id}': the prompt does not fit", "with block_size 3 the last block "
                    "ends at position 513, past the model's max_position_embeddings 512", "(and 1 more example(s))")
    assert not (tmp_path / "o").exists()


def test_cli_prompt_ids_outside_a_smaller_model_vocabulary_name_the_example(tmp_path, capsys):
    """Was: `prompt 0 has token id(s) outside the vocabulary` (a batch-local index) from the sampler."""
    import string

    from lightningrl_fast.tokenizer import CharTokenizer

    tok = CharTokenizer("".join(c for c in string.printable if c not in "\r\x0b\x0c\t"))
    cfg = SDARConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,  # < the 100 ids
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=BLOCK,
                     mask_token_id=tok.mask_token_id, torch_dtype="float32", max_position_embeddings=512)
    model = tmp_path / "small"
    save_model(build_model(cfg, dtype=torch.float32, seed=0), cfg, model, tokenizer=tok)
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "What is 1+2?", "answer": "#### 3"}) + "\n")
    rc = ev.main(["--model", str(model), "--task", "math", "--data", str(data), "--max-new-tokens", "8",
                  "--out", str(tmp_path / "o"), "--device", "cpu", "--quiet"])
    assert rc == 2
    _one_error_line(capsys, "example 'q/1': the prompt has token id(s)", "outside the model's vocabulary [0, 80)")


def test_cli_warns_when_the_config_mask_id_is_not_the_tokenizers(tmp_path, capsys):
    tok = SyntheticArithmetic().tokenizer
    cfg = SDARConfig(vocab_size=tok.vocab_size + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=BLOCK,
                     mask_token_id=tok.vocab_size, torch_dtype="float32", max_position_embeddings=128)
    model = tmp_path / "m"
    save_model(build_model(cfg, dtype=torch.float32, seed=0), cfg, model, tokenizer=tok)
    assert ev.main(_synth_args(model, tmp_path / "o")) == 0
    err = capsys.readouterr().err
    assert (f"warning: tokenizer mask id {tok.mask_token_id} != model config mask_token_id {tok.vocab_size}; "
            f"the model's is used") in err


@pytest.mark.parametrize("tpf, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (-1.5, "-1.5"), (0, "0"),
                                        (10**400, "1000")], ids=["nan", "inf", "negative", "zero", "huge-int"])
def test_cli_overlay_with_a_tpf_that_is_not_positive_and_finite(synth_ckpt, tmp_path, capsys, tpf, shown):
    """Was accepted (accuracy was checked, TPF was not): the point silently left out of the plot and AUP."""
    overlay = tmp_path / "other.json"
    overlay.write_text(json.dumps({"points": [{"accuracy": 0.5, "mean_tpf": 2.0},
                                              {"accuracy": 0.5, "mean_tpf": tpf}]}))  # NaN / Infinity literals
    assert ev.main(_synth_args(synth_ckpt, tmp_path / "o", "--overlay", str(overlay))) == 2
    _one_error_line(capsys, f"overlay {overlay}: point 1 has mean_tpf {shown}", "expected a positive finite")
    assert not (tmp_path / "o").exists()


def _strict_json(text: str):
    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constant)


def test_cli_results_json_is_strict_json_with_null_for_non_finite(synth_ckpt, tmp_path, monkeypatch, capsys):
    """Was written with allow_nan=True: a rate with no decode time was a literal NaN (not valid JSON)."""
    real = ev.evaluate

    def no_decode_time(*a, **kw):
        res = real(*a, **kw)
        res["points"][0]["tokens_per_s"] = math.nan
        res["points"][0]["forwards_per_s"] = math.inf
        return res

    monkeypatch.setattr(ev, "evaluate", no_decode_time)
    out = tmp_path / "o"
    assert ev.main(_synth_args(synth_ckpt, out, "--label", "x")) == 0
    doc = _strict_json((out / "x.synthetic.json").read_text())
    assert doc["points"][0]["tokens_per_s"] is None and doc["points"][0]["forwards_per_s"] is None
    assert doc["points"][0]["mean_tpf"] > 0
    assert ev.load_results(out / "x.synthetic.json")["label"] == "x"  # still an overlay
    assert ev.json_safe({"a": [1.0, math.nan, (math.inf, -math.inf)], "b": 2, "c": "nan"}) == \
        {"a": [1.0, None, [None, None]], "b": 2, "c": "nan"}


def _main_rc(argv) -> int | str:
    try:  # a KeyboardInterrupt escaping main would stop the whole pytest session
        return ev.main(argv)
    except KeyboardInterrupt:
        return "KeyboardInterrupt escaped"


def test_cli_ctrl_c_is_one_line_and_leaves_no_results_file(synth_ckpt, tmp_path, monkeypatch, capsys):
    """Was a KeyboardInterrupt traceback (and a results file interrupted mid-write was left truncated)."""
    out = tmp_path / "o"

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ev, "evaluate", interrupted)
        assert _main_rc(_synth_args(synth_ckpt, out, "--label", "x")) == 130
    _one_error_line(capsys, "interrupted")
    assert not out.exists() or not list(out.iterdir())
    # interrupted while the results are written: the earlier file stays whole, no temporary file is left
    assert ev.main(_synth_args(synth_ckpt, out, "--label", "x")) == 0
    capsys.readouterr()
    before = (out / "x.synthetic.json").read_bytes()

    def replace_interrupted(src, dst):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ev.os, "replace", replace_interrupted)
        assert _main_rc(_synth_args(synth_ckpt, out, "--label", "x", "--thresholds", "0.5")) == 130
    _one_error_line(capsys, "interrupted")
    assert (out / "x.synthetic.json").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == sorted(["x.synthetic.json"] + (["x.synthetic.png"]
                                                                                   if _has_matplotlib() else []))
