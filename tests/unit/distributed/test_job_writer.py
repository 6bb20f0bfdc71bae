"""The driver's side of the job, without Ray: how the listing is cut into blocks, and the
writer that keeps every image once whatever Ray ran twice."""

from __future__ import annotations

import json

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from app.contracts import ImageResult
from app.distributed.actor import RECORD_COLUMNS, record_table
from app.distributed.job import BATCHES_PER_BLOCK, BLOCKS_PER_ACTOR, block_size, write_records
from app.distributed.output import open_sink
from app.errors import InvalidImage
from app.records import FolderSummary
from app.types import Detections
from tests.references import detected_batch, image_json

NAMES = ["Normal", "Fall"]


def result(n: int) -> ImageResult:
    boxes = np.array([[i, i, i + 10.5, i + 20.25] for i in range(n)], np.float32).reshape(n, 4)
    dets = Detections(boxes, np.linspace(0.9, 0.5, n, dtype=np.float32), np.arange(n, dtype=np.int32) % 2)
    return ImageResult(width=64, height=48, detections=dets)


def test_blocks_hold_several_whole_batches_but_every_actor_gets_a_few():
    assert block_size(20_000, 64, 2) == 64 * BATCHES_PER_BLOCK  # large jobs: big blocks
    assert block_size(20_000, 64, 1) == 64 * BATCHES_PER_BLOCK
    assert block_size(32, 2, 2) == 32 // (2 * BLOCKS_PER_ACTOR)  # short jobs: still work for every actor
    assert block_size(1000, 64, 4) == 64  # 16 blocks for 4 actors: one batch each
    assert block_size(3, 64, 4) == 64  # never less than one batch
    for images, batch, actors in ((20_000, 64, 2), (999, 32, 3), (130, 8, 5), (7, 2, 1)):
        assert block_size(images, batch, actors) % batch == 0  # a partial batch only at the very end


def test_retried_images_are_written_once_and_counted_once(tmp_path):
    first = record_table(["a.jpg", "b.jpg", "bad.png"],
                         detected_batch([result(2), result(0), ImageResult(error=InvalidImage("cut"))]), NAMES)
    retried = record_table(["b.jpg", "c.jpg"], detected_batch([result(0), result(3)]), NAMES)  # b.jpg came back twice
    assert first.column_names == list(RECORD_COLUMNS)
    out = tmp_path / "p.jsonl"
    sink = open_sink(out, "jsonl", resume=False)
    summary, progress = FolderSummary(), []
    seen = {"old.jpg"}  # resume: written by an earlier run
    earlier = record_table(["old.jpg"], detected_batch([result(1)]), NAMES)
    write_records(iter([first, earlier, retried]), sink, seen, summary, 4, lambda n, t: progress.append((n, t)))
    sink.close()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["image"] for r in records] == ["a.jpg", "b.jpg", "bad.png", "c.jpg"]
    assert records[0] == image_json(result(2), "a.jpg", NAMES)
    assert records[2] == {"image": "bad.png", "error": "cut"}
    assert (summary.images, summary.detections, summary.errors) == (4, 5, 1)
    assert summary.error_files == ["bad.png: cut"]
    assert progress == [(3, 4), (1, 4)]
    assert seen == {"old.jpg", "a.jpg", "b.jpg", "bad.png", "c.jpg"}
