"""The one place where errors become gRPC status codes (as ``app/api/errors.py`` is for HTTP).

The ``app.errors`` family, by the name of its ``grpc.StatusCode``: anything wrong with a request
is INVALID_ARGUMENT, over a limit RESOURCE_EXHAUSTED, overloaded (or starting, or a failed
inference worker) UNAVAILABLE, too late DEADLINE_EXCEEDED. Looked up along the exception's
MRO, so a subclass inherits its parent's code; anything else is INTERNAL.
"""

from __future__ import annotations

from app.errors import (
    BadRequest,
    ClientDisconnected,
    DeviceError,
    ImageTooLarge,
    InvalidImage,
    InvalidParameter,
    MethodNotImplemented,
    ModelNotFound,
    NotSupported,
    Overloaded,
    RequestTimeout,
    SharedMemoryError,
    UnsupportedMediaType,
    YolopipeError,
)

GRPC_CODE_BY_ERROR: dict[type[YolopipeError], str] = {
    InvalidImage: "INVALID_ARGUMENT",
    UnsupportedMediaType: "INVALID_ARGUMENT",
    InvalidParameter: "INVALID_ARGUMENT",
    SharedMemoryError: "INVALID_ARGUMENT",
    BadRequest: "INVALID_ARGUMENT",
    ImageTooLarge: "RESOURCE_EXHAUSTED",
    ModelNotFound: "NOT_FOUND",
    Overloaded: "UNAVAILABLE",
    DeviceError: "UNAVAILABLE",
    RequestTimeout: "DEADLINE_EXCEEDED",
    MethodNotImplemented: "UNIMPLEMENTED",
    NotSupported: "UNIMPLEMENTED",
    ClientDisconnected: "CANCELLED",
}


def grpc_code_for(exc: YolopipeError) -> str:
    """The name of the ``grpc.StatusCode`` member for an error."""
    for cls in type(exc).__mro__:
        if cls in GRPC_CODE_BY_ERROR:
            return GRPC_CODE_BY_ERROR[cls]
    return "INTERNAL"
