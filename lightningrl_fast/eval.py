"""[eval] Accuracy vs parallelism: decode a benchmark at several confidence thresholds, score, report AUP.

    python -m lightningrl_fast.eval --model DIR --task math|code|synthetic [--data FILE]
        [--thresholds 0.5,0.7,0.9,0.95] [--limit N] [--out DIR] [--label NAME] [--overlay other.json ...]
        [--block-size B] [--max-new-tokens N] [--batch-size N] [--temperature 0] [--device ...] [--dtype ...]

For each threshold tau the examples are decoded (greedy by default, REFERENCE §2: evaluation is greedy with
the rollout's block and tau) and scored by the task's verifier (a response cut at --max-new-tokens counts as
wrong unless --truncated-ok, as in the RL reward); per threshold it reports accuracy, mean TPF
(over examples), tokens/s and forwards/s (decode time only, scoring excluded), and the engine's forwards.
`--task synthetic` without `--data` uses the embedded task's held-out test split (`tasks.synthetic`);
with `--data`, a JSONL of {"operands": [a, b, c]} or {"prompt": "a+b+c?"} rows. Math/code read the benchmark
files of `tasks.data.load_examples` (GSM8K, MATH500, MBPP, HumanEval, plain). Code completions run in the
sandboxed verifier, many at a time (`--workers`), math answers through `verify_math_batch` (math-verify helpers
in parallel), and every batch is scored in a background thread while the next batch decodes.

Outputs: a table on stdout; `<out>/<label>.<task>.json` (the points, AUP, sampler settings, device, the model
folder as given and as an absolute path, `model_path`); `<out>/<label>.<task>.png`, the accuracy-vs-TPF curve of
this run with every `--overlay` results file drawn on the same axes (needs matplotlib; without it the PNG is
skipped with a note). Overlays are earlier results JSONs of this tool, e.g. the base model's curve under the
trained model's. The label defaults to the checkpoint folder's name, led by its training run's folder name for a
checkpoint of a run (`--model runs/A` -> `A-checkpoint-1`), so the checkpoints of two runs at the same step do not
share a file. An existing results file of another model is never overwritten (an error before decoding; the
same model's is replaced). Both files are written to a hidden temporary file and renamed into place: an
interrupted run (Ctrl-C: one `error:` line, exit status 130) leaves the earlier file or none, never half of one.
The JSON is strict (no NaN literals): a number that is not finite is written as null: a rate with no decode
time (tokens_per_s, forwards_per_s), an AUP with no point of positive TPF, the TPF of an example not decoded.

AUP (accuracy under parallelism), as d3LLM defines it (Qian et al., "d3LLM: Ultra-Fast Diffusion LLM using
Pseudo-Trajectory Distillation", and its public leaderboard code), on points (rho_i = TPF, y_i = accuracy in
PERCENT, 0..100):
  1. sort the points by TPF (ties: higher accuracy first);
  2. keep the points with y_i >= y_1 - 5, y_1 the accuracy of the lowest-TPF point (a run that loses more than
     five points of accuracy gets no credit for the extra parallelism);
  3. AUP = rho_1 * y_1 + sum_{i>=2} (rho_i - rho_{i-1}) * (y_i W(y_i) + y_{i-1} W(y_{i-1})) / 2, with
     W(y) = min(exp(-3 (1 - y / y_max)), 1): the rectangle under the first point (unweighted) plus the
     trapezoids of the weighted accuracy between consecutive points.
  y_max is the best accuracy among all compared runs (d3LLM normalizes every method of a task by the best
  one): `aup(points)` alone uses the points' own maximum; with overlays the JSON also records each run's AUP
  under the shared y_max (`aup_shared`). The unit of AUP is "TPF x accuracy-percent": a run at 90% with TPF 4
  everywhere scores 360. Raw accuracy and TPF are always reported beside it.

Several GPUs: `torchrun --nproc-per-node N -m lightningrl_fast.eval ...` gives each rank every N-th example;
the per-example results are gathered before the points are computed, so the numbers are those of one process
(greedy decoding; sampled evaluation draws per-rank batches), decoded N times faster; rank 0 prints and writes.

Python API (the trainer calls these): `evaluate(model, tokenizer, task, examples, thresholds, sampler_cfg)`
-> dict, `aup(points, y_max=None)` -> float, `plot_curves(runs, path)`, `load_results(path)`.
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
    from .rl import distributed
    from .rl.distributed import SINGLE, DistEnv, all_gather
    from .sampler import Decoder, prompt_fit_problem
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    print(INTERRUPTED, file=sys.stderr, flush=True)
    sys.exit(130)

DEFAULT_THRESHOLDS = (0.5, 0.7, 0.9, 0.95)
AUP_ALPHA = 3.0
AUP_Y_MIN_OFFSET = 5.0
AUP_DEFINITION = ("d3LLM AUP: points (TPF, accuracy %) sorted by TPF; keep accuracy >= y_1 - 5; "
                  "AUP = rho_1*y_1 + sum trapezoids of y*W(y), W(y) = min(exp(-3(1 - y/y_max)), 1)")


# ------------------------------------------------------------------------------------------------------------
# AUP
# ------------------------------------------------------------------------------------------------------------

def aup_weight(y: float, y_max: float, alpha: float = AUP_ALPHA) -> float:
    """W(y) = min(exp(-alpha (1 - y / y_max)), 1); 1 when y_max is 0 (then every y is 0)."""
    if y_max <= 0:
        return 1.0
    return min(math.exp(-alpha * (1.0 - y / y_max)), 1.0)


def aup(points: Sequence[tuple[float, float]], y_max: float | None = None, *, alpha: float = AUP_ALPHA,
        y_min_offset: float = AUP_Y_MIN_OFFSET) -> float:
    """Accuracy under parallelism of (TPF, accuracy-percent) points; see the module docstring.

    `y_max` defaults to the best accuracy among `points`; pass the best over every compared run to rank runs.
    Accuracies are percentages in [0, 100] (the d3LLM convention; the 5-point filter is in those units).
    """
    pts = [(float(r), float(y)) for r, y in points]
    if not pts:
        raise ValueError("aup needs at least one (tpf, accuracy) point")
    for r, y in pts:
        if not (math.isfinite(r) and r > 0):
            raise ValueError(f"aup: TPF must be a positive number, got {r}")
        if not (math.isfinite(y) and 0 <= y <= 100):
            raise ValueError(f"aup: accuracy must be a percentage in [0, 100], got {y}")
    if y_max is None:
        y_max = max(y for _, y in pts)
    pts.sort(key=lambda p: (p[0], -p[1]))
    floor = pts[0][1] - y_min_offset
    kept = [p for p in pts if p[1] >= floor]
    total = kept[0][0] * kept[0][1]
    for (r0, y0), (r1, y1) in zip(kept, kept[1:]):
        total += 0.5 * (r1 - r0) * (y1 * aup_weight(y1, y_max, alpha) + y0 * aup_weight(y0, y_max, alpha))
    return total


def run_points(result: dict) -> list[tuple[float, float]]:
    """(TPF, accuracy %) of every threshold of a results dict (points with no finite TPF are skipped)."""
    return [(p["mean_tpf"], 100.0 * p["accuracy"]) for p in result["points"]
            if isinstance(p.get("mean_tpf"), (int, float)) and math.isfinite(p["mean_tpf"]) and p["mean_tpf"] > 0]


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
        if not ids:
            raise ValueError(f"example {getattr(ex, 'id', i)!r}: the prompt encodes to no tokens")
        out.append(ids)
    return out


def _decoded_block_size(model, sampler_cfg) -> int:
    """The block size the sampler decodes with: sampler_cfg.block_size (an integer >= 1), None = the model's."""
    bs = sampler_cfg.block_size if sampler_cfg.block_size is not None else model.config.block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"evaluate: block_size must be an integer >= 1, got {bs!r}")
    return bs


