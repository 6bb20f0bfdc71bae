"""What runs on the cluster: the read task (paths → bytes) and the detector actor (bytes → records).

Image bytes travel through Ray's object store, never decoded pixels: a JPEG is ~10x smaller
than its frame, and the actor decodes where its pipeline does (nvImageCodec on a GPU actor,
OpenCV on an ONNX Runtime one). Each actor opens one detector when it starts and keeps it:
CUDA graphs of every batch bucket are captured before the first batch arrives.

A batch in and out of both is a ``pyarrow.Table``:

* read task: ``image`` (name), ``path`` → ``image``, ``data`` (bytes, null on error), ``error``;
* actor: → ``RECORD_COLUMNS``: ``image``, ``line`` (the JSON line ``yolopipe predict`` writes,
  from ``app.records``, newline included, so the driver writes a batch's lines as one buffer),
  ``error`` (null when detected), ``detections`` (count).

The actor's detector runs with ``RunShape.in_flight`` batches in flight: Ray gives it as many
calls at once (``app.distributed.job``), each ``Detector.run`` on one batch.
"""

from __future__ import annotations

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
        open_kwargs: dict[str, Any],  # the job's backend, precision and max_batch
        params: dict[str, Any],
        bundle: Any = None,
        ort_threads: int | None = None,
    ) -> None:
        from app.contracts import RunShape
        from app.distributed.shipping import model_dir_here
        from app.runtime import open_model_dir

        fetch: Callable[[], dict[str, bytes]] | None = None
        if bundle is not None:
            import ray

            fetch = lambda: ray.get(bundle[0])
        here = model_dir_here(model_dir, onnx_sha256, fetch)
        # The export already exists and matches: it is only loaded, never rebuilt.
        self.detector = open_model_dir(here, RunShape(max_batch=open_kwargs["max_batch"]),
                                       backend=open_kwargs["backend"], precision=open_kwargs["precision"],
                                       ort_threads=ort_threads or 0)
        self.params = self.detector.params(**params)
        self.detector.warmup()  # GPU pipelines: capture every bucket's graph now

    def __call__(self, batch: Any) -> Any:
        from app.errors import InvalidImage

        names = batch.column("image").to_pylist()
        data = batch.column("data").to_pylist()
        read_errors = batch.column("error").to_pylist()
        items = [InvalidImage(err) if err is not None else d for d, err in zip(data, read_errors)]
        return record_table(names, self.detector.run(items, self.params), self.detector.names)


def record_table(names: list[str], answers: Any, class_names: list[str]) -> Any:
    """The actor's output table (``RECORD_COLUMNS``) for ``answers`` (a ``DetectedBatch``), one
    row per name."""
    import pyarrow as pa

    from app.records import image_lines

    lines = [line + "\n" for line in image_lines(names, answers, class_names)]
    errors = [str(answers.errors[i]) if i in answers.errors else None for i in range(len(names))]
    return pa.table(
        {
            "image": pa.array(names, pa.string()),
            "line": pa.array(lines, pa.string()),
            "error": pa.array(errors, pa.string()),
            "detections": pa.array(answers.counts, pa.int32()),
        }
    )
