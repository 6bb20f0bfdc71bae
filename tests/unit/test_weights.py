"""Weights specs: a path, a hub name (offline → a clear error), and the verified sample model."""

from __future__ import annotations

import pytest

from app.errors import WeightsError
from app.weights import SAMPLE_SHA256, resolve_weights, sha256_file


def test_sample_is_real_and_verified():
    sample = resolve_weights("sample")
    assert sample.path.is_file() and sha256_file(sample.path) == SAMPLE_SHA256 == sample.sha256
    assert sample.name == "sample"


def test_local_path(tmp_path):
    src = resolve_weights("sample").path
    local = resolve_weights(str(src))
    assert local.path == src.resolve() and local.name == "best" and local.sha256 == SAMPLE_SHA256
    txt = tmp_path / "model.txt"
    txt.write_text("x")
    with pytest.raises(WeightsError):
        resolve_weights(str(txt))
    text = tmp_path / "notes.pt"
    text.write_text("not weights")
    with pytest.raises(WeightsError, match=f"^{text} is not an Ultralytics YOLO checkpoint: it is not the zip"):
        resolve_weights(str(text))
    with pytest.raises(WeightsError, match="not found"):
        resolve_weights(str(tmp_path / "missing.pt"))
    with pytest.raises(WeightsError, match="is a folder"):
        resolve_weights(str(tmp_path))


def test_a_missing_relative_path_is_not_found_not_a_download(monkeypatch, tmp_path):
    """Only names Ultralytics publishes are downloaded; anything else is a missing file."""
    monkeypatch.chdir(tmp_path)
    for spec in ("nothere.pt", "my_model.pt", "yolov8n_custom.pt"):
        with pytest.raises(WeightsError, match=f"weights file not found: {spec}"):
            resolve_weights(spec)


def test_named_model_offline_points_to_sample(monkeypatch, tmp_path):
    monkeypatch.setenv("YOLO_OFFLINE", "1")
    monkeypatch.setenv("YOLOPIPE_CACHE_DIR", str(tmp_path))
    with pytest.raises(WeightsError) as info:
        resolve_weights("yolov8n.pt")
    assert "sample" in str(info.value)


def test_a_failed_download_is_one_plain_line(monkeypatch, tmp_path):
    """Ultralytics' own offline error (``❌  Download failure for ... Environment may be offline.``,
    from its real download code, pointed at a closed local port) reaches the user without its emoji."""
    from ultralytics.utils import downloads

    from tests.net import free_port

    monkeypatch.delenv("YOLO_OFFLINE", raising=False)
    monkeypatch.setenv("YOLOPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(downloads, "is_online", lambda: False)
    url = f"http://127.0.0.1:{free_port()}/yolov8n.pt"  # nothing listens there
    monkeypatch.setattr(downloads, "attempt_download_asset",
                        lambda file, **kwargs: downloads.safe_download(url=url, file=file, progress=False))
    with pytest.raises(WeightsError) as info:
        resolve_weights("yolov8n.pt")
    assert info.value.message == f"could not download yolov8n.pt: Download failure for {url}. Environment may be offline."


def test_corrupt_cached_sample_is_replaced(monkeypatch, tmp_path):
    """A cache entry whose sha256 is wrong is fetched again (needs the package index)."""
    monkeypatch.setenv("YOLOPIPE_CACHE_DIR", str(tmp_path))
    (tmp_path / "sample").mkdir()
    (tmp_path / "sample" / "best.pt").write_bytes(b"not weights")
    assert sha256_file(resolve_weights("sample").path) == SAMPLE_SHA256
