"""Every JSON record yolopipe writes about detections, from a ``DetectedBatch``'s arrays: an
image's line (``predict`` on folders, ``predict --ray``), a video frame's line, a stream's event
(``predict`` on streams, ``/v1/streams``) and ``/v1``'s answers. One formatter, byte for byte
what ``json.dumps`` gives for the record as a dict (``tests/references.py`` builds it the readable
way, plus the fields around it), without a dict per box or a ``json.dumps`` per image (the
folder path's biggest holder of the GIL after reading, issue #16).

A record is ``{HEAD, "width": W, "height": H, "detections": [...], TAIL}`` or, for an image that
failed, ``{HEAD, "error": ..., TAIL}``: ``HEAD`` names what the record is about (``"image"``;
``"frame"`` and ``"time_s"``; ``"stream"``...), ``TAIL`` adds what follows (``"latency_ms"``,
``"timings"``). Why the bytes are the same:

* boxes and scores are the batch's float32 values (already in source pixels);
* ``round(v, 2)`` and ``round(s, 5)``: a float32 times 100 (or 1e5) is exact in float64 (24 + 5,
  24 + 12 significant bits), so ``rint`` of it is the correctly rounded, half-to-even decimal
  that ``round`` finds, and dividing by 100 (1e5) gives the float64 nearest that decimal, as
  ``round``'s own string-to-float does;
* numbers are written with ``%r`` (``float.__repr__``, as ``json`` does for finite floats; a
  batch with a NaN or an infinity writes each number with ``json.dumps``) and strings with
  ``json.dumps``: the encoder it would build, built once per ``Style`` (``Style.dumps``); ``/v1``'s
  ``timings`` the same way, from a template (``Style.floats_field``);
* the layout (keys, order, separators) is ``json.dumps``' in the record's ``Style``: its defaults
  for lines and events, Starlette's ``JSONResponse`` (compact, UTF-8, no NaN) for ``/v1``.

``tests/unit/test_records.py`` compares the two on varied and adversarial records.

Around the lines: ``CocoDocument`` (``predict --coco``), written from the same arrays with the
same rounding; ``read_written``, what an output file already holds (``--resume``), read once;
and ``FolderSummary``, the counts a run over files reports (``predict`` and ``predict --ray``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from app.contracts import DetectedBatch
from app.errors import YolopipeError


@dataclass(frozen=True)
class Style:
    """How ``json.dumps`` is called for a kind of output, and the record's templates in it."""

    item: str  # between items
    key: str  # between a key and its value
    ensure_ascii: bool
    allow_nan: bool

    @cached_property
    def encoder(self) -> json.JSONEncoder:
        """The encoder ``json.dumps`` builds for these settings on each call (costlier than
        encoding a name), built once: ``json.dumps(v, ...)`` is ``encoder.encode(v)``."""
        return json.JSONEncoder(ensure_ascii=self.ensure_ascii, allow_nan=self.allow_nan, separators=(self.item, self.key))

    @cached_property
    def record(self) -> str:
        """An image's record: head, width, height, detections and tail (``item`` before it, or empty)."""
        item, key = self.item, self.key
        return "{%s" + item + '"width"' + key + "%d" + item + '"height"' + key + "%d" + item + '"detections"' + key \
            + "[%s]%s}"

    @cached_property
    def box_and_score(self) -> str:
        """A detection's start: its four box values and its score, each ``%r``."""
        item, key = self.item, self.key
        return '{"box"' + key + "[%r" + item + "%r" + item + "%r" + item + "%r]" + item + '"score"' + key + "%r"

    @cached_property
    def class_end(self) -> str:
        """A detection's end: its class id (``%d``) and name (``%s``, as ``dumps`` writes it)."""
        return self.item + '"class_id"' + self.key + "%d" + self.item + '"class_name"' + self.key + "%s}"

    def dumps(self, value: Any) -> str:
        return self.encoder.encode(value)

    def fields(self, **values: Any) -> str:
        """``"key": value`` pairs as ``dumps`` writes them inside an object (a record's head or tail):
        each key and value through ``dumps``, as json's encoder writes a dict's str keys and values."""
        return self.item.join(self.encoder.encode(k) + self.key + self.encoder.encode(v) for k, v in values.items())

    def floats_field(self, key: str, names: Sequence[str]) -> Callable[[Sequence[float]], str]:
        """``values`` (one per name) -> ``fields(**{key: dict(zip(names, values))})``, from a template
        made once: finite floats are written with ``%r`` (``float.__repr__``, as json writes them);
        values with a NaN, an infinity or anything but a float go through ``fields`` (json's words
        for them, or its refusal)."""
        if len(set(names)) != len(names):
            raise ValueError(f"a field's names are its keys, each once: {list(names)}")
        pairs = [self.dumps(n).replace("%", "%%") + self.key + "%r" for n in names]
        template = self.dumps(key).replace("%", "%%") + self.key + "{" + self.item.join(pairs) + "}"

        def field_text(values: Sequence[float]) -> str:
            if all(type(v) is float for v in values) and _all_finite(values):
                return template % tuple(values)
            return self.fields(**{key: dict(zip(names, values))})

        return field_text


