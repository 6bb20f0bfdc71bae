"""NVDEC through PyNvVideoCodec (PyPI ``pynvvideocodec``): a video's frames as NV12 in device
memory, never on the host, for ``app.gpu.nv12``'s letterbox kernel.

Files go through ``SimpleDecoder`` (its own demuxer, ``get_batch_frames``) or, with
``reader="threaded"``, ``ThreadedDecoder`` (the same, decoding ahead on a native thread of its
own); URLs (RTSP, HTTP) through ``CreateDecoder``, fed the compressed packets another demuxer
read (``app.predict.sources``: OpenCV's, whose open and reads time out). Every decoder works
in the device's primary context (the one torch and Numba use) on a CUDA stream of its own, not
the legacy default stream, which would order it against every other stream of the process.

A decoded frame is a torch view (``torch.from_dlpack``) of shape ``[H * 3 / 2, W]`` uint8: the Y
plane, then the interleaved UV plane. The decoder may reuse a frame's surface for a later one,
so a batch of frames is valid until the next batch is asked for: ``NvdecReader.own_copies``
makes them the caller's, one device-to-device copy each on the reader's stream and one
synchronize a batch.

A reader decodes on the ``app.gpu.device.CudaDevice`` it is given: the detector's
(``Detector.cuda``), whose frames it feeds. Every CUDA call here (opening, each decode call and
its frames' conversion, the copies, closing) holds that device's gate shared: a GPU pipeline's
CUDA-graph capture, which takes it exclusively, is never invalidated by a reader's work on the
same device.
PyNvVideoCodec's ``ThreadedDecoder`` also decodes on a native thread of its own, outside the
gate: a capture it invalidates is tried again (``app.gpu.capture``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from app.config import NVDEC_READERS as READERS  # file readers: SimpleDecoder, ThreadedDecoder
from app.errors import BackendUnavailable, InvalidImage
from app.gpu.device import CudaDevice

OTHER_SURFACES = ("P016", "P010", "YUV444", "NV16", "P216")  # NVDEC's layouts other than NV12
CODECS = {"h264": "H264", "avc1": "H264", "hevc": "HEVC", "hev1": "HEVC", "hvc1": "HEVC", "h265": "HEVC",
          "av01": "AV1"}  # a demuxer's FourCC → PyNvVideoCodec's cudaVideoCodec member


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


def decoder_engines(gpu_id: int = 0) -> int:
    """How many NVDEC engines GPU ``gpu_id`` has for 8-bit 4:2:0 H.264 (0: unknown)."""
    try:
        nvc = _nvc()
        chroma = next(v for k, v in nvc.cudaVideoChromaFormat.__members__.items() if "420" in k)
        caps = nvc.GetDecoderCaps(gpuid=gpu_id, codec=nvc.cudaVideoCodec.H264, chromaformat=chroma, bitdepth=8)
        return int(caps.get("num_decoder_engines", 0) or 0)
    except Exception:  # noqa: BLE001 - a binding or driver without the query: the caller's default
        return 0


class _Cuda:
    """The device's primary context (as an int handle) and a CUDA stream of this reader's own."""

    def __init__(self, gpu_id: int) -> None:
        import torch

        from app.gpu.driver import cuda_driver

        self.device = torch.device("cuda", gpu_id)
        self.stream = torch.cuda.Stream(device=self.device)  # non-blocking: never ordered against the others
        self.context = cuda_driver().primary_context(gpu_id)
        self.gpu_id = gpu_id

    def release(self) -> None:
        from app.gpu.driver import cuda_driver

        cuda_driver().release_primary_context(self.gpu_id)


class NvdecReader:
    """The NV12 frames of one file, or of a URL's compressed ``packets`` (bytes in Annex B, of
    the stream's ``codec``: a FourCC such as ``h264``), decoded by NVDEC on ``device`` under its
    gate. ``batch``: frames one decode call returns at most (files)."""

    def __init__(self, source: str, *, device: CudaDevice, batch: int = 8, reader: str = "simple",
                 packets: Iterable[bytes] | None = None, codec: str = "h264") -> None:
        if reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
        self.source, self.gpu_id, self.batch, self.reader = source, device.index, batch, reader
        self._packets = packets
        self._device = device
        nvc = _nvc()
        with device.shared():
            self._open(nvc, source, device.index, batch, reader, packets, codec)
        self.fps, self.shown = 0.0, (0, 0)  # shown: the picture's (height, width) when the stream says
        self.frame_count = 0  # a file's frames as its decoder counts them (0: it does not say)
        if packets is None:
            metadata = self._decoder.get_stream_metadata()
            # Fields not every version names: read what is there.
            self.fps = float(getattr(metadata, "average_fps", 0.0) or 0.0)
            self.shown = (int(getattr(metadata, "height", 0) or 0), int(getattr(metadata, "width", 0) or 0))
            self.frame_count = int(getattr(metadata, "num_frames", 0) or 0)
        self._index = 0

    def _open(self, nvc: Any, source: str, gpu_id: int, batch: int, reader: str, packets: Any, codec: str) -> None:
        self._cuda = _Cuda(gpu_id)
        cuda = {"cuda_context": self._cuda.context, "cuda_stream": self._cuda.stream.cuda_stream}
        try:
            if packets is not None:
                name = CODECS.get(codec.lower().strip("\0 "))
                if name is None:
                    raise InvalidImage(f"NVDEC does not decode {codec!r} streams here")
                self._decoder = nvc.CreateDecoder(gpuid=gpu_id, codec=getattr(nvc.cudaVideoCodec, name),
                                                  cudacontext=cuda["cuda_context"], cudastream=cuda["cuda_stream"],
                                                  usedevicememory=True)
            elif reader == "threaded":
                self._decoder = nvc.ThreadedDecoder(source, buffer_size=2 * batch, gpu_id=gpu_id, use_device_memory=True,
                                                    output_color_type=nvc.OutputColorType.NATIVE, **cuda)
            else:
                self._decoder = nvc.SimpleDecoder(source, gpu_id=gpu_id, use_device_memory=True,
                                                  output_color_type=nvc.OutputColorType.NATIVE, **cuda)
        except InvalidImage:
            self._cuda.release()
            raise
        except Exception as exc:  # noqa: BLE001 - the binding raises plain RuntimeErrors for bad input
            self._cuda.release()
            raise InvalidImage(f"NVDEC cannot open {source!r}: {exc}") from None

    @property
    def stream(self) -> Any:
        """The reader's CUDA stream (torch): the decoder's output and ``own_copies`` are ordered on it."""
        return self._cuda.stream

    def batches(self) -> Iterator[list[Nv12Frame]]:
        """The frames in presentation order, a decode call's worth at a time; each batch valid
        until the next one is asked for."""
        yield from self._packet_batches() if self._packets is not None else self._file_batches()

    def frames(self) -> Iterator[Nv12Frame]:
        """Every frame in presentation order; each one valid until the next batch is decoded."""
        for batch in self.batches():
            yield from batch

    def _frame(self, frame: Any) -> Nv12Frame:
        import torch

        fmt = str(getattr(frame, "format", "")).upper()  # 10-bit and 4:4:4 streams decode to other layouts
        if any(other in fmt for other in OTHER_SURFACES):
            raise InvalidImage(f"NVDEC gives {fmt} frames for {self.source!r}; the GPU reads 8-bit 4:2:0 (NV12)")
        planes = torch.from_dlpack(frame)
        if planes.dim() != 2:  # some versions add a batch or channel axis of 1: drop it, keep the strides
            planes = planes.squeeze()
        rows, cols = planes.shape[0] * 2 // 3, planes.shape[1]
        height, width = self.shown
        self._index += 1
        return Nv12Frame(self._index - 1, min(height, rows) or rows, min(width, cols) or cols, planes)

    def _decoded(self, decode: Callable[[Any], list[Any]], arg: Any) -> list[Nv12Frame]:
        """One decode call, ``decode(arg)``, and its frames' DLPack views, under the device's gate."""
        with self._device.shared():
            return [self._frame(f) for f in decode(arg) or []]

    def _file_batches(self) -> Iterator[list[Nv12Frame]]:
        """Until a call gives no frame. None asks past the file's last frame when its decoder
        counts them: SimpleDecoder returns none there, and prints a warning for each frame
        asked for ("INVALID INDEX")."""
        given = 0
        while not self.frame_count or given < self.frame_count:
            want = min(self.batch, self.frame_count - given) if self.frame_count else self.batch
            frames = self._decoded(self._decoder.get_batch_frames, want)
            if not frames:
                return
            given += len(frames)
            yield frames

    def _packet_batches(self) -> Iterator[list[Nv12Frame]]:
        """A URL's frames: a decode call per packet (the demuxer reads it here, outside the
        gate), then an empty packet, after which the decoder flushes."""
        import numpy as np

        nvc = _nvc()
        assert self._packets is not None
        for data in self._packets:
            buf = np.frombuffer(data, np.uint8)  # kept alive through the call: the packet points into it
            packet = nvc.PacketData()
            packet.bsl_data, packet.bsl = int(buf.ctypes.data), int(buf.size)
            if frames := self._decoded(self._decoder.Decode, packet):
                yield frames
        if frames := self._decoded(self._decoder.Decode, nvc.PacketData()):
            yield frames

    def own_copies(self, frames: list[Nv12Frame]) -> list[Any]:
        """Device copies of a batch's planes that the decoder cannot recycle, made on the reader's
        stream (after its decode) and complete when returned: frames handed to another thread are
        ready to read. One allocation and one synchronize for the batch."""
        import torch

        if not frames:
            return []
        stream = self._cuda.stream
        with self._device.shared(), torch.cuda.stream(stream):
            shapes = {tuple(f.planes.shape) for f in frames}
            if len(shapes) == 1:  # the usual case: one block, a view per frame
                block = torch.empty((len(frames), *shapes.pop()), dtype=torch.uint8, device=frames[0].planes.device)
                copies = list(block.unbind(0))
            else:
                copies = [torch.empty(f.planes.shape, dtype=torch.uint8, device=f.planes.device) for f in frames]
            for copy, frame in zip(copies, frames):
                copy.copy_(frame.planes, non_blocking=True)
            stream.synchronize()
        return copies

    def close(self) -> None:
        if self._decoder is not None:
            with self._device.shared():
                self._decoder = None  # the binding frees its decoder with the object
                self._cuda.release()
