"""The one table from the ``app.errors`` family to the statuses an error leaves with: its HTTP
status (``app/api/errors.py`` writes the response) and its ``grpc.StatusCode``, by name
(``app/api/grpc/service.py`` aborts with it). Looked up along the exception's MRO, so a subclass
inherits its parent's; anything else is 500 and INTERNAL. No web framework here: a gRPC worker
imports it without FastAPI.

gRPC: anything wrong with a request is INVALID_ARGUMENT, over a limit RESOURCE_EXHAUSTED,
overloaded (or starting, or a failed inference worker) UNAVAILABLE, too late DEADLINE_EXCEEDED.
"""

from __future__ import annotations

from app.errors import (
    BadRequest,
    ClientDisconnected,
    DeviceError,
    HeadersTooLarge,
    HttpVersionNotSupported,
    ImageTooLarge,
    InvalidImage,
    InvalidParameter,
    MethodNotImplemented,
    ModelNotFound,
    NotSupported,
    Overloaded,
    ReadTimeout,
    RequestTimeout,
    SharedMemoryError,
    UnsupportedMediaType,
    UriTooLong,
    YolopipeError,
)

# error → (HTTP status, gRPC status code)
STATUSES: dict[type[YolopipeError], tuple[int, str]] = {
    InvalidImage: (400, "INVALID_ARGUMENT"),
    UnsupportedMediaType: (415, "INVALID_ARGUMENT"),
    ImageTooLarge: (413, "RESOURCE_EXHAUSTED"),
    InvalidParameter: (422, "INVALID_ARGUMENT"),
    SharedMemoryError: (400, "INVALID_ARGUMENT"),
    ModelNotFound: (404, "NOT_FOUND"),
    NotSupported: (400, "UNIMPLEMENTED"),  # Triton's pair: UNSUPPORTED is a 400 over HTTP
    Overloaded: (503, "UNAVAILABLE"),
    RequestTimeout: (504, "DEADLINE_EXCEEDED"),
    DeviceError: (503, "UNAVAILABLE"),
    BadRequest: (400, "INVALID_ARGUMENT"),
    MethodNotImplemented: (501, "UNIMPLEMENTED"),
    # HTTP/1.1 itself (app/api/protocol.py answers these before a route runs; gRPC never meets them)
    ReadTimeout: (408, "DEADLINE_EXCEEDED"),
    UriTooLong: (414, "INVALID_ARGUMENT"),
    HeadersTooLarge: (431, "RESOURCE_EXHAUSTED"),
    HttpVersionNotSupported: (505, "UNIMPLEMENTED"),
    # nginx's "client closed request": never sent (nobody is listening), only counted in /metrics
    ClientDisconnected: (499, "CANCELLED"),
}
_UNEXPECTED = (500, "INTERNAL")


def _statuses(exc: YolopipeError) -> tuple[int, str]:
    for cls in type(exc).__mro__:
        if cls in STATUSES:
            return STATUSES[cls]
    return _UNEXPECTED


def status_for(exc: YolopipeError) -> int:
    """The HTTP status of an error."""
    return _statuses(exc)[0]


def grpc_code_for(exc: YolopipeError) -> str:
    """The name of the ``grpc.StatusCode`` member for an error."""
    return _statuses(exc)[1]
