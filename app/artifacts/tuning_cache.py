"""The tuning cache: what a batch-invariant build's kernel tuning chose, in one small file that
a later build on the same GPU type and software reads instead of tuning again, in the spirit of
TensorRT's timing cache.

A batch-invariant build (``app.builder.torch_build``) tunes every distinct convolution of the
model: inductor compiles each candidate Triton template and times it (bench/results: about 7 s
a convolution, 41 of them in YOLOv8s at 640, where every candidate is timed; 1.3 s where a first
build times only the tiles that won on its compute capability, ``app.builder.narrowed_choices``).
What it learns lives in inductor's cache folder as two kinds of small record, which this file
holds and gives back (``app.builder.tuning``):

* ``templates``: inductor's autotuning table (``cache/<system hash>`` under its folder): for each
  operator and input shape, every candidate's time. A build that finds every candidate of a
  convolution there neither compiles nor times any of them;
* ``kernels``: the launch settings chosen for each generated pointwise kernel
  (``<kernel>.best_config``), keyed by the kernel's path, which is the hash of its source;
* ``best_tiles``: the tile settings of each tuned operator's two fastest templates, so that a
  build from the cache generates only those candidates (``app.builder.narrowed_choices``). A cache
  written before they were recorded has none: its next build generates every candidate and adds
  them. The committed caches' tiles, merged per compute capability, are what a first build on a
  card without a cache times (the package's ``architecture_tiles.json``).

A cache fits a build when every fact of its ``TuningKey`` is the build's: the GPU's name and
compute capability, torch, Triton and CUDA (timings and kernels differ with each), and the traced
graph's operators and shapes (``graph``; not its weights, so retrained weights of one architecture
share a cache), and the batch the graph was traced and tuned at (``tuning_batch``: each candidate's
time is taken at that size; a key without it is from a build that traced batch 2). A cache that does
not fit is not read, and the build says why. Pure logic, no
torch import: the facts are passed in.

Where it lives: ``<model folder>/torch-cache/tuning.json`` by default; ``yolopipe build-engine
--tuning-cache FILE`` names another for one build, and ``YOLOPIPE_TUNING_CACHE`` for every build
(``predict`` and ``serve`` build too): a file copied between machines of one GPU type, or one
committed under ``bench/tuning/`` for the sample model. A build reads it when it fits and writes
its own tunings to it afterwards.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from app.artifacts.store import write_atomically
from app.errors import ArtifactError

TUNING_CACHE_NAME = "tuning.json"  # in the model folder's torch-cache/
TUNING_CACHE_FORMAT = 1
OLDER_TUNING_BATCH = 2  # a key without ``tuning_batch``: every build before it was recorded traced batch 2
MAX_TUNING_CACHE_BYTES = 1 << 20  # a cache this size holds thousands of tunings: more is not one
# A first build's seconds per tuning of every candidate: bench/results/2026-12-05-nvidia-h100-build-times.json
# (H100: 40 tunings in 338 s); the H200's 2026-12-03 build tuned at about 7 s each. Narrowed to the
# tiles that won on its compute capability (228 of 1,040 candidates), an H100's 40 tunings took 50 s
# after the first (2026-12-06-nvidia-h100-build-first.json). A card not measured is given the
# slowest. The rest of a build (export, lowering, the chosen kernels and the wrapper compiled, the
# checks): 30 s from a tuning cache that holds each operator's best tiles, on an H100
# (2026-12-06-nvidia-h100-build-narrowed-ab.json: 27 and 30 s; a cache without them, 33-43 s);
# 35 s around a first build's tunings (the narrowed first build above: 85 s in all).
SECONDS_PER_TUNING = {"NVIDIA H200": 7.0, "NVIDIA H100 80GB HBM3": 8.7}
NARROWED_SECONDS_PER_TUNING = {"NVIDIA H100 80GB HBM3": 1.3}
BUILD_REST_S = 30.0
FIRST_BUILD_REST_S = 35.0
TYPICAL_TUNINGS = 40  # distinct convolutions and 1x1 convolutions (as matrix products) of YOLOv8 at 640


@dataclass(frozen=True)
class TuningKey:
    """Every fact the tunings depend on; a cache is read only where all of them are the build's."""

    gpu_name: str  # e.g. "NVIDIA H200"
    compute_capability: str  # "major.minor"
    torch_version: str
    triton_version: str
    cuda_version: str
    graph: str  # sha256 of the traced graph's operators, shapes and dtypes (app.builder.tuning)
    tuning_batch: int  # the batch traced, at which inductor timed every candidate
    format: int = TUNING_CACHE_FORMAT

    def mismatch(self, other: TuningKey) -> list[str]:
        """Why tunings made under ``self`` may not serve a build under ``other`` (empty: they may)."""
        names = {"gpu_name": "GPU", "compute_capability": "compute capability", "torch_version": "torch",
                 "triton_version": "Triton", "cuda_version": "CUDA", "format": "format"}
        problems = [f"{label} {getattr(self, name)} made it, this build has {getattr(other, name)}"
                    for name, label in names.items() if getattr(self, name) != getattr(other, name)]
        if self.graph != other.graph:
            problems.append(f"it was tuned for another model graph ({self.graph[:12]}, this is {other.graph[:12]})")
        if self.tuning_batch != other.tuning_batch:
            problems.append(f"it was tuned at batch {self.tuning_batch}, this build tunes at batch {other.tuning_batch}")
        return problems


