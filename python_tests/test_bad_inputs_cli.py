"""Bad input to the generate / eval command lines: each case ends in one `error:` line naming the problem and
exit status 2 (no traceback, no hang, no lost file), checked before the model decodes anything.

Every test here was a defect: a traceback from deep inside (safetensors, the tokenizer files, the sampler,
`open`), a silently different run (a negative threshold, a "false" string read as true, a prompt split at
U+2028), a run far past the model's positions (a block size above them; out of memory when large) or lost
data (`--out` equal to `--prompts`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lightningrl_fast import eval as ev
from lightningrl_fast import generate as gen
from lightningrl_fast.checkpoint import save_model
from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.tasks.synthetic import SyntheticArithmetic
from lightningrl_fast.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread, restored after


def _save(tok, folder: Path, max_pos: int) -> Path:
    cfg = SDARConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=4,
                     mask_token_id=tok.mask_token_id, torch_dtype="float32", max_position_embeddings=max_pos)
    save_model(build_model(cfg, dtype=torch.float32, seed=0), cfg, folder, tokenizer=tok)
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny random SDAR checkpoint with a CharTokenizer (ChatML text encodes)."""
    return _save(CharTokenizer(), tmp_path_factory.mktemp("tiny") / "ckpt", max_pos=256)


@pytest.fixture(scope="module")
def synth_ckpt(tmp_path_factory) -> Path:
    return _save(SyntheticArithmetic().tokenizer, tmp_path_factory.mktemp("synth") / "base", max_pos=128)


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ckpt, tmp_path / "model"))


def _prompts(tmp_path: Path, rows=({"prompt": "1+2?"},)) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _gen(ckpt: Path, prompts: Path, *extra: str, out: Path | None = None) -> list[str]:
    return ["--model", str(ckpt), "--prompts", str(prompts), "--device", "cpu", "--quiet", "--max-new-tokens", "8",
            *(["--out", str(out)] if out is not None else []), *extra]


def _fails(main, argv, capsys, *named: str) -> str:
    """`main(argv)` exits with status 2 and one `error:` line that contains every string of `named`."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for s in named:
        assert s in err, (s, err)
    return err


# ------------------------------------------------------------------------------------------------------------
# generate: output file
# ------------------------------------------------------------------------------------------------------------

def test_generate_out_in_a_missing_folder(ckpt, tmp_path, capsys):
    """Was a FileNotFoundError traceback from `open`, after the model had loaded."""
    out = tmp_path / "no" / "such" / "o.jsonl"
    _fails(gen.main, _gen(ckpt, _prompts(tmp_path), out=out), capsys, "--out", "does not exist")
    assert not out.parent.exists()


def test_generate_out_equal_to_the_prompts_file_keeps_the_prompts(ckpt, tmp_path, capsys):
    """Was accepted: the prompts file was truncated by `open(out, "w")` and replaced by the results."""
    prompts = _prompts(tmp_path, [{"prompt": "1+2?"}, {"prompt": "3+4?"}])
    before = prompts.read_text()
    _fails(gen.main, _gen(ckpt, prompts, out=prompts), capsys, "is the prompts file")
    same_via_dotdot = prompts.parent / "x" / ".." / prompts.name
    (prompts.parent / "x").mkdir()
    _fails(gen.main, _gen(ckpt, prompts, out=same_via_dotdot), capsys, "is the prompts file")
    assert prompts.read_text() == before


# ------------------------------------------------------------------------------------------------------------
# generate: numeric options
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, named", [
    (["--threshold", "-1"], "--threshold must be a finite confidence >= 0, got -1.0"),  # a sign slip, run as 0
    (["--threshold", "nan"], "--threshold must be a finite confidence >= 0, got nan"),  # sampler traceback
    (["--threshold", "inf"], "--threshold must be a finite confidence >= 0, got inf"),  # sampler traceback
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),      # sampler traceback
    (["--temperature", "inf"], "--temperature must be a finite number, got inf"),      # sampler traceback
    (["--seed", str(10**23)], "--seed must be in [-2**62, 2**62)"),                   # OverflowError traceback
    (["--seed", str(-10**20)], "--seed must be in [-2**62, 2**62)"),                  # OverflowError traceback
    (["--block-size", "300"], "--block-size 300 exceeds the model's max_position_embeddings 256"),
])
def test_generate_out_of_range_numbers(ckpt, tmp_path, capsys, extra, named):
    out = tmp_path / "o.jsonl"
    _fails(gen.main, _gen(ckpt, _prompts(tmp_path), *extra, out=out), capsys, named)
    assert not out.exists()


def test_generate_threshold_above_one_is_allowed(ckpt, tmp_path):
    """Above 1 no confidence passes: SDAR's quota rule alone (what profiling/bench_decode.py runs with 1.01)."""
    out = tmp_path / "o.jsonl"
    assert gen.main(_gen(ckpt, _prompts(tmp_path), "--rule", "quota", "--threshold", "1.01", out=out)) == 0
    assert len(out.read_text().splitlines()) == 1


