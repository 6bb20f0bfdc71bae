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
    engine._torch, engine.precision = torch, precision
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
