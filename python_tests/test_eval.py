"""eval: the AUP metric against hand-computed values, `evaluate` on the synthetic task, the CLI (JSON, PNG, overlays)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
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


def test_cli_format_errors_name_the_flag(synth_ckpt, tmp_path, capsys):
    """Was: `--format foo` reported `fmt must be one of ...` and an undetectable file `... or pass fmt=`, the data
    loader's parameter, not the flag."""
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "What is 1+2?", "answer": "#### 3"}) + "\n")
    base = ["--model", str(synth_ckpt), "--task", "math", "--data", str(data), "--out", str(tmp_path / "o"), "--quiet"]
    with pytest.raises(SystemExit) as e:
        ev.main(base + ["--format", "foo"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --format: invalid choice: 'foo' (choose from" in err and "fmt" not in err
    data.write_text(json.dumps({"foo": 1}) + "\n")
    assert ev.main(base) == 2
    err = _one_error_line(capsys, f"{data}:1: cannot detect the format from keys ['foo']", "or give --format")
    assert "fmt" not in err
    assert ev.build_parser().parse_args(base[:6] + ["--format", "gsm8k"]).format == "gsm8k"


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


def test_cli_stdout_closed_early_exits_quietly(tmp_path, capsys, monkeypatch, ascii_checkpoint):
    """`eval ... | head`: was a BrokenPipeError traceback (generate already exited 141)."""
    import sys

    class ClosedPipe:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    model = ascii_checkpoint(tmp_path / "model")
    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps({"question": "What is 1+2?", "answer": "#### 3"}) + "\n")
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    rc = ev.main(["--model", str(model), "--task", "math", "--data", str(data), "--max-new-tokens", "8",
                  "--thresholds", "0.9", "--out", str(tmp_path / "o")])
    monkeypatch.undo()
    assert rc == 141 and "Traceback" not in capsys.readouterr().err


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
    assert "more example" not in err  # one example does not fit: no "(and 0 more example(s))"


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


def _math_args(model, data, out, *extra) -> list[str]:
    return ["--model", str(model), "--task", "math", "--data", str(data), "--thresholds", "0.9", "--max-new-tokens",
            "4", "--out", str(out), "--device", "cpu", "--quiet", *extra]


def test_cli_results_of_two_data_files_of_one_task_are_two_files(tmp_path, capsys, ascii_checkpoint):
    """Was: GSM8K and MATH500 (both --task math) wrote the one file <label>.math.json, the second run silently
    replacing the first. The data file's name is in the results file's name, and a file of the same name from
    another folder is refused, naming both."""
    model = ascii_checkpoint(tmp_path / "m", 2048)
    gsm, m500 = tmp_path / "gsm8k_test.jsonl", tmp_path / "math500.jsonl.gz"
    gsm.write_text(json.dumps({"question": "What is 1+2?", "answer": "#### 3"}) + "\n")
    import gzip

    m500.write_bytes(gzip.compress((json.dumps({"problem": "What is 2+2?", "answer": "4"}) + "\n").encode()))
    out = tmp_path / "res"
    assert ev.main(_math_args(model, gsm, out)) == 0
    assert ev.main(_math_args(model, m500, out)) == 0
    printed = capsys.readouterr().out
    g, m = (json.loads((out / f"m.math.{n}.json").read_text()) for n in ("gsm8k_test", "math500"))
    assert (g["data"], g["data_path"]) == (str(gsm), str(gsm.resolve()))
    assert (m["data"], m["data_path"]) == (str(m500), str(m500.resolve()))
    assert f"wrote {out / 'm.math.gsm8k_test.json'}" in printed and f"wrote {out / 'm.math.math500.json'}" in printed
    assert (out / "m.math.math500.png").is_file() == _has_matplotlib()
    assert not (out / "m.math.json").exists()
    # the same model on the same file again: replaced; on another file of the same name: refused before decoding
    assert ev.main(_math_args(model, gsm, out)) == 0
    capsys.readouterr()
    other = tmp_path / "b" / "gsm8k_test.jsonl"
    other.parent.mkdir()
    other.write_text(gsm.read_text())
    before = (out / "m.math.gsm8k_test.json").read_bytes()
    assert ev.main(_math_args(model, other, out)) == 2
    _one_error_line(capsys, f"{out / 'm.math.gsm8k_test.json'} holds this model's results on another data file "
                    f"({gsm.resolve()}); not overwriting them with those on {other.resolve()}")
    assert (out / "m.math.gsm8k_test.json").read_bytes() == before
    assert ev.main(_math_args(model, other, out, "--label", "m-b")) == 0  # the way out the message names
    assert json.loads((out / "m-b.math.gsm8k_test.json").read_text())["data_path"] == str(other.resolve())


def test_results_file_names_carry_the_data_files_name(tmp_path):
    assert ev.results_path(tmp_path, "A", "math", "data/gsm8k_test.jsonl") == tmp_path / "A.math.gsm8k_test.json"
    assert ev.results_path(tmp_path, "A", "math", "x/MATH500.test.json.gz") == tmp_path / "A.math.MATH500.test.json"
    assert ev.results_path(tmp_path, "A", "code", "he eval.parquet") == tmp_path / "A.code.he_eval.json"
    assert ev.results_path(tmp_path, "A", "synthetic", None) == tmp_path / "A.synthetic.json"
    assert ev.results_path(tmp_path, "A", "synthetic", "ops.jsonl") == tmp_path / "A.synthetic.ops.json"
    # an older file that records `data` only (relative to the current folder), and one on the synthetic test split
    mine = tmp_path / "mine"
    mine.mkdir()
    target = tmp_path / "r.json"
    target.write_text(json.dumps({"model_path": str(mine.resolve()), "data": str(tmp_path / "a.jsonl")}))
    ev.check_results_target(target, mine, tmp_path / "a.jsonl")
    with pytest.raises(ev.CLIError, match="another data file"):
        ev.check_results_target(target, mine, tmp_path / "b.jsonl")
    target.write_text(json.dumps({"model_path": str(mine.resolve()), "data": "synthetic:test"}))
    ev.check_results_target(target, mine, None)
    with pytest.raises(ev.CLIError, match="another data file"):
        ev.check_results_target(target, mine, tmp_path / "a.jsonl")


def _math_examples(path, model, qa):
    """(data file, examples, prompt lengths in tokens under `model`'s tokenizer): GSM8K rows of (question, answer)."""
    from lightningrl_fast.tokenizer import load_tokenizer

    path.write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n" for q, a in qa))
    task = ev.make_task("math", None)
    exs, _ = ev.load_data(ev.build_parser().parse_args(["--model", "m", "--task", "math", "--data", str(path)]), task)
    return path, exs, [len(ids) for ids in ev._encode(load_tokenizer(model), task, exs)]


def test_cli_default_max_new_tokens_fits_the_models_positions(tmp_path, capsys, monkeypatch, ascii_checkpoint):
    """Was: math / code took 512 new tokens whatever the model's positions, so on a 512-position model every
    example failed unless --max-new-tokens was given; now fitted as generate's default, with a note."""
    model = ascii_checkpoint(tmp_path / "m", 512)
    data, _, lens = _math_examples(tmp_path / "q.jsonl", model, [("What is 1+2?", 3), ("What is 10+20?", 30)])
    longest = max(lens)
    args = ["--model", str(model), "--task", "math", "--data", str(data), "--thresholds", "0.9", "--out",
            str(tmp_path / "o"), "--device", "cpu", "--quiet", "--label", "x"]
    assert ev.main(args + ["--block-size", "8"]) == 0
    printed = capsys.readouterr()
    want = 512 - longest  # 512 is a multiple of the block size: the last block ends at 512
    assert (f"max_new_tokens {want}: what the model's 512 positions leave after the longest prompt ({longest} "
            f"tokens, block 8), less than the default 512; --max-new-tokens sets it") in printed.err
    assert json.loads((tmp_path / "o" / "x.math.q.json").read_text())["sampler"]["max_new_tokens"] == want
    assert f"max_new_tokens {want})" in printed.out
    # positions to spare: the default 512, no note; an explicit value: as given (decoded with 4, to be quick)
    asked, real = [], ev.evaluate

    def short(model_, tok, task_, exs_, taus, cfg, **kw):
        asked.append(cfg.max_new_tokens)
        return real(model_, tok, task_, exs_, taus, dataclasses.replace(cfg, max_new_tokens=4), **kw)

    monkeypatch.setattr(ev, "evaluate", short)
    big = ascii_checkpoint(tmp_path / "big", 2048)
    assert ev.main(["--model", str(big)] + args[2:] + ["--label", "y"]) == 0
    assert ev.main(["--model", str(model)] + args[2:] + ["--label", "z", "--max-new-tokens", "40"]) == 0
    assert asked == [512, 40] and "max_new_tokens" not in capsys.readouterr().err


def test_cli_prompt_whose_last_block_passes_the_positions_is_named_before_decoding(tmp_path, capsys,
                                                                                   ascii_checkpoint):
    """Was: the up-front check counted prompt + max_new_tokens only; with the last block rounded up to the
    block size the sampler refused it mid-run as `prompt 0` (a batch-local index)."""
    model = ascii_checkpoint(tmp_path / "model", 512)
    data, exs, lens = _math_examples(tmp_path / "q.jsonl", model, [("What is 1+2?", 3), ("What is 2+2?", 4)])
    n = lens[0]
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


# ------------------------------------------------------------------------------------------------------------
# audit: every number of a point against hand-computed values (a scripted decoder and clock stand in for the
# sampler, so that TPF, forwards, lengths and finish reasons differ from row to row, which a random model's do not)
# ------------------------------------------------------------------------------------------------------------

_EXS = [ArithExample((1, 2, 3)), ArithExample((2, 2, 2)), ArithExample((3, 1, 4)), ArithExample((5, 0, 1)),
        ArithExample((4, 4, 1))]
# per threshold, per example: (response, finished with EOS, TPF, forwards of the row, response length)
_SCRIPT = {
    0.9: [("1+2=3,3+3=6#6", True, 1.0, 14, 14),   # right
          ("2+2=4,4+2=7#7", True, 2.0, 8, 14),    # wrong answer
          ("3+1=4,4+4=8#8", False, 1.5, 10, 13),  # a right trace cut at the length limit
          ("5+0=5,5+1=6#6", True, 3.5, 5, 14),    # right
          ("4+4", False, 1.25, 12, 13)],          # cut
    0.5: [("1+2=3,3+3=6#6", True, 3.0, 5, 14),
          ("2+2=4,4+2=6#6", True, 3.5, 4, 14),
          ("3+1=4,4+4=8#8", True, 2.5, 6, 14),
          ("5+0=5,5+1=6#6", True, 4.0, 4, 14),
          ("4+4=8,8+1=8#8", True, 2.0, 7, 14)],   # wrong answer
}


def _scripted(monkeypatch, tok, calls: list, score_s: float = 0.25, tick: float = 1.0):
    """ev.decode_texts answers from _SCRIPT (the engine's forwards of a batch: its rows' most + 1) and records
    (threshold, seed, example indices, the model's attention block) per call; the clock advances `tick` per read,
    so that each batch decodes in exactly `tick` seconds; scoring a batch takes `score_s`."""
    import itertools
    from types import SimpleNamespace

    index = {tuple(tok.encode(ex.prompt)): i for i, ex in enumerate(_EXS)}

    def decode_texts(model, tokenizer, prompt_ids, cfg, decoder=None):
        idx = [index[tuple(p)] for p in prompt_ids]
        calls.append((cfg.threshold, cfg.seed, idx, model.config.block_size))
        rows = [_SCRIPT[cfg.threshold][i] for i in idx]
        ro = SimpleNamespace(lengths=torch.tensor([r[4] for r in rows]),
                             tpf=torch.tensor([r[2] for r in rows], dtype=torch.float32),
                             forwards=torch.tensor([r[3] for r in rows]),
                             eos_found=torch.tensor([r[1] for r in rows]),
                             finish_reason=["eos" if r[1] else "length" for r in rows],
                             total_forwards=max(r[3] for r in rows) + 1)
        return ro, [r[0] for r in rows]

    ticks = itertools.count()
    monkeypatch.setattr(ev, "decode_texts", decode_texts)
    monkeypatch.setattr(ev, "time", SimpleNamespace(perf_counter=lambda: tick * next(ticks)))
    monkeypatch.setattr(ev, "_timed", lambda fn, *a: (fn(*a), score_s))


def _script_cfg(tok, **kw):
    return SamplerConfig(temperature=0, max_new_tokens=14, eos_ids=tuple(sorted(tok.eos_token_ids)), **kw)


def _aup_oracle(points, y_max):
    """d3LLM's AUP written out again (float64): sort by TPF (ties: higher accuracy first), keep y >= y_1 - 5."""
    pts = sorted(points, key=lambda p: (p[0], -p[1]))
    pts = [p for p in pts if p[1] >= pts[0][1] - 5]
    w = [min(math.exp(-3 * (1 - y / y_max)), 1.0) for _, y in pts]
    return pts[0][0] * pts[0][1] + sum((pts[i][0] - pts[i - 1][0]) * (pts[i][1] * w[i] + pts[i - 1][1] * w[i - 1]) / 2
                                       for i in range(1, len(pts)))


def test_evaluate_points_against_hand_computed_values(synth_ckpt, monkeypatch):
    """Each number of a point, per example and per batch, from a script whose rows differ: mean TPF over the
    examples, forwards per answer, the engine's forwards summed over batches, tokens/s and forwards/s over the
    decode time (summed over batches), accuracy needing EOS, well_formed, the kept responses, AUP and its y_max,
    a distinct seed per batch and the sampler's block size in force while decoding and recorded."""
    task = SyntheticArithmetic()
    model, _ = load_model(synth_ckpt)
    calls: list = []
    _scripted(monkeypatch, task.tokenizer, calls)
    cfg = _script_cfg(task.tokenizer, seed=7, block_size=8)
    res = ev.evaluate(model, task.tokenizer, task, _EXS, [0.9, 0.5], cfg, batch_size=2, keep_responses=True)
    assert [(c[0], c[1], c[2]) for c in calls] == [(t, 7 + b, idx) for t in (0.9, 0.5)
                                                   for b, idx in enumerate([[0, 1], [2, 3], [4]])]
    assert {c[3] for c in calls} == {8} and model.config.block_size == BLOCK
    p9, p5 = res["points"]
    want9 = {"threshold": 0.9, "n": 5, "correct": 2, "accuracy": 0.4, "verifier_accuracy": 0.6, "finished": 0.6,
             "well_formed": 0.4, "mean_tpf": 1.85, "forwards_per_answer": 9.8, "tokens": 68, "tokens_per_s": 68 / 3,
             "forwards": 15 + 11 + 13, "forwards_per_s": 13.0, "truncated": 2, "decode_s": 3.0, "score_s": 0.75}
    want5 = {"threshold": 0.5, "n": 5, "correct": 4, "accuracy": 0.8, "verifier_accuracy": 0.8, "finished": 1.0,
             "well_formed": 0.8, "mean_tpf": 3.0, "forwards_per_answer": 5.2, "tokens": 70, "tokens_per_s": 70 / 3,
             "forwards": 6 + 7 + 8, "forwards_per_s": 7.0, "truncated": 0, "decode_s": 3.0, "score_s": 0.75}
    for got, want in ((p9, want9), (p5, want5)):
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-12)
    assert [(r["response"], r["correct"], r["verified"], r["eos"], r["tpf"]) for r in p9["responses"]] == [
        (s[0], ok, v, s[1], s[2]) for s, ok, v in zip(_SCRIPT[0.9], [True, False, False, True, False],
                                                      [True, False, True, True, False])]
    assert res["aup_y_max"] == 80.0
    assert res["aup"] == pytest.approx(1.85 * 40 + (3.0 - 1.85) * (80 + 40 * math.exp(-1.5)) / 2, rel=1e-12)
    assert res["aup"] == pytest.approx(_aup_oracle([(1.85, 40.0), (3.0, 80.0)], 80.0), rel=1e-12)
    assert res["sampler"]["block_size"] == 8 and res["sampler"]["seed"] == 7
    assert res["sampler"]["truncated_is_wrong"] is True
    # the table printed by the CLI shows the same numbers (in percent, rates per second)
    lines = ev.format_table(res).splitlines()
    head = lines[0].split()
    rows = [dict(zip(head, line.split())) for line in lines[2:]]
    assert rows[0] == {"threshold": "0.9", "accuracy%": "40.00", "verifier%": "60.00", "well_formed%": "40.00",
                       "mean_tpf": "1.850", "tokens/s": "22.7", "forwards/s": "13.0", "forwards": "39",
                       "truncated": "2", "n": "5"}
    # the verifier alone: the right trace cut at the limit counts, but is not well formed (it did not finish)
    calls.clear()
    loose = ev.evaluate(model, task.tokenizer, task, _EXS, [0.9], cfg, batch_size=2, keep_responses=True,
                        truncated_is_wrong=False)
    p = loose["points"][0]
    assert (p["correct"], p["accuracy"], p["verifier_accuracy"], p["well_formed"]) == (3, 0.6, 0.6, 0.4)
    assert [r["correct"] for r in p["responses"]] == [True, False, True, True, False]
    assert loose["sampler"]["truncated_is_wrong"] is False


def test_evaluate_with_no_decode_time_reports_nan_rates(synth_ckpt, monkeypatch):
    """A decode time of 0 (a clock that did not move) gives NaN rates, not a ZeroDivisionError."""
    task = SyntheticArithmetic()
    model, _ = load_model(synth_ckpt)
    _scripted(monkeypatch, task.tokenizer, [], tick=0.0)
    res = ev.evaluate(model, task.tokenizer, task, _EXS, [0.9], _script_cfg(task.tokenizer))
    p = res["points"][0]
    assert p["decode_s"] == 0 and math.isnan(p["tokens_per_s"]) and math.isnan(p["forwards_per_s"])
    assert p["tokens"] == 68 and p["forwards"] == 15  # one batch of 5: its rows' most forwards + 1


def test_evaluate_on_two_ranks_merges_into_the_one_process_points(synth_ckpt, monkeypatch):
    """Two ranks (all_gather replaced by the exchange of their parts): rank 0 decodes examples 0, 2, 4 in two
    batches, rank 1 examples 1, 3 in one; the merged point is the one-process point, with the tokens and forwards
    summed over the ranks and the decode time the slowest rank's (the ranks decode at once)."""
    from lightningrl_fast.rl.distributed import DistEnv

    task = SyntheticArithmetic()
    model, _ = load_model(synth_ckpt)
    calls: list = []
    _scripted(monkeypatch, task.tokenizer, calls)
    cfg = _script_cfg(task.tokenizer)
    parts_1: list = []
    monkeypatch.setattr(ev, "all_gather", lambda env, obj: parts_1.append(obj) or [obj])
    ev.evaluate(model, task.tokenizer, task, _EXS, [0.9], cfg, batch_size=2, env=DistEnv(rank=1, world=2))
    monkeypatch.setattr(ev, "all_gather", lambda env, obj: [obj, parts_1.pop(0)])
    res = ev.evaluate(model, task.tokenizer, task, _EXS, [0.9], cfg, batch_size=2, env=DistEnv(rank=0, world=2))
    assert [c[2] for c in calls] == [[1, 3], [0, 2], [4]]
    p = res["points"][0]
    want = {"n": 5, "correct": 2, "accuracy": 0.4, "verifier_accuracy": 0.6, "finished": 0.6, "well_formed": 0.4,
            "mean_tpf": 1.85, "forwards_per_answer": 9.8, "tokens": 68, "forwards": 9 + 15 + 13, "truncated": 2,
            "decode_s": 2.0, "tokens_per_s": 34.0, "forwards_per_s": 18.5, "score_s": 0.5}
    assert {k: p[k] for k in want} == pytest.approx(want, rel=1e-12)
    assert res["aup"] == pytest.approx(1.85 * 40, rel=1e-12)


def test_aup_weight_is_capped_at_one_and_ties_keep_the_higher_accuracy_first():
    # a y_max below a point's accuracy (a caller's shared y_max): W(y) = min(..., 1) is 1, not above
    assert evr.aup_weight(90, 50) == 1.0
    assert ev.aup([(1, 80), (2, 90)], y_max=50) == pytest.approx(80 + (90 + 80) / 2)
    # two points at the lowest TPF: the higher accuracy is y_1 (floor 85), so the lower one (80) is dropped
    want = 90 + (2 - 1) * (88 * math.exp(-3 * 2 / 90) + 90) / 2
    assert ev.aup([(1, 80), (1, 90), (2, 88)]) == pytest.approx(want)
    assert ev.aup([(1, 80), (1, 90), (2, 88)]) == pytest.approx(_aup_oracle([(1, 80), (1, 90), (2, 88)], 90))
    # run_points: (TPF, accuracy %) of the points with a positive finite TPF only
    pts = [{"mean_tpf": 0, "accuracy": 0.5}, {"mean_tpf": math.inf, "accuracy": 0.5},
           {"mean_tpf": math.nan, "accuracy": 0.5}, {"mean_tpf": None, "accuracy": 0.5},
           {"mean_tpf": 2.5, "accuracy": 0.25}]
    assert evr.run_points({"points": pts}) == [(2.5, 25.0)]


def test_another_models_results_are_refused_before_decoding_and_again_before_writing(synth_ckpt, tmp_path,
                                                                                      monkeypatch, capsys):
    """The refusal to overwrite another model's results comes before decoding (nothing decoded in vain), and is
    checked again before writing (another run may have written the file meanwhile): then the numbers are printed
    rather than lost, and the other file is kept."""
    out = tmp_path / "res"
    out.mkdir()
    theirs = out / "x.synthetic.json"
    other = json.dumps({"model": str(tmp_path / "other-model"), "points": [{"accuracy": 1.0, "mean_tpf": 1.0}]})
    theirs.write_text(other)

    def no_decoding(*a, **kw):
        raise AssertionError("decoded before the results target was checked")

    with monkeypatch.context() as m:
        m.setattr(ev, "evaluate", no_decoding)
        assert ev.main(_synth_args(synth_ckpt, out, "--label", "x")) == 2
    _one_error_line(capsys, "holds the results of another model")
    assert theirs.read_text() == other
    # written by another run while this one decoded
    theirs.unlink()
    real = ev.evaluate

    def another_run_writes_meanwhile(*a, **kw):
        res = real(*a, **kw)
        theirs.write_text(other)
        return res

    monkeypatch.setattr(ev, "evaluate", another_run_writes_meanwhile)
    assert ev.main(_synth_args(synth_ckpt, out, "--label", "x")) == 2
    printed = capsys.readouterr()
    assert "holds the results of another model" in printed.err and "accuracy%" in printed.out
    assert theirs.read_text() == other and sorted(p.name for p in out.iterdir()) == ["x.synthetic.json"]


def test_results_target_is_recognised_by_its_model_path(tmp_path):
    """`model_path` (absolute) decides whose results a file holds; `model` only for files without it."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    target = tmp_path / "r.json"
    target.write_text(json.dumps({"model_path": str(mine.resolve()), "model": "other", "points": []}))
    ev.check_results_target(target, mine)  # the same model: replaced
    with pytest.raises(ev.CLIError, match="holds the results of another model"):
        ev.check_results_target(target, other)
    target.write_text(json.dumps({"model": str(other), "points": []}))  # an older file: `model` alone
    ev.check_results_target(target, other)
    with pytest.raises(ev.CLIError, match="another model"):
        ev.check_results_target(target, mine)
    target.unlink()
    target.symlink_to(tmp_path / "gone.json")  # a dangling link is not written through
    with pytest.raises(ev.CLIError, match="exists and is not a results file"):
        ev.check_results_target(target, mine)


def test_labels_and_results_file_names(tmp_path):
    """A checkpoint folder of a run (checkpoint-<step> or the reference model) is led by its run folder's name even
    without a `latest` file; other folders keep their name; a label is made file-safe."""
    for name in ("checkpoint-7", "reference"):
        (tmp_path / "B" / name).mkdir(parents=True)
        assert ev.default_label(tmp_path / "B" / name) == f"B-{name}"
    (tmp_path / "B" / "plain").mkdir()
    assert ev.default_label(tmp_path / "B" / "plain") == "plain"
    assert ev.results_path(tmp_path, "/a b:c/", "math") == tmp_path / "a_b_c.math.json"
    assert ev.results_path(tmp_path, "//", "code") == tmp_path / "run.code.json"
    # an overlay without a label is named by its file's stem
    f = tmp_path / "base-run.json"
    f.write_text(json.dumps({"points": [{"accuracy": 0.5, "mean_tpf": 2.0}]}))
    assert ev.load_results(f)["label"] == "base-run"


def test_overlays_are_scored_under_the_shared_y_max(synth_ckpt, tmp_path, capsys):
    """aup_shared of every run uses the best accuracy of all the runs; `overlays` also keeps each file's own AUP."""
    good, weak = tmp_path / "good.json", tmp_path / "weak.json"
    good.write_text(json.dumps({"points": [{"accuracy": 0.9, "mean_tpf": 2.0}]}))
    weak.write_text(json.dumps({"aup": 123.0, "points": [{"accuracy": 0.5, "mean_tpf": 1.0},
                                                         {"accuracy": 0.45, "mean_tpf": 2.0}]}))
    out = tmp_path / "o"
    assert ev.main(_synth_args(synth_ckpt, out, "--label", "x", "--overlay", str(good), str(weak))) == 0
    capsys.readouterr()
    res = json.loads((out / "x.synthetic.json").read_text())
    y_max = max(90.0, *(100 * p["accuracy"] for p in res["points"]))
    assert res["aup_shared_y_max"] == pytest.approx(y_max)
    w = [math.exp(-3 * (1 - y / y_max)) for y in (50, 45)]
    assert res["overlays"]["weak"]["aup_shared"] == pytest.approx(50 + (45 * w[1] + 50 * w[0]) / 2)
    assert res["overlays"]["weak"]["aup"] == 123.0 and res["overlays"]["good"]["aup"] is None
    assert res["overlays"]["good"]["aup_shared"] == pytest.approx(180.0)


def test_an_older_overlay_without_data_path_is_compared_by_file_name():
    """Results files written before `data_path` was recorded keep `data` as given (maybe relative to another
    folder): compared by file name, so an overlay of the same benchmark from another folder is not flagged."""
    old = {"task": "math", "data": "bench/gsm8k_test.jsonl", "n_examples": 5}
    assert evr.overlay_mismatch(old, "math", "/elsewhere/gsm8k_test.jsonl", 5) == []
    assert evr.overlay_mismatch(old, "math", "/elsewhere/math500.jsonl", 5) == [
        "data gsm8k_test.jsonl (this run: math500.jsonl)"]
    new = {**old, "data_path": "/x/gsm8k_test.jsonl"}  # a recorded absolute path: compared as a path
    assert evr.overlay_mismatch(new, "math", "/elsewhere/gsm8k_test.jsonl", 5) == [
        "data /x/gsm8k_test.jsonl (this run: /elsewhere/gsm8k_test.jsonl)"]


def test_overlays_of_other_data_are_warned_and_shared_labels_told_apart(synth_ckpt, tmp_path, monkeypatch, capsys):
    """Was: an overlay computed on another data file (or task) was drawn without a word, and runs sharing a label
    were shown under one name in the table and legend (and the second replaced the first in `overlays`)."""
    out = tmp_path / "o"
    assert ev.main(_synth_args(synth_ckpt, out, "--label", "base")) == 0  # the synthetic test split, 2 examples
    capsys.readouterr()
    earlier = out / "base.synthetic.json"
    ops = tmp_path / "ops.jsonl"
    ops.write_text("".join(json.dumps({"operands": [i, 2, 3]}) + "\n" for i in range(3)))
    copy = tmp_path / "b" / "base.synthetic.json"  # the same label and file name, from another folder
    copy.parent.mkdir()
    copy.write_text(earlier.read_text())
    math_run = tmp_path / "m.json"
    math_run.write_text(json.dumps({"label": "gsm", "task": "math", "data": "gsm.jsonl", "data_path": "/d/gsm.jsonl",
                                    "n_examples": 3, "points": [{"accuracy": 0.5, "mean_tpf": 2.0}]}))
    plotted = []
    monkeypatch.setattr(ev, "plot_curves", lambda runs, path, title="": plotted.append([r["label"] for r in runs]))
    args = ["--model", str(synth_ckpt), "--task", "synthetic", "--data", str(ops), "--thresholds", "0.9",
            "--max-new-tokens", "8", "--out", str(out), "--device", "cpu", "--quiet", "--label", "base",
            "--overlay", str(earlier), str(copy), str(math_run)]
    assert ev.main(args) == 0
    printed = capsys.readouterr()
    warns = [ln for ln in printed.err.splitlines() if ln.startswith("warning: overlay")]
    assert warns == [
        f"warning: overlay {earlier} was computed on data synthetic:test (this run: {ops.resolve()}); 2 examples (this "
        "run: 3): its curve is not comparable with this run's (drawn all the same)",
        f"warning: overlay {copy} was computed on data synthetic:test (this run: {ops.resolve()}); 2 examples (this "
        "run: 3): its curve is not comparable with this run's (drawn all the same)",
        f"warning: overlay {math_run} was computed on task math (this run: synthetic); data /d/gsm.jsonl (this run: "
        f"{ops.resolve()}): its curve is not comparable with this run's (drawn all the same)"]
    shown = ["base", f"base [{earlier}]", f"base [{copy}]", "gsm"]
    res = json.loads((out / "base.synthetic.ops.json").read_text())
    assert list(res["overlays"]) == shown[1:]
    assert [res["overlays"][k]["file"] for k in shown[1:]] == [str(earlier), str(copy), str(math_run)]
    assert plotted == [shown]
    assert all(f"  {name:<24} AUP" in printed.out for name in shown)
    assert json.loads(earlier.read_text())["label"] == "base"  # the overlay files are not changed
    # an overlay of the same task, data and size: no warning
    assert ev.main(args[:-3] + [str(out / "base.synthetic.ops.json")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert ev.distinct_labels(["a", "b", "c"], [None, "x.json", "y.json"]) == ["a", "b", "c"]
    assert ev.distinct_labels(["a", "a", "b", "a"], [None, "r/a.json", "b.json", "r/a.json"]) == [
        "a", "a [r/a.json]", "b", "a [r/a.json] #3"]  # the same file twice
    assert ev.distinct_labels(["a", "a", "b"], [None, "r/a.m.json", "b.json"]) == ["a", "a [a.m.json]", "b"]


def test_thresholds_and_synthetic_rows_are_checked(tmp_path):
    assert ev.parse_thresholds("0, 0.5,,1,") == [0.0, 0.5, 1.0]  # 0 and 1 are thresholds; empty items skipped
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ev.CLIError, match=r"must be in \[0, 1\]"):
            ev.parse_thresholds(bad)
    f = tmp_path / "s.jsonl"
    for row in ({"operands": [5]}, {"operands": [1, -2]}, {"prompt": "7?"}):
        f.write_text(json.dumps(row) + "\n")
        with pytest.raises(ev.CLIError, match=f"{f}:1: expected"):
            ev.load_synthetic(f, None)


def test_thresholds_take_commas_or_spaces_and_have_help(synth_ckpt, tmp_path, capsys):
    """Was: `--thresholds 0.5 0.9` failed with `unrecognized arguments: 0.9` (train's --eval-thresholds takes
    both forms), and --thresholds had no help text."""
    for words in (["0.5", "0.9"], ["0.5,0.9"], ["0.5,", "0.9"], ["0.5, 0.9"]):
        args = ev.build_parser().parse_args(["--model", "m", "--task", "synthetic", "--thresholds", *words])
        assert ev.parse_thresholds(args.thresholds) == [0.5, 0.9], words
    assert ev.resolve_thresholds(ev.build_parser().parse_args(["--model", "m", "--task", "synthetic"])) \
        == list(ev.DEFAULT_THRESHOLDS)
    with pytest.raises(ev.CLIError, match=r"--thresholds '0.5 x': expected numbers separated by commas or spaces"):
        ev.parse_thresholds(["0.5", "x"])
    helptext = " ".join(ev.build_parser().format_help().split())
    assert "--thresholds T [T ...] confidence thresholds tau to decode at" in helptext
    assert "separated by commas or spaces (default 0.5,0.7,0.9,0.95)" in helptext
    out = tmp_path / "o"
    assert ev.main(_synth_args(synth_ckpt, out, "--label", "x", "--thresholds", "0.5", "0.9")) == 0
    capsys.readouterr()
    assert [p["threshold"] for p in json.loads((out / "x.synthetic.json").read_text())["points"]] == [0.5, 0.9]


def test_an_explicit_threshold_is_decoded_at_or_refused_beside_thresholds(synth_ckpt, tmp_path, capsys):
    """Was: `eval --threshold 0.8` was accepted (the flag is shared with generate) and ignored: eval decoded the
    default --thresholds sweep. Alone it is the one threshold decoded; with --thresholds it is refused."""
    out = tmp_path / "o"
    base = ["--model", str(synth_ckpt), "--task", "synthetic", "--limit", "2", "--max-new-tokens", "8",
            "--batch-size", "2", "--out", str(out), "--device", "cpu", "--quiet", "--label", "x"]
    assert ev.main(base + ["--threshold", "0.8"]) == 0
    capsys.readouterr()
    assert [p["threshold"] for p in json.loads((out / "x.synthetic.json").read_text())["points"]] == [0.8]
    before = (out / "x.synthetic.json").read_bytes()
    assert ev.main(base + ["--threshold", "0.8", "--thresholds", "0.5,0.9"]) == 2
    _one_error_line(capsys, "--threshold 0.8 and --thresholds 0.5,0.9: eval decodes at each of --thresholds")
    assert ev.main(base + ["--threshold", "1.5"]) == 2
    _one_error_line(capsys, "--threshold: values must be in [0, 1], got [1.5]")
    assert (out / "x.synthetic.json").read_bytes() == before
    helptext = " ".join(ev.build_parser().format_help().split())
    assert "--threshold THRESHOLD one threshold to decode at: the same as --thresholds T" in helptext


def test_evaluate_refuses_a_block_size_below_one(synth_ckpt):
    task = SyntheticArithmetic()
    model, _ = load_model(synth_ckpt)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        ev.evaluate(model, task.tokenizer, task, task.test[:1], [0.9], _cfg(task.tokenizer, block_size=0))


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib is not installed")
def test_plot_curves_draws_the_points_sorted_with_the_shared_aup(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figs = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figs.append(fig), real_close(fig)))
    runs = [{"label": "a", "aup": 10.0, "aup_shared": 7.25, "sampler": {"block_size": 4},
             "points": [{"threshold": 0.5, "accuracy": 0.4, "mean_tpf": 3.0},
                        {"threshold": 0.9, "accuracy": 0.5, "mean_tpf": 1.5}]},
            {"label": "b", "aup": 20.0, "points": [{"threshold": 0.9, "accuracy": 0.7, "mean_tpf": 2.0}]}]
    assert ev.plot_curves(runs, tmp_path / "c.png")
    ax = figs[0].axes[0]
    lines = ax.get_lines()
    assert [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in lines] == [([1.5, 3.0], [50.0, 40.0]),
                                                                              ([2.0], [70.0])]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a b4 (AUP 7.2)", "b (AUP 20.0)"]
    assert ax.get_ylim() == pytest.approx((40 - 3, 70 + 3))  # margin max(2, 10% of 30)
    assert ax.get_xlim()[0] == 0


def test_results_are_written_through_a_hidden_sibling(tmp_path, monkeypatch):
    """The temporary file of an atomic write is a hidden file in the target's own folder (a rename across file
    systems is not atomic, or fails), named per writer."""
    from lightningrl_fast import _jsonfile

    target = tmp_path / "x.synthetic.json"
    a, b = _jsonfile.temp_sibling(target), _jsonfile.temp_sibling(target)
    assert a.parent == target.parent and a.name.startswith(".x.synthetic.json.tmp-") and a != b
    moved = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (moved.append(Path(src)), real(src, dst)))
    ev.write_text_atomic(target, "{}\n")
    assert target.read_text() == "{}\n" and [m.parent for m in moved] == [tmp_path]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.synthetic.json"]
