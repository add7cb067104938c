"""NVTX ranges and a device-aware timer. Both are no-ops / plain wall clocks when CUDA or NVTX is absent."""

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
