"""``serve``: its options are the service's ``Settings``; each left out comes from a
``YOLOPIPE_*`` variable or the default."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from app.cli.options import BATCH_INVARIANT_HELP, DECODE_HELP, SQUARE_HELP, ArtifactsDir

if TYPE_CHECKING:
    from app.settings import Settings


def settings_from(**given) -> Settings:
    """``Settings`` from the options given (the rest from ``YOLOPIPE_*`` variables or defaults)."""
    from pydantic import ValidationError

    from app.errors import InvalidParameter
    from app.settings import Settings

    try:
        return Settings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"--{'.'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in exc.errors())
        raise InvalidParameter(f"invalid settings: {problems}") from None


def serve(
    weights: Annotated[str | None, typer.Option("--weights", "-w", help="Weights (env YOLOPIPE_WEIGHTS).")] = None,
    backend: Annotated[str | None, typer.Option(help="auto | onnxruntime | torch-cuda | tensorrt.")] = None,
    precision: Annotated[str | None, typer.Option(help="auto | fp32 | fp16 | int8.")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000).")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="KServe v2 gRPC port [default: --port + 1, so 8001 "
                                                          "beside 8000 as Triton's; 0: no gRPC].")] = None,
    grpc_workers: Annotated[int | None, typer.Option(help="gRPC worker processes [default: as many as HTTP "
                                                             "workers].")] = None,
    allow_client_shm: Annotated[bool | None, typer.Option(
        "--allow-client-shm/--no-allow-client-shm", help="Triton's system shared-memory extension for clients "
        "on this host (REST and gRPC) [default: off].")] = None,
    max_batch: Annotated[int | None, typer.Option(help="Largest GPU batch the batcher forms.")] = None,
    max_wait_ms: Annotated[float | None, typer.Option(help="Longest wait to fill a batch.")] = None,
    workers: Annotated[int | None, typer.Option(help="HTTP worker processes [default: from the core count].")] = None,
    gpus: Annotated[str | None, typer.Option(help="'all' visible GPUs, or CUDA indices like 0,1: one inference "
                                                     "worker per GPU, each request to the least loaded [default: all].")] = None,
    cpu_workers: Annotated[int | None, typer.Option(help="Inference workers when the model runs on the CPU.")] = None,
    compile: Annotated[bool | None, typer.Option("--compile/--no-compile",
                                                    help="torch-cuda: run the engine compiled ahead of time "
                                                         "(built on first use, or by build-engine); "
                                                         "--no-compile: the eager model.")] = None,
    batch_invariant: Annotated[bool | None, typer.Option("--batch-invariant/--no-batch-invariant",
                                                            help=BATCH_INVARIANT_HELP)] = None,
    decode: Annotated[str | None, typer.Option(help=DECODE_HELP)] = None,
    square: Annotated[bool, typer.Option("--square", help=SQUARE_HELP + " Env YOLOPIPE_LETTERBOX=square.")] = False,
    artifacts_dir: ArtifactsDir = None,
) -> None:
    """Serve detection over HTTP and gRPC.

    POST /v1/detect, the Open Inference Protocol (KServe v2) under /v2, and KServe v2 gRPC on
    --grpc-port: HTTP and gRPC worker processes in front of one inference worker per GPU.
    Every option can also come from YOLOPIPE_<OPTION> variables.
    """
    from app.service.supervisor import serve as run_server

    run_server(settings_from(weights=weights, backend=backend, precision=precision, host=host, port=port,
                             grpc_port=grpc_port, grpc_workers=grpc_workers, allow_client_shm=allow_client_shm,
                             max_batch=max_batch, max_wait_ms=max_wait_ms, workers=workers, gpus=gpus,
                             cpu_workers=cpu_workers, compile=compile, batch_invariant=batch_invariant,
                             decode=decode, letterbox="square" if square else None, artifacts_dir=artifacts_dir))
