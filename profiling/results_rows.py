"""Turn the JSON lines of benchmark logs into draft rows of profiling/RESULTS.md.

    python profiling/results_rows.py LOG [LOG ...] --commit 3d3d72e [--date 2026-11-24] [--only linear,decode]

Every `bench_*.py` ends with one JSON line (`{"bench": ..., "device": ..., "rows": [...]}`); gpu_session.sh
collects them in bench.log, bench_decode.log, ... This script reads every such line of the given files (other
lines are skipped) and prints one markdown row per benchmark row in RESULTS.md's columns:

    | device (copy GB/s) | date | commit | bench / command | shapes | result | bound | ratio | notes |

Each field of a benchmark row goes to one column by its name: timings and rates (`*_us`, `ms`, `GB/s`,
`TFLOP/s`, `fwd/s`, `tok/s`, memory in `GiB` / `MiB`, ...) to **result**, the physical bound (`bound`, and the
line's own bounds: `gemm_tflops`, the pinned copy bandwidths) to **bound**, fractions of a bound and speed-ups
(`%...`, `... %bw`, `x`, `x_...`, `..._x`, `vs_...`, `speedup`) to **ratio**, text fields named `note(s)` to
**notes**, everything else (sizes, modes, implementation names) to **shapes**, after the line's own shape fields
(dtype, config, vocab, heads, layers, samples, ...). The rows are drafts: read them against the log, then add
what a number means (met / not met, the target) in the notes before pasting them into RESULTS.md. Rows of a CPU
run are dropped unless `--cpu` is given (RESULTS.md holds GPU figures only). A bench stopped before its final
line (a stage's time limit) still has the rows it wrote to stderr as it measured them (`{"bench_row": ...}`
lines, common.RowLog): those become rows with the note "partial".
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable

# top-level fields of a JSON line that describe the shapes of every row (the rest is printed per row)
LINE_SHAPES = ("config", "dtype", "vocab", "block", "hidden", "heads", "hq", "hkv", "head_dim", "inner", "tokens",
               "tpf", "prompt_len", "new_tokens", "layers", "samples", "prompt", "response", "budget")
# top-level fields that are the bound every row's ratio is taken against (beside the device's copy bandwidth)
LINE_BOUNDS = ("gemm_tflops", "h2d_gbs", "d2h_gbs", "duplex_gbs")
RESULT_SUFFIXES = ("_us", "ms", "GB/s", "TFLOP/s", "fwd/s", "tok/s", "GB/fwd", "peakGB", "GiB", "MiB")
RESULT_KEYS = ("s", "us", "fwd")


def is_ratio(k: str) -> bool:
    """A fraction of a bound or a speed-up, by its name: `%...` / `... %bw`, `x_ref`, `wg_x`, `x`, `vs_best`,
    `speedup` (matched as whole name parts: `flex_us` is a time, not an `x_` ratio)."""
    return "%" in k or k == "x" or k.startswith(("x_", "vs_")) or k.endswith("_x") or "speedup" in k


def column(key: str, value: Any) -> str:
    """RESULTS.md column of one field of a benchmark row: shapes, result, bound, ratio or notes."""
    k = key.lower()
    if k in ("note", "notes", "error", "sdpa", "graphs") and isinstance(value, str):
        return "notes"
    if k == "bound" or k.endswith(("_bound", " bound")):
        return "bound"
    if is_ratio(k):
        return "ratio"
    if not isinstance(value, bool) and (key.endswith(RESULT_SUFFIXES) or key in RESULT_KEYS):
        return "result"
    return "shapes"


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        a = abs(value)
        return f"{value:.3g}" if a < 10 else f"{value:.1f}" if a < 1000 else f"{value:.0f}"
    if isinstance(value, (list, tuple)):
        return "/".join(fmt(v) for v in value)
    return str(value)


def json_lines(paths: Iterable[Path]) -> Iterable[tuple[Path, dict]]:
    """(file, object) for every benchmark JSON line of the files: each final line (a "bench" key) as it is, and
    the rows a bench wrote as it measured them (`{"bench_row": ...}`, common.RowLog) gathered into one line of
    their own where no final line of that bench follows them in the file: a bench stopped at its time limit.
    Such a line carries `"partial": true` and each of its rows a note saying so."""
    for path in paths:
        pending: dict[str, dict] = {}  # bench -> a line made of its rows so far
        for line in path.read_text(errors="replace").splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(obj, dict):
                continue
            if "bench_row" in obj and isinstance(obj.get("line"), dict) and isinstance(obj.get("row"), dict):
                bench = str(obj["bench_row"])
                part = pending.setdefault(bench, {"bench": bench, **obj["line"], "partial": True, "rows": []})
                part["rows"].append({**obj["row"], "note": "partial: the bench stopped before its final line"})
            elif "bench" in obj:
                pending.pop(str(obj["bench"]), None)  # the final line holds every row
                yield path, obj
        for part in pending.values():
            yield path, part


def rows_of(obj: dict, commit: str, date: str) -> list[str]:
    """The markdown rows of one benchmark JSON line."""
    copy = obj.get("copy_gbs")
    device = str(obj.get("device", "?")) + (f" ({fmt(float(copy))})" if isinstance(copy, (int, float)) else "")
    line_shapes = [f"{k} {fmt(obj[k])}" for k in LINE_SHAPES if k in obj and obj[k] not in (None, "")]
    line_bounds = [f"{k} {fmt(obj[k])}" for k in LINE_BOUNDS if k in obj and obj[k] not in (None, "")]
    out = []
    for row in obj.get("rows") or []:
        cols: dict[str, list[str]] = {"shapes": list(line_shapes), "result": [], "bound": list(line_bounds),
                                      "ratio": [], "notes": []}
        for key, value in row.items():
            if value in (None, "") or (isinstance(value, float) and math.isnan(value)):
                continue
            cols[column(key, value)].append(fmt(value) if column(key, value) == "notes" else f"{key} {fmt(value)}")
        cells = [device, date, commit, f"bench_{obj['bench']}"] + ["; ".join(cols[c]) for c in
                                                                   ("shapes", "result", "bound", "ratio", "notes")]
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", type=Path, help="log files holding the benchmarks' JSON lines")
    ap.add_argument("--commit", required=True, help="short hash of the code that was measured")
    ap.add_argument("--date", default=datetime.date.today().isoformat(), help="YYYY-MM-DD (default: today)")
    ap.add_argument("--only", default="", help="comma-separated bench names to keep (e.g. linear,decode)")
    ap.add_argument("--cpu", action="store_true", help="keep rows measured on a CPU too")
    args = ap.parse_intermixed_args(argv)  # log files may come after the options too
    missing = [str(p) for p in args.logs if not p.is_file()]
    if missing:
        ap.error(f"no such log file: {', '.join(missing)}")
    only = {b.strip() for b in args.only.split(",") if b.strip()}
    n = 0
    for path, obj in json_lines(args.logs):
        if only and obj["bench"] not in only:
            continue
        if not args.cpu and str(obj.get("device", "")).startswith("cpu"):
            continue
        for row in rows_of(obj, args.commit, args.date):
            try:
                print(row)
            except BrokenPipeError:  # `| head`
                return 0
            n += 1
    print(f"{n} rows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
