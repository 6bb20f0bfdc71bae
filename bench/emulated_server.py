"""The real ``yolopipe serve`` with the device emulated: the supervisor, its HTTP and gRPC
workers, IPC, batcher and formatters as they run on a GPU machine, in front of one inference
worker whose detector is ``bench/emulated_device.py``'s (a serial device at ``--rate``
images/s replaying the sample model's recorded answers). Measures the host tier on any machine;
``bench/http_load.py --parts host`` starts it.

    python bench/emulated_server.py --replay FILE [--rate 7000] [--port 8000] [--grpc-port 8001]

The other serving settings come from ``YOLOPIPE_*`` variables as for ``yolopipe serve``
(``YOLOPIPE_WORKERS``, ``YOLOPIPE_GRPC_WORKERS``, ``YOLOPIPE_RING_MB``...).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))  # the spawned workers inherit it: the inference worker imports bench.emulated_device


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replay", type=Path, required=True, help="the recorded answers (emulated_device.Replay.save)")
    p.add_argument("--rate", type=float, default=None, help="the emulated device's images/s [default: 7000]")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=None, help="default: --port + 1; 0: no gRPC")
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--max-wait-ms", type=float, default=None)
    args = p.parse_args(argv)
    from app.service.supervisor import serve
    from app.settings import Settings
    from bench.emulated_device import open_emulated_detector  # here: every worker re-imports this module

    given = {"host": args.host, "port": args.port, "grpc_port": args.grpc_port, "max_batch": args.max_batch,
             "max_wait_ms": args.max_wait_ms}
    # The inference worker runs on no GPU (one, as cpu_workers says): its device is the emulated one.
    settings = Settings(backend="onnxruntime", **{k: v for k, v in given.items() if v is not None})
    device = {"replay": args.replay.resolve(), **({"rate": args.rate} if args.rate is not None else {})}
    serve(settings, detector_factory=functools.partial(open_emulated_detector, **device))


if __name__ == "__main__":
    main()
