"""One exception family for everything yolopipe reports to a user.

Each error carries a stable machine-readable ``code``. How an error becomes an HTTP status
and a gRPC status code lives in one table (``app/api/statuses.py``); how it becomes an exit
status lives in the CLI.
"""

from __future__ import annotations


class YolopipeError(Exception):
    """Base of every error yolopipe raises on purpose."""

    code = "internal_error"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


# --- the user's input -------------------------------------------------------------------
class InvalidImage(YolopipeError):
    """Bytes that are empty, truncated or otherwise not decodable as an image."""

    code = "invalid_image"


class UnsupportedMediaType(YolopipeError):
    """Content that is not an image at all (text, PDF, ...) or a format we do not decode."""

    code = "unsupported_media_type"


class ImageTooLarge(YolopipeError):
    """Body or pixel count over the configured limit (decompression-bomb guard)."""

    code = "image_too_large"


class InvalidParameter(YolopipeError):
    """A request or CLI parameter outside its allowed range."""

    code = "invalid_parameter"


class SharedMemoryError(YolopipeError):
    """A shared-memory region that cannot be used as asked: not registered, outside its size,
    a key that is not a readable POSIX shared-memory object, or client shared memory turned off."""

    code = "shared_memory_error"


class NotSupported(YolopipeError):
    """A protocol feature this server does not offer (Triton's CUDA shared memory)."""

    code = "not_supported"


class ModelNotFound(YolopipeError):
    """A request for a model (or version) this server does not serve."""

    code = "model_not_found"


# --- models, artifacts and backends -----------------------------------------------------
class WeightsError(YolopipeError):
    """Weights that cannot be found, downloaded or verified."""

    code = "weights_error"


class ArtifactError(YolopipeError):
    """An exported/calibrated/built artifact that is missing, stale or inconsistent."""

    code = "artifact_error"


class BackendUnavailable(YolopipeError):
    """A backend whose library or hardware is missing on this machine."""

    code = "backend_unavailable"


class EngineMismatch(ArtifactError):
    """A TensorRT engine built for another GPU or TensorRT version."""

    code = "engine_mismatch"


class CalibrationError(YolopipeError):
    """Calibration inputs unusable (empty folder, too few images, unreadable video)."""

    code = "calibration_error"


class AccuracyGateFailed(CalibrationError):
    """The INT8 model agrees with FP32 less than the gate asks; the work ran, its result is refused."""

    code = "accuracy_gate_failed"


# --- serving ----------------------------------------------------------------------------
class Overloaded(YolopipeError):
    """The request queue is full; the client should retry later."""

    code = "overloaded"


class RequestTimeout(YolopipeError):
    code = "timeout"


class DeviceError(YolopipeError):
    """The accelerator failed (e.g. out of memory) while running a batch."""

    code = "device_error"


# --- the HTTP protocol: answered before (or instead of) a route ---------------------------
class BadRequest(YolopipeError):
    """A request that is not well-formed HTTP (bad framing, bad chunk size, NUL in a header)."""

    code = "bad_request"


class ReadTimeout(YolopipeError):
    """The client stopped sending its request (headers or body) for longer than the read timeout."""

    code = "read_timeout"


class UriTooLong(YolopipeError):
    code = "uri_too_long"


class HeadersTooLarge(YolopipeError):
    code = "headers_too_large"


class MethodNotImplemented(YolopipeError):
    """A request method the HTTP parser does not know (``FOO / HTTP/1.1``)."""

    code = "not_implemented"


class HttpVersionNotSupported(YolopipeError):
    """HTTP/1.2, HTTP/3.0, or an HTTP/2 connection preface on the HTTP/1.1 port."""

    code = "http_version_not_supported"


class ClientDisconnected(YolopipeError):
    """The client hung up before its request was read; nobody receives an answer."""

    code = "client_disconnected"
