"""NVIDIA's own ``tritonclient.grpc`` (and ``tritonclient.utils.shared_memory``) against a real
``yolopipe serve`` on loopback (CPU backend, sample model): its supervisor, HTTP worker, gRPC
worker and inference worker as real processes. Health, metadata, unary and streaming infer equal
to ``/v1/detect``, Triton's system shared memory over gRPC and REST, every error status, client
deadlines that stop queued work, fuzzed requests that never meet an internal error, the README's
example, and a SIGTERM that ends it all with exit code 0."""

from __future__ import annotations

import os
import queue
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import cv2
import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from tests.net import GrpcServer, flat_jpeg, four_photos, metric_sum, wait_until_idle
from tests.net import v1_detect as net_v1_detect

BODY_LIMIT = 2 * 1024 * 1024
MAX_IMAGES = 48
OUTPUTS = ("num_dets", "det_boxes", "det_scores", "det_classes")
INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(scope="module")
def server(artifacts_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("grpc") / "server.log"
    # Two images of a request at the inference worker at a time: a request that is given up
    # leaves most of its images queued, where cancelling them shows. A queue budget far over the
    # timeout: on a loaded 2-core box the worker's own estimate of 40 images passed the default
    # (the timeout) and the deadline test was refused UNAVAILABLE before its deadline could pass.
    running = GrpcServer(artifacts_dir, log, YOLOPIPE_ALLOW_CLIENT_SHM="true", YOLOPIPE_REQUEST_WINDOW="2",
                         YOLOPIPE_QUEUE_BUDGET_S="600",
                         YOLOPIPE_MAX_BODY_BYTES=str(BODY_LIMIT), YOLOPIPE_MAX_IMAGES_PER_REQUEST=str(MAX_IMAGES))
    yield running
    assert running.stop() == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]


@pytest.fixture(scope="module")
def client(server) -> tgrpc.InferenceServerClient:
    return server.client


@pytest.fixture(scope="module")
def images(bus, zidane) -> list[bytes]:
    return four_photos(bus, zidane)


def v1_detect(server: GrpcServer, data: bytes, **params) -> list[dict]:
    return net_v1_detect(server.url, data, **params)


def image_input(module, images: list[bytes], shape: list[int] | None = None, name: str = "image"):
    array = np.array(images, dtype=np.object_).reshape(shape or [len(images)])
    tensor = module.InferInput(name, list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)
    return tensor


def rows(result, i: int) -> list[dict]:
    """Image ``i``'s detections as /v1 rounds them, checking the zero padding after them."""
    n = int(result.as_numpy("num_dets")[i, 0])
    boxes, scores, classes = (result.as_numpy(o) for o in OUTPUTS[1:])
    assert not boxes[i, n:].any() and not scores[i, n:].any() and not classes[i, n:].any()
    return [{"box": [round(float(v), 2) for v in boxes[i, j]], "score": round(float(scores[i, j]), 5),
             "class_id": int(classes[i, j])} for j in range(n)]


def assert_equals_v1(server: GrpcServer, result, images: list[bytes], **params) -> None:
    counts = result.as_numpy("num_dets")
    assert counts.shape == (len(images), 1) and counts.dtype == np.int32
    assert result.as_numpy("det_boxes").dtype == np.float32 and result.as_numpy("det_classes").dtype == np.int32
    for i, data in enumerate(images):
        expected = [{k: d[k] for k in ("box", "score", "class_id")} for d in v1_detect(server, data, **params)]
        assert rows(result, i) == expected, f"image {i}"


def failure(call, what: str = "") -> tuple[str, str]:
    try:
        call()
    except InferenceServerException as exc:
        return str(exc.status()), exc.message()
    pytest.fail(f"{what}: no error")


