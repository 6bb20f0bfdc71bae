"""Per-stream track ids from ByteTrack as the ``trackers`` package ships it (Roboflow's
maintained successor of ``supervision``'s ``sv.ByteTrack``, which supervision 0.30 removed).

Every detection keeps its place and gains ``"track_id"``: an int once ByteTrack has confirmed
its track, ``None`` before (the tracker's ``-1``). Detections are never dropped or moved, so a
tracked frame's detections are the untracked ones, plus ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from app.errors import InvalidParameter
from app.types import Detections


def _byte_track_class() -> Any:
    try:
        from trackers import ByteTrackTracker
    except ImportError:
        raise InvalidParameter(
            "--track needs the trackers package (ByteTrack)", hint="pip install 'yolopipe[track]'"
        ) from None
    return ByteTrackTracker


def check_tracking_available() -> None:
    """Fail before a model loads when ``--track`` cannot work here."""
    _byte_track_class()


class StreamTracker:
    """One ByteTrack for one stream; ``update`` once per processed frame, in frame order."""

    def __init__(self, frame_rate: float) -> None:
        import supervision as sv

        self._sv = sv
        self._tracker = _byte_track_class()(frame_rate=frame_rate if frame_rate > 0 else 30.0)

    def update(self, detections: Detections) -> list[int | None]:
        """Track ids for ``detections``, in their order."""
        n = len(detections)
        frame = self._sv.Detections(
            xyxy=detections.boxes.astype(np.float32).reshape(-1, 4),
            confidence=detections.scores.astype(np.float32),
            class_id=detections.class_ids.astype(int),
            data={"index": np.arange(n)},
        )
        tracked = self._tracker.update(frame)
        ids: list[int | None] = [None] * n
        # A frame with nothing tracked comes back without the "index" column (a frame of no detections).
        for index, track_id in zip(tracked.data.get("index", ()), tracked.tracker_id):
            ids[int(index)] = int(track_id) if int(track_id) >= 0 else None
        return ids


def with_track_ids(detections_json: list[dict[str, Any]], ids: list[int | None]) -> list[dict[str, Any]]:
    return [{**d, "track_id": t} for d, t in zip(detections_json, ids)]