def _all_finite(values: Iterable[float]) -> bool:
    """Whether every value is finite, in one C-level pass: a NaN or an infinity carries through a
    sum. (Finite values whose sum overflows read as not finite: their writer then takes json's
    path, which writes them the same.)"""
    return math.isfinite(sum(values))


LINES = Style(", ", ": ", ensure_ascii=True, allow_nan=True)  # json.dumps' defaults: JSON lines, events
HTTP = Style(",", ":", ensure_ascii=False, allow_nan=False)  # Starlette's JSONResponse: /v1's answers

# What an image that failed holds besides its head and tail (``{"error": message}`` by default).
ErrorFields = Callable[[YolopipeError], dict[str, Any]]


def _error_message(error: YolopipeError) -> dict[str, Any]:
    return {"error": str(error)}


def records(heads: Sequence[str], batch: DetectedBatch, class_names: Sequence[str], *,
            tails: Sequence[str] | None = None, track_ids: Sequence[Sequence[int | None] | None] | None = None,
            style: Style = LINES, error_fields: ErrorFields = _error_message) -> list[str]:
    """One JSON object (no newline) per image of ``batch``: ``heads[i]`` and ``tails[i]`` (field
    text, ``Style.fields``) around image ``i``'s size and detections, or its error;
    ``track_ids[i]``: a ``track_id`` per detection of image ``i`` (None: untracked)."""
    detections = _detection_texts(batch, class_names, style)
    counts = batch.counts.tolist()
    widths, heights = batch.widths.tolist(), batch.heights.tolist()
    item, record, errors = style.item, style.record, batch.errors
    track_key = item + '"track_id"' + style.key
    lines = []
    start = 0
    for i, head in enumerate(heads):
        tail = item + tails[i] if tails is not None and tails[i] else ""
        error = errors.get(i)
        if error is not None:
            lines.append("{" + head + item + style.fields(**error_fields(error)) + tail + "}")
            continue
        mine = detections[start : start + counts[i]]
        start += counts[i]
        ids = track_ids[i] if track_ids is not None else None
        if ids is not None:
            mine = [d[:-1] + track_key + ("null" if t is None else str(int(t))) + "}" for d, t in zip(mine, ids)]
        lines.append(record % (head, widths[i], heights[i], item.join(mine), tail))
    return lines


_SCALES = np.array([100, 100, 100, 100, 100_000], np.float64)  # a row's box values to 2 decimals, its score to 5


def _rounded(batch: DetectedBatch) -> np.ndarray:
    """The batch's boxes and scores (its rows' first five columns) as float64, rounded as
    ``round(v, 2)`` and ``round(s, 5)`` round them (see the module docstring); a NaN or an
    infinity stays what it is."""
    values = batch.rows[:, :5] * _SCALES  # float32 times float64: the float64 product, exact
    np.rint(values, out=values)
    values /= _SCALES
    return values


def _detection_texts(batch: DetectedBatch, class_names: Sequence[str], style: Style) -> list[str]:
    """Every detection of the batch as its JSON object, one image after another."""
    values = _rounded(batch).tolist()
    class_ids = batch.rows[:, 5].astype(np.int32).tolist()
    # Only the classes present are written (a model's 80 names through json cost more than a whole
    # answer); an id the model has not is written as its number, as a string.
    ends = {i: style.class_end % (i, style.dumps(class_names[i] if 0 <= i < len(class_names) else str(i)))
            for i in set(class_ids)}
    if not _all_finite(map(sum, values)):  # json's own words for them (or its refusal)
        start = style.box_and_score.replace("%r", "%s")
        return [start % tuple(map(style.dumps, row)) + ends[cid] for row, cid in zip(values, class_ids)]
    start = style.box_and_score
    return [start % tuple(row) + ends[cid] for row, cid in zip(values, class_ids)]


