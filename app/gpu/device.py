"""One CUDA device as this process uses it (``CudaDevice``), and the process's CUDA setting,
made before its first CUDA context (``configure_process``).

A ``CudaDevice`` owns the device's gate (``app.gpu.gate``). The runtime makes the process's one
per device (``app.runtime.cuda_device``) and hands it to the GPU pipeline it builds; front ends
reach it through the Detector (``Detector.cuda``) and hand it to their NVDEC readers
(``app.gpu.nvdec``). Every holder holds the gate through the context managers here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import ContextManager

from app.gpu.gate import Gate


def configure_process() -> None:
    """Set how many hardware work queues a CUDA context gets, before the process makes its first.

    Why: CUDA spreads a context's streams over ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues
    (8 by default), and two streams on one queue run in submission order, as if they were one.
    torch's stream pool and nvImageCodec's per-thread streams are dozens of streams, so a
    decoder stream that lands on the engine's queue waits behind every graph queued there:
    decode of batch N+1 could not start before the engine finished batch N
    (bench/results/2026-12-01-nvidia-h200-issue16-run2-connections.json, -run1-probe.json).
    32 is the most CUDA allows. A user's own setting wins, and a process whose CUDA context
    already exists keeps its own (the runtime calls this before it opens anything).
    """
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


class CudaDevice:
    """CUDA device ``index`` and its gate: ``shared`` for a batch or an NVDEC reader's CUDA call,
    ``exclusive`` for a capture (nothing else runs on the device meanwhile), and
    ``exclusive_from_shared`` for a capture from inside a batch."""

    def __init__(self, index: int) -> None:
        self.index = int(index)
        self._gate = Gate()

    def shared(self) -> ContextManager[None]:
        return self._gate.shared()

    def exclusive(self) -> ContextManager[None]:
        return self._gate.exclusive()

    def exclusive_from_shared(self) -> ContextManager[None]:
        """Inside ``shared``: give the share up, hold the device alone, take a share back."""
        return self._gate.exclusive_from_shared()

    def open_since(self) -> float:
        """Since when no capture has held the device or waited for it (``Gate.open_since``)."""
        return self._gate.open_since()

    @property
    def held_exclusive(self) -> bool:
        """Whether a capture holds the device now (what tests of its holders look at)."""
        return self._gate.held_exclusive

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """This device for torch and Numba on the calling thread, for the block only: the
        caller's own current device is back after it."""
        import torch

        with torch.cuda.device(self.index), self.numba():
            yield

    def numba(self) -> ContextManager[object]:
        """Numba's current context on this device (Numba's is device 0 unless told)."""
        if self.index == 0:
            return contextlib.nullcontext()
        from numba import cuda

        return cuda.gpus[self.index]

    def __repr__(self) -> str:
        return f"CudaDevice({self.index})"
