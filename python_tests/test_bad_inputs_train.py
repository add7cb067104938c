"""Bad input to the training entry point (`python -m lightningrl_fast.train`, config.py, rl/checkpointing.py,
rl/logging.py): each case ends in one `error:` line naming the problem (exit status 2 for a configuration, 1
for a corrupt run folder found while loading), never a traceback from deep inside, a silently different run,
a crash of the process or lost records.

Every test here was a defect: NaN/inf or out-of-range values that reached torch or the sampler (a traceback
after the model loaded, a negative SFT learning rate, an SFT warm-up of one step cached as the real one, a
segfault from --threads), config files that raised from inside the readers or silently kept the last of two
equal keys, a second run into a run folder (mixed metrics.jsonl, replaced checkpoints), a corrupt
trainer_state.pt or metrics.jsonl (a traceback; valid records after a corrupt line deleted), a resume that
ignored --lr / --betas / --weight-decay / --model while saying otherwise, a resume refused because the folder
the run once started from is gone, two runs started in the same second sharing one runs/<timestamp> folder.
CPU, tiny models, a few seconds each.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from lightningrl_fast import config as C
from lightningrl_fast import run_setup as S
from lightningrl_fast import train as T
from lightningrl_fast.rl import logging as L
from lightningrl_fast.rl.checkpointing import load_checkpoint, save_checkpoint
from lightningrl_fast.rl.trainer import RLConfig, make_state

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread, restored after


def _fails(argv: list[str], capsys, status: int, *named: str) -> str:
    """`train.main(argv)` exits with `status` and an `error:` line containing every string of `named`."""
    assert T.main(argv) == status
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err, err
    for s in named:
        assert s in err, (s, err)
    return err


def _gsm8k(path: Path, n: int = 6) -> Path:
    path.write_text("".join(json.dumps({"question": f"What is {i}+{i + 1}?", "answer": f"s\n#### {2 * i + 1}"}) + "\n"
                            for i in range(n)))
    return path


@pytest.fixture
def math_run(tmp_path, ascii_checkpoint):
    """`math_run(out, *extra)` -> argv of a tiny real-checkpoint run (--model DIR --task math, 2 prompts x 2
    samples, 8 new tokens, no eval set): seconds on one CPU thread."""
    model = ascii_checkpoint(tmp_path / "model")
    data = _gsm8k(tmp_path / "train.jsonl")

    def argv(out: Path | None, *extra: str, model_dir: Path = model) -> list[str]:
        return (["--model", str(model_dir), "--task", "math", "--train-data", str(data)]
                + (["--out", str(out)] if out is not None else [])
                + ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
                   "--threads", "1", "--no-plots", "--progress", "off", *extra])

    return argv


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------------------
# values: NaN / inf / out of range
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,match", [
    (["--lr", "nan"], "--lr must be a finite number, got nan"),  # was: torch's "Invalid learning rate" traceback
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--kl-beta", "inf"], "--kl-beta must be a finite number"),
    (["--eps-low", "nan"], "--eps-low must be a finite number"),
    (["--grad-clip", "nan"], "--grad-clip must be a finite number"),
    (["--temperature", "nan"], "--temperature must be a finite number"),  # was: a sampler traceback mid-run
    (["--nll-weight", "nan"], "--nll-weight must be a finite number"),
    (["--rl-time-budget", "nan"], "--rl-time-budget must be a finite number"),
    (["--sft-lr", "nan"], "--sft-lr must be a finite number"),
    (["--eps-low", "1.5"], "--eps-low must be < 1"),
    (["--sft-time-budget", "-5"], "--sft-time-budget must be positive"),  # was: 1 SFT step, cached as the model
    (["--sft-warmup", "0"], "--sft-warmup must be >= 1"),  # was: ZeroDivisionError in the SFT scheduler
    (["--sft-warmup", "-5"], "--sft-warmup must be >= 1"),  # was: a negative SFT learning rate (ascent)
    (["--dist-timeout-min", "0"], "--dist-timeout-min must be positive"),
    (["--seed", str(2**55)], "--seed must be in [-2**40, 2**40]"),  # was: OverflowError in the sampler at step 1
    (["--threads", "100000"], "--threads must be in [0, 1024]"),  # was: a segfault in torch.set_num_threads
    # were: a ValueError traceback from the sampler once the model had loaded
    (["--temperature", "1e-45"], "--temperature: temperature 1e-45 is out of the float32 range"),
    (["--temperature", "1e300"], "--temperature: temperature 1e.300 is out of the float32 range"),
    (["--steps-per-block", str(2**70)], "--steps-per-block must be in [1, 16777216]"),  # was: OverflowError
    (["--max-new-tokens", str(2**40)], "--max-new-tokens must be in [1, 16777216]"),
    # was: found at the first step with a mixed group (with the default filter, maybe hours in)
    (["--reduction", "bogus"], "reduction must be three of seq/tok joined by '-'"),
])
def test_nonfinite_and_out_of_range_values_are_config_errors(argv, match):
    with pytest.raises(C.ConfigError, match=match.replace("[", r"\[").replace("*", r"\*")):
        C.parse_config(argv, check_paths=False)


def test_nonfinite_values_from_config_files(tmp_path):
    for name, text in (("a.toml", "[rl]\nlr = nan\n"), ("b.yaml", "rl:\n  kl_beta: .inf\n"),
                       ("c.json", '{"lr": NaN}')):
        f = tmp_path / name
        f.write_text(text)
        with pytest.raises(C.ConfigError, match="must be a finite number"):
            C.parse_config(["--config", str(f)], check_paths=False)


# ------------------------------------------------------------------------------------------------------------
# config files
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,content,match", [
    ("bad.toml", b"lr = '\xff\xfe'\n", r"not UTF-8 text"),  # was: UnicodeDecodeError traceback
    ("int-key.yaml", b"1: 2\n", r"key 1 is not a name"),  # was: AttributeError traceback
    ("dup.yaml", b"lr: 1e-5\nsteps: 3\nlr: 2e-5\n", r"key 'lr' is given twice \(line 3\)"),  # was: last one kept
    ("dup-section.yaml", b"rl:\n  lr: 1e-5\n  lr: 2e-5\n", r"key 'lr' is given twice"),
    ("dup.json", b'{"steps": 3, "steps": 4}', r"key 'steps' is given twice"),  # was: last one kept
    ("scalar-section.toml", b"rl = 5\n", r"\[rl\] is a section: give it a table"),  # was: "did you mean 'rl'?"
])
def test_bad_config_files(tmp_path, name, content, match):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(C.ConfigError, match=match):
        C.parse_config(["--config", str(f)], check_paths=False)


def test_config_path_that_is_a_folder(tmp_path):
    with pytest.raises(C.ConfigError, match="is a folder, not a config file"):  # was: "no such file"
        C.parse_config(["--config", str(tmp_path)], check_paths=False)


# ------------------------------------------------------------------------------------------------------------
# output and cache folders
# ------------------------------------------------------------------------------------------------------------

def test_out_and_cache_folders_under_a_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    # was: NotADirectoryError traceback once the model had loaded
    with pytest.raises(C.ConfigError, match=r"--out .*a-file/run cannot be created: .*a-file is a file"):
        C.parse_config(["--out", str(f / "run")])
    # was: FileExistsError traceback after the whole SFT warm-up had run
    with pytest.raises(C.ConfigError, match=r"SFT cache folder .*a-file .*exists and is not a folder"):
        C.parse_config(["--cache-dir", str(f)])
    C.parse_config(["--cache-dir", str(f), "--no-cache"])  # nothing is cached: no folder needed


def test_warnings_print_once_as_plain_lines(tmp_path, math_run, capsys):
    """Was: a malformed data row's warning printed twice (logged, then a UserWarning with its source line)."""
    import os
    import subprocess
    import sys

    import lightningrl_fast

    argv = math_run(tmp_path / "run")
    data = Path(argv[argv.index("--train-data") + 1])
    data.write_text(data.read_text() + "{not json\n")
    env = dict(os.environ, PYTHONPATH=str(Path(lightningrl_fast.__file__).parent.parent), OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)
    run = [sys.executable, "-m", "lightningrl_fast.train", *argv]  # a real process: pytest records warnings
    r = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "malformed row" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "UserWarning" not in r.stderr, r.stderr
    # -W still decides: ignore silences it (was printed all the same)
    again = [str(tmp_path / "run2") if a == str(tmp_path / "run") else a for a in run]
    r = subprocess.run([sys.executable, "-W", "ignore", *again[1:]], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "malformed row" not in r.stderr, r.stderr
    assert "1 malformed rows skipped" in r.stdout  # the run's own data line still says it


def test_a_run_whose_steps_update_nothing_says_so(tmp_path, math_run, capsys):
    """Greedy rollouts: a group's samples decode alike, no group carries a signal, every step is skipped. Was: the
    summary said "steps": 1 with no word that nothing was trained."""
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match="no step will update the model"):
        assert T.main(math_run(out, "--temperature", "0")) == 0
    assert "RL: 0 of 1 steps updated the model" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["steps_updated"] == 0
    assert "skipped" in L.read_metrics(out)[0]


