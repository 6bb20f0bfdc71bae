"""The build's tuning on the CPU (``app.builder.tuning``): the graph's key, and a tuning cache
seeded into inductor's folder as inductor's own autotuning table reads it, collected back, and
carried through ``tuned`` (a first build writes it, a later one reads it, one for another GPU is
not read). Inductor's real tuning runs on the GPU (``tests/gpu/test_torch_engine.py``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from app.artifacts.tuning_cache import TuningCache, TuningKey, read_tuning_cache, write_tuning_cache
from app.builder import tuning


def key_for(graph: str = "", gpu_name: str = "NVIDIA Stand-in", tuning_batch: int = 2) -> TuningKey:
    return TuningKey(gpu_name, "9.0", torch.__version__, "3.5.0", "13.0", graph, tuning_batch)


def stand_in_machine_key(device: int = 0, graph: str = "", tuning_batch: int = 2) -> TuningKey:
    """``tuning.machine_key`` without a GPU."""
    return key_for(graph, tuning_batch=tuning_batch)


class Convs(torch.nn.Module):
    """Three convolutions, two of one shape: two tunings."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.c = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def export(size: int = 32, seed: int = 0):
    torch.manual_seed(seed)  # other weights: the same graph
    dim = torch.export.Dim("batch", min=1, max=64)
    return torch.export.export(Convs().eval(), (torch.rand(2, 3, size, size),), dynamic_shapes=({0: dim},))


class Choice:
    """A candidate kernel as inductor's table keys it."""

    def __init__(self, name: str):
        self.name = name

    def hash_key(self) -> str:
        return self.name


@pytest.fixture
def inductor_dir(tmp_path, monkeypatch):
    from torch._inductor.codecache import CacheBase

    folder = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    CacheBase.get_local_cache_path.cache_clear()
    yield folder
    CacheBase.get_local_cache_path.cache_clear()


def inductor_lookup(choices, inputs: str = "[[2, 3, 32, 32]]", benchmark=None):
    """Inductor's own look-up of a tuning (``PersistentCache.lookup``), as a build makes it."""
    from torch._inductor.codecache import PersistentCache

    return {c.name: t for c, t in PersistentCache().lookup(choices, "convolution", inputs, benchmark).items()}


def test_the_graph_key_is_the_graph_not_its_weights():
    first = tuning.graph_signature(export())
    assert first == tuning.graph_signature(export(seed=1))
    assert first != tuning.graph_signature(export(size=64))
    assert tuning.distinct_tunings(export()) == 2


def test_a_seeded_table_is_what_inductor_reads_and_it_tunes_nothing(inductor_dir):
    choices = [Choice("tile-64x64"), Choice("tile-128x32")]
    precision = torch.get_float32_matmul_precision()
    cache = TuningCache(key_for(), {"convolution": {"[[2, 3, 32, 32]]": {
        precision: {"tile-64x64": 0.25, "tile-128x32": 0.5}}}})
    tuning.seed(cache, inductor_dir)

    def benchmark(choices):
        raise AssertionError("a tuning found in the cache was timed again")

    assert inductor_lookup(choices, benchmark=benchmark) == {"tile-64x64": 0.25, "tile-128x32": 0.5}
    assert inductor_lookup([Choice("tile-32x32")]) == {}  # not in the cache: a build would time it


def test_what_inductor_tuned_is_collected_with_its_kernel_records(inductor_dir):
    timed = inductor_lookup([Choice("tile-64x64")], benchmark=lambda choices: {choices[0]: 0.125})
    assert timed == {"tile-64x64": 0.125}
    record = inductor_dir / "ab" / "cabcdef.best_config"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"XBLOCK": 128, "num_warps": 4}))
    (inductor_dir / "ab" / "cabcdef.py").write_text("# a kernel's source: not a record")
    got = tuning.collect(inductor_dir, key_for())
    assert got.kernels == {"ab/cabcdef.best_config": {"XBLOCK": 128, "num_warps": 4}} and got.tunings == 1
    assert next(iter(got.templates["convolution"]["[[2, 3, 32, 32]]"].values())) == {"tile-64x64": 0.125}


def test_a_cache_writes_nothing_but_records_inside_inductors_folder(inductor_dir, tmp_path):
    cache = TuningCache(key_for(), {}, {
        "../outside.best_config": {}, "/tmp/absolute.best_config": {}, "ab/kernel.py": {}, "cd/ok.best_config": {"a": 1}})
    assert tuning.seed(cache, inductor_dir) == 1
    assert json.loads((inductor_dir / "cd" / "ok.best_config").read_text()) == {"a": 1}
    assert not (tmp_path / "outside.best_config").exists() and not (inductor_dir / "ab" / "kernel.py").exists()


