"""The /v2 routes before any inference worker is there (no lifespan): readiness, errors in the
protocol's shape wherever they are answered, and the request parameters' validation."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.api.oip.infer import detect_params
from app.config import CONF, IOU, MAX_DET
from app.contracts import make_params
from app.errors import InvalidParameter
from app.settings import Settings


@pytest.fixture(scope="module")
def client():
    # No `with`: the lifespan does not run, so no inference client is connected (a starting server).
    return TestClient(create_app(Settings(max_body_bytes=4096), inference=None), raise_server_exceptions=False)  # type: ignore[arg-type]


def test_live_but_not_ready(client):
    assert client.get("/v2/health/live").json() == {"live": True}
    r = client.get("/v2/health/ready")
    assert r.status_code == 503 and r.json() == {"ready": False}
    r = client.get("/v2/models/yolopipe/ready")
    assert r.status_code == 503 and r.json() == {"name": "yolopipe", "ready": False}
    assert client.get("/v2").json()["extensions"] == ["binary_tensor_data", "parameters"]


@pytest.mark.parametrize("method, path, body, headers, status", [
    ("POST", "/v2/models/yolopipe/infer", b"{}", {}, 503),  # starting: no inference worker yet
    ("GET", "/v2/models/yolopipe", b"", {}, 503),
    ("GET", "/v2/models/resnet/ready", b"", {}, 404),
    ("GET", "/v2/models/yolopipe/versions/2", b"", {}, 404),
    ("GET", "/v2/no/such/path", b"", {}, 404),
    ("DELETE", "/v2/models/yolopipe/infer", b"", {}, 405),
    ("POST", "/v2/models/yolopipe/infer", bytes(5000), {}, 413),  # the body limit, before any route
])
def test_every_v2_error_is_error_message(client, method, path, body, headers, status):
    r = client.request(method, path, content=body, headers=headers)
    assert r.status_code == status and set(r.json()) == {"error"} and isinstance(r.json()["error"], str), r.text
    assert r.headers["content-length"] == str(len(r.content))


def test_v1_errors_keep_their_own_shape(client):
    r = client.post("/v1/detect", content=b"x", headers={"content-type": "image/jpeg"})
    assert r.status_code == 503 and set(r.json()["error"]) == {"code", "message"}
    assert client.get("/v2x").json()["error"]["code"] == "not_found"  # only /v2 and below change shape


@pytest.mark.parametrize("given, expected", [
    ({}, make_params(CONF, IOU, MAX_DET, None, False)),
    ({"conf": 0.5, "iou": 0.4, "max_det": 7, "agnostic": True}, make_params(0.5, 0.4, 7, None, True)),
    ({"conf": 1}, make_params(1.0, IOU, MAX_DET)),
    ({"classes": "0, 1"}, make_params(classes=[0, 1])),
    ({"classes": [1]}, make_params(classes=[1])),
    ({"classes": 1}, make_params(classes=[1])),
    ({"classes": ""}, make_params()),
])
def test_parameters_mean_what_v1s_mean(given, expected):
    assert detect_params(given, num_classes=2) == expected


@pytest.mark.parametrize("given, message", [
    ({"conf": "0.5"}, "conf must be a number"),
    ({"conf": True}, "conf must be a number"),
    ({"iou": 1.5}, "iou must be within"),
    ({"max_det": 2.5}, "max_det must be an integer"),
    ({"max_det": MAX_DET + 1}, "max_det must be within"),
    ({"classes": "0,a"}, "classes must be integer class ids"),
    ({"classes": [0.5]}, "classes must be integer class ids"),
    ({"classes": "-1"}, "unknown class ids"),
    ({"classes": [2]}, "unknown class ids"),
    ({"agnostic": 1}, "agnostic must be true or false"),
    ({"confidence": 0.3}, "unknown parameters"),
])
def test_bad_parameters_are_named(given, message):
    with pytest.raises(InvalidParameter, match=message):
        detect_params(given, num_classes=2)