def test_a_run_folder_as_model_says_what_to_give(tmp_path, math_run, capsys):
    """Was: "run/config.json is missing required key(s): 'vocab_size', ..." (the run's own config.json read as a
    model's). Now: it is a run's folder; --resume continues it, or its newest checkpoint starts a new run."""
    out = tmp_path / "run"
    assert T.main(math_run(out)) == 0
    _fails(math_run(tmp_path / "new", model_dir=out), capsys, T.EXIT_CONFIG,
           f"--model {out} is a training run's folder", f"--resume {out}", f"--model {out / 'checkpoint-1'}")
    # a run with no checkpoint (only its rft-model): no --resume offered, which would fail
    rft = tmp_path / "rft"
    rft.mkdir()
    shutil.copy(out / "config.json", rft / "config.json")
    shutil.copytree(out / "checkpoint-1", rft / "rft-model")
    err = _fails(math_run(tmp_path / "new2", model_dir=rft), capsys, T.EXIT_CONFIG, f"--model {rft / 'rft-model'}")
    assert "--resume" not in err


def test_second_run_into_a_run_folder_is_refused(tmp_path, math_run, capsys):
    """Was: the second run appended its steps to the first one's metrics.jsonl, replaced its checkpoint-1 and
    overwrote its config.json and summary.json, all without a word."""
    out = tmp_path / "run"
    assert T.main(math_run(out)) == 0
    before = _tree(out)
    _fails(math_run(out, "--steps", "2"), capsys, T.EXIT_CONFIG, f"--out {out} holds a previous run",
           "checkpoint-1", "metrics.jsonl", f"continue it with --resume {out}")
    other = tmp_path / "other"
    assert T.main(math_run(other, "--seed", "1")) == 0
    # a resume must not write into another run's folder either
    _fails(["--resume", str(other), "--out", str(out), "--steps", "2"], capsys, T.EXIT_CONFIG,
           f"--out {out} holds a previous run")
    assert _tree(out) == before
    # resuming into the run's own folder (named as --out, or through a checkpoint folder) is what continues it
    assert T.main(["--resume", str(out / "checkpoint-1"), "--out", str(out), "--steps", "2", "--progress", "off"]) == 0
    assert [m["step"] for m in L.read_metrics(out)] == [1, 2]
    # a folder holding only the config.json of a run that died before its first step may be reused
    died = tmp_path / "died"
    died.mkdir()
    (died / "config.json").write_text("{}")
    assert T.main(math_run(died)) == 0


