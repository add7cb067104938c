"""NVTX ranges, a device-aware timer and a device copy-bandwidth probe. The first two are no-ops / plain wall clocks
when CUDA or NVTX is absent."""

from __future__ import annotations

import contextlib
import time

import torch


@contextlib.contextmanager
def nvtx_range(name: str, enabled: bool = True):
    """An NVTX range around a block (shows up in Nsight Systems and in `ncu --nvtx`); free without CUDA."""
    if enabled and torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield


class Timer:
    """Wall-clock seconds of a block; synchronizes the device first and last so GPU work is counted."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.seconds = 0.0

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> "Timer":
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._t0


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 28, iters: int = 5) -> float | None:
    """Device-to-device copy bandwidth of a CUDA device in GB/s, counting the bytes read and written (the
    bandwidth bound a decode forward is compared with); None off CUDA or when the 2 x `nbytes` buffers do not fit.
    ~20 ms on an H100 with the defaults."""
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        try:
            src = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
        except torch.cuda.OutOfMemoryError:  # a full device (model + KV cache): no figure rather than a crash
            return None
        dst.copy_(src)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) * 1e-3 / iters
        del src, dst
    return 2 * nbytes / seconds / 1e9 if seconds > 0 else None