def _prompt_problem(p: list[int], mc, sampler_cfg, block_size: int) -> str | None:
    """Why the sampler would refuse prompt `p` with model config `mc` (its own checks, same order), or None."""
    bad = sorted({t for t in p if not 0 <= t < mc.vocab_size})
    if bad:
        return (f"the prompt has token id(s) {bad[:5]} outside the model's vocabulary [0, {mc.vocab_size}) (the "
                f"tokenizer has more ids than the checkpoint's vocab_size)")
    if mc.mask_token_id in p:
        return f"the prompt encodes to the mask token id {mc.mask_token_id} (position {p.index(mc.mask_token_id)})"
    problem = prompt_fit_problem(len(p), sampler_cfg.max_new_tokens, block_size, sampler_cfg.max_length,
                                 mc.max_position_embeddings)
    if problem is not None:
        return f"the prompt does not fit: {problem} (lower max_new_tokens or leave the example out)"
    return None


def _check_prompts(model, examples: list, ids: list[list[int]], sampler_cfg) -> None:
    """Every prompt decodable with these settings, found before decoding (the sampler finds the same problems
    mid-run and names only a batch-local prompt index): ids inside the model's vocabulary, no mask token, and
    prompt + max_new_tokens with the last block rounded up to the decoded block size within the positions
    (`sampler.prompt_fit_problem`). ValueError naming the first bad example's id and counting the others."""
    bs = _decoded_block_size(model, sampler_cfg)
    problems = []
    for i, (ex, p) in enumerate(zip(examples, ids)):
        problem = _prompt_problem(p, model.config, sampler_cfg, bs)
        if problem is not None:
            problems.append(f"example {getattr(ex, 'id', i)!r}: {problem}")
    if problems:
        more = f" (and {len(problems) - 1} more example(s))" if len(problems) > 1 else ""
        raise ValueError(problems[0] + more)


