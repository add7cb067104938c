"""[eval] Accuracy vs parallelism: decode a benchmark at several confidence thresholds, score, report AUP.

    python -m lightningrl_fast.eval --model DIR --task math|code|synthetic [--data FILE]
        [--thresholds 0.5,0.7,0.9,0.95 (or 0.5 0.7 0.9 0.95)] [--limit N] [--out DIR] [--label NAME]
        [--overlay other.json ...]
        [--block-size B] [--max-new-tokens N] [--batch-size N] [--temperature 0] [--device ...] [--dtype ...]

`--threshold T` (the sampler flag generate shares) alone is `--thresholds T`, one point; with `--thresholds` it is
refused (eval decodes at --thresholds only). For each threshold tau the examples are decoded (greedy by default,
REFERENCE §2: evaluation is greedy with the rollout's block and tau) and scored by the task's verifier (a response
cut at --max-new-tokens counts as wrong unless --truncated-ok, as in the RL reward; --max-new-tokens defaults to
512 for math / code, the synthetic task's longest answer for synthetic, or, as generate's, to what the model's
positions leave after the longest prompt when that is less, said on stderr); per threshold it reports accuracy,
mean TPF (over examples), tokens/s and forwards/s (decode time only, scoring excluded), and the engine's forwards.
`--task synthetic` without `--data` uses the embedded task's held-out test split (`tasks.synthetic`);
with `--data`, a JSONL of {"operands": [a, b, c]} or {"prompt": "a+b+c?"} rows. Math/code read the benchmark
files of `tasks.data.load_examples` (GSM8K, MATH500, MBPP, HumanEval, plain). Code completions run in the
sandboxed verifier, many at a time (`--workers`), math answers through `verify_math_batch` (math-verify helpers
in parallel), and every batch is scored in a background thread while the next batch decodes.

Outputs: a table on stdout, and `<out>/<label>.<task>.<data>.json` / `.png`, `<data>` the data file's name
without its .jsonl / .json / .parquet / .gz ending (none for the synthetic test split), so the results of one model
on two benchmarks of a task (GSM8K and MATH500) do not replace each other (results files, labels, AUP and the
plot: `eval_results.py`, whose docstring has the d3LLM AUP definition).

Several GPUs: `torchrun --nproc-per-node N -m lightningrl_fast.eval ...` gives each rank every N-th example;
the per-example results are gathered before the points are computed, so the numbers are those of one process
(greedy decoding; sampled evaluation draws per-rank batches), decoded N times faster; rank 0 prints and writes.

Python API (the trainer calls it): `evaluate(model, tokenizer, task, examples, thresholds, sampler_cfg)` -> dict;
`eval_results.aup(points, y_max=None)` -> float, `plot_curves(runs, path)`, `load_results(path)`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

INTERRUPTED = "error: interrupted (Ctrl-C); no results file was left half-written"

try:  # torch and the package load for seconds: a Ctrl-C meanwhile is main's one line, not an import traceback
    import torch

    from ._cli import (
        CLIError,
        add_decoding_args,
        batches,
        check_block_size,
        check_checkpoint_block_size,
        check_decoding_args,
        check_model_dir,
        cli_main,
        decode_block_size,
        decode_texts,
        drop_stdout,
        eos_ids_for,
        join_ranks,
        load_model_checked,
        load_tokenizer_checked,
        parse_json_line,
        progress,
        read_config_checked,
        resolve_dtype,
        split_lines,
        warn_mask_mismatch,
    )
    from .eval_results import (
        AUP_DEFINITION,
        aup,
        check_results_target,
        data_key,
        default_label,
        distinct_labels,
        format_table,
        json_safe,
        load_results,
        overlay_mismatch,
        plot_curves,
        results_path,
        run_points,
    )
    from ._jsonfile import write_text_atomic
    from .rl import distributed
    from .rl.distributed import SINGLE, DistEnv, all_gather
    from .sampler import Decoder, prompt_problem
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    print(INTERRUPTED, file=sys.stderr, flush=True)
    sys.exit(130)

DEFAULT_THRESHOLDS = (0.5, 0.7, 0.9, 0.95)


DEFAULT_MAX_NEW_TOKENS = 512  # math and code; the synthetic task's is its longest answer and its EOS


# ------------------------------------------------------------------------------------------------------------
# evaluation
# ------------------------------------------------------------------------------------------------------------

def _correct_batch(task, responses: list[str], examples: list) -> list[bool]:
    from .tasks import is_correct_batch

    return is_correct_batch(task, responses, examples)


def _encode(tokenizer, task, examples) -> list[list[int]]:
    out = []
    for i, ex in enumerate(examples):
        text = task.build_prompt(ex)
        try:
            ids = tokenizer.encode(text)
        except ValueError as e:
            ex_id = getattr(ex, "id", i)
            raise ValueError(f"example {ex_id!r}: the prompt cannot be tokenized: {e}") from None
        out.append(ids)
    return out


def _decoded_block_size(model, sampler_cfg) -> int:
    """The block size the sampler decodes with: sampler_cfg.block_size (an integer >= 1), None = the model's."""
    bs = sampler_cfg.block_size if sampler_cfg.block_size is not None else model.config.block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"evaluate: block_size must be an integer >= 1, got {bs!r}")
    return bs


