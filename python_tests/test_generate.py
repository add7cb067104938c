"""The generate command line (JSONL/txt prompts, ChatML, results rows, errors with file:line) and bench_decode on CPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightningrl_fast
from lightningrl_fast import generate as gen
from lightningrl_fast.checkpoint import save_model
from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.sampler import SamplerConfig, generate
from lightningrl_fast.tokenizer import CharTokenizer, chat_prompt

REPO = Path(__file__).resolve().parents[1]
BLOCK = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread, restored after


def _tiny_config(tok, max_pos=256, block=BLOCK) -> SDARConfig:
    return SDARConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=block,
                      mask_token_id=tok.mask_token_id, torch_dtype="float32", max_position_embeddings=max_pos)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny random SDAR checkpoint with a CharTokenizer (default alphabet: ChatML text encodes). Its lm_head is
    sharpened (x30) so that confidences spread over [0, 1] (a plain random model is never confident: every
    threshold would unmask one token per step), and <|im_end|>'s row copies a token it often picks, so that some
    prompts end on EOS and others run to the length limit."""
    tok = CharTokenizer()
    cfg = _tiny_config(tok)
    folder = tmp_path_factory.mktemp("tiny") / "ckpt"
    model = build_model(cfg, dtype=torch.float32, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
        model.lm_head.weight[tok.special_id("<|im_end|>")] = model.lm_head.weight[21] * 1.02
    save_model(model, cfg, folder, tokenizer=tok)
    return folder


def _env() -> dict:
    """Subprocesses import the same lightningrl_fast as this test process, one thread each."""
    pkg_parent = str(Path(lightningrl_fast.__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=os.pathsep.join([pkg_parent, os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_cli_end_to_end_jsonl(ckpt, tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "1+2?"}), "",
                                            json.dumps({"prompt": "what is 7*8", "id": "q2"}),
                                            json.dumps({"prompt": "hello there"})])
    out = tmp_path / "out.jsonl"
    rc = gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "12",
                   "--batch-size", "2", "--threshold", "0.3", "--device", "cpu", "--quiet"])
    assert rc == 0
    rows = _read_rows(out)
    assert [r["prompt"] for r in rows] == ["1+2?", "what is 7*8", "hello there"]  # input order
    tok = CharTokenizer()
    for r in rows:
        assert {"prompt", "text", "tokens", "token_ids", "tpf", "forwards", "finish_reason"} <= set(r)
        assert r["tokens"] == len(r["token_ids"]) and 1 <= r["tokens"] <= 12
        assert 1.0 <= r["tpf"] <= BLOCK
        assert r["forwards"] >= r["tokens"] / BLOCK  # at most B tokens per forward
        assert r["finish_reason"] in ("eos", "length")
        ids = r["token_ids"][:-1] if r["finish_reason"] == "eos" else r["token_ids"]
        assert r["text"] == tok.decode(ids)
        if r["finish_reason"] == "length":
            assert r["tokens"] == 12
    assert rows[1]["id"] == "q2" and "id" not in rows[0]
    # every field is what the sampler gives for the same batches (2 + 1 prompts, ChatML, tau 0.3, greedy); the
    # setup makes the checks bite: a row ends on EOS, a row runs to the limit, and tau 0.3 unmasks > 1 token/step
    from lightningrl_fast.checkpoint import load_model

    model, _ = load_model(ckpt)
    scfg = SamplerConfig(temperature=0, threshold=0.3, max_new_tokens=12, eos_ids=tuple(sorted(tok.eos_token_ids)))
    prompt_ids = [tok.encode(chat_prompt(r["prompt"])) for r in rows]
    want = []
    for batch in (prompt_ids[:2], prompt_ids[2:]):
        ro = generate(model, batch, scfg)
        for j in range(len(batch)):
            ids = ro.response_ids(j)
            want.append({"token_ids": ids, "tokens": len(ids), "tpf": round(float(ro.tpf[j]), 4),
                         "forwards": int(ro.forwards[j]), "finish_reason": ro.finish_reason[j],
                         "text": tok.decode(ids[:-1] if ro.finish_reason[j] == "eos" else ids)})
    assert [{k: r[k] for k in want[0]} for r in rows] == want
    assert {r["finish_reason"] for r in rows} == {"eos", "length"} and max(r["tpf"] for r in rows) > 1
    for r in rows:  # TPF = tokens / distinct unmasking steps: here at most 12 tokens in at most 12 steps
        assert r["tokens"] / r["tpf"] == pytest.approx(round(r["tokens"] / r["tpf"]), abs=1e-3)
    eos_row = next(r for r in rows if r["finish_reason"] == "eos")
    assert eos_row["token_ids"][-1] == tok.special_id("<|im_end|>") and "<|im_end|>" not in eos_row["text"]
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "forwards/s" in printed and "mean TPF" in printed
    # bandwidth use: weight bytes per forward x forwards / s (the forwards and seconds of the printed summary)
    m = re.search(r"weights streamed ([0-9.e+-]+) GB/s \(([0-9.e+-]+) GB per forward", printed)
    assert m, printed
    model = build_model(SDARConfig.from_dict(json.loads((ckpt / "config.json").read_text())))
    assert float(m.group(2)) == pytest.approx(model.forward_weight_bytes() / 1e9, rel=1e-3)
    fwd_s = float(re.search(r"forwards/s ([0-9.]+)", printed).group(1))
    assert float(m.group(1)) == pytest.approx(fwd_s * model.forward_weight_bytes() / 1e9, rel=0.02)
    assert "% of the device copy bandwidth" not in printed  # measured on a GPU only
    mean_tpf = float(re.search(r"mean TPF ([0-9.]+)", printed).group(1))
    assert mean_tpf == pytest.approx(sum(r["tpf"] for r in rows) / 3, abs=1e-3)


def test_cli_matches_the_sampler_and_is_deterministic(ckpt, tmp_path):
    prompts = _write(tmp_path / "p.txt", ["3+4?", "  ", "abc"])  # .txt: one prompt a line, blank lines skipped
    outs = []
    for k in range(2):
        out = tmp_path / f"o{k}.jsonl"
        assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--no-chat",
                         "--max-new-tokens", "8", "--device", "cpu", "--quiet"]) == 0
        outs.append(_read_rows(out))
    assert outs[0] == [dict(r) for r in outs[1]]
    from lightningrl_fast.checkpoint import load_model

    model, _ = load_model(ckpt)
    tok = CharTokenizer()
    ro = generate(model, [tok.encode("3+4?"), tok.encode("abc")],
                  SamplerConfig(temperature=0, threshold=0.9, max_new_tokens=8, eos_ids=tuple(sorted(tok.eos_token_ids))))
    assert [r["token_ids"] for r in outs[0]] == [ro.response_ids(0), ro.response_ids(1)]


