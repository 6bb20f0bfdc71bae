"""Settings that depend on one another: the gRPC port follows the HTTP port unless given."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.settings import Settings


@pytest.fixture(autouse=True)
def _no_grpc_port_variable(monkeypatch):
    monkeypatch.delenv("YOLOPIPE_GRPC_PORT", raising=False)  # tests/conftest.py sets it to 0
    monkeypatch.delenv("YOLOPIPE_PORT", raising=False)


def test_the_grpc_port_defaults_to_the_http_port_plus_one(monkeypatch):
    assert (Settings().port, Settings().grpc_port) == (8000, 8001)  # Triton's pair
    assert Settings(port=9000).grpc_port == 9001
    monkeypatch.setenv("YOLOPIPE_PORT", "9100")
    assert Settings().grpc_port == 9101


def test_a_grpc_port_given_wins_and_0_turns_grpc_off(monkeypatch):
    assert Settings(port=9000, grpc_port=7000).grpc_port == 7000
    assert Settings(port=9000, grpc_port=0).grpc_port == 0
    monkeypatch.setenv("YOLOPIPE_GRPC_PORT", "7777")
    assert Settings(port=9000).grpc_port == 7777
    monkeypatch.setenv("YOLOPIPE_GRPC_PORT", "0")
    assert Settings(port=9000).grpc_port == 0
    assert "grpc_port" in Settings().model_fields_set  # given (the supervisor's message says so)
    monkeypatch.delenv("YOLOPIPE_GRPC_PORT")
    assert "grpc_port" not in Settings().model_fields_set


def test_the_last_port_leaves_no_default_grpc_port():
    with pytest.raises(ValidationError, match=r"--port \+ 1 = 65536.*--grpc-port N, or --grpc-port 0"):
        Settings(port=65535)
    assert Settings(port=65535, grpc_port=0).grpc_port == 0
    assert Settings(port=65535, grpc_port=8001).grpc_port == 8001
    for bad in (-1, 65536):
        with pytest.raises(ValidationError):
            Settings(grpc_port=bad)
