"""Many batches at once, or one CUDA-graph capture with nothing else running.

A capture (``torch.cuda.graph``, global capture mode) must see no CUDA call from any other
thread, and it calls ``engine.forward``, which is never called concurrently. Runs hold the
gate ``shared``; a capture takes it ``exclusive``.
"""

from __future__ import annotations

import contextlib
import threading


class Gate:
    """Many runs at once (``shared``), or one capture with nothing else running (``exclusive``).

    A waiting exclusive holder goes before new shared ones, so a capture is not starved by a
    steady stream of batches. A shared holder that needs a capture releases its share first
    (``exclusive`` is not an upgrade), so two of them can never wait for each other.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if self._shared == 0:
                self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True

    def release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def shared(self):
        self.acquire_shared()
        try:
            yield
        finally:
            self.release_shared()

    @contextlib.contextmanager
    def exclusive(self):
        self.acquire_exclusive()
        try:
            yield
        finally:
            self.release_exclusive()
