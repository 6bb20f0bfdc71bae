"""Where yolopipe keeps what it builds: one user-level folder, one subfolder per model.

``<root>/<name>-<weights sha256[:12]>/imgsz<N>/`` holds everything built from one weights file
at one input size (``model.onnx`` + ``meta.json``, INT8 models, TensorRT engines, the
torch.compile cache), so other weights or another ``--imgsz`` never overwrite it, and a run
from any working directory finds what an earlier run built.

The root is ``--artifacts-dir`` / ``$YOLOPIPE_ARTIFACTS_DIR`` when given, else
``<cache>/artifacts`` with the cache at ``$YOLOPIPE_CACHE_DIR``, ``$XDG_CACHE_HOME/yolopipe`` or
``~/.cache/yolopipe``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$YOLOPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/yolopipe``, else ``~/.cache/yolopipe``."""
    if env := os.environ.get("YOLOPIPE_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "yolopipe"


def artifacts_root(override: Path | str | None = None) -> Path:
    """The folder every model's artifacts live under (see the module docstring)."""
    if override:
        return Path(override).expanduser()
    if env := os.environ.get("YOLOPIPE_ARTIFACTS_DIR"):
        return Path(env).expanduser()
    return cache_dir() / "artifacts"


def model_dir(root: Path, name: str, weights_sha256: str, imgsz: int) -> Path:
    """The folder of one (weights, imgsz): keyed so that nothing else ever writes into it."""
    return Path(root) / f"{name}-{weights_sha256[:12]}" / f"imgsz{int(imgsz)}"
