"""``yolopipe predict`` over a folder: JSONL objects, bad files reported, resume, COCO, images."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from app.errors import InvalidParameter
from app.predict.folder import list_images
from app.records import read_written
from tests.references import coco_document, image_json

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
    assert read_written(out).images == set(by_name)


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


def test_folder_lines_equal_the_detectors_per_image_results(folder, tmp_path, artifacts_dir):
    """The folder path runs the detector on each of its batches (the run's ``max_batch``: three
    for five files) and writes their lines in one go: the file is byte for byte
    ``json.dumps(to_json)`` of what ``Detector.detect`` gives each file, in listing order, with
    errors in their place; ``--coco`` (written from the batches' arrays) is byte for byte the
    document built from those records, and ``--save-images`` draws the same results."""
    from app.contracts import RunShape
    from app.predict.folder import predict_folder
    from app.runtime import OpenOptions, open_detector

    shutil.copy(folder / "bus.jpg", folder / "sub" / "bus copy ü.jpg")
    out, coco, viz = tmp_path / "p.jsonl", tmp_path / "coco.json", tmp_path / "viz"
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=2))
    with open_detector(options) as det:
        params = det.params()
        summary = predict_folder(det, str(folder), out, params, coco=coco, save_images=viz)
        images = list_images(str(folder))
        expected = [image_json(r, img.name, det.names) for img, r in
                    zip(images, det.detect([img.path.read_bytes() for img in images], params))]
    assert out.read_text() == "".join(json.dumps(rec) + "\n" for rec in expected)
    assert summary.images == 5 and summary.errors == 2
    assert summary.detections == sum(len(rec.get("detections", [])) for rec in expected)
    assert [f.split(":")[0] for f in summary.error_files] == ["broken.jpg", "empty.png"]
    assert coco.read_text() == json.dumps(coco_document(expected, ["Normal", "Fall"])) + "\n"
    assert sorted(p.relative_to(viz).as_posix() for p in viz.rglob("*.jpg")) == [
        "bus.jpg", "sub/bus copy ü.jpg", "sub/zidane.jpg"]


def test_each_images_header_is_read_once_and_reaches_a_pipeline_that_decodes_it(folder, tmp_path, cpu_detector,
                                                                                monkeypatch):
    """The reader threads read each file's header (checking it), and it travels with the bytes
    (``EncodedImage``) to a pipeline that decodes JPEGs itself (the GPU's; here a stand-in that
    decodes with the header it is given): one read per file, none again downstream."""
    from app.contracts import EncodedImage
    from app.pipeline.detector import Detector
    from app.predict.folder import predict_folder
    from tests.standins import DecodesItself, count_header_reads

    pipeline = DecodesItself(cpu_detector.pipeline)
    reads = count_header_reads(monkeypatch)
    out = tmp_path / "p.jsonl"
    summary = predict_folder(Detector(pipeline, max_batch=3), str(folder), out, cpu_detector.params(), workers=2)
    sizes = {img.name: img.path.stat().st_size for img in list_images(str(folder))}
    assert sorted(reads) == sorted(size for size in sizes.values() if size)  # empty.png has no header to read
    # The whole JPEGs, to decode itself; broken.jpg (cut short) is refused by its header check.
    jpegs = {(folder / name).read_bytes() for name in ("bus.jpg", "sub/zidane.jpg")}
    assert all(isinstance(x, EncodedImage) for x in pipeline.received)
    assert {x.data for x in pipeline.received} == jpegs and len(pipeline.received) == 2
    expected = out.with_name("cpu.jsonl")
    predict_folder(cpu_detector.reshaped(max_batch=3), str(folder), expected, cpu_detector.params())
    assert out.read_text() == expected.read_text() and summary.errors == 2


def test_readers_are_few_where_the_pipeline_decodes_and_many_where_they_decode(folder, tmp_path, cpu_detector,
                                                                                monkeypatch):
    """A reader that only reads and checks a header holds the GIL for short turns: where the
    pipeline decodes JPEGs itself, the folder reads with READERS_ENCODED threads; where the
    readers decode (the CPU pipeline), with READERS_DECODING. Both answer the same lines."""
    from app.pipeline.detector import Detector
    from app.predict import folder as folder_module
    from tests.standins import DecodesItself

    pools: list[int] = []
    real = folder_module.ThreadPoolExecutor

    class Spying(real):
        def __init__(self, max_workers=None, thread_name_prefix="", **kwargs):
            if thread_name_prefix == "read":
                pools.append(max_workers)
            super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix, **kwargs)

    monkeypatch.setattr(folder_module, "ThreadPoolExecutor", Spying)
    lines = []
    for detector in (Detector(DecodesItself(cpu_detector.pipeline), max_batch=3), cpu_detector.reshaped(max_batch=3)):
        out = tmp_path / f"{len(lines)}.jsonl"
        folder_module.predict_folder(detector, str(folder), out, cpu_detector.params())
        lines.append(out.read_text())
    assert pools == [folder_module.READERS_ENCODED, folder_module.READERS_DECODING]
    assert folder_module.READERS_ENCODED < folder_module.READERS_DECODING
    assert lines[0] == lines[1] and lines[0].count("\n") == 4  # bus, zidane, broken.jpg and empty.png


def test_large_runs_of_a_pipeline_that_decodes_walk_jpegs_compiled(folder, tmp_path, cpu_detector, monkeypatch):
    """From COMPILED_WALK_FROM images on, where the pipeline decodes JPEGs itself, the readers
    check JPEGs with the compiled walk (its load is paid once, where enough images win it back,
    on a thread of its own); fewer images, or readers that decode, keep the Python walk. The
    lines are the same."""
    from app.imaging import jpeg_structure
    from app.pipeline.detector import Detector
    from app.predict import folder as folder_module
    from tests.standins import DecodesItself

    monkeypatch.setattr(jpeg_structure, "_compiled_walk", None)  # this process's walk, as it was, after the test
    walks: list[bool] = []
    real_walk = jpeg_structure.walk_jpeg
    monkeypatch.setattr(jpeg_structure, "walk_jpeg", lambda data, **kw: walks.append(
        jpeg_structure._compiled_walk is not None) or real_walk(data, **kw))
    monkeypatch.setattr("app.imaging.headers.walk_jpeg", jpeg_structure.walk_jpeg)
    loads: list[bool] = []

    def load_and_wait(*, wait: bool = True):  # the real load, waited for: the run's walks are then all compiled
        loads.append(wait)
        loader = jpeg_structure.use_compiled_walk(wait=wait)
        if loader is not None:
            loader.join()

    monkeypatch.setattr(folder_module, "use_compiled_walk", load_and_wait)
    images = len(list_images(str(folder)))
    decodes = Detector(DecodesItself(cpu_detector.pipeline), max_batch=3)
    reads_and_decodes = cpu_detector.reshaped(max_batch=3)
    lines = []
    for detector, first in ((reads_and_decodes, images), (decodes, images + 1), (reads_and_decodes, 1), (decodes, images)):
        monkeypatch.setattr(folder_module, "COMPILED_WALK_FROM", first)
        walks.clear()
        out = tmp_path / f"{len(lines)}.jsonl"
        folder_module.predict_folder(detector, str(folder), out, cpu_detector.params())
        lines.append(out.read_text())
        if len(lines) < 4:
            assert walks and not any(walks), len(lines)  # the CPU pipeline, or too few images: Python
    assert loads == [False]  # the last run alone asked for it, on a thread of its own
    assert walks and all(walks)  # compiled from its first image on, the load waited for here
    assert len(set(lines)) == 1 and lines[0].count("cannot decode this JPEG") == 1


def test_rect_runs_hold_images_of_one_size_and_the_lines_keep_the_folder_order(tmp_path, assets_dir, cpu_detector):
    """Rect: photos of three input sizes, interleaved in the folder, run in batches of one size
    each (a window of batches grouped by size), fuller than the folder's order would make them;
    the lines are the folder's order, each the very bytes the image gets alone."""
    import cv2

    from app.predict.folder import RECT_WINDOW_BATCHES, predict_folder

    bus, zidane = cv2.imread(str(assets_dir / "bus.jpg")), cv2.imread(str(assets_dir / "zidane.jpg"))
    views = [bus, zidane, bus[:600], bus[:, ::-1], zidane[:, ::-1], bus[:600, ::-1], cv2.resize(zidane, (640, 360)),
             bus]
    folder = tmp_path / "mixed"
    folder.mkdir()
    for k, view in enumerate(views):
        cv2.imwrite(str(folder / f"{k:02d}.jpg"), view)
    det = cpu_detector.reshaped(max_batch=4)
    assert det.shape.letterbox == "rect" and RECT_WINDOW_BATCHES == 2
    runs: list[list[tuple[int, int]]] = []
    real_run = det.pipeline.run

    def recorded(images, params, **kwargs):
        runs.append([det.input_size(*x.shape[:2]) for x in images])
        return real_run(images, params, **kwargs)

    det.pipeline.run = recorded
    try:
        out = tmp_path / "p.jsonl"
        predict_folder(det, str(folder), out, det.params(), workers=2)
    finally:
        del det.pipeline.run
    # one window of eight: 640 × 480 (three bus views), 384 × 640 (three zidane views), 480 × 640 (two crops)
    assert runs == [[(640, 480)] * 3, [(384, 640)] * 3, [(480, 640)] * 2]
    images = list_images(str(folder))
    alone = [image_json(det.detect([img.path.read_bytes()], det.params())[0], img.name, det.names) for img in images]
    assert out.read_text() == "".join(json.dumps(rec) + "\n" for rec in alone)


def test_read_gives_the_bytes_or_the_reason(tmp_path):
    from app.errors import InvalidImage
    from app.predict.folder import SourceImage, _read

    data = np.random.default_rng(0).integers(0, 256, 300_001, dtype=np.uint8).tobytes()
    (tmp_path / "a.jpg").write_bytes(data)
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "dir.jpg").mkdir()
    assert _read(SourceImage(str(tmp_path / "a.jpg"), "a.jpg")) == data
    assert _read(SourceImage(tmp_path / "a.jpg", "a.jpg")) == data  # a Path works too
    assert _read(SourceImage(str(tmp_path / "empty.jpg"), "empty.jpg")) == b""
    for name, reason in [("gone.jpg", "No such file or directory"), ("dir.jpg", "Is a directory")]:
        err = _read(SourceImage(str(tmp_path / name), name))
        assert isinstance(err, InvalidImage) and str(err) == f"cannot read file: {reason}"


