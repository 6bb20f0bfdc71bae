"""The Open Inference Protocol's (KServe v2) REST endpoints beside ``/v1``, on the same workers.

The same inference client, header checks, limits and parameter validation as ``/v1``; errors
are raised as ``app.errors`` and leave in the protocol's shape (``app/api/oip/errors.py``).
The model answers to ``yolopipe`` and to the weights' name (``/v1/model``'s ``weights``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.api.errors import error_response
from app.api.oip.infer import MODEL, VERSION, extensions, infer_outputs, model_name
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
from app.api.oip.shm_routes import region_access
from app.api.oip.tensors import INPUT, OUTPUTS, decompress, encode_response, parse_infer_request
from app.api.routes import get_inference
from app.config import Settings
from app.errors import Overloaded
from app.ipc.client import InferenceClient

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol (KServe v2)"])


def _model_name(request: Request, name: str, version: str | None = None) -> str:
    return model_name(name, version, request.app.state.settings)


def _ready(request: Request) -> bool:
    client: InferenceClient | None = request.app.state.inference
    return client is not None and not request.app.state.draining and client.ready


@router.get("", summary="Server metadata", response_model=ServerMetadata)
async def server_metadata(request: Request) -> dict[str, Any]:
    return {"name": MODEL, "version": request.app.version, "extensions": extensions(request.app.state.settings)}


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
    regions = region_access(request)
    parsed = parse_infer_request(body, request.headers.get("inference-header-content-length"),
                                 max_images=settings.max_images_per_request, regions=regions)
    del body  # the images are copies: the decompressed body need not live through the inference
    try:
        tensors = await infer_outputs(inference, parsed, settings, regions, request.app.state.metrics.rejected,
                                      parsed.timeout_s)
    except Overloaded as exc:  # answered unlogged, as /v1 does: under overload there are thousands
        return error_response(exc)
    content, header_length = encode_response(name, parsed.id, tensors, parsed.outputs, parsed.output_places)
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(header_length)})