@dataclass(frozen=True)
class TuningCache:
    key: TuningKey
    templates: dict[str, Any] = field(default_factory=dict)  # inductor's autotuning table
    kernels: dict[str, Any] = field(default_factory=dict)  # kernel path → its chosen launch settings
    tunings: int = 0  # distinct operators tuned (templates' input shapes)
    written_at: str = ""
    best_tiles: dict[str, Any] = field(default_factory=dict)  # an operator's key → its best tile settings

    def to_bytes(self) -> bytes:
        return json.dumps({"kind": "yolopipe tuning cache", **asdict(self)}, separators=(",", ":"),
                          sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TuningCache:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("kind") != "yolopipe tuning cache":
            raise ValueError("not a yolopipe tuning cache")
        key = raw["key"]
        if not isinstance(key, dict) or set(key) | {"tuning_batch"} != {f.name for f in fields(TuningKey)}:
            raise ValueError("its key is not a tuning key")
        templates, kernels = raw.get("templates", {}), raw.get("kernels", {})
        best_tiles = raw.get("best_tiles", {})
        if not all(isinstance(table, dict) for table in (templates, kernels, best_tiles)):
            raise ValueError("its templates, kernels and tiles are not tables")
        if not are_tiles(best_tiles):
            raise ValueError("its tiles are not lists of settings")
        return cls(TuningKey(**{"tuning_batch": OLDER_TUNING_BATCH, **key}), templates, kernels, int(raw.get("tunings", 0)), str(raw.get("written_at", "")),
                   best_tiles)


def are_tiles(table: Any) -> bool:
    """Whether ``table`` has the shape of ``best_tiles``: an operator's key → a list of settings."""
    return isinstance(table, dict) and all(
        isinstance(tiles, list) and all(isinstance(tile, dict) for tile in tiles) for tiles in table.values())


def default_tuning_cache(model_dir: Path) -> Path:
    """The cache a build reads and writes when none is named: ``YOLOPIPE_TUNING_CACHE``, else the
    model folder's."""
    if env := os.environ.get("YOLOPIPE_TUNING_CACHE"):
        return Path(env).expanduser()
    return Path(model_dir) / "torch-cache" / TUNING_CACHE_NAME


def read_tuning_cache(path: Path) -> TuningCache | None:
    """The cache in ``path``; None when there is no file. An unreadable one is an ``ArtifactError``
    saying why (a build told to read it should not tune for minutes in silence instead)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ArtifactError(f"tuning cache {path} cannot be read: {exc.strerror}") from exc
    if size > MAX_TUNING_CACHE_BYTES:
        raise ArtifactError(f"tuning cache {path} is {size:,} bytes, over {MAX_TUNING_CACHE_BYTES:,}: not one "
                            "yolopipe writes")
    try:
        return TuningCache.from_bytes(path.read_bytes())
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ArtifactError(f"tuning cache {path} is not a yolopipe tuning cache ({exc})",
                            hint="delete it, or name another with --tuning-cache") from exc


def write_tuning_cache(path: Path, cache: TuningCache) -> Path:
    data = cache.to_bytes()
    if len(data) > MAX_TUNING_CACHE_BYTES:
        raise ArtifactError(f"the tuning cache came to {len(data):,} bytes, over {MAX_TUNING_CACHE_BYTES:,}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(Path(path), data)


def build_estimate_s(gpu_name: str, *, tunings: int, batch_invariant: bool = True, narrowed: bool = False) -> float:
    """Seconds a torch-cuda build takes with ``tunings`` convolutions left to tune (0: a tuning
    cache that fits, or cuDNN's kernels, which are not tuned); ``narrowed``: each over the tiles
    that won on its compute capability (``app.builder.narrowed_choices``)."""
    if not batch_invariant or tunings <= 0:
        return BUILD_REST_S
    return FIRST_BUILD_REST_S + seconds_per_tuning(gpu_name, narrowed=narrowed) * tunings


def seconds_per_tuning(gpu_name: str, *, narrowed: bool = False) -> float:
    table = NARROWED_SECONDS_PER_TUNING if narrowed else SECONDS_PER_TUNING
    return table.get(gpu_name, max(table.values()))


def say_duration(seconds: float) -> str:
    """``about 40 s`` / ``about 6 min``: an estimate, rounded as one."""
    return f"about {seconds:.0f} s" if seconds < 90 else f"about {round(seconds / 60):.0f} min"
