"""The hot routes: what ``POST /v1/detect``, ``/v1/detect/batch`` and
``/v2/models/{name}/infer`` do for a request the front took, through the same code as
FastAPI's routes (``app/api/detection.py``, ``app/api/oip/rest.py``); FastAPI's declarations
(``app/api/routes.py``, ``app/api/oip/routes.py``) stay the schema and answer the rest."""

from __future__ import annotations

import time
from typing import Any

from starlette.datastructures import Headers

from app.api.detection import detect_many, detect_one, one_image
from app.api.form_parts import boundary_of
from app.api.hotpath.front import Answer, Request, Route, error_answer
from app.api.hotpath.query import detect_params
from app.api.oip.infer import model_name
from app.api.oip.rest import infer_answer
from app.api.oip.shm_routes import region_access_of
from app.api.protocol import ON_DISCONNECT
from app.api.uploads import form_images
from app.errors import InvalidParameter, ModelNotFound, Overloaded

_JSON = b"application/json"


class DetectRoute(Route):
    """``/v1/detect`` (one image: multipart field ``image`` or a raw ``image/*`` body) or, with
    ``batch``, ``/v1/detect/batch`` (multipart field ``images``). Taken when the inference
    workers have said hello and the query string is plain (``app/api/hotpath/query.py``)."""

    def __init__(self, state: Any, batch: bool) -> None:
        self.state = state
        self.batch = batch

    def prepare(self, request: Request, path_params: tuple[str, ...]) -> bool:
        inference = self.state.inference
        if inference is None or inference.info is None:
            return False  # starting: FastAPI's dependency answers the 503
        # What FastAPI's route refuses before reading the body (answered there, with connection:
        # close): another media type; a multipart body encoded, or whose boundary is not plain.
        media = request.media_type()
        if media == "multipart/form-data":
            if b"content-encoding" in request.headers or boundary_of(request.header(b"content-type") or "") is None:
                return False
        elif self.batch or not media.startswith("image/"):
            return False
        try:
            request.params = detect_params(request.scope["query_string"], len(inference.info["class_names"]))
        except InvalidParameter:  # a class id the model has not: FastAPI's route answers the 422
            return False
        return request.params is not None

    async def answer(self, request: Request, body: bytes) -> Answer:
        start = time.perf_counter()
        state, settings = self.state, self.state.settings
        if request.media_type() == "multipart/form-data":  # else an image/* body (``prepare`` took no other)
            images = await form_images(body, Headers(raw=request.scope["headers"]), "images" if self.batch else "image",
                                       max_parts=settings.max_images_per_request, max_body_bytes=settings.max_body_bytes)
        else:
            images = [("image", body)]
        on_disconnect = request.scope.get("extensions", {}).get(ON_DISCONNECT)
        if self.batch:
            result = await detect_many(state.inference, state.metrics, request.receive, images, request.params,
                                       settings.max_pixels, start, on_disconnect)
        else:
            name, data = one_image(images)
            result = await detect_one(state.inference, state.metrics, request.receive, name, data, request.params,
                                      settings.max_pixels, start, on_disconnect)
        if isinstance(result, Overloaded):
            return error_answer(result, oip=False)
        return 200, [(b"content-length", b"%d" % len(result)), (b"content-type", _JSON)], result


class InferRoute(Route):
    """``/v2/models/{name}[/versions/{version}]/infer``: the Open Inference Protocol's inference."""

    oip = True

    def __init__(self, state: Any) -> None:
        self.state = state

    def prepare(self, request: Request, path_params: tuple[str, ...]) -> bool:
        inference = self.state.inference
        if inference is None or inference.info is None:
            return False  # starting: FastAPI's route answers the 503
        try:
            request.params = model_name(path_params[0], path_params[1] if len(path_params) > 1 else None,
                                        self.state.settings)
        except ModelNotFound:  # FastAPI's route answers the 404 before reading the body (and closes)
            return False
        return True

    async def answer(self, request: Request, body: bytes) -> Answer:
        state = self.state
        name = request.params
        client = request.scope.get("client")
        regions = region_access_of(state, client[0] if client else None)
        result = await infer_answer(state.inference, state.settings, state.metrics.rejected, name, body,
                                    request.header(b"content-encoding"),
                                    request.header(b"inference-header-content-length"), regions)
        if isinstance(result, Overloaded):
            return error_answer(result, oip=True)
        content, media_type, json_length = result
        headers = [(b"content-length", b"%d" % len(content)), (b"content-type", media_type.encode())]
        if json_length is not None:
            headers.insert(0, (b"inference-header-content-length", b"%d" % json_length))
        return 200, headers, content
