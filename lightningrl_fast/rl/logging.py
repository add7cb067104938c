"""[logging] Per-step progress, metrics.jsonl, the end-of-run summary table and PNG plots.

* `RunLogger(out_dir, total_steps, progress="auto")`: `log_step(metrics)` appends one JSON object per step to
  `out_dir/metrics.jsonl` (flushed at once; NaN/inf written as null) and shows progress (`progress`): a tqdm bar
  on a terminal when tqdm is installed, else one plain line per step (`step_line`):

      step 12/200 | acc 0.938 tpf 3.41 reward 4.350 | loss 0.0312 kl 0.0009 clip 0.040 groups 16 | 5321 tok/s |
      rollout 2.10s logprob 0.05s train 0.31s (2.5s)

  On resume, `RunLogger(..., truncate_to=n)` keeps the first n lines (those covered by the checkpoint); a
  malformed line before the last one (or bytes that are not UTF-8) is a `MetricsFileError` naming the line, not
  a reason to drop the records after it.
* `format_table(headers, rows)`: a plain-text table; `sweep_table` and `before_after_table` format
  evaluation results (`{threshold: {"acc", "tpf", ...}}`).
* `plot_training(history, path)` (accuracy and TPF over RL steps) and `plot_sweep(sweeps, path)` (the
  accuracy-TPF curve over the threshold sweep, one per label: before vs after RL): matplotlib with the Agg backend;
  when matplotlib is missing they print one line and return None.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TextIO

from .._jsonfile import write_text_atomic

METRICS_FILE = "metrics.jsonl"


def _clean(v: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None, tuples -> lists, tensors/numpy scalars -> Python numbers."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    if hasattr(v, "item"):
        try:
            return _clean(v.item())
        except (ValueError, RuntimeError):
            pass
    return str(v)


class MetricsFileError(ValueError):
    """A metrics.jsonl that cannot be continued without losing records (the message names the file and line)."""


def read_metrics(path: str | Path, strict: bool = False) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a trailing partial line from a killed run is ignored).

    strict=False stops at the first malformed line; strict=True (a resumed run, which rewrites the file from
    what it read) raises MetricsFileError for a malformed line that more records follow, or undecodable bytes."""
    out: list[dict[str, Any]] = []
    p = Path(path)
    if p.is_dir() and p.name != METRICS_FILE:  # a run folder (a folder named metrics.jsonl is not a file: below)
        p = p / METRICS_FILE
    if not p.is_file():
        if strict and p.exists():
            raise MetricsFileError(f"{p} is not a file")
        return out
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if strict:
            line_no = raw[:e.start].count(b"\n") + 1
            raise MetricsFileError(f"{p}:{line_no}: not UTF-8 text (byte {e.start}); the file is corrupt: repair "
                                   "or remove that line (or the file)") from None
        text = raw.decode("utf-8", errors="replace")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            rec, err = None, str(e)
        else:
            err = None if isinstance(rec, dict) else f"a JSON {type(rec).__name__}, not an object"
        if err is not None:
            if strict and any(rest.strip() for rest in lines[i + 1:]):
                raise MetricsFileError(f"{p}:{i + 1}: not a metrics record ({err}) and {len(lines) - i - 1} "
                                       "line(s) follow it: the file is corrupt; repair or remove that line")
            break  # a partial last line of a killed run
        out.append(rec)
    return out


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def step_line(m: dict[str, Any], total: int | None = None) -> str:
    """The one-line summary of a step's metrics (also the tqdm postfix)."""
    step = m.get("step", "?")
    head = f"step {step}/{total}" if total else f"step {step}"
    parts = [head,
             f"acc {_fmt(m.get('acc'), '.3f')} tpf {_fmt(m.get('tpf'), '.2f')} reward {_fmt(m.get('reward'), '.3f')}"]
    if "skipped" in m:
        parts.append(f"skipped: {m['skipped']}")
    else:
        parts.append(f"loss {_fmt(m.get('loss'), '.4f')} kl {_fmt(m.get('kl'), '.4f')} "
                     f"clip {_fmt(m.get('clip_frac'), '.3f')} groups {m.get('groups_kept', '-')}")
    parts.append(f"{_fmt(m.get('tokens_per_s'), '.0f')} tok/s")
    stages = " ".join(f"{k[:-2]} {_fmt(m.get(k), '.2f')}s" for k in ("rollout_s", "logprob_s", "train_s") if k in m)
    if stages or "step_s" in m:
        parts.append(f"{stages} ({_fmt(m.get('step_s'), '.1f')}s)".strip())
    if m.get("nonfinite_skipped"):
        parts.append(f"NON-FINITE update skipped x{m['nonfinite_skipped']}")
    return " | ".join(parts)


