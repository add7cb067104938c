"""The CPU emulator of device code (csrc/emu) checks itself: a correct kernel runs under launch-order and
random thread interleavings, and kernels with divergent collectives or abandoned barriers are refused."""

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
])
@pytest.mark.parametrize("seed", [0, 3])
def test_control_flow_bugs_abort_with_a_named_error(selfcheck, case, message, seed):
    res = subprocess.run([str(selfcheck), case, str(seed)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0, f"{case}: the emulator accepted a broken kernel\n{res.stdout}"
    assert message in res.stderr, res.stderr
