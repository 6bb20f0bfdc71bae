"""/docs works offline: the page names no outside host and every asset it loads is served."""

from __future__ import annotations

import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.api.docs import install_docs


def _docs_page_assets(client: TestClient) -> list[str]:
    page = client.get("/docs")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text) + re.findall(r"url: ?'([^']+)'", page.text)
    assert urls, page.text
    assert [u for u in urls if "://" in u or u.startswith("//")] == [], "the page loads something from outside"
    return urls


def test_docs_page_and_every_asset_are_served_from_the_package():
    app = FastAPI(title="t", docs_url=None, redoc_url=None)
    install_docs(app)
    client = TestClient(app)
    urls = _docs_page_assets(client)
    assert {"/openapi.json", "/docs-assets/swagger-ui-bundle.js", "/docs-assets/swagger-ui.css"} <= set(urls)
    for url in urls:
        assert client.get(url).status_code == 200, url
    bundle = client.get("/docs-assets/swagger-ui-bundle.js")
    assert "javascript" in bundle.headers["content-type"] and "SwaggerUIBundle" in bundle.text


def test_install_docs_refuses_an_app_that_serves_the_cdn_page():
    with pytest.raises(ValueError, match="docs_url=None"):
        install_docs(FastAPI())


def test_the_service_docs_work_offline():
    from app.service.http_worker import create_service_app

    client = TestClient(create_service_app())
    for url in _docs_page_assets(client):
        assert client.get(url).status_code == 200, url


@pytest.mark.parametrize("range_header, status", [("bytes=abc", 400), ("bytes=5-2", 400), ("items=0-1", 400),
                                                  ("bytes=999999999-", 416)])
def test_a_bad_range_on_an_asset_is_answered_in_the_json_error_shape(range_header, status):
    app = FastAPI(title="t", docs_url=None, redoc_url=None)
    install_docs(app)
    r = TestClient(app).get("/docs-assets/swagger-ui.css", headers={"Range": range_header})
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"code", "message"}
    assert r.json()["error"]["code"] == {400: "bad_request", 416: "range_not_satisfiable"}[status]


def test_a_good_range_on_an_asset_is_still_served():
    app = FastAPI(title="t", docs_url=None, redoc_url=None)
    install_docs(app)
    client = TestClient(app)
    whole = client.get("/docs-assets/swagger-ui.css").content
    part = client.get("/docs-assets/swagger-ui.css", headers={"Range": "bytes=0-9"})
    assert part.status_code == 206 and part.content == whole[:10]
