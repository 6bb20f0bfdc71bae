"""``yolopipe serve``: HTTP worker processes in front of one inference worker per GPU.

The processes, their supervision and their shutdown live in ``app.serving.supervisor``; a
missing model or backend is one clear error from the first inference worker's start, for the
CLI to print, before any HTTP worker starts.
"""

from __future__ import annotations

from app.config import Settings


def serve(settings: Settings) -> None:
    from app.serving.supervisor import serve as supervise

    supervise(settings)