def image_lines(names: Sequence[str], batch: DetectedBatch, class_names: Sequence[str]) -> list[str]:
    """``predict``'s line per image: ``{"image": name, "width", "height", "detections"}`` or
    ``{"image": name, "error"}``."""
    return records(['"image": ' + LINES.dumps(name) for name in names], batch, class_names)


def frame_lines(name: str, frames: Sequence[tuple[int, float]], batch: DetectedBatch, class_names: Sequence[str],
                track_ids: Sequence[Sequence[int | None] | None] | None = None) -> list[str]:
    """``predict``'s line per video frame: ``"image"`` (the video), ``"frame"`` (its index) and
    ``"time_s"``, then an image's fields (``frames``: each frame's index and time)."""
    heads = [LINES.fields(image=name, frame=index, time_s=time_s) for index, time_s in frames]
    return records(heads, batch, class_names, track_ids=track_ids)


def error_line(head: str, error: YolopipeError | str, style: Style = LINES) -> str:
    """A record of something that failed before it had an image (a video that does not open)."""
    return "{" + head + style.item + style.fields(error=str(error)) + "}"


class CocoDocument:
    """``predict --coco``: COCO-style detections (images, scored annotations, categories), from
    each batch's arrays as its lines are written, with the lines' rounding: its boxes and scores
    are the numbers the lines hold. Images that failed are left out."""

    def __init__(self, class_names: Sequence[str]) -> None:
        self.categories = [{"id": i, "name": n} for i, n in enumerate(class_names)]
        self.images: list[dict[str, Any]] = []
        self.annotations: list[dict[str, Any]] = []

    def add(self, file_names: Sequence[str], batch: DetectedBatch) -> None:
        """The batch's images, ``file_names[i]`` naming image ``i`` (a video frame: ``video#frame``)."""
        values, class_ids = _rounded(batch).tolist(), batch.rows[:, 5].astype(np.int32).tolist()
        counts, widths, heights = batch.counts.tolist(), batch.widths.tolist(), batch.heights.tolist()
        start = 0
        for i, name in enumerate(file_names):
            if i in batch.errors:
                continue
            image_id = len(self.images)
            self.images.append({"id": image_id, "file_name": name, "width": widths[i], "height": heights[i]})
            for k in range(start, start + counts[i]):
                x1, y1, x2, y2, score = values[k]
                self.annotations.append({
                    "id": len(self.annotations), "image_id": image_id, "category_id": class_ids[k],
                    "bbox": [x1, y1, round(x2 - x1, 2), round(y2 - y1, 2)], "area": round((x2 - x1) * (y2 - y1), 2),
                    "score": score, "iscrowd": 0,
                })
            start += counts[i]

    def dumps(self) -> str:
        return json.dumps({"images": self.images, "annotations": self.annotations, "categories": self.categories})


@dataclass
class Written:
    """What an output file of JSON lines already holds (``--resume``): the images written, and per
    video the last frame written (its lines are written in frame order: all before it are done)."""

    images: set[str] = field(default_factory=set)
    frames: dict[str, int] = field(default_factory=dict)


def read_written(out: Path) -> Written:
    """``out``'s records, parsed once; a torn or foreign line is skipped. A line with ``"frame"``
    is a video's frame, not an image."""
    written = Written()
    if not Path(out).is_file():
        return written
    with open(out, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
                name = rec["image"]
                if "frame" not in rec:
                    written.images.add(name)
                    continue
                frame = int(rec["frame"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            written.frames[name] = max(frame, written.frames.get(name, -1))
    return written


@dataclass
class FolderSummary:
    """What a run over files wrote (``predict``, ``predict --ray``)."""

    images: int = 0  # JSON lines written: images and video frames
    videos: int = 0
    errors: int = 0
    detections: int = 0
    skipped: int = 0
    error_files: list[str] = field(default_factory=list)