# ------------------------------------------------------------------------------------------------------------
# generate: prompts files
# ------------------------------------------------------------------------------------------------------------

def test_line_separators_inside_a_row_do_not_split_it(ckpt, tmp_path):
    """`str.splitlines` also split at U+2028, U+0085 and form feeds: a valid JSONL row holding one (json.dumps
    with ensure_ascii=False writes them raw) became two malformed rows, and a .txt line two prompts."""
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a\u2028b\x0cc\x85d", "id": 1}, ensure_ascii=False) + "\r\n"
                     + json.dumps({"prompt": "e"}) + "\n", encoding="utf-8")
    rows = gen.read_prompts(jsonl)
    assert [(r.text, r.line) for r in rows] == [("a\u2028b\x0cc\x85d", 1), ("e", 2)]
    txt = tmp_path / "p.txt"
    txt.write_bytes("one\x0cprompt\u2028here\r\ntwo\rthree\n".encode())
    assert [(r.text, r.line) for r in gen.read_prompts(txt)] == [("one\x0cprompt\u2028here", 1), ("two", 2),
                                                                 ("three", 3)]


def test_rows_python_json_cannot_hold_are_named_by_line(ckpt, tmp_path, capsys):
    """NaN ids were echoed into the output as `NaN` (not JSON); a > 4300-digit integer or deep nesting raised a
    bare ValueError / RecursionError (a traceback) instead of a `file:line` error."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+2?", "id": NaN}\n'
                    '{"prompt": "1+2?", "id": ' + "9" * 5000 + "}\n"
                    '{"prompt": "1+2?", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
                    '{"prompt": "1+2?", "id": -Infinity}\n', encoding="utf-8")
    err = _fails(gen.main, _gen(ckpt, path), capsys, "4 malformed prompt row(s)")
    for line in (1, 2, 3, 4):
        assert f"p.jsonl:{line}: not valid JSON" in err
    assert "NaN is not valid JSON" in err and "-Infinity is not valid JSON" in err


# ------------------------------------------------------------------------------------------------------------
# generate: broken checkpoint folders
# ------------------------------------------------------------------------------------------------------------

def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("change, named", [
    ({"rms_norm_eps": "1e-6"}, "'rms_norm_eps' must be a positive finite number"),          # TypeError traceback
    ({"rope_theta": "abc"}, "'rope_theta' must be a positive finite number"),               # TypeError traceback
    ({"max_position_embeddings": "256"}, "'max_position_embeddings' must be a positive integer"),  # TypeError
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be bool"),                # a tied model, silently
])
def test_generate_config_values_of_the_wrong_type(ckpt, tmp_path, capsys, change, named):
    model = _copy(ckpt, tmp_path)
    _edit_json(model / "config.json", **change)
    _fails(gen.main, _gen(model, _prompts(tmp_path)), capsys, "config.json", named)


def test_generate_truncated_safetensors(ckpt, tmp_path, capsys):
    """Was safetensors' SafetensorError traceback (not a CLI error)."""
    model = _copy(ckpt, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _fails(gen.main, _gen(model, _prompts(tmp_path)), capsys, "cannot read safetensors file", "model.safetensors")


@pytest.mark.parametrize("name, text, named", [
    ("tokenizer_config.json", "[]", "tokenizer_config.json must hold a JSON object"),  # AttributeError traceback
    ("tokenizer.json", "[]", "tokenizer.json must hold a JSON object"),                # TypeError traceback
])
def test_generate_malformed_tokenizer_files(ckpt, tmp_path, capsys, name, text, named):
    model = _copy(ckpt, tmp_path)
    if name == "tokenizer_config.json":
        (model / "tokenizer.json").unlink()
    (model / name).write_text(text)
    _fails(gen.main, _gen(model, _prompts(tmp_path)), capsys, "cannot load the tokenizer", named)


# ------------------------------------------------------------------------------------------------------------
# eval
# ------------------------------------------------------------------------------------------------------------

def _ev(model: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--task", "synthetic", "--limit", "2", "--thresholds", "0.9", "--max-new-tokens",
            "8", "--device", "cpu", "--quiet", *(["--out", str(tmp_path / "o")] if "--out" not in extra else []),
            *extra]


def test_eval_out_that_is_not_a_folder_fails_before_decoding(synth_ckpt, tmp_path, capsys):
    """Was a FileExistsError / NotADirectoryError traceback after the whole evaluation (its results lost)."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    _fails(ev.main, _ev(synth_ckpt, tmp_path, "--out", str(afile)), capsys, "exists and is not a folder")
    _fails(ev.main, _ev(synth_ckpt, tmp_path, "--out", str(afile / "sub")), capsys, "afile is not a folder")
    assert afile.read_text() == "keep me"


@pytest.mark.parametrize("doc, named", [
    ({"points": [{"accuracy": float("nan"), "mean_tpf": 1.0}]}, "accuracy nan; expected a fraction in [0, 1]"),
    ({"points": [{"accuracy": 50, "mean_tpf": 1.0}]}, "accuracy 50; expected a fraction in [0, 1]"),
    ({"points": [{"accuracy": True, "mean_tpf": 1.0}]}, "lacks numeric"),
    ({"points": [{"accuracy": 0.5, "mean_tpf": 1.0, "threshold": "x"}]}, "non-numeric \"threshold\""),
    ({"points": [{"accuracy": 0.5, "mean_tpf": 1.0}], "label": [1]}, "\"label\" must be a string"),
    ({"points": [{"accuracy": 0.5, "mean_tpf": 1.0}], "sampler": "x"}, "\"sampler\" must be an object"),
])
def test_eval_malformed_overlay_values(synth_ckpt, tmp_path, capsys, doc, named):
    """Each was a ValueError / TypeError / AttributeError traceback from aup or the plot, after the evaluation
    (accuracy True was counted as 1)."""
    overlay = tmp_path / "other.json"
    overlay.write_text(json.dumps(doc))
    _fails(ev.main, _ev(synth_ckpt, tmp_path, "--overlay", str(overlay)), capsys, "other.json", named)
    assert not (tmp_path / "o").exists()


def test_eval_folders_given_as_files_are_named(synth_ckpt, tmp_path, capsys):
    """A folder was reported as `does not exist`."""
    _fails(ev.main, _ev(synth_ckpt, tmp_path, "--data", str(tmp_path)), capsys, "is a folder, not a file")
    _fails(ev.main, _ev(synth_ckpt, tmp_path, "--overlay", str(tmp_path)), capsys, "is a folder, not a results JSON")
    math = ["--model", str(synth_ckpt), "--task", "math", "--data", str(tmp_path), "--quiet"]
    _fails(ev.main, math, capsys, "is a folder, not a data file")


def test_eval_numeric_options(synth_ckpt, tmp_path, capsys):
    _fails(ev.main, _ev(synth_ckpt, tmp_path, "--workers", "0"), capsys, "--workers must be >= 1, got 0")  # was CPU count
    _fails(ev.main, _ev(synth_ckpt, tmp_path, "--block-size", "1000"), capsys,  # was a minute-long run past the positions
           "--block-size 1000 exceeds the model's max_position_embeddings 128")


def test_eval_synthetic_rows_with_line_separators(synth_ckpt, tmp_path):
    """A synthetic JSONL row holding a raw U+2028 in some string was split into two malformed rows."""
    data = tmp_path / "s.jsonl"
    data.write_text(json.dumps({"operands": [1, 2], "note": "a\u2028b"}, ensure_ascii=False) + "\n", encoding="utf-8")
    exs = ev.load_synthetic(data, SyntheticArithmetic())
    assert [e.operands for e in exs] == [(1, 2)]
