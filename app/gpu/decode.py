"""JPEG bytes → pixels for the GPU pipeline, on the decoder's own CUDA stream.

``decode`` (a ``GpuPipeline`` argument, changeable between calls):

=============  ===========================================================================
``gpu``        nvImageCodec when installed (``nvidia-nvimgcodec-cu12/13``, the ``cuda12`` /
               ``cuda13`` extras), else torchvision's nvJPEG
``nvimgcodec`` nvImageCodec: its hardware JPEG decoder for every image it takes, then its
               default chain (CUDA, hybrid) for the rest, chroma upsampled as libjpeg-turbo
               does: baseline JPEGs equal OpenCV's pixels but for one value in ~75,000 (off
               by one level); progressive and 4:1:1 ones differ in ~2 % of their values, by
               at most 3 levels (measured on the H200)
``nvjpeg``     torchvision ``decode_jpeg(device="cuda")``: no fancy upsampling, so about 16 %
               of the pixels differ from OpenCV's by a level or more
``opencv``     OpenCV in the pipeline's host threads: bit-exact with Ultralytics (``cpu``: its old name)
=============  ===========================================================================

A GPU decoder returns, per image, a ``DeviceImage`` (a device buffer it owns, RGB, with its
layout) or, for what it does not take, OpenCV's BGR frame or the image's error: CMYK/YCCK,
12-bit, arithmetic-coded and lossless JPEGs are decoded by OpenCV up front
(``app.gpu.jpeg``), and an image the GPU decoder refuses falls back to OpenCV alone, not
its batch. EXIF orientation is applied as OpenCV applies it.

The pipeline's path is ``decode_into``: every JPEG's decoded size is known from its header
(EXIF orientation included), so the pipeline reserves its place in the batch slot's device
staging first and nvImageCodec decodes straight into it (``images=`` views of that buffer):
no Image allocated per image, no device-to-device copy per image. torchvision's nvJPEG decodes
into its own tensors, which are then copied into place (``gather``). The compute stream waits
for an event recorded on the decoder's stream after the batch. A decoder serves one batch at
a time (``lock``): a decode of 128 photos takes about half the engine's time for them, so one
decoder keeps ahead of the engine, provided its streams do not share a hardware queue with
the engine's (``app/gpu/__init__.py``: ``CUDA_DEVICE_MAX_CONNECTIONS``).
"""

from __future__ import annotations

import logging
import re
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.config import MAX_PIXELS, decoder_name
from app.errors import BackendUnavailable, InvalidImage, YolopipeError
from app.gpu.jpeg import JpegHeader, apply_orientation, read_jpeg_header
from app.gpu.preprocess import LAYOUT_CHW_RGB, LAYOUT_HWC_RGB
from app.imaging.decode import decode_image
from app.imaging.headers import ImageHeader

log = logging.getLogger(__name__)


@dataclass
class DeviceImage:
    """A decoded image in a device buffer its ``owner`` keeps alive: ``height × width × 3`` bytes."""

    ptr: int
    height: int
    width: int
    layout: int  # app.gpu.preprocess.LAYOUT_*
    owner: Any

    @property
    def nbytes(self) -> int:
        return self.height * self.width * 3


Decoded = DeviceImage | np.ndarray | YolopipeError
# decode_into's answer per image: None (decoded in place) or what stands in for it.
Fallback = np.ndarray | YolopipeError | None


def decoded_size(header: JpegHeader) -> tuple[int, int]:
    """``(height, width)`` after the EXIF orientation (5-8 turn the image by 90°)."""
    if header.orientation in (5, 6, 7, 8):
        return header.width, header.height
    return header.height, header.width


def cpu_decode(data: bytes, header: ImageHeader | None = None, *, max_pixels: int = MAX_PIXELS
               ) -> np.ndarray | YolopipeError:
    """OpenCV's BGR frame of ``data`` (Ultralytics' reader), or the image's error; ``header``: its
    header, already read and checked (else it is read here)."""
    try:
        return decode_image(data, max_pixels=max_pixels, header=header)
    except YolopipeError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - any decoder failure is this image's fault
        detail = re.sub(r"\s+", " ", str(exc))[:200]
        return InvalidImage(f"cannot decode image: {detail}")