class RunLogger:
    """metrics.jsonl + progress display for one run (see the module docstring)."""

    def __init__(self, out_dir: str | Path, total_steps: int | None = None, progress: str = "auto",
                 truncate_to: int | None = None, initial_step: int = 0, stream: TextIO | None = None,
                 print_fn: Callable[[str], None] | None = None, write: bool = True) -> None:
        """write=False (the ranks > 0 of a data-parallel run): keep the history in memory, touch no file, print
        nothing."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        self.total = total_steps
        self.stream = stream or sys.stdout
        self._print = print_fn or (lambda s: print(s, file=self.stream, flush=True))
        self.history: list[dict[str, Any]] = read_metrics(self.path, strict=True) if write else []
        if write and truncate_to is not None:
            self.history = self.history[:truncate_to]
            self._rewrite()
        elif write and self.history:  # drop a trailing partial line of a killed run
            self._rewrite()
        self._file = open(self.path, "a", encoding="utf-8") if write else None
        self._bar = None
        mode = progress if write else "off"
        if mode == "auto":
            mode = "bar" if _has_tqdm() and getattr(self.stream, "isatty", lambda: False)() else "plain"
        if mode == "bar" and not _has_tqdm():
            mode = "plain"
        self.mode = mode
        if mode == "bar":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc="RL", file=self.stream, dynamic_ncols=True)

    def _rewrite(self) -> None:
        write_text_atomic(self.path, "".join(json.dumps(rec) + "\n" for rec in self.history))

    @property
    def n_logged(self) -> int:
        return len(self.history)

    def log_step(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Append one step's metrics (adds `time`), show progress; returns the cleaned record."""
        rec = _clean(dict(metrics))
        rec.setdefault("time", time.time())
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        self.history.append(rec)
        if self.mode == "off":
            return rec
        line = step_line(rec, self.total)
        if self._bar is not None:
            self._bar.set_postfix_str(line.split(" | ", 1)[1], refresh=False)
            self._bar.update(1)
        else:
            self._print(line)
        return rec

    def info(self, msg: str) -> None:
        """A message that does not break the progress bar."""
        if self._bar is not None:
            self._bar.write(msg, file=self.stream)
        elif self.mode != "off":
            self._print(msg)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None and not self._file.closed:
            self._file.close()

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _has_tqdm() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------------------

def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Plain-text table, columns right-aligned except the first."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def _key(sweep: dict, tau: float) -> Any:
    for k in sweep:
        if abs(float(k) - tau) < 1e-9:
            return k
    return None


def sweep_table(sweeps: dict[str, dict], title: str | None = None) -> str:
    """One row per threshold, columns acc/TPF per labelled sweep ({label: {tau: {"acc", "tpf"}}})."""
    taus = sorted({float(k) for s in sweeps.values() for k in s})
    headers = ["tau"] + [f"{lab} {c}" for lab in sweeps for c in ("acc", "TPF")]
    rows = []
    for t in taus:
        row = [f"{t:g}"]
        for s in sweeps.values():
            k = _key(s, t)
            r = s.get(k, {}) if k is not None else {}
            row += [_fmt(r.get("acc"), ".3f"), _fmt(r.get("tpf"), ".2f")]
        rows.append(row)
    table = format_table(headers, rows)
    return f"{title}\n{table}" if title else table


