"""The driver's side of the output: one writer, each image written once, resumable.

Only the driver writes. Ray Data may run a batch twice (a task retried after its node died,
an actor restarted mid-batch), so records are keyed by image name and a name already written
— in this run or, with resume, in an earlier one — is dropped. The file therefore holds every
image exactly once, whatever was retried.

* JSONL: one line per image, the schema of ``yolopipe predict`` (``app.records``),
  appended and flushed per block, so a killed run loses at most its last block. A block's
  lines arrive as an Arrow string column, newlines included, and go out as its one buffer.
* Parquet: ``out`` is a folder of ``part-<run>-<n>.parquet`` files, each written whole (temp
  name, then rename) every ``rows_per_part`` images and at the end; an interrupted run keeps
  every finished part. Columns: ``image``, ``width``, ``height``, ``detections`` (a list of
  ``box``, ``score``, ``class_id``, ``class_name``) and ``error``, as in the JSON lines.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from app.errors import InvalidParameter
from app.records import read_written

FORMATS = ("jsonl", "parquet")
PART_GLOB = "part-*.parquet"


def resolve_format(out: Path, requested: str | None) -> str:
    """``requested``, else ``parquet`` for a path ending in ``.parquet``, else ``jsonl``."""
    fmt = requested or ("parquet" if Path(out).suffix == ".parquet" else "jsonl")
    if fmt not in FORMATS:
        raise InvalidParameter(f"unknown output format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def parquet_schema() -> Any:
    import pyarrow as pa

    detection = pa.struct(
        [("box", pa.list_(pa.float32())), ("score", pa.float32()), ("class_id", pa.int32()), ("class_name", pa.string())]
    )
    return pa.schema(
        [("image", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
         ("detections", pa.list_(detection)), ("error", pa.string())]
    )


def done_images(out: Path, fmt: str) -> set[str]:
    """Images an earlier run already wrote to ``out``."""
    out = Path(out)
    if fmt == "jsonl":
        return read_written(out).images
    if not out.is_dir():
        return set()
    import pyarrow.parquet as pq

    done: set[str] = set()
    for part in sorted(out.glob(PART_GLOB)):
        done.update(pq.read_table(part, columns=["image"]).column("image").to_pylist())
    return done


def string_bytes(array: Any) -> memoryview:
    """The characters of an Arrow string array end to end (its data buffer, offsets applied)."""
    import numpy as np
    import pyarrow as pa

    if not len(array):
        return memoryview(b"")
    offset_type = np.int64 if pa.types.is_large_string(array.type) else np.int32
    _, offsets_buf, data = array.buffers()
    offsets = np.frombuffer(offsets_buf, offset_type)[array.offset : array.offset + len(array) + 1]
    return memoryview(data)[int(offsets[0]) : int(offsets[-1])]


class JsonlSink:
    def __init__(self, out: Path, *, resume: bool) -> None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(out, "ab" if resume else "wb")  # noqa: SIM115 - held until close()

    def write_lines(self, lines: Any) -> None:
        """``lines``: an Arrow string (chunked) array of JSON lines, each ending in a newline."""
        for chunk in getattr(lines, "chunks", [lines]):
            if chunk.null_count:
                raise ValueError("a record line is null")  # an actor bug; never write a torn file
            self._fh.write(string_bytes(chunk))
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class ParquetSink:
    def __init__(self, out: Path, *, resume: bool, rows_per_part: int = 10_000) -> None:
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise InvalidParameter(f"parquet output {out} must be a folder (it holds part files)")
        self.out.mkdir(parents=True, exist_ok=True)
        if not resume:
            for old in self.out.glob(PART_GLOB):
                old.unlink()
        self.rows_per_part = rows_per_part
        self._run = time.strftime("%Y%m%d%H%M%S") + f"{os.getpid() % 100000:05d}"
        self._parts = 0
        self._pending: list[dict[str, Any]] = []

    def write_lines(self, lines: Any) -> None:
        """``lines``: an Arrow string (chunked) array of JSON lines."""
        self._pending.extend(json.loads(line) for line in lines.to_pylist())
        if len(self._pending) >= self.rows_per_part:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(self._pending, schema=parquet_schema())
        final = self.out / f"part-{self._run}-{self._parts:05d}.parquet"
        tmp = final.with_name("." + final.name + ".tmp")
        pq.write_table(table, tmp)
        tmp.replace(final)
        self._parts += 1
        self._pending = []

    def close(self) -> None:
        self._flush()


def open_sink(out: Path, fmt: str, *, resume: bool) -> JsonlSink | ParquetSink:
    return ParquetSink(out, resume=resume) if fmt == "parquet" else JsonlSink(out, resume=resume)
