"""Every error a request can meet has a gRPC status code that says what its HTTP status says."""

from __future__ import annotations

import pytest

from app.api.errors import STATUS_BY_ERROR, status_for
from app.api.grpc.errors import grpc_code_for
from app.errors import (
    HeadersTooLarge,
    HttpVersionNotSupported,
    NotSupported,
    ReadTimeout,
    SharedMemoryError,
    UriTooLong,
    YolopipeError,
)

# HTTP/1.1 framing: answered by the HTTP protocol layer before a route runs; gRPC never meets them.
HTTP_ONLY = {ReadTimeout, UriTooLong, HeadersTooLarge, HttpVersionNotSupported}
CODE_OF_STATUS = {400: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT",
                  413: "RESOURCE_EXHAUSTED", 404: "NOT_FOUND", 501: "UNIMPLEMENTED", 499: "CANCELLED",
                  503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


@pytest.mark.parametrize("error", sorted(set(STATUS_BY_ERROR) - HTTP_ONLY, key=lambda c: c.__name__))
def test_each_error_has_the_code_of_its_http_status(error):
    expected = "UNIMPLEMENTED" if error is NotSupported else CODE_OF_STATUS[status_for(error("x"))]  # Triton's pair
    assert grpc_code_for(error("x")) == expected


def test_a_subclass_takes_its_parents_code_and_the_unknown_are_internal():
    class RegionGone(SharedMemoryError):
        pass

    assert grpc_code_for(RegionGone("x")) == "INVALID_ARGUMENT"
    assert grpc_code_for(YolopipeError("x")) == "INTERNAL"
