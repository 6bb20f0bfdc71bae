"""Where the frames of videos and streams come from: OpenCV (FFmpeg) on the host, or NVDEC on
the GPU, behind one capture interface (``grab``, ``retrieve``, ``release``, as
``cv2.VideoCapture``), so that ``app.predict.video`` and ``app.predict.stream_source`` read
both the same way and give the same frame indices, times and sizes.

Which decoder is resolved once, in ``video_decoder``: the detector's ``RunShape.video_decode`` (``auto`` |
``nvdec`` | ``opencv``, ``app.config.VIDEO_DECODERS``); ``auto`` is NVDEC where it can be (a GPU
pipeline, PyNvVideoCodec installed: on the H200 its frames give the model the very input
OpenCV's give, ``tests/gpu/test_nvdec.py``), else OpenCV; ``nvdec`` asked for by name where it
cannot be is an error. With NVDEC a
frame is a ``DeviceNv12`` that never touches the host; a file NVDEC cannot open or decode (a
codec it lacks) is read by OpenCV instead, so one such source never stops the others, and so
are live URLs (see ``open_source``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from app.config import decoder_name, nvdec_reader
from app.contracts import DeviceNv12
from app.errors import BackendUnavailable, InvalidImage, InvalidParameter
from app.source_urls import redact

if TYPE_CHECKING:
    from app.pipeline.detector import Detector

log = logging.getLogger(__name__)

def let_ffmpeg_open_in_parallel() -> None:
    """Tell OpenCV that FFmpeg is thread-safe (it is, since FFmpeg 4); else OpenCV serialises
    every FFmpeg open of the process behind one lock, and one source that never answers holds
    every other stream's open until its timeout. OpenCV reads the variable at each open. Called
    before each open, and before the threads that open sources start (``StreamRunner``): setting
    the environment while another thread reads it is not safe, so the first call must come
    before them (later calls find it set and write nothing). A value the user set is kept."""
    os.environ.setdefault("OPENCV_FFMPEG_IS_THREAD_SAFE", "1")


def quiet_opencv() -> None:
    """OpenCV's warnings off, its errors kept, unless the user chose a level (``OPENCV_LOG_LEVEL``):
    its FFmpeg backend warns at every capture that ``OPENCV_FFMPEG_IS_THREAD_SAFE`` is set,
    which yolopipe sets on purpose (``let_ffmpeg_open_in_parallel``), and a normal video or
    stream prints nothing."""
    if "OPENCV_LOG_LEVEL" in os.environ:
        return
    import cv2

    levels = getattr(getattr(cv2, "utils", None), "logging", None)
    if levels is not None and levels.getLogLevel() > levels.LOG_LEVEL_ERROR:
        levels.setLogLevel(levels.LOG_LEVEL_ERROR)


LIVE_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "udp://", "tcp://", "srt://")


def is_live(source: str) -> bool:
    return source.lower().startswith(LIVE_SCHEMES)


def video_decoder(detector: Detector) -> str:
    """``nvdec`` or ``opencv``: what decodes the detector's videos (see the module docstring)."""
    choice = decoder_name(detector.shape.video_decode, video=True)
    takes_nv12 = detector.takes_nv12
    if choice == "opencv":
        return "opencv"
    installed = importlib.util.find_spec("PyNvVideoCodec") is not None
    if choice == "auto":
        return "nvdec" if takes_nv12 and installed else "opencv"
    if not takes_nv12:
        raise InvalidParameter(f"NVDEC decoding needs a GPU backend, not {detector.backend}")
    if not installed:
        raise BackendUnavailable("NVDEC decoding needs PyNvVideoCodec", hint="pip install pynvvideocodec")
    return "nvdec"


