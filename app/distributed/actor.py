"""What runs on the cluster: the read task (paths → bytes) and the detector actor (bytes → records).

Image bytes travel through Ray's object store, never decoded pixels: a JPEG is ~10x smaller
than its frame, and the actor decodes where its pipeline does (nvImageCodec on a GPU actor,
OpenCV on an ONNX Runtime one). Each actor opens one detector when it starts and keeps it:
CUDA graphs of every batch bucket are captured before the first batch arrives.

A batch in and out of both is a ``pyarrow.Table``:

* read task: ``image`` (name), ``path`` → ``image``, ``data`` (bytes, null on error), ``error``;
* actor: → ``RECORD_COLUMNS``: ``image``, ``line`` (the JSON line ``yolopipe predict`` writes,
  newline included, so the driver writes a batch's lines as one buffer), ``error`` (null when
  detected), ``detections`` (count).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from app.distributed.sources import read_bytes

RECORD_COLUMNS = ("image", "line", "error", "detections")


def read_batch(batch: Any, *, filesystem: Any) -> Any:
    """Ray Data ``map_batches`` function: read every path of the batch through ``filesystem``."""
    import pyarrow as pa

    data, errors = [], []
    for path in batch.column("path").to_pylist():
        got = read_bytes(filesystem, path)
        ok = isinstance(got, bytes)
        data.append(got if ok else None)
        errors.append(None if ok else str(got))
    return pa.table(
        {"image": batch.column("image"), "data": pa.array(data, pa.binary()), "error": pa.array(errors, pa.string())}
    )


class DetectorActor:
    """Ray Data ``map_batches`` class: one detector per actor (per GPU, or per CPU worker)."""

    def __init__(
        self,
        *,
        model_dir: str,
        onnx_sha256: str,
        open_kwargs: dict[str, Any],
        params: dict[str, Any],
        bundle: Any = None,
        ort_threads: int | None = None,
    ) -> None:
        from app.distributed.shipping import model_dir_here
        from app.runtime import open_model_dir

        fetch: Callable[[], dict[str, bytes]] | None = None
        if bundle is not None:
            import ray

            fetch = lambda: ray.get(bundle[0])
        here = model_dir_here(model_dir, onnx_sha256, fetch)
        # The export already exists and matches: it is only loaded, never rebuilt.
        self.detector = open_model_dir(here, ort_threads=ort_threads or 0, **open_kwargs)
        self.params = self.detector.params(**params)
        self.detector.pipeline.warmup()  # GPU pipelines: capture every bucket's graph now

    def __call__(self, batch: Any) -> Any:
        from app.contracts import ImageResult
        from app.errors import InvalidImage

        names = batch.column("image").to_pylist()
        data = batch.column("data").to_pylist()
        read_errors = batch.column("error").to_pylist()
        results: list[ImageResult | None] = [None] * len(names)
        todo = [i for i, err in enumerate(read_errors) if err is None]
        for i, err in enumerate(read_errors):
            if err is not None:
                results[i] = ImageResult(error=InvalidImage(err))
        for i, res in zip(todo, self.detector.detect([data[i] for i in todo], self.params)):
            results[i] = res
        return record_table(names, results, self.detector.names)


def record_table(names: list[str], results: list[Any], class_names: list[str]) -> Any:
    """The actor's output table (``RECORD_COLUMNS``) for ``results``, one per name."""
    import pyarrow as pa

    lines, errors, counts = [], [], []
    for name, res in zip(names, results):
        record = res.to_json(name, class_names)
        lines.append(json.dumps(record) + "\n")
        errors.append(record.get("error"))
        counts.append(len(record.get("detections", ())))
    return pa.table(
        {
            "image": pa.array(names, pa.string()),
            "line": pa.array(lines, pa.string()),
            "error": pa.array(errors, pa.string()),
            "detections": pa.array(counts, pa.int32()),
        }
    )
