"""Thin HTTP handlers: read the body and the parameters, hand the images to
``app/api/detection.py`` (each header checked, the bytes sent to the inference workers, the
JSON written from the arrays). No image is decoded here."""

from __future__ import annotations

import inspect
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from app.api.detection import detect_many, detect_one, one_image
from app.api.errors import error_body, error_response
from app.api.metrics import Metrics
from app.api.protocol import ON_DISCONNECT
from app.api.schemas import (
    DETECT_ERRORS,
    BatchResponse,
    ErrorResponse,
    Health,
    ImageDetections,
    ModelInfo,
    Ready,
    batch_request_body,
    detect_request_body,
)
from app.api.uploads import read_form_images
from app.config import CONF, IOU, MAX_DET
from app.contracts import DetectParams, make_params
from app.errors import InvalidParameter, Overloaded, UnsupportedMediaType
from app.ipc.client import InferenceClient
from app.settings import Settings

router = APIRouter()


# --- dependencies ----------------------------------------------------------------------
# Every dependency is ``async def``: FastAPI runs a plain ``def`` one in anyio's thread pool, a
# hand-off to another thread and back for each (five per /v1 request), though none blocks.
def get_inference(request: Request) -> InferenceClient:
    client: InferenceClient | None = request.app.state.inference
    if client is None or client.info is None:
        raise Overloaded("the service is starting; retry shortly")
    return client


async def inference_dependency(request: Request) -> InferenceClient:
    return get_inference(request)


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


