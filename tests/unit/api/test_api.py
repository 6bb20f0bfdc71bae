"""The HTTP API on the real detector (CPU backend, sample model): results, parameters, errors, docs."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from app.api.schemas import BatchResponse, ErrorResponse, ImageDetections, ModelInfo, Ready
from app.service.http_worker import create_service_app
from app.settings import Settings
from tests.references import image_json


@pytest.fixture(scope="module")
def client(artifacts_dir):
    app = create_service_app(Settings(backend="onnxruntime", artifacts_dir=artifacts_dir, max_wait_ms=2))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def detector(cpu_detector):
    return cpu_detector


def direct(detector, data: bytes, name: str, **params) -> dict:
    """What the detector itself says for these bytes: the reference for every HTTP answer."""
    (result,) = detector.detect([data], detector.params(**params))
    return image_json(result, name, detector.names)


def metric(text: str, prefix: str) -> float:
    """The sum of a ``/metrics`` page's samples whose line starts with ``prefix``."""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def without_timings(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "timings"}


def test_detect_multipart_equals_the_detector(client, detector, bus):
    r = client.post("/v1/detect", files={"image": ("bus.jpg", bus, "image/jpeg")})
    assert r.status_code == 200, r.text
    body = r.json()
    ImageDetections.model_validate(body)
    assert without_timings(body) == direct(detector, bus, "bus.jpg")
    assert (body["width"], body["height"]) == (810, 1080) and body["detections"]
    t = body["timings"]
    # Times only, the same stages on every backend (the schema forbids any other key). Durations
    # nest: the pipeline's stages inside its batch call; queue, decode and batch, one after the
    # other, inside the request's total (rounded to 1 µs each, hence the slack).
    assert list(t) == ["decode_ms", "queue_ms", "batch_ms", "pipeline_decode_ms", "preprocess_ms", "infer_ms",
                       "postprocess_ms", "total_ms"], t
    stages = [t["preprocess_ms"], t["infer_ms"], t["postprocess_ms"]]
    assert t["pipeline_decode_ms"] == 0 and min(stages) > 0, t  # the CPU pipeline's images come decoded
    assert sum(stages) <= t["batch_ms"] + 0.01, t
    assert t["decode_ms"] > 0 and t["total_ms"] >= t["queue_ms"] + t["decode_ms"] + t["batch_ms"] - 0.01, t


def test_detect_raw_body_equals_multipart(client, bus):
    raw = client.post("/v1/detect", content=bus, headers={"content-type": "image/jpeg"})
    multi = client.post("/v1/detect", files={"image": ("x.jpg", bus, "image/jpeg")})
    assert raw.status_code == multi.status_code == 200
    assert raw.json()["detections"] == multi.json()["detections"]
    assert raw.json()["image"] == "image"


@pytest.mark.parametrize(
    "query, params",
    [
        ("conf=0.6", {"conf": 0.6}),
        ("conf=0.1&iou=0.3", {"conf": 0.1, "iou": 0.3}),
        ("max_det=2&conf=0.05", {"max_det": 2, "conf": 0.05}),
        ("classes=1&conf=0.05", {"classes": [1], "conf": 0.05}),
        ("classes=0,1&conf=0.05", {"classes": [0, 1], "conf": 0.05}),
        ("classes=1&classes=0&conf=0.05", {"classes": [1, 0], "conf": 0.05}),
        ("agnostic=true&conf=0.05", {"agnostic": True, "conf": 0.05}),
    ],
)
def test_query_parameters_reach_the_detector(client, detector, zidane, query, params):
    r = client.post(f"/v1/detect?{query}", content=zidane, headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    assert without_timings(r.json()) == direct(detector, zidane, "image", **params)


def test_parameters_change_the_answer(client, zidane):
    def count(query):
        r = client.post(f"/v1/detect?{query}", content=zidane, headers={"content-type": "image/jpeg"})
        return len(r.json()["detections"])

    assert count("conf=0.01") > count("conf=0.5")  # guards the test above against a no-op parameter
    assert count("conf=0.01&max_det=1") == 1


def test_batch_keeps_order_and_reports_bad_images_inline(client, detector, bus, zidane):
    files = [
        ("images", ("zidane.jpg", zidane, "image/jpeg")),
        ("images", ("notes.txt", b"plain text, not an image", "text/plain")),
        ("images", ("bus.jpg", bus, "image/jpeg")),
        ("images", ("cut.jpg", bus[:300], "image/jpeg")),
    ]
    r = client.post("/v1/detect/batch?conf=0.3", files=files)
    assert r.status_code == 200, r.text
    body = r.json()
    BatchResponse.model_validate(body)
    res = body["results"]
    assert [x["image"] for x in res] == ["zidane.jpg", "notes.txt", "bus.jpg", "cut.jpg"]
    assert without_timings(res[0]) == direct(detector, zidane, "zidane.jpg", conf=0.3)
    assert without_timings(res[2]) == direct(detector, bus, "bus.jpg", conf=0.3)
    assert res[1]["status"] == 415 and res[1]["error"]["code"] == "unsupported_media_type"
    assert res[3]["status"] == 400 and res[3]["error"]["code"] == "invalid_image"


def test_batch_requests_coalesce_into_one_detector_batch(artifacts_dir, bus):
    """A request's images arrive together and form one batch within the batcher's wait."""
    app = create_service_app(Settings(backend="onnxruntime", artifacts_dir=artifacts_dir, max_wait_ms=200))
    with TestClient(app, raise_server_exceptions=False) as client:
        before = client.get("/metrics").text
        r = client.post("/v1/detect/batch", files=[("images", (f"{i}.jpg", bus, "image/jpeg")) for i in range(3)])
        after = client.get("/metrics").text
    assert r.status_code == 200 and len(r.json()["results"]) == 3

    def batches(text):  # (how many, images in all) of the batch size histogram
        return (metric(text, "yolopipe_batch_size_count"), metric(text, "yolopipe_batch_size_sum"))

    assert batches(after) == (batches(before)[0] + 1, batches(before)[1] + 3)  # one batch of all three


def test_a_square_server_answers_as_the_square_detector(artifacts_dir, detector, bus, zidane):
    """``YOLOPIPE_LETTERBOX=square`` (``serve --square``): the served answers are the square
    detector's (Ultralytics' ``rect=False``), not the default rect one's, and ``/v1/model`` says so."""
    from app.contracts import RunShape
    from app.runtime import OpenOptions, open_detector

    app = create_service_app(Settings(backend="onnxruntime", artifacts_dir=artifacts_dir, letterbox="square"))
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir,
                          shape=RunShape(letterbox="square"))
    with TestClient(app, raise_server_exceptions=False) as client, open_detector(options) as square:
        assert client.get("/v1/model").json()["letterbox"] == "square"
        for data, name in ((bus, "bus.jpg"), (zidane, "zidane.jpg")):
            served = without_timings(client.post("/v1/detect", files={"image": (name, data, "image/jpeg")}).json())
            assert served == direct(square, data, name) != direct(detector, data, name)


