"""torch-cuda: the Ultralytics model itself on the GPU, when TensorRT is absent.

Fused, eval, ``channels_last``, fp16 or fp32, optionally ``torch.compile``d (inductor, default
mode). ``forward`` only enqueues work on torch's current stream, reads and writes fixed
addresses after one warm-up call per batch size, and returns the head tensor
``[B, 4 + nc, anchors]`` itself (no copy), so the pipeline can capture it in a CUDA graph.

Two details of Ultralytics' ``Detect`` head matter for graphs:

* in eval it returns ``(y, raw)``; export mode (``detect.export = True``) returns ``y`` alone;
* it rebuilds its anchors whenever the input *shape* changes, batch included, and stores them
  on the module. A graph captured for batch 4 reads the anchor tensor that existed then; if
  batch 8 later rebuilt (and so freed) it, the batch-4 graph would read freed memory. Anchors
  do not depend on the batch, so the engine builds them once and, before each call, sets the
  head's remembered shape to the incoming one: no rebuild, one anchor tensor forever.

Batches in flight (``RunShape.in_flight``) all use this one engine. That is safe
because ``forward`` only runs while the pipeline captures or warms up a graph, with nothing
else running, so the head's ``shape`` attribute is never set by two threads at once; the
graphs then replay one after another on the pipeline's compute stream. They share the weights
and the one anchor tensor (built by the eager probe below, outside every graph pool);
activations and the head output live in the pipeline's graph memory pool.

Three ways to run the model, fastest start first:

* an **AOTInductor package** (``packages``: built ahead by ``app.builder.torch_build``, found by
  ``app.runtime``): loaded, not compiled; nothing is traced or compiled at start-up and
  Ultralytics is not imported. Its graph computes the head's anchors itself from the feature
  maps' fixed size (``app.gpu.torch_model``), so no state of the head is read at all. The
  package allocates its output (and activations) through torch's caching allocator on each
  call, like the eager model: inside a capture that is the graph's pool, so the captured head
  tensor keeps its address for every replay. It is loaded single-threaded: the container's
  multi-threaded ``run`` records and waits on CUDA events of its own, which a capture forbids;
* ``torch.compile`` (``compile=True`` without a package): Dynamo and inductor on the first call
  of each batch size (the pipeline's warm-up), with caches under the model's folder;
* the eager model (``compile=False``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from app.artifacts.torch_engines import TorchEngineKey
from app.errors import ArtifactError, BackendUnavailable, InvalidParameter
from app.gpu.torch_model import check_head, load_model, load_package, torch_dtype
from app.types import ModelMeta

log = logging.getLogger(__name__)

PRECISIONS = ("fp16", "fp32")
WEIGHTS_NAME = "weights.pt"
TORCH_CACHE_DIR = "torch-cache"


class TorchCudaEngine:
    name = "torch-cuda"

    def __init__(
        self,
        model_dir: Path,
        meta: ModelMeta,
        *,
        precision: str = "fp16",
        max_batch: int,
        device: int = 0,
        compile: bool = True,
        packages: Sequence[tuple[Path, TorchEngineKey]] = (),
        cudnn_benchmark: bool = False,
    ) -> None:
        if precision == "int8":
            raise InvalidParameter(
                "torch-cuda runs fp16 or fp32; int8 needs the TensorRT backend",
                hint="use --backend tensorrt with an int8 engine, or --precision fp16",
            )
        if precision not in PRECISIONS:
            raise InvalidParameter(f"unknown precision {precision!r} for torch-cuda; choose fp16 or fp32")
        if max_batch < 1:
            raise InvalidParameter(f"max_batch must be >= 1, got {max_batch}")
        try:
            import torch
        except ImportError as exc:
            raise BackendUnavailable("torch is not installed", hint="pip install torch") from exc
        if not torch.cuda.is_available() or device >= torch.cuda.device_count():
            raise BackendUnavailable(f"torch-cuda needs CUDA device {device}, and torch sees none")
        weights = Path(model_dir) / WEIGHTS_NAME
        if not weights.is_file():
            raise ArtifactError(f"weights not found: {weights}", hint="run `yolopipe export` first")

        self.precision = precision
        self.input_dtype = "float16" if precision == "fp16" else "float32"
        self.max_batch = int(max_batch)
        self.meta = meta
        self.device = torch.device("cuda", device)
        self._torch = torch
        self._torch_dtype = torch_dtype(precision)
        self.cudnn_benchmark = cudnn_benchmark  # autotune convolutions on each new shape (see _scope)
        self.compiled = False
        self.compiler = "eager"  # "aoti" (a package) | "inductor" (torch.compile) | "eager"
        self.batch_invariant = False  # cuDNN's kernels split their work per batch size; a package may not
        self._compile_limits: dict[str, int] = {}  # torch._dynamo settings for this engine's calls
        self._inductor_cache: str | None = None
        self._packages: list[tuple[TorchEngineKey, Any]] = []
        self._model = self._detect = self._feat_shape = None
        torch.cuda.set_device(self.device)

        if packages:
            self._load_packages(packages)
            return
        model, self._detect = load_model(weights, precision=precision, device=self.device, anchors_in_graph=False)
        self._model = model
        # One eager call builds the anchors (batch independent) and records the feature shape.
        size = meta.imgsz
        with torch.inference_mode():
            probe = torch.zeros((1, 3, size, size), dtype=self._torch_dtype, device=self.device)
            check_head(self._call(model, probe), meta, 1)
        self._feat_shape = tuple(self._detect.shape)[1:]  # (C, H, W) of the first feature map
        torch.cuda.synchronize(self.device)

        self._forward = model
        if compile:
            self._forward = self._compile(model, Path(model_dir) / TORCH_CACHE_DIR)

    def _load_packages(self, packages: Sequence[tuple[Path, TorchEngineKey]]) -> None:
        """Load each package (``forward`` runs a batch on the narrowest one that takes it) and
        check its output on a batch of its smallest size."""
        torch = self._torch
        for path, key in sorted(packages, key=lambda p: p[1].max_batch - p[1].min_batch):
            if key.precision != self.precision or key.imgsz != self.meta.imgsz:
                raise ArtifactError(f"torch-cuda engine {path.name} runs {key.precision} at {key.imgsz}, "
                                    f"not {self.precision} at {self.meta.imgsz}")
            self._packages.append((key, load_package(path, self.device)))
        if not any(key.covers(self.max_batch) for key, _ in self._packages):
            raise ArtifactError(f"no torch-cuda engine package takes batches of {self.max_batch}",
                                hint="build one: yolopipe build-engine --max-batch N")
        size, autotune = self.meta.imgsz, self.cudnn_benchmark
        self.cudnn_benchmark = False  # a shape check: no autotuning of shapes the run may never use
        try:
            with torch.inference_mode(), self._scope():
                for key, runner in self._packages:
                    probe = torch.zeros((key.min_batch, 3, size, size), dtype=self._torch_dtype, device=self.device)
                    check_head(runner(probe), self.meta, key.min_batch)
            torch.cuda.synchronize(self.device)
        finally:
            self.cudnn_benchmark = autotune
        self._forward = None
        self.compiled, self.compiler = True, "aoti"
        self.batch_invariant = all(key.batch_invariant for key, _ in self._packages)

    # ------------------------------------------------------------------------------ build
    def _compile(self, model, cache_dir: Path):
        """``torch.compile`` (inductor, default mode) with its caches under ``model_dir``.

        Compilation itself happens lazily, on the first call per batch size (the pipeline's
        warm-up). A failure there falls back to the eager model with a warning (``forward``).
        """
        torch = self._torch
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Compiles happen inside this engine's calls (see _scope), which point inductor (and the
        # Triton cache inside it) here, so a restart reuses them. A user's own setting wins.
        self._inductor_cache = str(cache_dir / "inductor")
        try:
            import torch._dynamo

            # One compiled graph per bucket (1, 2, 4, ... max_batch): static shapes are faster.
            n_buckets = max(1, self.max_batch.bit_length() + 1)
            cfg = torch._dynamo.config
            self._compile_limits = {key: max(getattr(cfg, key), n_buckets + 4)
                                    for key in ("recompile_limit", "cache_size_limit") if hasattr(cfg, key)}
            with self._scope():  # a compile worker pool started now inherits the cache dir too
                compiled = torch.compile(model, mode="default", dynamic=False)
        except Exception as exc:  # noqa: BLE001 - compile is an optimisation, never a requirement
            warnings.warn(
                f"torch.compile unavailable ({exc}); running the eager model", RuntimeWarning, stacklevel=2
            )
            return model
        self.compiled, self.compiler = True, "inductor"
        return compiled

    # ----------------------------------------------------------------------------- run
    @contextlib.contextmanager
    def _scope(self) -> Iterator[None]:
        """This engine's settings for the length of one call, the process's own restored after.

        cuDNN's choice of kernels is pinned: no autotuning (timed per thread and per process, its
        picks differed between graphs of one bucket, and moved an image's scores by a few fp16
        steps with the slot or the thread that captured it), deterministic algorithms only;
        fp32 means fp32, not the TF32 PyTorch uses by default (its rounding moves scores between
        batch sizes); the recompile limit fits every batch bucket; inductor caches under the
        model's folder. The pipeline only calls ``forward`` to warm up and capture graphs, on its
        one capture thread, so nothing interleaves.
        """
        torch = self._torch
        cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
        saved = cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32
        env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        # Autotuning picks by timing, per process and thread: the same image could score differently
        # across captures and restarts (issue #25). Off unless a benchmark asks for it.
        cudnn.benchmark, cudnn.deterministic = self.cudnn_benchmark, not self.cudnn_benchmark
        if self.precision == "fp32":
            cudnn.allow_tf32 = matmul.allow_tf32 = False
        if self._inductor_cache and env is None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = self._inductor_cache
        try:
            with contextlib.ExitStack() as stack:
                if self._compile_limits:
                    stack.enter_context(torch._dynamo.config.patch(**self._compile_limits))
                yield
        finally:
            cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32 = saved
            if self._inductor_cache and env is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # inductor writes it back itself

    def _call(self, fn, images):
        """Run ``fn`` on ``images`` with the head's anchors pinned (see the module docstring)."""
        if self._detect.shape is not None and getattr(self, "_feat_shape", None) is not None:
            self._detect.shape = self._torch.Size((images.shape[0], *self._feat_shape))
        with self._scope():
            out = fn(images)
        if isinstance(out, (tuple, list)):  # an Ultralytics version that ignores export mode
            out = out[0]
        return out

    def forward(self, images: Any) -> Any:
        """Enqueue the model on the current stream; returns the head tensor ``[B, 4 + nc, A]``."""
        torch = self._torch
        if images.dtype != self._torch_dtype or images.device != self.device or images.dim() != 4:
            raise InvalidParameter(
                f"torch-cuda {self.precision} expects a {self.input_dtype} [B, 3, S, S] tensor on "
                f"{self.device}, got {images.dtype} {tuple(images.shape)} on {images.device}"
            )
        if images.shape[0] > self.max_batch:
            raise InvalidParameter(
                f"batch {images.shape[0]} is over this engine's max_batch {self.max_batch}"
            )
        with torch.inference_mode():
            if self._packages:
                runner = next((r for key, r in self._packages if key.covers(images.shape[0])), None)
                if runner is None:
                    raise InvalidParameter(f"no torch-cuda engine package takes a batch of {images.shape[0]}")
                with self._scope():
                    out = runner(images)
                return out[0] if isinstance(out, (tuple, list)) else out
            if self._forward is not self._model:
                try:
                    return self._call(self._forward, images)
                except Exception as exc:
                    if torch.cuda.is_current_stream_capturing():
                        raise  # never recompile inside a capture: the warm-up should have
                    warnings.warn(
                        f"torch.compile failed ({type(exc).__name__}: {exc}); running the eager model",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    self._forward = self._model
                    self.compiled, self.compiler = False, "eager"
            return self._call(self._model, images)

    def close(self) -> None:
        if self._model is None and not self._packages:
            return
        self._forward = self._model = self._detect = None
        self._packages = []
        torch = self._torch
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
