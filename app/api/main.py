"""The FastAPI application of one HTTP worker: ``create_app(settings)``.

An HTTP worker parses and checks requests and hands image bytes to the inference workers
(``app.serving``); it never decodes an image or loads a model. Under ``yolopipe serve`` the
supervisor started those workers and passes their run folder (``layout``); without one, the
app starts its own for its lifetime (tests, embedding), through the same code.
Importing this module never loads torch, numba.cuda, CuPy or TensorRT.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app.api.docs import install_docs
from app.api.errors import install_error_handlers
from app.api.limits import BodyLimitMiddleware
from app.api.metrics import Metrics, MetricsMiddleware
from app.api.routes import router
from app.config import Settings
from app.serving.client import InferenceClient
from app.serving.processes import RunLayout
from app.serving.settings import ServingSettings

log = logging.getLogger("yolopipe.api")


def create_app(settings: Settings | None = None, *, layout: RunLayout | None = None) -> FastAPI:
    """The service. ``layout``: inference workers someone else runs (the supervisor)."""
    serving = ServingSettings.from_settings(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = None
        run = layout
        if run is None:  # our own inference workers, for as long as the app lives
            from app.serving.pool import InferencePool

            devices = serving.inference_devices()
            run = RunLayout.create(len(devices))
            pool = InferencePool(serving, run, devices)
            try:
                await asyncio.to_thread(pool.start)
            except BaseException:
                run.remove()
                raise
        app.state.metrics.workers_dir = run.metrics_dir
        client = InferenceClient(serving, run)
        # Not long: this worker's socket already listens, so a client would wait; until a worker is
        # connected requests get an immediate 503 (and /readyz says not ready).
        await client.start(wait_s=2.0)
        app.state.inference = client
        app.state.draining = False
        try:
            yield
        finally:
            # Uvicorn has stopped accepting and waited for in-flight requests.
            app.state.draining = True
            await client.close()
            if pool is not None:
                await asyncio.to_thread(pool.stop, serving.request_timeout_s)
                run.remove()
            log.info("stopped")

    app = FastAPI(
        title="yolopipe",
        version="0.1.0",
        description="YOLOv8 object detection. Errors are `{\"error\": {\"code\", \"message\"}}`.",
        lifespan=lifespan,
        docs_url=None,  # install_docs serves Swagger UI from the package: /docs works offline
        redoc_url=None,  # ReDoc loads from a CDN
    )
    app.state.settings = serving
    app.state.metrics = Metrics()
    app.state.inference = None
    app.state.draining = False
    install_error_handlers(app)
    install_docs(app)
    app.include_router(router)
    # Outermost last: metrics see every response, including a 413 from the body limit.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=serving.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app
