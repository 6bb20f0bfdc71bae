"""What the inference worker answers, across the process boundary: ``Answers``, the detector's
arrays (a ``DetectedBatch``) with a ticket per image (``TICKET``: whose image it is, how long it
waited and was read, and the times of the batch it ran in), as numbers all the way.

An answer's walk from a POST to its JSON holds three forms: these arrays (built once per batch
in the inference worker, ``app.service.inference.answers``), one RESULTS frame per owner of the
batch's images (``answers_frame``: the arrays' bytes, no object per image, no JSON), and the
arrays again in the HTTP or gRPC worker (``read_answers``: views of the frame), split once per
request (``Answers.split``) and joined in the request's order (``Answers.joined``) for the
formatters, which write the JSON or the output tensors from them.

A RESULTS body (little-endian): images n, rows m and failed images e (u32 each); n ``TICKET``s;
the n widths, then heights, then row counts (i8 each); m rows (x1, y1, x2, y2, score, class as
f4, in source pixels, image after image); then per failed image its position (u32), its error's
code and message lengths (u8, u32), the code and the message (UTF-8).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from app.contracts import DetectedBatch, StageTimes
from app.errors import YolopipeError
from app.ipc.wire import FRAME, RESULTS, error_from_code

# Each image's times in ms, in ``/v1``'s ``timings`` order: its own (``decode_ms``: read, or
# decoded, before its batch; ``queue_ms``: admitted to its batch's start), then its batch's
# (``batch_ms``: the detector call; the pipeline's ``StageTimes``, summed over its runs, the
# pipeline's own decode named ``pipeline_decode_ms``).
TIMES = ("decode_ms", "queue_ms", "batch_ms", "pipeline_decode_ms", "preprocess_ms", "infer_ms", "postprocess_ms")
STAGES = TIMES[3:]  # the StageTimes fields, in their order
TICKET = np.dtype([("req_id", "<u8"), ("index", "<u4"), *((name, "<f8") for name in TIMES)])
_HEAD = struct.Struct("<III")  # images, rows, failed images
_ERROR = struct.Struct("<IBI")  # position, code length, message length


def tickets(req_ids: Sequence[int], indexes: Sequence[int], decode_ms: Sequence[float] | float = 0.0,
            queue_ms: Sequence[float] | float = 0.0, batch_ms: float = 0.0,
            stages: StageTimes | None = None) -> np.ndarray:
    """A batch's tickets: per image its request and place in it and its own times, and the
    batch's times (``batch_ms``, ``stages``) on every ticket."""
    out = np.zeros(len(req_ids), TICKET)
    out["req_id"], out["index"], out["decode_ms"], out["queue_ms"] = req_ids, indexes, decode_ms, queue_ms
    out["batch_ms"] = batch_ms
    if stages is not None:
        for name, ms in zip(STAGES, stages.values()):
            out[name] = ms
    return out


@dataclass(slots=True)
class Answers:
    """Images' answers: ``detected`` (the detector's arrays: sizes, row counts, rows, errors by
    position) and, image by image in the same order, ``tickets`` (``TICKET``). After the wire,
    the batch's stage times are in the tickets only (``detected.timings`` and ``runs`` stay
    the inference worker's)."""

    detected: DetectedBatch
    tickets: np.ndarray

    def __len__(self) -> int:
        return len(self.tickets)

    @classmethod
    def failed(cls, req_ids: Sequence[int], indexes: Sequence[int], errors: Sequence[YolopipeError]) -> Answers:
        """Images answered with an error each, never run (refused, cancelled, a failed batch)."""
        return cls(DetectedBatch.failed(errors), tickets(req_ids, indexes))

    def times(self) -> list[tuple[float, ...]]:
        """Per image, in order, its times in ms in ``TIMES``' order (``/v1``'s): its own decode
        and queue wait, its batch's call and pipeline stages."""
        return [ticket[2:] for ticket in self.tickets.tolist()]  # a ticket: req_id, index, then TIMES

    def take(self, positions: Sequence[int]) -> Answers:
        """The images at ``positions``, in that order."""
        return Answers(self.detected.take(positions), self.tickets[np.asarray(positions, np.int64)])

    def split(self, groups: list[list[int]]) -> list[Answers]:
        """The answers at each group of positions (each owner's or request's share), in that
        order: gathered once for all groups, then sliced."""
        if len(groups) == 1 and groups[0] == list(range(len(self))):
            return [self]
        whole = self.take(np.concatenate([np.asarray(g, np.int64) for g in groups]))
        d = whole.detected
        ends = np.cumsum(d.counts).tolist()
        out = []
        first = first_row = 0
        for group in groups:
            last = first + len(group)
            last_row = ends[last - 1] if last else first_row
            errors = {k - first: e for k, e in d.errors.items() if first <= k < last}
            out.append(Answers(DetectedBatch(d.widths[first:last], d.heights[first:last], d.counts[first:last],
                                             d.rows[first_row:last_row], errors, d.timings, d.runs),
                               whole.tickets[first:last]))
            first, first_row = last, last_row
        return out

    @classmethod
    def joined(cls, shares: list[Answers]) -> Answers:
        """One request's answers, in the request's order (its tickets' ``index``), from its
        shares of the batches its images ran in (in any order)."""
        if len(shares) == 1:
            joined = shares[0]
        elif not shares:
            return cls(DetectedBatch.failed([]), tickets([], []))
        else:
            joined = cls(DetectedBatch.concat([s.detected for s in shares]), np.concatenate([s.tickets for s in shares]))
        index = joined.tickets["index"]
        if len(index) > 1 and (np.diff(index.astype(np.int64)) < 0).any():
            return joined.take(np.argsort(index, kind="stable"))
        return joined


def answers_frame(answers: Answers) -> bytes:
    """One RESULTS frame of ``answers``: the arrays' bytes, joined once."""
    d = answers.detected
    n = len(answers)
    rows = np.ascontiguousarray(d.rows, np.float32)
    parts: list = [b"", _HEAD.pack(n, len(rows), len(d.errors)), np.ascontiguousarray(answers.tickets),
                   np.ascontiguousarray(np.stack([d.widths, d.heights, d.counts]), "<i8"), rows]
    for position in sorted(d.errors):
        error = d.errors[position]
        code, message = error.code.encode(), str(error).encode()
        parts += [_ERROR.pack(position, len(code), len(message)), code, message]
    length = sum(memoryview(p).nbytes for p in parts)
    parts[0] = FRAME.pack(length, RESULTS)
    return b"".join(parts)


def read_answers(body: bytes) -> Answers:
    """A RESULTS body's answers, as arrays (views of ``body``)."""
    n, m, e = _HEAD.unpack_from(body)
    pos = _HEAD.size
    ticket_array = np.frombuffer(body, TICKET, n, pos)
    pos += ticket_array.nbytes
    widths, heights, counts = np.frombuffer(body, "<i8", 3 * n, pos).reshape(3, n)
    pos += 24 * n
    rows = np.frombuffer(body, "<f4", 6 * m, pos).reshape(m, 6)
    pos += rows.nbytes
    errors = {}
    for _ in range(e):
        position, n_code, n_message = _ERROR.unpack_from(body, pos)
        pos += _ERROR.size
        code = bytes(body[pos : pos + n_code]).decode()
        errors[position] = error_from_code(code, bytes(body[pos + n_code : pos + n_code + n_message]).decode())
        pos += n_code + n_message
    return Answers(DetectedBatch(widths, heights, counts, rows, errors), ticket_array)