def test_tuned_writes_a_first_builds_tunings_and_a_later_build_reads_them(inductor_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "machine_key", stand_in_machine_key)
    program, cache_path, said = export(), tmp_path / "copied" / "tuning.json", []
    with tuning.tuned(program, 0, cache_path, said.append, tuning_batch=2) as first:
        inductor_lookup([Choice("tile-64x64"), Choice("tile-128x32")],
                        benchmark=lambda choices: {c: 0.5 for c in choices})
    assert first["report"].tuning_cache == "none" and "tuning about 2 kernels" in said[0]
    written = read_tuning_cache(cache_path)
    assert written.key.graph == tuning.graph_signature(program) and written.tunings == 1

    (inductor_dir / "cache").rename(tmp_path / "elsewhere")  # another machine: an empty inductor folder
    said.clear()
    with tuning.tuned(export(seed=3), 0, cache_path, said.append, tuning_batch=2) as later:
        timings = inductor_lookup([Choice("tile-64x64"), Choice("tile-128x32")], benchmark=None)
    assert later["report"].tuning_cache == "hit" and timings == {"tile-64x64": 0.5, "tile-128x32": 0.5}
    assert said == [f"tuning cache {cache_path}: 1 tunings of NVIDIA Stand-in read"]

    said.clear()  # the same graph traced at another batch: its candidates' times were taken at another size
    with tuning.tuned(program, 0, cache_path, said.append, tuning_batch=64) as bigger:
        pass
    assert bigger["report"].tuning_cache == "other"
    assert said[0] == f"tuning cache {cache_path} not read: it was tuned at batch 2, this build tunes at batch 64"
    assert read_tuning_cache(cache_path).key.tuning_batch == 64

    monkeypatch.setattr(tuning, "machine_key", lambda device=0, graph="", tuning_batch=2: key_for(
        graph, gpu_name="NVIDIA Other"))
    said.clear()
    with tuning.tuned(program, 0, cache_path, said.append, tuning_batch=2) as other:
        pass
    assert other["report"].tuning_cache == "other"
    assert said[0].startswith(f"tuning cache {cache_path} not read: GPU NVIDIA Stand-in made it, this build has "
                              "NVIDIA Other")
    assert read_tuning_cache(cache_path).key.gpu_name == "NVIDIA Other"  # the file holds the last build's


def test_the_count_says_each_new_tuning_once_with_what_is_left():
    said = []

    class Node:
        def __init__(self, size):
            self.size = size

        def get_size(self):
            return self.size

    count = tuning.TuningCount(3, 7.0, said.append)
    count({}, "convolution", [Node([2, 3, 32, 32])])
    count({}, "convolution", [Node([2, 3, 32, 32])])  # the same shape again: inductor's cache answered
    count({}, "convolution", [Node([2, 8, 32, 32])])
    count({}, "convolution", None, "anything inductor adds")  # never fails the compile
    assert [line.split(" (")[0] for line in said] == ["tuning kernels: 1 of about 3", "tuning kernels: 2 of about 3",
                                                      "tuning kernels: 3 of about 3"]
    assert said[-1].endswith("about 0 s left)")


def test_the_pace_is_measured_from_the_first_tuning_on(monkeypatch):
    """The first tuning ends after the graph is traced and lowered: what is left is paced by the
    tunings after it, not by that."""
    clock = iter([130.0, 132.0, 134.0])  # made at 100; tuning 1 at +30 s; then one every 2 s
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: next(clock))
    said = []
    count = tuning.TuningCount(13, 7.0, said.append, started=100.0)

    class Node:
        def __init__(self, size):
            self.size = size

        def get_size(self):
            return self.size

    for c in (3, 8, 16):
        count({}, "convolution", [Node([2, c, 32, 32])])
    assert said[0].endswith("(30 s; about 84 s left)")  # 12 left at the default 7 s
    assert said[-1].endswith("(34 s; about 20 s left)")  # 10 left at 2 s each


