"""Shared helpers for the benchmark scripts in profiling/ (scripts, not tests).

* `time_fn(fn, device=d)`: median milliseconds per call: CUDA events on the GPU, perf_counter on the CPU, after warmup.
  Events around ONE eager call also count the host's launch overhead (argument checks, allocation, launch)
  whenever the GPU waits for it: fine for big kernels, not for ones of a few microseconds.
* `graph_time_us(fns, device)`: device microseconds per call of short kernels: the calls captured back to back
  in one CUDA graph, the replay timed (no host gaps; None when the capture fails, `device_time` / `device_time_us`
  then time eagerly, cycling through the same input sets, and `device_time` says which it did);
  `rotation(bytes, device)` says how many distinct input sets to cycle through so that a call does not find the
  previous call's inputs in L2 (at most 64), `l2_state(bytes, sets, device)` whether they do span 2x L2 ("cold")
  or not ("warm": GB/s then overstates DRAM bandwidth); `ColumnTimes(device)` times a row's columns so and labels the
  row "graph" or "eager: <the columns whose capture failed>".
* `kernels_dispatched(device, *names)`: whether the public ops run the `_C` kernels (CUDA build, LRF_DISABLE_KERNELS
  unset): a bench timing kernels through the ops labels its rows by it; `mismatch(got, want)` / `check(fn, want)`:
  the check of a kernel's output against the reference before it is timed (a timing of a wrong result is none).
* `copy_bandwidth_gbs(device)`: measured device-to-device copy bandwidth (read + write bytes / s), the
  roofline for memory-bound kernels.
* `ints("1,8,64")`: an argparse type for comma-separated positive integers (a clear usage error otherwise).
* `print_table(rows)`: one aligned table; `emit_json(bench, **fields)`: the ONE final JSON line a script ends
  with (`python profiling/bench_x.py | tail -n 1` is machine-readable).
* `RowLog(bench, **fields)`: the list a script collects its rows in; each row is also written to stderr as it is
  measured (`{"bench_row": ...}`), so a script stopped at a time limit (gpu_session.sh) leaves what it measured,
  and profiling/results_rows.py uses those lines where the final one is missing; `rows.emit(**more)` writes the
  final line with the same fields. stdout stays one table + one line.

Run a script as `python profiling/bench_<op>.py` from the repository root (the package must be installed
with its extension to time the kernels).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from typing import Callable, Sequence

import torch


def ints(text: str) -> list[int]:
    """argparse type: comma-separated positive integers ("1,8,64")."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def time_fn(fn: Callable[[], object], *, device: torch.device, warmup: int = 10, iters: int = 50) -> float:
    """Median milliseconds of one `fn()` call."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def l2_bytes(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))


def rotation(bytes_per_call: int, device: torch.device, max_sets: int = 64) -> int:
    """Distinct input sets to rotate through so that the inputs of back-to-back calls span 2x the L2 cache
    (a call then reads its inputs from DRAM, as in a real decode step between other kernels); 1 on the CPU.
    `bytes_per_call`: the bytes of the inputs a call READS (not its outputs). Capped at `max_sets`: calls with tiny
    inputs cannot be made to miss L2 that way; `l2_state` says whether a rotation does."""
    if device.type != "cuda":
        return 1
    need = -(-2 * l2_bytes(device) // max(1, int(bytes_per_call)))
    return max(1, min(max_sets, need))


def l2_state(bytes_per_set: int, sets: int, device: torch.device) -> str:
    """How the inputs of a timed call meet the L2 cache: "cold" when the `sets` distinct input sets cycled through
    span >= 2x L2 (each call reads its inputs from DRAM: GB/s is a DRAM figure), "warm" when they do not (the
    inputs are, in part, still in L2 from the previous use of the set: GB/s and %copy overstate DRAM bandwidth),
    "-" off CUDA."""
    if device.type != "cuda":
        return "-"
    return "cold" if int(bytes_per_set) * int(sets) >= 2 * l2_bytes(device) else "warm"


def graph_time_us(fns: Sequence[Callable[[], object]], device: torch.device, min_calls: int = 8,
                  warmup: int = 3, iters: int = 20) -> float | None:
    """Device microseconds per call: the calls `fns` (one per input set), repeated to >= `min_calls`, captured
    back to back in one CUDA graph after an eager warm-up pass on a side stream; the replay is timed with CUDA
    events and divided by the number of calls. None when the capture fails (the caller falls back to
    `time_fn`). The calls must be safe to repeat (idempotent writes)."""
    if device.type != "cuda":
        return None
    calls = list(fns) * -(-min_calls // max(1, len(fns)))
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        ms = time_fn(graph.replay, device=device, warmup=warmup, iters=iters)
    except Exception as e:  # an op that syncs or allocates in a way capture refuses
        print(f"  (graph capture failed, eager timing: {type(e).__name__}: {str(e).splitlines()[0][:100]})",
              file=sys.stderr)
        torch.cuda.synchronize(device)
        return None
    del graph
    return 1e3 * ms / len(calls)


SLOW_CALL_MS = 2.0  # device_time: a call at least this long is timed with few repeats (a slow baseline)


def device_time(fns: Sequence[Callable[[], object]], device: torch.device, min_calls: int = 8) -> tuple[float, str]:
    """(microseconds per call, how): `graph_time_us(fns, device, min_calls)` ("graph"), or where the capture fails (or
    off CUDA) the eager per-call time between CUDA events of calls cycling through `fns` ("eager": host launch
    overhead included, over the same input rotation as the graph, not one set that stays in L2). A call that
    takes >= SLOW_CALL_MS on its own (one call after a warm-up one, first) is timed with one call per replay and
    3 replays: a baseline at 50 ms a call (FlexAttention on some decode shapes) would otherwise cost ~10 s of a
    GPU lease per column."""
    slow = device.type == "cuda" and time_fn(fns[0], device=device, warmup=1, iters=1) >= SLOW_CALL_MS
    few = dict(warmup=1, iters=3) if slow else {}  # the repeats of a slow call (else each timer's defaults)
    us = graph_time_us(fns, device, min_calls=1 if slow else min_calls, **few)
    if us is not None:
        return us, "graph"
    nxt = itertools.cycle(fns)
    return 1e3 * time_fn(lambda: next(nxt)(), device=device, **few), "eager"


class ColumnTimes:
    """`device_time` per timed column of a table row, keeping the columns whose calls had to be timed eagerly
    (capture failed) for the row's `timing` label: `label()` is "graph", or "eager: <columns>"."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.eager: list[str] = []

    def __call__(self, col: str, fns: Sequence[Callable[[], object]]) -> float:
        us, how = device_time(fns, self.device)
        if how == "eager" and self.device.type == "cuda":
            self.eager.append(col)
        return us

    def label(self) -> str:
        return "eager: " + ",".join(self.eager) if self.eager else "graph"


