"""KServe v2 gRPC (Triton's ``inference.GRPCInferenceService``), beside the REST app.

``proto/``: Triton's ``grpc_service.proto`` and ``model_config.proto`` (triton-inference-server/common
at 83adf7c, BSD-3-Clause: ``proto/LICENSE``), unchanged, and their descriptors
(``proto/inference.binpb``, built by ``generate.py``). ``messages`` loads them, ``tensors``
reads a request as ``/v2`` REST does, ``service`` answers the calls, ``server`` builds the
grpc.aio server that a gRPC worker (``app/service/grpc_worker.py``) runs.
"""
