"""The candidates a build from a tuning cache generates (``app.builder.narrowed_choices``), on the
CPU with this torch's own inductor: its real convolution candidate generator (which needs a
graph's size rules: a ``GraphLowering``) and its real hook for matrix products. That the narrowed
build makes the same package runs on the GPU (bench/results, the build A/B of 2026-12-06)."""

from __future__ import annotations

import threading
import types

import pytest

torch = pytest.importorskip("torch")
sympy = pytest.importorskip("sympy")

from app.builder import narrowed_choices as nc


@pytest.fixture
def graph():
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    with V.set_graph_handler(GraphLowering(torch.fx.symbolic_trace(lambda x: x + 1))):
        yield


def conv_candidates(out_channels: int = 64, in_channels: int = 32, m: int = 12800) -> list:
    """What inductor's convolution lowering iterates: the generator ``V.choices`` hands it."""
    from torch._inductor.virtualized import V

    return list(V.choices.get_conv_configs("cuda")(sympy.Integer(m), out_channels, in_channels, dtype_size=2))


def tile_of(config) -> dict[str, int]:
    settings = nc._config_settings(config)
    return {name: int(settings[name]) for name in (*nc.TILE_NAMES, "num_stages", "num_warps")}


def test_a_recorded_convolution_generates_only_its_recorded_tiles(graph):
    every = conv_candidates()
    assert len(every) > 4  # inductor's own list, scaled to this shape
    recorded = [tile_of(every[1]), tile_of(every[3])]
    with nc.narrowed_candidates({nc.conv_key(64, 32): recorded}) as narrowing:
        kept = conv_candidates()
        other = conv_candidates(out_channels=128)
    assert [tile_of(c) for c in kept] == recorded
    assert [tile_of(c) for c in other] == [tile_of(c) for c in conv_candidates(out_channels=128)]  # no record
    assert narrowing.active and narrowing.generated == len(every) + len(other)
    assert narrowing.kept == 2 + len(other)
    assert [tile_of(c) for c in conv_candidates()] == [tile_of(c) for c in every]  # the block's end restores them


def test_a_record_that_matches_nothing_generated_keeps_every_candidate(graph):
    every = conv_candidates()
    absent = {**tile_of(every[0]), "BLOCK_M": 4096}
    with nc.narrowed_candidates({nc.conv_key(64, 32): [absent]}):
        assert [tile_of(c) for c in conv_candidates()] == [tile_of(c) for c in every]


def test_a_convolutions_warps_match_as_its_template_caps_them(graph):
    """conv.py caps a non-unrolled tile at 4 warps, and the template logs what it got: a record of
    4 warps keeps the generator's 8-warp setting of that tile."""
    eight = next(c for c in conv_candidates() if c.num_warps == 8)
    capped = {**tile_of(eight), "num_warps": 4}
    with nc.narrowed_candidates({nc.conv_key(64, 32): [capped]}):
        assert tile_of(eight) in [tile_of(c) for c in conv_candidates()]


def test_the_narrowing_holds_only_inside_the_block_and_only_in_its_thread(graph):
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    seen = []
    with nc.narrowed_candidates({nc.conv_key(64, 32): [{"BLOCK_M": 1}]}):
        assert type(V.choices) is not InductorChoices
        thread = threading.Thread(target=lambda: seen.append(type(V.choices)))
        thread.start()
        thread.join()
    assert seen == [InductorChoices] and type(V.choices) is InductorChoices
    with nc.narrowed_candidates({}) as narrowing:  # nothing recorded: inductor's own choices
        assert type(V.choices) is InductorChoices and not narrowing.active


class Node:
    """An inductor IR node as the feedback and the hooks see it: its sizes."""

    def __init__(self, *size):
        self.size = [sympy.Integer(d) if isinstance(d, int) else d for d in size]

    def get_size(self):
        return self.size


class Template:
    """A Triton template candidate as ``TritonTemplateCaller`` logs its settings."""

    def __init__(self, m: int, k: int, n: int, stages: int, warps: int):
        self.log_info = {"tile_shape": str((m, k, n)), "num_stages": stages, "num_warps": warps, "backend": "Triton"}


class Extern:
    """An external kernel candidate (cuBLAS, say): no tile."""

    log_info = None


