"""NVDEC through PyNvVideoCodec (PyPI ``pynvvideocodec``): a video's frames as NV12 in device
memory, never on the host, for ``app.gpu.nv12``'s letterbox kernel.

Files go through ``SimpleDecoder`` (batches of frames, its own demuxer); URLs (RTSP, HTTP)
through ``CreateDemuxer`` + ``CreateDecoder``, packet by packet. Each frame comes out as a
torch view (``torch.from_dlpack``) of shape ``[H * 3 / 2, W]`` uint8: the Y plane, then the
interleaved UV plane. The decoder may reuse a frame's surface for a later one, so a frame is
valid until the next batch is asked for: copy it (device to device) into the batch's staging
before that.

``app.pipeline.sources`` opens these for videos and streams when the detector's pipeline takes
device NV12 frames (``Pipeline.takes_nv12``): ``own_copy`` makes a frame the caller's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.errors import BackendUnavailable, InvalidImage

OTHER_SURFACES = ("P016", "P010", "YUV444", "NV16", "P216")  # NVDEC's layouts other than NV12


def _nvc() -> Any:
    try:
        import PyNvVideoCodec as nvc
    except ImportError:
        raise BackendUnavailable("PyNvVideoCodec is not installed", hint="pip install pynvvideocodec") from None
    return nvc


@dataclass
class Nv12Frame:
    index: int
    height: int  # the picture: the top-left height x width of the Y plane
    width: int
    planes: Any  # torch uint8 [rows, cols] on the device: rows * 2 / 3 Y rows, then the interleaved UV rows


class NvdecReader:
    """The NV12 frames of one file or URL (``live``: read packet by packet), decoded by NVDEC on
    GPU ``gpu_id``."""

    def __init__(self, source: str, *, live: bool = False, gpu_id: int = 0, batch: int = 8) -> None:
        self.source, self.gpu_id, self.batch, self.live = source, gpu_id, batch, live
        self._demuxer: Any = None
        nvc = _nvc()
        try:
            if self.live:
                self._demuxer = nvc.CreateDemuxer(filename=source)
                self._decoder = nvc.CreateDecoder(gpuid=gpu_id, codec=self._demuxer.GetNvCodecId(), cudacontext=0,
                                                  cudastream=0, usedevicememory=True)
                self.fps = float(self._demuxer.FrameRate() or 0.0)
            else:
                self._decoder = nvc.SimpleDecoder(source, gpu_id=gpu_id, use_device_memory=True,
                                                  output_color_type=nvc.OutputColorType.NATIVE)
        except Exception as exc:  # noqa: BLE001 - the binding raises plain RuntimeErrors for bad input
            raise InvalidImage(f"NVDEC cannot open {source!r}: {exc}") from None
        self.shown = (0, 0)  # the picture's (height, width) when the stream says, else the surface's
        if not self.live:
            metadata = self._decoder.get_stream_metadata()
            # Fields not every version names: read what is there.
            self.fps = float(getattr(metadata, "average_fps", 0.0) or 0.0)
            self.shown = (int(getattr(metadata, "height", 0) or 0), int(getattr(metadata, "width", 0) or 0))

    def frames(self) -> Iterator[Nv12Frame]:
        """Every frame in presentation order; each one valid until the next is taken."""
        import torch

        for index, frame in enumerate(self._packets() if self.live else self._batches()):
            fmt = str(getattr(frame, "format", "")).upper()  # 10-bit and 4:4:4 streams decode to other layouts
            if any(other in fmt for other in OTHER_SURFACES):
                raise InvalidImage(f"NVDEC gives {fmt} frames for {self.source!r}; the GPU reads 8-bit 4:2:0 (NV12)")
            planes = torch.from_dlpack(frame)
            if planes.dim() != 2:  # some versions add a batch or channel axis of 1: drop it, keep the strides
                planes = planes.squeeze()
            rows, cols = planes.shape[0] * 2 // 3, planes.shape[1]
            height, width = self.shown
            yield Nv12Frame(index, min(height, rows) or rows, min(width, cols) or cols, planes)

    def _batches(self) -> Iterator[Any]:
        while frames := self._decoder.get_batch_frames(self.batch):
            yield from frames

    def _packets(self) -> Iterator[Any]:
        for packet in self._demuxer:
            yield from self._decoder.Decode(packet)

    def close(self) -> None:
        self._decoder = self._demuxer = None  # the binding frees its decoder with the object


def own_copy(planes: Any) -> Any:
    """A device copy of a frame's planes that the decoder cannot recycle, complete when returned
    (the reader's stream is synchronized: a frame handed to another thread is ready to read)."""
    import torch

    with torch.cuda.device(planes.device):
        copy = planes.clone()
        torch.cuda.current_stream().synchronize()
    return copy
