"""KServe's own Python SDK (``kserve`` 0.21) as a client process, for ``tests/e2e/test_kserve_sdk.py``.

Run as a script, never imported by a test process: kserve registers the KServe v2 messages
(``inference.*``) in protobuf's default descriptor pool, as tritonclient does, and a process that
imports both fails (``duplicate symbol 'inference.ServerLiveRequest'``). So each call runs here,
in a process of its own, and prints its answer as one JSON line:

    python tests/kserve_client.py MODE TARGET MODEL PARAMS_JSON IMAGE...

``MODE``: ``rest`` or ``grpc`` (an infer call; ``TARGET`` the server's URL or gRPC address),
``message`` (what ``InferRequest.to_grpc`` builds, no call), ``lie`` (a gRPC infer whose
``binary_data_size`` is one more than its data). The answer: ``{"model_name", "outputs": {name:
{"shape", "dtype", "data"}}}``, or ``{"error": {"code", "details"}}`` for a refused gRPC call.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig


def image_request(images: list[bytes], model: str, parameters: dict) -> InferRequest:
    """The SDK's request for these images, the data set as its docs show (binary, from numpy)."""
    tensor = InferInput("image", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_), binary_data=True)
    return InferRequest(model_name=model, infer_inputs=[tensor], parameters=parameters or None)


async def infer(mode: str, target: str, request: InferRequest):
    if mode == "rest":
        async with InferenceRESTClient(RESTConfig(protocol="v2", timeout=120)) as client:
            return await client.infer(target, request, model_name=request.model_name)
    async with InferenceGRPCClient(target, timeout=120, retries=0) as client:
        return await client.infer(request)


def main() -> None:
    import grpc

    mode, target, model, params = sys.argv[1:5]
    images = [open(path, "rb").read() for path in sys.argv[5:]]
    request = image_request(images, model, json.loads(params))
    if mode == "message":
        message = request.to_grpc()
        print(json.dumps({"raw_input_contents": [len(raw) for raw in message.raw_input_contents],
                          "binary_data_size": message.inputs[0].parameters["binary_data_size"].int64_param,
                          "rest_binary": request.to_rest()[1] is not None}))
        return
    if mode == "lie":  # to_grpc keeps it: the data is raw already
        request.inputs[0].parameters["binary_data_size"] += 1
        mode = "grpc"
    try:
        response = asyncio.run(infer(mode, target, request))
    except grpc.aio.AioRpcError as exc:
        print(json.dumps({"error": {"code": exc.code().name, "details": exc.details()}}))
        return
    outputs = {}
    for output in response.outputs:
        array = output.as_numpy()
        outputs[output.name] = {"shape": list(array.shape), "dtype": str(array.dtype), "data": array.tolist()}
    print(json.dumps({"model_name": response.model_name, "outputs": outputs}))


if __name__ == "__main__":
    main()
