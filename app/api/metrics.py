"""Prometheus metrics of one app: its own registry, so several apps can live in one process (tests)."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Latency buckets in seconds: sub-millisecond GPU stages up to multi-second CPU batches.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Paths we label by name; anything else is "other" so random 404s cannot blow up label cardinality.
KNOWN_PATHS = frozenset(
    {"/v1/detect", "/v1/detect/batch", "/healthz", "/readyz", "/v1/model", "/metrics", "/docs", "/openapi.json"}
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "yolopipe_requests", "HTTP requests by path and status", ["path", "status"], registry=r
        )
        self.request_latency = Histogram(
            "yolopipe_request_latency_seconds", "Whole-request latency", ["path"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.stage_latency = Histogram(
            "yolopipe_stage_latency_seconds",
            "Latency per stage: decode (CPU thread), queue (wait for a batch), batch (detector call), "
            "and the pipeline's own preprocess/engine/nms when it reports them",
            ["stage"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "yolopipe_batch_size", "Images per detector batch", buckets=_BATCH_BUCKETS, registry=r
        )
        self.images = Counter("yolopipe_images", "Images processed by outcome", ["outcome"], registry=r)
        self.queue_depth = Gauge(
            "yolopipe_queue_depth", "Images admitted and not finished (decoding, queued or running)", registry=r
        )
        self.rejected = Counter(
            "yolopipe_rejected", "Requests refused before any work, by reason", ["reason"], registry=r
        )
        self.device_errors = Counter(
            "yolopipe_device_errors", "Batches failed by the accelerator", registry=r
        )

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        label = path if path in KNOWN_PATHS else "other"
        self.requests.labels(label, str(status)).inc()
        self.request_latency.labels(label).observe(seconds)

    def add_gpu_memory(self, readers: dict[str, Callable[[], float | None]]) -> None:
        """Gauges for GPU memory, registered only when a GPU backend can report it."""
        if not readers:
            return
        gauge = Gauge(
            "yolopipe_gpu_memory_bytes", "GPU memory by source (allocator: the framework's pool; device: "
            "used on the whole device, from NVML)", ["source"], registry=self.registry,
        )
        for source, read in readers.items():
            gauge.labels(source).set_function(lambda read=read: read() or 0.0)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


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


# --- GPU memory readers -------------------------------------------------------------------
def gpu_memory_readers(detector: Any, device: int) -> dict[str, Callable[[], float | None]]:
    """How to read GPU memory for this detector; empty for a CPU backend.

    ``allocator``: the pipeline's own report (``pipeline.device_memory_bytes()``) if it has
    one, else torch's reserved pool when torch is already loaded (GPU backends load it; we
    never import it here). ``device``: memory used on the whole device, from NVML via ctypes.
    """
    pipeline = detector.pipeline
    if pipeline.backend == "onnxruntime":
        return {}
    readers: dict[str, Callable[[], float | None]] = {}
    own = getattr(pipeline, "device_memory_bytes", None)
    if callable(own):
        readers["allocator"] = own
    elif "torch" in sys.modules:
        torch = sys.modules["torch"]
        readers["allocator"] = lambda: float(torch.cuda.memory_reserved(device))
    nvml = _NvmlMemory.open(device)
    if nvml is not None:
        readers["device"] = nvml.used_bytes
    return readers


class _NvmlMemoryInfo(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _NvmlMemory:
    """Device memory in use, through libnvidia-ml (needs no CUDA context on the calling thread)."""

    def __init__(self, lib: Any, handle: ctypes.c_void_p) -> None:
        self._lib = lib
        self._handle = handle

    @classmethod
    def open(cls, device: int) -> _NvmlMemory | None:
        for name in ("libnvidia-ml.so.1", "libnvidia-ml.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            return None
        handle = ctypes.c_void_p()
        if lib.nvmlInit_v2() != 0:
            return None
        # NVML numbers every GPU of the host; CUDA only the visible ones. Map through
        # CUDA_VISIBLE_DEVICES (an index or a UUID per entry) when it is set.
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if device < len(visible) and not visible[device].isdigit():
            status = lib.nvmlDeviceGetHandleByUUID(visible[device].encode(), ctypes.byref(handle))
        else:
            index = int(visible[device]) if device < len(visible) else device
            status = lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
        return cls(lib, handle) if status == 0 else None

    def used_bytes(self) -> float | None:
        info = _NvmlMemoryInfo()
        if self._lib.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(info)) != 0:
            return None
        return float(info.used)
