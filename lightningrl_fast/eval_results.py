"""Results of an evaluation: the AUP score, the results files and the accuracy-vs-TPF plot (eval.py writes them,
overlays read them back).

Outputs: a table on stdout; `<out>/<label>.<task>.<data>.json` (the points, AUP, sampler settings, device, the model
folder and the data file as given and as absolute paths, `model_path` / `data_path`), where `<data>` is the data
file's name without its .jsonl / .json / .parquet / .gz ending (`--data gsm8k_test.jsonl` ->
`A.math.gsm8k_test.json`; no `<data>` part for the synthetic task's own test split: `A.synthetic.json`), so the
GSM8K and MATH500 results of one model (both `--task math`) are two files; `<out>/<label>.<task>.<data>.png`, the
accuracy-vs-TPF curve of this run with every `--overlay` results file drawn on the same axes (needs matplotlib;
without it the PNG is skipped with a note). Overlays are earlier results JSONs of this tool, e.g. the base model's
curve under the trained model's; one computed on another task, data file or number of examples than this run gets a
warning on stderr (its curve is drawn all the same), and runs that share a label are told apart in the table, the
legend and the JSON's `overlays` by their file's name (`base [base.math.gsm8k_test.json]`). The label defaults to
the checkpoint folder's name, led by its training run's folder name for a checkpoint of a run (`--model runs/A` ->
`A-checkpoint-1`), so the checkpoints of two runs at the same step do not share a file. An existing results file of
another model, or of the same model on another data file (two files of one name in different folders), is never
overwritten (an error before decoding naming both; the same model's results on the same data are replaced). Both
files are written to a hidden temporary file and renamed into place: an interrupted run (Ctrl-C: one `error:` line,
exit status 130) leaves the earlier file or none, never half of one.
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
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Sequence

from ._cli import CLIError
from ._jsonfile import temp_sibling


AUP_ALPHA = 3.0


AUP_Y_MIN_OFFSET = 5.0


AUP_DEFINITION = ("d3LLM AUP: points (TPF, accuracy %) sorted by TPF; keep accuracy >= y_1 - 5; "
                  "AUP = rho_1*y_1 + sum trapezoids of y*W(y), W(y) = min(exp(-3(1 - y/y_max)), 1)")


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


def overlay_mismatch(overlay: dict, task: str, data: str | Path | None, n_examples: int) -> list[str]:
    """What an overlay (`load_results`) was computed on that this run (`task`, `data`: the --data file or None for
    the synthetic test split, `n_examples`) was not: its task, its data file (`data_key`), its number of examples;
    each as `what X (this run: Y)`. Empty when they agree or the overlay does not record them."""
    out = []
    if isinstance(overlay.get("task"), str) and overlay["task"] != task:
        out.append(f"task {overlay['task']} (this run: {task})")
    theirs, ours = _recorded_data(overlay), data_key(data)
    if (theirs not in (None, SYNTHETIC_TEST) and not isinstance(overlay.get("data_path"), str)
            and data is not None and str(data) != SYNTHETIC_TEST):
        theirs, ours = Path(str(overlay["data"])).name, Path(data).name  # an older file: its `data` as given, maybe
        # relative to another folder than the current one: the file names are what can be compared
    if theirs is not None and theirs != ours:
        out.append(f"data {theirs} (this run: {ours})")
    n = overlay.get("n_examples")
    if isinstance(n, int) and not isinstance(n, bool) and n != n_examples:
        out.append(f"{n} examples (this run: {n_examples})")
    return out


def distinct_labels(labels: Sequence[str], files: Sequence[str | Path | None]) -> list[str]:
    """The labels runs are shown under (table, legend, the JSON's `overlays` keys), told apart: the first (this
    run) keeps its own; a later one (an overlay, `files[i]` its results file) whose label another run has too gets
    its file's name appended, `base [base.math.gsm8k_test.json]`, or the file as given where two such names are
    alike (`base [runs/b/base.math.gsm8k_test.json]`), and then ` #i` (its position) where one is still shown
    twice (the same file given twice)."""
    out = list(labels)
    for i in range(1, len(out)):
        if labels.count(labels[i]) > 1 and files[i] is not None:
            out[i] = f"{labels[i]} [{Path(files[i]).name}]"
    named = list(out)
    for i in range(1, len(out)):
        if named.count(named[i]) > 1 and files[i] is not None and named[i] != labels[i]:
            out[i] = f"{labels[i]} [{files[i]}]"
    for i in range(1, len(out)):
        if out[i] in out[:i]:
            out[i] = f"{out[i]} #{i}"
    return out


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
    tmp = temp_sibling(path)  # written whole, then renamed (as the results JSON)
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


SYNTHETIC_TEST = "synthetic:test"  # the `data` of a run on the synthetic task's own test split (no --data)


def data_stem(data: str | Path) -> str:
    """A data file's name without its container ending (.gz, then .jsonl / .json / .parquet, as `tasks.data`
    reads them): `gsm8k_test.jsonl.gz` -> `gsm8k_test`, `math500.test.jsonl` -> `math500.test`."""
    name = Path(data).name
    for ext in (".gz", ".jsonl", ".json", ".parquet"):
        if name.lower().endswith(ext) and len(name) > len(ext):
            name = name[: -len(ext)]
    return name


def results_path(out: str | Path, label: str, task: str, data: str | Path | None = None) -> Path:
    """`<out>/<label>.<task>.<data stem>.json`, or `<out>/<label>.<task>.json` without a data file (the synthetic
    task's own test split): the results of one model on two benchmarks of one task (GSM8K and MATH500 are both
    `--task math`) are two files."""
    stem = f".{_safe_name(data_stem(data))}" if data is not None and str(data) != SYNTHETIC_TEST else ""
    return Path(out) / f"{_safe_name(label)}.{task}{stem}.json"


def data_key(data: str | Path | None) -> str:
    """What identifies a run's data in its results JSON: the data file's absolute path (`data_path`), or
    `synthetic:test`."""
    if data is None or str(data) == SYNTHETIC_TEST:
        return SYNTHETIC_TEST
    return str(Path(data).resolve())


def _recorded_model(doc: Any) -> Path | None:
    """The model folder a results JSON was written for: `model_path` (absolute), else its `model` (files of
    versions that did not record `model_path`; a relative path is taken from the current folder)."""
    if not isinstance(doc, dict):
        return None
    for key in ("model_path", "model"):
        if isinstance(doc.get(key), str) and doc[key]:
            return Path(doc[key]).resolve()
    return None


def _recorded_data(doc: dict) -> str | None:
    """The data a results JSON was computed on (`data_key`): its `data_path`, else its `data` (files of versions
    that did not record `data_path`; a relative path is taken from the current folder); None if it records none."""
    for key in ("data_path", "data"):
        if isinstance(doc.get(key), str) and doc[key]:
            return data_key(doc[key])
    return None


def check_results_target(json_path: Path, model_dir: Path, data: str | Path | None = None) -> None:
    """CLIError when `json_path` exists and is not the results file of this model on this data (a results file of
    another model, of this model on another data file (`data`: the --data file, None for the synthetic test
    split), or a file that is not a results file): never overwritten. The same model's results on the same data
    are replaced."""
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
    theirs, ours = _recorded_data(doc), data_key(data)
    if theirs is not None and theirs != ours:
        raise CLIError(f"{json_path} holds this model's results on another data file ({theirs}); not overwriting "
                       f"them with those on {ours} (pick another --label or --out)")