@torch.no_grad()
def evaluate(model, tokenizer, task, examples: Sequence[Any], thresholds: Sequence[float], sampler_cfg,
             *, batch_size: int = 32, progress_bar: bool = False, keep_responses: bool = False,
             truncated_is_wrong: bool = True, on_batch: Callable[[float, int, int], None] | None = None,
             env: DistEnv = SINGLE) -> dict:
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
    returns the points of all examples.

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
    ids = _encode(tokenizer, task, examples)
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
# results files and plots
# ------------------------------------------------------------------------------------------------------------

def load_results(path: str | Path) -> dict:
    """A results JSON written by this tool (checked: a "points" list with accuracy and mean_tpf)."""
    path = Path(path)
    if path.is_dir():
        raise CLIError(f"overlay {path} is a folder, not a results JSON")
    if not path.is_file():
        raise CLIError(f"overlay {path} does not exist")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, the int-digits limit
        raise CLIError(f"overlay {path} is not valid JSON: {e}") from None
    pts = d.get("points") if isinstance(d, dict) else None
    if not isinstance(pts, list) or not pts:
        raise CLIError(f"overlay {path} is not a results file of lightningrl_fast.eval (no \"points\" list)")

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for i, p in enumerate(pts):
        if not isinstance(p, dict) or not all(number(p.get(k)) for k in ("accuracy", "mean_tpf")):
            raise CLIError(f"overlay {path}: point {i} lacks numeric \"accuracy\" / \"mean_tpf\"")
        if not 0 <= p["accuracy"] <= 1:  # NaN fails too
            raise CLIError(f"overlay {path}: point {i} has accuracy {p['accuracy']}; expected a fraction in [0, 1]")
        if not _positive_finite(p["mean_tpf"]):  # json reads NaN / Infinity literals; aup needs TPF > 0
            raise CLIError(f"overlay {path}: point {i} has mean_tpf {p['mean_tpf']}; expected a positive finite "
                           f"number of tokens per forward")
        if p.get("threshold") is not None and not number(p["threshold"]):
            raise CLIError(f"overlay {path}: point {i} has a non-numeric \"threshold\" {p['threshold']!r}")
    d.setdefault("label", path.stem)
    if not isinstance(d["label"], str):
        raise CLIError(f"overlay {path}: \"label\" must be a string, got {d['label']!r}")
    if d.get("sampler") is not None and not isinstance(d["sampler"], dict):
        raise CLIError(f"overlay {path}: \"sampler\" must be an object, got {type(d['sampler']).__name__}")
    return d


