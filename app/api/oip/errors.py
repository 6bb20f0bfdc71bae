"""Errors under ``/v2`` in the protocol's shape, ``{"error": "message"}``.

Everything else in the service answers ``{"error": {"code", "message"}}`` (``app/api/errors.py``,
the one status mapping). This pure ASGI middleware rewrites those JSON error bodies for
``/v2`` paths only, so the routes raise ``app.errors`` as ``/v1``'s do, and the errors answered
before a route runs (the body limit's 413, an unknown path's 404, a 405) take the shape too.
"""

from __future__ import annotations

import json
from typing import Any

PREFIX = "/v2"


class OipErrorShapeMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        chunks: list[bytes] = []

        async def reshaping_send(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400 and _is_json(message):
                start = message  # held until its (small) body is complete
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = reshape(b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaping_send)


def reshape(body: bytes) -> bytes:
    """``{"error": {"code", "message"}}`` → ``{"error": message}``; any other body as it was."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return json.dumps({"error": error["message"]}).encode()
    return body


def _is_json(start: dict) -> bool:
    for key, value in start.get("headers", []):
        if key.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"application/json"
    return False