def test_cli_stdout_when_no_out_and_chat_template(ckpt, tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"})])
    assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--max-new-tokens", "4", "--quiet"]) == 0
    cap = capsys.readouterr()
    rows = [json.loads(x) for x in cap.out.splitlines()]
    assert len(rows) == 1 and rows[0]["prompt"] == "hi"
    assert "tokens/s" in cap.err  # the summary moves to stderr
    # --chat encodes the ChatML template around the prompt
    rows_ = gen.read_prompts(prompts)
    ids, _ = gen.encode_prompts(rows_, CharTokenizer(), prompts, True, 10**6, 10**6, 4, -1, block_size=BLOCK)
    assert ids[0] == CharTokenizer().encode(chat_prompt("hi"))


def test_prompts_files_may_start_with_a_byte_order_mark(tmp_path):
    j = tmp_path / "p.jsonl"
    j.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "hi", "id": 3}).encode() + b"\n")
    t = tmp_path / "p.txt"
    t.write_bytes(b"\xef\xbb\xbfhello\n")
    assert [(r.text, r.id) for r in gen.read_prompts(j)] == [("hi", 3)]
    assert [r.text for r in gen.read_prompts(t)] == ["hello"]


def test_errors_missing_model_and_prompts(ckpt, tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "x"})])
    assert gen.main(["--model", str(tmp_path / "nope"), "--prompts", str(prompts)]) == 2
    assert "model folder" in capsys.readouterr().err
    assert gen.main(["--model", str(ckpt), "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl" in err and "does not exist" in err
    empty = _write(tmp_path / "e.jsonl", ["", "  "])
    assert gen.main(["--model", str(ckpt), "--prompts", str(empty)]) == 2
    assert "no prompts" in capsys.readouterr().err


def test_bad_rows_are_named_by_file_and_line_before_the_model_loads(ckpt, tmp_path, capsys):
    # a folder with the config and tokenizer but NO weights: the prompt errors must come first
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((ckpt / name).read_bytes())
    bad = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok"}), "{not json", json.dumps([1, 2]),
                                          json.dumps({"text": "x"}), json.dumps({"prompt": 5}),
                                          json.dumps({"prompt": "   "})])
    assert gen.main(["--model", str(broken), "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err
    for line in (2, 3, 4, 5, 6):
        assert f"{bad}:{line}:" in err
    assert f"{bad}:1:" not in err
    # rows that parse but cannot be tokenized / are too long: still file:line, still before loading
    odd = _write(tmp_path / "odd.jsonl", [json.dumps({"prompt": "fine"}), json.dumps({"prompt": "UPPER CASE"}),
                                          json.dumps({"prompt": "a" * 300})])
    assert gen.main(["--model", str(broken), "--prompts", str(odd), "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert f"{odd}:2: cannot tokenize (try --no-chat)" in err and "'U'" in err
    assert f"{odd}:3:" in err and "max_position_embeddings" in err
    # with good prompts, the same folder fails at the model load, with a clear message
    good = _write(tmp_path / "good.jsonl", [json.dumps({"prompt": "fine"})])
    assert gen.main(["--model", str(broken), "--prompts", str(good), "--max-new-tokens", "8"]) == 2
    assert "cannot load the model" in capsys.readouterr().err


def test_bad_options(ckpt, tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "x"})])
    base = ["--model", str(ckpt), "--prompts", str(prompts)]
    for extra, msg in ((["--batch-size", "0"], "--batch-size"), (["--max-new-tokens", "0"], "--max-new-tokens"),
                       (["--top-p", "0"], "--top-p"), (["--dtype", "int8"], "--dtype"),
                       (["--block-size", "-4"], "--block-size")):
        assert gen.main(base + extra) == 2, extra
        assert msg in capsys.readouterr().err


def test_block_size_override_sets_and_restores_the_attention_block(ckpt, tmp_path):
    from lightningrl_fast.checkpoint import load_model

    model, _ = load_model(ckpt)
    with gen.decode_block_size(model, 8):
        assert model.config.block_size == 8
    assert model.config.block_size == BLOCK
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "12+3?"})])
    out = tmp_path / "o.jsonl"
    assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--block-size", "8",
                     "--threshold", "0.3", "--max-new-tokens", "16", "--quiet"]) == 0
    row = _read_rows(out)[0]
    # the same decode with the model's own attention block set to 8 (what the override must amount to)
    tok = CharTokenizer()
    model.config.block_size = 8
    ro = generate(model, [tok.encode(chat_prompt("12+3?"))],
                  SamplerConfig(block_size=8, threshold=0.3, temperature=0, max_new_tokens=16,
                                eos_ids=tuple(sorted(tok.eos_token_ids))))
    assert row["token_ids"] == ro.response_ids(0)


def test_module_entry_point_subprocess(ckpt, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "1+1?"})])
    out = tmp_path / "o.jsonl"
    proc = subprocess.run([sys.executable, "-m", "lightningrl_fast.generate", "--model", str(ckpt), "--prompts",
                           str(prompts), "--out", str(out), "--max-new-tokens", "4", "--quiet"],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(_read_rows(out)) == 1 and "tokens/s" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "lightningrl_fast.generate", "--model", str(ckpt), "--prompts",
                          str(tmp_path / "none.jsonl")], capture_output=True, text=True, env=_env(), timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr


def test_bench_decode_cpu_tiny_final_json_line():
    script = REPO / "profiling" / "bench_decode.py"
    proc = subprocess.run([sys.executable, str(script), "--cpu", "--batches", "1,2", "--blocks", "4",
                           "--new-tokens", "8", "--tpf", "2"], capture_output=True, text=True, env=_env(),
                          timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "tiny" in proc.stdout and "CPU" in proc.stdout  # it says what it ran
    result = json.loads(lines[-1])
    assert result["bench"] == "decode" and result["config"] == "tiny" and result["copy_gbs"] > 0
    assert [(r["batch"], r["block"]) for r in result["rows"]] == [(1, 4), (2, 4)]
    for r in result["rows"]:
        assert r["impl"] == "reference" and r["graphs"] == "off"
        assert r["tpf"] == 2.0  # the forced TPF
        assert r["fwd"] == 1 + 8 // 2  # prefill + one forward per 2 tokens
        assert r["tok/s"] > 0 and r["fwd/s"] > 0 and r["bound"] > 0
        assert 0 < r["%bw"] < 100 and r["GB/fwd"] > 0
        assert r["attn"] == r["gemm"] == r["pdl"] == "-"  # kernel-only switches: not applied to reference rows
    bad = subprocess.run([sys.executable, str(script), "--cpu", "--pdl", "maybe"], capture_output=True, text=True,
                         env=_env(), timeout=300, cwd=str(REPO))
    assert bad.returncode == 2 and "PDL modes must be among on, off" in bad.stderr
    assert sum(line.startswith("{") for line in lines) == 1  # ONE JSON line
    assert result["ragged"] is False and all(r["pack"] == "auto" for r in result["rows"])


def test_bench_decode_pack_modes_and_ragged_prompts():
    """--pack times each mode (a row each, the same forwards); --ragged spreads the prompt lengths over a block, so
    first blocks finish early (forced TPF 4 at block 8: below 4, and the same for every mode)."""
    script = REPO / "profiling" / "bench_decode.py"
    proc = subprocess.run([sys.executable, str(script), "--cpu", "--batches", "3", "--blocks", "8", "--new-tokens",
                           "16", "--tpf", "4", "--pack", "on,off", "--ragged", "--no-steady"], capture_output=True,
                          text=True, env=_env(), timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ragged"] is True and [r["pack"] for r in result["rows"]] == ["on", "off"]
    on, off = result["rows"]
    assert on["fwd"] == off["fwd"] and on["tpf"] == off["tpf"] < 4
    bad = subprocess.run([sys.executable, str(script), "--cpu", "--pack", "sometimes"], capture_output=True, text=True,
                         env=_env(), timeout=300, cwd=str(REPO))
    assert bad.returncode == 2 and "pack modes must be among auto, on, off" in bad.stderr


@pytest.mark.gpu
def test_gpu_cli_prints_the_bandwidth_use(ckpt, tmp_path, capsys):
    from lightningrl_fast.profiling import copy_bandwidth_gbs

    bw = copy_bandwidth_gbs(torch.device("cuda"))
    assert bw is not None and 50 < bw < 20000  # GB/s, read + written: any current GPU
    prompts = _write(tmp_path / "p.txt", ["1+2?", "hello"])
    rc = gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                   "--max-new-tokens", "8", "--device", "cuda", "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    m = re.search(r"weights streamed [0-9.e+-]+ GB/s .* = ([0-9.]+)% of the device copy bandwidth \(([0-9]+) GB/s\)",
                  printed)
    assert m, printed
    assert float(m.group(1)) >= 0 and float(m.group(2)) > 50


# ------------------------------------------------------------------------------------------------------------
# bad input found by the audit: each case below was a traceback, a crash or lost data
# ------------------------------------------------------------------------------------------------------------

def _no_weights(ckpt: Path, folder: Path, **config: object) -> Path:
    """A copy of the checkpoint's config (with `config` changes) and tokenizer, WITHOUT weights: a run on it that
    gets to "cannot load the model" passed every up-front check."""
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((ckpt / name).read_bytes())
    cfg = json.loads((ckpt / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def _one_line_error(err: str, *named: str) -> None:
    assert err.startswith("error: ") and "Traceback" not in err, err
    for s in named:
        assert s in err, (s, err)


def test_out_inside_the_model_folder_is_refused_and_the_checkpoint_kept(ckpt, tmp_path, capsys):
    """Was accepted: --out M/config.json replaced the checkpoint's config (the next run could not read it), and
    --out M/model.safetensors truncated the weights the loader had mmapped (a bus error, exit 135)."""
    model = Path(shutil.copytree(ckpt, tmp_path / "model"))
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"})])
    (tmp_path / "link.json").symlink_to(model / "config.json")
    (tmp_path / "alias").symlink_to(model)
    for out in (model / "config.json", tmp_path / "link.json", tmp_path / "alias" / "new.jsonl",
                model / "sub" / ".." / "new.jsonl"):
        (model / "sub").mkdir(exist_ok=True)
        assert gen.main(["--model", str(model), "--prompts", str(prompts), "--out", str(out), "--quiet",
                         "--max-new-tokens", "4"]) == 2, out
        _one_line_error(capsys.readouterr().err, f"--out {out} is inside the model folder")
        (model / "sub").rmdir()
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
    # the mmapped weights: in a subprocess (the old code died of SIGBUS)
    proc = subprocess.run([sys.executable, "-m", "lightningrl_fast.generate", "--model", str(model), "--prompts",
                           str(prompts), "--out", str(model / "model.safetensors"), "--quiet", "--max-new-tokens",
                           "4"], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    _one_line_error(proc.stderr, "is inside the model folder")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def _fail_on_batch(monkeypatch, k: int, exc: BaseException) -> None:
    """decode_texts raises `exc` on its k-th call (1-based): a late error or a Ctrl-C after k - 1 batches."""
    real, calls = gen.decode_texts, []

    def decode(*a, **kw):
        calls.append(1)
        if len(calls) == k:
            raise exc
        return real(*a, **kw)

    monkeypatch.setattr(gen, "decode_texts", decode)


@pytest.mark.parametrize("exc, status, named", [
    (ValueError("the sampler refused"), 2, "the sampler refused"),
    (KeyboardInterrupt(), 130, "error: interrupted (Ctrl-C)"),
])
def test_a_late_error_or_ctrl_c_keeps_the_old_out_and_the_rows_so_far(ckpt, tmp_path, capsys, monkeypatch, exc,
                                                                      status, named):
    """Was: --out opened with "w" up front, so an error after the model loaded emptied an existing --out, and
    Ctrl-C left a partial file that looked complete (and a KeyboardInterrupt traceback)."""
    prompts = _write(tmp_path / "p.txt", ["1+2?", "abc", "hello"])
    out = tmp_path / "o.jsonl"
    out.write_text('{"old": "results"}\n')
    _fail_on_batch(monkeypatch, 3, exc)
    try:
        rc = gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--batch-size", "1",
                       "--max-new-tokens", "4", "--quiet", "--no-chat"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main as a KeyboardInterrupt (a traceback)")
    assert rc == status
    err = capsys.readouterr().err
    partial = tmp_path / "o.jsonl.partial"
    _one_line_error(err, named, f"the 2 row(s) written so far are in {partial}", f"{out} is left as it was")
    assert len(err.strip().splitlines()) == 1
    assert out.read_text() == '{"old": "results"}\n'
    assert [r["prompt"] for r in _read_rows(partial)] == ["1+2?", "abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl", "o.jsonl.partial", "p.txt"]  # no temp file
    # the same run, uninterrupted: --out replaced whole (its mode kept), no temporary file left
    monkeypatch.undo()
    out.chmod(0o640)
    assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--batch-size", "1",
                     "--max-new-tokens", "4", "--quiet", "--no-chat"]) == 0
    assert [r["prompt"] for r in _read_rows(out)] == ["1+2?", "abc", "hello"] and out.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl", "o.jsonl.partial", "p.txt"]


def test_an_error_before_any_row_leaves_no_file(ckpt, tmp_path, capsys, monkeypatch):
    prompts = _write(tmp_path / "p.txt", ["1+2?"])
    out = tmp_path / "o.jsonl"
    _fail_on_batch(monkeypatch, 1, ValueError("no memory for this batch"))
    assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--quiet",
                     "--max-new-tokens", "4"]) == 2
    _one_line_error(capsys.readouterr().err, "cannot decode batch 1 of 1: no memory for this batch",
                    "no row was written", "was not created")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_out_may_be_a_device(ckpt, tmp_path, capsys):
    """An --out that is not a regular file (/dev/null, a pipe) is written directly, not renamed over. Tested on a
    named pipe of the test's own: with the check broken, a test on /dev/null run as root replaced the machine's
    /dev/null with a regular file (found by a mutation run)."""
    import stat

    prompts = _write(tmp_path / "p.txt", ["1+2?"])
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so that the writer's open does not wait
    try:
        assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(fifo), "--quiet",
                         "--max-new-tokens", "4"]) == 0
        data = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    assert f"wrote {fifo}" in capsys.readouterr().out and stat.S_ISFIFO(fifo.stat().st_mode)
    assert [json.loads(x)["prompt"] for x in data.decode().splitlines()] == ["1+2?"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.fifo", "p.txt"]  # no temporary file left


def test_unpaired_surrogates_are_refused_by_line_before_loading(ckpt, tmp_path, capsys):
    """Was: `TypeError: TextInputSequence must be str` from a BPE tokenizer for a "\\ud800" in the prompt, or a
    UnicodeEncodeError writing the output row for one in the id (after the earlier rows had been written)."""
    broken = _no_weights(ckpt, tmp_path / "noweights")
    rows = [json.dumps({"prompt": "ab", "id": 1}), json.dumps({"prompt": "cd", "id": "\ud800"}),
            json.dumps({"prompt": "e\udc00f"}), json.dumps({"prompt": "gh", "id": {"k": ["x", "\udfff"]}}),
            json.dumps({"prompt": "paired \U0001F600 is fine"})]
    assert '"\\ud800"' in rows[1]  # the file holds the JSON escape
    prompts = _write(tmp_path / "p.jsonl", rows)
    assert gen.main(["--model", str(broken), "--prompts", str(prompts), "--no-chat"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 3 malformed prompt row(s)") and "Traceback" not in err, err
    assert f'{prompts}:2: "id" holds an unpaired surrogate \\ud800' in err
    assert f'{prompts}:3: "prompt" holds an unpaired surrogate \\udc00' in err
    assert f'{prompts}:4: "id" holds an unpaired surrogate \\udfff' in err
    assert f"{prompts}:1:" not in err and f"{prompts}:5:" not in err
    assert gen.unpaired_surrogate("\U0001F600") is None and gen.unpaired_surrogate(["\ud83d"]) == "\\ud83d"


@pytest.mark.parametrize("extra, config", [
    (["--block-size", "3"], {}),   # 23 + 233 = 256 positions, but blocks of 3 end at 258
    ([], {"block_size": 5}),       # the checkpoint's own block size: blocks of 5 end at 260
])
def test_the_last_block_must_end_within_the_positions(ckpt, tmp_path, capsys, extra, config):
    """Was: the prompt passed the check (prompt + max_new_tokens fit in 256 positions), the model loaded, and the
    sampler raised a ValueError traceback: the last block, aligned at position 0, ended past the positions."""
    broken = _no_weights(ckpt, tmp_path / "noweights", **config)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "1+2?"})])  # 23 tokens with ChatML
    assert gen.main(["--model", str(broken), "--prompts", str(prompts), "--max-new-tokens", "233", *extra]) == 2
    block = int(extra[1]) if extra else config["block_size"]
    _one_line_error(capsys.readouterr().err, f"{prompts}:1: the prompt does not fit: 23 prompt tokens + max_new_tokens 233: with block_size "
                    f"{block} the last block ends at position {-(-256 // block) * block}, past the model's "
                    "max_position_embeddings 256")
    # one token less fits the positions with blocks of 4: the same folder gets to the model load
    assert gen.main(["--model", str(broken), "--prompts", str(prompts), "--max-new-tokens", "233",
                     "--block-size", "4"]) == 2
    assert "cannot load the model" in capsys.readouterr().err


