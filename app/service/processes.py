"""What every serving process does the same way: dying with its parent, logging, metrics files."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Linux: this process gets SIGKILL when the thread that started it ends, so a killed
    supervisor never leaves workers behind."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() != parent_pid:  # the parent was gone before we asked
        os._exit(1)


def write_metrics_to(folder: Path) -> None:
    """Metrics of this process go to files in ``folder`` (prometheus_client's multiprocess mode).

    prometheus_client picks its storage when imported, and a spawned child may have imported
    it already (while re-importing the parent's main module), so pick again."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    from prometheus_client import values

    values.ValueClass = values.get_value_class()


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
