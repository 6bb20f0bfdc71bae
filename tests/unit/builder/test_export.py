"""Export: dynamic batch, height and width; meta.json; the same bytes for the same weights; re-export
only when the weights change or the export is one pinned to the square."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from app.artifacts.exports import current_export, load_export
from app.builder.export import export_onnx, pin_spatial_dims
from app.types import ModelMeta
from app.weights import resolve_weights, sha256_file


def test_export_shapes_and_meta(sample_model_dir):
    onnx_path, meta = load_export(sample_model_dir)
    model = onnx.load(str(onnx_path))
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3, "height", "width"] == meta.input_shape and meta.dynamic_hw
    assert model.opset_import[0].version >= 17
    # the output at the 640 square: 80² + 40² + 20² anchors
    assert meta.names == ["Normal", "Fall"] and meta.output_shape == ["batch", 6, 8400] and meta.num_anchors == 8400
    assert meta.stride == 32 and len(meta.weights_sha256) == 64
    assert ModelMeta.load(sample_model_dir / "meta.json") == meta


def test_dynamic_batch_runs(sample_model_dir):
    sess = ort.InferenceSession(str(sample_model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((3, 3, 640, 640), dtype=np.float32)
    out = sess.run(None, {"images": x})[0]
    single = sess.run(None, {"images": x[1:2]})[0]
    assert out.shape == (3, 6, 8400)
    np.testing.assert_allclose(out[1:2], single, rtol=1e-4, atol=1e-3)


def test_any_multiple_of_the_stride_runs_and_the_square_equals_a_static_export(sample_model_dir):
    """Height and width are free (multiples of 32 up to imgsz, as rect letterboxes them): each
    gives one anchor per grid cell of strides 8, 16 and 32; at 640 × 640 the outputs are the very
    bits of the same export pinned to the square (what exports were before rect inputs)."""
    model = onnx.load(str(sample_model_dir / "model.onnx"))
    dynamic = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    pinned = pin_spatial_dims(model, 640)
    dims = [d.dim_param or d.dim_value for d in pinned.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3, 640, 640]
    static = ort.InferenceSession(pinned.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    x = rng.random((2, 3, 640, 640), dtype=np.float32)
    assert dynamic.run(None, {"images": x})[0].tobytes() == static.run(None, {"images": x})[0].tobytes()
    for h, w in [(640, 480), (480, 640), (352, 640), (640, 32), (32, 32), (96, 160)]:
        out = dynamic.run(None, {"images": rng.random((2, 3, h, w), dtype=np.float32)})[0]
        assert out.shape == (2, 6, sum((h // s) * (w // s) for s in (8, 16, 32)))


def test_export_is_deterministic(tmp_path):
    """The same weights exported twice (another folder, another process state) give the same bytes."""
    first = export_onnx("sample", imgsz=64, artifacts_dir=tmp_path / "a")
    second = export_onnx("sample", imgsz=64, artifacts_dir=tmp_path / "b")
    assert not second.reused and first.onnx_path.read_bytes() == second.onnx_path.read_bytes()
    assert first.meta == second.meta and first.meta.onnx_sha256 == sha256_file(second.onnx_path)


def test_exports_in_processes_of_other_hash_seeds_give_the_same_bytes(tmp_path):
    """An export's sha256 names it across machines and processes (a TensorRT engine's staleness
    check, the cluster's shipping): two processes whose hash seeds differ, which ordered
    onnxslim's shape expressions differently, write the same bytes."""
    import os
    import subprocess
    import sys

    script = ("import sys; from pathlib import Path; from app.builder.export import export_onnx; "
              "print(export_onnx('sample', imgsz=64, artifacts_dir=Path(sys.argv[1])).meta.onnx_sha256)")
    hashes = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path / seed)], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        hashes.append(done.stdout.split()[-1])
    assert hashes[0] == hashes[1] == export_onnx("sample", imgsz=64, artifacts_dir=tmp_path / "here").meta.onnx_sha256


def test_an_export_pinned_to_the_square_is_exported_again(tmp_path):
    """An export made before rect inputs (H and W pinned to imgsz) is stale: the next export
    replaces it rather than leave the CPU pipeline a model that takes only the square."""
    root = tmp_path / "artifacts"
    fresh = export_onnx("sample", imgsz=64, artifacts_dir=root)
    old = fresh.meta
    old.input_shape = ["batch", 3, 64, 64]  # what meta.json said of a pinned export
    old.save(fresh.model_dir / "meta.json")
    assert current_export(fresh.model_dir, weights_sha256=old.weights_sha256, imgsz=64) is None
    again = export_onnx("sample", imgsz=64, artifacts_dir=root)
    assert not again.reused and again.meta.dynamic_hw and again.meta.onnx_sha256 == fresh.meta.onnx_sha256


