"""The one place where errors become HTTP responses.

Every error leaves the service as ``{"error": {"code": ..., "message": ...}}``: yolopipe's own
``app.errors`` family (with the status ``app/api/statuses.py`` maps it to, the one table the
KServe v2 gRPC service's status codes come from too), FastAPI's request validation, Starlette's
HTTP errors (404, 405, a malformed multipart body) and, as a last resort, an unexpected
exception (500, no traceback).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.statuses import status_for
from app.errors import DeviceError, InvalidParameter, Overloaded, YolopipeError

log = logging.getLogger("yolopipe.api")

# Seconds a client should wait before retrying an error that is about load, not its request.
RETRY_AFTER_S: dict[type[YolopipeError], int] = {Overloaded: 1, DeviceError: 1}

# Codes for Starlette's own HTTP errors, so they read like ours.
_CODE_BY_HTTP_STATUS = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "image_too_large",
    415: "unsupported_media_type",
    416: "range_not_satisfiable",
    422: "invalid_parameter",
    503: "unavailable",
}


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def http_error_code(status: int) -> str:
    """The error code of an HTTP status that no exception of ours names (Starlette's own)."""
    return _CODE_BY_HTTP_STATUS.get(status, "http_error")


def error_response(exc: YolopipeError) -> JSONResponse:
    headers = {}
    for cls in type(exc).__mro__:
        if cls in RETRY_AFTER_S:
            headers["Retry-After"] = str(RETRY_AFTER_S[cls])
            break
    return JSONResponse(error_body(exc.code, str(exc)), status_code=status_for(exc), headers=headers)


def image_error_fields(exc: YolopipeError) -> dict[str, Any]:
    """One failed image inside a batch response, after its name: the status it would have alone and the error."""
    return {"status": status_for(exc), **error_body(exc.code, str(exc))}


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "body"))
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else str(err.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"


async def _yolopipe_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, YolopipeError)
    if status_for(exc) >= 500:
        log.warning("%s %s -> %s: %s", request.method, request.url.path, exc.code, exc)
    # Its traceback holds the route's frames, and they the request's body: Starlette before 0.51
    # keeps the exception in a frame of its own, a cycle that only a full collection would free.
    exc.__traceback__ = None
    return error_response(exc)


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(error_body(InvalidParameter.code, _validation_message(exc)), status_code=422)


async def _http_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = http_error_code(exc.status_code)
    return JSONResponse(
        error_body(code, str(exc.detail)), status_code=exc.status_code, headers=getattr(exc, "headers", None)
    )


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    # The traceback goes to the server log, never to the client.
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return unexpected_error_response()


def unexpected_error_response() -> JSONResponse:
    """The answer to an error nobody expected (500, no traceback)."""
    return JSONResponse(error_body("internal_error", "internal server error"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(YolopipeError, _yolopipe_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
