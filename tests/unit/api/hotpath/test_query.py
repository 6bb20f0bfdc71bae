"""The hot path reads ``/v1/detect``'s query string itself (``app.api.hotpath.query``): for every
query it takes, its parameters are the ones FastAPI's route reads; anything else it hands to
FastAPI (None), whose answer (a 422 naming the parameter, or parameters) stays what it was."""

from __future__ import annotations

from types import SimpleNamespace
from urllib.parse import quote

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from app.api.errors import install_error_handlers
from app.api.hotpath.query import detect_params
from app.api.routes import ParamsDep, detect_query, inference_dependency
from app.config import MAX_DET
from app.contracts import DetectParams

CLASSES = 5


@pytest.fixture(scope="module")
def fastapi_reads():
    """A route with the detect endpoints' own query dependencies, answering what they read."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/q", dependencies=[Depends(detect_query)])
    async def q(params: ParamsDep) -> dict:
        return {"params": [params.conf, params.iou, params.max_det, params.classes, params.agnostic]}

    app.dependency_overrides[inference_dependency] = lambda: SimpleNamespace(
        info={"class_names": [str(i) for i in range(CLASSES)]})
    client = TestClient(app)

    def read(query: str) -> DetectParams | int:
        r = client.post("/q?" + query if query else "/q")
        if r.status_code != 200:
            return r.status_code
        conf, iou, max_det, classes, agnostic = r.json()["params"]
        return DetectParams(conf, iou, max_det, None if classes is None else tuple(classes), agnostic)

    return read


PLAIN = ["", "conf=0.5", "conf=0.25&iou=0.7", "max_det=3", f"max_det={MAX_DET}", "classes=0,2", "classes=0&classes=4",
         "agnostic=true", "agnostic=0", "conf=1&iou=0", "conf=0.123456789012&agnostic=false&classes=1&max_det=7"]


@pytest.mark.parametrize("query", PLAIN)
def test_a_plain_query_is_read_as_fastapi_reads_it(fastapi_reads, query):
    params = detect_params(query.encode(), CLASSES)
    assert params is not None and params == fastapi_reads(query)


@pytest.mark.parametrize("query", ["cnf=0.5", "conf=0.5&conf=0.6", "conf=%30.5", "conf=+0.5", "conf=1e-1",
                                   "conf=.5", "conf=nan", "conf=1.5", "conf=", "conf", "max_det=0", "max_det=007",
                                   f"max_det={MAX_DET + 1}", "classes=", "classes=a", "classes=0,,1", "agnostic=yes",
                                   "conf=0.5&", "&conf=0.5", "iou=0.5+"])
def test_anything_else_goes_to_fastapi(query):
    assert detect_params(query.encode(), CLASSES) is None


def test_a_class_the_model_lacks_is_the_routes_422():
    from app.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="unknown class ids"):
        detect_params(b"classes=9", CLASSES)


values = st.sampled_from(["0", "1", "0.5", "0.25", "1.0", "0.999999999999", "2", "10", "300", "-1", "true", "false",
                          "yes", "", " 0.5", "1e-2", "nan", "0,1", "4", "9", "1,2,3", "0.5.5"])
names = st.sampled_from(["conf", "iou", "max_det", "classes", "agnostic", "cnf"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(names, values), max_size=4))
def test_whatever_the_hot_path_reads_fastapi_reads_the_same(fastapi_reads, pairs):
    query = "&".join(f"{name}={quote(value, safe=',')}" for name, value in pairs)  # as a client sends it
    try:
        params = detect_params(query.encode(), CLASSES)
    except Exception as exc:  # noqa: BLE001 - only the route's own 422 may come out
        assert fastapi_reads(query) == 422, exc
        return
    if params is not None:
        assert params == fastapi_reads(query)
