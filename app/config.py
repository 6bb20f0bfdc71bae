"""The one vocabulary: backends, precisions, decoders and limits.

Every name a user can type for a backend, precision or decoder, and every limit a request is
held to, is spelled here once; the CLI, the HTTP schema, the pipelines and the service's
settings (``app.settings``) import these. Plain Python: ``predict`` imports it on its way to
the first result, and pydantic stays out of that path.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

BackendName = Literal["auto", "onnxruntime", "torch-cuda", "tensorrt"]
Precision = Literal["auto", "fp32", "fp16", "int8"]
DecodeName = Literal["gpu", "nvimgcodec", "nvjpeg", "opencv"]  # GPU backends' JPEG; gpu: nvImageCodec, else nvJPEG
BACKENDS: tuple[str, ...] = get_args(BackendName)
PRECISIONS: tuple[str, ...] = get_args(Precision)
DECODERS: tuple[str, ...] = get_args(DecodeName)
# How an image is placed in the model input: rect, Ultralytics' ``model.predict(source)`` default on
# a .pt (the long side to imgsz, padded to the next multiple of the stride); square: the imgsz
# square (its exported engines, ``rect=False``). ``app.imaging.letterbox``.
LetterboxName = Literal["rect", "square"]
LETTERBOXES: tuple[str, ...] = get_args(LetterboxName)
VideoDecodeName = Literal["auto", "nvdec", "opencv"]  # videos and streams; auto: NVDEC on a GPU, else OpenCV (app.predict.sources)
VIDEO_DECODERS: tuple[str, ...] = get_args(VideoDecodeName)
# Old spellings still accepted, each resolved here only (``decoder_name``): ``cpu`` was the JPEG
# decoders' name for OpenCV, the decoder the video decoders call ``opencv``.
DECODER_ALIASES = {"cpu": "opencv"}
ENGINE_PRECISIONS = ("int8", "fp16", "fp32")  # what "auto" resolves to, fastest first

# --- detection defaults (Ultralytics' own) ---------------------------------------------------
CONF = 0.25  # confidence threshold
IOU = 0.7  # NMS IoU threshold

# --- limits: one ceiling each, shared by the CLI, the HTTP schema and the pipelines -----------
MAX_DET = 300  # most detections per image; GPU result buffers are sized for it (Ultralytics' default too)
MAX_PIXELS = 50_000_000  # per image, read from the header before decoding (decompression-bomb guard)
MAX_BATCH = 256  # largest batch a pipeline or engine profile is built for

# --- batch defaults: one per purpose ---------------------------------------------------------
SERVE_MAX_BATCH = 32  # the service's batcher (Settings.max_batch) and RunShape's default
PREDICT_BATCH = 64  # `yolopipe predict --batch` (with --ray too): the run shape's max_batch its detector opens with
IN_FLIGHT = 3  # batches in flight at once on a GPU pipeline (each its own BatchSlot); the CPU runs 1
GPU_HOST_THREADS = 16  # most host threads of a GPU pipeline (frame packing, OpenCV decodes, nvImageCodec's CPU work)
MAX_WAIT_MS = 2.0  # longest wait for a batch to fill: the service's batcher and every stream runner
MAX_STREAMS = 16  # video streams one stream runner (one inference worker) runs at once
# ONNX Runtime on a CPU spends the same time per image at batch 1 to 16, and its arena holds
# ~47 MB an image at 640: 4 keeps a server's peak within ~500 MB (bench/memory_probe.py --engine-sweep).
CPU_MAX_BATCH = 4
ENGINE_OPT_BATCH = 8  # a TensorRT engine's optimization profile: the batch it is tuned for...
ENGINE_MAX_BATCH = 64  # ...and the largest it takes
# What one decode may hold at its peak: a 50 MP 8-bit image of any format (~300 MB) or a 50 MP
# 16-bit TIFF in strips (~700 MB); an image whose tiles or strips need more is refused.
MAX_DECODE_BYTES = 768 * 2**20
# Decode work a header cannot show: a progressive JPEG decodes every scan over the whole image
# (encoders write about 10; a crafted one thousands), a PNG inflates all its compressed data.
MAX_JPEG_SCANS = 40
MAX_REQUEST_PIXELS = 4 * MAX_PIXELS  # summed over the images of one batch request, from their headers
MAX_SHM_REGIONS = 256  # shared-memory regions registered at once (the whole server)


# --- NVDEC streams (app.predict.decode_pool): decoder threads of a stream runner --------------
NVDEC_THREADS_PER_ENGINE = 1  # more decoded less on the H200 (bench/results/2026-12-03-nvidia-h200-issue36-README.md)
NVDEC_THREADS_UNKNOWN = 8  # when the GPU does not say how many engines it has


NVDEC_READERS = ("simple", "threaded")  # app.gpu.nvdec.READERS: SimpleDecoder, ThreadedDecoder


def gpu_host_threads() -> int:
    """A GPU pipeline's host threads: one per core, at most ``GPU_HOST_THREADS``."""
    return min(GPU_HOST_THREADS, os.cpu_count() or 1)


def nvdec_reader() -> str:
    """How NVDEC reads files: ``YOLOPIPE_NVDEC_READER`` (``simple``: PyNvVideoCodec's
    SimpleDecoder, a decode call's batch at a time; ``threaded``: its ThreadedDecoder, which
    decodes ahead on a native thread of its own), default ``simple``."""
    import os

    return check_choice("NVDEC reader", os.environ.get("YOLOPIPE_NVDEC_READER", "simple"), NVDEC_READERS)


def nvdec_threads(engines: int) -> int:
    """The decoder threads of a stream runner's NVDEC pool: ``YOLOPIPE_NVDEC_THREADS``, else
    ``NVDEC_THREADS_PER_ENGINE`` per NVDEC engine of the GPU (``engines``; 0: unknown)."""
    import os

    if env := os.environ.get("YOLOPIPE_NVDEC_THREADS"):
        if not env.isdigit() or int(env) < 1:
            from app.errors import InvalidParameter

            raise InvalidParameter(f"YOLOPIPE_NVDEC_THREADS must be a whole number >= 1, got {env!r}")
        return int(env)
    return engines * NVDEC_THREADS_PER_ENGINE if engines > 0 else NVDEC_THREADS_UNKNOWN


def check_imgsz(imgsz: int) -> int:
    """``imgsz`` when a model can take it (a multiple of its largest stride, 32); else ``InvalidParameter``."""
    if imgsz % 32 or not 32 <= imgsz <= 4096:
        from app.errors import InvalidParameter

        raise InvalidParameter(f"imgsz must be a multiple of 32 (the model's largest stride) in [32, 4096], got {imgsz}")
    return imgsz


def decoder_name(value: str, *, video: bool = False) -> str:
    """A JPEG decoder's name (``video``: a video decoder's), its deprecated alias resolved; else
    ``InvalidParameter`` naming the choices."""
    value = DECODER_ALIASES.get(value, value)
    return check_choice("video decoder" if video else "decoder", value, VIDEO_DECODERS if video else DECODERS)


def check_choice(kind: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` when it is one of ``choices``; else ``InvalidParameter`` naming them."""
    if value not in choices:
        from app.errors import InvalidParameter

        raise InvalidParameter(f"unknown {kind} {value!r}; choose one of {', '.join(choices)}")
    return value
