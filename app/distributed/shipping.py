"""Getting the driver's model folder (export, engines) to a node that does not share its disk.

The driver builds the artifacts once; every actor only loads them. An actor whose node sees
the driver's folder with the same export (same ``model.onnx`` hash in ``meta.json``) loads it
in place. Otherwise it takes the folder's files from Ray's object store (put there once by the
driver) and writes them under the node's temp folder, keyed by that hash, once per node.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from app.artifacts.exports import META_NAME
from app.types import ModelMeta


def pack_model_dir(model_dir: Path) -> dict[str, bytes]:
    """The folder's top-level files (export, meta, engines); caches in sub-folders stay behind."""
    return {p.name: p.read_bytes() for p in sorted(Path(model_dir).iterdir()) if p.is_file()}


def matches(model_dir: Path, onnx_sha256: str) -> bool:
    meta_path = Path(model_dir) / META_NAME
    if not meta_path.is_file():
        return False
    try:
        return ModelMeta.load(meta_path).onnx_sha256 == onnx_sha256
    except (OSError, ValueError, KeyError, TypeError):
        return False


def model_dir_here(model_dir: str, onnx_sha256: str, fetch_bundle: Any = None) -> Path:
    """A folder on this node holding the driver's artifacts: its own path, or an unpacked copy.

    ``fetch_bundle``: a callable returning ``pack_model_dir``'s dict (only called when needed).
    """
    from app.errors import ArtifactError

    here = Path(model_dir)
    if matches(here, onnx_sha256):
        return here
    dest = Path(tempfile.gettempdir()) / "yolopipe-ray" / onnx_sha256[:16] / here.name
    if matches(dest, onnx_sha256):
        return dest
    if fetch_bundle is None:
        raise ArtifactError(
            f"{model_dir} is not on this node and the driver did not ship it",
            hint="put the engines folder on a shared filesystem, or let predict_with_ray ship it",
        )
    files = fetch_bundle()
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    for name, data in files.items():
        (staging / name).write_bytes(data)
    try:
        os.rename(staging, dest)  # atomic: another actor on this node may have won the race
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not matches(dest, onnx_sha256):
            raise
    return dest
