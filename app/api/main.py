"""The FastAPI application of one HTTP worker: ``create_app(settings, inference)``.

Pure FastAPI: it parses and checks requests and hands image bytes to the ``inference`` client
it is given (``app.ipc.client.InferenceClient``: the inference workers someone else runs); it
never decodes an image, loads a model or starts a process. ``app.service`` builds it, for
``yolopipe serve`` and for an embedded app with its own workers.
Importing this module never loads torch, numba.cuda, CuPy or TensorRT.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from app.api.docs import install_docs
from app.api.errors import install_error_handlers
from app.api.framing import ConnectionCloseMiddleware, HeadAsGetMiddleware, RequestFramingMiddleware
from app.api.hotpath.front import HotPath
from app.api.hotpath.routes import DetectRoute, InferRoute
from app.api.limits import BodyHolds, BodyLimitMiddleware
from app.api.metrics import Metrics, MetricsMiddleware
from app.api.oip.errors import OipErrorShapeMiddleware
from app.api.oip.routes import router as oip_router
from app.api.oip.shm_routes import router as shm_router
from app.api.routes import router
from app.api.streams import streams_router
from app.ipc.client import InferenceClient
from app.settings import Settings

log = logging.getLogger("yolopipe.api")


class ServiceApp(FastAPI):
    """The FastAPI app with the hot path (``app/api/hotpath``) in front: the ordinary requests of
    the detect and OIP infer routes are answered there, everything else by FastAPI as usual."""

    hot_path: HotPath | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.hot_path is not None:
            found = self.hot_path.route(scope)
            if found is not None:
                await self.hot_path.serve(scope, receive, send, *found, fallback=super().__call__)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings, inference: InferenceClient) -> ServiceApp:
    """The service's routes in front of ``inference``, started and closed with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Not long: this worker's socket already listens, so a client would wait; until a worker is
        # connected requests get an immediate 503 (and /readyz says not ready).
        await inference.start(wait_s=2.0)
        app.state.metrics.workers_dir = inference.layout.metrics_dir
        app.state.inference = inference
        app.state.draining = False
        try:
            yield
        finally:
            # Uvicorn has stopped accepting and waited for in-flight requests.
            app.state.draining = True
            await inference.close()
            log.info("stopped")

    app = ServiceApp(
        title="yolopipe",
        version="0.1.0",
        description="YOLOv8 object detection. Errors are `{\"error\": {\"code\", \"message\"}}`.",
        lifespan=lifespan,
        docs_url=None,  # install_docs serves Swagger UI from the package: /docs works offline
        redoc_url=None,  # ReDoc loads from a CDN
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.inference = None
    app.state.draining = False
    install_error_handlers(app)
    install_docs(app)
    app.include_router(router)
    app.include_router(oip_router)  # the Open Inference Protocol (KServe v2) under /v2
    app.include_router(shm_router)  # and Triton's shared-memory extension
    app.include_router(streams_router)
    holds = BodyHolds(settings.max_requests_in_flight)  # the requests with a body this process holds
    # Outermost last: metrics see every response, including a 413 from the body limit.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       limits={streams_router.prefix: settings.max_stream_body_bytes}, holds=holds)
    app.add_middleware(RequestFramingMiddleware)  # one value per header acted on; no encoded '/' in a path
    app.add_middleware(OipErrorShapeMiddleware)  # /v2 errors as {"error": message}, the body limit's too
    app.add_middleware(HeadAsGetMiddleware)  # outside the reshaping: HEAD's Content-Length is GET's
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(ConnectionCloseMiddleware)  # every answer on a closing connection says so
    # In front of all that: the detect and OIP infer routes' ordinary requests (what the middlewares
    # above do for them, it does itself).
    app.hot_path = HotPath({"/v1/detect": DetectRoute(app.state, batch=False),
                            "/v1/detect/batch": DetectRoute(app.state, batch=True)},
                           InferRoute(app.state), holds, app.state.metrics, settings.max_body_bytes)
    return app
