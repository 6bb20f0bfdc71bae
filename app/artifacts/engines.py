"""What a TensorRT engine was built from and for, and the rules that decide whether it may run.

Pure logic: no tensorrt, torch or CUDA import, so the checks, the profile validation and the
choice of build recipe for each TensorRT major version are tested on any machine.

``engine.json`` in a model's artifacts folder holds one entry per built precision (an int8, an fp16 and an
fp32 engine may live side by side)::

    {"format": 1, "engines": {"int8": {...EngineMeta...}, "fp16": {...}}}

Compatibility rules (NVIDIA, "Engine Compatibility" / "Version Compatibility" in the TensorRT
developer guide): by default an engine runs only on the TensorRT version that built it, and,
without hardware-compatibility mode, only on the GPU architecture it was built for; NVIDIA
support adds that engines are tied to the exact GPU model. So all three must match here:

* the full TensorRT version string (``10.13.3.9`` vs ``10.13.2.6`` is a mismatch: the runtime
  refuses such a plan with "expecting library version ... please rebuild");
* the compute capability (``9.0``);
* the GPU name (an H100 engine on an H200 shares the capability but was tuned for another
  model; TensorRT itself warns that this "is likely to affect performance or even cause errors").

Nothing here builds version-compatible or hardware-compatible engines, so nothing is relaxed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import MISSING, asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.config import ENGINE_PRECISIONS, check_choice
from app.errors import ArtifactError, EngineMismatch, YolopipeError

ENGINE_META_NAME = "engine.json"
ENGINE_META_FORMAT = 1


def engine_file_name(precision: str) -> str:
    return f"model.{precision}.engine"


@dataclass
class EngineMeta:
    """One built engine: everything needed to decide, without TensorRT, whether it may run here."""

    precision: str  # "int8" | "fp16" | "fp32"
    engine_file: str  # "model.int8.engine", relative to the model folder
    trt_version: str  # tensorrt.__version__ at build time, e.g. "10.13.3.9"
    gpu_name: str  # e.g. "NVIDIA H200"
    compute_capability: str  # "major.minor", e.g. "9.0"
    min_batch: int
    opt_batch: int
    max_batch: int
    imgsz: int
    source_onnx: str  # file TensorRT parsed: model.onnx, model.int8.onnx or model.fp16.onnx
    onnx_sha256: str  # sha256 of source_onnx
    export_onnx_sha256: str  # sha256 of the fp32 export (meta.json) it derives from: staleness check
    class_names: list[str]
    input_name: str = "images"
    output_name: str = "output0"
    weights: str = ""
    created_at: str = ""
    builder_options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineMeta:
        fields = dataclasses.fields(cls)
        required = [f.name for f in fields if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:  # the file is not ours, or from a version that wrote less
            raise ArtifactError(
                f"engine metadata lacks {', '.join(missing)}",
                hint="rebuild the engine with `yolopipe build-engine`",
            )
        known = {f.name for f in fields}
        return cls(**{k: v for k, v in data.items() if k in known})


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- engine.json ------------------------------------------------------------------------
def _read_index(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / ENGINE_META_NAME
    if not path.is_file():
        return {"format": ENGINE_META_FORMAT, "engines": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"unreadable engine metadata {path}: {exc}", hint=_rebuild_hint(None, None)) from exc
    if not isinstance(data, dict) or not isinstance(data.get("engines"), dict):
        raise ArtifactError(f"{path} is not a yolopipe engine index", hint=_rebuild_hint(None, None))
    return data


def save_engine_meta(model_dir: Path, meta: EngineMeta) -> Path:
    """Add or replace this precision's entry in ``engine.json`` (written atomically)."""
    path = Path(model_dir) / ENGINE_META_NAME
    index = _read_index(model_dir) if path.is_file() else {"format": ENGINE_META_FORMAT, "engines": {}}
    index["format"] = ENGINE_META_FORMAT
    index["engines"][meta.precision] = meta.to_dict()
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    tmp.replace(path)
    return path


def load_engine_meta(model_dir: Path, precision: str) -> EngineMeta | None:
    """This precision's entry, or None when ``engine.json`` has none."""
    entry = _read_index(model_dir)["engines"].get(precision)
    return None if entry is None else EngineMeta.from_dict(entry)


def engine_meta_for(engine_path: Path) -> EngineMeta:
    """The entry describing ``engine_path`` (matched by file name); a clear error when absent."""
    engine_path = Path(engine_path)
    for entry in _read_index(engine_path.parent)["engines"].values():
        if entry.get("engine_file") == engine_path.name:
            return EngineMeta.from_dict(entry)
    raise ArtifactError(
        f"no entry for {engine_path.name} in {engine_path.parent / ENGINE_META_NAME}",
        hint="the engine cannot be checked against this GPU; rebuild it with `yolopipe build-engine`",
    )


# --- which engine to load (files only: no TensorRT, no GPU) ------------------------------
def find_engine(model_dir: Path, precision: str | None) -> Path | None:
    """The engine to load from ``model_dir``, or None. Looks at files only (no TensorRT, no GPU).

    ``precision=None`` prefers int8, then fp16, then fp32. An engine counts only when
    ``engine.json`` describes it, because without that entry it cannot be checked against this
    GPU and TensorRT version before deserializing.
    """
    if precision is not None:
        check_choice("precision", precision, ENGINE_PRECISIONS)
    model_dir = Path(model_dir)
    for candidate in (precision,) if precision else ENGINE_PRECISIONS:
        path = model_dir / engine_file_name(candidate)
        if not path.is_file():
            continue
        try:
            entry = load_engine_meta(model_dir, candidate)
        except YolopipeError:  # unreadable engine.json: nothing here can be checked, so nothing is offered
            return None
        if entry is not None and entry.engine_file == path.name:
            return path
    return None


# --- compatibility --------------------------------------------------------------------
def _rebuild_hint(weights: str | None, precision: str | None) -> str:
    return f"rebuild it here: yolopipe build-engine --weights {weights or 'WEIGHTS'} --precision {precision or 'PRECISION'}"


def check_engine_meta(meta: EngineMeta, *, trt_version: str, gpu_name: str, compute_capability: str) -> None:
    """Raise ``EngineMismatch`` unless the engine was built by this TensorRT for this GPU model.

    Called before deserializing, so a mismatch is one clear line instead of a TensorRT
    assertion. All three facts must match exactly (see the module docstring for why).
    """
    problems = []
    if meta.trt_version.strip() != trt_version.strip():
        problems.append(f"TensorRT {meta.trt_version} built it, this is TensorRT {trt_version}")
    if meta.compute_capability.strip() != compute_capability.strip():
        problems.append(
            f"built for compute capability {meta.compute_capability}, this GPU has {compute_capability}"
        )
    if meta.gpu_name.strip() != gpu_name.strip():
        problems.append(f"built on {meta.gpu_name!r}, this GPU is {gpu_name!r}")
    if problems:
        raise EngineMismatch(
            f"TensorRT engine {meta.engine_file} does not match this machine: " + "; ".join(problems),
            hint=_rebuild_hint(meta.weights or None, meta.precision),
        )
