"""The FastAPI application: ``create_app(settings)``.

Nothing is loaded at import: the lifespan opens (or adopts) the detector, warms it on the
batcher's worker thread, serves, then drains the batcher and releases the detector.
Importing this module never loads torch, numba.cuda, CuPy or TensorRT.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app.api.batching import DynamicBatcher, warmup_detector
from app.api.errors import install_error_handlers
from app.api.limits import BodyLimitMiddleware
from app.api.metrics import Metrics, MetricsMiddleware, gpu_memory_readers
from app.api.routes import router
from app.config import Settings
from app.pipeline.detector import Detector
from app.runtime import open_detector_from

log = logging.getLogger("yolopipe.api")


def create_app(settings: Settings | None = None, *, detector: Detector | None = None) -> FastAPI:
    """The service. ``detector``: one the caller opened and keeps owning (the app will not close
    it); without it the lifespan opens one from ``settings`` and closes it on shutdown."""
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = detector is None
        det = await asyncio.to_thread(open_detector_from, settings) if owned else detector
        assert det is not None
        batcher = DynamicBatcher(
            det,
            max_batch=settings.max_batch,
            max_wait_ms=settings.max_wait_ms,
            max_queue=settings.max_queue,
            request_timeout_s=settings.request_timeout_s,
            metrics=metrics,
        )
        # A GPU pipeline sets up per batch size (CUDA graphs): pay for the common sizes now.
        sizes = (1,) if det.pipeline.backend == "onnxruntime" else tuple(sorted({1, batcher.max_batch}))
        try:
            await batcher.start(warmup=lambda d: warmup_detector(d, sizes))
        except BaseException:
            await batcher.close()
            if owned:
                det.close()
            raise
        metrics.add_gpu_memory(gpu_memory_readers(det, settings.device))
        app.state.detector = det
        app.state.batcher = batcher
        app.state.ready = True
        log.info("ready: %s on %s/%s, max batch %d", det.meta.name, det.pipeline.backend,
                 det.pipeline.precision, batcher.max_batch)
        try:
            yield
        finally:
            # Uvicorn has stopped accepting and waited for in-flight requests; drain what is left.
            app.state.ready = False
            await batcher.close()
            if owned:
                det.close()
            log.info("stopped")

    app = FastAPI(
        title="yolopipe",
        version="0.1.0",
        description="YOLOv8 object detection. Errors are `{\"error\": {\"code\", \"message\"}}`.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.ready = False
    install_error_handlers(app)
    app.include_router(router)
    # Outermost last: metrics see every response, including a 413 from the body limit.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