def open_opencv(source: str, *, timeout_ms: int | None = None, threads: int | None = None) -> Any:
    """An OpenCV capture through its FFmpeg backend, or None when nothing opens. ``threads``:
    FFmpeg's decoding threads for it (OpenCV's default: one per core)."""
    import cv2

    let_ffmpeg_open_in_parallel()
    quiet_opencv()
    params = []
    if timeout_ms is not None:
        params += [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, timeout_ms, cv2.CAP_PROP_READ_TIMEOUT_MSEC, timeout_ms]
    if threads:
        params += [cv2.CAP_PROP_N_THREADS, threads]
    cap = cv2.VideoCapture(source, cv2.CAP_FFMPEG, params) if params else cv2.VideoCapture(source, cv2.CAP_FFMPEG)
    if not cap.isOpened():
        cap.release()
        return None
    return cap


def open_source(source: str, decoder: str, *, max_pixels: int, device: Any = None, timeout_ms: int | None = None,
                threads: int | None = None) -> Any:
    """A capture of ``source`` by ``decoder`` (``video_decoder``'s answer), or None when nothing
    opens it (``nvdec``: NVDEC on ``device``, the detector's ``Detector.cuda``, else OpenCV; see
    the module docstring for ``auto``); an ``InvalidImage`` when its frames are over
    ``max_pixels`` (the run's limit). ``threads``: OpenCV's decoding threads for it (``open_opencv``)."""
    # URLs are demuxed by OpenCV for NVDEC (RawPackets), whose open and reads time out:
    # PyNvVideoCodec's own demuxer has no timeout, and a camera that never answers would hold
    # its reader thread for good.
    if decoder == "nvdec":
        try:
            cap = NvdecCapture(source, device=device, timeout_ms=timeout_ms, reader=nvdec_reader())
        except Exception as exc:  # noqa: BLE001 - the binding raises plain errors; OpenCV may still read it
            log.info("NVDEC cannot read %s (%s: %s); OpenCV reads it", redact(source), type(exc).__name__, exc)
        else:
            if not cap.opened:
                return None
            return checked_size(cap, source, cap.width, cap.height, max_pixels)
    cap = open_opencv(source, timeout_ms=timeout_ms, threads=threads)
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
    if (fps := getattr(cap, "fps", None)) is not None:  # NvdecCapture: OpenCV's figure, read on opening
        return fps
    import cv2

    fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
    return fps if 0.0 < fps < 1000.0 else 0.0  # some containers report 0 or nonsense


class RawPackets:
    """A source's compressed video packets, demuxed by OpenCV's FFmpeg without decoding (its raw
    mode, with its open and read timeouts), in Annex B (it filters MP4's length-prefixed H.264 and
    HEVC to start codes): what NVDEC reads URLs from. ``head``: the stream's own header (the
    extradata, when it is Annex B, as RTSP's is) and the first packets, read on opening and given
    first when iterated; ``colour``: the SPS's colour description among them
    (``app.imaging.h264_sps``; None: none found)."""

    HEAD_PACKETS = 3

    def __init__(self, source: str, *, timeout_ms: int | None = None) -> None:
        import cv2

        let_ffmpeg_open_in_parallel()
        quiet_opencv()
        params = [cv2.CAP_PROP_FORMAT, -1]
        if timeout_ms is not None:
            params += [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, timeout_ms, cv2.CAP_PROP_READ_TIMEOUT_MSEC, timeout_ms]
        self._cap = cv2.VideoCapture(source, cv2.CAP_FFMPEG, params)
        self.opened = self._cap.isOpened()
        self.fps = capture_fps(self._cap) if self.opened else 0.0
        fourcc = int(self._cap.get(cv2.CAP_PROP_FOURCC) or 0) if self.opened else 0
        self.codec = fourcc.to_bytes(4, "little").decode("latin-1").strip("\0 ").lower()
        self.head: list[bytes] = []
        if self.opened:
            extra_index = int(self._cap.get(cv2.CAP_PROP_CODEC_EXTRADATA_INDEX) or 0)
            ok, extra = self._cap.retrieve(flag=extra_index) if extra_index else (False, None)
            if ok and extra is not None and extra.size and extra.tobytes().startswith((b"\0\0\1", b"\0\0\0\1")):
                self.head.append(extra.tobytes())  # RTSP's parameter sets, from its SDP
            while len(self.head) < self.HEAD_PACKETS + 1 and (packet := self._read()) is not None:
                self.head.append(packet)
        from app.imaging.h264_sps import stream_colour

        self.colour = stream_colour(self.head) if self.codec in ("h264", "avc1") else None

    def _read(self) -> bytes | None:
        if not self._cap.grab():
            return None
        ok, packet = self._cap.retrieve()
        return packet.tobytes() if ok and packet is not None else b""

    def __iter__(self) -> Iterator[bytes]:
        head, self.head = self.head, []
        yield from head
        while (packet := self._read()) is not None:
            if packet:
                yield packet

    def release(self) -> None:
        self._cap.release()


