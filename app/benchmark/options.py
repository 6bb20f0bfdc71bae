"""The benchmark's options: one dataclass, each field with its help text, so every front end
(``yolopipe bench`` in Typer, ``python -m app.benchmark`` in argparse) shows the same ones."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

PARTS = ("torch-cuda", "onnxruntime", "tensorrt", "ultralytics", "fp32", "pipelined", "bare", "nms", "folder",
         "decoders", "fidelity")


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class BenchOptions:
    out: Path | None = _opt(None, "result JSON (default: ./yolopipe-bench-<date>-<gpu-name or cpu>.json in the current "
                                  "directory)")
    images: Path | None = _opt(None, "folder of JPEGs to time (default: Ultralytics' bus.jpg and zidane.jpg plus "
                                     "resized and flipped variants)")
    weights: str = _opt("sample", "weights: a .pt path, an Ultralytics name, or 'sample'")
    artifacts_dir: Path | None = _opt(None, "where exports and engines are kept (default: the user's artifacts store, ~/.cache/yolopipe/artifacts)")
    batches: tuple[int, ...] = _opt((), "serial rows' batch sizes (default 1,8,32,128 on a GPU, 1,8 on a CPU)")
    iters: int = _opt(0, "timed calls per serial row (default 50; 3 with --quick)")
    warmup: int = _opt(-1, "untimed calls before each serial row (default 5; 1 with --quick)")
    quick: bool = _opt(False, "few iterations and a small folder: proves the benchmark runs")
    compile: str = _opt("fp16", "run the torch-cuda engine compiled ahead of time for these precisions: none "
                                "(eager), fp16 or all (an AOTInductor package, built once into the artifacts folder)",
                        choices=("none", "fp16", "all"))
    pipelined_batches: tuple[int, ...] = _opt((32, 64, 128), "batch sizes of the throughput rows (GPU)")
    pipelined_images: int = _opt(0, "images per throughput row (default 4096; 256 with --quick)")
    decoders: tuple[str, ...] = _opt(("gpu", "opencv"), "JPEG decoders of the throughput rows: gpu (nvImageCodec, "
                                                        "else nvJPEG), nvimgcodec, nvjpeg, opencv (OpenCV threads)")
    folder_images: int = _opt(10_000, "JPEGs in the folder benchmark (copies of the images; 0 skips it)")
    folder_batch: int = _opt(128, "batch size of the folder benchmark, for yolopipe and Ultralytics alike")
    budget_s: float = _opt(330.0, "wall-clock budget: a part that would start later is skipped (and listed)")
    row_max_s: float = _opt(4.0, "time cap of one serial row (at least 3 timed calls)")
    skip: tuple[str, ...] = _opt((), "parts to skip: " + ",".join(PARTS))
    cpu: bool = _opt(False, "ignore the GPU")

    def resolved(self, gpu: bool) -> BenchOptions:
        """A copy with every default that depends on --quick or on the machine filled in."""
        out = BenchOptions(**{f.name: getattr(self, f.name) for f in fields(self)})
        out.iters = self.iters or (3 if self.quick else 50)
        out.warmup = self.warmup if self.warmup >= 0 else (1 if self.quick else 5)
        out.batches = tuple(self.batches) or ((1, 8, 32, 128) if gpu else (1, 8))
        out.pipelined_images = self.pipelined_images or (256 if self.quick else 4096)
        if self.quick and self.folder_images == 10_000:
            out.folder_images = 512
        out.out = self.out or default_out(gpu)
        unknown = set(self.skip) - set(PARTS)
        if unknown:
            from app.errors import InvalidParameter

            raise InvalidParameter(f"unknown parts to skip: {', '.join(sorted(unknown))}; known: {', '.join(PARTS)}")
        return out

    def wants(self, part: str) -> bool:
        return part not in self.skip


def default_out(gpu: bool) -> Path:
    """A file in the current directory, never inside the installed package or a source tree."""
    tag = "cpu"
    if gpu:
        import torch

        tag = torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "-").lower()
    return Path.cwd() / f"yolopipe-bench-{dt.date.today().isoformat()}-{tag}.json"

