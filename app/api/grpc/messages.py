"""The KServe v2 / Triton gRPC messages, from the vendored ``.proto`` files' descriptors.

``proto/grpc_service.proto`` and ``proto/model_config.proto`` are Triton's (BSD-3-Clause,
``proto/LICENSE``), so the service is ``inference.GRPCInferenceService`` with Triton's messages
and ``tritonclient.grpc`` drives it unchanged. Their descriptors (``proto/inference.binpb``,
built by ``app/api/grpc/generate.py``) are loaded into a pool of this module's own, not
protobuf's default one: a process that also loads another copy of these protos (tritonclient,
another version of them) cannot clash with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"
DESCRIPTORS = Path(__file__).parent / "proto" / "inference.binpb"


def _pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTORS.read_bytes()).file:
        pool.Add(file)
    return pool


POOL = _pool()
METHODS = {m.name: m for m in POOL.FindServiceByName(SERVICE).methods}


def message(name: str) -> Any:
    """The message class ``inference.<name>``."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ServerLiveResponse = message("ServerLiveResponse")
ServerReadyResponse = message("ServerReadyResponse")
ModelReadyResponse = message("ModelReadyResponse")
ServerMetadataResponse = message("ServerMetadataResponse")
ModelMetadataResponse = message("ModelMetadataResponse")
ModelInferRequest = message("ModelInferRequest")
ModelInferResponse = message("ModelInferResponse")
ModelStreamInferResponse = message("ModelStreamInferResponse")
InferParameter = message("InferParameter")
SystemSharedMemoryStatusResponse = message("SystemSharedMemoryStatusResponse")
SystemSharedMemoryRegisterResponse = message("SystemSharedMemoryRegisterResponse")
SystemSharedMemoryUnregisterResponse = message("SystemSharedMemoryUnregisterResponse")
CudaSharedMemoryStatusResponse = message("CudaSharedMemoryStatusResponse")
CudaSharedMemoryUnregisterResponse = message("CudaSharedMemoryUnregisterResponse")


def request_class(method: str) -> Any:
    return message_factory.GetMessageClass(METHODS[method].input_type)


def response_class(method: str) -> Any:
    return message_factory.GetMessageClass(METHODS[method].output_type)
