"""Export: dynamic batch only, fixed H and W, meta.json, re-export only when the weights change."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from app.artifacts.exports import load_export
from app.builder.export import export_onnx
from app.types import ModelMeta
from app.weights import resolve_weights, sha256_file


def test_export_shapes_and_meta(sample_model_dir):
    onnx_path, meta = load_export(sample_model_dir)
    model = onnx.load(str(onnx_path))
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3, 640, 640]
    assert model.opset_import[0].version >= 17
    assert meta.names == ["Normal", "Fall"] and meta.output_shape == ["batch", 6, 8400]
    assert meta.stride == 32 and len(meta.weights_sha256) == 64
    assert ModelMeta.load(sample_model_dir / "meta.json") == meta
    assert not any(n.op_type in ("Shape", "Range") for n in model.graph.node)  # shapes folded away


def test_dynamic_batch_runs(sample_model_dir):
    sess = ort.InferenceSession(str(sample_model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((3, 3, 640, 640), dtype=np.float32)
    out = sess.run(None, {"images": x})[0]
    single = sess.run(None, {"images": x[1:2]})[0]
    assert out.shape == (3, 6, 8400)
    np.testing.assert_allclose(out[1:2], single, rtol=1e-4, atol=1e-3)


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
