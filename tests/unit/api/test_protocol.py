"""``uvicorn_options``: what the server passes to uvicorn (the behaviour is in tests/e2e/test_hostile_http.py)."""

from __future__ import annotations

import pickle

import uvicorn
from fastapi import FastAPI

from app.api.protocol import HttpLimits, JsonHttpToolsProtocol, uvicorn_options
from app.config import Settings


def test_options_load_into_uvicorn_and_survive_a_trip_to_a_worker_process():
    limits = HttpLimits(max_head_bytes=1234, keep_alive_s=7)
    options = uvicorn_options(Settings(), limits)
    config = uvicorn.Config(FastAPI(), **options)
    config.load()
    assert config.http_protocol_class.func is JsonHttpToolsProtocol  # type: ignore[attr-defined]
    assert config.timeout_keep_alive == 7 and config.h11_max_incomplete_event_size == 1234
    assert config.ws_protocol_class is None
    # uvicorn's worker processes receive the config pickled (spawn): the protocol must pickle.
    revived = pickle.loads(pickle.dumps(options["http"]))
    assert revived.func is JsonHttpToolsProtocol and revived.keywords == {"limits": limits}
