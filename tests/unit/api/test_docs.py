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


def _assets_client() -> TestClient:
    app = FastAPI(title="t", docs_url=None, redoc_url=None)
    install_docs(app)
    return TestClient(app)


@pytest.mark.parametrize("range_header", ["bytes=abc", "bytes=5-2", "items=0-1", "bytes=999999999-", "bytes=0-9",
                                          "bytes=" + ",".join(f"{i * 10}-{i * 10 + 5}" for i in range(101))])
def test_an_asset_is_served_whole_whatever_its_range(range_header):
    client = _assets_client()
    whole = client.get("/docs-assets/swagger-ui.css")
    r = client.get("/docs-assets/swagger-ui.css", headers={"Range": range_header, "If-Range": whole.headers["etag"]})
    assert r.status_code == 200 and r.content == whole.content and "content-range" not in r.headers


@pytest.mark.parametrize("path", ["/docs-assets/swagger-ui.css%00.png", "/docs-assets/%00", "/docs-assets/",
                                  "/docs-assets", "/docs-assets/nope.js", "/docs-assets/%C0%AF",
                                  "/docs-assets/" + "a" * 5000, "/docs-assets/swagger-ui.css/x",
                                  "/docs-assets/LICENSE%2F..%2F..%2Fdocs.py"])
def test_a_path_that_names_no_asset_is_a_json_404(path):
    r = _assets_client().get(path)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "not_found"


def test_another_method_on_an_asset_is_answered_in_the_json_error_shape():
    from app.service.http_worker import create_service_app

    r = TestClient(create_service_app()).post("/docs-assets/swagger-ui.css")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
