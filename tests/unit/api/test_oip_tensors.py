"""The Open Inference Protocol's body codec (app/api/oip/tensors.py): request parsing against
hand-built bodies and tritonclient's own serialisation, fuzzed; decompression under its bound;
the EfficientNMS-style outputs and their encoding read back by tritonclient."""

from __future__ import annotations

import base64
import gzip
import json
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.http import InferInput, InferRequestedOutput, InferResult
from tritonclient.http._utils import _get_inference_request
from tritonclient.utils import serialize_byte_tensor

from app.api.oip.errors import reshape
from app.api.oip.tensors import (
    OUTPUTS,
    decompress,
    encode_response,
    join_bytes_tensor,
    output_tensors,
    parse_infer_request,
    split_bytes_tensor,
)
from app.api.statuses import status_for
from app.contracts import ImageResult
from app.errors import BadRequest, ImageTooLarge, InvalidParameter, UnsupportedMediaType
from app.types import Detections
from tests.references import detected_batch

CLIENT_ERRORS = (InvalidParameter, BadRequest, ImageTooLarge)


def tritonclient_body(elements: list[bytes], *, binary: bool = True, outputs=None, parameters=None):
    """The body and header length that tritonclient.http itself sends for these images."""
    array = np.array(elements if binary else [base64.b64encode(e).decode() for e in elements], dtype=np.object_)
    tensor = InferInput("image", [len(elements)], "BYTES")
    tensor.set_data_from_numpy(array, binary_data=binary)
    body, json_size = _get_inference_request([tensor], "req-7", outputs, 0, False, False, 0, None, parameters)
    return body, None if json_size is None else str(json_size)


@given(st.lists(st.binary(max_size=64), min_size=1, max_size=8))
def test_bytes_tensor_round_trips_and_matches_tritonclient(elements):
    joined = join_bytes_tensor(elements)
    assert joined == serialize_byte_tensor(np.array(elements, dtype=np.object_)).item()
    assert split_bytes_tensor(joined, len(elements)) == elements


@given(st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=6), st.booleans())
def test_parses_what_tritonclient_sends(elements, binary):
    body, header_length = tritonclient_body(elements, binary=binary, parameters={"conf": 0.4, "classes": "0,1"})
    parsed = parse_infer_request(body, header_length, max_images=8)
    assert parsed.images == elements and parsed.id == "req-7"
    assert parsed.parameters == {"conf": 0.4, "classes": "0,1"}  # binary_data_output is the protocol's own
    assert parsed.outputs == dict.fromkeys(OUTPUTS, True)  # no outputs named: all, binary (as Triton does)


def test_named_outputs_keep_their_order_and_binary_choice():
    outputs = [InferRequestedOutput("det_scores", binary_data=False), InferRequestedOutput("num_dets")]
    body, header_length = tritonclient_body([b"x"], outputs=outputs)
    assert parse_infer_request(body, header_length, max_images=8).outputs == {"det_scores": False, "num_dets": True}


@settings(max_examples=300)
@given(st.binary(max_size=256), st.one_of(st.none(), st.integers(-5, 300).map(str), st.text(max_size=5)))
def test_arbitrary_bytes_are_refused_as_the_clients_mistake(body, header_length):
    """Random bytes are never a valid request: always refused, as a 4xx with a message."""
    with pytest.raises(CLIENT_ERRORS) as info:
        parse_infer_request(body, header_length, max_images=8)
    assert 400 <= status_for(info.value) < 500 and info.value.message


@settings(max_examples=300)
@given(
    st.integers(-2, 12), st.one_of(st.none(), st.integers(-3, 80), st.text(max_size=3)),
    st.lists(st.integers(0, 2**32 - 1), max_size=5), st.binary(max_size=40), st.sampled_from([1, 2, 3]),
)
def test_wrong_binary_sizes_never_escape_as_anything_else(count, size, lengths, tail, rank):
    """A well-formed header with lying sizes: element lengths, binary_data_size and B that disagree."""
    binary = b"".join(n.to_bytes(4, "little") for n in lengths) + tail
    shape = [count, 1, 1][:rank]
    params = {} if size is None else {"binary_data_size": size}
    head = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": shape, "parameters": params}]})
    try:
        parsed = parse_infer_request(head.encode() + binary, str(len(head)), max_images=8)
    except CLIENT_ERRORS:
        return
    assert size == len(binary) and len(parsed.images) == count and sum(map(len, parsed.images)) + 4 * count == size


