"""The inference worker's metrics: stage latencies, batch sizes, images, device errors, queue
depth, restarts and GPU memory. Written to the supervisor's multiprocess folder like every
serving process's, and rendered by any HTTP worker (``app.ipc.metrics``)."""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from app.contracts import StageTimes
from app.ipc.answers import STAGES
from app.ipc.metrics import LATENCY_BUCKETS

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Under load, a batch's observations are written at most this late (with the others held since).
WRITE_EVERY_S = 0.1
_FEW_VALUES = 32  # observe_many counts up to this many values in Python
_PIPELINE_STAGES = tuple(name.removesuffix("_ms") for name in STAGES)  # pipeline_decode, preprocess, ...


@dataclass
class _Held:
    """Observations of batches not yet written to the metrics files."""

    queue: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    sizes: list[float] = field(default_factory=list)
    batch: list[float] = field(default_factory=list)
    stages: tuple[list[float], ...] = field(default_factory=lambda: tuple([] for _ in _PIPELINE_STAGES))
    ok: int = 0
    failed: int = 0


class WorkerMetrics:
    def __init__(self, worker: str) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.worker = worker
        self.stage_latency = Histogram(
            "yolopipe_stage_latency_seconds",
            "Latency per stage in the inference worker: queue (admitted to batch start), decode, batch (the "
            "detector call), and the pipeline's stages of each batch: pipeline_decode, preprocess, infer, postprocess",
            ["stage"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram("yolopipe_batch_size", "Images per detector batch", buckets=_BATCH_BUCKETS,
                                    registry=r)
        self._images = Counter("yolopipe_images", "Images answered by the inference workers, by outcome",
                               ["outcome", "worker"], registry=r)
        self.device_errors = Counter("yolopipe_device_errors", "Batches failed by the accelerator", registry=r)
        self._pending = Gauge("yolopipe_queue_depth", "Images admitted and not yet answered, summed over the "
                              "inference workers (each one's own: /v1/model)", multiprocess_mode="livesum", registry=r)
        self.restarts = Counter("yolopipe_worker_restarts", "Inference workers started again after one died",
                                ["worker"], registry=r)
        self._gpu_memory = Gauge(
            "yolopipe_gpu_memory_bytes", "GPU memory by source (allocator: the framework's pool; device: used on "
            "the whole device, from NVML)", ["worker", "source"], multiprocess_mode="livesum", registry=r)

        self._stages: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._held = _Held()
        self._written_at = time.monotonic()

    def images(self, outcome: str) -> Any:
        return self._images.labels(outcome, self.worker)

    def stage(self, name: str) -> Any:
        """The latency histogram of one stage (looked up once: ``labels`` costs more than ``observe``)."""
        child = self._stages.get(name)
        if child is None:
            child = self._stages[name] = self.stage_latency.labels(name)
        return child

    def observe_batch(self, queue_s: list[float], decode_s: list[float], size: int, batch_s: float,
                      stages: StageTimes, ok: int, failed: int) -> None:
        """One batch's observations: per image its queue wait and decode, then the batch's size
        (images that reached the detector), the detector call and the pipeline's stage times,
        and its images by outcome. Each written value costs a ``getpid`` and a write to this
        process's metrics file, so they are held and written together: by ``write`` (the
        batcher calls it once it has no admitted work left) or ``WRITE_EVERY_S`` after the last
        write. The histograms and counters are those of observing each value at once."""
        with self._lock:
            held = self._held
            held.queue += queue_s
            held.decode += decode_s
            held.sizes.append(size)
            held.batch.append(batch_s)
            for values, ms in zip(held.stages, stages.values()):
                values.append(ms / 1e3)
            held.ok += ok
            held.failed += failed
            write = time.monotonic() - self._written_at >= WRITE_EVERY_S
        if write:
            self.write()

    def write(self) -> None:
        """Write the observations held (``observe_batch``), if any."""
        with self._lock:
            self._written_at = time.monotonic()
            held = self._held
            if not held.sizes:  # (a batch thread about to wait, after the batch that wrote them)
                return
            self._held = _Held()
        for name, values in (("queue", held.queue), ("decode", held.decode), ("batch", held.batch),
                             *zip(_PIPELINE_STAGES, held.stages)):
            observe_many(self.stage(name), values)
        observe_many(self.batch_size, held.sizes)
        if held.ok:
            self.images("ok").inc(held.ok)
        if held.failed:
            self.images("failed").inc(held.failed)

    def set_pending(self, n: int) -> None:
        self._pending.set(n)

    def sample_gpu_memory(self, readers: dict[str, Callable[[], float | None]], every_s: float,
                          stop: threading.Event) -> threading.Thread | None:
        """Gauges set every ``every_s`` from a thread (multiprocess gauges cannot be read on demand)."""
        if not readers:
            return None

        def loop() -> None:
            while not stop.wait(every_s):
                for source, read in readers.items():
                    self._gpu_memory.labels(self.worker, source).set(read() or 0.0)

        thread = threading.Thread(target=loop, name="yolopipe-gpu-memory", daemon=True)
        thread.start()
        return thread


def observe_many(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for each of ``values``, one increment per bucket touched.

    prometheus_client has no call for it, so this adds to the child's bucket and sum values
    the way its ``observe`` does (a value counts in the first bucket whose bound it does not
    exceed; a NaN in none, its sum NaN from then on); where those are not there (another
    version), it observes one by one. A few values (a quiet worker writes a batch's at a time)
    are counted in Python, where NumPy's cost per call would be most of the work; many (a busy
    worker's, held ``WRITE_EVERY_S``) in NumPy."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            histogram.observe(v)
        return
    if not values:
        return
    added = float(sum(values))
    if added != 0.0:  # a stage a pipeline does not have (0 ms): its sum stays as it is, unwritten
        total.inc(added)
    if len(values) <= _FEW_VALUES:
        found: dict[int, int] = {}
        for v in values:
            if not math.isnan(v):
                i = bisect_left(bounds, v)
                found[i] = found.get(i, 0) + 1
        for i, n in found.items():
            buckets[i].inc(n)
        return
    counts = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds))
    for i in np.flatnonzero(counts[: len(bounds)]).tolist():  # (a NaN sorts past the last bound)
        buckets[i].inc(int(counts[i]))


# --- GPU memory readers -------------------------------------------------------------------
def gpu_memory_readers(detector: Any, device: int) -> dict[str, Callable[[], float | None]]:
    """How to read GPU memory for this detector; empty for a CPU backend.

    ``allocator``: torch's reserved pool when torch is already loaded (GPU backends load it; we
    never import it here). ``device``: memory used on the whole device, from NVML via ctypes.
    """
    if detector.backend == "onnxruntime":
        return {}
    readers: dict[str, Callable[[], float | None]] = {}
    if "torch" in sys.modules:
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
