"""Reference servers for the host tier: what serving the same requests costs with nothing but the
framework, measured beside yolopipe (``bench/http_load.py --parts host``).

* ``http``: a bare FastAPI app on the same uvicorn (its own ``--workers`` processes; uvloop and
  httptools, uvicorn's defaults where installed, as yolopipe's HTTP workers use), each route
  answering a fixed body of the size of yolopipe's answer (files in ``--answers``):

  - ``POST /v1/detect``: reads the multipart upload (field ``image``, FastAPI's ``UploadFile``)
    and answers ``v1.json``;
  - ``POST /v1/detect/raw``: reads the raw body (the ``/v1`` raw-JPEG row's reference) and
    answers ``v1-raw.json``;
  - ``POST /v2/models/{model}/infer``: reads the raw body (the OIP binary row's reference) and
    answers ``oip.bin`` with the headers of ``oip.headers.json``;
  - ``GET /readyz``.

* ``grpc``: a bare ``grpc.aio`` server in ``--processes`` processes, each with its own
  SO_REUSEPORT listener like yolopipe's gRPC workers, with the same message limits: it parses
  each KServe v2 ``ModelInferRequest`` (the repository's compiled descriptors,
  ``app.api.grpc.messages``) and answers the fixed tensors of ``grpc.bin`` (a
  ``ModelInferResponse`` yolopipe gave). It prints ``ready`` once every process listens.

    python bench/reference_servers.py http --answers DIR --port 8100 --workers 2
    python bench/reference_servers.py grpc --answers DIR --port 8101 --processes 2
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations, which name
# classes imported inside ``http_app``, as objects.
import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ANSWERS = "REFERENCE_ANSWERS"  # the answers' folder, for uvicorn's worker processes


# ----------------------------------------------------------------------------- HTTP
def http_app():
    """The bare FastAPI app (a uvicorn factory: each worker builds it, its answers from ``$REFERENCE_ANSWERS``)."""
    from fastapi import FastAPI, Request, UploadFile
    from fastapi.responses import Response

    folder = Path(os.environ[ANSWERS])
    v1, v1_raw = (folder / "v1.json").read_bytes(), (folder / "v1-raw.json").read_bytes()
    oip = (folder / "oip.bin").read_bytes()
    oip_headers = json.loads((folder / "oip.headers.json").read_text())
    oip_type = oip_headers.pop("content-type", "application/octet-stream")
    app = FastAPI(title="reference: bare FastAPI")

    @app.get("/readyz")
    async def readyz() -> dict:
        return {"status": "ready"}

    @app.post("/v1/detect")
    async def detect(image: UploadFile) -> Response:
        await image.read()
        return Response(v1, media_type="application/json")

    @app.post("/v1/detect/raw")
    async def detect_raw(request: Request) -> Response:
        await request.body()
        return Response(v1_raw, media_type="application/json")

    @app.post("/v2/models/{model}/infer")
    async def infer(model: str, request: Request) -> Response:
        await request.body()
        return Response(oip, media_type=oip_type, headers=oip_headers)

    return app


def run_http(args: argparse.Namespace) -> None:
    import uvicorn

    os.environ[ANSWERS] = str(args.answers.resolve())
    uvicorn.run("reference_servers:http_app", factory=True, app_dir=str(Path(__file__).parent), host=args.host,
                port=args.port, workers=args.workers, access_log=False, log_level="warning", ws="none")


# ----------------------------------------------------------------------------- gRPC
def grpc_process(host: str, port: int, answer: bytes, max_receive: int, ready) -> None:
    """One process of the reference gRPC server (spawn): listen, say so, serve until SIGTERM."""
    sys.path.insert(0, str(ROOT))
    asyncio.run(_serve_grpc(host, port, answer, max_receive, ready))


async def _serve_grpc(host: str, port: int, answer: bytes, max_receive: int, ready) -> None:
    import grpc

    from app.api.grpc import messages

    response = messages.ModelInferResponse.FromString(answer)

    async def model_infer(request, context):
        if not request.raw_input_contents:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no input")
        return response

    handler = grpc.method_handlers_generic_handler(messages.SERVICE, {"ModelInfer": grpc.unary_unary_rpc_method_handler(
        model_infer, request_deserializer=messages.ModelInferRequest.FromString,
        response_serializer=messages.ModelInferResponse.SerializeToString)})
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1), ("grpc.max_receive_message_length", max_receive),
                                      ("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"{host}:{port}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    ready.send("listening")
    ready.close()
    await stop.wait()
    await server.stop(grace=1.0)


def run_grpc(args: argparse.Namespace) -> None:
    from app.settings import Settings

    answer = (args.answers / "grpc.bin").read_bytes()
    max_receive = Settings().max_body_bytes  # yolopipe's gRPC limit
    ctx = multiprocessing.get_context("spawn")
    procs, pipes = [], []
    for _ in range(args.processes):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=grpc_process, args=(args.host, args.port, answer, max_receive, send))
        proc.start()
        send.close()
        procs.append(proc)
        pipes.append(receive)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        for receive in pipes:
            if receive.recv() != "listening":
                raise SystemExit("a reference gRPC process did not start")
        print("ready", flush=True)
        while not stop.wait(0.5) and all(p.is_alive() for p in procs):
            pass
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("http", "grpc"))
    p.add_argument("--answers", type=Path, required=True, help="v1.json, v1-raw.json, oip.bin, oip.headers.json, "
                                                                "grpc.bin")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=2, help="http: uvicorn worker processes")
    p.add_argument("--processes", type=int, default=2, help="grpc: server processes")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    (run_http if args.kind == "http" else run_grpc)(args)


if __name__ == "__main__":
    main()
