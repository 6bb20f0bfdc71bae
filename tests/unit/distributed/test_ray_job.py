"""``predict_with_ray`` on a local Ray cluster: a head node and two worker nodes (ONNX Runtime
actors, one per worker node).

The reference is the single-process ``predict_folder`` on the same folder and model: the
cluster must write the same record for every image, once, even when a node dies mid-run.
"""

from __future__ import annotations

import json
import threading

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster

from app.contracts import RunShape
from app.distributed import predict_with_ray
from app.errors import ArtifactError, BackendUnavailable, InvalidParameter
from app.predict.folder import predict_folder
from app.runtime import OpenOptions, open_detector

STORE = 150 * 2**20  # object store per node: small, the test images are a few MB
COPIES = 4  # of the 32-file folder, for the killed-node test


def job_options(artifacts_dir, **fields) -> OpenOptions:
    """The detector the jobs' actors open: ONNX Runtime, one thread, batches of 2, unless changed."""
    return OpenOptions("sample", artifacts_dir=artifacts_dir,
                       **{"backend": "onnxruntime", "ort_threads": 1, "shape": RunShape(max_batch=2), **fields})


@pytest.fixture(scope="module")
def cluster():
    # No CPU on the head node (the driver's reads ask for none) and one on each of two worker
    # nodes: the job's two actors (num_cpus=1 each) sit one per worker node whatever Ray's
    # placement does under load, so the killed-node test knows the node it kills holds one.
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": 0, "object_store_memory": STORE, "include_dashboard": False})
    doomed = c.add_node(num_cpus=1, object_store_memory=STORE)
    c.add_node(num_cpus=1, object_store_memory=STORE)
    ray.init(address=c.address, logging_level="WARNING")
    c.wait_for_nodes()
    yield c, doomed
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def photos(tmp_path_factory, assets_dir):
    """30 real photos in varied sizes, flips and formats, in sub-folders, plus two bad files."""
    import cv2

    root = tmp_path_factory.mktemp("photos")
    bus, zidane = cv2.imread(str(assets_dir / "bus.jpg")), cv2.imread(str(assets_dir / "zidane.jpg"))
    for i in range(30):
        src = (bus, zidane)[i % 2]
        side = 160 + 40 * i
        h, w = src.shape[:2]
        r = side / max(h, w)
        img = cv2.resize(src, (round(w * r), round(h * r)), interpolation=cv2.INTER_AREA)
        img = img[:, ::-1] if i % 3 == 0 else img
        folder = root / f"set{i % 3}"
        folder.mkdir(exist_ok=True)
        cv2.imwrite(str(folder / f"img{i:02d}{'.png' if i % 5 == 0 else '.jpg'}"), img)
    (root / "broken.jpg").write_bytes((assets_dir / "bus.jpg").read_bytes()[:500])
    (root / "empty.png").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def reference(photos, artifacts_dir, tmp_path_factory):
    """``yolopipe predict``'s records for the folder, by image name."""
    out = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    options = OpenOptions("sample", backend="onnxruntime", artifacts_dir=artifacts_dir, shape=RunShape(max_batch=4))
    with open_detector(options) as det:
        predict_folder(det, str(photos), out, det.params())
    return by_image(out.read_text().splitlines())


def by_image(lines):
    records = [json.loads(line) if isinstance(line, str) else line for line in lines]
    names = [r["image"] for r in records]
    assert len(names) == len(set(names)), "an image was written more than once"
    return {r["image"]: r for r in records}


def assert_same_records(got, want):
    assert set(got) == set(want)
    for name, ref in want.items():
        rec = got[name]
        if "error" in ref:
            assert rec.get("error") == ref["error"], name
            continue
        assert (rec["width"], rec["height"]) == (ref["width"], ref["height"]), name
        assert len(rec["detections"]) == len(ref["detections"]), name
        for d, e in zip(rec["detections"], ref["detections"]):
            assert d["class_id"] == e["class_id"] and d["class_name"] == e["class_name"], name
            assert d["score"] == pytest.approx(e["score"], abs=1e-4), name
            assert d["box"] == pytest.approx(e["box"], abs=0.05), name


def test_two_nodes_write_what_predict_writes(cluster, photos, artifacts_dir, reference, tmp_path):
    out = tmp_path / "ray.jsonl"
    progress = []
    summary = predict_with_ray(str(photos), out, options=job_options(artifacts_dir),
                               on_progress=lambda n, total: progress.append((n, total)))
    assert_same_records(by_image(out.read_text().splitlines()), reference)
    assert summary.images == len(reference) == 32 and summary.errors == 2
    assert summary.detections == sum(len(r.get("detections", [])) for r in reference.values())
    assert progress[0] == (0, 32) and sum(n for n, _ in progress) == 32


