"""The gRPC server of one gRPC worker: ``create_server(settings, inference)``.

grpc.aio on this process's event loop, the service's calls registered from the ``.proto``'s
descriptors, and the limits: a message no larger than the REST body limit (RESOURCE_EXHAUSTED
past it, before it is parsed) and at most ``MAX_CONCURRENT_CALLS`` calls at once (more are
RESOURCE_EXHAUSTED at once). Each gRPC worker binds the port with SO_REUSEPORT, as the HTTP
workers do, and the kernel spreads the connections over them.
"""

from __future__ import annotations

import grpc

from app.api.grpc.service import InferenceService, rpc_handlers
from app.ipc.client import InferenceClient
from app.settings import Settings

MAX_CONCURRENT_CALLS = 1024  # per gRPC worker; a stream counts once


def create_server(settings: Settings, inference: InferenceClient) -> tuple[grpc.aio.Server, InferenceService]:
    service = InferenceService(settings, inference)
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),  # answers are boxes: small
        ],
        maximum_concurrent_rpcs=MAX_CONCURRENT_CALLS,
    )
    server.add_generic_rpc_handlers((rpc_handlers(service),))
    return server, service


def address(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