InferenceDep = Annotated[InferenceClient, Depends(inference_dependency)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


def check_query(request: Request, known: tuple[str, ...]) -> None:
    """A query parameter the endpoint does not take (a typo such as ``cnf``) is a 422 naming it,
    never silently the default."""
    unknown = sorted({name for name in request.query_params if name not in known})
    if unknown:
        takes = f"it takes {', '.join(known)}" if known else "it takes no query parameters"
        raise InvalidParameter(f"unknown query parameter {', '.join(map(repr, unknown[:8]))} for {request.url.path}; "
                               + takes)


async def no_query(request: Request) -> None:
    """A dependency: the endpoint takes no query parameters."""
    check_query(request, ())


async def detect_params(
    inference: InferenceDep,
    conf: Annotated[float, Query(ge=0.0, le=1.0, description="confidence threshold")] = CONF,
    iou: Annotated[float, Query(ge=0.0, le=1.0, description="NMS IoU threshold")] = IOU,
    max_det: Annotated[int, Query(ge=1, le=MAX_DET, description="most detections per image")] = MAX_DET,
    classes: Annotated[
        list[str] | None,
        Query(description="class ids to keep: comma-separated (classes=0,2) or repeated (classes=0&classes=2)"),
    ] = None,
    agnostic: Annotated[bool, Query(description="class-agnostic NMS")] = False,
) -> DetectParams:
    class_ids: list[int] | None = None
    if classes:
        try:
            class_ids = [int(c) for part in classes for c in part.split(",") if c.strip()]
        except ValueError:
            raise InvalidParameter(f"classes must be integer class ids, got {','.join(classes)!r}") from None
    info = inference.info
    return make_params(conf, iou, max_det, class_ids or None, agnostic, num_classes=len(info["class_names"]))


ParamsDep = Annotated[DetectParams, Depends(detect_params)]
DETECT_QUERY = tuple(name for name in inspect.signature(detect_params).parameters if name != "inference")


async def detect_query(request: Request) -> None:
    """A dependency: the detect endpoints take ``detect_params``' query parameters only."""
    check_query(request, DETECT_QUERY)


# --- reading images from the body ------------------------------------------------------
def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def _read_single_image(request: Request, settings: Settings) -> tuple[str, bytes]:
    media = _media_type(request)
    if media == "multipart/form-data":
        return one_image(await read_form_images(request, "image", max_parts=settings.max_images_per_request,
                                                max_body_bytes=settings.max_body_bytes))
    if media.startswith("image/"):
        return "image", await request.body()
    raise unsupported_single(media)


def unsupported_single(media: str) -> UnsupportedMediaType:
    return UnsupportedMediaType(
        f"content type {media or '(none)'!r} is not accepted: send multipart/form-data with a field "
        "'image', or the raw image with an image/* content type"
    )


def unsupported_batch(media: str) -> UnsupportedMediaType:
    return UnsupportedMediaType(
        f"content type {media or '(none)'!r} is not accepted: send multipart/form-data with repeated field 'images'"
    )


def answer(result: bytes | Overloaded) -> Response:
    """A detect endpoint's answer: its JSON, or the refusal under load (unlogged: there are thousands a second)."""
    if isinstance(result, Overloaded):
        return error_response(result)
    return Response(result, media_type="application/json")


# --- endpoints -------------------------------------------------------------------------
# The hot path (``app/api/hotpath``) answers the ordinary requests of these two before FastAPI
# sees them, through the same ``app/api/detection.py``; these declarations give the schema and
# answer the rest (chunked bodies, unusual query strings, ...).
@router.post(
    "/v1/detect",
    summary="Detect objects in one image",
    response_model=None,
    responses={200: {"model": ImageDetections}, **DETECT_ERRORS},
    openapi_extra=detect_request_body(),
    dependencies=[Depends(detect_query)],
)
async def detect(request: Request, params: ParamsDep, inference: InferenceDep, settings: SettingsDep,
                 metrics: MetricsDep) -> Response:
    start = time.perf_counter()
    name, data = await _read_single_image(request, settings)
    return answer(await detect_one(inference, metrics, request.receive, name, data, params, settings.max_pixels,
                                   start, request.scope.get("extensions", {}).get(ON_DISCONNECT)))


@router.post(
    "/v1/detect/batch",
    summary="Detect objects in several images; results in request order, per-image errors inline",
    response_model=None,
    responses={200: {"model": BatchResponse}, **DETECT_ERRORS},
    openapi_extra=batch_request_body(),
    dependencies=[Depends(detect_query)],
)
async def detect_batch(request: Request, params: ParamsDep, inference: InferenceDep, settings: SettingsDep,
                       metrics: MetricsDep) -> Response:
    start = time.perf_counter()
    media = _media_type(request)
    if media != "multipart/form-data":
        raise unsupported_batch(media)
    images = await read_form_images(request, "images", max_parts=settings.max_images_per_request,
                                    max_body_bytes=settings.max_body_bytes)
    return answer(await detect_many(inference, metrics, request.receive, images, params, settings.max_pixels, start,
                                    request.scope.get("extensions", {}).get(ON_DISCONNECT)))


@router.get("/healthz", summary="The process is alive", response_model=Health)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="An inference worker is ready and this HTTP worker is not draining",
    response_model=Ready,
    responses={503: {"model": ErrorResponse}},
)
async def readyz(request: Request) -> Any:
    client: InferenceClient | None = request.app.state.inference
    if client is None or request.app.state.draining or not client.ready:
        workers = client.workers() if client else []
        doing = "; ".join(f"worker {w['worker']}: {'ready' if w['ready'] else w['phase']}" for w in workers)
        what = "the inference workers are starting" if any(w["ready"] for w in workers) else "no inference worker is ready"
        return JSONResponse(error_body("not_ready", what + (f" ({doing})" if doing else "")), status_code=503)
    return {"status": "ready", "startup": [{"worker": w["worker"], **w["startup"]} for w in client.workers()
                                           if w["startup"]]}


@router.get("/v1/model", summary="The served model, backend and serving limits", response_model=ModelInfo)
async def model_info(inference: InferenceDep, settings: SettingsDep) -> dict[str, Any]:
    info = dict(inference.info)
    info.update(
        weights=settings.weights,
        serving={
            "max_batch": info["max_batch"],  # the run shape's, as the inference workers clamped it (the one value)
            "max_wait_ms": settings.max_wait_ms,
            "queue_budget_s": settings.budget_s,
            "request_window": inference.window,
            "request_timeout_s": settings.request_timeout_s,
            "max_body_bytes": settings.max_body_bytes,
            "max_pixels": info.pop("max_pixels"),
            "inference_workers": inference.workers(),
        },
    )
    for key in ("worker", "generation", "pid", "in_flight", "device"):
        info.pop(key, None)
    return info


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    body, content_type = await request.app.state.metrics.render_off_loop()
    return Response(body, media_type=content_type)
