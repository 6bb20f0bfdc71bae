"""``yolopipe serve``: one uvicorn process serving one detector (one process per GPU).

The detector is opened before uvicorn starts, so a missing model or backend is one clear
error for the CLI instead of a lifespan traceback. SIGTERM/SIGINT: uvicorn stops accepting,
waits for in-flight requests (bounded by the request timeout), then the lifespan drains the
batcher; the detector is closed last.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from app.api.main import create_app
from app.runtime import open_detector_from
from app.config import Settings


def serve(settings: Settings) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    detector = open_detector_from(settings)
    try:
        app = create_app(settings, detector=detector)
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            lifespan="on",
            access_log=False,  # per-request lines cost throughput; /metrics counts requests by status
            # In-flight requests finish within the request timeout; do not wait longer than that.
            timeout_graceful_shutdown=int(settings.request_timeout_s) + 5,
            timeout_keep_alive=30,
            log_level="info",
        )
        server = uvicorn.Server(config)
        # Uvicorn re-raises the signal it shut down for once it is done, which would kill the
        # process with the default handler (exit -15) before the detector is closed. A graceful
        # shutdown is a clean exit: let the re-raised signal land on a handler that ignores it.
        on_main_thread = threading.current_thread() is threading.main_thread()  # signals live there only
        previous = {
            sig: signal.signal(sig, _already_handled) for sig in (signal.SIGINT, signal.SIGTERM) if on_main_thread
        }
        try:
            server.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if not server.started:  # the lifespan failed (e.g. warm-up); uvicorn has logged why
            raise SystemExit(3)
    finally:
        detector.close()


def _already_handled(signum: int, frame: FrameType | None) -> None:
    """Uvicorn handled this signal (graceful shutdown); nothing is left to do."""
