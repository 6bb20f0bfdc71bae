"""What the inference worker answers, as arrays: a batch's answers and their RESULTS frames.

A RESULTS body is the batch's timings (JSON), the record count, one ``RECORD`` per image, the
rows of every ok image (rows × 6 float32: x1, y1, x2, y2, score, class in source pixels, in
record order), then each failed image's error code and message (UTF-8, in record order):
fixed-size parts the inference worker writes from arrays (a ``DetectedBatch``'s, with each
image's request, index and waits: ``app.service.inference.answers``), a batch at a time, with
no object per image. An HTTP worker reads them back as arrays too, and gathers each request's
shares of the batches its images ran in into one ``RequestAnswers``: a ``DetectedBatch`` in the
request's order, what the formatters take.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np

from app.contracts import DetectedBatch
from app.errors import YolopipeError
from app.ipc.wire import RESULTS, Outcome, error_from_code, frame
from app.types import Detections

_ERROR_TEXT = struct.Struct("<BI")  # code and message lengths
# One record per answered image: req_id, index, ok, width, height, decode_ms, queue_ms, rows.
RECORD = np.dtype([("req_id", "<u8"), ("index", "<u4"), ("ok", "u1"), ("width", "<u4"), ("height", "<u4"),
                   ("decode_ms", "<f4"), ("queue_ms", "<f4"), ("rows", "<u4")])


@dataclass(slots=True)
class Answers:
    """Several images' answers as arrays (what the inference worker writes, a batch at a time):
    a ``RECORD`` per image, the rows of the ok ones in record order (x1, y1, x2, y2, score,
    class in source pixels), and each failed image's error by its position."""

    records: np.ndarray
    rows: np.ndarray
    errors: dict[int, YolopipeError]
    timings: dict[str, float]

    @classmethod
    def of(cls, outcomes: list[Outcome], timings: dict[str, float] | None = None) -> Answers:
        records = np.zeros(len(outcomes), RECORD)
        rows, errors = [], {}
        for i, o in enumerate(outcomes):
            if o.error is None:
                det = o.detections if o.detections is not None else Detections.empty()
                part = np.empty((len(det), 6), np.float32)
                part[:, :4], part[:, 4], part[:, 5] = det.boxes, det.scores, det.class_ids
                rows.append(part)
                records[i] = (o.req_id, o.index, 1, o.width, o.height, o.decode_ms, o.queue_ms, len(det))
            else:
                errors[i] = o.error
                records[i] = (o.req_id, o.index, 0, 0, 0, o.decode_ms, o.queue_ms, 0)
        return cls(records, np.concatenate(rows) if rows else np.empty((0, 6), np.float32), errors, timings or {})

    def split(self, groups: list[list[int]]) -> list[Answers]:
        """The answers at each group of positions (each owner's share of a batch), in that
        order: records and rows gathered once for all groups, then sliced."""
        order = np.concatenate([np.asarray(g, np.int64) for g in groups])
        counts = self.records["rows"].astype(np.int64)
        starts = np.cumsum(counts) - counts
        taken = counts[order]
        ends = np.cumsum(taken)
        rows = self.rows[np.repeat(starts[order] - (ends - taken), taken) + np.arange(int(ends[-1]) if len(ends) else 0)]
        records = self.records[order]
        out = []
        first = first_row = 0
        for group in groups:
            last = first + len(group)
            last_row = int(ends[last - 1]) if last else 0
            errors = {k: self.errors[p] for k, p in enumerate(group) if p in self.errors}
            out.append(Answers(records[first:last], rows[first_row:last_row], errors, self.timings))
            first, first_row = last, last_row
        return out

    def detected(self) -> DetectedBatch:
        """The same answers as the detector's arrays (views, no copy of the rows)."""
        return DetectedBatch(self.records["width"].astype(np.int64), self.records["height"].astype(np.int64),
                             self.records["rows"].astype(np.int64), self.rows, dict(self.errors))

def answers_frame(answers: Answers, timings_json: bytes | None = None) -> bytes:
    """One RESULTS frame; ``timings_json``: the batch's timings already encoded (shared by owners)."""
    timings = json.dumps(answers.timings).encode() if timings_json is None else timings_json
    parts = [struct.pack("<H", len(timings)), timings, struct.pack("<I", len(answers.records)),
             answers.records.tobytes(), np.ascontiguousarray(answers.rows, np.float32).tobytes()]
    for i in sorted(answers.errors):
        error = answers.errors[i]
        code, message = error.code.encode(), str(error).encode()
        parts += [_ERROR_TEXT.pack(len(code), len(message)), code, message]
    return frame(RESULTS, b"".join(parts))


def results(outcomes: list[Outcome], batch_timings: dict[str, float] | None = None) -> bytes:
    """One frame for several answers given one by one (errors, tests)."""
    return answers_frame(Answers.of(outcomes, batch_timings))


def read_answers(body: bytes) -> Answers:
    (n_timings,) = struct.unpack_from("<H", body)
    pos = 2 + n_timings
    timings = json.loads(bytes(body[2:pos])) if n_timings else {}
    (count,) = struct.unpack_from("<I", body, pos)
    pos += 4
    records = np.frombuffer(body, RECORD, count, pos)
    pos += records.nbytes
    n_rows = int(records["rows"].sum())
    rows = np.frombuffer(body, np.float32, n_rows * 6, pos).reshape(n_rows, 6)
    pos += rows.nbytes
    errors = {}
    for i in np.flatnonzero(records["ok"] == 0).tolist():
        n_code, n_msg = _ERROR_TEXT.unpack_from(body, pos)
        pos += _ERROR_TEXT.size
        code = bytes(body[pos : pos + n_code]).decode()
        message = bytes(body[pos + n_code : pos + n_code + n_msg]).decode()
        pos += n_code + n_msg
        errors[i] = error_from_code(code, message)
    return Answers(records, rows, errors, timings)


@dataclass(slots=True)
class RequestAnswers:
    """One request's answers, image by image in its order: the detector's arrays (``detected``),
    and per image how long it decoded and waited and the timings of the batch it ran in."""

    detected: DetectedBatch
    decode_ms: list[float]
    queue_ms: list[float]
    batch_timings: list[dict[str, float]]


def request_answers(shares: list[Answers]) -> RequestAnswers:
    """A request's answers from its shares of the batches its images ran in (in any order; each
    record's ``index``: the image's place in the request)."""
    if not shares:
        return RequestAnswers(DetectedBatch.failed([]), [], [], [])
    joined = Answers(np.concatenate([s.records for s in shares]), np.concatenate([s.rows for s in shares]), {}, {})
    batch_timings: list[dict[str, float]] = []
    for share in shares:
        joined.errors.update((len(batch_timings) + k, e) for k, e in share.errors.items())
        batch_timings += [share.timings] * len(share.records)
    order = np.argsort(joined.records["index"], kind="stable")
    records = joined.records[order]
    return RequestAnswers(joined.detected().take(order), records["decode_ms"].tolist(), records["queue_ms"].tolist(),
                          [batch_timings[p] for p in order.tolist()])