def device_time_us(fns: Sequence[Callable[[], object]], device: torch.device, min_calls: int = 8) -> float:
    """`device_time(fns, device, min_calls)` without saying how it was timed."""
    return device_time(fns, device, min_calls)[0]


def kernels_dispatched(device: torch.device, *names: str) -> bool:
    """True when the public ops on `device` run the `_C` entry points `names`: a CUDA device, a CUDA build of the
    extension that has them, and LRF_DISABLE_KERNELS not set (`ops._common.cuda_kernel`, the ops' own dispatch).
    A bench whose kernel columns go through the public ops must not label reference timings as kernel ones."""
    if device.type != "cuda":
        return False
    from lightningrl_fast import _ext
    from lightningrl_fast.ops._common import cuda_kernel

    if not _ext.has_cuda_kernels():
        return False
    probe = torch.empty(1, device=device)
    return all(cuda_kernel(n, probe) is not None for n in names)


def mismatch(got, want, rel: float = 0.05) -> str | None:
    """None when every tensor of `got` matches `want` (same shapes; max |got - want| <= rel x max |want|, no NaN /
    inf where `want` is finite), else what differs: the check a bench runs on a kernel's output before it times
    it (a timing of a wrong result is no result). Tensors or (nested) tuples / lists of tensors; bool / integer
    tensors must be equal."""
    if isinstance(got, (tuple, list)):
        if not isinstance(want, (tuple, list)) or len(got) != len(want):
            return "different number of outputs"
        for i, (g, w) in enumerate(zip(got, want)):
            bad = mismatch(g, w, rel)
            if bad:
                return f"output {i}: {bad}"
        return None
    if got is None or want is None:
        return None if got is None and want is None else "an output is missing"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not got.is_floating_point() or not want.is_floating_point():
        n = int((got.to(want.device) != want).sum())
        return f"{n} of {want.numel()} elements differ" if n else None
    g, w = got.double().to(want.device), want.double()
    if not bool(torch.isfinite(g[torch.isfinite(w)]).all()):
        return "non-finite values where the reference is finite"
    finite = w[torch.isfinite(w)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    err = float((g - w).abs().nan_to_num(0.0).max()) if w.numel() else 0.0
    return f"max abs error {err:.3g} > {rel:g} x max |reference| {scale:.3g}" if err > rel * scale + 1e-6 else None


def check(fn: Callable[[], object], want, rel: float = 0.05) -> str | None:
    """`mismatch(fn(), want, rel)`, or what fn raised: the check before a kernel column is timed."""
    try:
        return mismatch(fn(), want, rel)
    except Exception as e:  # a launcher that refuses the inputs: no time either
        return f"raised {type(e).__name__}: {str(e).splitlines()[0][:80]}"


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured copy bandwidth in GB/s, counting bytes read + written (2 * nbytes per copy)."""
    if device.type != "cuda":
        nbytes = min(nbytes, 1 << 26)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), device=device, warmup=3, iters=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def gemm_tflops(device: torch.device, dtype: torch.dtype, m: int = 8192, k: int = 4096, n: int = 8192) -> float:
    """Measured dense GEMM rate in TFLOP/s ([m, k] x [k, n] in `dtype`): the compute side of a roofline, as the
    copy bandwidth is its memory side (on the CPU a 256-cube GEMM, so that it stays quick)."""
    if device.type != "cuda":
        m = k = n = 256
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, generator=g, device=device).to(dtype)
    b = torch.randn(k, n, generator=g, device=device).to(dtype)
    ms = time_fn(lambda: a @ b, device=device, warmup=3, iters=10)
    return 2.0 * m * k * n / (ms * 1e-3) / 1e12


def print_table(rows: Sequence[dict], file=sys.stdout) -> None:
    """Print dict rows as one aligned table (columns from the first row, floats with 4 significant digits)."""
    if not rows:
        return
    cols = list(rows[0])

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=file)


class RowLog(list):
    """A benchmark's rows; `append` also writes the row at once to stderr as one JSON line
    `{"bench_row": bench, "line": fields, "row": row}` (fields: what the final line says of every row: device,
    copy_gbs, dtype, ...), flushed, for a run that does not reach its final line."""

    def __init__(self, bench: str, **fields) -> None:
        super().__init__()
        self.bench, self.fields = bench, fields

    def append(self, row: dict) -> None:
        super().append(row)
        print(json.dumps({"bench_row": self.bench, "line": self.fields, "row": row}, default=str), file=sys.stderr,
              flush=True)

    def emit(self, **fields) -> None:
        """The script's final line (`emit_json`): the bench, the fields every row line carried, then `fields`."""
        emit_json(self.bench, **{**self.fields, **fields})


def emit_json(bench: str, **fields) -> None:
    """The final line of a benchmark script: `{"bench": ..., ...}` as one JSON line."""
    print(json.dumps({"bench": bench, **fields}), flush=True)
