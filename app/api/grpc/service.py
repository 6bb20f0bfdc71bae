"""``inference.GRPCInferenceService``: KServe v2 gRPC (Triton's service) in front of the inference
workers, beside the REST app and as thin: the same inference client, header checks, limits,
parameters and shared-memory regions as ``/v2`` REST (``app.api.oip``).

Errors are ``app.errors``, answered with the status code ``app.api.statuses`` maps
them to: INVALID_ARGUMENT for a bad image, tensor, parameter or region, RESOURCE_EXHAUSTED over
a limit, UNAVAILABLE when overloaded, DEADLINE_EXCEEDED past the request's ``timeout`` or the
client's deadline, NOT_FOUND for another model. A call that ends early (deadline, cancel, the
client gone) cancels its call's coroutine, and with it the images it left queued.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import unquote

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry, Counter, Histogram

from app.api.grpc import messages
from app.api.grpc.tensors import infer_response, read_request
from app.api.metrics import rejected_counter
from app.api.oip.infer import MODEL, VERSION, extensions, infer_outputs, model_name
from app.api.oip.shared_memory import RegionAccess, is_loopback, run_registry
from app.api.oip.tensors import INPUT, OUTPUTS
from app.api.statuses import grpc_code_for
from app.errors import BadRequest, ModelNotFound, NotSupported, Overloaded, SharedMemoryError, YolopipeError
from app.ipc.client import InferenceClient
from app.ipc.metrics import LATENCY_BUCKETS
from app.settings import Settings

log = logging.getLogger("yolopipe.grpc")
SERVER_VERSION = "0.1.0"  # as the REST app's
_CUDA = "CUDA shared memory is not supported by this server; register system shared memory instead"


class GrpcMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.calls = Counter("yolopipe_grpc_requests", "gRPC calls (and stream requests) by method and status code",
                             ["method", "code"], registry=r)
        self.latency = Histogram("yolopipe_grpc_request_latency_seconds", "Whole-call latency of gRPC calls",
                                 ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = rejected_counter(r)
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def answered(self, method: str, code: str, seconds: float) -> None:
        """One call (or stream request) of ``method`` ended with ``code`` after ``seconds``."""
        children = self._children.get((method, code))
        if children is None:  # looked up once per method and code: ``labels`` costs more than ``inc``
            children = self._children[(method, code)] = (self.calls.labels(method, code), self.latency.labels(method))
        children[0].inc()
        children[1].observe(seconds)


class Malformed:
    """A request whose bytes are not the message its call takes (answered INVALID_ARGUMENT,
    where grpcio's own parsing would answer INTERNAL)."""

    def __init__(self, kind: str, reason: str) -> None:
        self.kind = kind
        self.reason = reason

    def refuse(self) -> None:
        raise BadRequest(f"the request is not a valid {self.kind} message: {self.reason[:200]}")


def _parser(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, RecursionError) as exc:
            return Malformed(cls.DESCRIPTOR.name, str(exc) or type(exc).__name__)

    return parse


@functools.lru_cache(maxsize=4096)  # a connection's every call asks about the same peer
def peer_is_local(peer: str) -> bool:
    """A gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``) on this host."""
    kind, _, address = unquote(peer).partition(":")
    if kind in ("unix", "unix-abstract"):
        return True
    return kind in ("ipv4", "ipv6") and is_loopback(address.rsplit(":", 1)[0])


def _call(method: Callable) -> Callable:
    """A unary call: its errors answered with their status code, counted and timed by method."""

    @functools.wraps(method)
    async def answer(self: InferenceService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        start = time.perf_counter()
        code = "OK"
        try:
            if isinstance(request, Malformed):
                request.refuse()
            return await method(self, request, context)
        except YolopipeError as exc:
            code = grpc_code_for(exc)
            await context.abort(grpc.StatusCode[code], str(exc))
        except asyncio.CancelledError:  # a deadline, a cancel or the client gone: nobody to answer
            code = "CANCELLED"
            raise
        except Exception as exc:  # noqa: BLE001 - no traceback to the client, one in the log
            code = "INTERNAL"
            log.error("unexpected error in %s", method.__name__, exc_info=exc)
            await context.abort(grpc.StatusCode.INTERNAL, "internal server error")
        finally:
            self.metrics.answered(method.__name__, code, time.perf_counter() - start)

    return answer


class InferenceService:
    """The service's calls (named as in the ``.proto``); those it lacks answer UNIMPLEMENTED."""

    def __init__(self, settings: Settings, inference: InferenceClient) -> None:
        self.settings = settings
        self.inference = inference
        self.registry = run_registry(inference.layout.root, enabled=settings.allow_client_shm)
        self.metrics = GrpcMetrics()
        self.draining = False

    def _ready(self) -> bool:
        return not self.draining and self.inference.ready

    def _client(self) -> InferenceClient:
        if self.inference.info is None:
            raise Overloaded("the service is starting; retry shortly")
        return self.inference

    # --- health and metadata ----------------------------------------------------------------------
    @_call
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return messages.ServerLiveResponse(live=True)

    @_call
    async def ServerReady(self, request: Any, context: Any) -> Any:
        return messages.ServerReadyResponse(ready=self._ready())

    @_call
    async def ModelReady(self, request: Any, context: Any) -> Any:
        try:
            model_name(request.name, request.version, self.settings)
        except ModelNotFound:
            return messages.ModelReadyResponse(ready=False)
        return messages.ModelReadyResponse(ready=self._ready())

    @_call
    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return messages.ServerMetadataResponse(name=MODEL, version=SERVER_VERSION, extensions=extensions(self.settings))

    @_call
    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        name = model_name(request.name, request.version, self.settings)
        response = messages.ModelMetadataResponse(name=name, versions=[VERSION],
                                                  platform=f"yolopipe_{self._client().info['backend']}")
        response.inputs.add(name=INPUT, datatype="BYTES", shape=[-1])
        for output, (datatype, shape) in OUTPUTS.items():
            response.outputs.add(name=output, datatype=datatype, shape=shape)
        return response

    # --- inference --------------------------------------------------------------------------------
    @_call
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        return await self._infer(request, peer_is_local(context.peer()), context.time_remaining())

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        """Responses in the order of the requests, several requests at work at once (up to
        ``max_batch``, the run shape's as the inference workers clamped it; past that, the stream is
        not read until the first is answered). A request's error is its response's
        ``error_message``; the stream goes on."""
        local = peer_is_local(context.peer())
        pending: asyncio.Queue = asyncio.Queue()  # requests at work, in order; None: no more
        room = asyncio.Semaphore(self.inference.max_batch)

        async def read() -> None:
            try:
                async for request in requests:
                    await room.acquire()
                    pending.put_nowait(asyncio.ensure_future(self._stream_one(request, local, context)))
            finally:
                pending.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (task := await pending.get()) is not None:
                yield await task
                room.release()
        finally:  # the stream ended or was cancelled: what is still at work is not wanted
            reader.cancel()
            while not pending.empty():
                task = pending.get_nowait()
                if task is not None:
                    task.cancel()

    async def _stream_one(self, request: Any, local: bool, context: Any) -> Any:
        start = time.perf_counter()
        code = "OK"
        try:
            return messages.ModelStreamInferResponse(
                infer_response=await self._infer(request, local, context.time_remaining()))
        except YolopipeError as exc:
            code = grpc_code_for(exc)
            return self._stream_error(request, str(exc))
        except asyncio.CancelledError:  # the stream ended while this request was at work
            code = "CANCELLED"
            raise
        except Exception as exc:  # noqa: BLE001 - no traceback to the client, one in the log
            code = "INTERNAL"
            log.error("unexpected error in ModelStreamInfer", exc_info=exc)
            return self._stream_error(request, "internal server error")
        finally:
            self.metrics.answered("ModelStreamInfer", code, time.perf_counter() - start)

    @staticmethod
    def _stream_error(request: Any, message: str) -> Any:
        if isinstance(request, Malformed):
            return messages.ModelStreamInferResponse(error_message=message)
        answer = messages.ModelInferResponse(model_name=request.model_name, id=request.id)
        return messages.ModelStreamInferResponse(error_message=message, infer_response=answer)

    async def _infer(self, request: Any, local: bool, deadline_s: float | None) -> Any:
        if isinstance(request, Malformed):
            request.refuse()
        settings = self.settings
        name = model_name(request.model_name, request.model_version, settings)
        inference = self._client()
        regions = RegionAccess(self.registry, local, settings.max_body_bytes)
        parsed = read_request(request, max_images=settings.max_images_per_request, regions=regions)
        timeouts = [t for t in (parsed.timeout_s, deadline_s) if t is not None]
        tensors = await infer_outputs(inference, parsed, settings, regions, self.metrics.rejected,
                                      min(timeouts, default=None))
        return infer_response(name, parsed.id, tensors, parsed.outputs, parsed.output_places)

    # --- Triton's system shared-memory extension ------------------------------------------------
    @_call
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        response = messages.SystemSharedMemoryStatusResponse()
        for region in self.registry.status(request.name, local=peer_is_local(context.peer())):
            entry = response.regions[region.name]
            entry.name, entry.key, entry.offset, entry.byte_size = (region.name, region.key, region.offset,
                                                                    region.byte_size)
        return response

    @_call
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self.registry.register(request.name, request.key, request.offset, request.byte_size,
                               local=peer_is_local(context.peer()))
        return messages.SystemSharedMemoryRegisterResponse()

    @_call
    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.registry.unregister(request.name, local=peer_is_local(context.peer()))
        return messages.SystemSharedMemoryUnregisterResponse()

    @_call
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        if request.name:
            raise SharedMemoryError(f"no CUDA shared-memory region named {request.name[:100]!r}: {_CUDA}")
        return messages.CudaSharedMemoryStatusResponse()

    @_call
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        raise NotSupported(_CUDA)

    @_call
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        return messages.CudaSharedMemoryUnregisterResponse()


def rpc_handlers(service: InferenceService) -> grpc.GenericRpcHandler:
    """The service's calls, by the ``.proto``'s method names and message types."""
    handlers = {}
    for name, method in messages.METHODS.items():
        behaviour = getattr(service, name, None)
        if behaviour is None:
            continue
        parse, serialize = _parser(messages.request_class(name)), messages.response_class(name).SerializeToString
        if method.client_streaming:
            handlers[name] = grpc.stream_stream_rpc_method_handler(behaviour, parse, serialize)
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(behaviour, parse, serialize)
    return grpc.method_handlers_generic_handler(messages.SERVICE, handlers)
