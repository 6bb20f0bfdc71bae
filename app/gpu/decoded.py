"""What every GPU JPEG decoder shares: the routing of a batch's encoded images, the answers of a
decode into staging, the decoded device image, and the base class.

Both decoder modules build on this one (``app.gpu.decode``: torchvision's nvJPEG and the
overview; ``app.gpu.nvimgcodec``: nvImageCodec) and neither imports the other.

An image's header comes from whoever read its bytes first (an HTTP worker, the detector, a
folder reader): the decoders never parse it again. Every JPEG header comes from the one
parser, which also walked the JPEG's byte structure (``app.imaging.jpeg_structure``), so
routing needs nothing else: a JPEG that cannot decode whole is OpenCV's own error here, before
any decoder is handed it; what only OpenCV decodes as meant goes to OpenCV.

``decode_into`` answers per image: ``IN_PLACE`` only when the decoder reported that image
decoded, whole, at its target; else OpenCV's frame of it (the GPU refused it) or its error. No
other value makes an image valid (``app.gpu.pack.settle_decoded``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from app.config import MAX_PIXELS
from app.errors import InvalidImage, YolopipeError
from app.gpu.preprocess import LAYOUT_HWC_RGB
from app.imaging.check import undecodable
from app.imaging.decode import decode_image
from app.imaging.headers import ImageHeader, JpegHeader, read_header


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


class _InPlace:
    __slots__ = ()

    def __repr__(self) -> str:
        return "IN_PLACE"


IN_PLACE: Final = _InPlace()  # decoded whole at its target, as the decoder reported
Decoded = DeviceImage | np.ndarray | YolopipeError
Answer = _InPlace | np.ndarray | YolopipeError  # decode_into's, per image


def decoded_size(header: JpegHeader) -> tuple[int, int]:
    """``(height, width)`` after the EXIF orientation (5-8 turn the image by 90°)."""
    if header.orientation in (5, 6, 7, 8):
        return header.width, header.height
    return header.height, header.width


def cpu_decode(data: bytes, header: ImageHeader | None = None, *, max_pixels: int = MAX_PIXELS
               ) -> np.ndarray | YolopipeError:
    """OpenCV's BGR frame of ``data`` (Ultralytics' reader), or the image's error. ``header``:
    the image's, when whoever read the bytes has checked it (else it is checked here against
    ``max_pixels``)."""
    try:
        return decode_image(data, max_pixels=max_pixels, header=header)
    except YolopipeError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - any decoder failure is this image's fault
        detail = re.sub(r"\s+", " ", str(exc))[:200]
        return InvalidImage(f"cannot decode image: {detail}")


def route(datas: Sequence[bytes], headers: Sequence[ImageHeader | None]
          ) -> tuple[list[tuple[int, JpegHeader]], dict[int, np.ndarray | YolopipeError]]:
    """The one place that decides what a GPU decoder is handed: ``(index, header)`` of the
    JPEGs it takes; OpenCV's frame (or the error) of every other image. A missing header is
    read here; the limits (pixels, decode memory) are the caller's to check, as the detector
    checks every image before its pipeline sees it."""
    gpu: list[tuple[int, JpegHeader]] = []
    host: dict[int, np.ndarray | YolopipeError] = {}
    for i, (data, given) in enumerate(zip(datas, headers)):
        try:
            header = given if given is not None else read_header(data)
        except YolopipeError as exc:
            host[i] = exc
            continue
        jpeg = header.jpeg
        if jpeg is not None and jpeg.defect is not None:
            host[i] = undecodable(header.format)  # the bytes cannot decode whole: no decoder is asked
        elif jpeg is None or not jpeg.gpu_decodable:
            host[i] = cpu_decode(data, given)  # not ours: OpenCV decodes it (its checks first), or says why not
        else:
            gpu.append((i, jpeg))
    return gpu, host


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
    def split(datas: Sequence[bytes], headers: Sequence[ImageHeader | None] | None = None
              ) -> tuple[list[tuple[int, JpegHeader]], dict[int, np.ndarray | YolopipeError]]:
        """``route``: headers from the caller (None: read here)."""
        return route(datas, headers if headers is not None else [None] * len(datas))

    def decode_into(self, datas: Sequence[bytes], headers: Sequence[JpegHeader], targets: Sequence[int]
                    ) -> list[Answer]:
        """Decode ``datas[k]`` into device memory at ``targets[k]`` (``decoded_size`` × 3 bytes in
        ``self.layout``) on ``self.stream``, with ``lock`` held. Per image: ``IN_PLACE`` when it
        is there, else OpenCV's frame of it (the GPU refused it) or its error."""
        out: list[Answer] = []
        copies = []
        for data, header, dst, img in zip(datas, headers, targets, self._decode_gpu(list(datas), list(headers))):
            if img is not None and (img.height, img.width) == decoded_size(header) and img.layout == self.layout:
                copies.append((dst, img))
                out.append(IN_PLACE)
            else:
                out.append(cpu_decode(data))
        self.gather(copies)
        return out

    def decode(self, datas: Sequence[bytes], headers: Sequence[ImageHeader | None] | None = None) -> list[Decoded]:
        """Decode on ``self.stream`` (call with ``lock`` held); ready in that stream's order."""
        gpu, host = self.split(datas, headers)
        out: list[Decoded | None] = [host.get(i) for i in range(len(datas))]
        if gpu:
            decoded = self._decode_gpu([datas[i] for i, _ in gpu], [h for _, h in gpu])
            for (i, _), result in zip(gpu, decoded):
                out[i] = result if result is not None else cpu_decode(datas[i])
        return out  # type: ignore[return-value]

    def _decode_gpu(self, datas: list[bytes], headers: list[JpegHeader]) -> list[DeviceImage | None]:
        """One ``DeviceImage`` per image the decoder reported decoded, None for each it did not."""
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
