"""gRPC worker processes as the supervisor runs them (real processes, real grpcio), before any
inference worker is there: health, errors for what cannot be served yet or is not a message,
two workers sharing the port, shared memory refused to a client that is not on loopback, and a
SIGTERM that ends each with exit code 0."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

from app.api.grpc import messages
from app.ipc.layout import RunLayout
from app.service.grpc_worker import grpc_worker_main
from app.service.supervisor import FrontWorkers
from app.settings import Settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outside_address() -> str | None:
    """An address of this host that is not loopback (a client there is not "local")."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.fixture(scope="module")
def workers():
    layout = RunLayout.create(0)  # no inference worker: the service is "starting"
    stop = threading.Event()
    settings = Settings(host="0.0.0.0", port=_free_port(), grpc_port=_free_port(), allow_client_shm=True)
    front = FrontWorkers(settings, layout, 2, stop, grpc_worker_main, "gRPC")
    try:
        front.start()
        yield settings, front
    finally:
        stop.set()
        front.stop(5.0)
        layout.remove()


def call(port: int, method: str, request, host: str = "127.0.0.1"):
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = channel.unary_unary(f"/{messages.SERVICE}/{method}",
                                   request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
                                   response_deserializer=messages.response_class(method).FromString)
        return stub(request, timeout=30)


def code_of(port: int, method: str, request, host: str = "127.0.0.1") -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(port, method, request, host)
    return info.value.code(), info.value.details()


def test_health_before_any_inference_worker(workers):
    settings, _ = workers
    assert call(settings.grpc_port, "ServerLive", messages.request_class("ServerLive")()).live
    assert not call(settings.grpc_port, "ServerReady", messages.request_class("ServerReady")()).ready
    code, details = code_of(settings.grpc_port, "ModelInfer", messages.ModelInferRequest(model_name="yolopipe"))
    assert code == grpc.StatusCode.UNAVAILABLE and "starting" in details
    code, _ = code_of(settings.grpc_port, "ModelInfer", messages.ModelInferRequest(model_name="resnet"))
    assert code == grpc.StatusCode.NOT_FOUND


def test_bytes_that_are_no_message_are_invalid_argument_and_unserved_calls_unimplemented(workers):
    settings, _ = workers
    code, details = code_of(settings.grpc_port, "ModelInfer", b"\x0a\xff\xff\xff\xff\x0f")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid ModelInferRequest" in details
    code, _ = code_of(settings.grpc_port, "ModelConfig", messages.request_class("ModelConfig")(name="yolopipe"))
    assert code == grpc.StatusCode.UNIMPLEMENTED


def test_two_workers_share_the_port(workers):
    settings, front = workers
    assert len([p for p in front._procs if p.is_alive()]) == 2
    for _ in range(8):  # new connections each time: the kernel spreads them over both
        assert call(settings.grpc_port, "ServerLive", messages.request_class("ServerLive")()).live


def test_shared_memory_is_refused_to_a_client_not_on_loopback(workers):
    settings, _ = workers
    outside = _outside_address()
    if outside is None:
        pytest.skip("this host has no address but loopback")
    status = messages.request_class("SystemSharedMemoryStatus")()
    assert len(call(settings.grpc_port, "SystemSharedMemoryStatus", status).regions) == 0  # from loopback
    code, details = code_of(settings.grpc_port, "SystemSharedMemoryStatus", status, host=outside)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a loopback one" in details
    register = messages.request_class("SystemSharedMemoryRegister")(name="r", key="/x", byte_size=8)
    code, _ = code_of(settings.grpc_port, "SystemSharedMemoryRegister", register, host=outside)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_sigterm_ends_each_worker_with_exit_code_0():
    layout = RunLayout.create(0)
    stop = threading.Event()
    front = FrontWorkers(Settings(host="127.0.0.1", port=_free_port(), grpc_port=_free_port()), layout, 1, stop,
                         grpc_worker_main, "gRPC")
    try:
        front.start()
        (proc,) = front._procs
        front.stop(5.0)
        assert proc.exitcode == 0
    finally:
        layout.remove()