def test_listing_follows_what_os_walk_and_isfile_found(tmp_path):
    """Symlinked files are listed, symlinked folders are not entered, broken links and folders
    named like images are left out: as main's ``os.walk`` + ``os.path.isfile`` listing did."""
    import os

    from app.imaging.headers import IMAGE_SUFFIXES

    for rel in ["a.jpg", "d/b.png", "d/e/c.jpeg", "..x.jpg", ".jpg", "f.jpg/inner.jpg", "g..JPG"]:
        p = tmp_path / "root" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "o.jpg").write_bytes(b"x")
    root = tmp_path / "root"
    os.symlink(root / "a.jpg", root / "link.jpg")
    os.symlink(tmp_path / "outside", root / "linked-dir")
    os.symlink(tmp_path / "nothing.jpg", root / "broken.jpg")

    expected = []
    for folder_, _, names in os.walk(root):
        for name in names:
            full = os.path.join(folder_, name)
            if os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES and os.path.isfile(full):
                expected.append(os.path.relpath(full, root).replace(os.sep, "/"))
    expected.sort(key=lambda n: n.split("/"))
    got = list_images(str(root))
    assert [i.name for i in got] == expected
    assert "link.jpg" in expected and "f.jpg/inner.jpg" in expected and "g..JPG" in expected
    assert all(i.path == root / i.name for i in got)