def _positive_finite(v: float) -> bool:
    try:
        return math.isfinite(float(v)) and v > 0
    except OverflowError:  # an integer past the float range
        return False


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, inf) replaced by None: a results JSON is strict JSON (a NaN
    literal is not JSON, and other readers reject it); the NaNs of a run are rates with no decode time, an AUP
    with no point, the TPF of an example not decoded (see the module docstring)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _temp_sibling(path: Path) -> Path:
    """A hidden temporary name next to `path` (same folder: the rename is atomic), unique to this process."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary sibling renamed into place: an interrupted or failed write
    leaves the earlier file (or none), never part of one; the temporary file is removed on any exit."""
    path = Path(path)
    tmp = _temp_sibling(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def plot_curves(runs: Sequence[dict], path: str | Path, title: str = "") -> bool:
    """Accuracy (%) vs mean TPF, one line per run (label and AUP in the legend; thresholds annotated).

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    ys: list[float] = []
    for run in runs:
        pts = sorted(((p["mean_tpf"], 100 * p["accuracy"], p.get("threshold")) for p in run["points"]
                      if math.isfinite(p["mean_tpf"])), key=lambda t: t[0])
        if not pts:
            continue
        x, y, taus = zip(*pts)
        a = run.get("aup_shared", run.get("aup"))
        block = (run.get("sampler") or {}).get("block_size")
        label = str(run.get("label", "?")) + (f" b{block}" if block else "")
        if isinstance(a, (int, float)) and math.isfinite(a):
            label += f" (AUP {a:.1f})"
        ax.plot(x, y, marker="o", label=label)
        ys.extend(y)
        for xi, yi, t in zip(x, y, taus):
            if t is not None:
                ax.annotate(f"{t:g}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if ys:  # AUP integrates from TPF 0; accuracy within [0, 100] with a margin
        lo, hi = min(ys), max(ys)
        pad = max(2.0, 0.1 * (hi - lo))
        ax.set_ylim(max(0.0, lo - pad) if lo > 0 else -1.0, min(100.0, hi + pad) if hi < 100 else 101.0)
    ax.set_xlim(left=0)
    ax.set_xlabel("tokens per forward (TPF)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title or "accuracy vs parallelism")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path)  # written whole, then renamed (as the results JSON)
    try:
        fig.savefig(tmp, format=path.suffix[1:] or "png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return True


def format_table(result: dict) -> str:
    wf = all("well_formed" in p for p in result["points"])
    cols = ("threshold", "accuracy%", "verifier%") + (("well_formed%",) if wf else ()) + (
        "mean_tpf", "tokens/s", "forwards/s", "forwards", "truncated", "n")
    rows = []
    for p in result["points"]:
        rows.append((f"{p['threshold']:g}", f"{100 * p['accuracy']:.2f}",
                     f"{100 * p.get('verifier_accuracy', p['accuracy']):.2f}")
                    + ((f"{100 * p['well_formed']:.2f}",) if wf else ())
                    + (f"{p['mean_tpf']:.3f}", f"{p['tokens_per_s']:.1f}", f"{p['forwards_per_s']:.1f}",
                       str(p["forwards"]), str(p["truncated"]), str(p["n"])))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


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
        except (DataFormatError, ValueError) as e:
            raise CLIError(str(e)) from None
        exs = list(loaded)
        info.update(rows=loaded.n_rows, skipped=loaded.skipped, skipped_rows=[str(e) for e in loaded.errors[:100]])
        wrong = [e for e in exs if e.kind != args.task]
        if wrong:
            raise CLIError(f"{args.data}: {len(wrong)} of {len(exs)} examples are {wrong[0].kind!r} problems, "
                           f"not {args.task!r} (e.g. {wrong[0].id}); pick the matching --task")
    return (exs[: args.limit] if args.limit else exs), info


def parse_thresholds(text: str) -> list[float]:
    try:
        vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise CLIError(f"--thresholds {text!r}: expected comma-separated numbers, e.g. 0.5,0.7,0.9") from None
    if not vals:
        raise CLIError("--thresholds: no value given")
    bad = [v for v in vals if not 0 <= v <= 1.0001]
    if bad:
        raise CLIError(f"--thresholds: values must be in [0, 1], got {bad}")
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


def _safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") or "run"


def default_label(model_dir: Path) -> str:
    """The results label without --label: the checkpoint folder's name, led by its run folder's name when it is a
    checkpoint of a training run (`runs/A` or `runs/A/checkpoint-1` -> `A-checkpoint-1`): two runs' checkpoints
    of the same step would otherwise share (and overwrite) one results file."""
    from .rl.checkpointing import LATEST, PREFIX, REFERENCE

    p = model_dir.resolve()
    in_run = p.name.startswith(PREFIX) or p.name == REFERENCE or (p.parent / LATEST).is_file()
    return f"{p.parent.name}-{p.name}" if in_run and p.parent.name else p.name


def results_path(out: str | Path, label: str, task: str) -> Path:
    return Path(out) / f"{_safe_name(label)}.{task}.json"


def _recorded_model(doc: Any) -> Path | None:
    """The model folder a results JSON was written for: `model_path` (absolute), else its `model` (files of
    versions that did not record `model_path`; a relative path is taken from the current folder)."""
    if not isinstance(doc, dict):
        return None
    for key in ("model_path", "model"):
        if isinstance(doc.get(key), str) and doc[key]:
            return Path(doc[key]).resolve()
    return None


def check_results_target(json_path: Path, model_dir: Path) -> None:
    """CLIError when `json_path` exists and is not the results file of this model (a results file of another
    model, or a file that is not a results file): never overwritten. The same model's results are replaced."""
    if not json_path.exists() and not json_path.is_symlink():
        return
    if json_path.is_dir():
        raise CLIError(f"{json_path} is a folder; cannot write the results there (pick another --label or --out)")
    try:
        doc = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        doc = None
    recorded = _recorded_model(doc)
    if recorded is None:
        raise CLIError(f"{json_path} exists and is not a results file of this tool; not overwriting it (move it, or "
                       f"pick another --label or --out)")
    if recorded != model_dir.resolve():
        raise CLIError(f"{json_path} holds the results of another model ({recorded}); not overwriting them with "
                       f"those of {model_dir.resolve()} (pick another --label or --out)")


# ------------------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lightningrl_fast.eval",
                                 description="Accuracy vs tokens-per-forward over confidence thresholds, and AUP.")
    ap.add_argument("--model", required=True, help="checkpoint folder")
    ap.add_argument("--task", required=True, choices=("math", "code", "synthetic"))
    ap.add_argument("--data", default=None, help="benchmark file (optional for --task synthetic: its test split)")
    ap.add_argument("--format", default=None, help="force the data format (gsm8k, math500, mbpp, humaneval, plain)")
    ap.add_argument("--thresholds", default=",".join(f"{t:g}" for t in DEFAULT_THRESHOLDS))
    ap.add_argument("--limit", type=int, default=None, help="first N examples only")
    ap.add_argument("--out", default="eval_results", help="folder for the results JSON and PNG (default eval_results)")
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
                                          "EOS; math and code: 512)")
    return ap


