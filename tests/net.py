"""Loopback helpers for tests that start a server: a free port, and waiting until it is ready."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readyz_ok(base: str) -> bool:
    return httpx.get(f"{base}/readyz", timeout=2).status_code == 200


def wait_ready(base: str, proc: subprocess.Popen, log: Path, *, timeout: float = 180.0,
               ready: Callable[[str], bool] = readyz_ok) -> None:
    """Return once ``ready(base)`` holds (default: ``/readyz`` answers 200). Fail the test, with
    the tail of the server's log, if the process exits first or ``timeout`` seconds pass.
    Connection errors while it starts count as not ready yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if ready(base):
                return
        except (httpx.TransportError, OSError):
            pass
        time.sleep(0.25)
    pytest.fail(f"server not ready in {timeout} s:\n{log.read_text()[-3000:]}")
