"""The run folder the processes of one ``yolopipe serve`` share: where each socket, ring,
status block and metrics file lives."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunLayout:
    """The run folder the supervisor owns: sockets, status blocks, rings and metrics files.

    In /dev/shm where there is one (rings and status blocks are then plain shared memory)."""

    root: Path
    workers: int  # inference workers

    @classmethod
    def create(cls, workers: int) -> RunLayout:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        root = Path(tempfile.mkdtemp(prefix="yolopipe-", dir=base))
        (root / "metrics").mkdir()
        return cls(root, workers)

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    @property
    def starting(self) -> Path:
        """There while ``yolopipe serve`` starts its inference workers: its HTTP workers already
        answer, and are not ready until every inference worker is."""
        return self.root / "starting"

    def socket(self, worker: int) -> Path:
        return self.root / f"worker-{worker}.sock"

    def status(self, worker: int) -> Path:
        return self.root / f"worker-{worker}.status"

    def ring(self, worker: int, serial: int) -> Path:
        return self.root / f"ring-{os.getpid()}-{worker}-{serial}"

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
