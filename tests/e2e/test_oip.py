"""NVIDIA's own ``tritonclient.http`` drives yolopipe's Open Inference Protocol (KServe v2) on a
real uvicorn server on loopback (CPU backend, sample model), exactly as it drives Triton: health,
metadata, infer with binary and JSON tensors, parameters, a subset of outputs, compressed
bodies and every error status. Every answer must equal ``/v1/detect``'s on the same images."""

from __future__ import annotations

import base64
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.net import four_photos, free_port, wait_ready
from tests.net import v1_detect as net_v1_detect

BODY_LIMIT = 2 * 1024 * 1024
MAX_IMAGES = 8
SERVER = """
import sys, uvicorn
from app.service.http_worker import create_service_app
from app.api.protocol import uvicorn_options
from app.settings import Settings
settings = Settings(backend="onnxruntime", artifacts_dir=sys.argv[1], max_wait_ms=5, **eval(sys.argv[3]))
uvicorn.run(create_service_app(settings), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning",
            access_log=False, **uvicorn_options(settings))
"""


def start(artifacts_dir: Path, log: Path, **settings) -> tuple[int, subprocess.Popen]:
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, str(artifacts_dir), str(port), repr(settings)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "YOLO_OFFLINE": "1"})
    wait_ready(f"http://127.0.0.1:{port}", proc, log)
    return port, proc


@pytest.fixture(scope="module")
def server(artifacts_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("oip") / "server.log"
    port, proc = start(artifacts_dir, log, max_body_bytes=BODY_LIMIT, max_images_per_request=MAX_IMAGES)
    yield port
    proc.terminate()
    proc.wait(30)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return triton.InferenceServerClient(f"127.0.0.1:{server}", connection_timeout=120, network_timeout=120)


@pytest.fixture(scope="module")
def images(bus, zidane) -> list[bytes]:
    return four_photos(bus, zidane)


def v1_detect(port: int, data: bytes, **params) -> list[dict]:
    return net_v1_detect(f"http://127.0.0.1:{port}", data, **params)


def image_input(images: list[bytes], *, binary: bool = True, shape: list[int] | None = None,
                name: str = "image", datatype: str = "BYTES") -> triton.InferInput:
    array = np.array(images if binary else [base64.b64encode(i).decode() for i in images], dtype=np.object_)
    array = array.reshape(shape or [len(images)])
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def assert_equals_v1(port: int, result: triton.InferResult, images: list[bytes], **params) -> None:
    """Each image's rows equal /v1/detect's (rounded as /v1 rounds them); padding rows are zeros."""
    counts = result.as_numpy("num_dets")
    boxes, scores, classes = (result.as_numpy(n) for n in ("det_boxes", "det_scores", "det_classes"))
    k = max(1, int(counts.max()))
    assert counts.shape == (len(images), 1) and counts.dtype == np.int32
    assert boxes.shape == (len(images), k, 4) and boxes.dtype == np.float32
    assert scores.shape == classes.shape == (len(images), k) and classes.dtype == np.int32
    for i, data in enumerate(images):
        n = int(counts[i, 0])
        rows = [{"box": [round(float(v), 2) for v in boxes[i, j]], "score": round(float(scores[i, j]), 5),
                 "class_id": int(classes[i, j])} for j in range(n)]
        expected = [{key: d[key] for key in ("box", "score", "class_id")} for d in v1_detect(port, data, **params)]
        assert rows == expected, f"image {i}"
        assert not boxes[i, n:].any() and not scores[i, n:].any() and not classes[i, n:].any()


def test_health_and_metadata(client, server):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("yolopipe") and client.is_model_ready("sample")  # the weights' name too
    assert not client.is_model_ready("resnet50")
    meta = client.get_server_metadata()
    assert meta["name"] == "yolopipe" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("yolopipe")
    assert model["platform"] == "yolopipe_onnxruntime" and model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1]}]
    assert {o["name"]: (o["datatype"], o["shape"]) for o in model["outputs"]} == {
        "num_dets": ("INT32", [-1, 1]), "det_boxes": ("FP32", [-1, -1, 4]),
        "det_scores": ("FP32", [-1, -1]), "det_classes": ("INT32", [-1, -1])}
    assert client.get_model_metadata("yolopipe", model_version="1")["name"] == "yolopipe"


def test_binary_batch_equals_v1(client, server, images):
    result = client.infer("yolopipe", [image_input(images)])  # binary in, binary out: tritonclient's default
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == 4 * len(images)
    assert result.as_numpy("num_dets").min() >= 1  # every photo has detections: the comparison bites
    assert_equals_v1(server, result, images)