# --- health, metadata, inference ----------------------------------------------------------------
def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("yolopipe") and client.is_model_ready("sample") and client.is_model_ready("yolopipe", "1")
    assert not client.is_model_ready("resnet50") and not client.is_model_ready("yolopipe", "2")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "yolopipe" and "system_shared_memory" in meta["extensions"]
    model = client.get_model_metadata("yolopipe", as_json=True)
    assert model["platform"] == "yolopipe_onnxruntime" and model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": ["-1"]}]
    assert {o["name"]: (o["datatype"], o["shape"]) for o in model["outputs"]} == {
        "num_dets": ("INT32", ["-1", "1"]), "det_boxes": ("FP32", ["-1", "-1", "4"]),
        "det_scores": ("FP32", ["-1", "-1"]), "det_classes": ("INT32", ["-1", "-1"])}
    status, _ = failure(lambda: client.get_model_config("yolopipe"))  # Triton's, not served
    assert status == "StatusCode.UNIMPLEMENTED"


def test_infer_equals_v1(client, server, images):
    result = client.infer("yolopipe", [image_input(tgrpc, images)], request_id="batch-1")
    assert result.get_response().id == "batch-1" and result.get_response().model_version == "1"
    assert [o.name for o in result.get_response().outputs] == list(OUTPUTS)
    assert result.as_numpy("num_dets").min() >= 1  # every photo has detections: the comparison bites
    assert_equals_v1(server, result, images)


def test_shape_b_by_1_parameters_and_a_subset_of_outputs(client, server, images):
    two = images[:2]
    params = {"conf": 0.1, "iou": 0.5, "max_det": 3, "classes": "0"}
    outputs = [tgrpc.InferRequestedOutput(n) for n in OUTPUTS]
    result = client.infer("sample", [image_input(tgrpc, two, shape=[2, 1])], parameters=params, outputs=outputs)
    assert_equals_v1(server, result, two, conf=0.1, iou=0.5, max_det=3, classes=[0])
    subset = client.infer("yolopipe", [image_input(tgrpc, two)], parameters=params,
                          outputs=[tgrpc.InferRequestedOutput("det_scores"), tgrpc.InferRequestedOutput("num_dets")])
    assert [o.name for o in subset.get_response().outputs] == ["det_scores", "num_dets"]
    assert subset.as_numpy("det_boxes") is None
    assert np.array_equal(subset.as_numpy("det_scores"), result.as_numpy("det_scores"))


def stub_call(server: GrpcServer, request, timeout: float = 120.0):
    """One ModelInfer call made without tritonclient's InferInput (the message as built)."""
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_unary(INFER, request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
                                   response_deserializer=service_pb2.ModelInferResponse.FromString)
        return call(request, timeout=timeout)


