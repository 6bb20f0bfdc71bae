"""Where the frames of videos and streams come from: OpenCV (FFmpeg) on the host, or NVDEC on
the GPU, behind one capture interface (``grab``, ``retrieve``, ``release``, as
``cv2.VideoCapture``), so that ``app.pipeline.video`` and ``app.pipeline.stream_source`` read
both the same way and give the same frame indices, times and sizes.

Which decoder is resolved once, in ``video_decoder``: the detector's ``RunShape.video_decode`` (``auto`` |
``nvdec`` | ``opencv``, ``app.config.VIDEO_DECODERS``); ``auto`` is OpenCV for now: NVDEC's
kernel and pipeline runs passed on the H200, but its end-to-end comparisons with OpenCV's
frames did not (bench/results/2026-12-01-nvidia-h200-session2-README.md), so NVDEC is asked
for by name (``nvdec``: a GPU pipeline with PyNvVideoCodec installed). With NVDEC a
frame is a ``DeviceNv12`` that never touches the host; a file NVDEC cannot open or decode (a
codec it lacks) is read by OpenCV instead, so one such source never stops the others, and so
are live URLs (see ``open_source``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any

from app.config import decoder_name
from app.contracts import DeviceNv12
from app.errors import BackendUnavailable, InvalidImage, InvalidParameter
from app.source_urls import redact

if TYPE_CHECKING:
    from app.pipeline.detector import Detector

log = logging.getLogger(__name__)

# OpenCV serialises every FFmpeg open of the process behind one lock unless told that FFmpeg is
# thread-safe (it is, since FFmpeg 4): one source that never answers would hold every other
# stream's open until its timeout. Read by OpenCV at each open; set before any thread opens one.
os.environ.setdefault("OPENCV_FFMPEG_IS_THREAD_SAFE", "1")

LIVE_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "udp://", "tcp://", "srt://")


def is_live(source: str) -> bool:
    return source.lower().startswith(LIVE_SCHEMES)


def video_decoder(detector: Detector) -> str:
    """``nvdec`` or ``opencv``: what decodes the detector's videos (see the module docstring)."""
    choice = decoder_name(detector.shape.video_decode, video=True)
    takes_nv12 = detector.pipeline.takes_nv12
    if choice == "opencv":
        return "opencv"
    if choice == "auto":
        return "opencv"
    installed = importlib.util.find_spec("PyNvVideoCodec") is not None
    if not takes_nv12:
        raise InvalidParameter(f"NVDEC decoding needs a GPU backend, not {detector.pipeline.backend}")
    if not installed:
        raise BackendUnavailable("NVDEC decoding needs PyNvVideoCodec", hint="pip install pynvvideocodec")
    return "nvdec"


def open_opencv(source: str, *, timeout_ms: int | None = None) -> Any:
    """An OpenCV capture through its FFmpeg backend, or None when nothing opens."""
    import cv2

    if timeout_ms is None:
        cap = cv2.VideoCapture(source, cv2.CAP_FFMPEG)
    else:
        params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, timeout_ms, cv2.CAP_PROP_READ_TIMEOUT_MSEC, timeout_ms]
        cap = cv2.VideoCapture(source, cv2.CAP_FFMPEG, params)
    if not cap.isOpened():
        cap.release()
        return None
    return cap