def _check_prompts(model, examples: list, ids: list[list[int]], sampler_cfg) -> None:
    """Every prompt decodable with these settings, found before decoding (the sampler finds the same problems
    mid-run and names only a batch-local prompt index): ids inside the model's vocabulary, no mask token, and
    prompt + max_new_tokens with the last block rounded up to the decoded block size within the positions
    (`sampler.prompt_problem`, the sampler's rule). ValueError naming the first bad example's id and counting the
    others."""
    bs, mc = _decoded_block_size(model, sampler_cfg), model.config
    problems = []
    for i, (ex, p) in enumerate(zip(examples, ids)):
        problem = prompt_problem(p, mc.vocab_size, mc.mask_token_id, sampler_cfg.max_new_tokens, bs,
                                 sampler_cfg.max_length, mc.max_position_embeddings)
        if problem is not None:
            hint = {"vocab": " (the tokenizer has more ids than the checkpoint's vocab_size)",
                    "fit": " (lower max_new_tokens or leave the example out)"}.get(problem.kind, "")
            problems.append(f"example {getattr(ex, 'id', i)!r}: the prompt {problem.text}{hint}")
    if problems:
        more = f" (and {len(problems) - 1} more example(s))" if len(problems) > 1 else ""
        raise ValueError(problems[0] + more)


