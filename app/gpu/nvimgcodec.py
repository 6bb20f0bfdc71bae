"""nvImageCodec, the GPU pipeline's JPEG decoder (``app.gpu.decoded`` has the shared part,
``app.gpu.decode`` the overview).

Its hardware JPEG decoder gets every image it takes (``hardware_takes``), its default chain
(CUDA, hybrid; made on its first need, ``app.gpu.early_decoder``) the rest, OpenCV what both
refuse. ``decode_into`` decodes straight into the batch slot's staging through ``images=`` views
of it, so a batch allocates no Image and copies nothing device-to-device. (Allocation was not
what kept decode from overlapping the engine: nvImageCodec allocates stream-ordered, and every
way of holding the output measured the same under load; the shared hardware queue was, see
``app/gpu/__init__.py``.)

What nvImageCodec reports per image is all an answer rests on: an image counts as decoded in
place only when the call returned it (0.6+ puts None where an image failed; older versions
leave failed ones out of the list, and a call that raises is retried image by image), at its
target, at its size. Its hardware decoder, though, only enqueues a batch and reports every image
a success, whatever the data: a JPEG cut short is never handed to it (its header says so,
``app.imaging.jpeg_structure``), and the pipeline zeroes each image's place before decoding.

The decoders themselves are made by ``app.gpu.early_decoder``: at start-up on a thread of their
own where the runtime started them, else here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from app.gpu import early_decoder
from app.gpu.decoded import IN_PLACE, Answer, DeviceImage, GpuJpegDecoder, cpu_decode, decoded_size
from app.gpu.early_decoder import NVIMGCODEC_OPTIONS
from app.gpu.jpeg import JpegHeader
from app.gpu.preprocess import LAYOUT_HWC_RGB

log = logging.getLogger(__name__)


def hardware_takes(header: JpegHeader) -> bool:
    """What the hardware JPEG decoder accepts (measured on the H200): baseline, gray or
    4:4:4 / 4:2:2 / 4:4:0 / 4:2:0. Progressive and 4:1:1 go straight to the default chain:
    handed to the hardware decoder they fail there, and each failure is a warning line."""
    if header.progressive:
        return False
    return header.components == 1 or header.sampling[0] in ((1, 1), (2, 1), (1, 2), (2, 2))


class NvImageCodecDecoder(GpuJpegDecoder):
    """nvImageCodec, default backends, interleaved RGB uint8 output, EXIF applied."""

    name = "nvimgcodec"

    def __init__(self, device: int = 0, *, threads: int = 8, options: str = NVIMGCODEC_OPTIONS,
                 decoders: early_decoder.NvDecoders | None = None) -> None:
        # the decoders made on their own thread while the process started (early_decoder), else now
        if decoders is None:
            decoders = early_decoder.take(device, threads, options) or early_decoder.make(device, threads, options)
        super().__init__(device)
        self._nv = decoders.nv
        self._params = decoders.params
        self._hw = decoders.hardware
        self._decoders = decoders  # the default chain: decoders.chain(), made on its first need
        self._into = True  # decode_into through images= views; off if this nvImageCodec refuses them

    def decode_into(self, datas: Sequence[bytes], headers: Sequence[JpegHeader], targets: Sequence[int]) -> list[Answer]:
        if not self._into:
            return super().decode_into(datas, headers, targets)
        nv = self._nv
        n = len(datas)
        sizes = [decoded_size(h) for h in headers]
        try:
            views = nv.as_images([_DeviceView(ptr, h, w) for ptr, (h, w) in zip(targets, sizes)],
                                 cuda_stream=self.stream.cuda_stream)
        except Exception as exc:  # noqa: BLE001 - an nvImageCodec without external images: copy instead
            return self._into_off(exc, datas, headers, targets)
        done = [False] * n
        streams: list[Any] = [None] * n
        for k, data in enumerate(datas):
            try:
                streams[k] = nv.CodeStream(data)
            except Exception:  # noqa: BLE001 - unparseable: OpenCV says what is wrong
                pass
        first = [k for k in range(n) if streams[k] is not None and self._hw is not None and hardware_takes(headers[k])]
        rest = [k for k in range(n) if streams[k] is not None and k not in set(first)]
        try:
            self._into_place(self._hw, first, streams, views, targets, sizes, done)
            later = rest + [k for k in first if not done[k]]  # what the hardware decoder was not given, or refused
            if later:
                self._into_place(self._decoders.chain(), later, streams, views, targets, sizes, done)
        except TypeError as exc:  # images= not accepted at all
            return self._into_off(exc, datas, headers, targets)
        return [IN_PLACE if done[k] else cpu_decode(datas[k]) for k in range(n)]

    def _into_place(self, decoder, todo: list[int], streams, views, targets, sizes, done: list[bool]) -> None:
        """``todo``'s images through ``decoder`` (None: none), each marked done if it is in place."""
        if decoder is None or not todo:
            return
        got = self._batch(decoder, [streams[k] for k in todo], [views[k] for k in todo])
        for k, img in zip(todo, got):
            done[k] = img is not None and _is_at(img, targets[k], sizes[k])

    def _into_off(self, exc: Exception, datas, headers, targets) -> list[Answer]:
        log.info("nvImageCodec: no decode into external buffers (%s: %s); decoding then copying",
                 type(exc).__name__, exc)
        self._into = False
        return super().decode_into(datas, headers, targets)

    def _decode_gpu(self, datas: list[bytes], headers: list[JpegHeader]) -> list[DeviceImage | None]:
        streams: list[Any] = []
        for data in datas:
            try:
                streams.append(self._nv.CodeStream(data))
            except Exception:  # noqa: BLE001 - unparseable: OpenCV says what is wrong
                streams.append(None)
        images: list[Any] = [None] * len(datas)
        todo = [k for k, s in enumerate(streams) if s is not None]
        for decoder_of in (lambda: self._hw, self._decoders.chain):
            decoder = decoder_of() if todo else None
            if decoder is None:
                continue
            for k, img in zip(todo, self._batch(decoder, [streams[k] for k in todo])):
                images[k] = img
            todo = [k for k in todo if images[k] is None]  # refused: the next decoder, then OpenCV
        return [self._device_image(img) for img in images]

    def _batch(self, decoder, streams: list[Any], images: list[Any] | None = None) -> list[Any]:
        """One batched call; if it fails as a whole, one call per image (a bad one fails alone)."""
        try:
            got = self._call(decoder, streams, images)
            if len(got) == len(streams):
                return got
        except TypeError:
            raise
        except Exception:  # noqa: BLE001 - retried image by image below
            pass
        out = []
        for k, stream in enumerate(streams):
            try:
                (img,) = self._call(decoder, [stream], None if images is None else [images[k]])
            except Exception:  # noqa: BLE001 - this one goes on to the next decoder
                img = None
            out.append(img)
        return out

    def _call(self, decoder, streams: list[Any], images: list[Any] | None = None) -> list[Any]:
        if images is None:
            return decoder.decode(streams, params=self._params, cuda_stream=self.stream.cuda_stream)
        return decoder.decode(streams, images=images, params=self._params, cuda_stream=self.stream.cuda_stream)

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


class _DeviceView:
    """``height × width × 3`` bytes of device memory at ``ptr``, for ``nvimgcodec.as_images``."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, height: int, width: int) -> None:
        self.__cuda_array_interface__ = {"shape": (height, width, 3), "typestr": "|u1", "data": (int(ptr), False),
                                         "strides": None, "version": 2}


def _is_at(img: Any, ptr: int, size: tuple[int, int]) -> bool:
    """The decoded Image is where it was meant to go, at the size its header said."""
    cai = img.__cuda_array_interface__
    return int(cai["data"][0]) == ptr and tuple(cai["shape"]) == (*size, 3) and cai.get("strides") in (None, (size[1] * 3, 3, 1))
