"""torch-cuda's settings (cuDNN's choice pinned: no autotune, deterministic algorithms; no TF32
for fp32, recompile limit, inductor cache dir) hold for the engine's own calls only: the
process's settings are back after each call."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from app.backends.torch_cuda import TorchCudaEngine


def engine_settings_only(tmp_path, precision: str) -> TorchCudaEngine:
    # The settings part of an engine, without a GPU: the attributes __init__ and _compile set.
    import torch._dynamo

    engine = object.__new__(TorchCudaEngine)
    engine._torch, engine.precision, engine.cudnn_benchmark = torch, precision, False
    engine._inductor_cache = str(tmp_path / "torch-cache" / "inductor")
    engine._compile_limits = {"recompile_limit": torch._dynamo.config.recompile_limit + 50}
    return engine


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_settings_hold_inside_a_call_and_are_restored_after(tmp_path, monkeypatch, precision):
    import torch._dynamo

    cudnn, matmul, dynamo = torch.backends.cudnn, torch.backends.cuda.matmul, torch._dynamo.config
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    saved = cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32
    # the process's own choice: autotune, any algorithm, TF32
    cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32 = True, False, True, True
    try:
        before = dynamo.recompile_limit
        engine = engine_settings_only(tmp_path, precision)
        with engine._scope():
            assert cudnn.benchmark is False and cudnn.deterministic is True
            assert cudnn.allow_tf32 is matmul.allow_tf32 is (precision != "fp32")
            assert dynamo.recompile_limit == before + 50
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == engine._inductor_cache
        assert (cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32) == (True, False, True, True)
        assert dynamo.recompile_limit == before and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    finally:
        cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32 = saved


def test_a_users_inductor_cache_dir_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    with engine_settings_only(tmp_path, "fp16")._scope():
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_batch_runs_on_the_narrowest_package_that_takes_it_in_the_engines_settings(tmp_path):
    """With packages built ahead of time, ``forward`` calls the one whose batch range is the
    narrowest that holds the batch (a fixed-batch package before the dynamic one), inside the
    engine's settings, and refuses a batch no package takes."""
    from app.artifacts.torch_engines import TorchEngineKey
    from app.errors import InvalidParameter

    calls = []

    def runner(name):
        def run(images):
            calls.append((name, images.shape[0], torch.backends.cudnn.benchmark))
            return images[:, :1]
        return run

    key = TorchEngineKey("0" * 64, 8, "fp16", "t", "g", "9.0", 1, 64)
    engine = engine_settings_only(tmp_path, "fp16")
    engine._inductor_cache, engine._compile_limits = None, {}
    engine.device, engine._torch_dtype, engine.input_dtype, engine.max_batch = torch.device("cpu"), torch.float16, "float16", 64
    engine._packages = [(TorchEngineKey(**{**key.__dict__, "min_batch": 8, "max_batch": 8}), runner("fixed 8")),
                        (key, runner("dynamic 1-64"))]
    benchmark = torch.backends.cudnn.benchmark
    for batch in (8, 3, 64):
        out = engine.forward(torch.zeros((batch, 3, 8, 8), dtype=torch.float16))
        assert out.shape == (batch, 1, 8, 8)
    assert calls == [("fixed 8", 8, False), ("dynamic 1-64", 3, False), ("dynamic 1-64", 64, False)]  # no autotuning
    assert torch.backends.cudnn.benchmark == benchmark
    engine._packages = engine._packages[:1]
    with pytest.raises(InvalidParameter, match="no torch-cuda engine package takes a batch of 3"):
        engine.forward(torch.zeros((3, 3, 8, 8), dtype=torch.float16))