def test_a_checkpoint_block_size_past_its_positions_is_refused_before_loading(ckpt, tmp_path, capsys):
    """Was: a ValueError traceback from the sampler for every prompt, after the model had loaded."""
    broken = _no_weights(ckpt, tmp_path / "noweights", block_size=1000)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"})])
    assert gen.main(["--model", str(broken), "--prompts", str(prompts), "--max-new-tokens", "8"]) == 2
    _one_line_error(capsys.readouterr().err, f"{broken / 'config.json'}: block_size 1000 exceeds "
                    "max_position_embeddings 256", "--block-size")
    assert gen.main(["--model", str(broken), "--prompts", str(prompts), "--max-new-tokens", "8",
                     "--block-size", "4"]) == 2  # overridden
    assert "cannot load the model" in capsys.readouterr().err


@pytest.mark.parametrize("extra, named", [
    (["--temperature", "1e-45"], "--temperature 1e-45 is out of the float32 range"),   # ValueError, after loading
    (["--temperature", "1e300"], "--temperature 1e+300 is out of the float32 range"),  # ValueError, after loading
    (["--rule", "quota", "--steps-per-block", str(2**70)],
     "--steps-per-block must be in [1, 2**31 - 1]"),                                   # OverflowError, after loading
    (["--device", "mps"], "--device mps: only cpu and cuda devices are supported"),   # RuntimeError from torch
    (["--device", "meta"], "--device meta: only cpu and cuda devices are supported"),  # NotImplementedError
])
def test_bad_options_are_refused_before_loading(ckpt, tmp_path, capsys, extra, named):
    broken = _no_weights(ckpt, tmp_path / "noweights")  # "cannot load the model" if the check came too late
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"})])
    assert gen.main(["--model", str(broken), "--prompts", str(prompts), "--max-new-tokens", "4", *extra]) == 2
    _one_line_error(capsys.readouterr().err, named)