def before_after_table(before: dict, after: dict, threshold: float, labels: tuple[str, str] = ("before", "after"),
                       extra_rows: dict[str, dict] | None = None) -> str:
    """The headline table at one threshold: accuracy, TPF, forwards per answer and the well-formed fraction
    (the last two when the records have them)."""
    present = [c for c in ("fwd_per_answer", "well_formed")
               if any(c in (s.get(_key(s, threshold)) or {}) for s in (before, after))]
    cols = ["acc", "tpf"] + present
    fmts = {"acc": ".3f", "tpf": ".2f", "fwd_per_answer": ".2f", "well_formed": ".3f"}
    rows = []
    runs = {labels[0]: before, labels[1]: after, **(extra_rows or {})}
    for lab, s in runs.items():
        k = _key(s, threshold)
        r = s.get(k, {}) if k is not None else {}
        rows.append([lab] + [_fmt(r.get(c), fmts[c]) for c in cols])
    b, a = (before.get(_key(before, threshold)) or {}), (after.get(_key(after, threshold)) or {})
    if b and a:
        rows.append(["change"] + [_fmt((a.get(c) - b.get(c)) if a.get(c) is not None and b.get(c) is not None else None,
                                       "+" + fmts[c]) for c in cols])
    heads = {"tpf": "TPF", "fwd_per_answer": "fwd/answer"}
    return f"tau = {threshold:g}\n" + format_table(["model"] + [heads.get(c, c) for c in cols], rows)


# ------------------------------------------------------------------------------------------------------------
# plots
# ------------------------------------------------------------------------------------------------------------

def _pyplot(log: Callable[[str], None] | None):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        (log or print)("plots skipped: matplotlib is not installed (pip install matplotlib)")
        return None


def plot_training(history: Sequence[dict[str, Any]], path: str | Path, log: Callable[[str], None] | None = None,
                  evals: Sequence[dict[str, Any]] | None = None, eval_label: str = "eval (greedy)",
                  kept: dict[str, Any] | None = None) -> Path | None:
    """Accuracy and TPF of the rollouts over RL steps (and greedy eval points when given, named `eval_label` in
    the legend; `kept`: the evaluation --select-best kept, {step, acc, tpf}, marked with a star) -> PNG."""
    plt = _pyplot(log)
    if plt is None:
        return None
    steps = [m.get("step") for m in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((ax1, "acc", "accuracy"), (ax2, "tpf", "TPF (tokens per forward)")):
        ys = [m.get(key) for m in history]
        ax.plot(steps, [y if y is not None else float("nan") for y in ys], label="rollouts (sampled)", alpha=0.8)
        if evals:
            ax.plot([e["step"] for e in evals], [e.get(key) for e in evals], "o-", label=eval_label)
        if kept:
            ax.plot([kept["step"]], [kept[key]], "*", markersize=16, color="tab:red",
                    label=f"kept: step {kept['step']} (best-model)")
        ax.set_xlabel("RL step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("LightningRL training")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(sweeps: dict[str, dict], path: str | Path, log: Callable[[str], None] | None = None,
               title: str = "accuracy vs TPF over the threshold sweep") -> Path | None:
    """Accuracy (y) against TPF (x), one curve per labelled sweep, points annotated with tau -> PNG."""
    plt = _pyplot(log)
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, s in sweeps.items():
        pts = sorted((float(k), v) for k, v in s.items())
        xs, ys = [v.get("tpf") for _, v in pts], [v.get("acc") for _, v in pts]
        ax.plot(xs, ys, "o-", label=label)
        for (t, _), x, y in zip(pts, xs, ys):
            if x is not None and y is not None:
                ax.annotate(f"{t:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("TPF (tokens per forward)")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
