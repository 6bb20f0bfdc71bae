"""``/v1/detect``'s query string read without FastAPI, for the forms a client ordinarily sends:
``conf`` and ``iou`` as plain decimals, ``max_det`` as digits, ``classes`` as comma-separated
digits (repeatable), ``agnostic`` as ``true``/``false``/``1``/``0``, each other name once. For
anything else (an unknown name, a percent-escape, a value out of range or of another spelling)
``detect_params`` answers None and FastAPI reads the request, so its 422s stay what they are.
"""

from __future__ import annotations

import re

from app.config import CONF, IOU, MAX_DET
from app.contracts import DetectParams, make_params

_UNIT = re.compile(rb"(?:0|1)(?:\.[0-9]{1,12})?")  # a decimal within [0, 2): checked <= 1 below
_COUNT = re.compile(rb"[1-9][0-9]{0,5}")
_CLASSES = re.compile(rb"[0-9]{1,6}(?:,[0-9]{1,6})*")
_BOOLS = {b"true": True, b"false": False, b"1": True, b"0": False}


def detect_params(query: bytes, num_classes: int) -> DetectParams | None:
    """The parameters ``query`` (a raw query string) asks for, or None unless it is plain.
    Class ids the model has not are ``make_params``' 422, as FastAPI's route raises it."""
    conf, iou, max_det, agnostic = CONF, IOU, MAX_DET, False
    classes: list[int] = []
    seen: set[bytes] = set()
    for pair in query.split(b"&") if query else ():
        name, eq, value = pair.partition(b"=")
        if not eq or (name in seen and name != b"classes"):
            return None
        seen.add(name)
        if name in (b"conf", b"iou"):
            if _UNIT.fullmatch(value) is None or float(value) > 1.0:
                return None
            if name == b"conf":
                conf = float(value)
            else:
                iou = float(value)
        elif name == b"max_det":
            if _COUNT.fullmatch(value) is None or int(value) > MAX_DET:
                return None
            max_det = int(value)
        elif name == b"classes":
            if _CLASSES.fullmatch(value) is None:
                return None
            classes += [int(c) for c in value.split(b",")]
        elif name == b"agnostic":
            if value not in _BOOLS:
                return None
            agnostic = _BOOLS[value]
        else:
            return None
    return make_params(conf, iou, max_det, classes or None, agnostic, num_classes=num_classes)