def test_bytes_contents_are_read_as_raw_input_contents_are(client, server, images):
    request = service_pb2.ModelInferRequest(model_name="yolopipe")
    tensor = request.inputs.add(name="image", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend(images[2:])
    answer = stub_call(server, request)
    expected = client.infer("yolopipe", [image_input(tgrpc, images[2:])]).get_response()
    assert list(answer.raw_output_contents) == list(expected.raw_output_contents)


def test_a_stream_answers_in_order_and_goes_on_past_an_error(client, images):
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, image in enumerate([images[0], images[3], b"not an image", images[1], images[3]]):
            client.async_stream_infer("yolopipe", [image_input(tgrpc, [image])], request_id=f"r{i}")
        got = [answers.get(timeout=300) for _ in range(5)]
    finally:
        client.stop_stream()
    assert [r.get_response().id if r else None for r, _ in got] == ["r0", "r1", None, "r3", "r4"]
    assert got[2][1] is not None and "image 0: " in got[2][1].message()
    for (result, _), image in zip([got[0], got[1], got[3]], [images[0], images[3], images[1]]):
        unary = client.infer("yolopipe", [image_input(tgrpc, [image])])
        for name in OUTPUTS:
            assert np.array_equal(result.as_numpy(name), unary.as_numpy(name)), name
    assert np.array_equal(got[4][0].as_numpy("det_boxes"), got[1][0].as_numpy("det_boxes"))


# --- shared memory --------------------------------------------------------------------------------
@pytest.fixture
def regions():
    """Input and output regions as a Triton client makes them; destroyed (unlinked) afterwards."""
    made = []

    def make(name: str, size: int):
        handle = shm.create_shared_memory_region(name, f"/yolopipe-test-{os.getpid()}-{name}", size)
        made.append(handle)
        return handle, f"/yolopipe-test-{os.getpid()}-{name}"

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_shared_memory_input_and_output(server, images, regions, protocol):
    module = tgrpc if protocol == "grpc" else thttp
    client = server.client if protocol == "grpc" else thttp.InferenceServerClient(f"127.0.0.1:{server.port}",
                                                                                 network_timeout=300)
    two = images[:2]
    data = serialize_byte_tensor(np.array(two, dtype=np.object_))
    size = len(data.item())
    source, source_key = regions("in", size + 64)
    shm.set_shared_memory_region(source, [data], offset=64)  # at an offset within the region
    boxes_size = 2 * 300 * 4 * 4  # what the largest answer needs (max_det 300)
    sink, sink_key = regions("out", 4096 + boxes_size)
    client.register_system_shared_memory("images", source_key, size + 64)
    client.register_system_shared_memory("boxes", sink_key, boxes_size, offset=4096)
    try:
        status = client.get_system_shared_memory_status(**({"as_json": True} if protocol == "grpc" else {}))
        listed = status["regions"].values() if protocol == "grpc" else status
        assert {(r["name"], r["key"]) for r in listed} == {("images", source_key), ("boxes", sink_key)}
        tensor = module.InferInput("image", [2], "BYTES")
        tensor.set_shared_memory("images", size, offset=64)
        wanted = module.InferRequestedOutput("det_boxes")
        wanted.set_shared_memory("boxes", boxes_size)
        result = client.infer("yolopipe", [tensor], outputs=[wanted, module.InferRequestedOutput("num_dets")])
        described = result.get_output("det_boxes")
        shape = list(described.shape) if protocol == "grpc" else described["shape"]
        plain = server.client.infer("yolopipe", [image_input(tgrpc, two)])
        assert shape == list(plain.as_numpy("det_boxes").shape)
        written = shm.get_contents_as_numpy(sink, np.float32, shape, offset=4096)
        assert np.array_equal(written, plain.as_numpy("det_boxes")) and written.any()
        assert np.array_equal(result.as_numpy("num_dets"), plain.as_numpy("num_dets"))
    finally:
        client.unregister_system_shared_memory()
    status = client.get_system_shared_memory_status(**({"as_json": True} if protocol == "grpc" else {}))
    assert not (status.get("regions") if protocol == "grpc" else status)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unusable_regions_are_invalid_argument_or_400(server, images, regions, protocol, tmp_path):
    module = tgrpc if protocol == "grpc" else thttp
    client = server.client if protocol == "grpc" else thttp.InferenceServerClient(f"127.0.0.1:{server.port}",
                                                                                 network_timeout=300)
    expected = "StatusCode.INVALID_ARGUMENT" if protocol == "grpc" else "400"
    data = serialize_byte_tensor(np.array(images[3:], dtype=np.object_))
    size = len(data.item())
    source, key = regions("in2", size)
    shm.set_shared_memory_region(source, [data])
    _, small_key = regions("small", 64)
    client.register_system_shared_memory("in2", key, size)
    client.register_system_shared_memory("small", small_key, 8)  # less than one image's boxes

    def infer_from(region: str, nbytes: int, offset: int = 0, out: tuple | None = None):
        tensor = module.InferInput("image", [1], "BYTES")
        tensor.set_shared_memory(region, nbytes, offset=offset)
        outputs = None
        if out is not None:
            outputs = [module.InferRequestedOutput("det_boxes")]
            outputs[0].set_shared_memory(*out)
        return lambda: client.infer("yolopipe", [tensor], outputs=outputs)

    os.symlink(f"/dev/shm{key}", link := Path(f"/dev/shm/yolopipe-test-{os.getpid()}-link"))
    try:
        cases = {
            "no such region": (infer_from("elsewhere", size), "no shared-memory region named 'elsewhere'"),
            "span outside the region": (infer_from("in2", size, offset=8), "outside region 'in2'"),
            "output region too small": (infer_from("in2", size, out=("small", 8)), "output 'det_boxes' needs"),
            "output span outside": (infer_from("in2", size, out=("small", 8, 4)), "outside region 'small'"),
            "key that does not exist": (lambda: client.register_system_shared_memory("x", "/yolopipe-no-such", 8),
                                        "does not exist"),
            "a path, not a key": (lambda: client.register_system_shared_memory("x", "/../etc/passwd", 8),
                                  "not a POSIX shared-memory name"),
            "a symlink": (lambda: client.register_system_shared_memory("x", f"/{link.name}", 8), "symbolic link"),
            "region past its object": (lambda: client.register_system_shared_memory("x", key, size + 1),
                                       "outside shared-memory object"),
            "a name already registered": (lambda: client.register_system_shared_memory("in2", key, size),
                                          "already registered"),
            "status of no such region": (lambda: client.get_system_shared_memory_status("elsewhere"),
                                         "no shared-memory region named 'elsewhere'"),
            "CUDA shared memory": (lambda: client.register_cuda_shared_memory("c", b"\0" * 64, 0, 64),
                                   "CUDA shared memory is not supported"),
        }
        for case, (call, words) in cases.items():
            status, message = failure(call, case)
            if case == "CUDA shared memory":
                assert status == ("StatusCode.UNIMPLEMENTED" if protocol == "grpc" else "400"), (case, status)
            else:
                assert status == expected, (case, status, message)
            assert words in message, (case, message)
    finally:
        link.unlink()
        client.unregister_system_shared_memory()


# --- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, status, words", [
    ("truncated", "INVALID_ARGUMENT", "image 1: "),
    ("text", "INVALID_ARGUMENT", "image 1: "),
    ("input_name", "INVALID_ARGUMENT", "unknown input 'images'"),
    ("shape", "INVALID_ARGUMENT", "shape [B] or [B, 1]"),
    ("conf", "INVALID_ARGUMENT", "conf must be within [0, 1]"),
    ("classes", "INVALID_ARGUMENT", "unknown class ids [7]"),
    ("unknown_parameter", "INVALID_ARGUMENT", "unknown parameters ['confidence']"),
    ("output", "INVALID_ARGUMENT", "unknown output 'boxes'"),
    ("datatype", "INVALID_ARGUMENT", "datatype BYTES"),
    ("too_many_images", "RESOURCE_EXHAUSTED", f"limit of {MAX_IMAGES}"),
    ("message_over_limit", "RESOURCE_EXHAUSTED", "larger than max"),
    ("pixels", "RESOURCE_EXHAUSTED", "image 0: "),
    ("model", "NOT_FOUND", "unknown model 'yolov8'"),
    ("version", "NOT_FOUND", "version '1' only"),
    ("timeout", "DEADLINE_EXCEEDED", "timeout of 1e-06 s"),
])
def test_errors_map_to_status_codes(client, images, forge, case, status, words):
    good = [images[3]]
    calls = {
        "truncated": lambda: client.infer("yolopipe", [image_input(tgrpc, [images[3], images[0][:300]])]),
        "text": lambda: client.infer("yolopipe", [image_input(tgrpc, [images[3], b"plain text, not an image"])]),
        "input_name": lambda: client.infer("yolopipe", [image_input(tgrpc, good, name="images")]),
        "shape": lambda: client.infer("yolopipe", [image_input(tgrpc, good * 2, shape=[1, 2])]),
        "conf": lambda: client.infer("yolopipe", [image_input(tgrpc, good)], parameters={"conf": 2.0}),
        "classes": lambda: client.infer("yolopipe", [image_input(tgrpc, good)], parameters={"classes": "0,7"}),
        "unknown_parameter": lambda: client.infer("yolopipe", [image_input(tgrpc, good)],
                                                  parameters={"confidence": 0.5}),
        "output": lambda: client.infer("yolopipe", [image_input(tgrpc, good)],
                                       outputs=[tgrpc.InferRequestedOutput("boxes")]),
        "too_many_images": lambda: client.infer("yolopipe", [image_input(tgrpc, [b"x"] * (MAX_IMAGES + 1))]),
        "message_over_limit": lambda: client.infer("yolopipe", [image_input(tgrpc, [os.urandom(BODY_LIMIT + 10)])]),
        "pixels": lambda: client.infer("yolopipe", [image_input(tgrpc, [forge.png(20_000, 20_000, rows=1)])]),
        "model": lambda: client.infer("yolov8", [image_input(tgrpc, good)]),
        "version": lambda: client.infer("yolopipe", [image_input(tgrpc, good)], model_version="2"),
        "timeout": lambda: client.infer("yolopipe", [image_input(tgrpc, good)], timeout=1),  # microseconds
    }
    if case == "datatype":  # tritonclient checks a numpy array's datatype: give it raw bytes as UINT8
        tensor = tgrpc.InferInput("image", [len(good[0])], "UINT8")
        tensor.set_data_from_numpy(np.frombuffer(good[0], np.uint8))
        calls[case] = lambda: client.infer("yolopipe", [tensor])
    got, message = failure(calls[case])
    assert got == f"StatusCode.{status}" and words in message, (got, message)