def open_source(source: str, decoder: str, *, max_pixels: int, device: int = 0, timeout_ms: int | None = None) -> Any:
    """A capture of ``source`` by ``decoder`` (``video_decoder``'s answer), or None when nothing
    opens it (``nvdec``: NVDEC, else OpenCV; see the module docstring for ``auto``); an
    ``InvalidImage`` when its frames are over ``max_pixels`` (the run's limit)."""
    # Live URLs stay on OpenCV, whose open and read time out (PyNvVideoCodec's demuxer has no
    # timeout: a camera that never answers would hold its reader thread for good).
    if decoder == "nvdec" and not is_live(source):
        try:
            cap = NvdecCapture(source, device=device)
        except Exception as exc:  # noqa: BLE001 - the binding raises plain errors; OpenCV may still read it
            log.info("NVDEC cannot read %s (%s: %s); OpenCV reads it", redact(source), type(exc).__name__, exc)
        else:
            return checked_size(cap, source, cap.width, cap.height, max_pixels)
    cap = open_opencv(source, timeout_ms=timeout_ms)
    if cap is None:
        return None
    import cv2

    return checked_size(cap, source, int(cap.get(cv2.CAP_PROP_FRAME_WIDTH) or 0),
                        int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT) or 0), max_pixels)


def check_frame(frame: Any, source: str, max_pixels: int) -> None:
    """A decoded frame over ``max_pixels`` (a source whose container did not say its size, or
    changed it mid-stream): an ``InvalidImage``, before the frame is queued."""
    height, width = (frame.height, frame.width) if isinstance(frame, DeviceNv12) else frame.shape[:2]
    _refuse_over_limit(source, width, height, max_pixels)


def checked_size(cap: Any, source: str, width: int, height: int, max_pixels: int) -> Any:
    """``cap``, unless its frames are over ``max_pixels`` (a stream or file that would queue frames
    of gigabytes): then released, and an ``InvalidImage``, before any frame is read."""
    try:
        _refuse_over_limit(source, width, height, max_pixels)
    except InvalidImage:
        cap.release()
        raise
    return cap


def _refuse_over_limit(source: str, width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:  # the run's limit (RunShape.max_pixels), the images' too
        raise InvalidImage(f"{redact(source)!r} has frames of {width}x{height} pixels, over the limit of "
                           f"{max_pixels:,} per image")


def capture_fps(cap: Any) -> float:
    """The source's frame rate (0: unknown), as OpenCV reports it for either kind of capture."""
    if isinstance(cap, NvdecCapture):
        return cap.fps
    import cv2

    fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
    return fps if 0.0 < fps < 1000.0 else 0.0  # some containers report 0 or nonsense


class NvdecCapture:
    """``cv2.VideoCapture``'s reading interface over ``app.gpu.nvdec.NvdecReader``: ``retrieve``
    gives a ``DeviceNv12`` of the caller's own (a device copy: the decoder recycles its surfaces).
    The first frame is decoded on opening, so a source NVDEC cannot decode fails there."""

    def __init__(self, source: str, *, device: int = 0) -> None:
        from app.gpu.nvdec import NvdecReader

        live = is_live(source)
        self._reader = NvdecReader(source, live=live, gpu_id=device)
        self.fps = self._reader.fps
        if not live:  # a file's time_s as OpenCV reads it: the same container frame rate
            probe = open_opencv(source)
            if probe is not None:
                self.fps = capture_fps(probe)
                probe.release()
        self._frames = self._reader.frames()
        try:
            self._first = next(self._frames, None)
        except Exception as exc:  # noqa: BLE001 - the binding raises plain RuntimeErrors for what it cannot decode
            raise InvalidImage(f"NVDEC cannot decode {redact(source)!r}: {exc}") from None
        self.width, self.height = (self._first.width, self._first.height) if self._first is not None else (0, 0)
        self._current: Any = None

    def grab(self) -> bool:
        """The next frame (never decoded ahead: that may recycle the surface of this one)."""
        if self._first is not None:
            self._current, self._first = self._first, None
        else:
            self._current = next(self._frames, None)
        return self._current is not None

    def retrieve(self) -> tuple[bool, DeviceNv12 | None]:
        from app.gpu.nvdec import own_copy

        frame = self._current
        if frame is None:
            return False, None
        return True, DeviceNv12(own_copy(frame.planes), frame.height, frame.width)

    def release(self) -> None:
        self._frames = iter(())
        self._current = self._first = None
        self._reader.close()
