"""Typed settings and the one vocabulary: backends, precisions, decoders and limits.

Every name a user can type for a backend, precision or decoder, and every limit a request is
held to, is spelled here once; the CLI, the HTTP schema and the pipelines import these.
Settings are built on demand (``Settings()``), never at import, so tests and the CLI choose
their values (flags, or ``YOLOPIPE_*`` environment variables).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="YOLOPIPE_", env_file=None, extra="ignore")

    weights: str = "sample"
    artifacts_dir: Path | None = None  # None: app.artifacts.store.artifacts_root()
    imgsz: int = Field(640, ge=32, le=4096)
    backend: BackendName = "auto"
    precision: Precision = "auto"
    decode: DecodeName = "gpu"  # GPU backends only; the CPU backend decodes with OpenCV (cpu: alias of opencv)
    device: int = Field(0, ge=0)
    compile: bool = True  # torch-cuda: the engine compiled ahead of time (app.builder.torch_build); False: eager
    batch_invariant: bool = True  # torch-cuda: that engine's kernels give an image one answer in any batch
    ort_threads: int = Field(0, ge=0)  # onnxruntime intra-op threads; 0: its default
    letterbox: LetterboxName = "rect"  # rect: Ultralytics' predict default; square: imgsz × imgsz (serve --square)

    # serving
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_batch: int = Field(SERVE_MAX_BATCH, ge=1, le=MAX_BATCH)
    max_wait_ms: float = Field(MAX_WAIT_MS, ge=0, le=1000)
    max_images_per_request: int = Field(256, ge=1)  # files in one /v1/detect/batch body
    request_timeout_s: float = Field(30.0, gt=0)
    max_body_bytes: int = Field(20 * 1024 * 1024, ge=1024)
    max_stream_body_bytes: int = Field(4096, ge=256)  # a /v1/streams request body (JSON): 413 beyond
    max_requests_in_flight: int = Field(256, ge=0)  # requests with a body one HTTP worker holds at once (0: any)
    max_pixels: int = Field(MAX_PIXELS, ge=1)
    workers: int = Field(0, ge=0, le=256)  # HTTP worker processes; 0: from the core count
    # KServe v2 gRPC; not given: port + 1 (8000 → 8001, Triton's pair of defaults), so a server moved
    # with --port alone never collides with another's gRPC port; 0: no gRPC
    grpc_port: int = Field(None, ge=0, le=65535, validate_default=True)  # type: ignore[assignment]
    grpc_workers: int = Field(0, ge=0, le=256)  # gRPC worker processes; 0: as many as HTTP workers
    # Triton's system shared-memory extension (REST and gRPC): off, as Triton's --allow-client-shm
    allow_client_shm: bool = False
    gpus: str = "all"  # 'all' visible GPUs, or CUDA indices like '0,1': one inference worker each
    cpu_workers: int = Field(1, ge=1, le=16)  # inference workers when the model runs on the CPU
    queue_budget_s: float | None = Field(None, gt=0)  # refuse work past this many seconds (default: the timeout)
    request_window: int = Field(0, ge=0)  # images of one request admitted at once (0: the run's max_batch)
    ring_mb: int = Field(32, ge=1)  # shared memory per HTTP worker and inference worker for image bytes
    max_streams: int = Field(MAX_STREAMS, ge=0, le=1024)  # video streams one inference worker runs at once (/v1/streams)
    stream_open_timeout_s: float = Field(5.0, gt=0, le=600)  # a stream source silent this long fails (and retries)
    stream_files_root: Path | None = None  # /v1/streams may read video files under this folder (None: URLs only)
    standby: bool = True  # a warm standby per inference worker, which takes over when it dies
    idle_release_s: float = Field(2.0, ge=0)  # quiet seconds before a serving process frees what a burst took (0: never)
    # HTTP/1.1 limits the protocol enforces (app.api.protocol)
    max_url_bytes: int = Field(8 * 1024, ge=256)  # the request target (path and query): 414 beyond
    max_head_bytes: int = Field(64 * 1024, ge=1024)  # request line and headers, or chunked trailers: 431 beyond
    head_timeout_s: float = Field(10.0, gt=0)  # first byte of a request to its last header: 408 beyond
    body_idle_timeout_s: float = Field(15.0, gt=0)  # longest silence while a body is awaited: 408 beyond
    keep_alive_s: int = Field(30, ge=1)  # idle time between requests on one connection

    @field_validator("grpc_port", mode="before")
    @classmethod
    def _grpc_port_default(cls, value: object, info: ValidationInfo) -> object:
        """Not given (None): the HTTP port + 1; --port 65535 leaves none, which is an error."""
        if value is not None:
            return value
        port = info.data.get("port")
        if not isinstance(port, int):
            return 0  # port itself is invalid: its own error says so
        if port >= 65535:
            raise ValueError(f"not given, it would be --port + 1 = {port + 1}, past the last port; "
                             "give --grpc-port N, or --grpc-port 0 for no gRPC")
        return port + 1

    @field_validator("decode", mode="before")
    @classmethod
    def _decoder_alias(cls, value: object) -> object:
        return DECODER_ALIASES.get(value, value) if isinstance(value, str) else value

    @property
    def budget_s(self) -> float:
        """Seconds of queued work past which new work is refused (503)."""
        return self.queue_budget_s or self.request_timeout_s

    def window(self, max_batch: int) -> int:
        """Images of one request at the inference workers at once: ``request_window``, else the
        run's ``max_batch`` as the inference workers clamped it (``RunShape``; their hello says it)."""
        return self.request_window or max_batch

    @property
    def ring_bytes(self) -> int:
        # Room for the largest body twice over, so one big image never finds the ring too small.
        return max(self.ring_mb * 2**20, 2 * self.max_body_bytes)