@torch.no_grad()
def evaluate(model, tokenizer, task, examples: Sequence[Any], thresholds: Sequence[float], sampler_cfg,
             *, batch_size: int = 32, progress_bar: bool = False, keep_responses: bool = False,
             truncated_is_wrong: bool = True, on_batch: Callable[[float, int, int], None] | None = None,
             env: DistEnv = SINGLE, prompt_ids: list[list[int]] | None = None) -> dict:
    """Decode `examples` at each threshold with `sampler_cfg` (its `threshold` is replaced), score, and report.

    `task` has `build_prompt(example) -> str` and `is_correct(response, example)` (or `is_correct_batch`);
    the response passed to the verifier is the decoded text without its EOS. `accuracy` counts a response as
    correct when the verifier says so AND it finished with EOS (a response cut at max_new_tokens is wrong, as in
    the RL reward and train.py's sweep); `truncated_is_wrong=False` counts the verifier alone. Both are reported
    (`accuracy`, `verifier_accuracy`), with `finished` (fraction that emitted EOS) and, for the synthetic task,
    `well_formed` (every step of the trace right, and finished). The model is put in eval mode for the call and
    its mode restored. When `sampler_cfg.block_size` differs from the model's, the model's
    attention runs with the sampler's block size for the call. `env` (several ranks, every one calls it): this
    rank decodes examples rank, rank + world, ...; the per-example results are all-gathered, so every rank
    returns the points of all examples. `prompt_ids`: the examples' encoded prompts when the caller has them
    (`_encode`, one list per example), else they are encoded here.

    Returns {"points": [per threshold: threshold, n, correct, accuracy (fraction), verifier_accuracy, finished,
    (well_formed), mean_tpf, tokens, tokens_per_s, forwards, forwards_per_s, truncated, decode_s, score_s
    (+ responses)], "aup", "aup_y_max",
    "sampler": settings, "n_examples"}.
    """
    if not examples:
        raise ValueError("evaluate: no examples")
    if not thresholds:
        raise ValueError("evaluate: no thresholds")
    if batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
    examples = list(examples)
    ids = _encode(tokenizer, task, examples) if prompt_ids is None else prompt_ids
    if len(ids) != len(examples):
        raise ValueError(f"evaluate: {len(ids)} encoded prompts for {len(examples)} examples")
    _check_prompts(model, examples, ids, sampler_cfg)
    mine = list(range(env.rank, len(ids), env.world))  # this rank's examples (all of them with one rank)
    groups = [mine[r.start:r.stop] for r in batches(len(mine), batch_size)]
    was_training = model.training
    model.eval()
    points = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-score")
    decoder = Decoder(model)  # one engine for every batch and threshold: each step shape is captured once
    bar = progress(len(groups) * len(thresholds), "eval", enabled=progress_bar)
    try:
        with decode_block_size(model, sampler_cfg.block_size):
            for tau in thresholds:
                cfg = dataclasses.replace(sampler_cfg, threshold=float(tau))
                responses: list[str] = [""] * len(ids)
                tpf = [math.nan] * len(ids)
                row_fwd = [0] * len(ids)  # forwards each answer took part in (prefill and commits included)
                eos = [False] * len(ids)
                pending: list[tuple[list[int], concurrent.futures.Future]] = []
                n_tok = n_fwd = truncated = 0
                decode_s = 0.0
                for b, idx in enumerate(groups):
                    bcfg = dataclasses.replace(cfg, seed=cfg.seed + b)
                    t0 = time.perf_counter()
                    ro, texts = decode_texts(model, tokenizer, [ids[i] for i in idx], bcfg, decoder)
                    decode_s += time.perf_counter() - t0
                    n_fwd += ro.total_forwards
                    n_tok += int(ro.lengths.sum())
                    truncated += sum(r == "length" for r in ro.finish_reason)
                    for j, i in enumerate(idx):
                        responses[i] = texts[j]
                        tpf[i] = float(ro.tpf[j])
                        row_fwd[i] = int(ro.forwards[j])
                        eos[i] = bool(ro.eos_found[j])
                    exs = [examples[i] for i in idx]
                    pending.append((idx, pool.submit(_timed, _correct_batch, task, texts, exs)))
                    bar.update(1)
                    if on_batch is not None:
                        on_batch(float(tau), b, len(groups))
                correct = [False] * len(ids)
                score_s = 0.0
                for idx, fut in pending:
                    ok, s = fut.result()
                    score_s += s
                    for j, i in enumerate(idx):
                        correct[i] = bool(ok[j])
                if env.active:  # every rank's examples into the full per-example lists
                    cols = (responses, tpf, row_fwd, eos, correct)
                    parts = all_gather(env, (mine, [[c[i] for i in mine] for c in cols],
                                             (n_tok, n_fwd, truncated), (decode_s, score_s)))
                    for idx_r, vals, _, _ in parts:
                        for c, v in zip(cols, vals):
                            for i, x in zip(idx_r, v):
                                c[i] = x
                    n_tok, n_fwd, truncated = (sum(p[2][k] for p in parts) for k in range(3))
                    decode_s, score_s = (max(p[3][k] for p in parts) for k in range(2))  # the ranks run at once
                verified = correct
                if truncated_is_wrong:
                    correct = [c and e for c, e in zip(correct, eos)]
                n_ok = sum(correct)
                pt = {
                    "threshold": float(tau), "n": len(ids), "correct": n_ok, "accuracy": n_ok / len(ids),
                    "verifier_accuracy": sum(verified) / len(ids), "finished": sum(eos) / len(ids),
                    "mean_tpf": sum(tpf) / len(tpf), "forwards_per_answer": sum(row_fwd) / len(ids), "tokens": n_tok,
                    "tokens_per_s": n_tok / decode_s if decode_s > 0 else math.nan,
                    "forwards": n_fwd, "forwards_per_s": n_fwd / decode_s if decode_s > 0 else math.nan,
                    "truncated": truncated, "decode_s": decode_s, "score_s": score_s,
                }
                if getattr(task, "name", "") == "synthetic":
                    from .tasks.synthetic import well_formed

                    pt["well_formed"] = sum(e and well_formed(r, ex) for r, ex, e in zip(responses, examples, eos)) / len(ids)
                if keep_responses:
                    pt["responses"] = [{"response": r, "correct": c, "verified": v, "eos": e, "tpf": t}
                                       for r, c, v, e, t in zip(responses, correct, verified, eos, tpf)]
                points.append(pt)
    finally:
        bar.close()
        pool.shutdown(wait=True, cancel_futures=True)  # after an error or Ctrl-C: no scoring of queued batches
        model.train(was_training)
    pts = run_points({"points": points})
    y_max = max(y for _, y in pts) if pts else 0.0
    settings = {k: v for k, v in dataclasses.asdict(sampler_cfg).items() if k != "threshold"}
    settings["eos_ids"] = list(settings["eos_ids"])
    settings["block_size"] = sampler_cfg.block_size or model.config.block_size
    settings["truncated_is_wrong"] = truncated_is_wrong
    return {"points": points, "aup": aup(pts) if pts else math.nan, "aup_y_max": y_max,
            "aup_definition": AUP_DEFINITION, "sampler": settings, "n_examples": len(examples)}


