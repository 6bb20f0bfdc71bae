"""What the Open Inference Protocol's inference means here, over REST and gRPC alike.

The model's names, the request parameters (``/v1``'s, with its defaults and limits), the
request's own timeout, the per-image error, and the end of an inference request
(``infer_outputs``: from a read request to its output tensors). ``app/api/oip/routes.py`` (REST)
and ``app/api/grpc`` (gRPC) both call these, so the two protocols check the same things and
answer the same errors. No web framework here: a gRPC worker imports it without FastAPI.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from prometheus_client import Counter

from app.api.oip.shared_memory import RegionAccess
from app.api.oip.tensors import InferRequest, output_tensors, write_output_regions
from app.api.uploads import check_request_images
from app.config import CONF, IOU, MAX_DET
from app.contracts import DetectParams, make_params
from app.errors import InvalidParameter, ModelNotFound, RequestTimeout, YolopipeError
from app.ipc.answers import Answers
from app.ipc.client import SERVER_SIDE, InferenceClient
from app.settings import Settings

MODEL = "yolopipe"
VERSION = "1"


def extensions(settings: Settings) -> list[str]:
    """The protocol extensions this server speaks (server metadata)."""
    return ["binary_tensor_data", "parameters"] + (["system_shared_memory"] if settings.allow_client_shm else [])


def model_name(name: str, version: str | None, settings: Settings) -> str:
    """``name`` when it names this model (``yolopipe`` or the weights' name) at a version it has."""
    if name not in (MODEL, settings.weights):
        raise ModelNotFound(f"unknown model {name[:100]!r}; this server serves {MODEL!r} (also as {settings.weights!r})")
    if version not in (None, "", VERSION):
        raise ModelNotFound(f"model {name!r} has version {VERSION!r} only, not {version[:20]!r}")
    return name


async def detect_within(inference: InferenceClient, images: list[bytes], headers: list[Any], params: DetectParams,
                        timeout_s: float | None, settings: Settings) -> Answers:
    """The inference client's answer, within the request's own timeout when it asks for a shorter
    one than the server's (Triton's ``timeout`` parameter, a gRPC deadline); cancelling stops its
    queued work. ``headers``: each image's, as read here; they travel with the bytes, so the
    inference worker never reads them again."""
    if timeout_s is None or timeout_s >= settings.request_timeout_s:
        return await inference.detect(images, params, headers)
    try:
        return await asyncio.wait_for(inference.detect(images, params, headers), max(timeout_s, 0.0))
    except TimeoutError:
        raise RequestTimeout(f"no result within the request's timeout of {timeout_s:g} s") from None


def detect_params(parameters: dict[str, Any], *, num_classes: int) -> DetectParams:
    """``/v1``'s parameters (names, defaults, limits) from a request's ``parameters`` object."""
    values = dict(parameters)
    conf = _number(values.pop("conf", CONF), "conf")
    iou = _number(values.pop("iou", IOU), "iou")
    max_det = values.pop("max_det", MAX_DET)
    if not isinstance(max_det, int) or isinstance(max_det, bool):
        raise InvalidParameter(f"max_det must be an integer, got {str(max_det)[:40]!r}")
    agnostic = values.pop("agnostic", False)
    if not isinstance(agnostic, bool):
        raise InvalidParameter(f"agnostic must be true or false, got {str(agnostic)[:40]!r}")
    classes = _class_ids(values.pop("classes", None))
    if values:
        raise InvalidParameter(f"unknown parameters {sorted(values)[:8]}; this model takes conf, iou, max_det, "
                               "classes and agnostic")
    return make_params(conf, iou, max_det, classes, agnostic, num_classes=num_classes)


def _number(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidParameter(f"{name} must be a number, got {str(value)[:40]!r}")
    return float(value)


def _class_ids(value: Any) -> list[int] | None:
    """A list of class ids, one id, or a comma string ("0,2"), as ``/v1``'s ``classes``."""
    if value is None:
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.lstrip("-").isdigit() for p in parts):
            raise InvalidParameter(f"classes must be integer class ids, got {value[:60]!r}")
        return [int(p) for p in parts] or None
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in items):
        raise InvalidParameter(f"classes must be integer class ids, got {str(value)[:60]!r}")
    return items or None


def for_image(index: int, error: YolopipeError) -> YolopipeError:
    """The same error (so the same status), saying which image of the batch it was."""
    return type(error)(f"image {index}: {error.message}", hint=error.hint)


async def infer_outputs(inference: InferenceClient, request: InferRequest, settings: Settings,
                        regions: RegionAccess | None, rejected: Counter,
                        timeout_s: float | None) -> dict[str, np.ndarray]:
    """A read request's output tensors, those it asks for in shared memory written there: its
    parameters and each image's header checked, the images detected within ``timeout_s``
    (``detect_within``). No per-image errors in this protocol: the first image that fails fails
    the request. A request the inference client refuses as a whole is counted in ``rejected``."""
    params = detect_params(request.parameters, num_classes=len(inference.info["class_names"]))
    headers = check_request_images(request.images, max_pixels=settings.max_pixels)
    for i, checked in enumerate(headers):
        if isinstance(checked, YolopipeError):
            raise for_image(i, checked)
    try:  # the headers read here travel with the bytes: the inference worker never reads them again
        answered = await detect_within(inference, request.images, headers, params, timeout_s, settings)
    except SERVER_SIDE as exc:
        rejected.labels(exc.code).inc()
        raise
    errors = answered.detected.errors
    if errors:
        first = min(errors)
        raise for_image(first, errors[first])
    tensors = output_tensors(answered.detected)
    write_output_regions(tensors, request.output_places, regions)
    return tensors
