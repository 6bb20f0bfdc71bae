"""Triton's shared-memory extension over REST: ``/v2/systemsharedmemory`` (register, unregister,
status), and ``/v2/cudasharedmemory`` answering that CUDA shared memory is not supported (400, as Triton's UNSUPPORTED).

The registry is ``app/api/oip/shared_memory.py``'s, shared with the gRPC service; errors are
``SharedMemoryError`` (400), in the protocol's ``{"error": message}`` shape.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from app.api.oip.schemas import errors, inline_schema
from app.api.oip.shared_memory import RegionAccess, SharedMemoryRegistry, is_loopback, run_registry
from app.errors import BadRequest, NotSupported, Overloaded, SharedMemoryError

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol: shared memory"])
_CUDA = "CUDA shared memory is not supported by this server; register system shared memory instead"


class RegionStatus(BaseModel):
    name: str
    key: str
    offset: int
    byte_size: int


class RegisterRequest(BaseModel):
    key: str = Field(description="a POSIX shared-memory name, '/name' (the object /dev/shm/name)")
    offset: int = Field(0, description="where the region starts in the object, in bytes")
    byte_size: int = Field(description="the region's size in bytes")


class Done(BaseModel):
    """An empty JSON object."""


_REGISTER_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": inline_schema(RegisterRequest)}}}}
_ANSWERS = errors(400, 503)


def registry(request: Request) -> SharedMemoryRegistry:
    """This server's registry (in the run folder of the inference workers it talks to)."""
    return registry_of(request.app.state)


def registry_of(state: Any) -> SharedMemoryRegistry:
    """``registry`` of an app's ``state``."""
    found: SharedMemoryRegistry | None = getattr(state, "shared_memory", None)
    if found is None:
        inference = state.inference
        if inference is None:
            raise Overloaded("the service is starting; retry shortly")
        found = run_registry(inference.layout.root, enabled=state.settings.allow_client_shm)
        state.shared_memory = found
    return found


def _local(request: Request) -> bool:
    return request.client is not None and is_loopback(request.client.host)


def region_access(request: Request) -> RegionAccess | None:
    """What an inference request may do with the regions (None before the service is up)."""
    return region_access_of(request.app.state, request.client.host if request.client is not None else None)


def region_access_of(state: Any, client_host: str | None) -> RegionAccess | None:
    """``region_access`` of an app's ``state`` for a client at ``client_host``."""
    if state.inference is None:
        return None
    return RegionAccess(registry_of(state), is_loopback(client_host), state.settings.max_body_bytes)


@router.get("/systemsharedmemory/status", summary="Every registered system shared-memory region",
            response_model=list[RegionStatus], responses=_ANSWERS)
async def system_status_all(request: Request) -> list[dict[str, Any]]:
    return _status(request, "")


@router.get("/systemsharedmemory/region/{name}/status", summary="One registered region (400 when it is not)",
            response_model=list[RegionStatus], responses=_ANSWERS)
async def system_status(request: Request, name: str) -> list[dict[str, Any]]:
    return _status(request, name)


def _status(request: Request, name: str) -> list[dict[str, Any]]:
    regions = registry(request).status(name, local=_local(request))
    return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]


@router.post("/systemsharedmemory/region/{name}/register", summary="Register a POSIX shared-memory region",
             response_model=Done, responses=_ANSWERS, openapi_extra=_REGISTER_BODY)
async def system_register(request: Request, name: str) -> JSONResponse:
    try:
        body = json.loads(await request.body() or b"null")
    except (ValueError, RecursionError):
        raise BadRequest("the register request is not valid JSON") from None
    if not isinstance(body, dict):
        raise SharedMemoryError("the register request must be a JSON object with key, offset and byte_size")
    for field in ("key", "byte_size"):
        if field not in body:
            raise SharedMemoryError(f"the register request has no {field!r}")
    registry(request).register(name, body["key"], body.get("offset", 0), body["byte_size"], local=_local(request))
    return JSONResponse({})


@router.post("/systemsharedmemory/unregister", summary="Unregister every system shared-memory region",
             response_model=Done, responses=_ANSWERS)
async def system_unregister_all(request: Request) -> JSONResponse:
    registry(request).unregister("", local=_local(request))
    return JSONResponse({})


@router.post("/systemsharedmemory/region/{name}/unregister", summary="Unregister one region", response_model=Done,
             responses=_ANSWERS)
async def system_unregister(request: Request, name: str) -> JSONResponse:
    registry(request).unregister(name, local=_local(request))
    return JSONResponse({})


@router.get("/cudasharedmemory/status", summary="CUDA shared memory: none (not supported)",
            response_model=list[RegionStatus])
async def cuda_status_all() -> list[dict[str, Any]]:
    return []


@router.get("/cudasharedmemory/region/{name}/status", summary="CUDA shared memory: no such region (400)",
            response_model=list[RegionStatus], responses=errors(400))
async def cuda_status(name: str) -> list[dict[str, Any]]:
    raise SharedMemoryError(f"no CUDA shared-memory region named {name[:100]!r}: {_CUDA}")


@router.post("/cudasharedmemory/region/{name}/register", summary="CUDA shared memory: not supported (400)",
             response_model=Done, responses=errors(400))
async def cuda_register(name: str) -> None:
    raise NotSupported(_CUDA)


@router.post("/cudasharedmemory/unregister", summary="CUDA shared memory: nothing to unregister",
             response_model=Done)
@router.post("/cudasharedmemory/region/{name}/unregister", include_in_schema=False)
async def cuda_unregister() -> JSONResponse:
    return JSONResponse({})
