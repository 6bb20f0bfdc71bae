"""A ``ModelInferRequest`` read as the REST body is read, and the ``ModelInferResponse`` built.

The message becomes the JSON header's shape (``id``, ``parameters``, ``inputs``, ``outputs``)
and its tensor data the binary part, and ``app.api.oip.tensors.read_infer_header`` checks it:
the same input name, datatype, shape, element framing, limits, parameters and shared-memory
regions as ``/v2`` REST, with the same errors. The image input's data may come as
``raw_input_contents`` (what ``tritonclient.grpc`` sends: 4-byte length, then the bytes, per
element), as ``contents.bytes_contents`` (one entry per image), or from shared memory.
``binary_data_size``, REST's, is accepted beside ``raw_input_contents`` where it tells the truth.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from app.api.grpc import messages
from app.api.oip.infer import VERSION
from app.api.oip.shared_memory import RegionAccess
from app.api.oip.tensors import INPUT, OUTPUTS, InferRequest, join_bytes_tensor, read_infer_header
from app.errors import InvalidParameter

# InferTensorContents fields other than bytes_contents: typed numbers, which a BYTES input cannot hold.
_NUMBER_CONTENTS = ("bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents",
                    "fp32_contents", "fp64_contents")


def parameter_values(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """``map<string, InferParameter>`` as plain values (bool, int, str, float), as JSON gives them."""
    out = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        out[key] = None if choice is None else getattr(parameter, choice)
    return out


def read_request(request: Any, *, max_images: int, regions: RegionAccess | None) -> InferRequest:
    """The images, parameters and wanted outputs of one ``ModelInferRequest``."""
    inputs = []
    for tensor in request.inputs:
        inputs.append({"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                       "parameters": parameter_values(tensor.parameters)})
    raw = request.raw_input_contents
    if len(raw) > len(request.inputs):
        raise InvalidParameter(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} input(s)")
    binary = b""
    if len(inputs) == 1 and inputs[0]["name"] == INPUT:  # else read_infer_header says what is wrong
        binary = _input_data(request.inputs[0], raw, inputs[0]["parameters"])
    header = {
        "id": request.id or None,
        "parameters": parameter_values(request.parameters),
        "inputs": inputs,
        # No outputs named: all of them, as in REST.
        "outputs": [{"name": o.name, "parameters": parameter_values(o.parameters)} for o in request.outputs] or None,
    }
    return read_infer_header(header, binary, max_images=max_images, regions=regions)


def _input_data(tensor: Any, raw: Any, parameters: dict[str, Any]) -> bytes:
    """The image input's data in the binary form (declared to the reader as ``binary_data_size``),
    or b"" when it lies in shared memory.

    gRPC carries its data's length itself, so ``binary_data_size`` has no work here, but KServe's
    own SDK (``InferRequest.to_grpc``) sends it with every ``raw_input_contents``: one that equals
    that content's length is accepted, any other refused."""
    declared = parameters.pop("binary_data_size", None)
    if declared is not None and not raw:
        raise InvalidParameter(f"input {INPUT!r} declares binary_data_size {str(declared)[:24]}, "
                               "but the request has no raw_input_contents")
    if declared is not None and (not isinstance(declared, int) or isinstance(declared, bool)
                                 or declared != len(raw[0])):
        raise InvalidParameter(f"input {INPUT!r} declares binary_data_size {str(declared)[:24]}, "
                               f"but its raw_input_contents holds {len(raw[0])} bytes")
    contents = tensor.contents if tensor.HasField("contents") else None
    if contents is not None and any(len(getattr(contents, f)) for f in _NUMBER_CONTENTS):
        raise InvalidParameter(f"input {INPUT!r} has datatype BYTES: its contents can only be bytes_contents")
    if raw:
        if contents is not None and len(contents.bytes_contents):
            raise InvalidParameter(f"input {INPUT!r} has both contents and raw_input_contents")
        data = raw[0]
    elif contents is not None and len(contents.bytes_contents):
        data = join_bytes_tensor(list(contents.bytes_contents))
    else:
        if "shared_memory_region" not in parameters:
            raise InvalidParameter(f"input {INPUT!r} has no data: send raw_input_contents, contents.bytes_contents "
                                   "or a shared-memory region")
        return b""
    parameters["binary_data_size"] = len(data)
    return data


def infer_response(model: str, request_id: str | None, tensors: dict[str, np.ndarray],
                   wanted: Collection[str], in_regions: Collection[str] = ()) -> Any:
    """The ``ModelInferResponse``: each wanted output's metadata in order, its data in
    ``raw_output_contents`` at the same index (empty for one written to shared memory, as Triton does)."""
    response = messages.ModelInferResponse(model_name=model, model_version=VERSION, id=request_id or "")
    for name in wanted:
        array = tensors[name]
        response.outputs.add(name=name, datatype=OUTPUTS[name][0], shape=array.shape)
        response.raw_output_contents.append(b"" if name in in_regions else array.tobytes())
    return response
