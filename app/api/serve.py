"""``yolopipe serve``: one uvicorn process serving one detector (one process per GPU).

The detector is opened before uvicorn starts, so a missing model or backend is one clear
error for the CLI instead of a lifespan traceback. SIGTERM/SIGINT: uvicorn stops accepting,
waits for in-flight requests (bounded by the request timeout), then the lifespan drains the
batcher; the detector is closed last.
"""

from __future__ import annotations

import logging

from app.api.main import create_app, open_detector_from
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
        server.run()
        if not server.started:  # the lifespan failed (e.g. warm-up); uvicorn has logged why
            raise SystemExit(3)
    finally:
        detector.close()