def test_a_build_records_its_best_tiles_and_a_build_from_the_cache_generates_only_those(
        inductor_dir, tmp_path, monkeypatch):
    """The first build's feedback (called as inductor calls its feedback functions) goes into the
    cache with its tunings; a later build from it gets inductor's convolution candidates narrowed
    to them (``app.builder.narrowed_choices``), says so in its report, and keeps the record."""
    import sympy
    from torch._inductor import select_algorithm
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    monkeypatch.setattr(tuning, "machine_key", stand_in_machine_key)
    monkeypatch.setattr(tuning, "architecture_tiles", lambda capability: {})  # a first build of every candidate
    program, cache_path = export(), tmp_path / "tuning.json"

    def conv_candidates():
        with V.set_graph_handler(GraphLowering(torch.fx.symbolic_trace(lambda x: x + 1))):
            return list(V.choices.get_conv_configs("cuda")(sympy.Integer(2048), 8, 3, dtype_size=4))

    every = conv_candidates()
    best = every[2]

    class Template:
        def __init__(self):
            self.log_info = {"tile_shape": str((best.kwargs["BLOCK_M"], best.kwargs["BLOCK_K"], best.kwargs["BLOCK_N"])),
                             "num_stages": best.num_stages, "num_warps": best.num_warps}

    class Weight:
        def get_size(self):
            return [sympy.Integer(8), sympy.Integer(3), sympy.Integer(3), sympy.Integer(3)]

    with tuning.tuned(program, 0, cache_path, lambda text: None, tuning_batch=2) as first:
        for feedback in list(select_algorithm.get_algorithm_selector_cache().feedback_saver_fns):
            feedback({Template(): 0.25}, "convolution", [Weight(), Weight()], [], None)
        assert len(conv_candidates()) == len(every)  # nothing recorded yet: every candidate
    assert (first["report"].candidates_generated, first["report"].candidates_kept) == (0, 0)
    tile = {"BLOCK_M": best.kwargs["BLOCK_M"], "BLOCK_K": best.kwargs["BLOCK_K"], "BLOCK_N": best.kwargs["BLOCK_N"],
            "num_stages": best.num_stages, "num_warps": best.num_warps}
    assert read_tuning_cache(cache_path).best_tiles == {"convolution:8x3": [tile]}

    with tuning.tuned(program, 0, cache_path, lambda text: None, tuning_batch=2) as later:
        narrowed = conv_candidates()
    assert [c.kwargs["BLOCK_M"] for c in narrowed] == [best.kwargs["BLOCK_M"]] and len(every) > 1
    assert later["report"].tuning_cache == "hit"
    assert (later["report"].candidates_generated, later["report"].candidates_kept) == (len(every), 1)
    assert read_tuning_cache(cache_path).best_tiles == {"convolution:8x3": [tile]}  # kept for the next build
    assert not any(isinstance(f, (tuning.TuningCount, tuning.BestTiles))
                   for f in select_algorithm.get_algorithm_selector_cache().feedback_saver_fns)


def test_a_first_build_times_only_the_tiles_that_won_on_its_compute_capability(inductor_dir, tmp_path, monkeypatch):
    """No cache of its own: the package's tiles of its compute capability narrow inductor's real
    convolution candidates, and a cache from another card of that capability adds its own; a
    capability without tiles gets every candidate."""
    import sympy
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    from app.builder import narrowed_choices

    def conv_candidates():
        with V.set_graph_handler(GraphLowering(torch.fx.symbolic_trace(lambda x: x + 1))):
            return list(V.choices.get_conv_configs("cuda")(sympy.Integer(2048), 8, 3, dtype_size=4))

    def tile(config):
        return {"BLOCK_M": config.kwargs["BLOCK_M"], "BLOCK_K": config.kwargs["BLOCK_K"],
                "BLOCK_N": config.kwargs["BLOCK_N"], "num_stages": config.num_stages, "num_warps": config.num_warps}

    every = conv_candidates()
    packaged, kin = tile(every[0]), tile(every[2])
    packaged_file = tmp_path / "architecture_tiles.json"
    packaged_file.write_text(json.dumps({"architectures": {"9.0": {"tiles": {"convolution:8x3": [packaged]}}}}))
    monkeypatch.setattr(tuning, "architecture_tiles",
                        lambda capability: narrowed_choices.architecture_tiles(capability, packaged_file))
    monkeypatch.setattr(tuning, "machine_key", stand_in_machine_key)
    said, cache_path = [], tmp_path / "tuning.json"
    with tuning.tuned(export(), 0, cache_path, said.append, tuning_batch=2) as first:
        assert [tile(c) for c in conv_candidates()] == [packaged]
    report = first["report"]
    assert (report.tuning_cache, report.narrowed_by) == ("none", "compute capability 9.0")
    assert (report.candidates_generated, report.candidates_kept) == (len(every), 1)
    assert said[0].startswith("tuning about 2 kernels over the tile settings that won on compute capability 9.0 (")

    other_card = TuningCache(key_for(tuning.graph_signature(export()), gpu_name="NVIDIA Other"),
                             best_tiles={"convolution:8x3": [kin]})
    write_tuning_cache(cache_path, other_card)
    with tuning.tuned(export(), 0, cache_path, said.append, tuning_batch=2) as second:
        assert [tile(c) for c in conv_candidates()] == [packaged, kin]
    assert (second["report"].tuning_cache, second["report"].narrowed_by) == ("other", "compute capability 9.0")

    cache_path.unlink()
    monkeypatch.setattr(tuning, "machine_key", lambda device=0, graph="", tuning_batch=2: replace(
        key_for(graph), compute_capability="8.0"))
    with tuning.tuned(export(), 0, cache_path, said.append, tuning_batch=2) as unmeasured:
        assert len(conv_candidates()) == len(every)
    assert unmeasured["report"].narrowed_by == "" and said[-1].startswith("tuning about 2 kernels (")