class GpuJpegDecoder:
    """Shared by the GPU decoders: the stream, the lock, routing and the gather."""

    name = ""

    layout = LAYOUT_HWC_RGB  # what decode_into writes

    def __init__(self, device: int) -> None:
        import torch

        from app.gpu.driver import cuda_driver

        self.device = int(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.lock = threading.Lock()
        self._driver = cuda_driver()

    @staticmethod
    def split(datas: Sequence[bytes], headers: Sequence[JpegHeader | None] | None = None
              ) -> tuple[list[tuple[int, JpegHeader]], dict[int, np.ndarray | YolopipeError]]:
        """``(index, header)`` of the JPEGs the GPU takes; OpenCV's frame (or the error) of the rest.
        ``headers``: each one's JPEG header as already read (None: not a JPEG); else read here."""
        gpu: list[tuple[int, JpegHeader]] = []
        host: dict[int, np.ndarray | YolopipeError] = {}
        for i, data in enumerate(datas):
            header = headers[i] if headers is not None else read_jpeg_header(data)
            if header is None or not header.gpu_decodable:
                host[i] = cpu_decode(data)  # not ours, or not a JPEG: OpenCV, or its error
            else:
                gpu.append((i, header))
        return gpu, host

    def decode_into(self, datas: Sequence[bytes], headers: Sequence[JpegHeader], targets: Sequence[int]) -> list[Fallback]:
        """Decode ``datas[k]`` into device memory at ``targets[k]`` (``decoded_size`` × 3 bytes in
        ``self.layout``) on ``self.stream``, with ``lock`` held. Per image: None when it is there,
        else OpenCV's frame of it (the GPU refused it) or its error."""
        out: list[Fallback] = []
        copies = []
        for data, header, dst, img in zip(datas, headers, targets, self._decode_gpu(list(datas), list(headers))):
            if img is not None and (img.height, img.width) == decoded_size(header) and img.layout == self.layout:
                copies.append((dst, img))
                out.append(None)
            else:
                out.append(cpu_decode(data))
        self.gather(copies)
        return out

    def decode(self, datas: Sequence[bytes]) -> list[Decoded]:
        """Decode on ``self.stream`` (call with ``lock`` held); ready in that stream's order."""
        gpu, host = self.split(datas)
        out: list[Decoded | None] = [host.get(i) for i in range(len(datas))]
        if gpu:
            decoded = self._decode_gpu([datas[i] for i, _ in gpu], [h for _, h in gpu])
            for (i, _), result in zip(gpu, decoded):
                out[i] = result if result is not None else cpu_decode(datas[i])
        return out  # type: ignore[return-value]

    def _decode_gpu(self, datas: list[bytes], headers: list[JpegHeader]) -> list[DeviceImage | None]:
        raise NotImplementedError

    def gather(self, copies: list[tuple[int, DeviceImage]]) -> None:
        """``(destination pointer, image)`` device copies on ``self.stream`` (call with ``lock``)."""
        from app.gpu.driver import copy_device_to_device

        copy_device_to_device(
            self._driver, [(dst, img.ptr, img.nbytes) for dst, img in copies], self.stream.cuda_stream
        )

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
            self.stream = None


class NvJpegDecoder(GpuJpegDecoder):
    """torchvision's batched nvJPEG: planar RGB; EXIF applied here (nvJPEG ignores it)."""

    name = "nvjpeg"
    layout = LAYOUT_CHW_RGB

    def __init__(self, device: int = 0) -> None:
        try:
            from torchvision.io import decode_jpeg  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailable("torchvision is not installed", hint="pip install torchvision") from exc
        super().__init__(device)

    def _decode_gpu(self, datas: list[bytes], headers: list[JpegHeader]) -> list[DeviceImage | None]:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg

        encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
        target = torch.device("cuda", self.device)
        with torch.cuda.stream(self.stream), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision's deprecation notice about decode_jpeg
            try:
                decoded = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=target)
            except RuntimeError:
                decoded = []
                for e in encoded:
                    try:
                        decoded.append(decode_jpeg(e, mode=ImageReadMode.RGB, device=target))
                    except RuntimeError:
                        decoded.append(None)
            out: list[DeviceImage | None] = []
            for img, header in zip(decoded, headers):
                if img is None or img.ndim != 3 or img.shape[0] != 3:
                    out.append(None)
                    continue
                img = apply_orientation(img, header.orientation).contiguous()
                out.append(DeviceImage(img.data_ptr(), int(img.shape[1]), int(img.shape[2]), LAYOUT_CHW_RGB, img))
        return out


def make_decoder(decode: str, device: int, threads: int) -> GpuJpegDecoder | None:
    """The GPU decoder ``decode`` names (None for ``opencv``); ``gpu`` takes the best one present."""
    decode = decoder_name(decode)
    if decode == "opencv":
        return None
    if decode == "nvjpeg":
        return NvJpegDecoder(device)
    from app.gpu.nvimgcodec import NvImageCodecDecoder

    try:
        return NvImageCodecDecoder(device, threads=threads)
    except BackendUnavailable as exc:
        if decode == "nvimgcodec":
            raise
        log.warning("GPU JPEG decode: %s; using torchvision's nvJPEG (pixels differ more from OpenCV's)", exc)
        return NvJpegDecoder(device)


def to_host_bgr(img: DeviceImage, stream) -> np.ndarray:
    """A decoded image back on the host as an OpenCV-style BGR ``[H, W, 3]`` frame (for checks)."""
    import torch

    stream.synchronize()
    if isinstance(img.owner, torch.Tensor):
        t = img.owner
    else:  # an nvImageCodec image: a zero-copy torch view through __cuda_array_interface__
        t = torch.as_tensor(img.owner, device=torch.device("cuda", torch.cuda.current_device()))
    hwc = t.permute(1, 2, 0) if img.layout == LAYOUT_CHW_RGB else t
    return np.ascontiguousarray(hwc.cpu().numpy()[..., ::-1])
