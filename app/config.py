"""Typed settings, from CLI flags or ``YOLOPIPE_*`` environment variables.

Built on demand (``Settings()``), never at import, so tests and the CLI choose their values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

BackendName = Literal["auto", "onnxruntime", "torch-cuda", "tensorrt"]
Precision = Literal["auto", "fp32", "fp16", "int8"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="YOLOPIPE_", env_file=None, extra="ignore")

    weights: str = "sample"
    engines_dir: Path = Path("engines")
    imgsz: int = Field(640, ge=32, le=4096)
    backend: BackendName = "auto"
    precision: Precision = "auto"
    device: int = Field(0, ge=0)
    compile: bool = True  # torch-cuda: torch.compile each batch bucket (~20 s each, cached on disk)

    # serving
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_batch: int = Field(32, ge=1, le=256)
    max_wait_ms: float = Field(2.0, ge=0, le=1000)
    max_queue: int = Field(512, ge=1)
    request_timeout_s: float = Field(30.0, gt=0)
    max_body_bytes: int = Field(20 * 1024 * 1024, ge=1024)
    max_pixels: int = Field(50_000_000, ge=1)