def test_suffix_rules_are_splitext_and_path_suffix():
    import os
    from pathlib import Path

    from app.files import _suffix
    from app.predict.folder import SourceImage, _is_video
    from app.predict.video import is_video

    names = ["a.jpg", ".jpg", "..jpg", "a..jpg", "...", "a.", ".a.JPG", "a", ".", "..", "a.b.c", "x.tar.gz",
             ".hid.jpg", "..a.b", "a b.JpEg", "é.JPG", "...a", ".a.", "v.MP4", "..mp4", ".mp4", "c.gif", "x.avi"]
    for name in names:
        assert _suffix(name) == os.path.splitext(name)[1].lower(), name
        for rel in (name, f"d.mp4/{name}") if name not in (".", "..") else ():  # no file has those names
            assert _is_video(SourceImage(rel, rel)) == is_video(Path(rel)), rel


def test_listing_order_is_by_path_components_on_awkward_names(tmp_path):
    """Names that sort differently as whole strings and by components ("a/b" vs "a-b", "a.b",
    "a b", "a0"): the listing keeps the component order."""
    rng = np.random.default_rng(7)
    alphabet = list("a-. 0_~")
    rels = set()
    while len(rels) < 60:
        parts = ["".join(rng.choice(alphabet, int(rng.integers(1, 4)))) for _ in range(int(rng.integers(1, 4)))]
        if all(p.strip(".") and p.strip() == p for p in parts):
            rels.add("/".join("d" + p for p in parts[:-1]) + ("/" if len(parts) > 1 else "") + "x" + parts[-1] + ".jpg")
    made = []
    for rel in rels:
        p = tmp_path / rel
        if any(q.is_file() for q in p.parents):
            continue  # a folder where a file is already: not both
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
        made.append(rel)
    got = [i.name for i in list_images(str(tmp_path))]
    assert got == sorted(made, key=lambda n: n.split("/")) and len(got) > 40
