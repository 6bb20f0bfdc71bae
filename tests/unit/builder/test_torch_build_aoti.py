"""AOTInductor for real, on the CPU: the builder's export (one dynamic batch dimension) and
compile steps, and the loader a run uses, on a tiny model (a detection model takes minutes to
compile on a CPU; the GPU build of the real one is ``tests/gpu/test_torch_engine.py``)."""

from __future__ import annotations

import pytest
import torch

from app.artifacts.store import temp_name
from app.artifacts.torch_engines import TorchEngineKey, package_path
from app.builder.torch_build import compile_package, example_batch, export_program
from app.gpu.torch_model import load_package

pytestmark = pytest.mark.slow


class TinyHead(torch.nn.Module):
    """A conv and a head-shaped output ``[B, 4 + nc, anchors]``, with a batch-independent constant
    made inside the graph (as the real head's anchors are)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, stride=4, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.silu(self.conv(x)).flatten(2)
        offsets = torch.arange(y.shape[2], dtype=y.dtype, device=y.device) + 0.5
        return y + offsets


def test_one_package_runs_every_batch_of_its_range_like_the_model(tmp_path):
    key = TorchEngineKey("0" * 64, 32, "fp32", torch.__version__, "cpu", "", 1, 8)
    model = TinyHead().eval()
    example = torch.rand(example_batch(key), 3, 32, 32)
    assert example.shape[0] == 8  # the range's largest (up to the tuning batch): never 1, which fixes the dimension
    out = temp_name(package_path(tmp_path, key))
    out.parent.mkdir(parents=True)
    compile_package(export_program(model, example, key), out)
    run = load_package(out, torch.device("cpu"))
    with torch.inference_mode():
        for batch in (1, 3, 8):
            x = torch.rand(batch, 3, 32, 32)
            got, want = run(x), model(x)
            assert got.shape == want.shape == (batch, 6, 64)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_fixed_batch_package_and_a_file_that_is_no_package(tmp_path):
    from app.errors import ArtifactError

    key = TorchEngineKey("0" * 64, 32, "fp32", torch.__version__, "cpu", "", 4, 4)
    model = TinyHead().eval()
    example = torch.rand(example_batch(key), 3, 32, 32)
    assert example.shape[0] == 4
    out = package_path(tmp_path, key)
    out.parent.mkdir(parents=True)
    compile_package(export_program(model, example, key), out)
    with torch.inference_mode():
        torch.testing.assert_close(load_package(out, torch.device("cpu"))(example), model(example), rtol=1e-5, atol=1e-5)
    out.write_bytes(out.read_bytes()[:1000])
    with pytest.raises(ArtifactError, match="cannot load the torch-cuda engine"):
        load_package(out, torch.device("cpu"))
