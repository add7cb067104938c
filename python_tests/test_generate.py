"""The generate command line (JSONL/txt prompts, ChatML, results rows, errors with file:line) and bench_decode on CPU."""

from __future__ import annotations

import json
import os
import re
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
    ids = gen.encode_prompts(rows_, CharTokenizer(), prompts, True, 10**6, 10**6, 4, -1)
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
