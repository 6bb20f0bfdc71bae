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
from app.api.oip.infer import MODEL, VERSION, extensions, model_name
from app.api.oip.rest import infer_answer
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
from app.api.oip.tensors import INPUT, OUTPUTS
from app.api.routes import get_inference
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
    # The hot path (``app/api/hotpath``) answers the ordinary requests of this route before
    # FastAPI sees them, through the same ``infer_answer``; this declaration gives the schema and
    # answers the rest (a chunked body, ...).
    name = _model_name(request, name, version)
    inference = get_inference(request)
    result = await infer_answer(inference, request.app.state.settings, request.app.state.metrics.rejected, name,
                                await request.body(), request.headers.get("content-encoding"),
                                request.headers.get("inference-header-content-length"), region_access(request))
    if isinstance(result, Overloaded):
        return error_response(result)
    content, media_type, header_length = result
    headers = None if header_length is None else {"Inference-Header-Content-Length": str(header_length)}
    return Response(content, media_type=media_type, headers=headers)
