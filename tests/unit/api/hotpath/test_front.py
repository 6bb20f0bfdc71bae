"""The hot path (``app.api.hotpath``) answers the ordinary detect and OIP infer requests itself and
hands every other request to FastAPI untouched: either way the answer is FastAPI's, byte for
byte (status, body, the headers a client reads). Each request below goes once through the app
and once through FastAPI alone (the hot path bypassed), in front of an inference worker peer
that speaks the real wire protocol; what the hot path took, and what it answered, is checked."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import struct
from types import SimpleNamespace

import httpx
from fastapi import FastAPI

from app.api.hotpath import front
from app.api.main import create_app
from app.ipc.client import InferenceClient
from app.settings import Settings
from tests.worker_peer import Peer, ready_worker_layout

READ = ("content-type", "inference-header-content-length", "retry-after", "connection")  # and content-length
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF"  # not whole: the cases that reach the worker send real photos


def oip(images: list[bytes], binary_output: bool = True, request_id: str | None = "r-1") -> tuple[bytes, dict]:
    tensor = b"".join(struct.pack("<I", len(i)) + i for i in images)
    head = {"inputs": [{"name": "image", "shape": [len(images)], "datatype": "BYTES",
                        "parameters": {"binary_data_size": len(tensor)}}],
            "parameters": {"binary_data_output": binary_output}, **({"id": request_id} if request_id else {})}
    header = json.dumps(head).encode()
    return header + tensor, {"content-type": "application/octet-stream",
                             "inference-header-content-length": str(len(header))}


def cases(bus: bytes) -> dict[str, tuple[bool, dict]]:
    """name → (taken by the hot path, httpx request arguments)."""
    body, headers = oip([bus])
    two, two_headers = oip([bus, bus], binary_output=False, request_id=None)
    return {
        "multipart": (True, {"url": "/v1/detect", "files": {"image": ("bus.jpg", bus, "image/jpeg")}}),
        "raw": (True, {"url": "/v1/detect", "content": bus, "headers": {"content-type": "image/jpeg"}}),
        "query": (True, {"url": "/v1/detect?conf=0.5&classes=0,1&agnostic=true", "content": bus,
                         "headers": {"content-type": "image/jpeg"}}),
        "batch": (True, {"url": "/v1/detect/batch", "files": [("images", ("a.jpg", bus, "image/jpeg")),
                                                             ("images", ("b.jpg", JPEG, "image/jpeg")),
                                                             ("images", ("c.txt", b"text", "text/plain"))]}),
        "oip_binary": (True, {"url": "/v2/models/yolopipe/infer", "content": body, "headers": headers}),
        "oip_json_outputs": (True, {"url": "/v2/models/yolopipe/versions/1/infer", "content": two,
                                    "headers": two_headers}),
        # errors answered by the hot path, in each route's shape
        "not_an_image": (True, {"url": "/v1/detect", "content": b"%PDF-1.7", "headers": {"content-type": "image/png"}}),
        "two_files": (True, {"url": "/v1/detect", "files": [("image", ("a.jpg", bus)), ("image", ("b.jpg", bus))]}),
        "no_such_field": (True, {"url": "/v1/detect/batch", "files": {"image": ("a.jpg", bus)}}),
        "odd_multipart": (True, {"url": "/v1/detect", "content": b"preamble\r\n--x\r\nContent-Disposition: form-data;"
                                 b' name="image"\r\n\r\n' + bus + b"\r\n--x--\r\n",
                                 "headers": {"content-type": "multipart/form-data; boundary=x"}}),
        "bad_multipart": (True, {"url": "/v1/detect", "content": b"--x\nContent-Disposition: form-data\n\nabc",
                                 "headers": {"content-type": "multipart/form-data; boundary=x"}}),
        "oip_bad_header": (True, {"url": "/v2/models/yolopipe/infer", "content": b"{not json",
                                  "headers": {"inference-header-content-length": "9"}}),
        "oip_gzip_bomb": (True, {"url": "/v2/models/yolopipe/infer", "content": gzip.compress(b"\0" * (2 << 20)),
                                 "headers": {"content-encoding": "gzip"}}),
        "truncated_jpeg": (True, {"url": "/v1/detect", "content": bus[:300], "headers": {"content-type": "image/jpeg"}}),
        # handed to FastAPI: what its routes refuse before reading the body (and close) ...
        "wrong_media_type": (False, {"url": "/v1/detect", "content": bus, "headers": {"content-type": "text/plain"}}),
        "batch_raw": (False, {"url": "/v1/detect/batch", "content": bus, "headers": {"content-type": "image/jpeg"}}),
        "no_boundary": (False, {"url": "/v1/detect", "content": bus, "headers": {"content-type": "multipart/form-data"}}),
        "multipart_gzip": (False, {"url": "/v1/detect", "content": gzip.compress(bus), "headers": {
            "content-type": "multipart/form-data; boundary=x", "content-encoding": "gzip"}}),
        "unknown_model": (False, {"url": "/v2/models/nope/infer", "content": body, "headers": headers}),
        # ... and anything unusual
        "chunked": (False, {"url": "/v1/detect", "chunks": [bus[:100], bus[100:]],
                            "headers": {"content-type": "image/jpeg"}}),
        "unknown_query": (False, {"url": "/v1/detect?cnf=0.5", "content": bus, "headers": {"content-type": "image/jpeg"}}),
        "bad_query": (False, {"url": "/v1/detect?conf=2", "content": bus, "headers": {"content-type": "image/jpeg"}}),
        "unknown_class": (False, {"url": "/v1/detect?classes=7", "content": bus, "headers": {"content-type": "image/jpeg"}}),
        "encoded_slash": (False, {"url": "/v2/models/yolopipe%2Finfer", "content": body, "headers": headers}),
        "dot_segment": (False, {"url": "/v2/models/../infer", "content": body, "headers": headers}),
        "two_content_types": (False, {"url": "/v1/detect", "content": bus,
                                      "headers": [("content-type", "image/jpeg"), ("content-type", "image/png")]}),
        "trailing_slash": (False, {"url": "/v1/detect/", "content": bus, "headers": {"content-type": "image/jpeg"}}),
        "over_the_limit": (False, {"url": "/v1/detect", "content": bus + b"\0" * (1 << 20),
                                   "headers": {"content-type": "image/jpeg"}}),
    }


def request_arguments(kwargs: dict) -> dict:
    """``kwargs`` for one request: "chunks" sent as a body of unknown length (chunked)."""
    if "chunks" not in kwargs:
        return kwargs
    chunks = kwargs["chunks"]

    async def pieces():
        for chunk in chunks:
            yield chunk

    return {**{k: v for k, v in kwargs.items() if k != "chunks"}, "content": pieces()}


def masked(body: bytes) -> bytes:
    """The body with the request's own clock readings (total_ms) blanked."""
    return re.sub(rb'"total_ms":[0-9.e-]+', b'"total_ms":0', body)


