"""Thin HTTP handlers: read the body and the parameters, hand images to the batcher, shape the JSON."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException

from app.api.batching import DynamicBatcher, SlotResult
from app.api.errors import error_body, image_error_json, status_for
from app.api.schemas import (
    DETECT_ERRORS,
    BatchResponse,
    ErrorResponse,
    Health,
    ImageDetections,
    ModelInfo,
    batch_request_body,
    detect_request_body,
)
from app.config import Settings
from app.errors import InvalidParameter, UnsupportedMediaType, YolopipeError
from app.pipeline.detector import Detector
from app.types import DetectParams

router = APIRouter()


# --- dependencies ----------------------------------------------------------------------
def get_detector(request: Request) -> Detector:
    return request.app.state.detector


def get_batcher(request: Request) -> DynamicBatcher:
    return request.app.state.batcher


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def detect_params(
    detector: Annotated[Detector, Depends(get_detector)],
    conf: Annotated[float, Query(ge=0.0, le=1.0, description="confidence threshold")] = 0.25,
    iou: Annotated[float, Query(ge=0.0, le=1.0, description="NMS IoU threshold")] = 0.7,
    max_det: Annotated[int, Query(ge=1, le=1000, description="most detections per image")] = 300,
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
    return detector.params(conf=conf, iou=iou, max_det=max_det, classes=class_ids or None, agnostic=agnostic)


DetectorDep = Annotated[Detector, Depends(get_detector)]
BatcherDep = Annotated[DynamicBatcher, Depends(get_batcher)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
ParamsDep = Annotated[DetectParams, Depends(detect_params)]


# --- reading images from the body ------------------------------------------------------
def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def _read_form_images(request: Request, field: str, settings: Settings) -> list[tuple[str, bytes]]:
    """The files (or plain values) of ``field`` in a multipart body, with their file names."""
    try:
        async with request.form(max_files=settings.max_queue, max_fields=settings.max_queue,
                                max_part_size=settings.max_body_bytes) as form:
            images = []
            for i, value in enumerate(form.getlist(field)):
                if isinstance(value, UploadFile):
                    images.append((value.filename or f"{field}[{i}]", await value.read()))
                else:  # a plain form field: take its text as the image bytes (it will not decode)
                    images.append((f"{field}[{i}]", value.encode()))
    except YolopipeError:  # the body limit, raised while the body streams in
        raise
    except (StarletteHTTPException, MultiPartException) as exc:
        detail = getattr(exc, "detail", None) or getattr(exc, "message", "")
        raise StarletteHTTPException(400, f"malformed multipart body: {detail}") from None
    if not images:
        raise InvalidParameter(f"the multipart body has no field {field!r}")
    return images


async def _read_single_image(request: Request, settings: Settings) -> tuple[str, bytes]:
    media = _media_type(request)
    if media == "multipart/form-data":
        images = await _read_form_images(request, "image", settings)
        if len(images) != 1:
            raise InvalidParameter(f"send one file in field 'image' (got {len(images)}); use /v1/detect/batch for more")
        return images[0]
    if media.startswith("image/"):
        return "image", await request.body()
    raise UnsupportedMediaType(
        f"content type {media or '(none)'!r} is not accepted: send multipart/form-data with a field "
        "'image', or the raw image with an image/* content type"
    )


def _image_json(name: str, slot: SlotResult, names: list[str], total_ms: float) -> dict[str, Any]:
    out = slot.result.to_json(name, names)
    out["timings"] = {**slot.timings, "total_ms": round(total_ms, 3)}
    return out


# --- endpoints -------------------------------------------------------------------------
@router.post(
    "/v1/detect",
    summary="Detect objects in one image",
    response_model=None,
    responses={200: {"model": ImageDetections}, **DETECT_ERRORS},
    openapi_extra=detect_request_body(),
)
async def detect(
    request: Request, params: ParamsDep, batcher: BatcherDep, detector: DetectorDep, settings: SettingsDep
) -> JSONResponse:
    start = time.perf_counter()
    name, data = await _read_single_image(request, settings)
    (slot,) = await batcher.submit([data], params)
    if slot.result.error is not None:
        raise slot.result.error
    return JSONResponse(_image_json(name, slot, detector.names, (time.perf_counter() - start) * 1e3))


@router.post(
    "/v1/detect/batch",
    summary="Detect objects in several images; results in request order, per-image errors inline",
    response_model=None,
    responses={200: {"model": BatchResponse}, **DETECT_ERRORS},
    openapi_extra=batch_request_body(),
)
async def detect_batch(
    request: Request, params: ParamsDep, batcher: BatcherDep, detector: DetectorDep, settings: SettingsDep
) -> JSONResponse:
    start = time.perf_counter()
    media = _media_type(request)
    if media != "multipart/form-data":
        raise UnsupportedMediaType(
            f"content type {media or '(none)'!r} is not accepted: send multipart/form-data with repeated field 'images'"
        )
    images = await _read_form_images(request, "images", settings)
    slots = await batcher.submit([data for _, data in images], params)
    total_ms = (time.perf_counter() - start) * 1e3
    # A server-side failure (the device) fails the whole request, so the client retries it;
    # only the images' own problems are reported inline.
    for slot in slots:
        if slot.result.error is not None and status_for(slot.result.error) >= 500:
            raise slot.result.error
    results = []
    for (name, _), slot in zip(images, slots):
        if slot.result.error is not None:
            results.append(image_error_json(name, slot.result.error))
        else:
            results.append(_image_json(name, slot, detector.names, total_ms))
    return JSONResponse({"results": results, "timings": {"total_ms": round(total_ms, 3)}})


@router.get("/healthz", summary="The process is alive", response_model=Health)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="The detector is loaded and warmed, and the server is not draining",
    response_model=Health,
    responses={503: {"model": ErrorResponse}},
)
async def readyz(request: Request) -> Any:
    batcher: DynamicBatcher | None = getattr(request.app.state, "batcher", None)
    if not getattr(request.app.state, "ready", False) or batcher is None or batcher.closing:
        return JSONResponse(error_body("not_ready", "the detector is not ready"), status_code=503)
    return {"status": "ready"}


@router.get("/v1/model", summary="The served model, backend and serving limits", response_model=ModelInfo)
async def model_info(detector: DetectorDep, batcher: BatcherDep, settings: SettingsDep) -> dict[str, Any]:
    info = detector.info()
    info.update(
        weights=settings.weights,
        meta=asdict(detector.meta),
        serving={
            "max_batch": batcher.max_batch,
            "max_wait_ms": settings.max_wait_ms,
            "max_queue": settings.max_queue,
            "request_timeout_s": settings.request_timeout_s,
            "max_body_bytes": settings.max_body_bytes,
            "max_pixels": detector.max_pixels,
        },
    )
    engine_info = getattr(detector.pipeline, "engine_info", None)  # a GPU pipeline may describe its engine
    if callable(engine_info):
        info["engine"] = engine_info()
    return info


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)
