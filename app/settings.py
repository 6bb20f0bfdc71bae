"""The service's typed settings (``Settings``): built on demand (``Settings()``), never at
import, so tests and the CLI choose their values (flags, or ``YOLOPIPE_*`` environment
variables). Its names and limits are ``app.config``'s vocabulary; pydantic is imported here
alone, so that ``predict`` does not load it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.config import (
    DECODER_ALIASES,
    MAX_BATCH,
    MAX_PIXELS,
    MAX_STREAMS,
    MAX_WAIT_MS,
    SERVE_MAX_BATCH,
    BackendName,
    DecodeName,
    LetterboxName,
    Precision,
)


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

