"""What HTTP workers and inference workers say to each other, byte for byte.

Image bytes never travel on the socket: an HTTP worker copies them into its shared-memory
ring (``app.ipc.ring``) and sends a descriptor (``IMAGE``: where the bytes are, the
request's parameters and deadline). The inference worker answers each image exactly once
(``RESULTS``: detections as float32 rows, or an error code), which is also when the HTTP
worker may reuse that part of its ring. The ring was chosen by measurement against sending the
bytes inline on the socket and pyzmq: per 230 KB message the server spent 17-23 µs of CPU with the
ring, 215-240 µs inline, 109-145 µs with pyzmq (bench/results/2026-11-30-cpu-2core-ipc-roundtrip.json).

Every frame is ``<u32 body length><u8 kind><body>``. Each inference worker also publishes its
load in a small shared status block (``StatusBlock``), which every HTTP worker reads to route
to the least loaded worker and to refuse at once what would not finish in time.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import errors
from app.contracts import DetectParams
from app.errors import YolopipeError
from app.imaging.headers import ImageHeader, JpegHeader

FRAME = struct.Struct("<IB")
HELLO, IMAGE, CANCEL, RESULTS = 1, 2, 3, 4
STREAM = 5  # video streams' control and events, on their own socket (app.ipc.streams)

# req_id, index, ring offset, length, deadline (time.monotonic, shared by the host's processes),
# conf, iou, max_det, agnostic, number of class ids (then that many int32)
_IMAGE = struct.Struct("<QIQIdddIBH")
# Then the header the HTTP worker read (so the inference worker never parses it again): format
# (0: none sent), height, width, channels, bits, work bytes; a JPEG's components, precision,
# coding flags (progressive 1, arithmetic 2, lossless 4), orientation, scans, and the chroma
# sampling factors of its first four components (as in its frame header: horizontal << 4 | vertical).
_HEADER = struct.Struct("<BIIBBQBBBBI4s")
_MAX_SAMPLED = 4
_FORMATS = ("", "jpeg", "png", "bmp", "tiff", "webp")
_CANCEL = struct.Struct("<Q")


def frame(kind: int, body: bytes) -> bytes:
    return FRAME.pack(len(body), kind) + body


class FrameReader:
    """Splits a byte stream into ``(kind, body)`` frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The frames completed by ``data`` (bodies are small: descriptors and results)."""
        buf = self._buf
        buf += data
        frames = []
        pos, end = 0, len(buf)
        while end - pos >= FRAME.size:
            length, kind = FRAME.unpack_from(buf, pos)
            start = pos + FRAME.size
            if end - start < length:
                break
            frames.append((kind, bytes(buf[start : start + length])))
            pos = start + length
        del buf[:pos]
        return frames


# --- HTTP worker → inference worker -------------------------------------------------------
def stream_message(message: dict[str, Any]) -> bytes:
    return frame(STREAM, json.dumps(message).encode())


_EVENT_HEAD = b'{"event": '


def stream_event(event_json: str) -> bytes:
    """``stream_message({"event": event})`` for an event already written as JSON text."""
    return frame(STREAM, _EVENT_HEAD + event_json.encode() + b"}")


def stream_event_text(body: bytes) -> str | None:
    """A ``stream_event`` body's event, the JSON text as it was written (passed on, never parsed);
    None for another message."""
    return bytes(body[len(_EVENT_HEAD) : -1]).decode() if body.startswith(_EVENT_HEAD) else None


def read_stream_message(body: bytes) -> dict[str, Any]:
    return json.loads(bytes(body))


def hello(info: dict[str, Any]) -> bytes:
    return frame(HELLO, json.dumps(info).encode())


def read_hello(body: bytes) -> dict[str, Any]:
    return json.loads(bytes(body))


@dataclass(slots=True)
class ImageRef:
    req_id: int
    index: int
    offset: int
    length: int
    deadline: float
    params: DetectParams
    header: ImageHeader | None = None  # as the HTTP worker read it


def image(ref: ImageRef) -> bytes:
    p = ref.params
    classes = p.classes or ()
    body = _IMAGE.pack(ref.req_id, ref.index, ref.offset, ref.length, ref.deadline, p.conf, p.iou, p.max_det,
                       p.agnostic, len(classes))
    if classes:
        body += struct.pack(f"<{len(classes)}i", *classes)
    return frame(IMAGE, body + _pack_header(ref.header))


def read_image(body: bytes) -> ImageRef:
    req_id, index, offset, length, deadline, conf, iou, max_det, agnostic, n = _IMAGE.unpack_from(body)
    # Parameters and headers repeat from image to image: the same bytes give the same
    # (immutable) objects, made once.
    params_at = _IMAGE.size - _PARAMS_SIZE
    header_at = _IMAGE.size + 4 * n
    key = bytes(body[params_at:header_at])
    params = _PARAMS.get(key)
    if params is None:
        classes = struct.unpack_from(f"<{n}i", body, _IMAGE.size) if n else None
        params = _remember(_PARAMS, key, DetectParams(conf, iou, max_det, classes, bool(agnostic)))
    key = bytes(body[header_at : header_at + _HEADER.size])
    if key in _HEADERS:
        header = _HEADERS[key]
    else:
        header = _remember(_HEADERS, key, _unpack_header(body, header_at))
    return ImageRef(req_id, index, offset, length, deadline, params, header)


_PARAMS_SIZE = struct.calcsize("<ddIBH")  # the end of _IMAGE: conf, iou, max_det, agnostic, class count
_PARAMS: dict[bytes, DetectParams] = {}
_HEADERS: dict[bytes, ImageHeader | None] = {}
_REMEMBERED = 1024  # distinct values kept per kind (a client sending ever new ones only refills it)


def _remember(cache: dict, key: bytes, value: Any) -> Any:
    if len(cache) >= _REMEMBERED:
        cache.clear()
    cache[key] = value
    return value


def _pack_header(h: ImageHeader | None) -> bytes:
    if h is None:
        return _HEADER.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, b"")
    j = h.jpeg
    flags = 0 if j is None else (j.progressive | j.arithmetic << 1 | j.lossless << 2 | j.needs_libjpeg << 3)
    sampling = b"" if j is None else bytes(hf << 4 | vf for hf, vf in j.sampling[:_MAX_SAMPLED])
    return _HEADER.pack(_FORMATS.index(h.format), h.height, h.width, h.channels, h.bits, h.work_bytes,
                        0 if j is None else j.components, 0 if j is None else j.precision, flags,
                        0 if j is None else j.orientation, 0 if j is None else j.scans, sampling)


def _unpack_header(body: bytes, pos: int) -> ImageHeader | None:
    fmt, height, width, channels, bits, work, comps, precision, flags, orientation, scans, sampled = \
        _HEADER.unpack_from(body, pos)
    if not fmt:
        return None
    jpeg = None
    if comps:
        sampling = tuple((b >> 4, b & 0x0F) for b in sampled[: min(comps, _MAX_SAMPLED)])
        jpeg = JpegHeader(height, width, comps, precision, progressive=bool(flags & 1), arithmetic=bool(flags & 2),
                          lossless=bool(flags & 4), sampling=sampling, orientation=orientation, scans=scans,
                          needs_libjpeg=bool(flags & 8))  # a defect never travels: check_image refused it
    return ImageHeader(_FORMATS[fmt], height, width, channels, bits, work, jpeg)


def cancel(req_id: int) -> bytes:
    return frame(CANCEL, _CANCEL.pack(req_id))


def read_cancel(body: bytes) -> int:
    return _CANCEL.unpack_from(body)[0]


# --- inference worker → HTTP worker (the RESULTS frames: app.ipc.answers) -----------------
def error_from_code(code: str, message: str) -> YolopipeError:
    """The ``app.errors`` class a code names (so its HTTP status survives the trip)."""
    cls = _errors_by_code().get(code, YolopipeError)
    return cls(message)


@functools.cache  # app.errors' classes are all defined when it is imported: walked once, not per error
def _errors_by_code() -> dict[str, type[YolopipeError]]:
    found: dict[str, type[YolopipeError]] = {}
    todo: list[type[YolopipeError]] = [YolopipeError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == errors.__name__:
            found.setdefault(cls.code, cls)
        todo += cls.__subclasses__()
    return found


# --- the load an inference worker publishes --------------------------------------------
STARTING, READY, DRAINING = 0, 1, 2
# generation, state, images admitted and unanswered, s/image, batches in flight (in the host's byte order)
_STATUS = struct.Struct("=QIIdI")
_STANDBY_AT = 48  # u32: the pid of the worker's warm standby, once it is ready
_PHASE_AT, _PHASE_MAX = 64, 256  # then a short text: the warm-up step of a starting worker


@dataclass(frozen=True)
class Load:
    generation: int
    state: int
    pending: int
    seconds_per_image: float
    in_flight: int

    def queued_s(self, more: int = 0) -> float:
        """Seconds until the admitted work (and ``more`` images) is done at the measured rate."""
        return queued_seconds(self.pending + more, self.seconds_per_image, self.in_flight)


def queued_seconds(images: int, seconds_per_image: float, in_flight: int) -> float:
    return images * seconds_per_image / max(in_flight, 1)


def over_budget(queued_s: float, budget_s: float, *, images: int = 1, ahead: int = 0) -> errors.Overloaded:
    if images > 1:
        return errors.Overloaded(f"this request's {images} images, behind {ahead} queued, would take about "
                                 f"{queued_s:.1f} s, over the {budget_s:g} s budget; retry shortly, or send fewer "
                                 "images per request")
    return errors.Overloaded(f"the queue holds {queued_s:.1f} s of work, over its {budget_s:g} s budget; retry shortly")


class StatusBlock:
    """A few numbers in a shared file: one writer (the inference worker), many readers.

    Each field is one aligned store, and a reader only needs each to be current, not the
    set to be consistent: it is a routing and admission hint; the worker re-checks. Fields are
    written through typed views, never with ``struct.pack_into``, which zero-fills the whole
    struct before writing it: a reader in another process would see a ready worker as starting."""

    def __init__(self, path: Path, *, writable: bool) -> None:
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if writable else os.O_RDONLY, 0o600)
        try:
            if writable and os.fstat(fd).st_size < mmap.PAGESIZE:
                os.ftruncate(fd, mmap.PAGESIZE)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._map = mmap.mmap(fd, mmap.PAGESIZE, prot=prot)
        finally:
            os.close(fd)
        self._views: list[memoryview] = []
        if writable:
            whole = memoryview(self._map)
            # The _STATUS fields, one view per type.
            self._generation = whole[0:8].cast("Q")
            self._u32 = whole[8:16].cast("I")  # state, pending
            self._seconds = whole[16:24].cast("d")
            self._in_flight = whole[24:28].cast("I")
            self._standby = whole[_STANDBY_AT : _STANDBY_AT + 4].cast("I")
            self._phase_len = whole[_PHASE_AT : _PHASE_AT + 2].cast("H")
            self._views = [self._generation, self._u32, self._seconds, self._in_flight, self._standby, self._phase_len,
                           whole]

    def write(self, load: Load) -> None:
        self._generation[0] = load.generation
        self._u32[0] = load.state
        self._u32[1] = load.pending
        self._seconds[0] = load.seconds_per_image
        self._in_flight[0] = load.in_flight

    def read(self) -> Load:
        return Load(*_STATUS.unpack_from(self._map, 0))

    def write_standby(self, pid: int) -> None:
        """The pid of this worker's warm standby (0: none ready). Written by the standby itself,
        a field the serving worker never writes."""
        self._standby[0] = pid

    def read_standby(self) -> int:
        return struct.unpack_from("=I", self._map, _STANDBY_AT)[0]

    def write_phase(self, text: str) -> None:
        """What a starting worker is doing (its warm-up step), for /readyz and /v1/model."""
        data = text.encode()[:_PHASE_MAX]
        self._phase_len[0] = 0  # a reader meanwhile sees no text rather than a mix of two
        self._map[_PHASE_AT + 2 : _PHASE_AT + 2 + len(data)] = data
        self._phase_len[0] = len(data)

    def read_phase(self) -> str:
        (n,) = struct.unpack_from("=H", self._map, _PHASE_AT)
        return bytes(self._map[_PHASE_AT + 2 : _PHASE_AT + 2 + min(n, _PHASE_MAX)]).decode(errors="replace")

    def close(self) -> None:
        for view in self._views:
            view.release()
        self._map.close()