def _metric(server: GrpcServer, name: str) -> float:
    return metric_sum(httpx.get(f"{server.url}/metrics", timeout=30).text, name)


def test_a_client_deadline_stops_the_work_its_request_left_queued(client, server, images):
    """The deadline is set from the worker's measured pace, so that the request needs about
    five times it on any machine: with a fixed second, a fast one answered all 40 small images
    in time and the test failed."""
    flat = flat_jpeg(640)
    paced = 8  # four request windows (two images each) back to back
    client.infer("yolopipe", [image_input(tgrpc, [flat] * paced)])  # warm
    start = time.monotonic()
    client.infer("yolopipe", [image_input(tgrpc, [flat] * paced)])
    per_image = (time.monotonic() - start) / paced
    count = MAX_IMAGES
    wait_until_idle(lambda: _metric(server, "yolopipe_queue_depth"))  # the pacing counted before ``before``
    before = _metric(server, 'yolopipe_images_total{outcome="ok"')
    status, _ = failure(lambda: client.infer("yolopipe", [image_input(tgrpc, [flat] * count)],
                                             client_timeout=per_image * count / 5))
    assert status == "StatusCode.DEADLINE_EXCEEDED"
    wait_until_idle(lambda: _metric(server, "yolopipe_queue_depth"))  # the worker idle for 2 s
    computed = _metric(server, 'yolopipe_images_total{outcome="ok"') - before
    assert computed < count / 2, computed  # only what was already running when the deadline passed
    assert _metric(server, 'yolopipe_grpc_requests_total{code="DEADLINE_EXCEEDED",method="ModelInfer"') >= 1 or \
        _metric(server, 'yolopipe_grpc_requests_total{code="CANCELLED",method="ModelInfer"') >= 1