@pytest.mark.parametrize("header, message", [
    ({"inputs": []}, "exactly one tensor"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [0]}]}, "B >= 1"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [True]}]}, "shape [B] or [B, 1]"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["%%"]}]}, "not valid base64"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2], "data": ["AA=="]}]}, "but 1 data elements"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [1]}]}, "base64 string"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1]}]}, "needs data"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["AA=="]}], "outputs": []},
     "non-empty list"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["AA=="]}],
      "outputs": [{"name": "num_dets"}, {"name": "num_dets"}]}, "asked for twice"),
    ({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["AA=="]}],
      "parameters": {"binary_data_output": "yes"}}, "binary_data_output must be"),
    ([1, 2], "a JSON object"),
])
def test_malformed_tensors_name_what_is_wrong(header, message):
    with pytest.raises(InvalidParameter, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_infer_request(json.dumps(header).encode(), None, max_images=8)


@pytest.mark.parametrize("timeout, expected", [(None, None), (0, None), (2500, 0.0025)])
def test_tritons_timeout_parameter_is_microseconds(timeout, expected):
    parameters = {} if timeout is None else {"timeout": timeout}
    body, header_length = tritonclient_body([b"x"], parameters=None)
    head = json.loads(body[:int(header_length)])
    head["parameters"].update(parameters)
    raw = json.dumps(head).encode()
    parsed = parse_infer_request(raw + body[int(header_length):], str(len(raw)), max_images=8)
    assert parsed.timeout_s == expected and "timeout" not in parsed.parameters


@pytest.mark.parametrize("timeout", [-1, 1.5, "10", True])
def test_a_bad_timeout_is_422(timeout):
    head = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["AA=="]}],
            "parameters": {"timeout": timeout}}
    with pytest.raises(InvalidParameter, match="timeout must be whole microseconds"):
        parse_infer_request(json.dumps(head).encode(), None, max_images=8)


def test_json_data_nested_for_shape_b_by_1():
    head = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2, 1], "data": [["AAE="], ["Ag=="]]}]}
    assert parse_infer_request(json.dumps(head).encode(), None, max_images=8).images == [b"\0\1", b"\2"]


def test_too_many_images_is_413_before_reading_them():
    head = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [9], "data": []}]}
    with pytest.raises(ImageTooLarge, match="9 images, over the limit of 8"):
        parse_infer_request(json.dumps(head).encode(), None, max_images=8)


def test_decompression_is_bounded():
    data = b"{}" + bytes(10_000)
    assert decompress(gzip.compress(data), "gzip", len(data)) == data
    assert decompress(zlib.compress(data), "Deflate", len(data)) == data
    assert decompress(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip", 10) == b"abcd"  # two members
    assert decompress(b"plain", None, 1) == b"plain"  # the body limit already held it
    bomb = gzip.compress(bytes(64 << 20), compresslevel=9)  # 64 MiB of zeros in ~64 KB
    with pytest.raises(ImageTooLarge, match="decompresses to more than the limit of 4,096 bytes"):
        decompress(bomb, "gzip", 4096)
    with pytest.raises(ImageTooLarge):  # a bomb spread over many small members
        decompress(gzip.compress(bytes(3000)) * 2, "gzip", 4096)
    with pytest.raises(BadRequest, match="cut short"):
        decompress(gzip.compress(data)[:-12], "gzip", len(data))
    with pytest.raises(BadRequest, match="cannot be decompressed"):
        decompress(b"not gzip at all", "gzip", 100)
    with pytest.raises(UnsupportedMediaType):
        decompress(b"", "br", 100)


def test_outputs_are_zero_padded_to_the_largest_count_and_read_back_by_tritonclient():
    two = Detections(np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.float32), np.array([0.9, 0.5], np.float32),
                     np.array([1, 0], np.int32))
    tensors = output_tensors(detected_batch([ImageResult(9, 9, two), ImageResult(9, 9, Detections.empty())]))
    assert tensors["num_dets"].tolist() == [[2], [0]]
    assert tensors["det_boxes"].tolist() == [[[1, 2, 3, 4], [5, 6, 7, 8]], [[0, 0, 0, 0], [0, 0, 0, 0]]]
    assert tensors["det_scores"].tolist() == [[pytest.approx(0.9), 0.5], [0, 0]]
    assert tensors["det_classes"].tolist() == [[1, 0], [0, 0]]
    empty = output_tensors(detected_batch([ImageResult(9, 9, Detections.empty())]))
    assert empty["det_boxes"].shape == (1, 1, 4) and not empty["det_boxes"].any()  # K is at least 1
    later = output_tensors(detected_batch([ImageResult(9, 9, Detections.empty()), ImageResult(9, 9, two)]))
    assert later["num_dets"].tolist() == [[0], [2]] and later["det_boxes"][1].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert later["det_classes"].tolist() == [[0, 0], [1, 0]] and not later["det_scores"][0].any()

    wanted = {"det_boxes": True, "det_classes": False, "num_dets": True}
    body, header_length = encode_response("yolopipe", "r1", tensors, wanted)
    result = InferResult.from_response_body(body, header_length=header_length)
    assert result.get_response()["id"] == "r1" and result.get_response()["model_name"] == "yolopipe"
    for name in wanted:
        got = result.as_numpy(name)
        assert got.dtype == tensors[name].dtype and np.array_equal(got, tensors[name])
    assert result.as_numpy("det_scores") is None
    body, header_length = encode_response("yolopipe", None, tensors, {"det_scores": False})
    assert header_length is None and np.array_equal(
        InferResult.from_response_body(body).as_numpy("det_scores"), tensors["det_scores"])


