"""The gRPC service's messages: built from the vendored Triton ``.proto`` files, and the same,
field for field, as the messages ``tritonclient.grpc`` sends and reads."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2

from app.api.grpc import messages
from app.api.grpc.generate import DESCRIPTORS, build_descriptor_set


def test_the_committed_descriptors_are_built_from_the_vendored_protos():
    pytest.importorskip("grpc_tools")
    built = descriptor_pb2.FileDescriptorSet.FromString(build_descriptor_set())
    committed = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTORS.read_bytes())
    assert [f.name for f in committed.file] == ["model_config.proto", "grpc_service.proto"]
    assert built == committed, "proto/*.proto changed: run python -m app.api.grpc.generate"


def _proto(descriptor) -> descriptor_pb2.DescriptorProto:
    """The message's fields, nested messages and enums (without json_name, which protoc's
    Python output leaves out and a descriptor set keeps)."""
    out = descriptor_pb2.DescriptorProto()
    descriptor.CopyToProto(out)

    def strip(message: descriptor_pb2.DescriptorProto) -> None:
        for field in message.field:
            field.ClearField("json_name")
        for nested in message.nested_type:
            strip(nested)

    strip(out)
    return out


def test_every_message_and_call_is_tritonclients():
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    theirs = service_pb2.DESCRIPTOR
    assert theirs.package == messages.PACKAGE
    for name, descriptor in theirs.message_types_by_name.items():
        ours = messages.POOL.FindMessageTypeByName(f"{messages.PACKAGE}.{name}")
        assert _proto(ours) == _proto(descriptor), name
    service = theirs.services_by_name["GRPCInferenceService"]
    assert service.full_name == messages.SERVICE
    assert {m.name: (m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming)
            for m in service.methods} == {
        name: (m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming)
        for name, m in messages.METHODS.items()}


def test_the_messages_live_in_a_pool_of_their_own():
    """tritonclient registers the same files in protobuf's default pool: both load in one process."""
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    request = messages.ModelInferRequest(model_name="yolopipe", id="7")
    request.parameters["conf"].double_param = 0.5
    assert messages.ModelInferRequest is not service_pb2.ModelInferRequest
    assert service_pb2.ModelInferRequest.FromString(request.SerializeToString()).parameters["conf"].double_param == 0.5
