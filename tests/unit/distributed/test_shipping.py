"""A node that does not see the driver's model folder gets an unpacked copy and loads it."""

from __future__ import annotations

import shutil

import pytest

from app.distributed.shipping import model_dir_here, pack_model_dir
from app.errors import ArtifactError
from app.types import ModelMeta
from tests.references import detections_json


def test_missing_folder_is_unpacked_once_and_loads(sample_model_dir, tmp_path, monkeypatch, assets_dir):
    from app.runtime import OpenOptions, open_detector, open_model_dir

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "node-tmp"))
    (tmp_path / "node-tmp").mkdir()
    sha = ModelMeta.load(sample_model_dir / "meta.json").onnx_sha256
    assert model_dir_here(str(sample_model_dir), sha) == sample_model_dir  # same disk: used in place

    bundle = pack_model_dir(sample_model_dir)
    assert {"model.onnx", "meta.json", "weights.pt"} <= set(bundle)
    calls = []

    def fetch():
        calls.append(1)
        return bundle

    elsewhere = str(tmp_path / "driver-only" / "sample")
    here = model_dir_here(elsewhere, sha, fetch)
    assert here != sample_model_dir and (here / "model.onnx").read_bytes() == (sample_model_dir / "model.onnx").read_bytes()
    assert model_dir_here(elsewhere, sha, fetch) == here and len(calls) == 1  # once per node
    image = (assets_dir / "bus.jpg").read_bytes()
    built = (here / "model.onnx").stat().st_mtime_ns
    with open_model_dir(here, OpenOptions(backend="onnxruntime")) as det:
        mine = det.detect([image])[0]
    assert (here / "model.onnx").stat().st_mtime_ns == built  # loaded, not exported again
    with open_detector(OpenOptions("sample", backend="onnxruntime")) as det:
        ref = det.detect([image])[0]
    assert detections_json(mine.detections, ["a", "b"]) == detections_json(ref.detections, ["a", "b"])


def test_another_export_at_the_same_path_is_not_used(sample_model_dir, tmp_path):
    copy = tmp_path / "sample"
    shutil.copytree(sample_model_dir, copy, ignore=shutil.ignore_patterns("torch-cache"))
    with pytest.raises(ArtifactError, match="not on this node"):
        model_dir_here(str(copy), "0" * 64)
