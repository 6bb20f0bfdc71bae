"""``/docs`` with Swagger UI served from the package (``app/api/static/swagger-ui``).

FastAPI's default page loads Swagger UI from a CDN, so offline it is blank. Create the app
with ``docs_url=None, redoc_url=None`` (ReDoc loads from a CDN too) and call ``install_docs``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

SWAGGER_UI_DIR = Path(__file__).parent / "static" / "swagger-ui"
ASSETS_PATH = "/docs-assets"


def install_docs(app: FastAPI, path: str = "/docs") -> None:
    """Serve Swagger UI at ``path`` and its assets under ``/docs-assets``, both offline."""
    if app.docs_url is not None:
        raise ValueError("create the app with docs_url=None: install_docs serves the docs page itself")
    app.mount(ASSETS_PATH, StaticFiles(directory=SWAGGER_UI_DIR), name="docs-assets")

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=root + (app.openapi_url or "/openapi.json"),
            title=f"{app.title} — API",
            swagger_js_url=f"{root}{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_PATH}/favicon-32x32.png",
        )

    app.add_api_route(path, swagger_ui, methods=["GET"], include_in_schema=False)
