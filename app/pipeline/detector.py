"""The one detector API shared by every backend: images (bytes or arrays) in, detections out.

``yolopipe predict`` and the HTTP service both use it. It validates parameters, decodes what
the pipeline does not decode itself, splits work into batches the pipeline takes, and turns
NMS rows in input pixels into detections in original pixels.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from app.boxes import rows_to_detections
from app.config import MAX_PIXELS, VIDEO_DECODERS, check_choice
from app.contracts import DetectParams, DeviceNv12, ImageResult, Pipeline, PipelineInput, PipelineRun, make_params
from app.errors import InvalidParameter, YolopipeError
from app.imaging.check import check_image
from app.imaging.decode import decode_image
from app.imaging.headers import ImageHeader, sniff_format
from app.pipeline.overlap import run_overlapped
from app.types import ModelMeta


class Detector:
    """Owns one pipeline (and through it the backend and every GPU resource).

    ``detect`` and ``detect_batches`` keep up to ``pipeline.max_in_flight`` batches in flight
    (``app.pipeline.overlap``): on the GPU, the decode and upload of one batch overlap with the
    graph of the one before.
    """

    def __init__(self, pipeline: Pipeline, *, max_pixels: int = MAX_PIXELS, video_decode: str = "auto") -> None:
        self.pipeline = pipeline
        self.max_pixels = max_pixels
        self.video_decode = check_choice("video decoder", video_decode, VIDEO_DECODERS)  # app.pipeline.sources

    # --- facts -----------------------------------------------------------------------
    @property
    def meta(self) -> ModelMeta:
        return self.pipeline.meta

    @property
    def names(self) -> list[str]:
        return self.pipeline.meta.names

    def info(self) -> dict[str, Any]:
        return {
            "model": self.meta.name,
            "backend": self.pipeline.backend,
            "precision": self.pipeline.precision,
            "imgsz": self.meta.imgsz,
            "max_batch": self.pipeline.max_batch,
            "class_names": self.names,
            "weights_sha256": self.meta.weights_sha256,
        }

    def params(self, **kwargs: Any) -> DetectParams:
        return make_params(**kwargs, num_classes=len(self.names))

    # --- work ------------------------------------------------------------------------
    def prepare(self, item: bytes | np.ndarray | DeviceNv12, header: ImageHeader | None = None) -> PipelineInput:
        """Decode on the CPU unless the pipeline decodes this item itself (JPEG on the GPU).
        ``header``: the image's, already checked (the service's HTTP workers read it)."""
        if isinstance(item, DeviceNv12):
            if not self.pipeline.takes_nv12:
                raise InvalidParameter(f"the {self.pipeline.backend} pipeline takes no device NV12 frames")
            return item
        if isinstance(item, np.ndarray):
            if item.ndim != 3 or item.shape[2] != 3 or item.dtype != np.uint8:
                raise InvalidParameter(f"arrays must be BGR uint8 [H, W, 3], got {item.dtype} {item.shape}")
            return item
        data = bytes(item)
        if header is None:
            header = check_image(data, max_pixels=self.max_pixels)  # format, size and memory, before any pixel
        if self._gpu_decodes(header):
            return data  # the GPU decodes it; a corrupt one comes back as an error in its slot
        return decode_image(data, max_pixels=self.max_pixels, header=header)

    def decodes_itself(self, header: ImageHeader | None, data: Any = b"") -> bool:
        """Whether the pipeline decodes these bytes (so no CPU decode is needed before it)."""
        if header is None:
            fmt = sniff_format(bytes(data[:16]))
            return self.pipeline.decodes_jpeg and fmt == "jpeg"
        return self._gpu_decodes(header)

    def _gpu_decodes(self, header: ImageHeader) -> bool:
        """The one place that decides it: a JPEG the GPU decoders take (8-bit, 1 or 3 components,
        Huffman); CMYK, 12-bit, arithmetic and lossless ones decode on the CPU, like Ultralytics."""
        if not self.pipeline.decodes_jpeg or header.format != "jpeg":
            return False
        return header.jpeg is None or header.jpeg.gpu_decodable

    def detect(self, items: Sequence[bytes | np.ndarray], params: DetectParams | None = None) -> list[ImageResult]:
        """Detections for each item, in order; a bad item gets an error, the others go on."""
        return self.detect_timed(items, params)[0]

    def detect_timed(
        self, items: Sequence[bytes | np.ndarray], params: DetectParams | None = None
    ) -> tuple[list[ImageResult], dict[str, float]]:
        """``detect``, and the pipeline's stage times of these items' batches (summed over them)."""
        params = params or DetectParams()
        timings: dict[str, float] = {}
        results: list[ImageResult] = [ImageResult() for _ in items]
        ready: list[tuple[int, PipelineInput]] = []
        for i, item in enumerate(items):
            try:
                ready.append((i, self.prepare(item)))
            except YolopipeError as exc:
                results[i].error = exc
        step = self.pipeline.max_batch
        chunks = [ready[start : start + step] for start in range(0, len(ready), step)]

        def run(chunk: list[tuple[int, PipelineInput]]) -> PipelineRun:
            return self.pipeline.run([x for _, x in chunk], params)

        depth = self.pipeline.max_in_flight if len(chunks) > 1 else 1
        for chunk, done in zip(chunks, run_overlapped(run, chunks, depth)):
            for key, value in done.timings.items():
                timings[key] = timings.get(key, 0.0) + value
            for (i, _), out in zip(chunk, done.images):
                if isinstance(out, YolopipeError):
                    results[i].error = out
                    continue
                rows, lb = out
                results[i] = ImageResult(lb.src_w, lb.src_h, rows_to_detections(rows, lb))
        return results, timings

    def detect_batches(
        self, batches: Iterable[Sequence[bytes | np.ndarray]], params: DetectParams | None = None
    ) -> Iterator[list[ImageResult]]:
        """``detect`` on each batch, up to ``pipeline.max_in_flight`` at once; results in order."""
        return run_overlapped(lambda items: self.detect(items, params), batches, self.pipeline.max_in_flight)

    def close(self) -> None:
        self.pipeline.close()

    def __enter__(self) -> Detector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
