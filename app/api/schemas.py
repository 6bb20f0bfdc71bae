"""Response shapes, for the OpenAPI document (/docs) and for clients.

Handlers build plain dicts (the detector already gives #2's per-image JSON) and return them
directly; these models describe them. ``tests/unit/api`` validates real responses against them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Detection(BaseModel):
    box: list[float] = Field(description="x1, y1, x2, y2 in original-image pixels", min_length=4, max_length=4)
    score: float
    class_id: int
    class_name: str


class Timings(BaseModel):
    """Milliseconds, and only times (a batch's size, bucket or slot is never here): this image's
    own decode and wait, then the batch it ran in: the detector call and the pipeline's stages
    (the same four on every backend, ``app.contracts.StageTimes``, summed over the batch's runs)."""

    model_config = {"extra": "forbid"}

    decode_ms: float = Field(description="reading the image before its batch (decoding it, unless the GPU does)")
    queue_ms: float = Field(description="admission to the start of its batch")
    batch_ms: float = Field(description="the detector call for the whole batch")
    pipeline_decode_ms: float = Field(description="the batch's images decoded inside the pipeline (GPU); 0 on the CPU")
    preprocess_ms: float = Field(description="the batch made ready for the model on the host")
    infer_ms: float = Field(description="the model: the engine and, on a GPU, letterbox and NMS in its graph")
    postprocess_ms: float = Field(description="NMS (CPU), or the rows split per image (GPU)")
    total_ms: float = Field(description="admission to result, inside the server")


class ImageDetections(BaseModel):
    image: str
    width: int
    height: int
    detections: list[Detection]
    timings: Timings


class ErrorInfo(BaseModel):
    code: str = Field(description="stable machine-readable code, e.g. invalid_image, overloaded")
    message: str


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ImageFailure(BaseModel):
    image: str
    status: int = Field(description="the HTTP status this image alone would have got")
    error: ErrorInfo


class BatchResponse(BaseModel):
    results: list[ImageDetections | ImageFailure] = Field(description="one entry per image, in request order")
    timings: dict[str, float]


class Health(BaseModel):
    status: str


class WorkerStartup(BaseModel):
    model_config = {"extra": "allow"}

    worker: int
    steps: list[dict[str, Any]] = Field(description="each start-up step of the worker and its seconds, in order")
    worker_ready_after_s: float | None = Field(None, description="the worker process's age when it was ready")


class Ready(Health):
    startup: list[WorkerStartup] = Field(default_factory=list, description="how each inference worker started")


class ModelInfo(BaseModel):
    model_config = {"extra": "allow"}

    model: str
    weights: str
    backend: str
    precision: str
    imgsz: int
    max_batch: int
    class_names: list[str]
    meta: dict[str, Any]
    serving: dict[str, Any]


# Error responses every detect endpoint documents.
DETECT_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "empty, truncated or corrupt image; malformed multipart"},
    413: {"model": ErrorResponse, "description": "body over the size limit or image over the pixel limit"},
    415: {"model": ErrorResponse, "description": "not an image, or not a supported format / content type"},
    422: {"model": ErrorResponse, "description": "invalid parameter"},
    503: {"model": ErrorResponse, "description": "queue full or shutting down (see Retry-After), or device failure"},
    504: {"model": ErrorResponse, "description": "no result within the request timeout"},
}

_BINARY = {"type": "string", "format": "binary"}
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/bmp", "image/tiff", "image/webp")


def detect_request_body() -> dict[str, Any]:
    """The request body of /v1/detect, written by hand: the handler reads the body itself,
    so that the size limit holds while it streams in."""
    content: dict[str, Any] = {
        "multipart/form-data": {
            "schema": {"type": "object", "properties": {"image": _BINARY}, "required": ["image"]}
        }
    }
    content.update({t: {"schema": _BINARY} for t in _IMAGE_TYPES})
    return {"requestBody": {"required": True, "content": content}}


def batch_request_body() -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "properties": {"images": {"type": "array", "items": _BINARY, "minItems": 1}},
                        "required": ["images"],
                    }
                }
            },
        }
    }