def test_uri_source_parquet_output_and_resume(cluster, photos, artifacts_dir, reference, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "preds.parquet"
    # an earlier run wrote part of the folder: resume skips those images and adds the rest once
    first = predict_with_ray(photos.as_uri() + "/**/img0*", out, options=job_options(artifacts_dir),
                             ship_artifacts=True)
    assert first.images == 10
    summary = predict_with_ray(photos.as_uri(), out, options=job_options(artifacts_dir), resume=True)
    assert (summary.skipped, summary.images) == (10, 22)
    again = predict_with_ray(photos.as_uri(), out, options=job_options(artifacts_dir), resume=True)
    assert (again.skipped, again.images) == (32, 0)
    rows = pq.read_table(out).to_pylist()
    records = [{k: v for k, v in r.items() if v is not None} for r in rows]
    assert_same_records(by_image(records), reference)


def test_user_mistakes_are_clear_errors(cluster, photos, artifacts_dir, tmp_path):
    with pytest.raises(BackendUnavailable, match="GPU"):
        predict_with_ray(str(photos), tmp_path / "x.jsonl", options=job_options(artifacts_dir, backend="torch-cuda"))
    with pytest.raises(InvalidParameter, match="gpu_actors is 0"):
        predict_with_ray(str(photos), tmp_path / "x.jsonl", options=job_options(artifacts_dir, backend="tensorrt"),
                         gpu_actors=0)
    with pytest.raises(InvalidParameter, match="conf"):
        predict_with_ray(str(photos), tmp_path / "x.jsonl", options=job_options(artifacts_dir), detect={"conf": 2.0})
    # resolved once, on the driver, by app.runtime: before any actor starts
    with pytest.raises(InvalidParameter, match="fp16"):
        predict_with_ray(str(photos), tmp_path / "x.jsonl", options=job_options(artifacts_dir, precision="fp16"))


def test_an_error_raised_in_the_actors_comes_back_as_itself(cluster, photos, artifacts_dir, tmp_path):
    """No INT8 model in this copy of the export: the actors fail opening it, and the job says why."""
    import shutil

    private = tmp_path / "artifacts"
    shutil.copytree(artifacts_dir, private, ignore=shutil.ignore_patterns("*int8*", "*.engine"))
    with pytest.raises(ArtifactError, match="no INT8 model"):
        predict_with_ray(str(photos), tmp_path / "x.jsonl", options=job_options(private, precision="int8"))


@pytest.fixture
def many_photos(photos, tmp_path):
    """The photo folder COPIES times over: long enough that a node dies mid-job."""
    import shutil

    root = tmp_path / "many"
    for k in range(COPIES):
        shutil.copytree(photos, root / f"copy{k}")
    return root


def test_killed_worker_node_costs_batches_not_the_job(cluster, many_photos, artifacts_dir, reference, tmp_path):
    """Last in this module: it takes the worker node away (and puts a fresh one back)."""
    import ray.data

    c, worker = cluster
    out = tmp_path / "ray.jsonl"
    want = {f"copy{k}/{name}": {**rec, "image": f"copy{k}/{name}"} for k in range(COPIES) for name, rec in reference.items()}
    started, result = threading.Event(), {}

    def on_progress(n, total):
        if n:
            started.set()

    def job():
        try:
            result["summary"] = predict_with_ray(str(many_photos), out, options=job_options(artifacts_dir),
                                                 on_progress=on_progress)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = exc

    # Ray Data waits for the whole pool before it feeds it: with one CPU per worker node, each
    # node then holds one of the two actors (the fixture's layout).
    ctx = ray.data.DataContext.get_current()
    saved, ctx.wait_for_min_actors_s = ctx.wait_for_min_actors_s, 240
    try:
        thread = threading.Thread(target=job)
        thread.start()
        assert started.wait(300), "the job never wrote a record"
    finally:
        ctx.wait_for_min_actors_s = saved
    c.remove_node(worker)
    written_before = len(out.read_text().splitlines())
    thread.join(300)
    assert not thread.is_alive(), "the job did not finish after the node died"
    assert "error" not in result, result.get("error")
    assert_same_records(by_image(out.read_text().splitlines()), want)
    assert result["summary"].images == 32 * COPIES and written_before < 32 * COPIES, "the node died after the job's end"
    c.add_node(num_cpus=1, object_store_memory=STORE)
