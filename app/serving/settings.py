"""Settings of the serving processes: ``app.config.Settings`` plus what only serving derives.

Every field is in ``Settings`` (``YOLOPIPE_<FIELD>`` or a ``yolopipe serve`` option); this class
only adds what serving derives from them.
"""

from __future__ import annotations

import os

from app.config import Settings
from app.errors import BackendUnavailable, InvalidParameter

MiB = 1024 * 1024


class ServingSettings(Settings):
    """``Settings`` with what serving derives from them (workers, devices, budgets)."""

    @classmethod
    def from_settings(cls, settings: Settings | None) -> ServingSettings:
        if settings is None:
            return cls()
        if isinstance(settings, ServingSettings):
            return settings
        return cls(**settings.model_dump())

    @property
    def budget_s(self) -> float:
        return self.queue_budget_s or self.request_timeout_s

    @property
    def window(self) -> int:
        return self.request_window or self.max_batch

    @property
    def ring_bytes(self) -> int:
        # Room for the largest body twice over, so one big image never finds the ring too small.
        return max(self.ring_mb * MiB, 2 * self.max_body_bytes)

    def runs_on_gpu(self) -> bool:
        if self.backend == "onnxruntime":
            return False
        from app.gpu.probe import cuda_device_count  # ctypes only: no torch here

        if cuda_device_count() == 0:
            if self.backend != "auto":
                raise BackendUnavailable(f"backend {self.backend} needs an NVIDIA GPU and none was found",
                                         hint="use --backend onnxruntime")
            return False
        return True

    def inference_devices(self) -> list[str | None]:
        """One entry per inference worker: the CUDA_VISIBLE_DEVICES entry it gets, or None (CPU)."""
        if not self.runs_on_gpu():
            return [None] * self.cpu_workers
        from app.gpu.probe import cuda_device_count

        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = [v.strip() for v in env.split(",") if v.strip()] if env else []
        visible = visible or [str(i) for i in range(cuda_device_count())]
        if self.gpus.strip().lower() == "all":
            return list(visible)
        try:
            chosen = [int(g) for g in self.gpus.split(",") if g.strip()]
        except ValueError:
            raise InvalidParameter(f"gpus must be 'all' or CUDA indices like '0,1', got {self.gpus!r}") from None
        bad = [g for g in chosen if not 0 <= g < len(visible)]
        if bad or not chosen:
            raise InvalidParameter(f"gpus {self.gpus!r}: this machine shows {len(visible)} GPU(s), 0..{len(visible) - 1}")
        return [visible[g] for g in dict.fromkeys(chosen)]

    def http_worker_count(self, inference_workers: int, on_gpu: bool) -> int:
        """Given, or: every core but two per GPU worker (its host threads); on the CPU the model
        needs the cores and HTTP is cheap beside it, so one worker per eight cores."""
        if self.workers:
            return self.workers
        cores = os.cpu_count() or 1
        if on_gpu:
            return max(1, min(32, cores - 2 * inference_workers))
        return max(1, cores // 8)