class _ClosedPipe:
    """A stdout whose reader has gone (`| head -c 10`)."""

    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_stdout_closed_early_exits_quietly(ckpt, tmp_path, capsys, monkeypatch):
    """Was a BrokenPipeError traceback."""
    prompts = _write(tmp_path / "p.txt", ["1+2?", "abc"])
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--max-new-tokens", "4", "--quiet"]) == 141
    monkeypatch.undo()
    assert capsys.readouterr().err == ""
    # the real thing: a pipe closed after 10 bytes, while rows are still coming
    many = _write(tmp_path / "many.txt", [f"{i}+{i}?" for i in range(1000)])  # > a 64 KiB pipe buffer of rows
    proc = subprocess.Popen([sys.executable, "-m", "lightningrl_fast.generate", "--model", str(ckpt), "--prompts",
                             str(many), "--max-new-tokens", "8", "--batch-size", "1", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert err == "", err


def _run_folder(tmp_path: Path, ckpt: Path, steps: tuple[int, ...], latest: str | None) -> Path:
    """A training run's output folder: its run config.json, checkpoint-<step> folders (model files + trainer
    state), a `latest` file."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run": {"out": str(run)}, "data": {"task": "math"}, "rl": {}}))
    for s in steps:
        shutil.copytree(ckpt, run / f"checkpoint-{s}")
        (run / f"checkpoint-{s}" / "trainer_state.pt").write_bytes(b"state")
    if latest is not None:
        (run / "latest").write_text(latest)
    return run


def test_a_run_folder_stands_for_its_latest_checkpoint(ckpt, tmp_path, capsys):
    """Was: "cannot read run/config.json: missing required key(s) 'vocab_size', ..." for a run folder without a
    `latest` file (a run that never saved one, or whose `latest` was lost)."""
    run = _run_folder(tmp_path, ckpt, (1, 3), latest=None)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"})])
    assert gen.check_model_dir(run) == run / "checkpoint-3"
    out = tmp_path / "o.jsonl"
    assert gen.main(["--model", str(run), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4"]) == 0
    assert len(_read_rows(out)) == 1
    assert f"--model {run} is a training run folder: decoding its latest checkpoint {run / 'checkpoint-3'}" in (
        capsys.readouterr().err)
    (run / "latest").write_text("checkpoint-1")
    assert gen.check_model_dir(run) == run / "checkpoint-1"
    # --out inside the run folder or its checkpoint: refused as inside the model folder
    for bad in (run / "results.jsonl", run / "checkpoint-1" / "config.json"):
        assert gen.main(["--model", str(run), "--prompts", str(prompts), "--out", str(bad), "--quiet"]) == 2
        _one_line_error(capsys.readouterr().err, "is inside the model folder")
    (run / "latest").write_text("checkpoint-9")  # a `latest` naming a checkpoint that is gone
    assert gen.main(["--model", str(run), "--prompts", str(prompts)]) == 2
    _one_line_error(capsys.readouterr().err, f"--model {run}: a run folder whose latest checkpoint cannot be found",
                    f"its newest complete checkpoint is {run / 'checkpoint-3'}")


def test_a_run_folder_without_checkpoints_is_named_as_such(ckpt, tmp_path, capsys):
    run = _run_folder(tmp_path, ckpt, (), latest=None)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"})])
    assert gen.main(["--model", str(run), "--prompts", str(prompts)]) == 2
    _one_line_error(capsys.readouterr().err, f"--model {run} is a training run folder with no checkpoint yet")


def test_an_rft_run_folder_stands_for_its_rft_model(ckpt, tmp_path, capsys):
    """Was: "a training run folder with no checkpoint yet" for a finished --baseline rft run, whose one model is
    <run>/rft-model (it writes no checkpoint-<step>)."""
    run = _run_folder(tmp_path, ckpt, (), latest=None)
    shutil.copytree(ckpt, run / "rft-model")
    assert gen.check_model_dir(run) == run / "rft-model"
    (run / "latest").write_text("checkpoint-2")  # a run with a `latest` is an RL run: its checkpoint, not rft-model
    with pytest.raises(gen.CLIError, match="latest checkpoint cannot be found"):
        gen.check_model_dir(run)



def test_a_model_folder_with_a_latest_file_is_a_model(ckpt, tmp_path):
    """A DeepSpeed / HF Trainer checkpoint-N folder: the model's config.json and weights beside a `latest` file
    (naming its global_stepN). Was: taken for a training run's folder (by `latest` alone) and refused."""
    folder = tmp_path / "checkpoint-500"
    shutil.copytree(ckpt, folder)
    (folder / "latest").write_text("global_step500")
    assert gen.check_model_dir(folder) == folder


def test_mask_token_mismatch_warns(ckpt, tmp_path, capsys):
    """Was silent (train warns): the config's mask_token_id 50 is not the tokenizer's <|MASK|> (3)."""
    broken = _no_weights(ckpt, tmp_path / "noweights", mask_token_id=50)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"})])  # no id 50 ("t") with --no-chat
    argv = ["--prompts", str(prompts), "--no-chat", "--max-new-tokens", "8"]
    assert gen.main(["--model", str(broken), *argv]) == 2  # no weights: stops at the load
    err = capsys.readouterr().err
    assert ("warning: tokenizer mask id 3 != model config mask_token_id 50; the model's is used" in err
            and "cannot load the model" in err), err
    assert gen.main(["--model", str(_no_weights(ckpt, tmp_path / "same")), *argv]) == 2
    assert "warning" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# audit: the summary's numbers against the rows and the sampler, sampled decoding's seeds, the flag checks' edges
# ------------------------------------------------------------------------------------------------------------

def _clock(monkeypatch, tick: float = 1.0) -> None:
    """generate's clock advances `tick` per read: each batch decodes in exactly `tick` seconds."""
    import itertools
    from types import SimpleNamespace

    ticks = itertools.count()
    monkeypatch.setattr(gen, "time", SimpleNamespace(perf_counter=lambda: tick * next(ticks)))


def test_summary_numbers_against_the_rows_and_the_sampler(ckpt, tmp_path, capsys, monkeypatch):
    """tokens (EOS included), engine forwards summed over batches, finish counts, mean TPF, the decode time summed
    over batches, the rates over it, the weight bandwidth and its share of a (stubbed) copy bandwidth."""
    from lightningrl_fast import profiling
    from lightningrl_fast.checkpoint import load_model

    _clock(monkeypatch, 0.5)
    monkeypatch.setattr(profiling, "copy_bandwidth_gbs", lambda device: 1e-4)  # GB/s: a share far above 100%
    texts = ["1+2?", "what is 7*8", "hello there"]
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": t}) for t in texts])
    out = tmp_path / "o.jsonl"
    args = gen.build_parser().parse_args(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out),
                                          "--max-new-tokens", "12", "--batch-size", "2", "--threshold", "0.3",
                                          "--device", "cpu", "--quiet"])
    s = gen.run(args)
    rows = _read_rows(out)
    model, _ = load_model(ckpt)
    tok = CharTokenizer()
    scfg = SamplerConfig(temperature=0, threshold=0.3, max_new_tokens=12, eos_ids=tuple(sorted(tok.eos_token_ids)))
    ids = [tok.encode(chat_prompt(t)) for t in texts]
    ros = [generate(model, b, scfg) for b in (ids[:2], ids[2:])]
    tokens = sum(int(ro.lengths.sum()) for ro in ros)
    forwards = sum(ro.total_forwards for ro in ros)
    tpfs = [float(t) for ro in ros for t in ro.tpf]
    reasons = [r for ro in ros for r in ro.finish_reason]
    assert forwards > max(int(ro.forwards.max()) for ro in ros)  # the engine's forwards, not one row's
    assert tokens == sum(r["tokens"] for r in rows) and tokens != sum(len(r["text"]) for r in rows)
    assert (s["prompts"], s["batches"], s["tokens"], s["forwards"], s["seconds"]) == (3, 2, tokens, forwards, 1.0)
    assert s["finish"] == {"eos": reasons.count("eos"), "length": reasons.count("length")}
    assert s["finish"]["eos"] > 0 and s["finish"]["length"] > 0
    assert s["tokens_per_s"] == pytest.approx(tokens / 1.0) and s["forwards_per_s"] == pytest.approx(forwards / 1.0)
    assert s["mean_tpf"] == pytest.approx(sum(tpfs) / 3, rel=1e-6) and s["block_size"] == BLOCK
    wbytes = model.forward_weight_bytes()
    assert s["weight_gb_per_forward"] == pytest.approx(wbytes / 1e9)
    assert s["weight_gbs"] == pytest.approx(wbytes * forwards / 1.0 / 1e9)
    assert s["copy_gbs"] == 1e-4 and s["bandwidth_use"] == pytest.approx(s["weight_gbs"] / 1e-4)
    assert s["bandwidth_use"] > 10
    printed = capsys.readouterr().out
    assert f"= {100 * s['weight_gbs'] / 1e-4:.1f}% of the device copy bandwidth (0 GB/s)" in printed
    assert f"finish: eos {reasons.count('eos')}, length {reasons.count('length')}" in printed
    # --block-size other than the checkpoint's: the summary says which block size decoded
    out.unlink()
    args = gen.build_parser().parse_args(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out),
                                          "--max-new-tokens", "8", "--block-size", "8", "--device", "cpu", "--quiet"])
    assert gen.run(args)["block_size"] == 8


