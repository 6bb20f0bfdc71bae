"""A request means one thing or is refused, before any route runs (``app.api.framing``,
``app.api.limits``, the streams API's schema): HEAD answers as GET without a body, an encoded
slash or a dot segment is no path here, two values of a header the server acts on are a 400,
and the streams API refuses unknown fields, other types and big bodies. The app runs without
its inference workers (no lifespan); raw sockets against a real server are in tests/e2e."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.settings import Settings

GET_ENDPOINTS = ["/healthz", "/readyz", "/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/yolopipe",
                 "/v2/models/yolopipe/ready", "/v2/models/yolopipe/versions/1", "/v2/models/nope", "/v1/model",
                 "/v1/streams", "/v1/streams/0-0", "/docs", "/openapi.json", "/nowhere"]


@pytest.fixture(scope="module")
def client():
    app = create_app(Settings(max_body_bytes=8192, max_stream_body_bytes=512), inference=None)  # type: ignore[arg-type]
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def ready_client():
    """As if an inference worker were connected: requests get past the readiness check (and
    must be refused before they reach it)."""
    app = create_app(Settings(max_stream_body_bytes=512), inference=None)  # type: ignore[arg-type]
    client = TestClient(app, raise_server_exceptions=False)
    app.state.inference = SimpleNamespace(info={"class_names": ["a"]}, layout=None)
    return client


@pytest.mark.parametrize("path", GET_ENDPOINTS)
def test_head_answers_as_get_without_a_body(client, path):
    get, head = client.get(path), client.head(path)
    assert head.status_code == get.status_code, head.text
    assert head.content == b""
    assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))
    assert head.headers["content-type"] == get.headers["content-type"]


def test_head_on_metrics_and_on_a_post_endpoint(client):
    head = client.head("/metrics")
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 1000
    assert client.head("/v1/detect").status_code == 405 == client.get("/v1/detect").status_code


@pytest.mark.parametrize("method, path", [
    ("POST", "/v2/models/yolopipe%2Finfer"),
    ("POST", "/v2/models/yolopipe%2finfer"),
    ("POST", "/v2/models%2Fyolopipe/infer"),
    ("GET", "/v2/models/yolopipe%2Fready"),
    ("GET", "/v2%2Fhealth%2Flive"),
    ("GET", "/v1%2Fmodel"),
    ("GET", "/v1/streams/0-0%2Fevents"),
    ("GET", "/v2/models/yolopipe%5Cready"),
    ("GET", "/v2/models/%2e%2e/ready"),
    ("GET", "/v2/models/%2E/ready"),
    ("GET", "/v1/streams/%2e%2e"),
    ("POST", "/v2/models/yolopipe/%2e%2e/yolopipe/infer"),
])
def test_an_encoded_slash_or_a_dot_segment_names_nothing(client, method, path):
    r = client.request(method, path, content=b"{}")
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error if path.startswith("/v2") else error["message"]).startswith("no such path")


@pytest.mark.parametrize("name", ["Content-Type", "Content-Encoding", "Inference-Header-Content-Length", "Host"])
@pytest.mark.parametrize("values", [("2", "1"), ("2", "2")])
def test_two_values_of_a_header_the_server_acts_on_are_a_400(client, name, values):
    headers = [(name, values[0]), (name, values[1])]
    r = client.post("/v2/models/yolopipe/infer", content=b"{}", headers=headers)
    assert r.status_code == 400 and r.json() == {"error": f"malformed HTTP request: more than one {name.lower()} "
                                                          "header"}
    assert r.headers["connection"] == "close"
    r = client.post("/v1/detect", content=b"x", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"


def test_two_values_of_another_header_are_fine(client):
    assert client.get("/healthz", headers=[("Accept", "a/b"), ("Accept", "c/d")]).status_code == 200


@pytest.mark.parametrize("path, named", [
    ("/v1/detect?cnf=0.5", "'cnf'"),
    ("/v1/detect?conf=0.5&vid_stride=2", "'vid_stride'"),
    ("/v1/detect/batch?agnostc=1", "'agnostc'"),
    ("/v1/streams?source=rtsp://cam/a", "'source'"),
])
def test_a_query_parameter_an_endpoint_does_not_take_is_a_422_naming_it(client, path, named):
    r = client.post(path, content=b"x", headers={"content-type": "image/jpeg"})
    assert r.status_code == 422 and named in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body, named", [
    ({"source": "rtsp://cam/a", "vid_strde": 5}, "vid_strde"),
    ({"source": "rtsp://cam/a", "vid_stride": "5"}, "vid_stride"),
    ({"source": "rtsp://cam/a", "vid_stride": True}, "vid_stride"),
    ({"source": "rtsp://cam/a", "vid_stride": 5.0}, "vid_stride"),
    ({"source": "rtsp://cam/a", "track": "yes"}, "track"),
    ({"source": "rtsp://cam/a", "track": 1}, "track"),
    ({"source": 7}, "source"),
    ({"sources": ["rtsp://cam/a"]}, "sources"),
])
def test_the_streams_api_refuses_unknown_fields_and_other_types_by_name(ready_client, body, named):
    r = ready_client.post("/v1/streams", json=body)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_parameter"
    assert named in r.json()["error"]["message"], r.text


def test_the_streams_api_has_a_small_body_limit_of_its_own(ready_client):
    big = b'{"source": "' + b"a" * 600 + b'"}'
    r = ready_client.post("/v1/streams", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "over the limit of 512" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it streams in
        yield b'{"source": "'
        for _ in range(10):
            yield b"a" * 100
        yield b'"}'

    r = ready_client.post("/v1/streams", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large", r.text
    # Elsewhere the service's own limit holds: the same body reaches /v1/detect's checks.
    r = ready_client.post("/v1/detect", content=big, headers={"content-type": "image/jpeg"})
    assert r.status_code != 413
