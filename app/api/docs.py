"""``/docs`` with Swagger UI served from the package (``app/api/static/swagger-ui``).

FastAPI's default page loads Swagger UI from a CDN, so offline it is blank. Create the app
with ``docs_url=None, redoc_url=None`` (ReDoc loads from a CDN too) and call ``install_docs``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from app.api.errors import error_body, http_error_code

SWAGGER_UI_DIR = Path(__file__).parent / "static" / "swagger-ui"
ASSETS_PATH = "/docs-assets"


def install_docs(app: FastAPI, path: str = "/docs") -> None:
    """Serve Swagger UI at ``path`` and its assets under ``/docs-assets``, both offline."""
    if app.docs_url is not None:
        raise ValueError("create the app with docs_url=None: install_docs serves the docs page itself")
    app.mount(ASSETS_PATH, StaticAssets(JsonErrors(StaticFiles(directory=SWAGGER_UI_DIR))), name="docs-assets")

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


class StaticAssets:
    """Only the package's own asset files, whole: any other path is a 404 before the file
    system is asked (a NUL or an undecodable name made older Starlettes answer 500), and
    ``Range`` is ignored (Starlette answers any number of ranges; these files are small)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.names = frozenset(p.name for p in SWAGGER_UI_DIR.iterdir() if p.is_file())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path, root = scope["path"], scope.get("root_path", "")
            name = path[len(root):] if root and path.startswith(root) else path
            if name.lstrip("/") not in self.names:
                await JSONResponse(error_body(http_error_code(404), "no such asset"), status_code=404)(
                    scope, receive, send)
                return
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() not in (b"range", b"if-range")]}
        await self.app(scope, receive, send)


class JsonErrors:
    """An ASGI app's error answers (Starlette's static files answer a bad ``Range`` in plain
    text) in the JSON error shape; everything else passes through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        error_start: dict | None = None
        text = b""

        async def send_json_errors(message: dict) -> None:
            nonlocal error_start, text
            if message["type"] == "http.response.start" and message["status"] >= 400:
                error_start = message
                return
            if error_start is None:
                await send(message)
                return
            text += message.get("body", b"")
            if message.get("more_body", False):
                return
            status = error_start["status"]
            reason = text.decode("utf-8", "replace").strip() or f"HTTP {status}"
            body = json.dumps(error_body(http_error_code(status), reason)).encode()
            kept = [(k, v) for k, v in error_start.get("headers", []) if k.lower() not in (b"content-type",
                                                                                           b"content-length")]
            headers = [*kept, (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, send_json_errors)
