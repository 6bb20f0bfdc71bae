"""The HTTP workers' metrics, and ``/metrics``: every serving process's metrics on one page.

Under ``yolopipe serve`` every process writes to the supervisor's multiprocess folder, so one
HTTP worker renders them all from there. An app that runs in a process of its own choosing
(tests, embedding) keeps its HTTP metrics in memory and adds the inference workers' folder.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from app.ipc.metrics import LATENCY_BUCKETS, multiprocess_dir, render_dir

# Paths we label by name; anything else is "other" so random 404s cannot blow up label cardinality.
KNOWN_PATHS = frozenset(
    {"/v1/detect", "/v1/detect/batch", "/healthz", "/readyz", "/v1/model", "/metrics", "/docs", "/openapi.json",
     "/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/yolopipe", "/v2/models/yolopipe/ready",
     "/v2/models/yolopipe/infer"}
)


def rejected_counter(registry: CollectorRegistry) -> Counter:
    """Requests the service refused or failed, by code: one series for HTTP and gRPC workers alike
    (multiprocess mode sums the processes that define it)."""
    return Counter(
        "yolopipe_rejected", "Requests refused or failed by the service, not by their content, by error code "
        "(overloaded: over the time budget or no worker ready; device_error: the inference worker failed or "
        "stopped; timeout)", ["reason"], registry=registry,
    )


class Metrics:
    def __init__(self, workers_dir: Path | None = None) -> None:
        """``workers_dir``: where the inference workers write their metrics."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.workers_dir = workers_dir
        r = self.registry
        self.requests = Counter("yolopipe_requests", "HTTP requests by path and status", ["path", "status"], registry=r)
        self.request_latency = Histogram(
            "yolopipe_request_latency_seconds", "Whole-request latency", ["path"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.rejected = rejected_counter(r)
        self._rendering = asyncio.Lock()  # one scrape at a time reads the files; others wait for it
        # (path, status) → its two series: ``labels`` looks them up under a lock on every call
        self._series: dict[tuple[str, int], tuple[Any, Any]] = {}

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        series = self._series.get((path, status))
        if series is None:
            label = path if path in KNOWN_PATHS else "other"
            series = self.requests.labels(label, str(status)), self.request_latency.labels(label)
            if path in KNOWN_PATHS:  # other paths are any a client makes up: not kept
                self._series[path, status] = series
        series[0].inc()
        series[1].observe(seconds)

    async def render_off_loop(self) -> tuple[bytes, str]:
        """``render`` in a thread: it reads a file per process, which must not stall requests."""
        async with self._rendering:
            return await asyncio.to_thread(self.render)

    def render(self) -> tuple[bytes, str]:
        own = multiprocess_dir()
        if own is not None:  # this process writes there too: the folder has everything
            return render_dir(own), CONTENT_TYPE_LATEST
        body = generate_latest(self.registry)
        if self.workers_dir is not None:
            body += render_dir(self.workers_dir)
        return body, CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure ASGI middleware: counts every HTTP response by status and times it."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # if the app dies before starting a response, that is what the client sees

        async def send_and_record(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.observe_request(scope["path"], status, time.perf_counter() - start)