def test_two_ranks_summary_takes_the_slowest_rank_and_sums_the_rest(ckpt, tmp_path, capsys, monkeypatch):
    """Rank 0 of two (all_gather replaced by the exchange with a scripted rank 1): rank 0 decodes batches 0 and 2,
    rank 1 batch 1; rows in input order; tokens, forwards and TPF over all rows; the decode time of the slowest rank;
    the bandwidth share per GPU."""
    from lightningrl_fast import profiling
    from lightningrl_fast.rl import distributed
    from lightningrl_fast.rl.distributed import DistEnv

    _clock(monkeypatch, 1.0)  # rank 0: two batches, 2 s
    monkeypatch.setattr(profiling, "copy_bandwidth_gbs", lambda device: 100.0)
    theirs = {"prompt": "b", "text": "xy", "tokens": 5, "token_ids": [1, 2, 3, 4, 5], "tpf": 2.5, "forwards": 2,
              "finish_reason": "length"}
    answers = [[theirs], [], (7.0, 11, 2.5, 1)]  # rank 1: its rows per round, then (seconds, forwards, sum tpf, n)
    monkeypatch.setattr(distributed, "all_gather", lambda env, obj: [obj, answers.pop(0)])
    prompts = _write(tmp_path / "p.txt", ["a", "b", "c"])
    out = tmp_path / "o.jsonl"
    args = gen.build_parser().parse_args(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out),
                                          "--max-new-tokens", "4", "--batch-size", "1", "--no-chat", "--quiet"])
    s = gen._generate(args, DistEnv(rank=0, world=2), torch.device("cpu"), ckpt, gen.read_prompts(prompts))
    rows = _read_rows(out)
    assert [r["prompt"] for r in rows] == ["a", "b", "c"] and rows[1] == theirs and not answers
    mine = [rows[0], rows[2]]
    assert s["seconds"] == 7.0 and s["tokens"] == 5 + sum(r["tokens"] for r in mine)
    assert s["tokens_per_s"] == pytest.approx(s["tokens"] / 7.0)
    fwd0 = s["forwards"] - 11
    assert fwd0 >= max(r["forwards"] for r in mine) and s["forwards_per_s"] == pytest.approx(s["forwards"] / 7.0)
    assert s["mean_tpf"] == pytest.approx((2.5 + sum(r["tpf"] for r in mine)) / 3, abs=1e-4)
    assert s["finish"]["length"] == 1 + sum(r["finish_reason"] == "length" for r in mine)
    assert s["bandwidth_use"] == pytest.approx(s["weight_gbs"] / 2 / 100.0)
    assert " per GPU" in capsys.readouterr().out


def test_sampled_decoding_gives_each_batch_its_own_seed(ckpt, tmp_path):
    """--temperature > 0: batch g draws with seed + g (the Philox stream a one-process run uses), so three equal
    prompts in three batches are three draws, as the sampler gives them."""
    from lightningrl_fast.checkpoint import load_model

    prompts = _write(tmp_path / "p.txt", ["1+2?"] * 3)
    out = tmp_path / "o.jsonl"
    assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--no-chat",
                     "--max-new-tokens", "12", "--batch-size", "1", "--temperature", "3", "--seed", "5",
                     "--threshold", "0.5", "--device", "cpu", "--quiet"]) == 0
    model, _ = load_model(ckpt)
    tok = CharTokenizer()
    want = [generate(model, [tok.encode("1+2?")], SamplerConfig(temperature=3.0, seed=5 + g, threshold=0.5,
                                                               max_new_tokens=12,
                                                               eos_ids=tuple(sorted(tok.eos_token_ids))))
            .response_ids(0) for g in range(3)]
    assert len({tuple(w) for w in want}) == 3  # the draws differ: the check bites
    assert [r["token_ids"] for r in _read_rows(out)] == want


def test_sampler_config_takes_every_decoding_flag():
    from lightningrl_fast._cli import sampler_config_from_args

    args = gen.build_parser().parse_args(["--model", "m", "--prompts", "p", "--block-size", "8", "--threshold", "0.7",
                                          "--rule", "quota", "--steps-per-block", "3", "--temperature", "0.8",
                                          "--top-k", "5", "--top-p", "0.9", "--noise", "per_token",
                                          "--max-new-tokens", "17", "--seed", "11", "--no-cuda-graphs",
                                          "--pack", "off"])
    cfg = sampler_config_from_args(args, (2, 7))
    assert (cfg.block_size, cfg.threshold, cfg.rule, cfg.steps_per_block, cfg.temperature, cfg.top_k, cfg.top_p,
            cfg.noise, cfg.max_new_tokens, cfg.eos_ids, cfg.cuda_graphs, cfg.seed, cfg.pack) == (
        8, 0.7, "quota", 3, 0.8, 5, 0.9, "per_token", 17, (2, 7), False, 11, "off")
    assert sampler_config_from_args(gen.build_parser().parse_args(["--model", "m", "--prompts", "p"]), (2,)).pack == \
        "auto"


def test_decoding_flag_checks_at_their_edges():
    """The edges of each range: accepted at the edge, refused just past it."""
    from lightningrl_fast._cli import check_decoding_args

    def args(*extra):
        return gen.build_parser().parse_args(["--model", "m", "--prompts", "p", *extra])

    for ok in (["--threshold", "0"], ["--seed", str(2**62 - 1)], ["--seed", str(-2**62)], ["--block-size", "1"],
               ["--temperature", "0"], ["--steps-per-block", "1"], ["--top-p", "1"]):
        check_decoding_args(args(*ok))
    for bad, named in ((["--seed", str(2**62)], "--seed must be in"), (["--block-size", "0"], "--block-size"),
                       (["--temperature", "-0.5"], "--temperature must be >= 0"),
                       (["--steps-per-block", "0"], "--steps-per-block must be in")):
        with pytest.raises(gen.CLIError, match=named):
            check_decoding_args(args(*bad))



