"""What runs on the cluster: the read task (paths → bytes) and the detector actor (bytes → records).

Image bytes travel through Ray's object store, never decoded pixels: a JPEG is ~10x smaller
than its frame, and the actor decodes where its pipeline does (nvImageCodec on a GPU actor,
OpenCV on an ONNX Runtime one). Each actor opens one detector when it starts and keeps it:
CUDA graphs of every batch bucket are captured before the first batch arrives.

What an actor is made with survives its restart on another node (Ray runs the constructor
again with the same arguments): the job's ``OpenOptions`` and the other small values, by value,
and, for nodes that do not see the driver's disk, the model folder's files as one object the
driver owns and keeps until the job ends (nested in a list: fetched only where it is needed).
Everything heavy the actor makes itself from them: the folder unpacked on its node
(``app.distributed.shipping``), the torch-cuda engine built on its GPU when missing
(``app.runtime.ensure_engine``), the detector opened.

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
from typing import TYPE_CHECKING, Any

from app.distributed.sources import read_bytes

if TYPE_CHECKING:
    from app.runtime import OpenOptions

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
        options: OpenOptions,  # the job's detector, on the plan's backend, on this actor's GPU (device 0)
        model_dir: str,  # the driver's folder, with its export's hash
        onnx_sha256: str,
        detect: dict[str, Any],  # Detector.params' keywords
        bundle: list[Any] | None = None,  # [the folder's files in Ray's object store], for nodes without it
    ) -> None:
        from app.distributed.shipping import model_dir_here
        from app.runtime import ensure_engine, open_model_dir

        fetch: Callable[[], dict[str, bytes]] | None = None
        if bundle is not None:
            import ray

            fetch = lambda: ray.get(bundle[0])
        here = model_dir_here(model_dir, onnx_sha256, fetch)
        # The export is the driver's, used as it is. What runs on this GPU alone is built here.
        ensure_engine(here, options)
        self.detector = open_model_dir(here, options)
        self.params = self.detector.params(**detect)
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
