"""Every kernel benchmark script runs on the CPU (reference columns, tiny shapes) and ends with one JSON line.

A GPU lease is rare and short: a benchmark that dies of a Python error in its shared code (argument parsing,
table printing, the JSON summary) would waste it. These runs cover that code on every CI build; the GPU-only
columns are covered by the scripts' own `--cpu`-less paths on a lease. bench_linear and bench_decode have
their own CPU tests (test_linear.py, test_generate.py).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import find_cuobjdump

REPO = Path(__file__).resolve().parents[1]


def profiling_module(name: str):
    """A module of profiling/ (a bench script or common.py), imported as the benches import each other."""
    sys.path.insert(0, str(REPO / "profiling"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


# script, CPU arguments, the "bench" name its JSON line carries, the timing key every row must have
BENCHES = [
    ("bench_unmask.py", ["--cpu", "--no-compile"], "threshold_unmask", "ref_us"),
    ("bench_rms_norm.py", ["--cpu", "--no-compile"], "rms_norm", "ref_us"),
    ("bench_silu_mul.py", ["--cpu", "--no-compile"], "silu_mul", "ref_us"),
    ("bench_kv_cache.py", ["--cpu"], "kv_cache_write", "ref_us"),
    ("bench_block_attn.py", ["--cpu", "--quick"], "block_attention", "ref_us"),
    ("bench_grpo_loss.py", ["--cpu", "--no-compile", "--iters", "2"], "grpo_loss", "ms"),
    ("bench_rl_step.py", ["--cpu", "--iters", "1"], "rl_step", "ms"),
    ("bench_optim.py", ["--cpu", "--iters", "2"], "optim", "ms"),
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
    # each row was also written to stderr as it was measured (common.RowLog): what a stopped bench leaves
    progress = [json.loads(ln) for ln in proc.stderr.splitlines() if ln.startswith('{"bench_row"')]
    def same(a, b):  # the final line may round what the row line gives in full
        if isinstance(a, float) and isinstance(b, (int, float)):
            return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3) or (math.isnan(a) and math.isnan(b))
        return a == b

    assert len(progress) == len(result["rows"]), (script, proc.stderr[-2000:])
    for p, row in zip(progress, result["rows"]):
        assert p["row"].keys() == row.keys() and all(same(p["row"][k], row[k]) for k in row), (p["row"], row)
    assert {p["bench_row"] for p in progress} == {name} and all(p["line"]["device"] == result["device"]
                                                                 for p in progress)
    if name == "grpo_loss":  # the CPU run times the reference and the dense loss
        assert {"reference", "dense"} <= {row.get("path") for row in rows}, rows
    if timing is not None:
        for row in rows:
            if name == "grpo_loss" and row.get("path") == "liger":  # Liger needs a GPU: "n/a" on the CPU
                continue
            t = row[timing]  # a row that failed ("failed") or timed nothing is not a number
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
    results_rows = profiling_module("results_rows")
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
    # a bench stopped before its final line: the rows it wrote as it measured them, noted "partial"; rows of a
    # bench whose final line follows them are not repeated
    part = tmp_path / "bench.log"
    line = {"device": "NVIDIA H200", "copy_gbs": 4100.0, "dtype": "bfloat16", "hq": 32}
    part.write_text("\n".join(json.dumps(x) for x in [
        {"bench_row": "threshold_unmask", "line": {"device": "NVIDIA H200"}, "row": {"rows": 32, "kernel_us": 9.0}},
        {"bench": "threshold_unmask", "device": "NVIDIA H200", "rows": [{"rows": 32, "kernel_us": 9.0}]},
        {"bench_row": "block_attention", "line": line, "row": {"B": 1, "block": 4, "kernel_us": 20.5}},
        {"bench_row": "block_attention", "line": line, "row": {"B": 32, "block": 32, "kernel_us": 99.0}},
    ]) + "\n=== bench_block_attn.py --quick: rc=124 in 150s\n")
    objs = [obj for _, obj in results_rows.json_lines([part])]
    assert [(o["bench"], o.get("partial", False), len(o["rows"])) for o in objs] == [
        ("threshold_unmask", False, 1), ("block_attention", True, 2)]
    rows = results_rows.rows_of(objs[1], "abc1234", "2026-11-28")
    assert len(rows) == 2 and all("partial: the bench stopped before its final line" in r for r in rows)
    assert rows[0].startswith("| NVIDIA H200 (4100) |") and "dtype bfloat16; hq 32; B 1; block 4" in rows[0]
    assert "block 32" in rows[1] and "kernel_us 99.0" in rows[1]
    # each field of the other benches in its column by its name: a FlexAttention time is a result (it holds "x_"),
    # the padded / packed speed-up "x" and every %, x_, _x, vs_ field a ratio, memory a result, and the line's
    # own shapes and bounds (grpo_loss' GEMM rate, bench_optim's pinned copy bandwidths) on every row
    def cells_of(obj):
        return [dict(zip(("device", "date", "commit", "bench", "shapes", "result", "bound", "ratio", "notes"),
                         (c.strip() for c in r.strip("|").split("|")))) for r in results_rows.rows_of(obj, "c", "d")]

    attn = cells_of({"bench": "block_attention", "device": "H100", "rows": [
        {"B": 1, "kernel_us": 20.0, "flex_us": 40.0, "fa_us": 30.0, "wg_x": 1.1, "vs_best": 0.5, "vs_flex": 0.5,
         "%copy": 80.0, "l2": "cold"}]})[0]
    assert attn["result"] == "kernel_us 20.0; flex_us 40.0; fa_us 30.0", attn
    assert attn["ratio"] == "wg_x 1.1; vs_best 0.5; vs_flex 0.5; %copy 80.0" and "l2 cold" in attn["shapes"]
    rl = cells_of({"bench": "rl_step", "device": "H100", "samples": 64, "budget": 16384, "prompt": [64, 320],
                   "rows": [{"mode": "trace", "path": "packed", "ms": 10.0, "ktok/s": 90.0, "x": 2.5,
                             "peak_GiB": 3.0}]})[0]
    assert rl["ratio"] == "x 2.5" and rl["result"] == "ms 10.0; ktok/s 90.0; peak_GiB 3", rl
    assert rl["shapes"].startswith("samples 64; prompt 64/320; budget 16384; mode trace"), rl
    optim = cells_of({"bench": "optim", "device": "H100", "layers": 4, "h2d_gbs": 50.5, "d2h_gbs": 48.0,
                      "duplex_gbs": 45.0, "rows": [
        {"variant": "offload", "ms": 90.0, "peak_MiB": 512.0, "host_GiB": 12.0, "PCIe_GB/s": 40.0, "%bound": 80.0}]})[0]
    assert optim["result"] == "ms 90.0; peak_MiB 512.0; host_GiB 12.0; PCIe_GB/s 40.0", optim
    assert optim["bound"] == "h2d_gbs 50.5; d2h_gbs 48.0; duplex_gbs 45.0" and optim["ratio"] == "%bound 80.0"
    assert optim["shapes"] == "layers 4; variant offload", optim
    grpo = cells_of({"bench": "grpo_loss", "device": "H100", "gemm_tflops": 738.0, "rows": [
        {"path": "kernel", "ms": 93.6, "%gemm": 88.6}]})[0]
    assert grpo["bound"] == "gemm_tflops 738.0" and grpo["ratio"] == "%gemm 88.6", grpo
    # the CLI drops CPU rows unless asked, and names a missing file
    cli = [sys.executable, str(REPO / "profiling" / "results_rows.py"), str(log), "--commit", "3d3d72e"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.count("\n") == 1 and "cpu" not in out.stdout
    out = subprocess.run(cli + ["--cpu"], capture_output=True, text=True, timeout=60)
    assert out.stdout.count("\n") == 2
    out = subprocess.run(cli + [str(tmp_path / "missing.log")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such log file" in out.stderr


# ------------------------------------------------------------------------------------------------ gpu_session.sh

def _session(stages: list[str], repo: Path, out: Path, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, OUT=str(out), CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run(["bash", str(repo / "profiling" / "gpu_session.sh"), *stages], cwd=str(repo),
                          capture_output=True, text=True, timeout=600, env=full_env)


def _installed_extension() -> Path:
    import torch  # noqa: F401  (_C links torch's libraries)

    from lightningrl_fast import _ext

    mod = _ext.ext()
    if mod is None:
        pytest.skip("lightningrl_fast._C is not built")
    return Path(mod.__file__)


def test_gpu_session_sass_stage_reads_the_installed_extension(tmp_path):
    """The lease's SASS stage finds the extension (torch imported first) and cuobjdump, and writes the mix."""
    so = _installed_extension()
    exe = find_cuobjdump()
    import lightningrl_fast._C as C

    if not C.has_cuda() or exe is None:
        pytest.skip("needs a CUDA build and cuobjdump")
    proc = _session(["sass"], REPO, tmp_path, PATH=os.path.dirname(exe) + os.pathsep + os.environ["PATH"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (tmp_path / "sass.log").read_text()
    assert so.name in log or "sm_90a" in log  # --list-elf of the library
    for k in ("block_attn", "linear_kernel", "rms_norm"):
        section = log.split(f"--- {k}: instruction mix", 1)[1].split("---", 1)[0]
        assert "MMA" in section or "FFMA" in section or "FADD" in section, (k, section[:300])


def test_gpu_session_prebuilt_stage_and_budget(tmp_path):
    """A later call reuses the build of the same sources (`prebuilt`), refuses one of other sources, and keeps to
    its time budget (stages that would get < 30 s are skipped, not killed)."""
    import gzip
    import re
    import shutil

    so = _installed_extension()
    repo = tmp_path / "repo"
    for item in ("csrc", "lightningrl_fast", "profiling"):
        shutil.copytree(REPO / item, repo / item, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "setup.py", repo / "setup.py")
    out = tmp_path / "out"
    proc = _session(["prebuilt"], repo, out)
    assert proc.returncode == 1
    want = re.search(r"no (\S+/_C-[0-9a-f]{12}\.so\.gz)", proc.stdout + proc.stderr)
    assert want, proc.stdout + proc.stderr
    gz = Path(want.group(1))
    gz.parent.mkdir(parents=True, exist_ok=True)
    gz.write_bytes(gzip.compress(so.read_bytes(), compresslevel=1))
    (repo / "csrc" / "launch.h").write_text((repo / "csrc" / "launch.h").read_text() + "\n// edited\n")
    proc = _session(["prebuilt"], repo, out)  # the sources changed: that build is not theirs
    assert proc.returncode == 1 and "carry .prebuilt with the build of these sources" in proc.stdout
    shutil.copy(REPO / "csrc" / "launch.h", repo / "csrc" / "launch.h")
    proc = _session(["prebuilt", "kernels"], repo, out, GPU_SESSION_BUDGET_S="45")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{repo}/lightningrl_fast/_C" in (out / "build.log").read_text()  # the unpacked library was imported
    bench = (out / "bench.log").read_text()
    # the first bench ran within what was left (or was already skipped on a slow machine); the last, after six
    # script starts, cannot fit into 45 s and is skipped with a line instead of the call being killed
    assert re.search(r"=== bench_unmask\.py( \(limit \d+s\)|: skipped)", bench), bench[:500]
    assert re.search(r"=== bench_grpo_loss.py: skipped, -?\d+s left of the 45s budget", bench), bench[-2000:]


def test_gpu_session_build_is_skipped_on_a_warm_machine_and_presets_keep_the_budget(tmp_path):
    """A second call on the same warm machine: `build` does nothing when the installed package was built from
    these sources (and would build otherwise); the lease presets expand to their stages and keep to the budget."""
    import shutil

    _installed_extension()
    repo = tmp_path / "repo"
    for item in ("csrc", "profiling"):
        shutil.copytree(REPO / item, repo / item, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "setup.py", repo / "setup.py")
    src_hash = subprocess.run(["bash", "-c", "find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum | "
                               "sha256sum | cut -c1-12"], cwd=str(repo), capture_output=True, text=True,
                              check=True).stdout.strip()
    hash_file = tmp_path / "installed_hash"
    hash_file.write_text(src_hash + "\n")
    out = tmp_path / "out"
    # budget 30: every stage after the (skipped) build gets < 30 s and is skipped, none of them runs here
    proc = _session(["lease2"], repo, out, LRF_INSTALLED_HASH_FILE=str(hash_file), GPU_SESSION_BUDGET_S="30")
    assert proc.returncode == 124, proc.stdout + proc.stderr  # the last stage's status: skipped for the budget
    assert f"build: skipped, this machine has lightningrl_fast installed from these sources ({src_hash})" \
        in proc.stdout
    for name in ("bench_block_attn.py --quick", "bench_unmask.py quick", "bench_decode128", "bench_decode_pack"):
        assert f"=== {name}: skipped" in proc.stdout, proc.stdout
    assert "pip install" not in (out / "build.log").read_text()
    # other sources installed: the stage would build (checked without building: budget too small to start it)
    hash_file.write_text("000000000000\n")
    proc = _session(["build"], repo, out, LRF_INSTALLED_HASH_FILE=str(hash_file), GPU_SESSION_BUDGET_S="30")
    assert "build: skipped, this machine" not in proc.stdout
    assert "=== build: skipped" in proc.stdout and proc.returncode == 1


def test_gpu_session_tests_stage_runs_files_in_parallel_and_joins_their_logs(tmp_path):
    """The tests stage runs one pytest per file, several at once, then every file's random-configuration tests in
    one last run, and joins their logs in that order (here without a GPU: every GPU test skips, so each run ends
    at once with rc 0)."""
    _installed_extension()
    out = tmp_path / "out"
    proc = _session(["tests"], REPO, out, GPU_TESTS="rms_norm silu_mul linear", GPU_TEST_JOBS="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (out / "tests.log").read_text()
    heads = [line.split()[2] for line in log.splitlines() if line.startswith("=== tests ") and "rc=" in line]
    assert heads == ["test_rms_norm.py:", "test_silu_mul.py:", "test_linear.py:", "random"], log[-3000:]
    assert sum(line.startswith("=== tests ") and "rc=0 in" in line for line in log.splitlines()) == 4
    per_file, last = log.split("=== tests random configurations")[:2]
    assert "random_config" not in per_file and "test_gpu_random_config" in last  # -v names each skipped test
    assert "skipped" in log
    assert "=== launcher checks: rc=" in log
    assert not (out / "tests_parts").exists()


# ------------------------------------------------------------------------------------------------ common.py helpers

def test_rotation_spans_twice_l2_with_the_read_bytes_and_says_when_it_cannot(monkeypatch):
    common = profiling_module("common")
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    monkeypatch.setattr(common, "l2_bytes", lambda device: 50 << 20)
    # block_attn B1 x cache 512 (2.1 MB of K/V) needs 50 copies: the old cap of 16 left them in L2 (34 MB)
    kv = 2 * 1 * 8 * 516 * 128 * 2
    sets = common.rotation(kv, cuda)
    assert sets == 50 and common.l2_state(kv, sets, cuda) == "cold"
    assert common.l2_state(kv, 16, cuda) == "warm"
    # a kv_cache write of B128 x 4 new tokens reads 2.1 MB of k/v: counted as read + written bytes (4.2 MB) its
    # 24 copies spanned 1x L2 only
    kv_new = 2 * 128 * 4 * 8 * 128 * 2
    assert common.l2_state(kv_new, common.rotation(kv_new, cuda), cuda) == "cold"
    assert common.l2_state(kv_new, common.rotation(2 * kv_new, cuda), cuda) == "warm"
    # tiny inputs cannot be rotated out of L2 within the cap: labelled, not claimed as DRAM
    assert common.rotation(16 << 10, cuda) == 64 and common.l2_state(16 << 10, 64, cuda) == "warm"
    assert common.rotation(1 << 30, cuda) == 1 and common.l2_state(1 << 30, 1, cuda) == "cold"
    assert common.rotation(kv, torch.device("cpu")) == 1 and common.l2_state(kv, 1, torch.device("cpu")) == "-"


def test_device_time_falls_back_to_eager_over_every_input_set_and_says_so():
    common = profiling_module("common")
    calls = [0, 0, 0]

    def make(i):
        def fn():
            calls[i] += 1
        return fn

    us, how = common.device_time([make(i) for i in range(3)], torch.device("cpu"))
    assert how == "eager" and us > 0
    assert min(calls) >= 10 and max(calls) - min(calls) <= 1, calls  # not fns[0] alone (an input set kept in L2)


def test_column_times_label_the_columns_timed_eagerly(monkeypatch):
    """A row's `timing`: "graph" when every column was captured, else "eager: " and the columns whose capture
    failed, in timing order; off CUDA nothing is labelled eager (there is no graph to fail)."""
    common = profiling_module("common")
    how = {"a_us": "graph", "b_us": "eager", "c_us": "eager"}
    monkeypatch.setattr(common, "device_time", lambda fns, device: (float(len(fns)), how[fns[0]()]))
    timed = common.ColumnTimes(torch.device("cuda"))
    assert timed("a_us", [lambda: "a_us"]) == 1.0 and timed.label() == "graph"
    assert timed("b_us", [lambda: "b_us"] * 2) == 2.0 and timed("c_us", [lambda: "c_us"]) == 1.0
    assert timed.label() == "eager: b_us,c_us"
    cpu = common.ColumnTimes(torch.device("cpu"))
    cpu("b_us", [lambda: "b_us"])
    assert cpu.label() == "graph"


def test_kernels_dispatched_follows_the_ops_dispatch_and_lrf_disable_kernels(monkeypatch):
    """The kernel columns of bench_decode / grpo_loss / rl_step / kv_cache / unmask go through the public ops, which
    run their references under LRF_DISABLE_KERNELS=1: the benches label their rows by this, not by the build."""
    import types

    from lightningrl_fast import _ext

    common = profiling_module("common")
    assert common.kernels_dispatched(torch.device("cpu"), "kv_cache_write") is False
    fake = types.SimpleNamespace(kv_cache_write=object(), threshold_unmask=object(), has_cuda=lambda: True)
    monkeypatch.setattr(_ext, "ext", lambda: fake)
    monkeypatch.setattr(_ext, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: types.SimpleNamespace(is_cuda=True))  # no GPU here
    monkeypatch.delenv("LRF_DISABLE_KERNELS", raising=False)
    cuda = torch.device("cuda")
    assert common.kernels_dispatched(cuda, "kv_cache_write", "threshold_unmask") is True
    assert common.kernels_dispatched(cuda, "kv_cache_write", "block_attention") is False  # not in this build
    monkeypatch.setenv("LRF_DISABLE_KERNELS", "1")
    assert common.kernels_dispatched(cuda, "kv_cache_write") is False
    monkeypatch.setattr(_ext, "has_cuda_kernels", lambda: False)
    monkeypatch.delenv("LRF_DISABLE_KERNELS")
    assert common.kernels_dispatched(cuda, "kv_cache_write") is False



def test_bench_decode_steady_bound_uses_the_context_of_the_differenced_forwards():
    bd = profiling_module("bench_decode")
    from lightningrl_fast.model import SDARConfig

    cfg = SDARConfig(**bd.CONFIGS["sdar-8b"])
    assert bd.mean_context(64, 0, 256) == 64 + 128  # the whole call
    assert bd.mean_context(64, 128, 256) == 64 + 192  # the full call minus the half-length call
    # batch 256: the KV read per forward at the steady forwards' context is 2.4 GB more than the call's mean
    extra = (bd.kv_bytes(cfg, 256, bd.mean_context(64, 128, 256), 2)
             - bd.kv_bytes(cfg, 256, bd.mean_context(64, 0, 256), 2))
    assert abs(extra - 36 * 2 * 8 * 128 * 2 * 256 * 64) < 1 and extra > 2.4e9


@pytest.mark.parametrize("kw", [
    dict(threshold=1.01, rule="quota", steps_per_block=2, temperature=0),  # bench_decode's forced TPF
    dict(threshold=0.4, temperature=0, eos=True),  # variable TPF, EOS: rows stop at different blocks
])
def test_bench_decode_flops_count_the_engines_work(monkeypatch, kw):
    """decode_flops, from a Rollout alone, equals the work the engine really did, counted as it runs: every token a
    forward carried (prefill, steps, folded commits: the chunk lengths given to hidden_cached, at their absolute
    positions, each seeing the keys up to its block's end) and every position the packed steps' LM head ran on."""
    import dataclasses

    bd = profiling_module("bench_decode")
    import lightningrl_fast.sampler as sampler
    from lightningrl_fast.model import SDARConfig, build_model

    cfg = SDARConfig(vocab_size=111, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, block_size=4, mask_token_id=110, torch_dtype="float32",
                     max_position_embeddings=256)
    model = build_model(cfg, dtype=torch.float64, seed=1).eval()
    h, inner, L, hq, hkv, d = 32, 48, 2, 4, 2, 8
    body = 2 * L * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inner)
    seen = {"tokens": 0, "keys": 0, "head": 0}
    real_hidden, real_step = model.hidden_cached, sampler._unmask_step

    def spy_hidden(chunk, cache, start, chunk_lens, bs, *a, **k):
        for s0, n in zip(start.tolist(), chunk_lens.tolist()):
            pos = torch.arange(s0, s0 + n)
            seen["tokens"] += n
            seen["keys"] += int(((pos // bs + 1) * bs).sum())
        return real_hidden(chunk, cache, start, chunk_lens, bs, *a, **k)

    def spy_step(model_, st, c, bs, eos_ids, hs, lm_rows=None):
        seen["head"] += lm_rows or 0  # (None: an unpacked step, all positions)
        return real_step(model_, st, c, bs, eos_ids, hs, lm_rows)

    monkeypatch.setattr(model, "hidden_cached", spy_hidden)
    monkeypatch.setattr(sampler, "_unmask_step", spy_step)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 100, (n,), generator=g).tolist() for n in (1, 3, 4, 5, 9, 12, 2)]  # distinct
    scfg = sampler.SamplerConfig(max_new_tokens=17, eos_ids=(110,), pack="off", **{k: v for k, v in kw.items()
                                                                                  if k != "eos"})
    if kw.get("eos"):  # an EOS id that some rows decode (a token of row 0's response) and others not
        free = sampler.generate(model, prompts, scfg).tokens
        eos = next(t for t in free[0].tolist() if not all(t in r for r in free.tolist()))
        scfg = dataclasses.replace(scfg, eos_ids=(eos,))
    seen.update(tokens=0, keys=0, head=0)
    scfg = dataclasses.replace(scfg, pack="on")
    ro = sampler.generate(model, prompts, scfg)
    if kw.get("eos"):
        assert ro.eos_found.any() and not ro.eos_found.all()
    want = body * seen["tokens"] + 4 * L * hq * d * seen["keys"] + 2 * h * 111 * seen["head"]
    assert bd.decode_flops(cfg, ro, 4) == pytest.approx(want, rel=1e-12)
    assert seen["head"] < seen["tokens"]  # the LM head ran on fewer positions than the forwards carried
    unpacked = sampler.generate(model, prompts, dataclasses.replace(scfg, pack="off"))
    assert bd.decode_flops(cfg, unpacked, 4) == bd.decode_flops(cfg, ro, 4)  # the schedule's work, not the layout's
    rr = profiling_module("results_rows")  # the new columns land in RESULTS.md's result / bound / ratio
    assert [rr.column(k, 1.0) for k in ("TFLOP/s", "roof bound", "%roof", "steady roof bound", "steady %roof")] == [
        "result", "bound", "ratio", "bound", "ratio"]


def test_bench_decode_reads_the_samplers_capture_warnings():
    """A failed capture with PDL on is retried without PDL (a graph, not an eager step): the row must say pdl off,
    not graphs failed; only the second failure means an eager step. The fragments are the sampler's wording."""
    bd = profiling_module("bench_decode")
    src = (REPO / "lightningrl_fast" / "sampler.py").read_text()
    assert "retrying with it off" in src and "decoding continues eagerly" in src
    retry = ("CUDA graph capture of the denoising step failed (RuntimeError: x) with programmatic dependent launch "
             "on; retrying with it off (LRF_PDL=0 for this process)")
    eager = "CUDA graph capture of the denoising step failed (RuntimeError: y); decoding continues eagerly"
    assert bd.capture_outcome([]) == (False, False)
    assert bd.capture_outcome([retry]) == (False, True)
    assert bd.capture_outcome([retry, eager]) == (True, False)
    assert bd.capture_outcome([eager, "an unrelated warning"]) == (True, False)
    results_rows = profiling_module("results_rows")
    assert results_rows.column("steady bound", 150.0) == "bound"


def test_bench_block_attn_sdpa_mask_is_the_block_mask_made_once():
    """SDPA's baseline gets its additive mask built outside the timing (a bool mask is converted, and padded for the
    efficient kernel, on every call): the same attention as block attention, aligned rows, broadcast over B."""
    ba = profiling_module("bench_block_attn")
    import torch.nn.functional as F

    from lightningrl_fast.ops.block_attn import block_attention_reference

    cpu = torch.device("cpu")
    assert ba.sdpa_mask(3, 4, 8, 4, torch.float32, cpu) is None  # one block: every key visible
    for B, L, bs, C in ((2, 8, 4, 8), (1, 0, 4, 12), (2, 12, 8, 16)):
        mask = ba.sdpa_mask(B, C, L, bs, torch.float32, cpu)
        assert mask.shape == (B, 1, C, L + C) and (B == 1 or mask.stride(0) == 0) and mask.stride(2) % 16 == 0
        allow = ba.block_mask_bool(B, C, L + C, L, bs, cpu)
        assert torch.equal(mask == 0, allow) and bool((mask[~allow] == float("-inf")).all())
        g = torch.Generator().manual_seed(B + L)
        q, k, v = (torch.randn(B, C, 2, 16, generator=g) for _ in range(3))
        kc, vc = (torch.randn(B, L + C, 2, 16, generator=g) for _ in range(2))
        cl, nl = torch.full((B,), L, dtype=torch.int32), torch.full((B,), C, dtype=torch.int32)
        want = block_attention_reference(q, k, v, kc, vc, cl, nl, bs)
        got = F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                             attn_mask=mask).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mismatch_and_check_catch_wrong_or_raising_kernels():
    common = profiling_module("common")
    want = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    assert common.mismatch(want + 0.01, want) is None  # bf16-sized error: fine
    assert "max abs error" in common.mismatch(want + 0.5, want)
    assert "non-finite" in common.mismatch(want * float("nan"), want)
    assert "shape" in common.mismatch(want[:1], want)
    assert common.mismatch((want, torch.tensor([1, 2])), (want, torch.tensor([1, 2]))) is None
    got = (want, torch.tensor([1, 3]))
    assert common.mismatch(got, (want, torch.tensor([1, 2]))) == "output 1: 1 of 2 elements differ"
    assert "max abs error" in common.mismatch(want.to(torch.bfloat16) + 1e-2, want, rel=0.0)  # exact, for copies
    assert common.check(lambda: want.clone(), want) is None
    assert common.check(lambda: 1 / 0, want).startswith("raised ZeroDivisionError")


def test_bench_unmask_kernel_check_rejects_a_kernel_that_did_no_work_or_picked_wrong():
    """What bench_unmask runs on the kernel before timing it, here with the reference (and broken copies of it) in the
    kernel's place: a kernel that leaves its state untouched or picks a non-maximal token gets no time."""
    bu = profiling_module("bench_unmask")
    from lightningrl_fast.ops.unmask import threshold_unmask_reference

    def as_kernel(*a):  # the reference with _C.threshold_unmask's signature (two_level as a bool)
        return threshold_unmask_reference(*a[:-1], "two_level" if a[-1] else "per_token")

    def idle(*a):
        return None

    def argmin(logits, *a):
        as_kernel(-logits, *a)

    cpu = torch.device("cpu")
    logits = bu.make_logits(2 * bu.BLOCK, 300, "llm", torch.float32, cpu)
    extra = bu.extras(2, cpu)
    for greedy, noise in ((True, "two_level"), (False, "two_level"), (False, "per_token")):
        assert bu.kernel_check(logits, extra, greedy, noise, as_kernel) == "ok"
        assert "nothing unmasked" in bu.kernel_check(logits, extra, greedy, noise, idle)
    assert bu.kernel_check(logits, extra, True, "two_level", argmin) != "ok"


def test_bench_unmask_greedy_check_tolerates_only_near_ties():
    """The greedy check before timing allows a different selection only where the kernel may legitimately differ
    (a confidence within 1e-4 of tau, or of the block's best when that is below tau); a different selection of a
    clearly decided position, or a wrong written confidence, fails it."""
    import math

    bu = profiling_module("bench_unmask")
    from lightningrl_fast.ops.unmask import threshold_unmask_reference

    cpu, vocab = torch.device("cpu"), 300
    logits = torch.zeros(2, bu.BLOCK, vocab)

    def with_conf(c):  # one token's logit such that its softmax probability over the row is c
        return math.log(c * (vocab - 1) / (1 - c))

    for s, c in enumerate([0.90005, 0.95, 0.99, 0.97]):
        logits[:, s, 7 + s] = with_conf(c)  # positions 0..3 of each block clearly or barely above tau, rest low
    extra = bu.extras(2, cpu)

    def flip(pos, scale_conf=1.0):
        def kernel(*a):
            out = threshold_unmask_reference(*a[:-1], "two_level" if a[-1] else "per_token")
            masked, conf = a[2], a[5]
            assert not bool(masked[0, pos])  # the reference unmasked it
            masked[0, pos] = True  # ... this "kernel" does not
            conf.mul_(scale_conf)
            return out
        return kernel

    assert bu.kernel_check(logits, extra, True, "two_level", flip(0)) == "ok"  # conf 0.90005: within 1e-4 of tau
    assert "unmasked differently" in bu.kernel_check(logits, extra, True, "two_level", flip(1))  # conf 0.95
    wrong_conf = flip(0, scale_conf=0.5)
    assert "confidence differs" in bu.kernel_check(logits, extra, True, "two_level", wrong_conf)


def test_bench_block_attn_split_sweep_checks_and_times_each_forced_split(monkeypatch):
    """--splits: each forced KV split count of a decode row is checked against the reference, then timed (here with
    the reference in the kernel's place, eagerly on the CPU); a wrong split count gets "wrong", never a time, and is
    not the best; `split_x` compares the launcher's own choice with the fastest forced one."""
    import types

    ba = profiling_module("bench_block_attn")
    from lightningrl_fast import _ext
    from lightningrl_fast.ops.block_attn import block_attention_reference

    calls = []

    def kernel(q, k, v, kc, vc, cl, nl, bs, scale, num_splits=0, variant=0):
        calls.append((num_splits, variant))
        out = block_attention_reference(q, k, v, kc, vc, cl, nl, bs, scale)
        return out + 1.0 if num_splits == 3 else out  # split count 3 is "broken"

    monkeypatch.setattr(_ext, "ext", lambda: types.SimpleNamespace(block_attention=kernel))
    monkeypatch.setattr(ba, "HQ", 2)
    monkeypatch.setattr(ba, "HKV", 1)
    monkeypatch.setattr(ba, "D", 16)
    cpu = torch.device("cpu")
    row = ba.bench_row("decode", 2, 64, 4, 4, torch.float32, cpu, True, 10.0, baselines=False, splits=(1, 3, 8))
    assert row["check"] == "ok" and isinstance(row["kernel_us"], float)
    assert isinstance(row["s1_us"], float) and isinstance(row["s8_us"], float) and row["s3_us"] == "wrong"
    assert row["best_split"] in (1, 8) and row["split_x"] == row["kernel_us"] / row[f"s{row['best_split']}_us"]
    assert {(1, ba.VARIANTS["mma"]), (8, ba.VARIANTS["mma"])} <= set(calls)
    assert sum(c == (3, ba.VARIANTS["mma"]) for c in calls) == 1  # checked once, never timed
    prefill = ba.bench_row("prefill", 1, 0, 8, 16, torch.float32, cpu, True, 10.0, baselines=False, splits=(1, 8))
    assert "s1_us" not in prefill and "best_split" not in prefill  # the sweep is for decode rows


# ------------------------------------------------------------------------------------------------------------
# lightningrl_fast/profiling.py: the helpers bench_decode and the sampler use
# ------------------------------------------------------------------------------------------------------------

def test_timer_adds_up_its_blocks_and_nvtx_ranges_are_free_without_cuda():
    import time

    from lightningrl_fast.profiling import Timer, copy_bandwidth_gbs, nvtx_range

    t = Timer(torch.device("cpu"))
    for _ in range(2):
        with t:
            time.sleep(0.02)
    assert 0.04 <= t.seconds < 5.0  # both blocks counted
    with Timer() as u, nvtx_range("x"), nvtx_range("y", enabled=False):
        pass
    assert 0.0 <= u.seconds < 1.0
    assert copy_bandwidth_gbs(torch.device("cpu")) is None  # a CUDA-only probe: no figure off CUDA



def test_bench_block_attn_probes_the_wgmma_variant_in_a_child_process():
    """The wgmma variant (never run on hardware) runs every row shape in a child process before its columns are
    timed: a child that ran them all (here: no shape) lets it in, one that fails (here: no GPU for the one shape)
    keeps it out with the reason, so a fault cannot end the bench's own process and its mma.sync rows."""
    from lightningrl_fast import _ext

    if _ext.ext() is None or not hasattr(_ext.ext(), "block_attention"):
        pytest.skip("the extension has no block_attention entry point")
    ba = profiling_module("bench_block_attn")
    assert ba.wgmma_probe([], "bf16") is None
    if not torch.cuda.is_available():
        note = ba.wgmma_probe([["decode", 1, 64, 4, 4]], "bf16")
        assert note is not None and note.startswith("the wgmma probe failed (exit "), note


def test_device_time_times_a_slow_call_with_few_repeats(monkeypatch):
    """A call of >= SLOW_CALL_MS (a slow baseline) is timed with one call per replay and 3 replays instead of
    8 calls x (3 + 20): the first lease's FlexAttention at 57.7 ms a call would have taken ~10 s a column."""
    common = profiling_module("common")
    seen = []
    monkeypatch.setattr(common, "time_fn", lambda fn, *, device, warmup=10, iters=50: (seen.append((warmup, iters)),
                                                                                        ms)[1])
    monkeypatch.setattr(common, "graph_time_us", lambda fns, device, **kw: (seen.append(kw), 7.0)[1])
    cuda = torch.device("cuda")
    for ms, want in ((5.0, dict(min_calls=1, warmup=1, iters=3)), (0.5, dict(min_calls=8))):
        seen.clear()
        assert common.device_time([lambda: None], cuda) == (7.0, "graph")
        assert seen == [(1, 1), want], seen