def test_the_feedback_keeps_each_operators_two_fastest_templates():
    best = nc.BestTiles()
    batch = sympy.Symbol("s0", positive=True, integer=True)
    x, weight = Node(batch, 32, 80, 80), Node(64, 32, 3, 3)
    fast, second, slow = Template(64, 32, 128, 2, 4), Template(128, 32, 64, 3, 4), Template(256, 64, 64, 2, 8)
    best({slow: 0.9, Extern(): 0.1, second: 0.5, fast: 0.2, Template(16, 16, 16, 1, 2): float("nan")},
         "convolution", [x, weight])
    assert best.tiles == {"convolution:64x32": [
        {"BLOCK_M": 64, "BLOCK_K": 32, "BLOCK_N": 128, "num_stages": 2, "num_warps": 4},
        {"BLOCK_M": 128, "BLOCK_K": 32, "BLOCK_N": 64, "num_stages": 3, "num_warps": 4}]}
    best({Template(32, 32, 32, 2, 4): 0.3, fast: 0.1}, "convolution", [Node(batch, 32, 40, 40), weight])
    assert len(best.tiles["convolution:64x32"]) == 3  # one key for both shapes: the union

    nodes = [Node(batch * 400, 128), Node(batch * 400, 256), Node(256, 128)]
    best({fast: 0.1}, "addmm", nodes)
    assert best.tiles[nc.product_key("addmm", nodes)] == [best.tiles["convolution:64x32"][0]]
    assert nc.product_key("addmm", nodes) == 'addmm:[["s",128],["s",256],[256,128]]'
    best({Extern(): 0.1}, "mm", nodes)  # no template timed: nothing to record
    best("not timings", "mm", nodes)  # and a surprise never fails the compile
    assert set(best.tiles) == {"convolution:64x32", nc.product_key("addmm", nodes)}


class Candidate:
    """A template choice before it is generated, as inductor's matrix-product hook gets it."""

    def __init__(self, **kwargs):
        self.params = types.SimpleNamespace(to_kwargs=lambda: dict(kwargs))


def test_a_recorded_matrix_product_keeps_its_recorded_tiles_and_every_untiled_candidate():
    """Through inductor's own ``_finalize_template_configs`` (which flattens each template's
    candidates) and the narrowing's override of it."""
    from torch._inductor.virtualized import V

    nodes = [Node(sympy.Symbol("s0") * 400, 128), Node(sympy.Symbol("s0") * 400, 256), Node(256, 128)]
    tiled = [Candidate(BLOCK_M=m, BLOCK_N=64, BLOCK_K=32, num_stages=3, num_warps=4, GROUP_M=8) for m in (32, 64, 128)]
    untiled = Candidate(alpha=1)
    inputs = types.SimpleNamespace(nodes=lambda: nodes)
    record = {nc.product_key("addmm", nodes): [
        {"BLOCK_M": 64, "BLOCK_K": 32, "BLOCK_N": 64, "num_stages": 3, "num_warps": 4}]}

    def finalize(op_name: str = "addmm"):
        return V.choices._finalize_template_configs({"triton": iter(tiled), "aten": iter([untiled])}, inputs, [],
                                                    op_name)

    with nc.narrowed_candidates(record) as narrowing:
        assert finalize() == [tiled[1], untiled]
        assert finalize("mm") == [*tiled, untiled]  # another operator: not recorded
    assert (narrowing.generated, narrowing.kept) == (6, 4)
    assert finalize() == [*tiled, untiled]


def test_recorded_tiles_merge_without_repeats():
    a, b, c = ({"BLOCK_M": m} for m in (16, 32, 64))
    assert nc.merged_tiles({"k": [a, b]}, {"k": [b, c], "j": [a]}) == {"k": [a, b, c], "j": [a]}


# --- the tiles a first build narrows to (the package's, per compute capability) ---------------
def committed_caches() -> list:
    from pathlib import Path

    from app.artifacts.tuning_cache import read_tuning_cache

    folder = Path(__file__).resolve().parents[3] / "bench" / "tuning"
    return [read_tuning_cache(path) for path in sorted(folder.glob("*.json"))]


def test_the_packaged_tiles_are_the_committed_caches_best_tiles_merged_per_compute_capability():
    """tools/architecture_tiles.py writes the package's file from bench/tuning/: the two never drift."""
    import json

    caches = committed_caches()
    assert caches and all(cache.best_tiles for cache in caches)
    assert json.loads(nc.ARCHITECTURE_TILES.read_text()) == nc.tiles_by_architecture(caches)
    for cache in caches:
        merged = nc.architecture_tiles(cache.key.compute_capability)
        assert all(tile in merged[key] for key, tiles in cache.best_tiles.items() for tile in tiles)


def test_every_packaged_convolution_tile_is_one_this_torch_generates_for_its_channels(graph):
    """A tile inductor no longer generates would narrow nothing (the operator gets every candidate):
    this torch's own generator, for YOLOv8s' convolutions at batch 64 and 640 pixels' largest map."""
    for capability in ("9.0",):
        for key, tiles in nc.architecture_tiles(capability).items():
            if key.startswith("convolution:"):
                out_channels, in_channels = (int(c) for c in key.split(":")[1].split("x"))
                generated = [tile_of(c) for c in conv_candidates(out_channels, in_channels, m=64 * 6400)]
                assert all(nc.is_recorded(tile, generated) for tile in tiles), key


def test_an_unmeasured_compute_capability_or_a_file_that_is_not_one_has_no_tiles(tmp_path):
    assert nc.architecture_tiles("9.0") and nc.architecture_tiles("1.0") == {}
    for text in ("not json", '{"architectures": {"9.0": {"tiles": {"k": "no list"}}}}', "[]"):
        (tmp_path / "tiles.json").write_text(text)
        assert nc.architecture_tiles("9.0", tmp_path / "tiles.json") == {}
    assert nc.architecture_tiles("9.0", tmp_path / "absent.json") == {}
