"""Folder inference past one machine: a Ray Data job with one detector actor per GPU.

``predict_with_ray`` writes the records ``yolopipe predict`` writes. Ray is an optional
dependency (``yolopipe[ray]``), imported only when a job runs.
"""

from app.distributed.job import predict_with_ray

__all__ = ["predict_with_ray"]
