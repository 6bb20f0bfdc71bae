"""``predict_folder`` on the GPU pipeline: the lines it writes from each batch's rows are byte for
byte ``json.dumps(to_json)`` of what ``Detector.detect`` gives each file (JPEGs the GPU decodes,
others OpenCV decodes, broken files), in listing order, in batches of the pipeline's size."""

from __future__ import annotations

import json
import shutil

import pytest

from app.benchmark.workloads import varied_jpegs
from app.pipeline.detector import Detector
from app.predict.folder import list_images, predict_folder
from tests.references import image_json

pytestmark = pytest.mark.requires_gpu


def test_folder_lines_equal_the_detectors_per_image_results(gpu, sample_model_dir, meta, assets_dir, tmp_path):
    src = tmp_path / "photos"
    (src / "sub").mkdir(parents=True)
    for name in ("bus.jpg", "zidane.jpg"):
        shutil.copy(assets_dir / name, src / "sub" / name)
    for name, data in varied_jpegs()[:24]:  # progressive, 4:1:1, CMYK, EXIF orientations, gray, ...
        (src / name).write_bytes(data)
    (src / "broken.jpg").write_bytes((assets_dir / "bus.jpg").read_bytes()[:400])
    pipe = gpu.make_pipeline(sample_model_dir, meta, "fp32", max_batch=8, in_flight=3)
    try:
        det = Detector(pipe)
        out = tmp_path / "p.jsonl"
        summary = predict_folder(det, str(src), out, det.params())
        images = list_images(str(src))
        expected = [image_json(r, img.name, det.names) for img, r in
                    zip(images, det.detect([img.path.read_bytes() for img in images], det.params()))]
    finally:
        pipe.close()
    assert out.read_text() == "".join(json.dumps(rec) + "\n" for rec in expected)
    assert summary.images == len(images) == 27 and summary.errors == 1
    assert summary.detections == sum(len(rec.get("detections", [])) for rec in expected) > 0