def test_health_ready_model_docs(client, detector):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    Ready.model_validate(ready)
    (worker,) = ready["startup"]  # how the worker started, step by step, each with its time
    assert ready["status"] == "ready" and worker["worker"] == 0 and worker["worker_ready_after_s"] > 0
    steps = [s["step"] for s in worker["steps"]]
    assert steps[:2] == ["checking the model's export (a first run exports it)", "opening ONNX Runtime"], steps
    assert steps[-1] == "warming up batch size 1 (1 of 1)" and all(s["s"] >= 0 for s in worker["steps"])
    info = client.get("/v1/model").json()
    ModelInfo.model_validate(info)
    assert info["backend"] == "onnxruntime" and info["precision"] == "fp32" and info["letterbox"] == "rect"
    assert info["class_names"] == detector.names and info["meta"]["imgsz"] == 640
    assert info["serving"]["max_pixels"] == 50_000_000 and info["weights"] == "sample"
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/detect", "/v1/detect/batch", "/healthz", "/readyz", "/v1/model", "/metrics"} <= set(paths)
    body = paths["/v1/detect"]["post"]["requestBody"]["content"]
    assert "multipart/form-data" in body and "image/jpeg" in body


def test_metrics_count_requests_batches_and_stages_across_processes(client, bus):
    before = client.get("/metrics").text
    client.post("/v1/detect", content=bus, headers={"content-type": "image/jpeg"})
    client.post("/v1/detect", content=b"", headers={"content-type": "image/jpeg"})
    text = client.get("/metrics").text
    assert 'yolopipe_requests_total{path="/v1/detect",status="200"}' in text
    assert 'yolopipe_requests_total{path="/v1/detect",status="400"}' in text

    assert metric(text, "yolopipe_batch_size_count") == metric(before, "yolopipe_batch_size_count") + 1
    # Stage times only: the worker's own stages and the pipeline's four (no count or index as a latency).
    stages = set(re.findall(r'yolopipe_stage_latency_seconds_count\{stage="(\w+)"\}', text))
    assert stages == {"decode", "queue", "batch", "pipeline_decode", "preprocess", "infer", "postprocess"}, stages
    assert "yolopipe_queue_depth 0.0" in text
    ok = 'yolopipe_images_total{outcome="ok"'
    assert metric(text, ok) == metric(before, ok) + 1
    assert "yolopipe_gpu_memory_bytes" not in text  # the CPU backend reports no GPU memory


@pytest.mark.parametrize(
    "method, path, status, code",
    [("get", "/nowhere", 404, "not_found"), ("get", "/v1/detect", 405, "method_not_allowed")],
)
def test_routing_errors_use_the_error_format(client, method, path, status, code):
    r = getattr(client, method)(path)
    assert r.status_code == status
    ErrorResponse.model_validate(r.json())
    assert r.json()["error"]["code"] == code