def test_json_tensors_both_ways_equal_v1(client, server, images):
    outputs = [triton.InferRequestedOutput(n, binary_data=False)
               for n in ("num_dets", "det_boxes", "det_scores", "det_classes")]
    result = client.infer("sample", [image_input(images, binary=False)], outputs=outputs)
    assert all("data" in o for o in result.get_response()["outputs"])
    assert_equals_v1(server, result, images)


def test_shape_b_by_1_and_parameters(client, server, images):
    params = {"conf": 0.1, "iou": 0.5, "max_det": 3, "classes": "0"}
    result = client.infer("yolopipe", [image_input(images, shape=[len(images), 1])], parameters=params)
    assert_equals_v1(server, result, images, conf=0.1, iou=0.5, max_det=3, classes=[0])
    assert result.as_numpy("num_dets").max() <= 3
    listed = client.infer("yolopipe", [image_input(images)], parameters={**params, "classes": [0]})
    assert np.array_equal(listed.as_numpy("det_boxes"), result.as_numpy("det_boxes"))
    lower = client.infer("yolopipe", [image_input(images)], parameters={"conf": 0.05})
    assert lower.as_numpy("num_dets").sum() > result.as_numpy("num_dets").sum()  # the parameters bite


def test_a_subset_of_outputs(client, images):
    outputs = [triton.InferRequestedOutput("det_scores"), triton.InferRequestedOutput("num_dets", binary_data=False)]
    result = client.infer("yolopipe", [image_input(images)], outputs=outputs)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["det_scores", "num_dets"]
    assert result.as_numpy("det_boxes") is None
    full = client.infer("yolopipe", [image_input(images)])
    assert np.array_equal(result.as_numpy("det_scores"), full.as_numpy("det_scores"))
    assert np.array_equal(result.as_numpy("num_dets"), full.as_numpy("num_dets"))


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(client, images, algorithm):
    plain = client.infer("yolopipe", [image_input(images[:2])])
    packed = client.infer("yolopipe", [image_input(images[:2])], request_compression_algorithm=algorithm)
    for name in ("num_dets", "det_boxes", "det_scores", "det_classes"):
        assert np.array_equal(plain.as_numpy(name), packed.as_numpy(name))


