"""The tuning cache's file and rules (``app.artifacts.tuning_cache``): a round trip, what makes a
cache not fit, and the files it refuses to read."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from app.artifacts.tuning_cache import (
    MAX_TUNING_CACHE_BYTES,
    TuningCache,
    TuningKey,
    build_estimate_s,
    default_tuning_cache,
    read_tuning_cache,
    say_duration,
    write_tuning_cache,
)
from app.errors import ArtifactError

KEY = TuningKey("NVIDIA H200", "9.0", "2.11.0+cu130", "3.5.0", "13.0", "ab" * 32, 2)


def test_a_cache_written_reads_back_whole(tmp_path):
    cache = TuningCache(KEY, {"convolution": {"[[2, 3, 640, 640]]": {"highest": {"choice-a": 0.012}}}},
                        {"ab/cabc.best_config": {"XBLOCK": 256, "num_warps": 4}}, 1, "2026-12-05T00:00:00+00:00",
                        {"convolution:64x32": [{"BLOCK_M": 64, "BLOCK_K": 32, "BLOCK_N": 128, "num_stages": 2,
                                                "num_warps": 4}]})
    path = write_tuning_cache(tmp_path / "deep" / "tuning.json", cache)
    assert read_tuning_cache(path) == cache
    assert path.stat().st_size < 1000 and not list(path.parent.glob("*.tmp*"))


def test_no_file_is_no_cache(tmp_path):
    assert read_tuning_cache(tmp_path / "none.json") is None


@pytest.mark.parametrize(("change", "says"), [
    ({"gpu_name": "NVIDIA H100 80GB HBM3"}, "GPU NVIDIA H200 made it, this build has NVIDIA H100 80GB HBM3"),
    ({"compute_capability": "8.0"}, "compute capability 9.0 made it"),
    ({"torch_version": "2.12.0"}, "torch 2.11.0+cu130 made it, this build has 2.12.0"),
    ({"triton_version": "3.6.0"}, "Triton 3.5.0 made it"),
    ({"cuda_version": "12.8"}, "CUDA 13.0 made it"),
    ({"graph": "cd" * 32}, "it was tuned for another model graph (abababababab, this is cdcdcdcdcdcd)"),
    ({"tuning_batch": 64}, "it was tuned at batch 2, this build tunes at batch 64"),
])
def test_a_cache_fits_only_the_gpu_software_graph_and_batch_it_was_made_for(change, says):
    assert KEY.mismatch(KEY) == []
    (problem,) = KEY.mismatch(replace(KEY, **change))
    assert problem.startswith(says), problem


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]", json.dumps({"kind": "something else"}).encode(),
                                     json.dumps({"kind": "yolopipe tuning cache", "key": {"gpu_name": "x"}}).encode(),
                                     json.dumps({"kind": "yolopipe tuning cache", "key": KEY.__dict__,
                                                 "templates": [1]}).encode(),
                                     json.dumps({"kind": "yolopipe tuning cache", "key": KEY.__dict__,
                                                 "best_tiles": {"convolution:64x32": "fast"}}).encode()])
def test_a_file_that_is_no_tuning_cache_is_refused_with_why(tmp_path, content):
    path = tmp_path / "tuning.json"
    path.write_bytes(content)
    with pytest.raises(ArtifactError, match="is not a yolopipe tuning cache"):
        read_tuning_cache(path)


def test_an_oversized_file_is_refused_unread(tmp_path):
    path = tmp_path / "tuning.json"
    with open(path, "wb") as fh:
        fh.truncate(MAX_TUNING_CACHE_BYTES + 1)
    with pytest.raises(ArtifactError, match="over 1,048,576"):
        read_tuning_cache(path)
    with pytest.raises(ArtifactError, match="over"):
        write_tuning_cache(tmp_path / "big.json", TuningCache(KEY, {"op": "x" * MAX_TUNING_CACHE_BYTES}))


def test_the_estimate_counts_the_tunings_left():
    assert build_estimate_s("NVIDIA H200", tunings=0) < build_estimate_s("NVIDIA H200", tunings=41)
    assert build_estimate_s("NVIDIA H200", tunings=41, batch_invariant=False) == build_estimate_s("NVIDIA H200",
                                                                                                  tunings=0)
    assert build_estimate_s("Some Other GPU", tunings=10) >= build_estimate_s("NVIDIA H200", tunings=10)
    assert [say_duration(s) for s in (12.4, 89, 400)] == ["about 12 s", "about 89 s", "about 7 min"]
    # the H100's committed builds (2026-12-06): 27-30 s from the cache with its tiles, 85 s for a first
    # build narrowed to the packaged tiles; every candidate timed: 462 s (2026-12-05, 338 s of tunings)
    assert build_estimate_s("NVIDIA H100 80GB HBM3", tunings=0) == 30.0
    assert abs(build_estimate_s("NVIDIA H100 80GB HBM3", tunings=40, narrowed=True) - 85) < 5
    assert build_estimate_s("NVIDIA H100 80GB HBM3", tunings=40) > 338
    assert build_estimate_s("Some Other GPU", tunings=40, narrowed=True) >= build_estimate_s(
        "NVIDIA H100 80GB HBM3", tunings=40, narrowed=True)


def test_the_cache_every_build_uses_can_be_named_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("YOLOPIPE_TUNING_CACHE", raising=False)
    assert default_tuning_cache(tmp_path / "model") == tmp_path / "model" / "torch-cache" / "tuning.json"
    monkeypatch.setenv("YOLOPIPE_TUNING_CACHE", str(tmp_path / "shared.json"))
    assert default_tuning_cache(tmp_path / "model") == tmp_path / "shared.json"


def test_a_cache_written_before_tiles_were_recorded_reads_with_none(tmp_path):
    """The H100 cache committed on 2026-12-06 had no ``best_tiles``: it still fits, and its next
    build generates every candidate and records them."""
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"kind": "yolopipe tuning cache", "key": KEY.__dict__, "templates": {}, "kernels": {},
                                "tunings": 0, "written_at": ""}))
    assert read_tuning_cache(path).best_tiles == {}


def test_a_cache_written_before_the_batch_was_recorded_was_tuned_at_2(tmp_path):
    """Caches written before 2026-12-06's seventh session have no ``tuning_batch``: every build then
    traced batch 2, so they fit only a build that tunes there."""
    path = tmp_path / "tuning.json"
    older = {name: value for name, value in KEY.__dict__.items() if name != "tuning_batch"}
    path.write_text(json.dumps({"kind": "yolopipe tuning cache", "key": older}))
    assert read_tuning_cache(path).key == replace(KEY, tuning_batch=2)
    assert replace(KEY, tuning_batch=64).mismatch(read_tuning_cache(path).key) == [
        "it was tuned at batch 64, this build tunes at batch 2"]
