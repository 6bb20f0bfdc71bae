"""Shared memory for image bytes on their way from one HTTP worker to one inference worker.

The HTTP worker (the only writer) copies each image into its ring and frees the space when
the inference worker's answer for that image arrives; answers may come out of order, so the
ring's tail only moves past freed space. Both sides map the same file; once the inference
worker has mapped it, the HTTP worker unlinks it, so a killed process never leaves it behind.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from pathlib import Path


class Ring:
    """The writer's side: ``put`` copies bytes in and says where; ``free`` gives the space back."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = Path(path)
        self.capacity = int(capacity)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.capacity)
            self._map = mmap.mmap(fd, self.capacity)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        self._live: deque[list] = deque()  # [start, end, freed] in allocation order
        self._by_offset: dict[int, list] = {}
        self._head = 0  # where the next allocation starts, unless it wraps
        self.used = 0

    def put(self, data: bytes) -> int | None:
        """The offset ``data`` was copied to, or None when the ring has no room for it now."""
        n = len(data)
        start = self._allocate(n)
        if start is None:
            return None
        self._view[start : start + n] = data
        entry = [start, start + n, False]
        self._live.append(entry)
        self._by_offset[start] = entry
        self._head = start + n
        self.used += n
        return start

    def _allocate(self, n: int) -> int | None:
        if n > self.capacity:
            return None
        if not self._live:  # empty: start over at 0, so a lightly loaded ring touches few pages
            return 0
        tail = self._live[0][0]
        if self._head > tail:  # not wrapped: room at the end, or from 0 up to the tail
            if self.capacity - self._head >= n:
                return self._head
            return 0 if tail > n else None
        return self._head if tail - self._head > n else None  # wrapped: room between head and tail

    def free(self, offset: int) -> None:
        entry = self._by_offset.pop(offset, None)
        if entry is None:
            return
        entry[2] = True
        self.used -= entry[1] - entry[0]
        while self._live and self._live[0][2]:
            self._live.popleft()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        self._view.release()
        self._map.close()


def map_ring(path: Path) -> memoryview:
    """The reader's side: the whole ring, read-only (stays mapped while a view of it lives)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return memoryview(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
    finally:
        os.close(fd)
