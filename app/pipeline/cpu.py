"""The CPU request path: letterbox → host backend → NMS (the NumPy reference's keep set; compiled for many candidates)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from app.boxes import nms_numpy
from app.config import MAX_DET
from app.contracts import DetectParams, HostBackend, PipelineInput, PipelineRun, RunShape
from app.imaging.letterbox import letterbox, to_input
from app.pipeline.nms_cpu import nms_keep_indices_cpu
from app.types import ModelMeta


class CpuPipeline:
    """Implements ``app.contracts.Pipeline`` for a ``HostBackend``. One batch at a time
    (``in_flight = 1``): the backend's own threads already use every core. No bucket: ONNX
    Runtime runs any batch size as it is, padding none. ``shape``: the run shape ``app.runtime``
    clamped (``max_batch`` is read from it). It owns ``backend`` and closes it."""

    decodes_jpeg = False
    takes_nv12 = False
    device = None
    in_flight = 1
    buckets: tuple[int, ...] = ()

    def __init__(self, backend: HostBackend, meta: ModelMeta, shape: RunShape, *, max_det: int = MAX_DET) -> None:
        self.backend = backend.name
        self.precision = backend.precision
        self.meta = meta
        self.max_batch = shape.max_batch
        self.max_det = max_det
        self._engine = backend

    def warmup(self, batches: Sequence[int] | None = None, *, nv12: bool = False,
               frame_size: tuple[int, int] | None = None) -> None:
        """Nothing to prepare ahead: ONNX Runtime plans a shape on its first run."""

    def run(self, images: Sequence[PipelineInput], params: DetectParams) -> PipelineRun:
        t0 = time.perf_counter()
        placed = [letterbox(img, self.meta.imgsz) for img in images]
        batch = to_input([p[0] for p in placed])
        t1 = time.perf_counter()
        head = self._engine.infer(batch)
        t2 = time.perf_counter()
        rows = [nms_numpy(h, params, nms_keep_indices_cpu) for h in head]
        t3 = time.perf_counter()
        timings = {"preprocess_ms": (t1 - t0) * 1e3, "engine_ms": (t2 - t1) * 1e3, "nms_ms": (t3 - t2) * 1e3}
        return PipelineRun([(r, p[1]) for r, p in zip(rows, placed)], timings)

    def release_memory(self) -> None:
        """Free what the backend keeps between batches (ONNX Runtime's arena); the next batch
        allocates again."""
        self._engine.release_memory()

    def close(self) -> None:
        self._engine.close()
