"""The Open Inference Protocol's (KServe v2) inference body, both ways, without FastAPI.

A request is a JSON header, optionally followed by binary tensor data (Triton's extension: the
header's length in ``Inference-Header-Content-Length``, each binary input's length in its
``parameters.binary_data_size``). yolopipe's one input is ``image``, ``BYTES`` ``[B]`` or
``[B, 1]``: in binary each element is a 4-byte little-endian length and that many bytes; in
JSON ``data`` each element is the image base64-encoded (JSON strings cannot hold raw bytes).

Outputs follow TensorRT's EfficientNMS plugin: ``num_dets`` INT32 ``[B, 1]``, ``det_boxes``
FP32 ``[B, K, 4]`` (x1, y1, x2, y2 in source pixels), ``det_scores`` FP32 ``[B, K]``,
``det_classes`` INT32 ``[B, K]``; K is the batch's largest count (at least 1), zero-padded.

Everything a client can get wrong raises ``InvalidParameter`` (422), or ``BadRequest`` (400)
for a header that is not JSON, or ``ImageTooLarge`` (413) past a size limit.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.errors import BadRequest, ImageTooLarge, InvalidParameter, UnsupportedMediaType
from app.types import Detections

INPUT = "image"
# name → (datatype, shape with -1 for a variable dimension)
OUTPUTS: dict[str, tuple[str, list[int]]] = {
    "num_dets": ("INT32", [-1, 1]),
    "det_boxes": ("FP32", [-1, -1, 4]),
    "det_scores": ("FP32", [-1, -1]),
    "det_classes": ("INT32", [-1, -1]),
}
# Request parameters that Triton's clients may send and that mean nothing here.
IGNORED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "headers"})
_LENGTH = struct.Struct("<I")
_ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}  # zlib wbits; HTTP's "deflate" is the zlib format


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    images: list[bytes]
    parameters: dict[str, Any]  # the model's parameters (conf, iou, ...), not yet validated
    outputs: dict[str, bool]  # output name → binary, in the order they are to be answered
    timeout_s: float | None = None  # Triton's "timeout" parameter (microseconds); None: the server's


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body under its ``Content-Encoding``, never more than ``limit`` bytes decompressed."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding not in _ENCODINGS:
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not accepted; use gzip, deflate or none")
    out: list[bytes] = []
    size = 0
    rest = body
    while rest:  # gzip allows several members one after another
        inflater = zlib.decompressobj(_ENCODINGS[encoding])
        try:
            chunk = inflater.decompress(rest, limit - size + 1)
        except zlib.error as exc:
            raise BadRequest(f"the {encoding} request body cannot be decompressed: {exc}") from None
        size += len(chunk)
        if size > limit or inflater.unconsumed_tail:
            raise ImageTooLarge(f"the request body decompresses to more than the limit of {limit:,} bytes")
        if not inflater.eof:
            raise BadRequest(f"the {encoding} request body is cut short")
        out.append(chunk)
        rest = inflater.unused_data if encoding != "deflate" else b""
        if encoding == "deflate" and inflater.unused_data:
            raise BadRequest("the deflate request body has bytes after its end")
    return b"".join(out)


def parse_infer_request(body: bytes, header_length: str | None, *, max_images: int) -> InferRequest:
    """The images, parameters and wanted outputs of one (decompressed) inference body."""
    if header_length is None:
        json_end = len(body)
    else:
        try:
            json_end = int(header_length)
        except ValueError:
            raise InvalidParameter(f"Inference-Header-Content-Length must be an integer, got {header_length[:40]!r}") from None
        if not 0 < json_end <= len(body):
            raise InvalidParameter(
                f"Inference-Header-Content-Length {json_end} is outside the body of {len(body)} bytes")
    try:
        header = json.loads(body[:json_end])
    except (ValueError, RecursionError):
        raise BadRequest("the inference request header is not valid JSON") from None
    if not isinstance(header, dict):
        raise InvalidParameter("the inference request must be a JSON object")
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidParameter("id must be a string")
    parameters = _object(header.get("parameters"), "parameters")
    binary_default = parameters.pop("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidParameter("parameters.binary_data_output must be true or false")
    for name in IGNORED_PARAMETERS:
        parameters.pop(name, None)
    timeout_us = parameters.pop("timeout", 0)
    if not isinstance(timeout_us, int) or isinstance(timeout_us, bool) or timeout_us < 0:
        raise InvalidParameter(f"parameters.timeout must be whole microseconds >= 0, got {str(timeout_us)[:40]!r}")
    images = _read_inputs(header.get("inputs"), body[json_end:], max_images)
    return InferRequest(request_id, images, parameters, _read_outputs(header.get("outputs"), binary_default),
                        timeout_us / 1e6 if timeout_us else None)


def _object(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParameter(f"{where} must be a JSON object")
    return dict(value)


def _read_inputs(inputs: Any, binary: bytes, max_images: int) -> list[bytes]:
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise InvalidParameter(f"inputs must hold exactly one tensor, {INPUT!r}")
    tensor = inputs[0]
    if tensor.get("name") != INPUT:
        raise InvalidParameter(f"unknown input {str(tensor.get('name'))[:64]!r}; this model's one input is {INPUT!r}")
    if tensor.get("datatype") != "BYTES":
        raise InvalidParameter(f"input {INPUT!r} has datatype BYTES, got {str(tensor.get('datatype'))[:16]!r}")
    shape = tensor.get("shape")
    if (not isinstance(shape, list) or len(shape) not in (1, 2)
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
            or shape[0] < 1 or (len(shape) == 2 and shape[1] != 1)):
        raise InvalidParameter(f"input {INPUT!r} has shape [B] or [B, 1] with B >= 1, got {str(shape)[:64]}")
    count = shape[0]
    if count > max_images:
        raise ImageTooLarge(f"the request holds {count} images, over the limit of {max_images}")
    size = _object(tensor.get("parameters"), f"input {INPUT!r} parameters").get("binary_data_size")
    if size is None:
        if binary:
            raise InvalidParameter(f"the body has {len(binary)} bytes after its JSON header but no input declares them")
        return _json_images(tensor.get("data"), shape)
    if "data" in tensor:
        raise InvalidParameter(f"input {INPUT!r} has both data and binary_data_size")
    if not isinstance(size, int) or isinstance(size, bool) or size != len(binary):
        raise InvalidParameter(
            f"input {INPUT!r} declares binary_data_size {str(size)[:24]}, but {len(binary)} bytes follow the header")
    return split_bytes_tensor(binary, count)


def split_bytes_tensor(data: bytes, count: int) -> list[bytes]:
    """A BYTES tensor's binary form: ``count`` elements, each a 4-byte LE length and its bytes."""
    elements = []
    pos = 0
    view = memoryview(data)
    for i in range(count):
        if pos + 4 > len(data):
            raise InvalidParameter(f"input {INPUT!r}: binary data ends before element {i} of {count}")
        (length,) = _LENGTH.unpack_from(data, pos)
        pos += 4
        if pos + length > len(data):
            raise InvalidParameter(f"input {INPUT!r}: element {i} declares {length} bytes, {len(data) - pos} remain")
        elements.append(bytes(view[pos:pos + length]))
        pos += length
    if pos != len(data):
        raise InvalidParameter(f"input {INPUT!r}: {len(data) - pos} bytes remain after its {count} elements")
    return elements


