"""How every serving process's metrics meet: files in one folder, rendered as one page.

Each serving process writes its metrics to files in ``PROMETHEUS_MULTIPROC_DIR`` (set before
``prometheus_client`` is imported; the supervisor owns the folder), and any HTTP worker
renders all of them (``prometheus_client``'s multiprocess mode). The families themselves are
their processes': the HTTP workers' (``app.api.metrics``) and the inference workers'
(``app.service.inference.metrics``) never share a name.
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

# Latency buckets in seconds, shared by every process's latency histograms: sub-millisecond GPU
# stages up to multi-second CPU batches.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def render_dir(path: Path) -> bytes:
    """Every process's metrics written under ``path``, summed as multiprocess mode defines."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    return generate_latest(registry)


def multiprocess_dir() -> Path | None:
    """Where this process writes its metrics, when it runs in multiprocess mode."""
    value = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return Path(value) if value else None


def mark_dead(pid: int, path: Path) -> None:
    """Drop a dead process's live gauges (its counters and histograms keep counting)."""
    from prometheus_client.multiprocess import mark_process_dead

    mark_process_dead(pid, str(path))
