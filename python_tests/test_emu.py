"""The CPU emulator of device code (csrc/emu) checks itself: a correct kernel runs under launch-order and
random thread interleavings, and kernels with divergent collectives or abandoned barriers are refused; its
wgmma model computes an exact product and refuses (or exposes) a missing fence, wait or warp."""

import subprocess

import pytest


@pytest.fixture(scope="module")
def selfcheck(emu_build):
    return emu_build("selfcheck_emu.cpp", cuda_headers=True)


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_a_correct_kernel_runs_in_any_interleaving(selfcheck, seed):
    res = subprocess.run([str(selfcheck), "ok", str(seed)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "sum 2080", res.stdout + res.stderr


@pytest.mark.parametrize("case, message", [
    ("warp_vs_block", "divergent collective"),
    ("divergent_shfl", "divergent collective"),
    ("exit_early", "deadlock"),
    ("skip_barrier", "divergent collective"),
    ("misaligned_load16", "16-byte global load not aligned"),  # the device faults: unmask's vector loads
])
@pytest.mark.parametrize("seed", [0, 3])
def test_control_flow_bugs_abort_with_a_named_error(selfcheck, case, message, seed):
    res = subprocess.run([str(selfcheck), case, str(seed)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0, f"{case}: the emulator accepted a broken kernel\n{res.stdout}"
    assert message in res.stderr, res.stderr


# ------------------------------------------------------------------ the wgmma model (warp_ops.h, csrc/emu)

@pytest.fixture(scope="module")
def wgmma_selfcheck(emu_build):
    return emu_build("wgmma_selfcheck_emu.cpp")


def run_wgmma(exe, case, defer, seed=3):
    return subprocess.run([str(exe), case, str(int(defer)), str(seed)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("seed", [0, 5])
def test_wgmma_gemm_is_exact(wgmma_selfcheck, defer, seed):
    """64x64x32 through two m64n64k16 (register A, descriptor B in the block-attention K-tile layout), values
    exact in bf16: the emulated product equals the float one, with results at issue or at the wait."""
    res = run_wgmma(wgmma_selfcheck, "ok", defer, seed)
    assert res.returncode == 0 and res.stdout.split() == ["max_err", "0"], res.stdout + res.stderr


@pytest.mark.parametrize("case, message", [
    ("no_fence", "without a wgmma.fence"),
    ("warp_skips", "different wgmma sequences"),
    ("no_wait", "not waited for"),
])
@pytest.mark.parametrize("defer", [False, True])
def test_wgmma_misuse_aborts_with_a_named_error(wgmma_selfcheck, case, message, defer):
    res = run_wgmma(wgmma_selfcheck, case, defer)
    assert res.returncode != 0 and message in res.stderr, res.stdout + res.stderr


def test_wgmma_results_exist_only_after_the_wait(wgmma_selfcheck):
    """With results landing at the wait (defer), reading the accumulators early gives NaN, writing them while
    the wgmma is in flight aborts, and overwriting the shared B tile before the wait changes the result: the
    late bracket that the block-attention tests run the wgmma kernel under. Landing at issue, the same kernels
    read correct values: the emulator brackets the hardware's timing from both sides."""
    assert run_wgmma(wgmma_selfcheck, "read_early", True).stdout.split() == ["max_err", "nan"]
    assert run_wgmma(wgmma_selfcheck, "read_early", False).stdout.split() == ["max_err", "0"]
    res = run_wgmma(wgmma_selfcheck, "write_in_flight", True)
    assert res.returncode != 0 and "were written" in res.stderr, res.stderr
    late, early = run_wgmma(wgmma_selfcheck, "smem_reuse", True), run_wgmma(wgmma_selfcheck, "smem_reuse", False)
    assert early.stdout.split() == ["max_err", "0"]
    assert late.returncode == 0 and float(late.stdout.split()[1]) > 1, late.stdout + late.stderr
