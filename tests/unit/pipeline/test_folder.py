"""``yolopipe predict`` over a folder: JSONL objects, bad files reported, resume, COCO, images."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from app.errors import InvalidParameter
from app.pipeline.folder import already_done, list_images

CLI = [sys.executable, "-m", "app.cli"]


@pytest.fixture()
def folder(tmp_path, assets_dir):
    src = tmp_path / "photos"
    (src / "sub").mkdir(parents=True)
    shutil.copy(assets_dir / "bus.jpg", src / "bus.jpg")
    shutil.copy(assets_dir / "zidane.jpg", src / "sub" / "zidane.jpg")
    (src / "notes.txt").write_text("not an image, and not an image suffix either")
    (src / "broken.jpg").write_bytes((assets_dir / "bus.jpg").read_bytes()[:400])
    (src / "empty.png").write_bytes(b"")
    return src


def run_cli(*args, cwd):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_list_images_folder_file_glob(folder):
    assert [i.name for i in list_images(str(folder))] == ["broken.jpg", "bus.jpg", "empty.png", "sub/zidane.jpg"]
    assert [i.name for i in list_images(str(folder / "bus.jpg"))] == ["bus.jpg"]
    assert [i.name for i in list_images(str(folder / "**" / "*.jpg"))] == ["broken.jpg", "bus.jpg", "sub/zidane.jpg"]
    with pytest.raises(InvalidParameter):
        list_images(str(folder / "nothing-*.jpg"))


def test_predict_cli_end_to_end(folder, tmp_path, artifacts_dir):
    out, coco, viz = tmp_path / "p.jsonl", tmp_path / "coco.json", tmp_path / "viz"
    proc = run_cli("predict", str(folder), "--backend", "onnxruntime", "--artifacts-dir", str(artifacts_dir),
                   "--out", str(out), "--coco", str(coco), "--save-images", str(viz), "--batch", "2", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr  # finished, but two files could not be read
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_name = {r["image"]: r for r in records}
    assert set(by_name) == {"broken.jpg", "bus.jpg", "empty.png", "sub/zidane.jpg"}
    assert "error" in by_name["broken.jpg"] and "error" in by_name["empty.png"]
    bus = by_name["bus.jpg"]
    assert (bus["width"], bus["height"]) == (810, 1080) and len(bus["detections"]) > 0
    d = bus["detections"][0]
    assert set(d) == {"box", "score", "class_id", "class_name"} and d["class_name"] in ("Normal", "Fall")
    assert "2 errors" in proc.stderr
    doc = json.loads(coco.read_text())
    assert len(doc["images"]) == 2 and len(doc["annotations"]) == sum(len(r.get("detections", [])) for r in records)
    assert (viz / "sub" / "zidane.jpg").is_file()

    # --resume: nothing left to do, nothing rewritten
    proc = run_cli("predict", str(folder), "--backend", "onnxruntime", "--artifacts-dir", str(artifacts_dir),
                   "--out", str(out), "--resume", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 4 and "4 already done" in proc.stderr
    assert already_done(out) == set(by_name)


def test_folder_listing_keeps_rglob_order_and_names(tmp_path):
    """The os.walk listing gives what pathlib's rglob + relative_to gave: the same files, names
    and order (by path components, so "b/c.jpg" before "b-1.jpg"), case kept, non-images out."""
    from app.imaging.headers import IMAGE_SUFFIXES

    for rel in ["a.jpg", "b/c.JPG", "b/a.png", "b.c/x.jpg", "b/c/d.jpeg", "B/z.jpg", "a b.jpg", "x.txt", "bb/1.jpg",
                "b-1.jpg", "b/.hid.jpg", "deep/er/still/i.webp"]:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    expected = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    got = list_images(str(tmp_path))
    assert [i.path for i in got] == expected
    assert [i.name for i in got] == [p.relative_to(tmp_path).as_posix() for p in expected]