def _timed(fn, *a):
    t0 = time.perf_counter()
    out = fn(*a)
    return out, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------------------
# tasks and data for the command line
# ------------------------------------------------------------------------------------------------------------

_SYNTH_PROMPT = re.compile(r"^\s*\d+(\s*\+\s*\d+)+\s*\?\s*$")


def load_synthetic(path: str | Path | None, task):
    """The synthetic task's test split, or ArithExamples from a JSONL of operands / prompts (file:line errors)."""
    from .tasks.synthetic import ArithExample

    if path is None:
        return list(task.test)
    path = Path(path)
    if path.is_dir():
        raise CLIError(f"data file {path} is a folder, not a file")
    if not path.is_file():
        raise CLIError(f"data file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark may lead
    except UnicodeDecodeError as e:
        raise CLIError(f"{path}: not UTF-8 text ({e})") from None
    out, errors = [], []
    for lineno, line in enumerate(split_lines(text), 1):
        if not line.strip():
            continue
        try:
            row = parse_json_line(line)
        except ValueError as e:
            errors.append(f"{path}:{lineno}: not valid JSON ({e})")
            continue
        ops = row.get("operands") if isinstance(row, dict) else None
        if ops is None and isinstance(row, dict) and isinstance(row.get("prompt"), str) and _SYNTH_PROMPT.match(row["prompt"]):
            ops = [int(x) for x in re.findall(r"\d+", row["prompt"])]
        if not (isinstance(ops, list) and len(ops) >= 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ops)):
            errors.append(f"{path}:{lineno}: expected {{\"operands\": [a, b, ...]}} or {{\"prompt\": \"a+b+c?\"}}")
            continue
        out.append(ArithExample(tuple(ops)))
    if errors:
        raise CLIError(f"{len(errors)} malformed row(s) in {path}:\n  " + "\n  ".join(errors[:10]))
    if not out:
        raise CLIError(f"{path}: no examples")
    return out


def make_task(name: str, workers: int | None):
    from .tasks import get_task

    return get_task(name, workers=workers) if name == "code" else get_task(name)


def load_data(args, task) -> tuple[list, dict]:
    """(examples, provenance): the rows evaluated and, for the results JSON, the file's row count and the
    malformed rows that were skipped (each named by file and line; the first 100 listed)."""
    info: dict = {"rows": None, "skipped": 0, "skipped_rows": []}
    if args.task == "synthetic":
        exs = load_synthetic(args.data, task)
        info["rows"] = len(exs)
    else:
        if args.data is None:
            raise CLIError(f"--task {args.task} needs --data FILE (a benchmark file; nothing is downloaded)")
        from .tasks.data import DataFormatError, load_examples

        try:
            loaded = load_examples(args.data, fmt=args.format, limit=args.limit)
        except FileNotFoundError:
            raise CLIError(f"data file {args.data} does not exist") from None
        except (DataFormatError, ValueError) as e:  # the loader's words for its `fmt=`: the flag's
            raise CLIError(str(e).replace("or pass fmt=", "or give --format")) from None
        exs = list(loaded)
        info.update(rows=loaded.n_rows, skipped=loaded.skipped, skipped_rows=[str(e) for e in loaded.errors[:100]])
        wrong = [e for e in exs if e.kind != args.task]
        if wrong:
            raise CLIError(f"{args.data}: {len(wrong)} of {len(exs)} examples are {wrong[0].kind!r} problems, "
                           f"not {args.task!r} (e.g. {wrong[0].id}); pick the matching --task")
    return (exs[: args.limit] if args.limit else exs), info