def test_reexport_only_when_weights_change(artifacts_dir, tmp_path):
    again = export_onnx("sample", artifacts_dir=artifacts_dir)
    assert again.reused

    # The user retrains and overwrites the same file: the next export is a new one, in its own folder.
    import shutil

    import torch

    weights = tmp_path / "best.pt"
    shutil.copyfile(resolve_weights("sample").path, weights)
    root = tmp_path / "artifacts"
    first = export_onnx(str(weights), imgsz=64, artifacts_dir=root)  # imgsz 64: the cheapest export
    assert not first.reused and export_onnx(str(weights), imgsz=64, artifacts_dir=root).reused
    checkpoint = torch.load(weights, weights_only=False)
    with torch.no_grad():
        next(checkpoint["model"].parameters()).add_(0.5)
    torch.save(checkpoint, weights)
    changed = export_onnx(str(weights), imgsz=64, artifacts_dir=root)
    assert not changed.reused and changed.meta.weights_sha256 == sha256_file(weights) != first.meta.weights_sha256
    assert changed.model_dir != first.model_dir and changed.meta.onnx_sha256 != first.meta.onnx_sha256
    assert load_export(first.model_dir)[1] == first.meta  # the earlier export is left as it was


def test_the_export_beside_a_build_writes_the_same_export_and_its_meta_is_known_at_once(tmp_path):
    """``export_beside``: the block has the model's folder, weights and meta while the export runs
    in a process of its own; the export it waits for is the one ``export_onnx`` writes (the
    same bytes), and the checkpoint's meta is that export's but for its ONNX hash and versions.
    An export already made is taken as it is, without a process."""
    from dataclasses import replace

    from app.builder import export

    direct = export_onnx("sample", imgsz=64, artifacts_dir=tmp_path / "direct")
    with export.export_beside("sample", imgsz=64, artifacts_dir=tmp_path / "beside") as running:
        under_way = running.under_way
        assert under_way.weights == resolve_weights("sample").path and not (under_way.model_dir / "meta.json").exists()
        done = running.result()
    assert not done.reused and done.model_dir == under_way.model_dir
    assert done.onnx_path.read_bytes() == direct.onnx_path.read_bytes() and done.meta == direct.meta
    assert replace(under_way.meta, onnx_sha256=done.meta.onnx_sha256, versions=done.meta.versions) == done.meta

    def no_process(*args, **kwargs):
        raise AssertionError("an export already made needs no process")

    export_popen = export.subprocess.Popen
    export.subprocess.Popen = no_process
    try:
        with export.export_beside("sample", imgsz=64, artifacts_dir=tmp_path / "beside") as again:
            assert again.result().reused and again.under_way.meta == done.meta
    finally:
        export.subprocess.Popen = export_popen


def test_the_export_beside_a_build_fails_as_the_export_would(tmp_path, monkeypatch, started_processes):
    """A file that is no checkpoint fails at the block's start with the export's own error; an
    error the export process raised comes back as the same type and words; a process that dies
    says so; and no process outlives its block."""
    import pytest

    from app.builder import export
    from app.errors import ArtifactError, InvalidParameter, WeightsError

    bogus = tmp_path / "bogus.pt"
    bogus.write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError) as direct:
        export_onnx(str(bogus), imgsz=64, artifacts_dir=tmp_path / "direct")
    with pytest.raises(WeightsError) as beside, export.export_beside(str(bogus), imgsz=64, artifacts_dir=tmp_path / "b"):
        pass
    assert beside.value.message == direct.value.message and beside.value.hint == direct.value.hint
    assert all(proc.returncode is not None for proc in started_processes)  # none left running

    said = 'import json; print(json.dumps({"error": "InvalidParameter", "message": "no such size", "hint": "try 640"}))'
    monkeypatch.setattr(export, "EXPORT_CHILD", said + "; raise SystemExit(3)")
    with export.export_beside("sample", imgsz=64, artifacts_dir=tmp_path / "c") as running, \
            pytest.raises(InvalidParameter, match="no such size") as raised:
        running.result()
    assert raised.value.hint == "try 640"
    monkeypatch.setattr(export, "EXPORT_CHILD", "import sys; print('dying', file=sys.stderr); raise SystemExit(9)")
    with export.export_beside("sample", imgsz=64, artifacts_dir=tmp_path / "d") as running, \
            pytest.raises(ArtifactError, match=r"the ONNX export failed \(exit code 9\): dying"):
        running.result()