class NvdecCapture:
    """``cv2.VideoCapture``'s reading interface over ``app.gpu.nvdec.NvdecReader``, plus ``read``:
    the next frames as ``DeviceNv12`` of the caller's own (device copies, made a decode call's
    batch at a time: the decoder recycles its surfaces), with the stream's colour matrix and
    range as its SPS says (OpenCV's decode converts with the same). A file is decoded by
    PyNvVideoCodec's own demuxer (``reader``: ``simple`` | ``threaded``) on ``device`` (an
    ``app.gpu.device.CudaDevice``: the detector's, ``Detector.cuda``); a URL's packets come
    from OpenCV's demuxer (``RawPackets``: the open and read time out after ``timeout_ms``). The
    first frames are decoded on opening, so a source NVDEC cannot decode fails there
    (``InvalidImage``); a URL that does not open leaves ``opened`` false."""

    def __init__(self, source: str, *, device: Any, timeout_ms: int | None = None, reader: str = "simple",
                 batch: int = 8) -> None:
        from app.gpu.nvdec import NvdecReader

        self.source, self.batch = source, batch
        self._reader: Any = None
        # A file's frame rate and colour as OpenCV reads them (its time_s: the container's rate).
        self._packets = RawPackets(source, timeout_ms=timeout_ms)
        self.opened = self._packets.opened
        if not self.opened:
            self._packets.release()
            return
        self.fps = self._packets.fps
        self.colorspace, self.full_range = self._packets.colour or (2, False)
        try:
            if is_live(source):
                self._reader = NvdecReader(source, device=device, packets=self._packets, codec=self._packets.codec)
            else:
                self._packets.release()
                self._reader = NvdecReader(source, device=device, reader=reader, batch=batch)
            self.fps = self.fps or self._reader.fps
            self._batches = self._reader.batches()
            self._decoded: list[Any] = []  # the decoder's current batch, taken from the front
            self._queue: list[DeviceNv12] = []  # frames of the caller's own, ahead of grab()
            self._queue = self.read(batch)
        except InvalidImage:
            self.release()
            raise
        except Exception as exc:  # noqa: BLE001 - the binding raises plain RuntimeErrors for what it cannot decode
            self.release()
            raise InvalidImage(f"NVDEC cannot decode {redact(source)!r}: {exc}") from None
        first = self._queue[0] if self._queue else None
        self.width, self.height = (first.width, first.height) if first is not None else (0, 0)
        self._current: DeviceNv12 | None = None

    def read(self, count: int) -> list[DeviceNv12]:
        """Up to ``count`` next frames, each the caller's own and complete on the device; [] at the end."""
        if getattr(self, "_queue", None):
            taken, self._queue = self._queue[:count], self._queue[count:]
            return taken
        if not self._decoded:
            self._decoded = next(self._batches, [])
        frames, self._decoded = self._decoded[:count], self._decoded[count:]
        planes = self._reader.own_copies(frames)
        return [DeviceNv12(p, f.height, f.width, self.colorspace, self.full_range) for p, f in zip(planes, frames)]

    def grab(self) -> bool:
        """The next frame (copied a decode batch at a time)."""
        if not self._queue:
            self._queue = self.read(self.batch)
        self._current = self._queue.pop(0) if self._queue else None
        return self._current is not None

    def retrieve(self) -> tuple[bool, DeviceNv12 | None]:
        return (self._current is not None), self._current

    def release(self) -> None:
        self._queue, self._decoded, self._current = [], [], None
        self._batches = iter(())
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._packets.release()