def join_bytes_tensor(elements: list[bytes]) -> bytes:
    """The inverse of ``split_bytes_tensor`` (for clients and tests)."""
    return b"".join(_LENGTH.pack(len(e)) + e for e in elements)


def _json_images(data: Any, shape: list[int]) -> list[bytes]:
    if not isinstance(data, list):
        raise InvalidParameter(f"input {INPUT!r} needs data (base64 strings) or binary_data_size")
    if len(shape) == 2 and all(isinstance(row, list) and len(row) == 1 for row in data):
        data = [row[0] for row in data]  # nested row-major [[s], [s]] for shape [B, 1]
    if len(data) != shape[0]:
        raise InvalidParameter(f"input {INPUT!r} has shape {shape} but {len(data)} data elements")
    images = []
    for i, element in enumerate(data):
        if not isinstance(element, str):
            raise InvalidParameter(f"input {INPUT!r} element {i} must be a base64 string")
        try:
            images.append(base64.b64decode(element, validate=True))
        except (binascii.Error, ValueError):
            raise InvalidParameter(f"input {INPUT!r} element {i} is not valid base64") from None
    return images


def _read_outputs(outputs: Any, binary_default: bool) -> dict[str, bool]:
    if outputs is None:
        return dict.fromkeys(OUTPUTS, binary_default)
    if not isinstance(outputs, list) or not outputs:
        raise InvalidParameter("outputs must be a non-empty list (or left out for all of them)")
    wanted: dict[str, bool] = {}
    for tensor in outputs:
        name = tensor.get("name") if isinstance(tensor, dict) else None
        if name not in OUTPUTS:
            raise InvalidParameter(f"unknown output {str(name)[:64]!r}; this model's outputs are {', '.join(OUTPUTS)}")
        if name in wanted:
            raise InvalidParameter(f"output {name!r} is asked for twice")
        binary = _object(tensor.get("parameters"), f"output {name!r} parameters").get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise InvalidParameter(f"output {name!r}: binary_data must be true or false")
        wanted[name] = binary
    return wanted


def output_tensors(detections: list[Detections]) -> dict[str, np.ndarray]:
    """The four EfficientNMS-style outputs of a batch, zero-padded to its largest count."""
    counts = np.array([len(d) for d in detections], np.int32)
    k = max(1, int(counts.max(initial=0)))
    boxes = np.zeros((len(detections), k, 4), np.float32)
    scores = np.zeros((len(detections), k), np.float32)
    classes = np.zeros((len(detections), k), np.int32)
    for i, d in enumerate(detections):
        n = len(d)
        boxes[i, :n], scores[i, :n], classes[i, :n] = d.boxes, d.scores, d.class_ids
    return {"num_dets": counts.reshape(-1, 1), "det_boxes": boxes, "det_scores": scores, "det_classes": classes}


def encode_response(model: str, request_id: str | None, tensors: dict[str, np.ndarray],
                    wanted: dict[str, bool]) -> tuple[bytes, int | None]:
    """The response body and, when any output is binary, the length of its JSON header."""
    described = []
    blobs = []
    for name, binary in wanted.items():
        array = tensors[name]
        entry: dict[str, Any] = {"name": name, "datatype": OUTPUTS[name][0], "shape": list(array.shape)}
        if binary:
            blob = array.tobytes()  # C order, little-endian on every host this runs on
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = array.ravel().tolist()
        described.append(entry)
    head: dict[str, Any] = {"model_name": model, "model_version": "1", "outputs": described}
    if request_id is not None:
        head["id"] = request_id
    header = json.dumps(head, separators=(",", ":")).encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)
