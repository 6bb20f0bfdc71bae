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
12-bit, arithmetic-coded and lossless JPEGs are decoded by OpenCV up front, and an image the
GPU decoder refuses falls back to OpenCV alone, not its batch. A JPEG whose bytes cannot decode
whole (cut short, structurally corrupt: its header says so, ``app.imaging.jpeg_structure``) is
OpenCV's error before any decoder sees it (``app.gpu.decoded.route``). EXIF orientation is
applied as OpenCV applies it.

The pipeline's path is ``decode_into``: every JPEG's decoded size is known from its header
(EXIF orientation included), so the pipeline reserves its place in the batch slot's device
staging first (filled with zeros, so what a decoder leaves unwritten is never a previous
image's pixels) and nvImageCodec decodes straight into it (``images=`` views of that buffer):
no Image allocated per image, no device-to-device copy per image. torchvision's nvJPEG decodes
into its own tensors, which are then copied into place (``gather``). The compute stream waits
for an event recorded on the decoder's stream after the batch. A decoder serves one batch at
a time (``lock``): a decode of 128 photos takes about half the engine's time for them, so one
decoder keeps ahead of the engine, provided its streams do not share a hardware queue with
the engine's (``app/gpu/__init__.py``: ``CUDA_DEVICE_MAX_CONNECTIONS``).

A pipeline keeps its decoders in ``Decoders`` (closed with it) and sends each batch's JPEGs to
the one in use, or to OpenCV, by ``split_jpegs``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from app.config import decoder_name
from app.contracts import EncodedImage
from app.errors import BackendUnavailable
from app.gpu.decoded import DeviceImage, GpuJpegDecoder, cpu_decode, decoded_size  # noqa: F401 (shared, named here too)
from app.gpu.jpeg import JpegHeader, apply_orientation
from app.gpu.preprocess import LAYOUT_CHW_RGB

log = logging.getLogger(__name__)


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


class Decoders:
    """A pipeline's JPEG decoders (``make_decoder``'s; None for ``opencv``), one per ``decode``
    value its runs name (``RunShape.decode``), each made on its first use and kept until
    ``close``, which closes them all."""

    def __init__(self, device: int, threads: int) -> None:
        self.device, self.threads = device, threads
        self.by_name: dict[str, GpuJpegDecoder | None] = {}
        self._lock = threading.Lock()  # runs on several threads may ask for a new one at once

    def get(self, decode: str) -> GpuJpegDecoder | None:
        """The decoder of ``decode`` (an old alias resolved); None: OpenCV in the host threads.
        Made now if it is new, so that a missing library shows on its first use."""
        decode = decoder_name(decode)
        with self._lock:
            if decode not in self.by_name:
                self.by_name[decode] = make_decoder(decode, self.device, self.threads)
            return self.by_name[decode]

    def name_of(self, decode: str) -> str:
        """What decodes JPEG under ``decode``: ``nvimgcodec``, ``nvjpeg`` or ``opencv``."""
        decoder = self.get(decode)
        return decoder.name if decoder is not None else "opencv"

    def close(self) -> None:
        for decoder in self.by_name.values():
            if decoder is not None:
                with contextlib.suppress(Exception):
                    decoder.close()
        self.by_name.clear()


def decode_on_host(jpegs: Sequence[EncodedImage], max_pixels: int, pool: Callable[[], Executor]) -> list:
    """``decode="opencv"``: OpenCV's frames of ``jpegs`` (their headers already read), or errors;
    more than one on ``pool()``'s threads."""
    def one(image: EncodedImage) -> Any:
        return cpu_decode(image.data, image.header, max_pixels=max_pixels)

    if len(jpegs) == 1:
        return [one(jpegs[0])]
    return list(pool().map(one, jpegs))


def split_jpegs(decoder: GpuJpegDecoder | None, jpegs: Sequence[EncodedImage], max_pixels: int,
                pool: Callable[[], Executor]) -> tuple[list[tuple[int, JpegHeader]], dict[int, Any]]:
    """The JPEGs ``decoder`` decodes in place (``(k, header)`` for ``jpegs[k]``), routed by the
    headers that came with the bytes (none is parsed again), and the others' answers by ``k``:
    OpenCV's frames or errors. No ``decoder`` (``opencv``): all of them by ``decode_on_host``."""
    if decoder is None:
        return [], dict(enumerate(decode_on_host(jpegs, max_pixels, pool))) if jpegs else {}
    return decoder.split([x.data for x in jpegs], [x.header for x in jpegs])


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
