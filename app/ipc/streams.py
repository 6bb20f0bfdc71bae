"""Video streams in ``serve``: the HTTP workers' side of the inference workers' stream host.

Each inference worker runs its streams itself (``app.service.inference.streams``: it owns the detector)
and listens for their control on a socket of its own beside the image socket, so the image
path is untouched. Every message is one ``wire.STREAM`` frame holding a JSON object: a request
(``{"op": "add" | "list" | "delete" | "events", ...}``), then one answer (``{"ok": ...}`` or
``{"error": {"code", "message"}}``); after ``events`` the worker sends one ``{"event": ...}``
per processed frame until the stream ends (``{"end": state}``) or the connection closes. An
event is written once, as JSON text, by the worker; the HTTP worker passes that text on.

A stream id names its worker (``"<worker>-<n>"``), so any HTTP worker can route to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from app.errors import InvalidParameter, Overloaded
from app.ipc import wire
from app.ipc.layout import RunLayout
from app.settings import Settings
from app.source_urls import MAX_SOURCE_CHARS, check_characters, parse_url

# What a client may ask a server to open: network video only; files only under an allowed root.
STREAM_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "srt://")


def stream_socket(layout: RunLayout, worker: int) -> Path:
    return layout.root / f"worker-{worker}.streams.sock"


def check_stream_source(source: str, settings: Settings) -> str:
    """What a server opens for ``source``, checked and normalised once (``app.source_urls``):
    a URL of an allowed scheme, or a file under ``settings.stream_files_root`` (no file at all
    when that is unset) as its resolved path; else ``InvalidParameter`` saying why. The answer
    is what is opened, listed and logged (``redact``ed), and checking it again gives it back."""
    if not isinstance(source, str) or not source:
        raise InvalidParameter("source must be a URL or file path of at most 2048 characters")
    if len(source) > MAX_SOURCE_CHARS:
        raise InvalidParameter(f"source must be at most {MAX_SOURCE_CHARS} characters")
    check_characters(source)
    if "://" in source:
        if f"{source.partition('://')[0].lower()}://" not in STREAM_SCHEMES:
            raise InvalidParameter(f"source scheme not allowed; use one of {', '.join(STREAM_SCHEMES)}")
        return str(parse_url(source))
    if source.startswith(("-", "|")):
        raise InvalidParameter(f"source scheme not allowed; use one of {', '.join(STREAM_SCHEMES)}")
    root = settings.stream_files_root
    if root is None:
        raise InvalidParameter("file sources are disabled on this server (set YOLOPIPE_STREAM_FILES_ROOT to allow "
                               "files under one folder); use an rtsp:// or http(s):// URL")
    root = Path(root).resolve()
    path = (root / source).resolve()  # an absolute source replaces root, then must still lie under it
    if not path.is_relative_to(root) or not path.is_file():
        raise InvalidParameter(f"no video file {source!r} under the allowed folder")
    return str(path)


def worker_of(stream_id: str, workers: int) -> int | None:
    head, _, tail = stream_id.partition("-")
    if not (head.isdigit() and tail.isdigit()) or int(head) >= workers:
        return None
    return int(head)


class StreamsClient:
    """Asks the inference workers' stream hosts; one short connection per request."""

    def __init__(self, layout: RunLayout) -> None:
        self.layout = layout

    async def _open(self, worker: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_unix_connection(str(stream_socket(self.layout, worker)))
        except OSError:
            raise Overloaded(f"inference worker {worker} is not ready for streams; retry shortly") from None

    @staticmethod
    async def _read_body(reader: asyncio.StreamReader) -> bytes | None:
        try:
            head = await reader.readexactly(wire.FRAME.size)
            length, _kind = wire.FRAME.unpack(head)
            return await reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    async def _read(self, reader: asyncio.StreamReader) -> dict[str, Any] | None:
        body = await self._read_body(reader)
        return None if body is None else wire.read_stream_message(body)

    async def ask(self, worker: int, message: dict[str, Any]) -> dict[str, Any]:
        reader, writer = await self._open(worker)
        try:
            writer.write(wire.stream_message(message))
            await writer.drain()
            answer = await self._read(reader)
        finally:
            writer.close()
        if answer is None:
            raise Overloaded(f"inference worker {worker} closed the stream connection; retry shortly")
        if "error" in answer:
            raise wire.error_from_code(answer["error"]["code"], answer["error"]["message"])
        return answer

    async def list(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for worker in range(self.layout.workers):
            found += (await self.ask(worker, {"op": "list"}))["streams"]
        return found

    async def add(self, source: str, *, vid_stride: int, track: bool) -> dict[str, Any]:
        """On the worker running the fewest streams."""
        counts = []
        for worker in range(self.layout.workers):
            counts.append((len((await self.ask(worker, {"op": "list"}))["streams"]), worker))
        worker = min(counts)[1]
        answer = await self.ask(worker, {"op": "add", "source": source, "vid_stride": vid_stride, "track": track})
        return answer["stream"]

    async def delete(self, worker: int, stream_id: str) -> bool:
        return bool((await self.ask(worker, {"op": "delete", "id": stream_id}))["ok"])

    async def get(self, worker: int, stream_id: str) -> dict[str, Any] | None:
        return next((s for s in (await self.ask(worker, {"op": "list"}))["streams"] if s["id"] == stream_id), None)

    async def events(self, worker: int, stream_id: str) -> AsyncIterator[tuple[str, str]] | None:
        """``("event", JSON text)`` per processed frame of the stream, the text as the worker wrote
        it, then ``("end", '{"end": state}')`` when the stream ends; ``None`` when the worker has no
        such stream."""
        reader, writer = await self._open(worker)
        writer.write(wire.stream_message({"op": "events", "id": stream_id}))
        await writer.drain()
        first = await self._read(reader)
        if first is None or not first.get("ok"):
            writer.close()
            return None

        async def frames() -> AsyncIterator[tuple[str, str]]:
            try:
                while (body := await self._read_body(reader)) is not None:
                    event = wire.stream_event_text(body)
                    if event is None:  # after the events, the one other message: the end
                        yield "end", body.decode()
                        return
                    yield "event", event
            finally:
                writer.close()

        return frames()
