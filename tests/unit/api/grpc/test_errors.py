"""Every error a request can meet has a gRPC status code that says what its HTTP status says:
one table (``app/api/statuses.py``) gives both."""

from __future__ import annotations

import pytest

from app.api.statuses import STATUSES, grpc_code_for, status_for
from app.errors import NotSupported, SharedMemoryError, YolopipeError

CODE_OF_STATUS = {400: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT", 414: "INVALID_ARGUMENT",
                  413: "RESOURCE_EXHAUSTED", 431: "RESOURCE_EXHAUSTED", 404: "NOT_FOUND", 501: "UNIMPLEMENTED",
                  505: "UNIMPLEMENTED", 499: "CANCELLED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
                  408: "DEADLINE_EXCEEDED"}


@pytest.mark.parametrize("error", sorted(STATUSES, key=lambda c: c.__name__))
def test_each_error_has_the_code_of_its_http_status(error):
    expected = "UNIMPLEMENTED" if error is NotSupported else CODE_OF_STATUS[status_for(error("x"))]  # Triton's pair
    assert grpc_code_for(error("x")) == expected


def test_a_subclass_takes_its_parents_statuses_and_the_unknown_are_internal():
    class RegionGone(SharedMemoryError):
        pass

    assert (status_for(RegionGone("x")), grpc_code_for(RegionGone("x"))) == (400, "INVALID_ARGUMENT")
    assert (status_for(YolopipeError("x")), grpc_code_for(YolopipeError("x"))) == (500, "INTERNAL")
