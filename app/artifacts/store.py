"""Where yolopipe keeps what it builds: one user-level folder, one subfolder per model.

``<root>/<name>-<weights sha256[:12]>/imgsz<N>/`` holds everything built from one weights file
at one input size (``model.onnx`` + ``meta.json``, INT8 models, TensorRT engines, the
torch.compile cache), so other weights or another ``--imgsz`` never overwrite it, and a run
from any working directory finds what an earlier run built.

The root is ``--artifacts-dir`` / ``$YOLOPIPE_ARTIFACTS_DIR`` when given, else
``<cache>/artifacts`` with the cache at ``$YOLOPIPE_CACHE_DIR``, ``$XDG_CACHE_HOME/yolopipe`` or
``~/.cache/yolopipe``.

What a build writes appears whole or not at all: an export is moved into place with
``meta.json`` last; a torch-cuda engine is written under a temporary name and renamed once its
bytes are on disk (``publish``), its manifest (which holds its hash) last. A build killed at any
moment leaves nothing that a later run takes for a whole artifact.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
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


# --- writing artifacts so that a killed build never leaves one that looks whole -----------------
def temp_name(path: Path) -> Path:
    """Where ``path`` is written before it is published: a hidden name beside it, per process,
    with the same suffix (AOTInductor insists on ``.pt2``)."""
    return path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")


def is_temp_name(path: Path) -> bool:
    return path.name.startswith(".") and ".tmp-" in path.name


def publish(tmp: Path, path: Path) -> Path:
    """Make the written file ``tmp`` appear as ``path`` in one step: its bytes on disk first
    (fsync), then the rename, then the folder's entry (fsync of the folder)."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


def write_atomically(path: Path, data) -> Path:
    """``path`` holds ``data`` (bytes or any buffer) or what it held before, never a part of it."""
    tmp = temp_name(path)
    tmp.write_bytes(data)
    return publish(tmp, path)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without folder handles: the rename is all there is
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the block: one builder of an
    artifact at a time across processes (the service's worker and its standby start together).
    The kernel drops the lock when its process dies, so a killed build never blocks the next."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