def test_decoding_flags_that_do_nothing_are_said(capsys):
    from lightningrl_fast._cli import check_decoding_args

    def args(*extra):
        return gen.build_parser().parse_args(["--model", "m", "--prompts", "p", *extra])

    check_decoding_args(args("--steps-per-block", "2"))
    check_decoding_args(args("--top-k", "5"))  # generate's default temperature is 0: greedy
    err = capsys.readouterr().err
    assert "warning: --steps-per-block does nothing with --rule threshold" in err
    assert "warning: --top-k / --top-p do nothing with --temperature 0" in err
    check_decoding_args(args("--rule", "quota", "--steps-per-block", "2", "--temperature", "1", "--top-k", "5"))
    assert capsys.readouterr().err == ""


def test_block_size_and_eos_checks_at_their_edges(tmp_path):
    from lightningrl_fast._cli import check_block_size, check_checkpoint_block_size, eos_ids_for

    check_block_size(256, 256)  # a block as wide as the positions fits
    check_checkpoint_block_size(None, 256, 256, tmp_path)
    with pytest.raises(gen.CLIError, match="--block-size 257 exceeds"):
        check_block_size(257, 256)
    with pytest.raises(gen.CLIError, match="block_size 257 exceeds max_position_embeddings 256"):
        check_checkpoint_block_size(None, 257, 256, tmp_path)
    check_checkpoint_block_size(8, 257, 256, tmp_path)  # --block-size given: the config's is not used

    class Tok:
        eos_token_ids = (10, 5, -1, 3)

    assert eos_ids_for(Tok(), 10) == (3, 5)  # ids inside [0, vocab_size), sorted
    Tok.eos_token_ids = (10,)
    with pytest.raises(gen.CLIError, match="no EOS token inside"):
        eos_ids_for(Tok(), 10)


def test_prompt_rows_ids_txt_suffix_and_error_list(tmp_path):
    rows = gen.read_prompts(_write(tmp_path / "p.jsonl", [json.dumps({"prompt": "a", "id": 0}),
                                                          json.dumps({"prompt": "b", "id": ""}),
                                                          json.dumps({"prompt": "c", "id": False})]))
    assert [r.id for r in rows] == [0, "", False]
    assert [r.text for r in gen.read_prompts(_write(tmp_path / "P.TXT", ["{not json}"]))] == ["{not json}"]
    bad = _write(tmp_path / "bad.jsonl", ["[]"] * 11)  # ten listed, one counted
    with pytest.raises(gen.CLIError) as e:
        gen.read_prompts(bad)
    msg = str(e.value)
    assert msg.startswith(f"11 malformed prompt row(s) in {bad}:") and msg.endswith("\n  ... and 1 more")
    assert f"{bad}:10:" in msg and f"{bad}:11:" not in msg


def test_a_json_array_of_prompt_rows_is_read_as_train_and_eval_read_json(ckpt, tmp_path, capsys):
    """Was: a `.json` prompts file holding a JSON array was read line by line as JSONL and reported as malformed
    rows. A `.json` file is one JSON document (an array of rows, {"data": [...]}, or one row) unless it holds one
    object per line; errors name the element, `file[row i]`."""
    rows = [{"prompt": "1+2?", "id": "a"}, {"prompt": "3+4?"}]
    arr = tmp_path / "p.json"
    arr.write_text(json.dumps(rows, indent=2))
    jsonl = _write(tmp_path / "p.jsonl", [json.dumps(r) for r in rows])
    out_a, out_l = tmp_path / "a.jsonl", tmp_path / "l.jsonl"
    common = ["--model", str(ckpt), "--max-new-tokens", "8", "--quiet", "--device", "cpu"]
    assert gen.main(common + ["--prompts", str(arr), "--out", str(out_a)]) == 0
    assert gen.main(common + ["--prompts", str(jsonl), "--out", str(out_l)]) == 0
    capsys.readouterr()
    assert out_a.read_text() == out_l.read_text() and [r.get("id") for r in _read_rows(out_a)] == ["a", None]
    for doc in ({"data": rows}, rows[0]):  # {"data": [...]}, and one row written over several lines
        arr.write_text(json.dumps(doc, indent=2))
        assert [(r.text, r.id) for r in gen.read_prompts(arr)] == [(r["prompt"], r.get("id")) for r in
                                                                   (rows if "data" in doc else rows[:1])]
    _write(arr, [json.dumps(r) for r in rows])  # JSON Lines named .json: still rows by line
    assert [(r.text, r.line, r.location(arr)) for r in gen.read_prompts(arr)] == [("1+2?", 1, f"{arr}:1"),
                                                                                   ("3+4?", 2, f"{arr}:2")]
    # bad elements: each named by its index, before the model loads
    arr.write_text(json.dumps([{"prompt": "ok"}, "bare", {"text": "x"}, {"prompt": 5}, {"prompt": " "},
                               {"prompt": "x", "id": "\ud800"}]))
    with pytest.raises(gen.CLIError) as e:
        gen.read_prompts(arr)
    assert str(e.value).splitlines() == [
        f"5 malformed prompt row(s) in {arr}:",
        f'  {arr}[row 1]: expected a JSON object with a "prompt" string, got str',
        f"  {arr}[row 2]: no \"prompt\" key (keys: ['text'])",
        f'  {arr}[row 3]: "prompt" must be a string, got int',
        f'  {arr}[row 4]: "prompt" is empty',
        f'  {arr}[row 5]: "id" holds an unpaired surrogate \\ud800 (an escape that is not a character: not valid '
        "Unicode text)"]
    broken = _no_weights(ckpt, tmp_path / "noweights")
    arr.write_text(json.dumps([{"prompt": "fine"}, {"prompt": "UPPER"}, {"prompt": "a" * 300}]))
    assert gen.main(["--model", str(broken), "--prompts", str(arr), "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert f"{arr}[row 1]: cannot tokenize (try --no-chat)" in err and f"{arr}[row 2]: the prompt" in err
    assert err.index("[row 1]") < err.index("[row 2]") and "[row 0]" not in err
    # not JSON, or JSON of another form: the file named with the line and column / what it holds
    for text, msg in (
            ('[\n  {"prompt": "a"},\n  {"prompt": }\n]', "not valid JSON (Expecting value at line 3, column 14)"),
            ('[{"prompt": "a", "x": NaN}]', "not valid JSON (NaN is not valid JSON)"),
            ('"just text"', 'expected a JSON array of {"prompt": ...} objects (or {"data": [...]}), got str'),
            ("[]", "no prompts (an empty JSON array)"), ("\n \n", "no prompts (the file is empty or blank)")):
        arr.write_text(text)
        with pytest.raises(gen.CLIError) as e:
            gen.read_prompts(arr)
        assert str(e.value) == f"{arr}: {msg}", text


def test_falsy_ids_are_written_back(ckpt, tmp_path):
    """An "id" of 0 or "" is an id: copied to the output row."""
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "a", "id": 0}),
                                            json.dumps({"prompt": "b", "id": ""}), json.dumps({"prompt": "c"})])
    out = tmp_path / "o.jsonl"
    assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--no-chat",
                     "--max-new-tokens", "4", "--quiet"]) == 0
    assert [r.get("id", "absent") for r in _read_rows(out)] == [0, "", "absent"]


