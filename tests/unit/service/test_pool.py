"""The inference pool's self-healing, with real worker processes (the CPU model) behind the
real app: a worker whose device context dies exits for a restart, the pool starts it again,
and /readyz says so meanwhile.

The fault is injected into the real pipeline of the first generation of the worker (its
``run`` raises CUDA's illegal-address error once the test drops a marker file in the run
folder); the pool's processes start from ``_loses_its_device`` instead of ``worker_main``."""

from __future__ import annotations

import logging
import time

import pytest
from fastapi.testclient import TestClient

import app.service.pool
from app.service.http_worker import create_service_app
from app.service.inference.worker import EXIT_DEVICE_LOST, worker_main
from app.settings import Settings

MARKER = "lose-the-device"


def _loses_its_device(spec, settings, report, promote=None):
    """``worker_main``, whose first generation loses its device once the marker file exists."""
    import app.runtime

    real_open = app.runtime.open_model_dir
    marker = spec.layout.root / MARKER

    def open_model_dir(model_dir, options=None, steps=None):
        detector = real_open(model_dir, options, steps)
        if spec.generation == 0:
            real_run = detector.pipeline.run

            def run(images, params, **kwargs):
                if marker.exists():
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                return real_run(images, params, **kwargs)

            detector.pipeline.run = run
        return detector

    app.runtime.open_model_dir = open_model_dir
    worker_main(spec, settings, report, promote)


def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout:g} s")


@pytest.mark.parametrize("standby", [False, True], ids=["restarted", "standby"])
def test_a_worker_that_loses_its_device_is_restarted_and_readyz_goes_false_then_true(
        standby, artifacts_dir, bus, monkeypatch, caplog):
    monkeypatch.setattr(app.service.pool, "worker_main", _loses_its_device)
    settings = Settings(weights="sample", backend="onnxruntime", artifacts_dir=artifacts_dir, standby=standby,
                        max_wait_ms=1, request_timeout_s=20.0)
    files = {"image": ("bus.jpg", bus, "image/jpeg")}
    caplog.set_level(logging.ERROR, logger="yolopipe.serving")
    with TestClient(create_service_app(settings)) as http:
        inference = http.app.state.inference
        assert http.get("/readyz").status_code == 200
        first = http.post("/v1/detect", files=files)
        assert first.status_code == 200 and first.json()["detections"]
        if standby:
            _until(lambda: inference.workers()[0]["standby_ready"], 120, "a standby warmed up")
        (inference.layout.root / MARKER).touch()
        pid = inference.workers()[0]["pid"]

        failed = http.post("/v1/detect", files=files)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "device_error"
        not_ready = _until(lambda: (r := http.get("/readyz")).status_code == 503 and r, 30, "/readyz went false")
        assert not_ready.json()["error"]["code"] == "not_ready"
        _until(lambda: http.get("/readyz").status_code == 200, 120, "/readyz came back")

        again = http.post("/v1/detect", files=files)
        assert again.status_code == 200
        assert again.json()["detections"] == first.json()["detections"]
        worker = inference.workers()[0]
        assert worker["pid"] != pid and worker["restarts"] == 1
    ended = [r.getMessage() for r in caplog.records if "ended with exit code" in r.getMessage()]
    assert ended and f"exit code {EXIT_DEVICE_LOST} " in ended[0], ended


def _decodes_itself(settings, steps=None):
    """A detector factory (as a benchmark passes one): the model of ``settings`` behind
    ``DecodesItself``, which names itself as the backend."""
    from app.pipeline.detector import Detector
    from app.runtime import ensure_artifacts, open_model_dir, options_from
    from tests.standins import DecodesItself

    options = options_from(settings)
    real = open_model_dir(ensure_artifacts(options, steps), options, steps)
    return Detector(DecodesItself(real.pipeline), real.shape)


def test_the_workers_open_their_detector_with_the_factory_the_service_is_given(artifacts_dir, cpu_detector, bus):
    settings = Settings(weights="sample", backend="onnxruntime", artifacts_dir=artifacts_dir, standby=False,
                        max_wait_ms=1, request_timeout_s=20.0)
    with TestClient(create_service_app(settings, detector_factory=_decodes_itself)) as http:
        assert http.get("/v1/model").json()["backend"] == "decodes-itself"
        answer = http.post("/v1/detect", content=bus, headers={"content-type": "image/jpeg"})
    assert answer.status_code == 200
    expected = cpu_detector.detect([bus])[0].detections
    assert len(expected) and [d["class_id"] for d in answer.json()["detections"]] == expected.class_ids.tolist()