def parse_thresholds(text: str | Sequence[str], flag: str = "--thresholds") -> list[float]:
    """--thresholds: numbers separated by commas or spaces (`0.5,0.9` or `0.5 0.9`, as train's --eval-thresholds),
    each in [0, 1]; `text` is the flag's words (or one string). CLIError naming `flag` otherwise."""
    words = [text] if isinstance(text, str) else list(text)
    try:
        vals = [float(t) for w in words for t in w.replace(",", " ").split()]
    except ValueError:
        raise CLIError(f"{flag} {' '.join(words)!r}: expected numbers separated by commas or spaces, e.g. "
                       f"0.5,0.7,0.9 or 0.5 0.7 0.9") from None
    if not vals:
        raise CLIError(f"{flag}: no value given")
    bad = [v for v in vals if not 0 <= v <= 1.0001]
    if bad:
        raise CLIError(f"{flag}: values must be in [0, 1], got {bad}")
    return vals


def resolve_thresholds(args) -> list[float]:
    """The thresholds eval decodes at: --thresholds, else an explicit --threshold T (one point), else the default
    sweep. Both flags: CLIError (eval decodes at --thresholds only; a --threshold beside them would be ignored).
    `args.threshold` is set to the first (the shared sampler checks then check a value that is decoded at)."""
    if args.threshold is not None and args.thresholds is not None:
        raise CLIError(f"--threshold {args.threshold:g} and --thresholds {' '.join(args.thresholds)}: eval decodes at "
                       f"each of --thresholds; give the thresholds in --thresholds only")
    if args.thresholds is not None:
        vals = parse_thresholds(args.thresholds)
    elif args.threshold is not None:
        vals = parse_thresholds([repr(args.threshold)], flag="--threshold")
    else:
        vals = list(DEFAULT_THRESHOLDS)
    args.threshold = vals[0]
    return vals


