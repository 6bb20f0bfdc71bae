"""The Open Inference Protocol's (KServe v2) REST endpoints beside ``/v1``, on the same workers.

The same inference client, header checks, limits and parameter validation as ``/v1``; errors
are raised as ``app.errors`` and leave in the protocol's shape (``app/api/oip/errors.py``).
The model answers to ``yolopipe`` and to the weights' name (``/v1/model``'s ``weights``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from app.api.errors import error_response
from app.api.oip.schemas import (
    INFER_REQUEST_BODY,
    INFER_RESPONSES,
    ModelMetadata,
    ModelReady,
    ServerLive,
    ServerMetadata,
    ServerReady,
    errors,
)
from app.api.oip.tensors import (
    INPUT,
    OUTPUTS,
    decompress,
    encode_response,
    output_tensors,
    parse_infer_request,
)
from app.api.routes import get_inference
from app.api.uploads import check_request_images
from app.config import CONF, IOU, MAX_DET, Settings
from app.contracts import DetectParams, make_params
from app.errors import InvalidParameter, Overloaded, RequestTimeout, YolopipeError
from app.ipc.client import SERVER_SIDE, InferenceClient
from app.ipc.wire import Outcome

MODEL = "yolopipe"
VERSION = "1"
EXTENSIONS = ["binary_tensor_data", "parameters"]

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol (KServe v2)"])


def _model_name(request: Request, name: str, version: str | None = None) -> str:
    settings: Settings = request.app.state.settings
    if name not in (MODEL, settings.weights):
        raise HTTPException(404, f"unknown model {name[:100]!r}; this server serves {MODEL!r} (also as {settings.weights!r})")
    if version is not None and version != VERSION:
        raise HTTPException(404, f"model {name!r} has version {VERSION!r} only, not {version[:20]!r}")
    return name


def _ready(request: Request) -> bool:
    client: InferenceClient | None = request.app.state.inference
    return client is not None and not request.app.state.draining and client.ready


@router.get("", summary="Server metadata", response_model=ServerMetadata)
async def server_metadata(request: Request) -> dict[str, Any]:
    return {"name": MODEL, "version": request.app.version, "extensions": EXTENSIONS}


@router.get("/health/live", summary="The server is live", response_model=ServerLive)
async def server_live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready", summary="An inference worker is ready (503 when not)", response_model=ServerReady,
            responses={503: {"model": ServerReady}})
async def server_ready(request: Request) -> JSONResponse:
    ready = _ready(request)
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)


@router.get("/models/{name}/ready", summary="The model is ready (503 when not)", response_model=ModelReady,
            responses={503: {"model": ModelReady}, **errors(404)})
@router.get("/models/{name}/versions/{version}/ready", include_in_schema=False)
async def model_ready(request: Request, name: str, version: str | None = None) -> JSONResponse:
    name = _model_name(request, name, version)
    ready = _ready(request)
    return JSONResponse({"name": name, "ready": ready}, status_code=200 if ready else 503)


@router.get("/models/{name}", summary="Model metadata: inputs and outputs, -1 for a variable dimension",
            response_model=ModelMetadata, responses=errors(404, 503))
@router.get("/models/{name}/versions/{version}", include_in_schema=False)
async def model_metadata(request: Request, name: str, version: str | None = None) -> dict[str, Any]:
    name = _model_name(request, name, version)
    inference = get_inference(request)
    return {
        "name": name,
        "versions": [VERSION],
        "platform": f"yolopipe_{inference.info['backend']}",
        "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": n, "datatype": t, "shape": s} for n, (t, s) in OUTPUTS.items()],
    }


@router.post("/models/{name}/infer", summary="Detect objects in a batch of encoded images", response_model=None,
             responses=INFER_RESPONSES, openapi_extra=INFER_REQUEST_BODY)
@router.post("/models/{name}/versions/{version}/infer", include_in_schema=False)
async def infer(request: Request, name: str, version: str | None = None) -> Response:
    name = _model_name(request, name, version)
    inference = get_inference(request)
    settings: Settings = request.app.state.settings
    # The body limit bounds what is read (BodyLimitMiddleware); decompressing is held to it too.
    body = decompress(await request.body(), request.headers.get("content-encoding"), settings.max_body_bytes)
    parsed = parse_infer_request(body, request.headers.get("inference-header-content-length"),
                                 max_images=settings.max_images_per_request)
    params = detect_params(parsed.parameters, num_classes=len(inference.info["class_names"]))
    del body  # the images are copies: the decompressed body need not live through the inference
    # No per-image errors in this protocol: the first image that fails fails the request.
    headers = check_request_images(parsed.images, max_pixels=settings.max_pixels)
    for i, checked in enumerate(headers):
        if isinstance(checked, YolopipeError):
            raise _for_image(i, checked)
    try:  # the headers read here travel with the bytes: the inference worker never reads them again
        outcomes = await _detect_within(inference, parsed.images, headers, params, parsed.timeout_s, settings)
    except SERVER_SIDE as exc:
        request.app.state.metrics.rejected.labels(exc.code).inc()
        if isinstance(exc, Overloaded):  # answered unlogged, as /v1 does: under overload there are thousands
            return error_response(exc)
        raise
    for i, outcome in enumerate(outcomes):
        if outcome.error is not None:
            raise _for_image(i, outcome.error)
    tensors = output_tensors([o.detections for o in outcomes])  # type: ignore[misc]
    content, header_length = encode_response(name, parsed.id, tensors, parsed.outputs)
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(header_length)})


async def _detect_within(inference: InferenceClient, images: list[bytes], headers: list[Any], params: DetectParams,
                         timeout_s: float | None, settings: Settings) -> list[Outcome]:
    """The inference client's answer, within the request's own timeout when it asks for a shorter
    one than the server's (Triton's ``timeout`` parameter); cancelling stops its queued work."""
    if timeout_s is None or timeout_s >= settings.request_timeout_s:
        return await inference.detect(images, params, headers)
    try:
        return await asyncio.wait_for(inference.detect(images, params, headers), timeout_s)
    except TimeoutError:
        raise RequestTimeout(f"no result within the request's timeout of {timeout_s:g} s") from None


def detect_params(parameters: dict[str, Any], *, num_classes: int) -> DetectParams:
    """``/v1``'s parameters (names, defaults, limits) from a request's ``parameters`` object."""
    values = dict(parameters)
    conf = _number(values.pop("conf", CONF), "conf")
    iou = _number(values.pop("iou", IOU), "iou")
    max_det = values.pop("max_det", MAX_DET)
    if not isinstance(max_det, int) or isinstance(max_det, bool):
        raise InvalidParameter(f"max_det must be an integer, got {str(max_det)[:40]!r}")
    agnostic = values.pop("agnostic", False)
    if not isinstance(agnostic, bool):
        raise InvalidParameter(f"agnostic must be true or false, got {str(agnostic)[:40]!r}")
    classes = _class_ids(values.pop("classes", None))
    if values:
        raise InvalidParameter(f"unknown parameters {sorted(values)[:8]}; this model takes conf, iou, max_det, "
                               "classes and agnostic")
    return make_params(conf, iou, max_det, classes, agnostic, num_classes=num_classes)


def _number(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidParameter(f"{name} must be a number, got {str(value)[:40]!r}")
    return float(value)


def _class_ids(value: Any) -> list[int] | None:
    """A list of class ids, one id, or a comma string ("0,2"), as ``/v1``'s ``classes``."""
    if value is None:
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.lstrip("-").isdigit() for p in parts):
            raise InvalidParameter(f"classes must be integer class ids, got {value[:60]!r}")
        return [int(p) for p in parts] or None
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in items):
        raise InvalidParameter(f"classes must be integer class ids, got {str(value)[:60]!r}")
    return items or None


def _for_image(index: int, error: YolopipeError) -> YolopipeError:
    """The same error (so the same status), saying which image of the batch it was."""
    return type(error)(f"image {index}: {error.message}", hint=error.hint)
