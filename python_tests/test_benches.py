"""Every kernel benchmark script runs on the CPU (reference columns, tiny shapes) and ends with one JSON line.

A GPU lease is rare and short: a benchmark that dies of a Python error in its shared code (argument parsing,
table printing, the JSON summary) would waste it. These runs cover that code on every CI build; the GPU-only
columns are covered by the scripts' own `--cpu`-less paths on a lease. bench_linear and bench_decode have
their own CPU tests (test_linear.py, test_generate.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# script, CPU arguments, the "bench" name its JSON line carries, the timing key every row must have
BENCHES = [
    ("bench_unmask.py", ["--cpu", "--no-compile"], "threshold_unmask", "ref_us"),
    ("bench_rms_norm.py", ["--cpu", "--no-compile"], "rms_norm", "ref_us"),
    ("bench_silu_mul.py", ["--cpu", "--no-compile"], "silu_mul", "ref_us"),
    ("bench_kv_cache.py", ["--cpu"], "kv_cache_write", "ref_us"),
    ("bench_block_attn.py", ["--cpu", "--quick"], "block_attention", "ref_us"),
    ("bench_grpo_loss.py", ["--cpu", "--no-compile", "--iters", "2"], "grpo_loss", None),
]


def _run(script: str, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(REPO / "profiling" / script), *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=str(REPO / "profiling"))


@pytest.mark.parametrize("script,args,name,timing", BENCHES, ids=[b[0] for b in BENCHES])
def test_bench_runs_on_cpu_and_ends_with_one_json_line(script, args, name, timing):
    proc = _run(script, args)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, f"{script} printed nothing"
    result = json.loads(lines[-1])  # the last line is the machine-readable summary
    assert sum(ln.lstrip().startswith("{") for ln in lines) == 1, "exactly one JSON line"
    assert len(lines) >= 3, "a table comes before the JSON line"
    assert result["bench"] == name and result["kernels"] is False
    assert str(result["device"]).startswith("cpu")
    rows = result.get("rows")
    if rows is None:  # bench_grpo_loss: one entry per implementation
        rows = [v for v in result.values() if isinstance(v, dict)] or result.get("results", [])
    assert rows, f"{script}: no rows in {sorted(result)}"
    if timing is not None:
        for row in rows:
            t = row[timing]
            assert isinstance(t, (int, float)) and math.isfinite(t) and t > 0, (script, row)


@pytest.mark.parametrize("args,message", [
    (["--rows", "abc"], "expected comma-separated integers"),
    (["--rows", "0,32"], "expected positive integers"),
    (["--rows", "33"], "multiples of the block"),
])
def test_bench_rejects_a_bad_argument_with_a_usage_error(args, message):
    proc = _run("bench_unmask.py", ["--cpu", *args])
    assert proc.returncode == 2, proc.stderr  # argparse's usage error, not a traceback
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_results_rows_turns_json_lines_into_results_md_rows(tmp_path):
    sys.path.insert(0, str(REPO / "profiling"))
    try:
        import results_rows
    finally:
        sys.path.pop(0)
    gpu = {"bench": "decode", "device": "NVIDIA H100 80GB HBM3", "copy_gbs": 2985.2, "config": "sdar-8b",
           "dtype": "bfloat16", "tpf": 4, "rows": [
               {"batch": 1, "block": 4, "graphs": "on", "impl": "kernels", "fwd/s": 151.234, "tok/s": 604.9,
                "bound": 196.8, "%bw": 76.85, "steady fwd/s": 160.0, "steady %bw": 81.3, "note": ""}]}
    cpu = dict(gpu, device="cpu (2 threads)")
    log = tmp_path / "bench_decode.log"
    log.write_text("=== bench_decode\nsome table\n" + json.dumps(cpu) + "\n" + json.dumps(gpu) + "\n{not json\n")
    rows = [r for _, obj in results_rows.json_lines([log]) if not obj["device"].startswith("cpu")
            for r in results_rows.rows_of(obj, "3d3d72e", "2026-11-24")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert len(cells) == 9
    device, date, commit, bench, shapes, result, bound, ratio, notes = cells
    assert (device, date, commit, bench) == ("NVIDIA H100 80GB HBM3 (2985)", "2026-11-24", "3d3d72e", "bench_decode")
    assert shapes.startswith("config sdar-8b; dtype bfloat16; tpf 4") and "batch 1" in shapes and "impl kernels" in shapes
    assert result == "fwd/s 151.2; tok/s 604.9; steady fwd/s 160.0"
    assert bound == "bound 196.8" and ratio == "%bw 76.8; steady %bw 81.3" and notes == "on"
    # the CLI drops CPU rows unless asked, and names a missing file
    cli = [sys.executable, str(REPO / "profiling" / "results_rows.py"), str(log), "--commit", "3d3d72e"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.count("\n") == 1 and "cpu" not in out.stdout
    out = subprocess.run(cli + ["--cpu"], capture_output=True, text=True, timeout=60)
    assert out.stdout.count("\n") == 2
    out = subprocess.run(cli + [str(tmp_path / "missing.log")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such log file" in out.stderr
