"""Many batches at once, or one CUDA-graph capture with nothing else running on its device.

A capture must see no CUDA call from any other thread on the same device: an implicit
synchronisation there (a context or stream synchronise, a free, NVDEC's own calls) invalidates
it whatever its capture mode (``thread_local`` included: the invalidation is device-wide), and
a capture calls ``engine.forward``, which is never called concurrently. So each device has one
gate, owned by its ``app.gpu.device.CudaDevice``: every GPU pipeline on the device holds it
``shared`` for a batch, and so does every NVDEC reader for each of its CUDA calls (opening,
decoding, copying out, closing: ``app.gpu.nvdec``); a capture takes it ``exclusive``. It is
held only through these context managers, never acquired in one method and released in another.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class Gate:
    """Many runs at once (``shared``), or one capture with nothing else running (``exclusive``).

    A waiting exclusive holder goes before new shared ones, so a capture is not starved by a
    steady stream of batches. A shared holder that needs a capture gives its share up first
    (``exclusive_from_shared``: ``exclusive`` is not an upgrade), so two of them can never wait
    for each other.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0
        self._exclusive_ended = 0.0  # time.monotonic() when the last capture let go

    @property
    def held_exclusive(self) -> bool:
        """Whether a capture holds it now (what tests of its holders look at)."""
        return self._exclusive

    def open_since(self) -> float:
        """Since when (``time.monotonic()``) shared holders have been let in: now while a capture
        holds the gate or waits for it, so a call that waited out a capture is not taken for one
        that hangs (``app.predict.decode_pool``)."""
        with self._cond:
            return time.monotonic() if self._exclusive or self._waiting else self._exclusive_ended

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        self._acquire_shared()
        try:
            yield
        finally:
            self._release_shared()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        self._acquire_exclusive()
        try:
            yield
        finally:
            self._release_exclusive()

    @contextlib.contextmanager
    def exclusive_from_shared(self) -> Iterator[None]:
        """Inside ``shared``: give the share up, hold the gate alone, then take a share back
        (also when the body raises), so that the enclosing ``shared`` releases what it holds."""
        self._release_shared()
        try:
            with self.exclusive():
                yield
        finally:
            self._acquire_shared()

    def _acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1

    def _release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if self._shared == 0:
                self._cond.notify_all()

    def _acquire_exclusive(self) -> None:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True

    def _release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._exclusive_ended = time.monotonic()
            self._cond.notify_all()