def test_error_bodies_take_the_protocols_shape():
    assert json.loads(reshape(b'{"error": {"code": "overloaded", "message": "retry"}}')) == {"error": "retry"}
    assert reshape(b'{"error": "already"}') == b'{"error": "already"}'
    assert reshape(b"not json") == b"not json"


def padded_outputs(results: list[ImageResult]) -> dict[str, np.ndarray]:
    """The four outputs built the readable way, image by image: the reference for ``output_tensors``."""
    k = max([1] + [len(r.detections) for r in results])
    out = {"num_dets": np.zeros((len(results), 1), np.int32), "det_boxes": np.zeros((len(results), k, 4), np.float32),
           "det_scores": np.zeros((len(results), k), np.float32), "det_classes": np.zeros((len(results), k), np.int32)}
    for i, r in enumerate(results):
        n = len(r.detections)
        out["num_dets"][i, 0] = n
        out["det_boxes"][i, :n], out["det_scores"][i, :n] = r.detections.boxes, r.detections.scores
        out["det_classes"][i, :n] = r.detections.class_ids
    return out


detections = st.integers(0, 5).flatmap(lambda n: st.builds(
    lambda boxes, scores, classes: Detections(np.array(boxes, np.float32).reshape(n, 4), np.array(scores, np.float32),
                                              np.array(classes, np.int32)),
    st.lists(st.floats(0, 4000, width=32), min_size=4 * n, max_size=4 * n),
    st.lists(st.floats(0, 1, width=32), min_size=n, max_size=n), st.lists(st.integers(0, 79), min_size=n, max_size=n)))


@given(st.lists(detections, min_size=1, max_size=4))
def test_output_tensors_equal_the_padded_outputs_built_image_by_image(dets):
    results = [ImageResult(64, 48, d) for d in dets]
    got, expected = output_tensors(detected_batch(results)), padded_outputs(results)
    assert list(got) == list(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].flags.c_contiguous and np.array_equal(got[name], array)


@given(st.one_of(st.none(), st.text(max_size=12)), st.sampled_from(["yolopipe", "sample", 'we"ird\\ü']),
       st.lists(st.tuples(st.sampled_from(list(OUTPUTS)), st.booleans(), st.booleans()), max_size=6,
                unique_by=lambda t: t[0]), detections)
def test_the_response_header_is_what_json_dumps_writes(request_id, model, wanted, dets):
    tensors = output_tensors(detected_batch([ImageResult(64, 48, dets)]))
    outputs = {name: binary for name, binary, _ in wanted}
    in_regions = {name for name, _, region in wanted if region}
    body, header_length = encode_response(model, request_id, tensors, outputs, in_regions)
    described, blobs = [], []
    for name, binary in outputs.items():  # the readable way: a dict per output, json.dumps of the whole
        entry = {"name": name, "datatype": OUTPUTS[name][0], "shape": list(tensors[name].shape)}
        if name in in_regions:
            pass
        elif binary:
            entry["parameters"] = {"binary_data_size": tensors[name].nbytes}
            blobs.append(tensors[name].tobytes())
        else:
            entry["data"] = tensors[name].ravel().tolist()
        described.append(entry)
    head = {"model_name": model, "model_version": "1", "outputs": described}
    if request_id is not None:
        head["id"] = request_id
    header = json.dumps(head, separators=(",", ":")).encode()
    assert body == b"".join([header, *blobs]) and header_length == (len(header) if blobs else None)


def test_the_binary_data_is_read_through_a_view_of_the_body():
    """Each image is copied out of the body once: the request's images own their bytes."""
    elements = [b"\xff\xd8one", b"\xff\xd8two!"]
    body, header_length = tritonclient_body(elements)
    parsed = parse_infer_request(body, header_length, max_images=4)
    assert parsed.images == elements and all(type(image) is bytes for image in parsed.images)
