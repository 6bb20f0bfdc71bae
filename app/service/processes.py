"""What every serving process does the same way: dying with its parent, logging, metrics files,
its event loop."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


def write_metrics_to(folder: Path) -> None:
    """Metrics of this (worker) process go to files in ``folder`` (prometheus_client's
    multiprocess mode, chosen by this variable when prometheus_client is imported).

    A worker normally has it from its parent (``metrics_folder``) or sets it before importing
    prometheus_client. Only if a spawned child imported prometheus_client first (re-importing
    its parent's main module) is the storage picked again, with prometheus_client's own chooser."""
    os.environ[_MULTIPROC_DIR] = str(folder)
    values = sys.modules.get("prometheus_client.values")
    if values is not None and values.ValueClass is not values.get_value_class():
        values.ValueClass = values.get_value_class()


@contextmanager
def metrics_folder(folder: Path) -> Iterator[None]:
    """Processes started inside write their metrics to ``folder``; the variable is put back after."""
    previous = os.environ.get(_MULTIPROC_DIR)
    os.environ[_MULTIPROC_DIR] = str(folder)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_MULTIPROC_DIR, None)
        else:
            os.environ[_MULTIPROC_DIR] = previous


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def run_event_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """``main`` on uvloop's event loop where it is installed (as uvicorn runs the HTTP workers;
    sockets, transports and callbacks in C), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
