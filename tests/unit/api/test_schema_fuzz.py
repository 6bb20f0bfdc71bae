"""Schemathesis against the OpenAPI document, over ASGI with the real detector: no 5xx, and
every response (status, content type, body) conforms to the documented schema."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.service.http_worker import create_service_app
from app.settings import Settings

# Built at import without loading anything: the model loads in the app's lifespan, which
# schemathesis starts on the first call (and stops after each test). The schema comes from
# the app object itself, and calls go to it over ASGI. (``schemathesis.pytest.from_fixture``
# would be the natural loader, but it fails under pytest 9: "'Function' object has no attribute '_nodeid'".)
_app = create_service_app(Settings(backend="onnxruntime"))  # artifacts: pytest's temp folder (tests/conftest.py)
schema = schemathesis.openapi.from_dict(_app.openapi())
schema.app = _app
schema.location = "/openapi.json"


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_conforms_to_its_schema_without_server_errors(case):
    case.call_and_validate(
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    )