def run(args) -> dict:
    check_decoding_args(args)
    if args.limit is not None and args.limit < 1:
        raise CLIError(f"--limit must be >= 1, got {args.limit}")
    if args.workers is not None and args.workers < 1:
        raise CLIError(f"--workers must be >= 1, got {args.workers}")
    thresholds = parse_thresholds(args.thresholds)
    check_out_folder(args.out)
    model_dir = check_model_dir(args.model)
    label = args.label or default_label(model_dir)
    check_results_target(results_path(args.out, label, args.task), model_dir)
    overlays = [load_results(p) for p in args.overlay]
    task = make_task(args.task, args.workers)
    examples, data_info = load_data(args, task)
    env, device = join_ranks(args.device)
    with distributed.joined(env):
        return _run_on(args, env, device, thresholds, model_dir, label, overlays, task, examples, data_info)


def _run_on(args, env: DistEnv, device, thresholds, model_dir, label, overlays, task, examples, data_info) -> dict:
    dtype = resolve_dtype(args.dtype, device)
    mcfg = read_config_checked(model_dir)
    check_block_size(args.block_size, mcfg.max_position_embeddings)
    check_checkpoint_block_size(args.block_size, mcfg.block_size, mcfg.max_position_embeddings, model_dir)
    tokenizer = load_tokenizer_checked(model_dir)
    if args.max_new_tokens is None:
        args.max_new_tokens = task.max_response_tokens() if hasattr(task, "max_response_tokens") else 512
    model = load_model_checked(model_dir, device, dtype)
    if env.main:
        warn_mask_mismatch(tokenizer, model.config)
    from ._cli import sampler_config_from_args

    cfg = sampler_config_from_args(args, eos_ids_for(tokenizer, model.config.vocab_size))
    try:
        res = evaluate(model, tokenizer, task, examples, thresholds, cfg, batch_size=args.batch_size,
                       progress_bar=not args.quiet and env.main, keep_responses=args.save_responses,
                       truncated_is_wrong=not args.truncated_ok, env=env)
    except ValueError as e:
        raise CLIError(str(e)) from None
    res.update(label=label, task=args.task, model=str(model_dir), model_path=str(model_dir.resolve()),
               data=args.data or "synthetic:test",
               data_rows=data_info,
               device=str(device), dtype=str(dtype)[6:], date=datetime.datetime.now().isoformat(timespec="seconds"))

    runs = [res, *overlays]
    all_pts = [p for r in runs for p in run_points(r)]
    y_max = max((y for _, y in all_pts), default=0.0)
    for r in runs:
        pts = run_points(r)
        r["aup_shared"] = aup(pts, y_max=y_max) if pts else math.nan
    res["aup_shared_y_max"] = y_max
    res["overlays"] = {r["label"]: {"aup": r.get("aup"), "aup_shared": r["aup_shared"]} for r in overlays}
    if not env.main:  # rank 0 writes and prints
        return res

    json_path = results_path(args.out, label, args.task)
    png_path = json_path.with_suffix(".png")
    try:
        check_results_target(json_path, model_dir)  # again: another run may have written it meanwhile
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(json_path, json.dumps(json_safe(res), indent=2, allow_nan=False) + "\n")
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


if __name__ == "__main__":
    sys.exit(main())
