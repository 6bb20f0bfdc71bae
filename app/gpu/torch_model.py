"""The Ultralytics model as the torch-cuda engine runs it and as its builder exports it.

Fused, eval, ``channels_last``, fp16 or fp32, no gradients, and the ``Detect`` head in export
mode (it returns the inference tensor ``[B, 4 + nc, anchors]`` alone, not ``(y, raw)``).

The head's anchors (see ``app.backends.torch_cuda``): the eager engine builds them once and pins
them (``anchors_in_graph=False``); the ahead-of-time package computes them inside its own graph
(``anchors_in_graph=True``: ``Detect.dynamic``), from the feature maps' fixed height and width,
so the compiled model reads no tensor the head may later rebuild, at any batch size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.errors import ArtifactError
from app.types import ModelMeta


def load_model(weights: Path, *, precision: str, device: Any, anchors_in_graph: bool) -> tuple[Any, Any]:
    """``(model, detect_head)`` on ``device`` (a ``torch.device``), ready to run or to export."""
    import torch
    from ultralytics import YOLO

    model = YOLO(str(weights)).model
    model = model.fuse(verbose=False) if hasattr(model, "fuse") else model
    model = model.to(device).eval()
    model = model.half() if precision == "fp16" else model.float()
    model = model.to(memory_format=torch.channels_last)
    for p in model.parameters():
        p.requires_grad_(False)
    detect = model.model[-1]
    detect.export = True  # the inference tensor alone, not (y, raw)
    detect.dynamic = anchors_in_graph
    return model, detect


def torch_dtype(precision: str) -> Any:
    import torch

    return torch.float16 if precision == "fp16" else torch.float32


def check_head(out: Any, meta: ModelMeta, batch: int) -> Any:
    """``out`` (the head tensor; the first item of a tuple an Ultralytics version may return)
    when its shape is the export's, else an ``ArtifactError``."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    expected = (batch, 4 + meta.num_classes, meta.num_anchors)
    if tuple(out.shape) != expected:
        raise ArtifactError(
            f"model output {tuple(out.shape)} does not match the export's {expected}",
            hint="re-export the model (`yolopipe export --force`)",
        )
    return out


def load_package(path: Path, device: Any) -> Any:
    """An AOTInductor package loaded on ``device``: a callable ``images → head``.

    Loaded through torch's package loader itself, single-threaded (the container's thread
    synchronisation records and waits on CUDA events, which a graph capture forbids), so that
    neither ``torch._inductor`` nor ``torch._dynamo`` is imported at start-up (seconds). The CUDA
    context is created before the package's kernels load. (Fresh processes on the H200 crashed
    here until the package library was linked by ``app.builder.aoti_link``.) A torch whose loader
    takes other arguments goes through ``torch._inductor.aoti_load_package``.
    """
    import torch

    if device.type == "cuda":
        torch.zeros(1, device=device)  # the context (torch creates it lazily)
    index = device.index if device.index is not None else -1
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, index)
    except TypeError:
        loader = None
    except Exception as exc:  # a package this torch cannot load: rebuild it
        raise _unloadable(path, exc) from exc
    if loader is not None:
        return lambda images: loader.boxed_run([images])[0]
    import inspect

    import torch._inductor

    accepted = inspect.signature(torch._inductor.aoti_load_package).parameters
    options = {k: v for k, v in (("run_single_threaded", True), ("device_index", index)) if k in accepted}
    try:
        return torch._inductor.aoti_load_package(str(path), **options)
    except Exception as exc:
        raise _unloadable(path, exc) from exc


def _unloadable(path: Path, exc: Exception) -> ArtifactError:
    return ArtifactError(f"cannot load the torch-cuda engine {path}: {type(exc).__name__}: {exc}"[:500],
                         hint="delete it and run `yolopipe build-engine` again")
