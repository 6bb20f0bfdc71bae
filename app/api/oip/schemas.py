"""OpenAPI models of the Open Inference Protocol's REST bodies (documentation and schema tests;
the routes build and parse the bodies themselves, ``app/api/oip/tensors.py``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class OipError(BaseModel):
    error: str


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ServerLive(BaseModel):
    live: bool


class ServerReady(BaseModel):
    ready: bool


class ModelReady(BaseModel):
    name: str
    ready: bool


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class RequestInput(BaseModel):
    name: str = Field(description="'image'")
    datatype: str = Field(description="'BYTES'")
    shape: list[int] = Field(description="[B] or [B, 1]")
    parameters: dict[str, Any] | None = Field(None, description="binary_data_size: bytes of this input after the header")
    data: list[Any] | None = Field(None, description="base64-encoded images (when not binary)")


class RequestOutput(BaseModel):
    name: str = Field(description="num_dets, det_boxes, det_scores or det_classes")
    parameters: dict[str, Any] | None = Field(None, description="binary_data: true for binary tensor data")


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="conf, iou, max_det, classes (list or '0,2'), agnostic; binary_data_output")
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[float] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    outputs: list[ResponseOutput]


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A model's JSON schema with its nested models written in place (no ``$defs`` to resolve)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": OipError} for status in statuses}


INFER_REQUEST_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "A JSON inference request, or (with Inference-Header-Content-Length) the JSON header "
                       "followed by binary tensor data; gzip or deflate with Content-Encoding.",
        "content": {
            "application/json": {"schema": inline_schema(InferRequest)},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}
INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": InferResponse,
        "description": "JSON, or (with Inference-Header-Content-Length) a JSON header and binary tensor data",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
    **errors(400, 404, 413, 415, 422, 503, 504),
}
