"""Plain data passed between the stages of the pipeline (NumPy and dataclasses only), and the
record of a start-up's steps."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Letterbox:
    """How one source image was placed into the model input (Ultralytics' ``LetterBox``): an
    ``input_h × input_w`` input, ``imgsz`` square or, rect, the smallest multiple of the stride
    that holds the resized image (``app.imaging.letterbox.letterbox_params``).

    ``new_w``/``new_h`` is the resized image before padding; ``pad_left``/``pad_top`` are the
    integer pads on the left and top. Boxes go back by ``undo`` (Ultralytics' ``scale_boxes``).
    """

    src_h: int
    src_w: int
    new_h: int
    new_w: int
    pad_top: int
    pad_left: int
    input_h: int  # the model input's height and width
    input_w: int

    @property
    def undo(self) -> tuple[int, int, float, float]:
        """``(pad_x, pad_y, gain_x, gain_y)``: a box in input pixels goes back to the source by
        ``(x - pad_x) / gain_x``. As Ultralytics' ``scale_boxes`` recomputes them from the input
        and source shapes alone: on a square input that is the placement itself; on a rect one its
        gain is the smaller of the two sides' (not the square's), which for about one size in
        150 rounds one side of the resized image differently from the placement, and Ultralytics'
        boxes go back by that."""
        return _undo(self.src_h, self.src_w, self.input_h, self.input_w)


@functools.lru_cache(maxsize=4096)  # sizes repeat (a camera's, a client's): a batch's undo is looked up, not redone
def _undo(src_h: int, src_w: int, input_h: int, input_w: int) -> tuple[int, int, float, float]:
    gain = min(input_h / src_h, input_w / src_w)
    new_h, new_w = max(round(src_h * gain), 1), max(round(src_w * gain), 1)
    pad_x, pad_y = round((input_w - new_w) / 2 - 0.1), round((input_h - new_h) / 2 - 0.1)
    return pad_x, pad_y, new_w / src_w, new_h / src_h


@dataclass
class Detections:
    """Final detections of one image, in original-image pixels, sorted by descending score."""

    boxes: np.ndarray  # [N, 4] float32 x1, y1, x2, y2
    scores: np.ndarray  # [N] float32
    class_ids: np.ndarray  # [N] int32

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    @classmethod
    def empty(cls) -> Detections:
        return cls(np.zeros((0, 4), np.float32), np.zeros((0,), np.float32), np.zeros((0,), np.int32))

    @classmethod
    def from_rows(cls, rows: np.ndarray) -> Detections:
        """From ``[N, 6]`` rows of x1, y1, x2, y2, score, class (the NMS output layout)."""
        rows = np.asarray(rows, dtype=np.float32).reshape(-1, 6)
        return cls(rows[:, :4].copy(), rows[:, 4].copy(), rows[:, 5].astype(np.int32))


@dataclass
class ModelMeta:
    """What ``yolopipe export`` writes to ``meta.json`` in the model's artifacts folder."""

    name: str
    names: list[str]
    imgsz: int
    stride: int
    input_name: str
    output_name: str
    input_shape: list[Any]  # ["batch", 3, "height", "width"] (dynamic; up to imgsz × imgsz)
    output_shape: list[Any]  # ["batch", 4 + nc, anchors at the imgsz square], e.g. ["batch", 6, 8400]
    opset: int
    weights_sha256: str
    onnx_sha256: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.names)

    @property
    def num_anchors(self) -> int:
        """The head's outputs per image at the ``imgsz`` square (the most any input has)."""
        return int(self.output_shape[2])

    @property
    def dynamic_hw(self) -> bool:
        """The model takes any input height and width (multiples of the stride), not only the
        square: every export since rect inputs; earlier ones were pinned to ``imgsz``."""
        return all(isinstance(d, str) for d in self.input_shape[2:])

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> ModelMeta:
        return cls(**json.loads(Path(path).read_text()))


class StartupSteps:
    """The steps of one start-up (opening the model, building what is missing, capturing graphs),
    each with its wall time, in order. ``listener`` hears each step as it begins and every
    progress line said within it (the CLI's spinner, the service's ``/readyz`` phase)."""

    def __init__(self, listener: Callable[[str], None] | None = None) -> None:
        self.listener = listener
        self.steps: list[tuple[str, float]] = []
        self._open: tuple[str, float] | None = None

    def say(self, text: str) -> None:
        if self.listener is not None:
            self.listener(text)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.say(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.steps.append((name, time.perf_counter() - started))

    def record(self, name: str, seconds: float) -> None:
        self.steps.append((name, seconds))

    def begin(self, name: str) -> None:
        """A step that lasts until the next ``begin`` or ``finish`` (for steps a callback names)."""
        self.finish()
        self._open = (name, time.perf_counter())
        self.say(name)

    def finish(self) -> None:
        if self._open is not None:
            name, started = self._open
            self.steps.append((name, time.perf_counter() - started))
        self._open = None

    def as_json(self) -> list[dict[str, Any]]:
        return [{"step": name, "s": round(seconds, 3)} for name, seconds in self.steps]

    def lines(self) -> list[str]:
        return [f"{seconds:7.2f} s  {name}" for name, seconds in self.steps]


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: from /proc), or None where that is unknown:
    what a start-up took before any of our code ran (the interpreter, the imports)."""
    try:
        with open("/proc/self/stat") as fh:
            started_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
