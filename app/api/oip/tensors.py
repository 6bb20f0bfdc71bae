"""The Open Inference Protocol's (KServe v2) inference body, both ways, without FastAPI.

A request is a JSON header, optionally followed by binary tensor data (Triton's extension: the
header's length in ``Inference-Header-Content-Length``, each binary input's length in its
``parameters.binary_data_size``). yolopipe's one input is ``image``, ``BYTES`` ``[B]`` or
``[B, 1]``: in binary each element is a 4-byte little-endian length and that many bytes; in
JSON ``data`` each element is the image base64-encoded (JSON strings cannot hold raw bytes).

Outputs follow TensorRT's EfficientNMS plugin: ``num_dets`` INT32 ``[B, 1]``, ``det_boxes``
FP32 ``[B, K, 4]`` (x1, y1, x2, y2 in source pixels), ``det_scores`` FP32 ``[B, K]``,
``det_classes`` INT32 ``[B, K]``; K is the batch's largest count (at least 1), zero-padded.

An input or output may instead lie in a registered shared-memory region (Triton's system
shared-memory extension: ``shared_memory_region``, ``shared_memory_byte_size``,
``shared_memory_offset`` in its parameters; ``app/api/oip/shared_memory.py``).

Everything a client can get wrong raises ``InvalidParameter`` (422), or ``BadRequest`` (400)
for a header that is not JSON, ``SharedMemoryError`` (400) for a region it cannot use, or
``ImageTooLarge`` (413) past a size limit. The gRPC service (``app/api/grpc``) hands its
messages to ``read_infer_header`` in the same shape, so both protocols check the same things.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.api.oip.shared_memory import RegionAccess, TensorPlace, tensor_place
from app.contracts import DetectedBatch
from app.errors import BadRequest, ImageTooLarge, InvalidParameter, UnsupportedMediaType

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
    output_places: dict[str, TensorPlace] = field(default_factory=dict)  # outputs written to shared memory


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


def parse_infer_request(body: bytes, header_length: str | None, *, max_images: int,
                        regions: RegionAccess | None = None) -> InferRequest:
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
    # A view of the binary data, not a copy: each image is copied out of it once (split_bytes_tensor).
    return read_infer_header(header, memoryview(body)[json_end:], max_images=max_images, regions=regions)


def read_infer_header(header: Any, binary: bytes | memoryview, *, max_images: int,
                      regions: RegionAccess | None = None) -> InferRequest:
    """The request a parsed header describes; ``binary``: the bytes after it (binary tensor
    data, or a view of them); ``regions``: the shared-memory regions this request may use."""
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
    images = _read_inputs(header.get("inputs"), binary, max_images, regions)
    outputs, places = _read_outputs(header.get("outputs"), binary_default, regions)
    return InferRequest(request_id, images, parameters, outputs, timeout_us / 1e6 if timeout_us else None, places)


def _object(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParameter(f"{where} must be a JSON object")
    return dict(value)


def _read_inputs(inputs: Any, binary: bytes | memoryview, max_images: int,
                 regions: RegionAccess | None) -> list[bytes]:
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
    parameters = _object(tensor.get("parameters"), f"input {INPUT!r} parameters")
    size = parameters.get("binary_data_size")
    place = tensor_place(parameters, f"input {INPUT!r}")
    if place is not None:
        if size is not None or "data" in tensor:
            raise InvalidParameter(f"input {INPUT!r} has both shared memory and data of its own")
        if binary:
            raise InvalidParameter(f"the body has {len(binary)} bytes after its JSON header but no input declares them")
        return split_bytes_tensor(RegionAccess.of(regions).read(place, f"input {INPUT!r}"), count)
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


def split_bytes_tensor(data: bytes | memoryview, count: int) -> list[bytes]:
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


def _read_outputs(outputs: Any, binary_default: bool,
                  regions: RegionAccess | None) -> tuple[dict[str, bool], dict[str, TensorPlace]]:
    """Output name → binary, in the order asked; and the outputs to write to shared memory."""
    if outputs is None:
        return dict.fromkeys(OUTPUTS, binary_default), {}
    if not isinstance(outputs, list) or not outputs:
        raise InvalidParameter("outputs must be a non-empty list (or left out for all of them)")
    wanted: dict[str, bool] = {}
    places: dict[str, TensorPlace] = {}
    for tensor in outputs:
        name = tensor.get("name") if isinstance(tensor, dict) else None
        if name not in OUTPUTS:
            raise InvalidParameter(f"unknown output {str(name)[:64]!r}; this model's outputs are {', '.join(OUTPUTS)}")
        if name in wanted:
            raise InvalidParameter(f"output {name!r} is asked for twice")
        parameters = _object(tensor.get("parameters"), f"output {name!r} parameters")
        binary = parameters.get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise InvalidParameter(f"output {name!r}: binary_data must be true or false")
        place = tensor_place(parameters, f"output {name!r}")
        if place is not None:
            if parameters.get("binary_data") is True:
                raise InvalidParameter(f"output {name!r} has both shared memory and binary_data true")
            RegionAccess.of(regions).check_output(place, f"output {name!r}")
            places[name] = place
        wanted[name] = binary
    return wanted, places


def output_tensors(batch: DetectedBatch) -> dict[str, np.ndarray]:
    """The four EfficientNMS-style outputs of a batch whose every image was answered, each
    image's rows in its row of the outputs, zero-padded to the batch's largest count."""
    counts = batch.counts
    if len(counts) == 1 and len(batch.rows):  # one image with detections (the usual call): no padding
        rows = batch.rows
        return {"num_dets": counts.astype(np.int32).reshape(1, 1),
                "det_boxes": np.array(rows[:, :4], np.float32).reshape(1, -1, 4),
                "det_scores": np.array(rows[:, 4], np.float32).reshape(1, -1),
                "det_classes": rows[:, 5].astype(np.int32).reshape(1, -1)}
    n, k = len(counts), max(1, int(counts.max(initial=0)))
    image = np.repeat(np.arange(n), counts)  # each row's image, and its place among that image's rows
    slot = np.arange(len(batch.rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    boxes = np.zeros((n, k, 4), np.float32)
    scores = np.zeros((n, k), np.float32)
    classes = np.zeros((n, k), np.int32)
    boxes[image, slot] = batch.rows[:, :4]
    scores[image, slot] = batch.rows[:, 4]
    classes[image, slot] = batch.rows[:, 5].astype(np.int32)
    return {"num_dets": counts.astype(np.int32).reshape(-1, 1), "det_boxes": boxes, "det_scores": scores,
            "det_classes": classes}


def write_output_regions(tensors: dict[str, np.ndarray], places: dict[str, TensorPlace],
                         regions: RegionAccess | None) -> None:
    """The outputs asked for in shared memory, written there (C order, as binary tensor data)."""
    for name, place in places.items():
        RegionAccess.of(regions).write(place, tensors[name].tobytes(), f"output {name!r}")


def encode_response(model: str, request_id: str | None, tensors: dict[str, np.ndarray],
                    wanted: dict[str, bool], in_regions: Collection[str] = ()) -> tuple[bytes, int | None]:
    """The response body and, when any output is binary, the length of its JSON header. An
    output in ``in_regions`` (written to shared memory) is described without data, as Triton does.

    The header is what ``json.dumps`` writes for ``{"model_name", "model_version", "outputs",
    "id"}`` (compact), written piece by piece: the names and datatypes are the model's own, so
    only the model's name, the id and the outputs asked for as JSON data go through ``json``."""
    described = []
    blobs = []
    for name, binary in wanted.items():
        array = tensors[name]
        shape = ",".join(map(str, array.shape))
        entry = f'{{"name":"{name}","datatype":"{OUTPUTS[name][0]}","shape":[{shape}]'
        if name in in_regions:
            described.append(entry + "}")
        elif binary:
            blob = array.tobytes()  # C order, little-endian on every host this runs on
            described.append(f'{entry},"parameters":{{"binary_data_size":{len(blob)}}}}}')
            blobs.append(blob)
        else:
            described.append(entry + ',"data":' + json.dumps(array.ravel().tolist(), separators=(",", ":")) + "}")
    header = ('{"model_name":' + json.dumps(model) + ',"model_version":"1","outputs":[' + ",".join(described) + "]"
              + ("" if request_id is None else ',"id":' + json.dumps(request_id)) + "}").encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)
