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
``cpu``        OpenCV in the pipeline's host threads: bit-exact with Ultralytics
=============  ===========================================================================

A GPU decoder returns, per image, a ``DeviceImage`` (a device buffer it owns, RGB, with its
layout) or, for what it does not take, OpenCV's BGR frame or the image's error: CMYK/YCCK,
12-bit, arithmetic-coded and lossless JPEGs are decoded by OpenCV up front
(``app.gpu.jpeg``), and an image the GPU decoder refuses falls back to OpenCV alone, not
its batch. EXIF orientation is applied as OpenCV applies it.

The pipeline then copies the device images into its staging buffer (``gather``, one driver
call per image, on the decoder's stream) and records an event there that the compute stream
waits for; the decoder's buffers are released in stream order after those copies. A decoder
serves one batch at a time (``lock``): a decode of 128 photos takes about half the engine's
time for them, so one decoder keeps ahead of the engine.
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

from app.config import DECODERS, check_choice
from app.errors import BackendUnavailable, InvalidImage, YolopipeError
from app.gpu.jpeg import JpegHeader, apply_orientation, read_jpeg_header
from app.gpu.preprocess import LAYOUT_CHW_RGB, LAYOUT_HWC_RGB
from app.imaging.decode import decode_image

log = logging.getLogger(__name__)

# libjpeg-turbo (OpenCV, Ultralytics) interpolates subsampled chroma ("fancy upsampling");
# nvImageCodec's CUDA decoder does the same when told.
NVIMGCODEC_OPTIONS = ":fancy_upsampling=1"


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


def cpu_decode(data: bytes) -> np.ndarray | YolopipeError:
    """OpenCV's BGR frame of ``data`` (Ultralytics' reader), or the image's error."""
    try:
        return decode_image(data)
    except YolopipeError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - any decoder failure is this image's fault
        detail = re.sub(r"\s+", " ", str(exc))[:200]
        return InvalidImage(f"cannot decode image: {detail}")


class GpuJpegDecoder:
    """Shared by the GPU decoders: the stream, the lock, routing and the gather."""

    name = ""

    def __init__(self, device: int) -> None:
        import torch

        from app.gpu.driver import cuda_driver

        self.device = int(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.lock = threading.Lock()
        self._driver = cuda_driver()

    def decode(self, datas: Sequence[bytes]) -> list[Decoded]:
        """Decode on ``self.stream`` (call with ``lock`` held); ready in that stream's order."""
        out: list[Decoded | None] = [None] * len(datas)
        todo: list[int] = []
        headers: list[JpegHeader] = []
        for i, data in enumerate(datas):
            header = read_jpeg_header(data)
            if header is None or not header.gpu_decodable:
                out[i] = cpu_decode(data)  # not ours, or not a JPEG: OpenCV, or its error
            else:
                todo.append(i)
                headers.append(header)
        if todo:
            for i, result in zip(todo, self._decode_gpu([datas[i] for i in todo], headers)):
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


class NvImageCodecDecoder(GpuJpegDecoder):
    """nvImageCodec, default backends, interleaved RGB uint8 output, EXIF applied."""

    name = "nvimgcodec"

    def __init__(self, device: int = 0, *, threads: int = 8, options: str = NVIMGCODEC_OPTIONS) -> None:
        try:
            from nvidia import nvimgcodec
        except ImportError as exc:
            raise BackendUnavailable(
                "nvImageCodec is not installed", hint="pip install 'yolopipe[cuda13]' (or [cuda12])"
            ) from exc
        super().__init__(device)
        self._nv = nvimgcodec
        try:
            self._params = nvimgcodec.DecodeParams(
                apply_exif_orientation=True, color_spec=nvimgcodec.ColorSpec.SRGB, allow_any_depth=False
            )
            self._chain = nvimgcodec.Decoder(device_id=self.device, max_num_cpu_threads=threads, options=options)
        except Exception as exc:  # e.g. no nvJPEG library: the caller falls back
            raise BackendUnavailable(f"nvImageCodec could not start a decoder: {type(exc).__name__}: {exc}") from exc
        self._hw = self._hardware_decoder(nvimgcodec, options)

    def _hardware_decoder(self, nv, options: str):
        """The hardware JPEG decoder alone, or None where there is none.

        Measured on the H200 (bench ``decoders`` rows): alone it decodes baseline JPEGs at
        11,800 img/s with libjpeg-turbo's pixels (one value in 75,000 off by one level) and no
        CPU or SM time, while nvImageCodec's default chain (which hands part of a batch to its
        CUDA and hybrid decoders) did 7,400 img/s and competed with the engine for the SMs and
        with the host for the CPU. So it gets every image first; what it refuses (progressive,
        4:1:1, ...) goes to the default chain, image by image.
        """
        try:
            return nv.Decoder(device_id=self.device, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)], options=options)
        except Exception as exc:  # noqa: BLE001 - no hardware decoder here: the chain does it all
            log.info("nvImageCodec: no hardware JPEG decoder (%s)", exc)
            return None

    def _decode_gpu(self, datas: list[bytes], headers: list[JpegHeader]) -> list[DeviceImage | None]:
        streams: list[Any] = []
        for data in datas:
            try:
                streams.append(self._nv.CodeStream(data))
            except Exception:  # noqa: BLE001 - unparseable: OpenCV says what is wrong
                streams.append(None)
        images: list[Any] = [None] * len(datas)
        todo = [k for k, s in enumerate(streams) if s is not None]
        for decoder in (self._hw, self._chain):
            if decoder is None or not todo:
                continue
            for k, img in zip(todo, self._batch(decoder, [streams[k] for k in todo])):
                images[k] = img
            todo = [k for k in todo if images[k] is None]  # refused: the next decoder, then OpenCV
        return [self._device_image(img) for img in images]

    def _batch(self, decoder, streams: list[Any]) -> list[Any]:
        """One batched call; if it fails as a whole, one call per image (a bad one fails alone)."""
        try:
            got = self._call(decoder, streams)
            if len(got) == len(streams):
                return got
        except Exception:  # noqa: BLE001 - retried image by image below
            pass
        out = []
        for stream in streams:
            try:
                (img,) = self._call(decoder, [stream])
            except Exception:  # noqa: BLE001 - this one goes on to the next decoder
                img = None
            out.append(img)
        return out

    def _call(self, decoder, streams: list[Any]) -> list[Any]:
        return decoder.decode(streams, params=self._params, cuda_stream=self.stream.cuda_stream)

    @staticmethod
    def _device_image(img: Any) -> DeviceImage | None:
        if img is None:
            return None
        cai = img.__cuda_array_interface__
        shape, strides = tuple(cai["shape"]), cai.get("strides")
        if len(shape) != 3 or shape[2] != 3 or cai["typestr"] != "|u1":
            return None
        if strides is not None and tuple(strides) != (shape[1] * 3, 3, 1):  # padded rows: not packed
            return None
        return DeviceImage(int(cai["data"][0]), int(shape[0]), int(shape[1]), LAYOUT_HWC_RGB, img)


class NvJpegDecoder(GpuJpegDecoder):
    """torchvision's batched nvJPEG: planar RGB; EXIF applied here (nvJPEG ignores it)."""

    name = "nvjpeg"

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
    """The GPU decoder ``decode`` names (None for ``cpu``); ``gpu`` takes the best one present."""
    check_choice("decoder", decode, DECODERS)
    if decode == "cpu":
        return None
    if decode == "nvjpeg":
        return NvJpegDecoder(device)
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
