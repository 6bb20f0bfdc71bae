"""Loopback helpers for tests that start a server: a free port, waiting until it is ready and
until its inference worker is busy or idle, a flat JPEG, a ``yolopipe serve`` with gRPC
(``GrpcServer``), the photos the protocol tests send, a `/v1/detect` reference answer, reading
`/metrics`, raw HTTP/1.1 requests, and the resident memory of the server's process tree."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def taken_port() -> tuple[socket.socket, int]:
    """A port something listens on, with the port below it free."""
    for _ in range(50):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        try:
            with socket.socket() as below:
                below.bind(("127.0.0.1", port - 1))
        except OSError:
            listener.close()
            continue
        listener.listen()
        return listener, port
    raise AssertionError("no free port below a free port")


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


class GrpcServer:
    """``yolopipe serve`` on loopback with gRPC on a port of its own (CPU backend; one HTTP, one
    gRPC and one inference worker, no standby), ready on both; ``env``: more settings.
    ``client``: a tritonclient gRPC client of it."""

    def __init__(self, artifacts_dir: Path, log: Path, **env: str) -> None:
        import tritonclient.grpc

        self.port, self.grpc_port, self.log = free_port(), free_port(), log
        full_env = {**os.environ, "YOLOPIPE_ARTIFACTS_DIR": str(artifacts_dir), "YOLO_OFFLINE": "1",
                    "YOLOPIPE_MAX_WAIT_MS": "5", "YOLOPIPE_STANDBY": "false", "YOLOPIPE_WORKERS": "1",
                    "YOLOPIPE_GRPC_WORKERS": "1", "YOLOPIPE_GRPC_PORT": str(self.grpc_port), **env}
        with log.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--backend", "onnxruntime",
                                          "--host", "127.0.0.1", "--port", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, env=full_env)
        self.client = tritonclient.grpc.InferenceServerClient(self.grpc_target)
        wait_ready(self.url, self.proc, log, timeout=300)
        wait_ready(self.url, self.proc, log, timeout=60, ready=lambda _: self._grpc_ready())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _grpc_ready(self) -> bool:
        from tritonclient.utils import InferenceServerException

        try:
            return self.client.is_server_ready()
        except InferenceServerException:  # not listening yet
            return False

    def stop(self) -> int:
        """SIGTERM: every worker drains and the supervisor exits (0 when all went well)."""
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def four_photos(bus: bytes, zidane: bytes) -> list[bytes]:
    """Four real photos: two JPEGs, a PNG and a small crop (other sizes, other counts)."""
    zid = cv2.imdecode(np.frombuffer(zidane, np.uint8), cv2.IMREAD_COLOR)
    png = cv2.imencode(".png", cv2.resize(zid, (640, 360)))[1].tobytes()
    crop = cv2.imencode(".jpg", cv2.imdecode(np.frombuffer(bus, np.uint8), cv2.IMREAD_COLOR)[600:, :400])[1].tobytes()
    return [bus, zidane, png, crop]


def v1_detect(base: str, data: bytes, **params) -> list[dict]:
    """``/v1/detect``'s detections of ``data`` (list parameters joined by commas): the reference
    the other protocols are held to."""
    query = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in params.items()}
    r = httpx.post(f"{base}/v1/detect", content=data, params=query, headers={"content-type": "image/jpeg"},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["detections"]


def metric_sum(page: str, prefix: str) -> float:
    """The sum of every sample of a Prometheus page whose line starts with ``prefix``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(prefix))


def wait_until_idle(queue_depth: Callable[[], float], *, quiet_s: float = 2.0, timeout: float = 120.0) -> None:
    """Return once ``queue_depth()`` has read 0 for ``quiet_s`` seconds in a row."""
    deadline, idle_since = time.monotonic() + timeout, None
    while idle_since is None or time.monotonic() - idle_since < quiet_s:
        assert time.monotonic() < deadline, "the inference worker never went idle"
        idle = queue_depth() == 0
        idle_since = (idle_since or time.monotonic()) if idle else None
        time.sleep(0.05)


def wait_until_busy(queue_depth: Callable[[], float], *, timeout: float = 60.0) -> None:
    """Return once ``queue_depth()`` reads more than 0: the inference worker holds work."""
    deadline = time.monotonic() + timeout
    while queue_depth() == 0:
        assert time.monotonic() < deadline, "no work reached the inference worker"
        time.sleep(0.005)


def flat_jpeg(side: int) -> bytes:
    """A flat gray ``side``×``side`` JPEG: a few KB to send, a whole letterboxed input to detect."""
    return cv2.imencode(".jpg", np.full((side, side, 3), 114, np.uint8))[1].tobytes()


def http_request(path: str, body: bytes, content_type: str, host: str) -> bytes:
    """One ``POST`` as bytes on the wire."""
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def multipart(field: str, files: list[bytes]) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body of JPEG parts named ``field``, and its content type."""
    boundary = "yolopipe-test"
    parts = [(f'--{boundary}\r\ncontent-disposition: form-data; name="{field}"; filename="{i}.jpg"\r\n'
              "content-type: image/jpeg\r\n\r\n").encode() + data + b"\r\n" for i, data in enumerate(files)]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


async def exchange(host: str, port: int, request: bytes, timeout: float) -> int | None:
    """Send one request on a connection of its own and read its response to the end: its status
    (None: no answer)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return None
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split(b" ", 2)[1])
        length = re.search(rb"(?i)content-length:\s*(\d+)", head)
        if length:
            await asyncio.wait_for(reader.readexactly(int(length.group(1))), timeout)
        return status
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
        return None
    finally:
        writer.close()


def tree_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and all its descendants (a process gone counts 0)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return total


class RssSampler:
    """``tree_rss(pid)`` every ``period`` seconds on a thread while in the ``with`` block: its peak."""

    def __init__(self, pid: int, period: float = 0.1) -> None:
        self.pid, self.period, self.peak = pid, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, tree_rss(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
