"""Build step: ``proto/inference.binpb`` (the descriptors the gRPC service reads its messages
from) out of the vendored ``.proto`` files, with ``grpcio-tools``' protoc (the dev extra).

    python -m app.api.grpc.generate        # after updating proto/*.proto

The file is committed, so a server needs no protoc; ``tests/unit/api/grpc/test_messages.py``
builds it again and checks that it still matches the ``.proto`` files.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).parent / "proto"
DESCRIPTORS = PROTO_DIR / "inference.binpb"
ROOT_PROTO = "grpc_service.proto"  # it imports model_config.proto


def build_descriptor_set(proto_dir: Path = PROTO_DIR) -> bytes:
    """A serialized ``FileDescriptorSet`` of the service's ``.proto`` files and what they import."""
    from grpc_tools import protoc  # build time only

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "inference.binpb"
        code = protoc.main(["protoc", f"--proto_path={proto_dir}", "--include_imports",
                            f"--descriptor_set_out={out}", str(proto_dir / ROOT_PROTO)])
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} on {proto_dir / ROOT_PROTO}")
        return out.read_bytes()


def main() -> None:
    DESCRIPTORS.write_bytes(build_descriptor_set())
    print(f"wrote {DESCRIPTORS} ({DESCRIPTORS.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
