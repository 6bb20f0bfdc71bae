"""A ModelInferRequest is read exactly as the same request over REST is (the REST parser is the
reference), and a ModelInferResponse reads back in tritonclient.grpc as the tensors it holds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.api.grpc import messages
from app.api.grpc.tensors import infer_response, parameter_values, read_request
from app.api.oip.tensors import join_bytes_tensor, output_tensors, parse_infer_request
from app.contracts import ImageResult
from app.errors import ImageTooLarge, InvalidParameter, SharedMemoryError
from app.types import Detections
from tests.references import detected_batch

IMAGES = [b"\xff\xd8first image", b"", b"\x89PNG third"]


def grpc_request(images=IMAGES, shape=None, parameters=None, outputs=(), request_id="", as_contents=False):
    request = messages.ModelInferRequest(model_name="yolopipe", id=request_id)
    tensor = request.inputs.add(name="image", datatype="BYTES", shape=shape or [len(images)])
    if as_contents:
        tensor.contents.bytes_contents.extend(images)
    else:
        request.raw_input_contents.append(join_bytes_tensor(images))
    for key, value in (parameters or {}).items():
        field = {bool: "bool_param", int: "int64_param", str: "string_param", float: "double_param"}[type(value)]
        setattr(request.parameters[key], field, value)
    for name in outputs:
        request.outputs.add(name=name)
    return request


def rest_request(images=IMAGES, shape=None, parameters=None, outputs=(), request_id=None):
    """The same request as a REST body with binary tensor data."""
    binary = join_bytes_tensor(images)
    header = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": shape or [len(images)],
                          "parameters": {"binary_data_size": len(binary)}}], "parameters": parameters or {}}
    if outputs:
        header["outputs"] = [{"name": n} for n in outputs]
    if request_id is not None:
        header["id"] = request_id
    head = json.dumps(header).encode()
    return parse_infer_request(head + binary, str(len(head)), max_images=8)


@pytest.mark.parametrize("kwargs", [
    {},
    {"shape": [3, 1]},
    {"parameters": {"conf": 0.1, "max_det": 5, "classes": "0,2", "agnostic": True, "timeout": 2500}},
    {"outputs": ("det_scores", "num_dets"), "request_id": "r-1"},
])
def test_a_request_reads_as_the_same_rest_request(kwargs):
    rest = rest_request(**kwargs)
    assert read_request(grpc_request(**kwargs), max_images=8, regions=None) == rest
    contents = read_request(grpc_request(as_contents=True, **kwargs), max_images=8, regions=None)
    assert contents == rest


def test_a_true_binary_data_size_is_accepted():
    """KServe's SDK (kserve 0.21, ``InferRequest.to_grpc``) packs a BYTES input into
    ``raw_input_contents`` and keeps ``binary_data_size`` (an ``int64_param``, the raw content's
    length) in the input's parameters: read as the same REST request."""
    request = grpc_request(parameters={"conf": 0.1})
    request.inputs[0].parameters["binary_data_size"].int64_param = len(request.raw_input_contents[0])
    assert read_request(request, max_images=8, regions=None) == rest_request(parameters={"conf": 0.1})


@pytest.mark.parametrize("where", ["contents", "shared memory"])
def test_binary_data_size_without_raw_contents_is_refused(where):
    request = grpc_request(as_contents=where == "contents")
    request.inputs[0].parameters["binary_data_size"].int64_param = len(join_bytes_tensor(IMAGES))
    if where == "shared memory":
        request.ClearField("raw_input_contents")
        request.inputs[0].parameters["shared_memory_region"].string_param = "r"
        request.inputs[0].parameters["shared_memory_byte_size"].int64_param = 10
    with pytest.raises(InvalidParameter, match="declares binary_data_size 35, but the request has no raw_input"):
        read_request(request, max_images=8, regions=None)


def test_parameters_of_every_kind():
    request = grpc_request()
    request.parameters["b"].bool_param = True
    request.parameters["i"].int64_param = -3
    request.parameters["u"].uint64_param = 2**64 - 1
    request.parameters["s"].string_param = "x"
    request.parameters["d"].double_param = 0.5
    request.parameters["unset"].SetInParent()
    assert parameter_values(request.parameters) == {"b": True, "i": -3, "u": 2**64 - 1, "s": "x", "d": 0.5,
                                                    "unset": None}


