"""What ``/v1/detect`` and ``/v1/detect/batch`` do once a request's images and parameters are
read, whoever read them: FastAPI's routes (``app/api/routes.py``) or the hot path
(``app/api/hotpath``). No web framework here: images in, the answer's JSON bytes out.

Each image's header is checked before anything is decoded; the images go to the inference
workers; a client that hangs up meanwhile stops its work (what it left queued is never run:
``ClientDisconnected``, 499); the answer is written from the arrays (``app.records``, in the
compact form Starlette's ``JSONResponse`` writes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from app.api.errors import image_error_fields
from app.api.metrics import Metrics
from app.api.uploads import check_request_images
from app.contracts import DetectedBatch, DetectParams
from app.errors import ClientDisconnected, InvalidParameter, Overloaded, YolopipeError
from app.imaging.check import check_image
from app.imaging.headers import ImageHeader
from app.ipc.answers import TIMES, Answers
from app.ipc.client import SERVER_SIDE, InferenceClient
from app.records import HTTP, records

Receive = Callable[[], Awaitable[dict[str, Any]]]  # the request's ASGI receive, its body read already
OnDisconnect = Callable[[Callable[[], None] | None], None]  # app.api.protocol.ON_DISCONNECT


async def detect_one(inference: InferenceClient, metrics: Metrics, receive: Receive, name: str, data: bytes,
                     params: DetectParams, max_pixels: int, start: float,
                     on_disconnect: OnDisconnect | None = None) -> bytes | Overloaded:
    """``/v1/detect``'s answer to one image read at ``start`` (``time.perf_counter``), or the
    ``Overloaded`` refusal to answer unlogged (under overload there are thousands a second)."""
    header = check_image(data, max_pixels=max_pixels)  # format, size and memory, before any decode
    answered = await detect_images(inference, metrics, receive, [data], [header], params, on_disconnect)
    if isinstance(answered, Overloaded):
        return answered
    batch, timings = _answered_images(answered, (time.perf_counter() - start) * 1e3)
    if batch.errors:
        raise batch.errors[0]
    return _image_records([name], batch, timings, inference.info["class_names"])[0].encode()


async def detect_many(inference: InferenceClient, metrics: Metrics, receive: Receive,
                      images: list[tuple[str, bytes]], params: DetectParams, max_pixels: int,
                      start: float, on_disconnect: OnDisconnect | None = None) -> bytes | Overloaded:
    """``/v1/detect/batch``'s answer: each image's record in request order, an image that fails
    answered in its place; or the ``Overloaded`` refusal of the whole request."""
    # Each header is checked (format, size, memory, the request's pixel budget) before anything is
    # decoded; images that fail are answered here, in their places, the rest go to the inference workers.
    checked = check_request_images([data for _, data in images], max_pixels=max_pixels)
    refused = [i for i, c in enumerate(checked) if isinstance(c, YolopipeError)]
    sent = [i for i, c in enumerate(checked) if not isinstance(c, YolopipeError)]
    answered = await detect_images(inference, metrics, receive, [images[i][1] for i in sent],
                                   [checked[i] for i in sent], params, on_disconnect) if sent else None  # type: ignore[misc]
    if isinstance(answered, Overloaded):
        return answered
    total_ms = (time.perf_counter() - start) * 1e3
    # The answered images, then the refused ones, each put back in its place in the request.
    parts = [DetectedBatch.failed([checked[i] for i in refused])]  # type: ignore[misc]
    timings = [""] * len(images)
    if answered is not None:
        detected, texts = _answered_images(answered, total_ms)
        parts.insert(0, detected)
        for i, text in zip(sent, texts):
            timings[i] = text
    batch = DetectedBatch.concat(parts).take(np.argsort(sent + refused))
    results = _image_records([name for name, _ in images], batch, timings, inference.info["class_names"])
    return ('{"results":[' + ",".join(results) + '],' + HTTP.fields(timings={"total_ms": round(total_ms, 3)})
            + "}").encode()


def one_image(images: list[tuple[str, bytes]]) -> tuple[str, bytes]:
    """The one image a multipart ``/v1/detect`` body holds."""
    if len(images) != 1:
        raise InvalidParameter(f"send one file in field 'image' (got {len(images)}); use /v1/detect/batch for more")
    return images[0]


async def detect_images(inference: InferenceClient, metrics: Metrics, receive: Receive, images: list[bytes],
                        headers: list[ImageHeader], params: DetectParams,
                        on_disconnect: OnDisconnect | None = None) -> Answers | Overloaded:
    """The images' answers, or the ``Overloaded`` refusal of a request refused under load. A
    client that hangs up meanwhile stops its work: what it left queued is never run
    (``ClientDisconnected``, 499). The server tells of a hang-up through ``on_disconnect``
    where it offers it (``app.api.protocol.ON_DISCONNECT``), else a watcher task waits for it in
    ``receive``; either cancels this task, and the inference client stops the request's queued
    work when cancelled."""
    task = asyncio.current_task()
    gone = False

    def went_away() -> None:
        nonlocal gone
        gone = True
        task.cancel()  # type: ignore[union-attr]

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        went_away()

    if on_disconnect is not None:
        on_disconnect(went_away)
        watcher = None
    else:
        watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await inference.detect(images, params, headers)
    except asyncio.CancelledError:
        if not gone:  # this handler was cancelled (the server stops): so is the work
            raise
        task.uncancel()  # type: ignore[union-attr]
        raise ClientDisconnected("the client went away before its answer") from None
    except SERVER_SIDE as exc:
        metrics.rejected.labels(exc.code).inc()
        if isinstance(exc, Overloaded):
            return exc.with_traceback(None)  # its traceback would hold this frame, and it ``images``
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
        else:
            on_disconnect(None)  # type: ignore[misc]


_timings_field = HTTP.floats_field("timings", [*TIMES, "total_ms"])  # an image's times and the request's, in ms
_THREES = (3,) * len(TIMES)  # each time rounded to the µs, as round(v, 3)


def _answered_images(answered: Answers, total_ms: float) -> tuple[DetectedBatch, list[str]]:
    """The request's detections, and each answered image's ``timings`` field (none for one that
    failed): its times and its batch's (``Answers.times``), then the request's total. The one
    reader of ``Answers`` here."""
    failed = answered.detected.errors
    total = round(total_ms, 3)
    timings = ["" if i in failed else _timings_field((*map(round, times, _THREES), total))
               for i, times in enumerate(answered.times())]
    return answered.detected, timings


def _image_records(names: list[str], batch: DetectedBatch, timings: list[str], class_names: list[str]) -> list[str]:
    """Each image's JSON object: a line of ``predict`` plus its ``timings``, or, for an image that
    failed, its error with the status it would have alone."""
    return records(['"image":' + HTTP.dumps(name) for name in names], batch, class_names, tails=timings, style=HTTP,
                   error_fields=image_error_fields)