def check_out_folder(out: str) -> None:
    """--out names a folder, or a path where one can be made: found before decoding, not when the results are
    written (which would lose them)."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise CLIError(f"--out {out} exists and is not a folder")
    for folder in (p.absolute(), *p.absolute().parents):
        if folder.exists():
            if not folder.is_dir():
                raise CLIError(f"--out {out}: {folder} is not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise CLIError(f"--out {out}: {folder} is not writable")
            break


# ------------------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lightningrl_fast.eval",
                                 description="Accuracy vs tokens-per-forward over confidence thresholds, and AUP.")
    ap.add_argument("--model", required=True,
                    help="checkpoint folder, or a training run's folder: its latest checkpoint (as generate)")
    ap.add_argument("--task", required=True, choices=("math", "code", "synthetic"))
    ap.add_argument("--data", default=None, help="benchmark file (optional for --task synthetic: its test split)")
    from .tasks.data import FORMATS

    ap.add_argument("--format", default=None, choices=FORMATS,
                    help="force the data format (default: detected from the file's first row)")
    ap.add_argument("--thresholds", nargs="+", default=None, metavar="T",
                    help="confidence thresholds tau to decode at, one point of the curve each, separated by commas or "
                    "spaces (default " + ",".join(f"{t:g}" for t in DEFAULT_THRESHOLDS) + ")")
    ap.add_argument("--limit", type=int, default=None, help="first N examples only")
    ap.add_argument("--out", default="eval_results", help="folder for the results JSON and PNG, "
                    "<label>.<task>.<data file's name>.json / .png (default eval_results)")
    ap.add_argument("--label", default=None, help="name of this run in tables, files and plots (default: the checkpoint "
                    "folder's name, led by its run folder's for a training run's checkpoint: A-checkpoint-1)")
    ap.add_argument("--overlay", nargs="*", default=[], help="results JSONs of earlier runs to draw on the same plot")
    ap.add_argument("--workers", type=int, default=None, help="parallel code sandboxes (default: CPU count)")
    ap.add_argument("--save-responses", action="store_true", help="keep every response in the results JSON")
    ap.add_argument("--truncated-ok", action="store_true",
                    help="score responses cut at --max-new-tokens by the verifier alone (default: they are wrong)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    add_decoding_args(ap, temperature=0.0, max_new_tokens=None, batch_size=32,
                      max_new_tokens_help="response length cap (default: the synthetic task's longest answer and its "
                                          f"EOS; math and code: {DEFAULT_MAX_NEW_TOKENS}; either, where the model's "
                                          "positions cannot hold it after the longest prompt, what they leave)")
    threshold = next(a for a in ap._actions if a.dest == "threshold")  # the shared flag, eval's meaning
    threshold.default = None
    threshold.help = ("one threshold to decode at: the same as --thresholds T (refused together with --thresholds; "
                      "default: the --thresholds sweep)")
    return ap


def run(args) -> dict:
    thresholds = resolve_thresholds(args)
    check_decoding_args(args)
    if args.limit is not None and args.limit < 1:
        raise CLIError(f"--limit must be >= 1, got {args.limit}")
    if args.workers is not None and args.workers < 1:
        raise CLIError(f"--workers must be >= 1, got {args.workers}")
    check_out_folder(args.out)
    model_dir = check_model_dir(args.model)
    label = args.label or default_label(model_dir)
    check_results_target(results_path(args.out, label, args.task, args.data), model_dir, args.data)
    overlays = [load_results(p) for p in args.overlay]
    task = make_task(args.task, args.workers)
    examples, data_info = load_data(args, task)
    env, device = join_ranks(args.device)
    with distributed.joined(env):
        return _run_on(args, env, device, thresholds, model_dir, label, overlays, task, examples, data_info)


def _default_max_new_tokens(args, env: DistEnv, task, prompt_ids: list[list[int]], mcfg) -> int:
    """Without --max-new-tokens: the task's cap (the synthetic task's longest answer and its EOS, else
    DEFAULT_MAX_NEW_TOKENS), or what the model's positions leave after the longest prompt (`prompt_ids`, the
    encoded examples) when that is less (`generate.fitted_max_new_tokens`, generate's rule), said on stderr by
    rank 0."""
    from .generate import fitted_max_new_tokens

    cap = task.max_response_tokens() if hasattr(task, "max_response_tokens") else DEFAULT_MAX_NEW_TOKENS
    lens = [len(ids) for ids in prompt_ids]
    bs = args.block_size or mcfg.block_size
    n = fitted_max_new_tokens(lens, mcfg.max_position_embeddings, bs, cap=cap)
    if n < cap and env.main:
        print(f"max_new_tokens {n}: what the model's {mcfg.max_position_embeddings} positions leave after the longest "
              f"prompt ({max(lens)} tokens, block {bs}), less than the default {cap}; --max-new-tokens sets it",
              file=sys.stderr, flush=True)
    return n


def _run_on(args, env: DistEnv, device, thresholds, model_dir, label, overlays, task, examples, data_info) -> dict:
    if env.main:
        for path, o in zip(args.overlay, overlays):
            if mismatch := overlay_mismatch(o, args.task, args.data, len(examples)):
                print(f"warning: overlay {path} was computed on {'; '.join(mismatch)}: its curve is not comparable "
                      "with this run's (drawn all the same)", file=sys.stderr, flush=True)
    dtype = resolve_dtype(args.dtype, device)
    mcfg = read_config_checked(model_dir)
    check_block_size(args.block_size, mcfg.max_position_embeddings)
    check_checkpoint_block_size(args.block_size, mcfg.block_size, mcfg.max_position_embeddings, model_dir)
    tokenizer = load_tokenizer_checked(model_dir)
    prompt_ids = None  # encoded once, for the default's fit and for evaluate
    if args.max_new_tokens is None:
        try:
            prompt_ids = _encode(tokenizer, task, examples)
        except ValueError as e:
            raise CLIError(str(e)) from None
        args.max_new_tokens = _default_max_new_tokens(args, env, task, prompt_ids, mcfg)
    model = load_model_checked(model_dir, device, dtype)
    if env.main:
        warn_mask_mismatch(tokenizer, model.config)
    from ._cli import sampler_config_from_args

    cfg = sampler_config_from_args(args, eos_ids_for(tokenizer, model.config.vocab_size))
    try:
        res = evaluate(model, tokenizer, task, examples, thresholds, cfg, batch_size=args.batch_size,
                       progress_bar=not args.quiet and env.main, keep_responses=args.save_responses,
                       truncated_is_wrong=not args.truncated_ok, env=env, prompt_ids=prompt_ids)
    except ValueError as e:
        raise CLIError(str(e)) from None
    res.update(label=label, task=args.task, model=str(model_dir), model_path=str(model_dir.resolve()),
               data=args.data or "synthetic:test",
               **({"data_path": data_key(args.data)} if args.data is not None else {}),
               data_rows=data_info,
               device=str(device), dtype=str(dtype)[6:], date=datetime.datetime.now().isoformat(timespec="seconds"))

    shown = distinct_labels([label, *(o["label"] for o in overlays)], [None, *args.overlay])
    for o, name in zip(overlays, shown[1:]):
        o["label"] = name  # told apart in the table, the legend and `overlays` (the files are not changed)
    runs = [res, *overlays]
    all_pts = [p for r in runs for p in run_points(r)]
    y_max = max((y for _, y in all_pts), default=0.0)
    for r in runs:
        pts = run_points(r)
        r["aup_shared"] = aup(pts, y_max=y_max) if pts else math.nan
    res["aup_shared_y_max"] = y_max
    res["overlays"] = {r["label"]: {"aup": r.get("aup"), "aup_shared": r["aup_shared"], "file": str(path)}
                       for r, path in zip(overlays, args.overlay)}
    if not env.main:  # rank 0 writes and prints
        return res

    json_path = results_path(args.out, label, args.task, args.data)
    png_path = json_path.with_suffix(".png")
    try:
        check_results_target(json_path, model_dir, args.data)  # again: another run may have written it meanwhile
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(json_path, json.dumps(json_safe(res), indent=2, allow_nan=False) + "\n")
    except CLIError:
        print(format_table(res))  # the numbers are not lost with the file
        raise
    except OSError as e:
        print(format_table(res))  # the numbers are not lost with the file
        raise CLIError(f"cannot write the results to {json_path}: {e.strerror or e}") from None
    plotted = plot_curves(runs, png_path, title=f"{args.task}: accuracy vs tokens per forward")

    ranks = f" x {env.world} ranks" if env.active else ""
    skipped = f" ({data_info['skipped']} malformed rows skipped)" if data_info["skipped"] else ""
    print(f"{label} on {args.task} ({len(examples)} examples{skipped}, {device}{ranks}, {res['dtype']}, "
          f"block {res['sampler']['block_size']}, max_new_tokens {cfg.max_new_tokens})")
    print(format_table(res))
    print(f"AUP {res['aup']:.2f} (y_max {res['aup_y_max']:.2f}; accuracy in %, TPF x accuracy units)")
    if overlays:
        print(f"with overlays, shared y_max {y_max:.2f}:")
        for r in runs:
            best = max(r["points"], key=lambda p: p["accuracy"])
            print(f"  {r['label']:<24} AUP {r['aup_shared']:8.2f}   best accuracy {100 * best['accuracy']:.2f}% "
                  f"at TPF {best['mean_tpf']:.3f}")
    print(f"wrote {json_path}")
    print(f"wrote {png_path}" if plotted else "matplotlib is not installed: no PNG (pip install matplotlib)")
    res["json_path"], res["png_path"] = str(json_path), str(png_path) if plotted else None
    return res


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: exit status 0, 2 on bad input (one `error:` line), 130 when interrupted (Ctrl-C: one
    line; the results files are written whole or not at all, so none is left half-written)."""
    try:
        return cli_main(build_parser, run, argv)
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:  # `eval ... | head`: the reader has all it wanted (was a traceback)
        drop_stdout()
        return 141


if __name__ == "__main__":
    sys.exit(main())