def test_the_hot_path_answers_as_fastapi_does(assets_dir):
    bus = (assets_dir / "bus.jpg").read_bytes()
    taken: list[bool] = []

    def spy(*args, **kwargs):
        request = take(*args, **kwargs)
        taken.append(request is not None)
        return request

    take = front._taken
    settings = Settings(max_body_bytes=1 << 20)
    with ready_worker_layout() as layout:
        app = create_app(settings, InferenceClient(settings, layout))

        async def fastapi_alone(scope, receive, send):  # the same app, the hot path bypassed
            await FastAPI.__call__(app, scope, receive, send)

        async def main() -> dict:
            server = await asyncio.get_running_loop().create_unix_server(lambda: Peer(["detect"], []),
                                                                         str(layout.socket(0)))
            answers = {}
            try:
                async with app.router.lifespan_context(app):
                    while app.state.inference.info is None:
                        await asyncio.sleep(0.01)
                    for name, (hot, kwargs) in cases(bus).items():
                        got = []
                        for target in (app, fastapi_alone):
                            transport = httpx.ASGITransport(app=target)
                            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                                got.append(await client.post(**request_arguments(kwargs)))
                        answers[name] = (hot, got, any(taken))
                        taken.clear()
            finally:
                server.close()
            return answers

        front._taken = spy
        try:
            answers = asyncio.run(main())
        finally:
            front._taken = take
    for name, (hot, (ours, theirs), was_taken) in answers.items():
        assert was_taken is hot, name
        assert ours.status_code == theirs.status_code, (name, ours.text, theirs.text)
        assert masked(ours.content) == masked(theirs.content), name
        read = READ
        if name == "bad_multipart":  # FastAPI's parser gave up before the body's end (so it closed); the
            read = READ[:-1]  # hot path read the (bounded, declared) body whole first: the connection stays usable
            assert "connection" not in ours.headers
        assert {k: ours.headers.get(k) for k in read} == {k: theirs.headers.get(k) for k in read}, name
        assert int(ours.headers["content-length"]) == len(ours.content), name
    statuses = {name: ours.status_code for name, (_, (ours, _), _) in answers.items()}
    assert statuses["multipart"] == statuses["oip_binary"] == statuses["batch"] == 200
    assert json.loads(answers["multipart"][1][0].content)["detections"][0]["score"] == 0.875
    assert app.hot_path.holds.count == 0


def test_a_client_that_leaves_while_sending_is_counted_499():
    settings = Settings()
    with ready_worker_layout() as layout:
        app = create_app(settings, InferenceClient(settings, layout))
        app.state.inference = SimpleNamespace(info={"class_names": ["a"]})  # ready, as far as the front asks
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/detect", "raw_path": b"/v1/detect",
                 "query_string": b"", "headers": [(b"content-type", b"image/jpeg"), (b"content-length", b"10")],
                 "http_version": "1.1"}
        asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert app.state.metrics.requests.labels("/v1/detect", "499")._value.get() == 1
    assert app.hot_path.holds.count == 0
