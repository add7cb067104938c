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
