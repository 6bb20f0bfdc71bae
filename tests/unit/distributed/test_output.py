"""The driver's writer: format choice, Parquet parts, and what resume reads back."""

from __future__ import annotations

import json

import pytest

from app.distributed.output import done_images, open_sink, resolve_format
from app.errors import InvalidParameter

pa = pytest.importorskip("pyarrow")

RECORDS = [
    {"image": "a.jpg", "width": 640, "height": 480,
     "detections": [{"box": [1.5, 2.0, 30.25, 40.0], "score": 0.9, "class_id": 1, "class_name": "Fall"}]},
    {"image": "sub/b.jpg", "width": 10, "height": 20, "detections": []},
    {"image": "bad.png", "error": "cannot decode this image"},
]


def lines(records, *, large=False):
    return pa.array([json.dumps(r) + "\n" for r in records], pa.large_string() if large else pa.string())


def test_format_from_suffix_or_request(tmp_path):
    assert resolve_format(tmp_path / "p.jsonl", None) == "jsonl"
    assert resolve_format(tmp_path / "p.parquet", None) == "parquet"
    assert resolve_format(tmp_path / "p", "parquet") == "parquet"
    with pytest.raises(InvalidParameter):
        resolve_format(tmp_path / "p", "csv")


def test_parquet_parts_hold_the_json_records(tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "p.parquet"
    sink = open_sink(out, "parquet", resume=False)
    sink.rows_per_part = 2
    sink.write_lines(lines(RECORDS))  # 3 rows: one full part now, the rest at close
    assert len(list(out.glob("part-*.parquet"))) == 1
    sink.close()
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["image"])
    want = sorted(RECORDS, key=lambda r: r["image"])
    for got, exp in zip(rows, want):
        assert got["image"] == exp["image"] and got["error"] == exp.get("error")
        assert got["width"] == exp.get("width") and got["height"] == exp.get("height")
        assert [d["class_name"] for d in got["detections"] or []] == [d["class_name"] for d in exp.get("detections", [])]
    assert rows[0]["detections"][0]["box"] == pytest.approx([1.5, 2.0, 30.25, 40.0])
    assert done_images(out, "parquet") == {"a.jpg", "sub/b.jpg", "bad.png"}

    # resume keeps the parts; a fresh run replaces them
    open_sink(out, "parquet", resume=True).close()
    assert done_images(out, "parquet") == {"a.jpg", "sub/b.jpg", "bad.png"}
    open_sink(out, "parquet", resume=False).close()
    assert done_images(out, "parquet") == set()


def test_jsonl_resume_appends(tmp_path):
    out = tmp_path / "p.jsonl"
    sink = open_sink(out, "jsonl", resume=False)
    sink.write_lines(lines(RECORDS[:1]))
    sink.close()
    sink = open_sink(out, "jsonl", resume=True)
    sink.write_lines(lines(RECORDS[1:2]))
    sink.close()
    assert done_images(out, "jsonl") == {"a.jpg", "sub/b.jpg"}


@pytest.mark.parametrize("large", [False, True])
def test_jsonl_writes_sliced_and_chunked_columns_line_for_line(tmp_path, large):
    """A filtered or sliced column (offsets not at 0) and several chunks: exactly its own lines."""
    out = tmp_path / "p.jsonl"
    column = pa.chunked_array([lines(RECORDS, large=large).slice(1), lines(RECORDS[:1], large=large), lines([], large=large)])
    sink = open_sink(out, "jsonl", resume=False)
    sink.write_lines(column)
    sink.write_lines(lines(RECORDS, large=large).filter(pa.array([True, False, True])))
    sink.close()
    want = [RECORDS[1], RECORDS[2], RECORDS[0], RECORDS[0], RECORDS[2]]
    assert [json.loads(line) for line in out.read_text().splitlines()] == want


def test_parquet_output_must_be_a_folder(tmp_path):
    (tmp_path / "f.parquet").write_text("x")
    with pytest.raises(InvalidParameter, match="folder"):
        open_sink(tmp_path / "f.parquet", "parquet", resume=False)
