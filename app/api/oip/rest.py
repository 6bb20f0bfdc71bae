"""The Open Inference Protocol's REST inference, from the request body to the answer body,
whoever read the request: FastAPI's route (``app/api/oip/routes.py``) or the hot path
(``app/api/hotpath``). No web framework here."""

from __future__ import annotations

from prometheus_client import Counter

from app.api.oip.infer import infer_outputs
from app.api.oip.shared_memory import RegionAccess
from app.api.oip.tensors import decompress, encode_response, parse_infer_request
from app.errors import Overloaded
from app.ipc.client import InferenceClient
from app.settings import Settings

JSON = "application/json"
BINARY = "application/octet-stream"


async def infer_answer(inference: InferenceClient, settings: Settings, rejected: Counter, model: str, body: bytes,
                       content_encoding: str | None, header_length: str | None,
                       regions: RegionAccess | None) -> tuple[bytes, str, int | None] | Overloaded:
    """The answer's body, its media type and, when it carries binary outputs, the length of its
    JSON header (``Inference-Header-Content-Length``); or the ``Overloaded`` refusal to answer
    unlogged (as ``/v1`` does: under overload there are thousands a second)."""
    # The body limit bounds what was read; decompressing is held to it too.
    body = decompress(body, content_encoding, settings.max_body_bytes)
    parsed = parse_infer_request(body, header_length, max_images=settings.max_images_per_request, regions=regions)
    del body  # the images are copies: the decompressed body need not live through the inference
    try:
        tensors = await infer_outputs(inference, parsed, settings, regions, rejected, parsed.timeout_s)
    except Overloaded as exc:
        return exc.with_traceback(None)  # its traceback would hold this frame, and it the images
    content, json_length = encode_response(model, parsed.id, tensors, parsed.outputs, parsed.output_places)
    return content, (JSON if json_length is None else BINARY), json_length