@pytest.mark.parametrize("change, error, words", [
    (lambda r: r.inputs[0].contents.bytes_contents.append(b"x"), InvalidParameter, "both contents and raw"),
    (lambda r: r.inputs[0].contents.int_contents.append(1), InvalidParameter, "can only be bytes_contents"),
    (lambda r: r.raw_input_contents.append(b"more"), InvalidParameter, "2 entries for 1 input"),
    (lambda r: r.ClearField("raw_input_contents"), InvalidParameter, "has no data"),
    (lambda r: setattr(r.inputs[0].parameters["binary_data_size"], "int64_param", 3), InvalidParameter,
     "declares binary_data_size 3, but its raw_input_contents holds 35 bytes"),
    (lambda r: setattr(r.inputs[0].parameters["binary_data_size"], "int64_param", 36), InvalidParameter,
     "declares binary_data_size 36, but its raw_input_contents holds 35 bytes"),
    (lambda r: setattr(r.inputs[0].parameters["binary_data_size"], "string_param", "35"), InvalidParameter,
     "declares binary_data_size 35"),
    (lambda r: setattr(r.inputs[0].parameters["binary_data_size"], "bool_param", True), InvalidParameter,
     "declares binary_data_size True"),
    (lambda r: r.inputs.add(name="other", datatype="BYTES", shape=[1]), InvalidParameter, "exactly one tensor"),
    (lambda r: setattr(r.inputs[0], "name", "images"), InvalidParameter, "unknown input 'images'"),
    (lambda r: setattr(r.inputs[0], "datatype", "UINT8"), InvalidParameter, "datatype BYTES"),
    (lambda r: r.inputs[0].shape.__setitem__(0, 9), ImageTooLarge, "over the limit of 8"),
    (lambda r: r.inputs[0].shape.__setitem__(0, 2), InvalidParameter, "remain after its 2 elements"),
    (lambda r: r.outputs.add(name="boxes"), InvalidParameter, "unknown output 'boxes'"),
    (lambda r: setattr(r.inputs[0].parameters["shared_memory_region"], "string_param", "x"), InvalidParameter,
     "shared_memory_byte_size"),
])
def test_what_a_request_can_get_wrong(change, error, words):
    request = grpc_request()
    change(request)
    with pytest.raises(error) as info:
        read_request(request, max_images=8, regions=None)
    assert words in str(info.value), str(info.value)


def test_a_region_where_none_can_be_used_is_refused():
    request = grpc_request()
    request.ClearField("raw_input_contents")
    request.inputs[0].parameters["shared_memory_region"].string_param = "r"
    request.inputs[0].parameters["shared_memory_byte_size"].int64_param = 10
    with pytest.raises(SharedMemoryError):
        read_request(request, max_images=8, regions=None)


def test_the_response_reads_back_in_tritonclient():
    grpc_client = pytest.importorskip("tritonclient.grpc")
    from tritonclient.grpc import service_pb2

    boxes = np.array([[1, 2, 30, 40], [5, 6, 70, 80]], np.float32)
    detections = [Detections(boxes, np.array([0.9, 0.5], np.float32), np.array([1, 0], np.int32)),
                  Detections(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32))]
    tensors = output_tensors(detected_batch([ImageResult(90, 90, d) for d in detections]))
    wanted = ["det_boxes", "num_dets", "det_classes", "det_scores"]
    response = infer_response("sample", "id-3", tensors, wanted, in_regions={"det_classes"})
    result = grpc_client.InferResult(service_pb2.ModelInferResponse.FromString(response.SerializeToString()))
    assert result.get_response().id == "id-3" and result.get_response().model_name == "sample"
    assert [o.name for o in result.get_response().outputs] == wanted
    for name in ("det_boxes", "num_dets", "det_scores"):
        assert np.array_equal(result.as_numpy(name), tensors[name]) and result.as_numpy(name).dtype == tensors[name].dtype
    assert list(result.get_output("det_classes").shape) == [2, 2]  # described, its data in the region
    assert result.get_response().raw_output_contents[2] == b""