def test_overload_is_unavailable(artifacts_dir, tmp_path, images):
    """A queue budget below one CPU inference: while one image is at work the others are refused
    at once, UNAVAILABLE, as REST's 503."""
    tight = GrpcServer(artifacts_dir, tmp_path / "server.log", YOLOPIPE_QUEUE_BUDGET_S="0.001")
    try:
        answers: queue.Queue = queue.Queue()
        for _ in range(6):
            tight.client.async_infer("yolopipe", [image_input(tgrpc, [images[0]])],
                                     callback=lambda result, error: answers.put(error))
        errors = [answers.get(timeout=300) for _ in range(6)]
        statuses = {str(e.status()) if e is not None else "OK" for e in errors}
        assert "StatusCode.UNAVAILABLE" in statuses and statuses <= {"OK", "StatusCode.UNAVAILABLE"}, statuses
    finally:
        assert tight.stop() == 0


# --- hostile input ------------------------------------------------------------------------------
def _fuzzed_request(rng: random.Random, small_jpeg: bytes):
    request = service_pb2.ModelInferRequest()
    # Mostly this model: a wrong name is answered before the rest is read.
    request.model_name = rng.choice(["yolopipe"] * 8 + ["sample", "", "x" * rng.randint(1, 300), "yolopipe\0"])
    request.model_version = rng.choice(["", "", "", "1", "1", "2", "-1", "1" * 40])
    request.id = rng.choice(["", "id", "\u00e9" * 50])
    for _ in range(rng.randint(0, 4)):
        key = rng.choice(["conf", "iou", "max_det", "classes", "agnostic", "timeout", "binary_data_output",
                          "sequence_id", "priority", "triton_x", "", "shared_memory_region"])
        value = request.parameters[key]
        kind = rng.randrange(6)
        if kind == 0:
            value.double_param = rng.choice([float("nan"), float("inf"), -1.0, 0.5, 1e308, -0.0])
        elif kind == 1:
            value.int64_param = rng.choice([0, 1, -1, 2**63 - 1, -(2**63), 300, 301])
        elif kind == 2:
            value.string_param = rng.choice(["0", "0,1", "a", "", "9" * 30, ",,,", "-1"])
        elif kind == 3:
            value.bool_param = rng.random() < 0.5
        elif kind == 4:
            value.uint64_param = rng.choice([0, 2**64 - 1, 5])
        # kind 5: an InferParameter with nothing set
    elements = [rng.choice([small_jpeg, small_jpeg[: rng.randint(0, len(small_jpeg))], os.urandom(rng.randint(0, 64)),
                            b"", b"\x89PNG\r\n\x1a\n" + os.urandom(30)]) for _ in range(rng.randint(0, 3))]
    for _ in range(rng.choice([0, 1, 1, 1, 2])):
        tensor = request.inputs.add(name=rng.choice(["image", "image", "images", ""]),
                                    datatype=rng.choice(["BYTES", "BYTES", "UINT8", "FP32", "", "bytes"]))
        tensor.shape.extend(rng.choice([[len(elements)], [len(elements), 1], [], [0], [-1], [2**62], [1, 2],
                                        [len(elements), 1, 1], [-(2**63)]]))
        if rng.random() < 0.2:
            tensor.parameters["shared_memory_region"].string_param = rng.choice(["", "nope", "x"])
            tensor.parameters["shared_memory_byte_size"].int64_param = rng.choice([0, -1, 10, 2**62])
        if rng.random() < 0.15:
            tensor.parameters["binary_data_size"].int64_param = rng.randint(-5, 100)
        if rng.random() < 0.2:
            tensor.contents.bytes_contents.extend(elements)
        if rng.random() < 0.1:
            tensor.contents.int_contents.extend([1, 2, 3])
    for _ in range(rng.choice([0, 1, 1, 2])):
        framing = rng.randrange(4)
        if framing == 0:
            raw = b"".join(struct.pack("<I", len(e)) + e for e in elements)
        elif framing == 1:
            raw = struct.pack("<I", 2**32 - 1) + os.urandom(8)
        elif framing == 2:
            raw = os.urandom(rng.randint(0, 40))
        else:
            raw = b"".join(struct.pack("<I", len(e) + 1) + e for e in elements)
        request.raw_input_contents.append(raw)
    for _ in range(rng.randint(0, 2)):
        output = request.outputs.add(name=rng.choice(["num_dets", "det_boxes", "boxes", ""]))
        if rng.random() < 0.3:
            output.parameters["shared_memory_region"].string_param = "nope"
        if rng.random() < 0.3:
            output.parameters["binary_data"].int64_param = 3
    return request