def failure(call) -> tuple[int, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return int(info.value.status()), info.value.message()


@pytest.mark.parametrize("case, status, words", [
    ("truncated", 400, "image 1: "),
    ("text", 415, "image 1: "),
    ("too_many_images", 413, f"limit of {MAX_IMAGES}"),
    ("body_over_limit", 413, "over the limit"),
    ("pixels", 413, "image 0: "),
    ("request_pixels", 413, "image 4: "),
    ("gzip_bomb", 413, "decompresses to more than"),
    ("input_name", 422, "unknown input 'images'"),
    ("datatype", 422, "datatype BYTES"),
    ("shape", 422, "shape [B] or [B, 1]"),
    ("conf", 422, "conf must be within [0, 1]"),
    ("max_det", 422, "max_det must be within"),
    ("classes", 422, "unknown class ids [7]"),
    ("unknown_parameter", 422, "unknown parameters ['confidence']"),
    ("output", 422, "unknown output 'boxes'"),
    ("model", 404, "unknown model 'yolov8'"),
])
def test_errors_answer_in_the_protocols_shape(client, images, forge, case, status, words):
    good = [images[0]]
    huge = forge.png(20_000, 20_000, rows=1)  # 400 MP declared in a few bytes: over the 50 MP per image
    big = forge.png(7_000, 6_500, rows=1)  # 45.5 MP: four fit the request's 200 MP, a fifth does not
    calls = {
        "truncated": lambda: client.infer("yolopipe", [image_input([images[0], images[0][:300]])]),
        "text": lambda: client.infer("yolopipe", [image_input([images[0], b"plain text, not an image"])]),
        "too_many_images": lambda: client.infer("yolopipe", [image_input([images[3]] * (MAX_IMAGES + 1))]),
        "body_over_limit": lambda: client.infer("yolopipe", [image_input([os.urandom(BODY_LIMIT + 10)])]),
        "gzip_bomb": lambda: client.infer("yolopipe", [image_input([bytes(BODY_LIMIT + 10)])],
                                          request_compression_algorithm="gzip"),
        "pixels": lambda: client.infer("yolopipe", [image_input([huge, images[0]])]),
        "request_pixels": lambda: client.infer("yolopipe", [image_input([big] * 5)]),
        "input_name": lambda: client.infer("yolopipe", [image_input(good, name="images")]),
        "datatype": lambda: client.infer("yolopipe", [image_input(good, datatype="UINT8")]),
        "shape": lambda: client.infer("yolopipe", [image_input(good * 2, shape=[1, 2])]),
        "conf": lambda: client.infer("yolopipe", [image_input(good)], parameters={"conf": 2}),
        "max_det": lambda: client.infer("yolopipe", [image_input(good)], parameters={"max_det": 0}),
        "classes": lambda: client.infer("yolopipe", [image_input(good)], parameters={"classes": [0, 7]}),
        "unknown_parameter": lambda: client.infer("yolopipe", [image_input(good)], parameters={"confidence": 0.5}),
        "output": lambda: client.infer("yolopipe", [image_input(good)],
                                       outputs=[triton.InferRequestedOutput("boxes")]),
        "model": lambda: client.infer("yolov8", [image_input(good)]),
    }
    if case == "datatype":  # tritonclient checks a numpy array's datatype: give it raw bytes as UINT8
        tensor = triton.InferInput("image", [len(images[0])], "UINT8")
        tensor.set_data_from_numpy(np.frombuffer(images[0], np.uint8))
        calls[case] = lambda: client.infer("yolopipe", [tensor])
    got_status, message = failure(calls[case])
    assert got_status == status and words in message, (got_status, message)


def raw_infer(port: int, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v2/models/yolopipe/infer", content=body, headers=headers, timeout=60)


@pytest.mark.parametrize("header, tail, header_length, status", [
    ({"binary_data_size": 10}, b"\x05\0\0\0abc", None, 422),  # declares more than follows
    ({"binary_data_size": 4}, b"\xff\xff\xff\x7f", None, 422),  # an element longer than the data
    ({"binary_data_size": 9}, b"\x01\0\0\0a\0\0\0\0", None, 422),  # bytes after the last element
    ({"binary_data_size": "9"}, b"\x05\0\0\0abcde", None, 422),
    ({"binary_data_size": 9}, b"\x05\0\0\0abcde", "x", 422),  # the header length is not a number
    ({"binary_data_size": 9}, b"\x05\0\0\0abcde", "100000", 422),  # past the body
    ({}, b"\x05\0\0\0abcde", None, 422),  # binary data that no input declares
])
def test_malformed_binary_sizes_are_422(server, header, tail, header_length, status):
    head = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "parameters": header}]}).encode()
    r = raw_infer(server, head + tail, **{"Inference-Header-Content-Length": header_length or str(len(head))})
    assert r.status_code == status and isinstance(r.json()["error"], str), r.text


def test_unreadable_bodies_are_400_and_unknown_encodings_415(server):
    assert raw_infer(server, b"{not json").status_code == 400
    assert raw_infer(server, gzip.compress(b'{"inputs": []}')[:-6], **{"Content-Encoding": "gzip"}).status_code == 400
    r = raw_infer(server, b"{}", **{"Content-Encoding": "br"})
    assert r.status_code == 415 and r.json() == {"error": "Content-Encoding 'br' is not accepted; use gzip, deflate "
                                                          "or none"}


def test_overload_is_503_and_a_requests_own_timeout_504(artifacts_dir, tmp_path, images):
    """A queue budget below one CPU inference: while one image is at work the others are refused
    at once (503). Triton's ``timeout`` parameter (microseconds) bounds a request's wait (504)."""
    port, proc = start(artifacts_dir, tmp_path / "server.log", queue_budget_s=0.001)
    try:
        client = triton.InferenceServerClient(f"127.0.0.1:{port}", concurrency=6, network_timeout=120)
        status, message = failure(lambda: client.infer("yolopipe", [image_input([images[0]])], timeout=1))
        assert status == 504 and "timeout of 1e-06 s" in message
        assert failure(lambda: client.infer("yolopipe", [image_input([images[0]])], timeout=-1))[0] == 422
        pending = [client.async_infer("yolopipe", [image_input([images[0]])]) for _ in range(6)]
        statuses = []
        for p in pending:
            try:
                p.get_result()
                statuses.append(200)
            except InferenceServerException as exc:
                statuses.append(int(exc.status()))
        assert 503 in statuses and set(statuses) <= {200, 503}, statuses
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_readme_example_runs_and_agrees_with_v1(server, assets_dir, bus, zidane):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Serve the Open Inference Protocol", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0].replace("127.0.0.1:8000", f"127.0.0.1:{server}")
    run = subprocess.run([sys.executable, "-c", code], cwd=assets_dir, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr
    counts = [int(line.split()[0]) for line in run.stdout.splitlines()]
    assert counts == [len(v1_detect(server, image, conf=0.25, classes=[0])) for image in (bus, zidane)]
    assert min(counts) >= 1
