"""The CPU request path: letterbox → host backend → NMS (the NumPy reference's keep set; compiled for many candidates)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from app.boxes import nms_numpy
from app.config import MAX_DET
from app.contracts import (
    BareRun,
    DetectParams,
    Diagnostics,
    PipelineInput,
    PipelineRun,
    RunFacts,
    RunShape,
    StageTimes,
    measure_once,
)
from app.engine_contracts import HostBackend
from app.errors import InvalidParameter
from app.imaging.letterbox import letterbox, to_input
from app.pipeline.nms_cpu import nms_keep_indices_cpu
from app.types import ModelMeta


class CpuPipeline:
    """Implements ``app.contracts.Pipeline`` for a ``HostBackend``. One batch at a time
    (``in_flight = 1``): the backend's own threads already use every core. No bucket: ONNX
    Runtime runs any batch size, and any input size, as it is, padding none. ``shape``: the run
    shape ``app.runtime`` clamped (``max_batch`` and ``letterbox`` are read from it; rect only
    where the backend ``takes_rect``). It owns ``backend`` and closes it."""

    decodes_jpeg = False
    takes_nv12 = False
    cuda = None
    in_flight = 1
    buckets: tuple[int, ...] = ()

    def __init__(self, backend: HostBackend, meta: ModelMeta, shape: RunShape, *, max_det: int = MAX_DET) -> None:
        if shape.letterbox == "rect" and not backend.takes_rect:
            raise InvalidParameter(f"this {backend.name} {backend.precision} model takes the {meta.imgsz} square only")
        self.backend = backend.name
        self.precision = backend.precision
        self.meta = meta
        self.max_batch = shape.max_batch
        self.letterbox = shape.letterbox
        self.max_det = max_det
        self._engine = backend
        self._stride = meta.stride if shape.letterbox == "rect" else 0  # 0: the square

    def warmup(self, batches: Sequence[int] | None = None, *, nv12: bool = False,
               frame_size: tuple[int, int] | None = None) -> None:
        """Nothing to prepare ahead: ONNX Runtime plans a shape on its first run."""

    def run(self, images: Sequence[PipelineInput], params: DetectParams, *, decode: str | None = None) -> PipelineRun:
        """``decode`` is a GPU pipeline's: images come here decoded."""
        t0 = time.perf_counter()
        placed = [letterbox(img, self.meta.imgsz, self._stride) for img in images]
        if len({p[0].shape for p in placed}) > 1:
            raise InvalidParameter("a rect run's images must share one input size (the Detector's runs do)")
        batch = to_input([p[0] for p in placed])
        t1 = time.perf_counter()
        head = self._engine.infer(batch)
        t2 = time.perf_counter()
        rows = [nms_numpy(h, params, nms_keep_indices_cpu) for h in head]
        t3 = time.perf_counter()
        times = StageTimes(preprocess_ms=(t1 - t0) * 1e3, infer_ms=(t2 - t1) * 1e3, postprocess_ms=(t3 - t2) * 1e3)
        return PipelineRun([(r, p[1]) for r, p in zip(rows, placed)], times, RunFacts(len(images), len(images)))

    def diagnose(self, *, decode: str | None = None,
                 profile: tuple[Sequence[PipelineInput], DetectParams] | None = None,
                 bare: np.ndarray | None = None, measure: Callable[[Callable[[], object]], list[float]] = measure_once,
                 timeline: bool = False) -> Diagnostics:
        """``Pipeline.diagnose`` as far as the CPU goes: its stage times are already the profile
        (no device stages), the bare engine is ``HostBackend.infer`` alone, and it keeps no
        timeline (there are no streams to overlap)."""
        profiled = self.run(profile[0], profile[1]) if profile is not None else None
        alone = BareRun(measure(lambda: self._engine.infer(bare)), []) if bare is not None else None
        return Diagnostics(decoder="opencv", compiled=False, compiler=self.backend, batch_invariant=False,
                           launch_error="no CUDA graphs: the model runs on the CPU", profiled=profiled, bare=alone)

    def release_memory(self) -> None:
        """Free what the backend keeps between batches (ONNX Runtime's arena); the next batch
        allocates again."""
        self._engine.release_memory()

    def close(self) -> None:
        self._engine.close()