def _valid_request(rng: random.Random, small_jpeg: bytes):
    """A request the server must answer OK, with parameters drawn from their valid ranges."""
    request = service_pb2.ModelInferRequest(model_name=rng.choice(["yolopipe", "sample"]))
    count = rng.randint(1, 2)
    request.inputs.add(name="image", datatype="BYTES", shape=rng.choice([[count], [count, 1]]))
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(small_jpeg)) + small_jpeg for _ in range(count)))
    request.parameters["conf"].double_param = rng.uniform(0, 1)
    request.parameters["max_det"].int64_param = rng.randint(1, 300)
    request.parameters["classes"].string_param = rng.choice(["0", "1", "0,1", ""])
    request.parameters["agnostic"].bool_param = rng.random() < 0.5
    for name in rng.sample(["num_dets", "det_boxes", "det_scores", "det_classes"], rng.randint(0, 4)):
        request.outputs.add(name=name)
    return request


def test_fuzzed_requests_never_meet_an_internal_error(client, server, images):
    """Random and wrong fields, shapes, datatypes, parameters and contents, and bytes that are not
    a ModelInferRequest at all: each is answered with a status that names the client's mistake
    (or OK), never INTERNAL or UNKNOWN, and the server goes on serving."""
    rng = random.Random(28)
    small_jpeg = cv2.imencode(".jpg", cv2.imdecode(np.frombuffer(images[0], np.uint8), cv2.IMREAD_COLOR)[:64, :64])[1]
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
    seen: dict = {}
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_unary(INFER, request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
                                   response_deserializer=service_pb2.ModelInferResponse.FromString)
        for i in range(300):
            if i % 30 == 0:
                message = _valid_request(rng, small_jpeg.tobytes())
            elif i % 10 == 0:  # bytes that are no ModelInferRequest at all
                message = rng.choice([os.urandom(rng.randint(1, 200)), b"\x0a\xff\xff\xff\xff\x0f", b"\xff" * 9])
            else:
                message = _fuzzed_request(rng, small_jpeg.tobytes())
            try:
                call(message, timeout=120)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert code in allowed and exc.details(), (i, code, exc.details(), message)
            seen[code] = seen.get(code, 0) + 1
    assert seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 100 and seen.get(grpc.StatusCode.OK, 0) >= 10, seen
    result = client.infer("yolopipe", [image_input(tgrpc, images[3:])])  # still serving, as before
    assert result.as_numpy("num_dets")[0, 0] >= 1


def test_the_readme_examples_run_and_agree_with_v1(server, assets_dir, bus, zidane):
    """The gRPC section's two examples: plain infer, and shared memory in and out."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Serve KServe v2 gRPC", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0].replace("127.0.0.1:8001", f"127.0.0.1:{server.grpc_port}")
              .replace('"/my_', f'"/yolopipe-readme-{os.getpid()}-') for b in section.split("```python\n")[1:]]
    assert len(blocks) == 2
    outputs = []
    for code in blocks:
        run = subprocess.run([sys.executable, "-c", code], cwd=assets_dir, capture_output=True, text=True,
                             timeout=300, check=False)
        assert run.returncode == 0, run.stderr
        outputs.append([int(line.split()[0]) for line in run.stdout.splitlines()])
    assert outputs[0] == [len(v1_detect(server, image, conf=0.25, classes=[0])) for image in (bus, zidane)]
    assert outputs[1] == [len(v1_detect(server, bus))]
    assert min(outputs[0]) >= 1 and outputs[1][0] >= 1
