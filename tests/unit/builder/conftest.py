"""What the builder's tests share: the sample model as a build traces it, and its export with the
package's dynamic batch (the rewrite tests); the child processes a build starts (its export
beside it, its check in a fresh process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def traced_sample(sample_model_dir) -> tuple[Any, Any, Any]:
    """The sample model in fp32 on the CPU with its anchors in the graph (as a build traces it), a
    batch of two 320x320 images, and the model's head on them before any rewrite."""
    import torch

    from app.gpu.torch_model import load_model

    model, _ = load_model(sample_model_dir / "weights.pt", precision="fp32", device=torch.device("cpu"),
                          anchors_in_graph=True)
    x = torch.rand(2, 3, 320, 320, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        head = model(x)
    return model, x, head


@pytest.fixture
def export_dynamic() -> Callable[[Any, Any], Any]:
    """``torch.export`` of a model at 320 with the package's dynamic batch (1-8), as a CPU build would."""
    import torch

    from app.artifacts.torch_engines import TorchEngineKey
    from app.builder.torch_build import export_program

    key = TorchEngineKey("0" * 64, 320, "fp32", torch.__version__, "cpu", "", 1, 8)
    return lambda model, x: export_program(model, x, key)


@pytest.fixture
def started_processes(monkeypatch) -> list[Any]:
    """Every ``subprocess.Popen`` the test starts, in order (the processes are real)."""
    import subprocess

    started: list[Any] = []
    real_popen = subprocess.Popen

    def recorded(*args: Any, **kwargs: Any) -> Any:
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", recorded)
    return started
