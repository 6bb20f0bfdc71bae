"""Thin HTTP handlers: read the body and the parameters, check each image's header, hand the
bytes (with their headers) to the inference workers, write the JSON (``app.records``, in the
compact form Starlette's ``JSONResponse`` writes). No image is decoded here."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from app.api.errors import error_body, error_response, image_error_fields
from app.api.metrics import Metrics
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
from app.api.uploads import check_request_images, read_form_images
from app.config import CONF, IOU, MAX_DET, Settings
from app.contracts import DetectedBatch, DetectParams, make_params
from app.errors import (
    ClientDisconnected,
    InvalidParameter,
    Overloaded,
    UnsupportedMediaType,
    YolopipeError,
)
from app.imaging.check import check_image
from app.imaging.headers import ImageHeader
from app.ipc.answers import Answers
from app.ipc.client import SERVER_SIDE, InferenceClient
from app.records import HTTP, records

router = APIRouter()


# --- dependencies ----------------------------------------------------------------------
def get_inference(request: Request) -> InferenceClient:
    client: InferenceClient | None = request.app.state.inference
    if client is None or client.info is None:
        raise Overloaded("the service is starting; retry shortly")
    return client


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


InferenceDep = Annotated[InferenceClient, Depends(get_inference)]
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


def no_query(request: Request) -> None:
    """A dependency: the endpoint takes no query parameters."""
    check_query(request, ())


def detect_params(
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


def detect_query(request: Request) -> None:
    """A dependency: the detect endpoints take ``detect_params``' query parameters only."""
    check_query(request, DETECT_QUERY)


# --- reading images from the body ------------------------------------------------------
def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def _read_single_image(request: Request, settings: Settings) -> tuple[str, bytes]:
    media = _media_type(request)
    if media == "multipart/form-data":
        images = await read_form_images(request, "image", max_parts=settings.max_images_per_request,
                                        max_body_bytes=settings.max_body_bytes)
        if len(images) != 1:
            raise InvalidParameter(f"send one file in field 'image' (got {len(images)}); use /v1/detect/batch for more")
        return images[0]
    if media.startswith("image/"):
        return "image", await request.body()
    raise UnsupportedMediaType(
        f"content type {media or '(none)'!r} is not accepted: send multipart/form-data with a field "
        "'image', or the raw image with an image/* content type"
    )


async def _detect(request: Request, inference: InferenceClient, metrics: Metrics, images: list[bytes],
                  headers: list[ImageHeader], params: DetectParams) -> Answers | JSONResponse:
    """The images' answers, or the 503 for a request refused under load: answered here, unlogged (under
    overload there are thousands a second; /metrics counts them). A client that hangs up
    meanwhile stops its work: what it left queued is never run (``ClientDisconnected``, 499)."""
    detecting = asyncio.ensure_future(inference.detect(images, params, headers))
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((detecting, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (the server stops): so is the work
        detecting.cancel()
        raise
    finally:
        gone.cancel()
    if not detecting.done():
        detecting.cancel()  # the client's cancel: its queued images are answered without running
        raise ClientDisconnected("the client went away before its answer")
    error = detecting.exception()
    if error is None:
        return detecting.result()
    # Raised here, the error's traceback would hold this frame, and through ``detecting`` the
    # frame would hold the error: a cycle that keeps ``images`` until a full collection.
    del detecting
    if isinstance(error, SERVER_SIDE):
        metrics.rejected.labels(error.code).inc()
    if isinstance(error, Overloaded):
        return error_response(error)
    try:
        raise error
    finally:
        del error


async def _until_disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read to its end before: only the
    disconnect is left to receive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _timings(answered: Answers, total_ms: float) -> list[str]:
    """Each answered image's ``timings`` field (none for one that failed): its times and its
    batch's (``Answers.times``), then the request's total."""
    failed = answered.detected.errors
    total = round(total_ms, 3)
    return ["" if i in failed else HTTP.fields(timings={**{k: round(v, 3) for k, v in times.items()}, "total_ms": total})
            for i, times in enumerate(answered.times())]


def _image_records(names: list[str], batch: DetectedBatch, timings: list[str], class_names: list[str]) -> list[str]:
    """Each image's JSON object: a line of ``predict`` plus its ``timings``, or, for an image that
    failed, its error with the status it would have alone."""
    return records([HTTP.fields(image=name) for name in names], batch, class_names, tails=timings, style=HTTP,
                   error_fields=image_error_fields)


def _json(text: str) -> Response:
    return Response(text.encode(), media_type="application/json")


# --- endpoints -------------------------------------------------------------------------
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
    header = check_image(data, max_pixels=settings.max_pixels)  # format, size and memory, before any decode
    answered = await _detect(request, inference, metrics, [data], [header], params)
    if isinstance(answered, JSONResponse):
        return answered
    if answered.detected.errors:
        raise answered.detected.errors[0]
    total_ms = (time.perf_counter() - start) * 1e3
    timings = _timings(answered, total_ms)
    return _json(_image_records([name], answered.detected, timings, inference.info["class_names"])[0])


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
        raise UnsupportedMediaType(
            f"content type {media or '(none)'!r} is not accepted: send multipart/form-data with repeated field 'images'"
        )
    images = await read_form_images(request, "images", max_parts=settings.max_images_per_request,
                                    max_body_bytes=settings.max_body_bytes)
    # Each header is checked (format, size, memory, the request's pixel budget) before anything is
    # decoded; images that fail are answered here, in their places, the rest go to the inference workers.
    checked = check_request_images([data for _, data in images], max_pixels=settings.max_pixels)
    refused = [i for i, c in enumerate(checked) if isinstance(c, YolopipeError)]
    sent = [i for i, c in enumerate(checked) if not isinstance(c, YolopipeError)]
    answered = await _detect(request, inference, metrics, [images[i][1] for i in sent],
                             [checked[i] for i in sent], params) if sent else None  # type: ignore[misc]
    if isinstance(answered, JSONResponse):
        return answered
    total_ms = (time.perf_counter() - start) * 1e3
    # The answered images, then the refused ones, each put back in its place in the request.
    parts = [DetectedBatch.failed([checked[i] for i in refused])]  # type: ignore[misc]
    timings = [""] * len(images)
    if answered is not None:
        parts.insert(0, answered.detected)
        for i, text in zip(sent, _timings(answered, total_ms)):
            timings[i] = text
    batch = DetectedBatch.concat(parts).take(np.argsort(sent + refused))
    results = _image_records([name for name, _ in images], batch, timings, inference.info["class_names"])
    return _json('{"results":[' + ",".join(results) + '],' + HTTP.fields(timings={"total_ms": round(total_ms, 3)})
                 + "}")


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