def test_out_checks_nested_folders_partial_file_and_permissions(ckpt, tmp_path, monkeypatch):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"})])
    with pytest.raises(gen.CLIError, match="is inside the model folder"):
        gen.check_out_file(str(model / "sub" / "o.jsonl"), prompts, model_dirs=(model,))
    partial_is_prompts = _write(tmp_path / "o.jsonl.partial", [json.dumps({"prompt": "hi"})])
    with pytest.raises(gen.CLIError, match=r"o\.jsonl\.partial \(where a failed run leaves its rows\) is the prompts"):
        gen.check_out_file(str(tmp_path / "o.jsonl"), partial_is_prompts)
    out = _write(tmp_path / "ro.jsonl", ["old"])
    real = os.access
    # os.access answers True for root whatever the mode bits: the file is made unwritable for the check alone
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == out else real(p, mode))
    with pytest.raises(gen.CLIError, match="the file is not writable"):
        gen.check_out_file(str(out), prompts)


def test_run_folder_detection_keeps_a_checkpoint_with_its_own_config(ckpt, tmp_path):
    """A checkpoint folder whose config.json is a model's (vocab_size) is itself, even with extra keys named like
    a run's sections or with checkpoint-<step> folders inside."""
    from lightningrl_fast.rl.checkpointing import TRAINER_STATE

    model = Path(shutil.copytree(ckpt, tmp_path / "model"))
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "checkpoint": {"note": "x"}}))
    inner = Path(shutil.copytree(ckpt, model / "checkpoint-1"))
    (inner / TRAINER_STATE).write_bytes(b"")
    assert gen.check_model_dir(model) == model
    from lightningrl_fast._cli import split_lines

    assert split_lines("a\r\nb\rc\n\nd") == ["a", "b", "c", "", "d"]  # "\r\n" is one line end


def test_forwards_are_the_engines_not_the_busiest_rows(ckpt, tmp_path, monkeypatch):
    """The summary's forwards (and forwards/s, the bandwidth) count `Rollout.total_forwards`, the forwards the
    engine ran: more than any row took part in when a batch is decoded in chunks (their forwards add up)."""
    real, totals = gen.decode_texts, []

    def decode(*a, **kw):
        ro, texts = real(*a, **kw)
        ro.total_forwards += 100  # as the chunks of a large batch
        totals.append(ro.total_forwards)
        return ro, texts

    monkeypatch.setattr(gen, "decode_texts", decode)
    _clock(monkeypatch, 0.5)
    prompts = _write(tmp_path / "p.txt", ["1+2?", "abc", "hello"])
    args = gen.build_parser().parse_args(["--model", str(ckpt), "--prompts", str(prompts), "--out",
                                          str(tmp_path / "o.jsonl"), "--max-new-tokens", "4", "--batch-size", "2",
                                          "--no-chat", "--quiet"])
    s = gen.run(args)
    assert len(totals) == 2 and s["forwards"] == sum(totals) and s["forwards_per_s"] == pytest.approx(sum(totals))


def test_fitted_max_new_tokens_rule():
    """The default cap: 256, or the room the positions leave after the longest prompt with the last block aligned
    at position 0 (prompt + n <= floor(positions / block) * block); 256 where not even one token fits."""
    assert gen.fitted_max_new_tokens([6, 3], 4096, 8) == 256
    assert gen.fitted_max_new_tokens([6, 3], 256, 8) == 250
    assert gen.fitted_max_new_tokens([6], 260, 8) == 250  # positions 256..259 hold no whole block of 8
    assert gen.fitted_max_new_tokens([255], 256, 8) == 1
    assert gen.fitted_max_new_tokens([256], 256, 8) == 256  # nothing fits: the prompt's own error says why
    assert gen.fitted_max_new_tokens([], 100, 4) == 100


def test_default_max_new_tokens_fits_a_small_models_positions(ckpt, tmp_path, capsys):
    """Was: without --max-new-tokens every prompt of a model with 256 positions failed ("6 prompt tokens +
    max_new_tokens 256 = 262 positions, more than the 256 ..."): the default cap is now what the positions leave
    after the longest prompt, said on stderr; an explicit --max-new-tokens is kept and checked as before."""
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"}), json.dumps({"prompt": "hello there"})])
    longest = len(CharTokenizer().encode(chat_prompt("hello there")))
    out = tmp_path / "o.jsonl"
    assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    fitted = (256 // BLOCK) * BLOCK - longest
    assert f"max_new_tokens {fitted}: what the model's 256 positions leave after the longest prompt ({longest} " \
           f"tokens, block {BLOCK})" in err
    rows = _read_rows(out)
    assert len(rows) == 2 and all(r["tokens"] == len(r["token_ids"]) <= fitted for r in rows)
    assert [r["tokens"] for r in rows if r["finish_reason"] == "length"] == [fitted]  # decoded to the fitted cap
    assert gen.main(["--model", str(ckpt), "--prompts", str(prompts), "--out", str(out), "--quiet",
                     "--max-new-tokens", "256"]) == 2
    assert "max_new_tokens 256" in capsys.readouterr().err


def test_chat_default_follows_what_the_tokenizer_can_encode(tmp_path, capsys):
    """Was: --chat was always the default, so a checkpoint of the embedded default (an arithmetic alphabet without
    the letters of the ChatML template) failed every prompt ("cannot tokenize (try --no-chat)"). Now the default is
    --chat only where the tokenizer encodes the template (SDAR's BPE, a full-alphabet CharTokenizer); an explicit
    --chat is kept and still names the problem."""
    tok = CharTokenizer("0123456789+=,# ?")
    folder = tmp_path / "arith"
    save_model(build_model(_tiny_config(tok), dtype=torch.float32, seed=0), _tiny_config(tok), folder, tokenizer=tok)
    assert gen.can_chat(CharTokenizer()) and not gen.can_chat(tok)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "1+2+3="})])
    out = tmp_path / "o.jsonl"
    assert gen.main(["--model", str(folder), "--prompts", str(prompts), "--out", str(out),
                     "--max-new-tokens", "8"]) == 0
    assert "prompts fed as they are (--no-chat)" in capsys.readouterr().err
    assert len(_read_rows(out)) == 1
    assert gen.main(["--model", str(folder), "--prompts", str(prompts), "--out", str(out), "--chat",
                     "--max-new-tokens", "8"]) == 2
    assert "cannot tokenize (try --no-chat)" in capsys.readouterr().err
