"""``/v1/streams``: video streams the inference workers run, added and removed at runtime.

``POST`` checks the source here (``app.ipc.streams.check_stream_source``: URLs of an allowed
scheme; files only under ``stream_files_root``) and again in the worker; ``events`` is
Server-Sent Events, one ``data:`` line per processed frame, the last one ``event: end``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from app.api.routes import InferenceDep, SettingsDep, no_query
from app.api.schemas import ErrorResponse
from app.ipc.client import InferenceClient
from app.ipc.streams import StreamsClient, check_stream_source, worker_of

streams_router = APIRouter(prefix="/v1/streams", tags=["streams"], dependencies=[Depends(no_query)])

STREAM_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "a body that is not JSON"},
    404: {"model": ErrorResponse, "description": "no such stream"},
    413: {"model": ErrorResponse, "description": "a body over YOLOPIPE_MAX_STREAM_BODY_BYTES"},
    422: {"model": ErrorResponse, "description": "a source this server may not open (a control character or "
                                                 "whitespace in it, a scheme or file not allowed), an unknown field, "
                                                 "or too many streams"},
    503: {"model": ErrorResponse, "description": "the inference workers are starting or restarting, or removed "
                                                 "streams are still closing their sources"},
}


class StreamRequest(BaseModel):
    # A field this API does not know (a typo such as "vid_strde") or a value of another type is
    # a 422 naming it, never silently a default.
    model_config = ConfigDict(extra="forbid", strict=True)

    source: str = Field(description="rtsp://, rtsps://, rtmp://, http(s):// or srt:// URL; a file path only "
                                    "under the server's YOLOPIPE_STREAM_FILES_ROOT", max_length=2048)
    vid_stride: int = Field(1, ge=1, le=1000, description="detect on every N-th frame")
    track: bool = Field(False, description="add a ByteTrack track_id to each detection")


def _client(inference: InferenceClient) -> StreamsClient:
    return StreamsClient(inference.layout)


def _worker(stream_id: str, inference: InferenceClient) -> int:
    worker = worker_of(stream_id, inference.layout.workers)
    if worker is None:
        raise HTTPException(404)
    return worker


@streams_router.post("", status_code=201, responses=STREAM_ERRORS)
async def add_stream(body: StreamRequest, inference: InferenceDep, settings: SettingsDep) -> dict[str, Any]:
    """Start a stream; the answer holds its ``id`` and state."""
    source = check_stream_source(body.source, settings)
    return await _client(inference).add(source, vid_stride=body.vid_stride, track=body.track)


@streams_router.get("", responses=STREAM_ERRORS)
async def list_streams(inference: InferenceDep) -> dict[str, Any]:
    """Every stream with its state, fps, drops, reconnects and latency percentiles."""
    return {"streams": await _client(inference).list()}


@streams_router.get("/{stream_id}", responses=STREAM_ERRORS)
async def get_stream(stream_id: str, inference: InferenceDep) -> dict[str, Any]:
    found = await _client(inference).get(_worker(stream_id, inference), stream_id)
    if found is None:
        raise HTTPException(404)
    return found


@streams_router.delete("/{stream_id}", status_code=204, responses=STREAM_ERRORS)
async def delete_stream(stream_id: str, inference: InferenceDep) -> None:
    if not await _client(inference).delete(_worker(stream_id, inference), stream_id):
        raise HTTPException(404)


@streams_router.get("/{stream_id}/events", responses=STREAM_ERRORS,
                    response_class=StreamingResponse)
async def stream_events(stream_id: str, request: Request, inference: InferenceDep) -> StreamingResponse:
    """Server-Sent Events: one ``data:`` JSON object per processed frame (``stream``, ``frame``,
    ``time_s``, ``width``, ``height``, ``detections``, ``latency_ms``); ``event: end`` when the
    stream ends or is removed."""
    frames = await _client(inference).events(_worker(stream_id, inference), stream_id)
    if frames is None:
        raise HTTPException(404)

    async def sse() -> AsyncIterator[bytes]:
        async with aclosing(frames) as events:  # the worker's connection closes with the client's
            async for kind, text in events:  # each event's JSON text as the worker wrote it
                if await request.is_disconnected():
                    return
                if kind == "end":
                    yield f"event: end\ndata: {text}\n\n".encode()
                    return
                yield f"data: {text}\n\n".encode()

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})