def test_out_into_the_model_folder_is_refused(tmp_path, math_run, capsys, ascii_checkpoint):
    """Was: --out M with --model M ran (rc 0) and replaced the model's config.json by the run config: M was no
    longer a checkpoint, and a resume was refused for good (the reference folder had changed)."""
    model = ascii_checkpoint(tmp_path / "m")
    before = _tree(model)
    _fails(math_run(model, model_dir=model), capsys, T.EXIT_CONFIG, f"--out {model} is inside the --model folder")
    _fails(math_run(model / "run", model_dir=model), capsys, T.EXIT_CONFIG, "is inside the --model folder")
    other = ascii_checkpoint(tmp_path / "other-model")  # any folder holding a checkpoint's weights
    _fails(math_run(other), capsys, T.EXIT_CONFIG, f"--out {other} holds a model checkpoint (model.safetensors)")
    assert _tree(model) == before


def test_prompts_and_models_that_do_not_fit_are_found_before_the_first_rollout(tmp_path, math_run, capsys,
                                                                               ascii_checkpoint):
    """Were tracebacks at whatever rollout drew the prompt (maybe hours in) or right after the model load: a prompt
    whose last block, rounded to the block size, passes the model's positions; ids outside a smaller vocabulary;
    a block size past the positions; a broken tokenizer file."""
    model = ascii_checkpoint(tmp_path / "m", max_pos=64)
    data = _gsm8k(tmp_path / "d.jsonl", 3)
    base = ["--model", str(model), "--task", "math", "--train-data", str(data), "--steps", "1", "--prompts-per-step",
            "2", "--group-size", "2", "--threads", "1", "--no-plots", "--progress", "off"]
    _fails(base + ["--out", str(tmp_path / "r1"), "--max-new-tokens", "60"], capsys, T.EXIT_ERROR,
           "prompts do not fit the model's positions", "none is left")
    _fails(base + ["--out", str(tmp_path / "r2"), "--block-size", "128"], capsys, T.EXIT_CONFIG,
           "--block-size 128 exceeds the model's max_position_embeddings 64")
    cfg = json.loads((model / "config.json").read_text())
    wide = tmp_path / "wide-blocks"
    shutil.copytree(model, wide)
    (wide / "config.json").write_text(json.dumps(cfg | {"block_size": 100}))
    _fails(["--model", str(wide)] + base[2:] + ["--out", str(tmp_path / "r3")], capsys, T.EXIT_CONFIG,
           "config.json block_size 100 exceeds the model's max_position_embeddings 64")
    broken = tmp_path / "broken-tok"
    shutil.copytree(model, broken)
    tok_files = [p for p in broken.iterdir() if p.name.startswith("tokenizer")]
    for p in tok_files:
        p.write_text("{not json")
    _fails(["--model", str(broken)] + base[2:] + ["--out", str(tmp_path / "r4")], capsys, T.EXIT_ERROR,
           f"cannot load the tokenizer of {broken}")


