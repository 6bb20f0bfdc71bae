"""The artifacts store: one user-level root, one folder per (weights, imgsz), deterministic exports."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app.artifacts.exports import current_export
from app.artifacts.store import artifacts_root, cache_dir, model_dir
from app.builder.export import export_onnx
from app.errors import InvalidParameter, WeightsError
from app.weights import SAMPLE_SHA256, sha256_file


def test_root_from_option_then_environment_then_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("YOLOPIPE_ARTIFACTS_DIR", raising=False)
    monkeypatch.setenv("YOLOPIPE_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    assert artifacts_root() == tmp_path / "cache" / "artifacts"
    monkeypatch.setenv("YOLOPIPE_ARTIFACTS_DIR", str(tmp_path / "env"))
    assert artifacts_root() == tmp_path / "env"
    assert artifacts_root(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv("YOLOPIPE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "yolopipe"


def test_folders_are_keyed_by_weights_and_imgsz(tmp_path):
    a = model_dir(tmp_path, "best", "a" * 64, 640)
    assert a == tmp_path / f"best-{'a' * 12}" / "imgsz640"
    assert len({a, model_dir(tmp_path, "best", "b" * 64, 640), model_dir(tmp_path, "best", "a" * 64, 320)}) == 3


def test_the_same_weights_export_to_the_same_bytes(artifacts_dir, tmp_path):
    """Ultralytics stamps the export time into the model: yolopipe drops it, so the sha256 is stable."""
    first = export_onnx("sample", artifacts_dir=artifacts_dir)
    again = export_onnx("sample", artifacts_dir=tmp_path, force=True)
    assert not again.reused
    assert sha256_file(again.onnx_path) == sha256_file(first.onnx_path) == again.meta.onnx_sha256


def test_other_imgsz_lives_beside_not_over(artifacts_dir, tmp_path):
    shutil.copytree(artifacts_dir, tmp_path / "root")
    at640 = export_onnx("sample", artifacts_dir=tmp_path / "root")
    at320 = export_onnx("sample", imgsz=320, artifacts_dir=tmp_path / "root")
    assert at640.reused and not at320.reused and at320.model_dir != at640.model_dir
    assert at320.meta.imgsz == 320 and at320.meta.output_shape == ["batch", 6, 2100]
    assert export_onnx("sample", artifacts_dir=tmp_path / "root").reused  # 640 still there, untouched
    assert current_export(at640.model_dir, weights_sha256=SAMPLE_SHA256, imgsz=640) is not None


def test_a_file_that_is_not_a_checkpoint_is_a_clear_error_and_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint" * 100)
    root = tmp_path / "root"
    with pytest.raises(WeightsError, match="not an Ultralytics YOLO checkpoint"):
        export_onnx(str(bad), artifacts_dir=root)
    leftovers = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
    assert leftovers == []


def test_bad_imgsz_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    from app.builder import export

    def must_not_resolve(spec):
        raise AssertionError(f"weights {spec!r} resolved before imgsz was checked")

    monkeypatch.setattr(export, "resolve_weights", must_not_resolve)
    for imgsz in (33, 0, 8192):
        with pytest.raises(InvalidParameter, match="multiple of 32"):
            export_onnx("sample", imgsz=imgsz, artifacts_dir=tmp_path)
    assert list(Path(tmp_path).iterdir()) == []
