"""KServe's own Python SDK (``kserve`` 0.21: ``InferenceRESTClient``, ``InferenceGRPCClient``,
``InferRequest``, ``InferInput``) against a real ``yolopipe serve`` on loopback (CPU backend,
sample model; one HTTP, one gRPC and one inference worker): ``/v2`` REST with binary tensor data
and gRPC ``ModelInfer``, each answer equal to ``/v1/detect``'s on the same images.

The SDK's gRPC request (``InferRequest.to_grpc``) packs a BYTES input into
``raw_input_contents`` and keeps REST's ``binary_data_size`` in the input's parameters: the
server accepts it where it equals that content's length and refuses a lie.

The SDK runs in a process of its own (``tests/kserve_client.py``): it registers the KServe v2
messages in protobuf's default pool, as tritonclient does, and one process cannot import both."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.net import GrpcServer, four_photos
from tests.net import v1_detect as net_v1_detect

if sys.version_info >= (3, 14) or importlib.util.find_spec("kserve") is None:
    pytest.skip("kserve 0.21 installs on Python < 3.14 only (pyproject's dev extra leaves it out there)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "tests" / "kserve_client.py"
OUTPUTS = ("num_dets", "det_boxes", "det_scores", "det_classes")


@pytest.fixture(scope="module")
def server(artifacts_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("kserve") / "server.log"
    running = GrpcServer(artifacts_dir, log)
    yield running
    assert running.stop() == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]


@pytest.fixture(scope="module")
def images(bus, zidane, tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("kserve-images")
    paths = [folder / f"{i}.jpg" for i in range(4)]
    for path, data in zip(paths, four_photos(bus, zidane)):
        path.write_bytes(data)
    return paths


def sdk(mode: str, target: str, images: list[Path], model: str = "yolopipe", **parameters) -> dict:
    """One call of KServe's SDK (``tests/kserve_client.py``), its answer as it printed it."""
    proc = subprocess.run([sys.executable, str(CLIENT), mode, target, model, json.dumps(parameters),
                           *map(str, images)], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_equals_v1(server: GrpcServer, answer: dict, images: list[Path], **params) -> None:
    """Each image's rows equal /v1/detect's (rounded as /v1 rounds them); padding rows are zeros."""
    outputs = answer["outputs"]
    assert sorted(outputs) == sorted(OUTPUTS)
    assert outputs["num_dets"]["dtype"] == "int32" and outputs["det_classes"]["dtype"] == "int32"
    assert outputs["det_boxes"]["dtype"] == "float32"
    counts, boxes, scores, classes = (np.array(outputs[n]["data"]) for n in OUTPUTS)
    assert counts.shape == (len(images), 1)
    for i, path in enumerate(images):
        n = int(counts[i, 0])
        rows = [{"box": [round(float(v), 2) for v in boxes[i, j]], "score": round(float(scores[i, j]), 5),
                 "class_id": int(classes[i, j])} for j in range(n)]
        expected = [{k: d[k] for k in ("box", "score", "class_id")}
                    for d in net_v1_detect(server.url, path.read_bytes(), **params)]
        assert rows == expected, f"image {i}"
        assert not boxes[i, n:].any() and not scores[i, n:].any() and not classes[i, n:].any()


def test_the_sdk_sends_binary_data_size_over_grpc(images):
    """What the fix is for: the SDK's gRPC message carries the raw content and its length beside it."""
    message = sdk("message", "-", images)
    assert message["rest_binary"]  # REST sends binary tensor data after the JSON header
    assert len(message["raw_input_contents"]) == 1
    assert message["binary_data_size"] == message["raw_input_contents"][0]


def test_rest_binary_infer_equals_v1(server, images):
    answer = sdk("rest", server.url, images)
    assert min(answer["outputs"]["num_dets"]["data"])[0] >= 1  # every photo has detections: the comparison bites
    assert_equals_v1(server, answer, images)


def test_grpc_infer_equals_v1(server, images):
    answer = sdk("grpc", server.grpc_target, images)
    assert answer["model_name"] == "yolopipe"
    assert min(answer["outputs"]["num_dets"]["data"])[0] >= 1
    assert_equals_v1(server, answer, images)


def test_parameters_reach_the_model_on_both_protocols(server, images):
    # The SDK carries str, bool and int parameters over gRPC (to_grpc_parameters has no float).
    params = {"max_det": 3, "classes": "0", "agnostic": True}
    for mode, target in (("rest", server.url), ("grpc", server.grpc_target)):
        answer = sdk(mode, target, images[:2], model="sample", **params)
        assert_equals_v1(server, answer, images[:2], max_det=3, classes=[0], agnostic=True)
        assert max(answer["outputs"]["num_dets"]["data"])[0] <= 3


def test_a_lying_binary_data_size_is_refused_over_grpc(server, images):
    declared = sdk("message", "-", images[:1])["binary_data_size"] + 1
    answer = sdk("lie", server.grpc_target, images[:1])
    assert answer["error"]["code"] == "INVALID_ARGUMENT", answer
    assert f"declares binary_data_size {declared}, but its raw_input_contents holds {declared - 1}" in \
        answer["error"]["details"]
    assert sdk("grpc", server.grpc_target, images[:1])["outputs"]["num_dets"]["data"][0][0] >= 1  # still serving