def test_fit_rules_rounding_vocabulary_and_eval_cap():
    """fit_examples applies the sampler's rule (the last block, aligned at 0, within the positions) and refuses
    ids outside the model's vocabulary naming the example."""
    from types import SimpleNamespace

    from lightningrl_fast.tasks.data import DataFormatError

    class Tok:
        def __init__(self, n):
            self.n = n

        def encode(self, text):
            return [5] * self.n if text != "big" else [5, 99]

    class Task:
        def build_prompt(self, ex):
            return ex.text

    mc = SimpleNamespace(max_position_embeddings=64, block_size=16, mask_token_id=1, vocab_size=50)
    exs = [SimpleNamespace(id="a", text="x"), SimpleNamespace(id="b", text="x")]
    said = []
    # 45 + 17 = 62 <= 64, but blocks of 16 end at 64: fits; 45 + 20 = 65: does not
    assert S.fit_examples(exs, Task(), Tok(45), mc, 17, None, "d", said.append) == exs
    with pytest.raises(DataFormatError, match="none is left"):
        S.fit_examples(exs, Task(), Tok(45), mc, 20, None, "d", said.append)
    # 60 positions, blocks of 16: 40 + 10 = 50 fits the cache, but the last block ends at 64 > 60 (was: kept, then a
    # sampler traceback at the rollout that drew it)
    mc60 = SimpleNamespace(**(vars(mc) | {"max_position_embeddings": 60}))
    with pytest.raises(DataFormatError, match="the last block ends at position 64, past the model's"):
        S.fit_examples(exs, Task(), Tok(40), mc60, 10, None, "d", said.append)
    mc32 = SimpleNamespace(**(vars(mc) | {"block_size": 32}))
    # a max_length of 60 caps the cache; the last block may still end at 64 (the model's positions)
    kept = S.fit_examples(exs[:1] + [SimpleNamespace(id="c", text="x")], Task(), Tok(30), mc32, 30, 60, "d",
                          said.append)
    assert len(kept) == 2
    with pytest.raises(DataFormatError, match=r"example z: the prompt has token id\(s\) \[99\] outside the model's vocabulary \[0, 50\) \(a tokenizer"):
        S.fit_examples([SimpleNamespace(id="z", text="big")], Task(), Tok(3), mc, 4, None, "d", said.append)


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path, math_run, monkeypatch):
    """Was: both wrote into runs/<timestamp> (metrics.jsonl of two runs mixed, checkpoints replaced)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(T.time, "strftime", lambda fmt, *a: "20250101-000000")
    first = tmp_path / "runs" / "20250101-000000"
    first.mkdir(parents=True)
    (first / "metrics.jsonl").write_text(json.dumps({"step": 1, "acc": 0.25}) + "\n")
    assert T.main(math_run(None)) == 0
    assert L.read_metrics(first) == [{"step": 1, "acc": 0.25}]
    assert [m["step"] for m in L.read_metrics(tmp_path / "runs" / "20250101-000000-1")] == [1]


# ------------------------------------------------------------------------------------------------------------
# resume: corrupt run folders
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture
def finished_run(tmp_path, math_run):
    out = tmp_path / "run"
    assert T.main(math_run(out, "--steps", "2", "--save-every", "1")) == 0
    assert (out / "latest").read_text().strip() == "checkpoint-2"
    return out


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not-a-dict"])
def test_corrupt_trainer_state(finished_run, capsys, damage):
    """Was: an OSError / RuntimeError traceback from torch.load (mmap of a non-zip file)."""
    f = finished_run / "checkpoint-2" / "trainer_state.pt"
    data = f.read_bytes()
    if damage == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        f.write_bytes(b"garbage\n")
    elif damage == "empty":
        f.write_bytes(b"")
    else:
        torch.save([1, 2, 3], f)
    _fails(["--resume", str(finished_run), "--steps", "3"], capsys, T.EXIT_ERROR, str(f),
           "resume from an earlier checkpoint instead (checkpoint-1)")
    assert (finished_run / "latest").read_text().strip() == "checkpoint-2"  # nothing was written


def test_latest_that_is_not_text(finished_run, capsys):
    (finished_run / "latest").write_bytes(b"\xff\xfe")
    _fails(["--resume", str(finished_run), "--steps", "3"], capsys, T.EXIT_CONFIG,
           f"{finished_run / 'latest'} is corrupt (not UTF-8 text)")


def test_latest_naming_a_folder_outside_the_run(finished_run, tmp_path, math_run, capsys):
    """Was: `latest` holding ../other/checkpoint-1 (or an absolute path) made the resume write into the other run
    (its checkpoints, metrics.jsonl, summary.json and latest), bypassing the 'holds a previous run' guard."""
    other = tmp_path / "other"
    assert T.main(math_run(other, "--seed", "1")) == 0
    before = _tree(other)
    for name in ("../other/checkpoint-1", str(other / "checkpoint-1"), "checkpoint-2/../checkpoint-1"):
        (finished_run / "latest").write_text(name + "\n")
        _fails(["--resume", str(finished_run), "--steps", "3"], capsys, T.EXIT_CONFIG,
               "not a checkpoint folder of this run")
    assert _tree(other) == before


def test_resume_from_an_earlier_checkpoint_sets_the_later_run_aside(finished_run, capsys):
    """Was: resuming from checkpoint-1 of a run at step 2 cut metrics.jsonl to the first record and left (then
    replaced) checkpoint-2 without a word. Now the later checkpoint and records move to discarded-1/."""
    m_before = L.read_metrics(finished_run)
    assert [r["step"] for r in m_before] == [1, 2]
    ck2 = _tree(finished_run / "checkpoint-2")
    assert T.main(["--resume", str(finished_run / "checkpoint-1"), "--steps", "1", "--progress", "off"]) == 0
    out = capsys.readouterr().out
    assert "moved checkpoint-2 and 1 later metrics record(s)" in out and "discarded-1" in out
    aside = finished_run / "discarded-1"
    assert _tree(aside / "checkpoint-2") == ck2 and L.read_metrics(aside) == m_before[1:]
    assert (finished_run / "latest").read_text().strip() == "checkpoint-1"
    assert not (finished_run / "checkpoint-2").exists() and L.read_metrics(finished_run) == m_before[:1]
    # the run goes on from there; a later resume finds its own newest checkpoint
    assert T.main(["--resume", str(finished_run), "--steps", "2", "--progress", "off"]) == 0
    assert (finished_run / "latest").read_text().strip() == "checkpoint-2"
    assert [r["step"] for r in L.read_metrics(finished_run)] == [1, 2]


def test_corrupt_metrics_line_on_resume_loses_no_record(finished_run, capsys):
    """Was: the records after a corrupt line were deleted from metrics.jsonl and the run went on."""
    m = finished_run / "metrics.jsonl"
    lines = m.read_text().splitlines()
    lines[0] = lines[0][:20]
    m.write_text("\n".join(lines) + "\n")
    damaged = m.read_bytes()
    _fails(["--resume", str(finished_run), "--steps", "3"], capsys, T.EXIT_ERROR, f"{m}:1: not a metrics record",
           "1 line(s) follow it")
    assert m.read_bytes() == damaged
    m.write_bytes(b'{"step": 1}\n\xff\xfe\n')  # was: UnicodeDecodeError traceback
    _fails(["--resume", str(finished_run), "--steps", "3"], capsys, T.EXIT_ERROR, f"{m}:2: not UTF-8 text")
    # a partial LAST line (a killed run) is still dropped quietly, the records before it kept
    m.write_text("\n".join(lines[1:] + ['{"step": 3, "ac']))
    assert T.main(["--resume", str(finished_run), "--steps", "3", "--progress", "off"]) == 0
    assert [r["step"] for r in L.read_metrics(m)] == [2, 3]


def test_corrupt_metrics_is_reported_before_the_evaluation(finished_run, tmp_path, capsys):
    """A resume that has to evaluate before RL (its checkpoint carries no evaluation: the run had no eval data,
    now given) reports a corrupt metrics.jsonl first, not after minutes of decoding."""
    m = finished_run / "metrics.jsonl"
    m.write_text('{"step": 1}\n{"step"\n{"step": 2}\n')
    data = _gsm8k(tmp_path / "eval.jsonl", 3)
    assert T.main(["--resume", str(finished_run), "--steps", "3", "--eval-data", str(data), "--eval-thresholds",
                   "0.9", "--progress", "off"]) == T.EXIT_ERROR
    captured = capsys.readouterr()
    assert f"{m}:2: not a metrics record" in captured.err and "eval before RL" not in captured.out


def test_run_logger_strict_read(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 1}\n[1, 2]\n{"step": 2}\n')
    # was: the list kept as a record (the end-of-run plot then failed on it, after the whole training)
    with pytest.raises(L.MetricsFileError, match=r"metrics.jsonl:2: not a metrics record \(a JSON list"):
        L.RunLogger(tmp_path, progress="off")
    assert m.read_text() == '{"step": 1}\n[1, 2]\n{"step": 2}\n'
    assert L.read_metrics(m) == [{"step": 1}]  # the plain reader stops there


def test_metrics_file_that_is_a_folder_or_not_utf8(tmp_path):
    """A metrics.jsonl that is a folder is named (was it an IsADirectoryError traceback from open?); the plain
    (non-strict) reader of a file with bytes that are not UTF-8 returns the records before them, it does not
    raise."""
    (tmp_path / "a" / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(L.MetricsFileError, match=r"metrics.jsonl is not a file"):
        L.RunLogger(tmp_path / "a", progress="off")
    assert L.read_metrics(tmp_path / "a") == []
    m = tmp_path / "b" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_bytes(b'{"step": 1}\n\xff\xfe\n{"step": 3}\n')
    assert L.read_metrics(m) == [{"step": 1}]
    with pytest.raises(L.MetricsFileError, match=r"metrics.jsonl:2: not UTF-8 text"):
        L.read_metrics(m, strict=True)


# ------------------------------------------------------------------------------------------------------------
# resume: changed settings
# ------------------------------------------------------------------------------------------------------------

def test_resume_applies_a_changed_lr_betas_and_weight_decay(tmp_path, ascii_checkpoint):
    """Was: the optimizer and scheduler state of the checkpoint silently restored the old lr / betas / weight
    decay, while the run header and the warning announced the new ones."""
    from lightningrl_fast.checkpoint import load_model

    folder = ascii_checkpoint(tmp_path / "model")
    old = RLConfig(lr=1e-3, warmup_steps=4, kl_beta=0.0)
    state = make_state(load_model(folder)[0], old)
    state.optimizer.step()  # no gradients: changes nothing (torch warns about a scheduler step before it)
    state.scheduler.step()  # one step into the warm-up: factor 2/4
    save_checkpoint(tmp_path / "run", state, config=old)
    new = RLConfig(lr=1e-2, warmup_steps=4, kl_beta=0.0, betas=(0.8, 0.9), weight_decay=0.1)
    resumed = make_state(load_model(folder)[0], new)
    with pytest.warns(UserWarning, match="lr 0.001 -> 0.01"):
        load_checkpoint(tmp_path / "run", resumed, config=new)
    g = resumed.optimizer.param_groups[0]
    assert g["lr"] == pytest.approx(1e-2 * 2 / 4) and g["betas"] == (0.8, 0.9) and g["weight_decay"] == 0.1
    resumed.scheduler.step()
    assert resumed.scheduler.get_last_lr()[0] == pytest.approx(1e-2 * 3 / 4)
    # the same config resumes exactly as saved
    same = make_state(load_model(folder)[0], old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_checkpoint(tmp_path / "run", same, config=old)
    assert same.optimizer.state_dict()["param_groups"] == state.optimizer.state_dict()["param_groups"]


def test_resume_with_another_model_is_refused(tmp_path, math_run, capsys, ascii_checkpoint):
    """Was: --model was ignored without a word (the resumed run loads its checkpoint's weights)."""
    out = tmp_path / "run"
    assert T.main(math_run(out)) == 0
    other = ascii_checkpoint(tmp_path / "other-model", max_pos=256)
    _fails(["--resume", str(out), "--model", str(other), "--steps", "2"], capsys, T.EXIT_CONFIG,
           f"--model {other} conflicts with --resume {out}", f"the run started from {tmp_path / 'model'}")
    # naming the run's own model again is fine
    assert T.main(["--resume", str(out), "--model", str(tmp_path / "model"), "--steps", "2", "--progress", "off"]) == 0


def test_resume_after_the_start_model_folder_is_gone(tmp_path, math_run):
    """Was: '--model <old folder>: no such folder', though the resumed run loads its checkpoint's weights (and,
    without the KL term, needs nothing else from that folder)."""
    start = Path(shutil.copytree(tmp_path / "model", tmp_path / "start"))  # math_run's model, to delete
    out = tmp_path / "run"
    assert T.main(math_run(out, "--kl-beta", "0", model_dir=start)) == 0
    shutil.rmtree(start)
    assert T.main(["--resume", str(out), "--steps", "2", "--progress", "off"]) == 0
    assert [m["step"] for m in L.read_metrics(out)] == [1, 2]
