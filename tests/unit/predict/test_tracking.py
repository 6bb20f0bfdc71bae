"""Per-stream track ids (``app.predict.tracking``): each detection keeps its place and gains an
id once ByteTrack confirms its track; a frame without detections is a frame like any other."""

from __future__ import annotations

import numpy as np

from app.predict.tracking import StreamTracker
from app.types import Detections


def frame(*boxes) -> Detections:
    return Detections.from_rows(np.array([[*b, 0.9, 0] for b in boxes], np.float32).reshape(-1, 6))


def test_a_frame_without_detections_keeps_the_tracks_going():
    tracker = StreamTracker(10.0)
    ids = [tracker.update(frame((10 + 2 * k, 20, 60 + 2 * k, 120))) for k in range(4)]
    assert tracker.update(frame()) == []  # nothing seen in this frame: no ids, no error
    after = tracker.update(frame((20, 20, 70, 120)))
    assert ids[0] == [None] and ids[-1][0] is not None  # confirmed after a few frames
    assert after == ids[-1]  # the same object keeps its id across the empty frame
