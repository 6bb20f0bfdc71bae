"""KServe's own Python SDK (``kserve`` 0.21: ``InferenceRESTClient``, ``InferenceGRPCClient``,
``InferRequest``, ``InferInput``) against a real ``yolopipe serve`` on loopback (CPU backend,
sample model; one HTTP, one gRPC and one inference worker): ``/v2`` REST with binary tensor data
and gRPC ``ModelInfer``, each answer equal to ``/v1/detect``'s on the same images.

The SDK's gRPC request (``InferRequest.to_grpc``) packs a BYTES input into
``raw_input_contents`` and keeps REST's ``binary_data_size`` in the input's parameters: the
server accepts it where it equals that content's length and refuses a lie."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.net import four_photos, free_port, wait_ready
from tests.net import v1_detect as net_v1_detect

if sys.version_info >= (3, 14):
    pytest.skip("kserve 0.21 installs on Python < 3.14 only (pyproject's dev extra leaves it out there)",
                allow_module_level=True)

from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig  # noqa: E402

OUTPUTS = ("num_dets", "det_boxes", "det_scores", "det_classes")


class Server:
    """``yolopipe serve`` with its HTTP port and a gRPC port."""

    def __init__(self, artifacts_dir: Path, log: Path) -> None:
        self.port, self.grpc_port, self.log = free_port(), free_port(), log
        env = {**os.environ, "YOLOPIPE_ARTIFACTS_DIR": str(artifacts_dir), "YOLO_OFFLINE": "1",
               "YOLOPIPE_MAX_WAIT_MS": "5", "YOLOPIPE_STANDBY": "false", "YOLOPIPE_WORKERS": "1",
               "YOLOPIPE_GRPC_WORKERS": "1", "YOLOPIPE_GRPC_PORT": str(self.grpc_port)}
        with log.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--backend", "onnxruntime",
                                          "--host", "127.0.0.1", "--port", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_ready(self.url, self.proc, log, timeout=300)
        wait_ready(self.url, self.proc, log, timeout=60,
                   ready=lambda _: asyncio.run(_grpc(self, lambda c: c.is_server_ready())))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode


async def _grpc(server: Server, call):
    async with InferenceGRPCClient(f"127.0.0.1:{server.grpc_port}", timeout=120, retries=0) as client:
        return await call(client)


def grpc_infer(server: Server, request: InferRequest):
    return asyncio.run(_grpc(server, lambda client: client.infer(request)))


def rest_infer(server: Server, request: InferRequest):
    async def call():
        async with InferenceRESTClient(RESTConfig(protocol="v2", timeout=120)) as client:
            return await client.infer(server.url, request, model_name=request.model_name)
    return asyncio.run(call())


@pytest.fixture(scope="module")
def server(artifacts_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("kserve") / "server.log"
    running = Server(artifacts_dir, log)
    yield running
    assert running.stop() == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]


@pytest.fixture(scope="module")
def images(bus, zidane) -> list[bytes]:
    return four_photos(bus, zidane)


def image_request(images: list[bytes], model: str = "yolopipe", **parameters) -> InferRequest:
    """The SDK's request for these images, the data set as its docs show (binary, from numpy)."""
    tensor = InferInput("image", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_), binary_data=True)
    return InferRequest(model_name=model, infer_inputs=[tensor], parameters=parameters or None)


def assert_equals_v1(server: Server, response, images: list[bytes], **params) -> None:
    """Each image's rows equal /v1/detect's (rounded as /v1 rounds them); padding rows are zeros."""
    arrays = {o.name: o.as_numpy() for o in response.outputs}
    assert sorted(arrays) == sorted(OUTPUTS)
    counts, boxes, scores, classes = (arrays[n] for n in OUTPUTS)
    assert counts.shape == (len(images), 1) and counts.dtype == np.int32
    assert boxes.dtype == np.float32 and classes.dtype == np.int32
    for i, data in enumerate(images):
        n = int(counts[i, 0])
        rows = [{"box": [round(float(v), 2) for v in boxes[i, j]], "score": round(float(scores[i, j]), 5),
                 "class_id": int(classes[i, j])} for j in range(n)]
        expected = [{k: d[k] for k in ("box", "score", "class_id")} for d in net_v1_detect(server.url, data, **params)]
        assert rows == expected, f"image {i}"
        assert not boxes[i, n:].any() and not scores[i, n:].any() and not classes[i, n:].any()


def test_the_sdk_sends_binary_data_size_over_grpc(images):
    """What the fix is for: the SDK's gRPC message carries the raw content and its length beside it."""
    message = image_request(images).to_grpc()
    assert len(message.raw_input_contents) == 1
    assert message.inputs[0].parameters["binary_data_size"].int64_param == len(message.raw_input_contents[0])


def test_rest_binary_infer_equals_v1(server, images):
    request = image_request(images)
    assert request.to_rest()[1] is not None  # binary tensor data after the JSON header
    response = rest_infer(server, request)
    assert response.outputs[0].as_numpy().min() >= 1  # every photo has detections: the comparison bites
    assert_equals_v1(server, response, images)


def test_grpc_infer_equals_v1(server, images):
    response = grpc_infer(server, image_request(images))
    assert response.model_name == "yolopipe"
    assert response.outputs[0].as_numpy().min() >= 1
    assert_equals_v1(server, response, images)


def test_parameters_reach_the_model_on_both_protocols(server, images):
    # The SDK carries str, bool and int parameters over gRPC (to_grpc_parameters has no float).
    params = {"max_det": 3, "classes": "0", "agnostic": True}
    for infer in (rest_infer, grpc_infer):
        response = infer(server, image_request(images[:2], model="sample", **params))
        assert_equals_v1(server, response, images[:2], max_det=3, classes=[0], agnostic=True)
        assert response.outputs[0].as_numpy().max() <= 3


def test_a_lying_binary_data_size_is_refused_over_grpc(server, images):
    request = image_request(images[:1])
    declared = request.inputs[0].parameters["binary_data_size"] + 1
    request.inputs[0].parameters["binary_data_size"] = declared  # to_grpc keeps it: the data is raw already
    with pytest.raises(grpc.aio.AioRpcError) as info:
        grpc_infer(server, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"declares binary_data_size {declared}, but its raw_input_contents holds {declared - 1}" in \
        info.value.details()
    assert grpc_infer(server, image_request(images[:1])).outputs[0].as_numpy()[0, 0] >= 1  # still serving
