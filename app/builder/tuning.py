"""A batch-invariant build's kernel tuning (build time only): read from a tuning cache that fits,
counted as it goes, written back afterwards (``app.artifacts.tuning_cache`` holds the file's
format and rules; this is the torch side).

Inductor keeps what it tunes in its cache folder (the model's ``torch-cache/inductor``): its
autotuning table and each pointwise kernel's chosen launch settings. ``tuned`` seeds that folder
from the cache before the compile, so every convolution found there is neither compiled nor timed
again, counts the tunings inductor reports while it compiles (``add_feedback_saver``: one call
per tuned operator) to say how many are left and for how long, and afterwards writes the folder's
records back to the cache file. It also narrows the candidates inductor generates
(``app.builder.narrowed_choices``): to the cache's best tiles, or, in a build without a cache of
its own, to the tiles that won on cards of its compute capability, which it then times itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.artifacts.engines import now_iso
from app.artifacts.store import write_atomically
from app.artifacts.tuning_cache import (
    TuningCache,
    TuningKey,
    read_tuning_cache,
    say_duration,
    seconds_per_tuning,
    write_tuning_cache,
)
from app.builder.narrowed_choices import BestTiles, architecture_tiles, merged_tiles, narrowed_candidates
from app.errors import ArtifactError

Say = Callable[[str], None]
TUNED_OPS = ("convolution", "conv2d", "mm", "addmm", "bmm")  # what max_autotune makes templates of
KERNEL_SUFFIX = ".best_config"


def machine_key(device: int, *, tuning_batch: int, graph: str = "") -> TuningKey:
    """This machine's facts (the GPU, torch, Triton, CUDA) with ``graph`` and the batch it is tuned at."""
    import torch

    from app.gpu.probe import gpu_identity

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu_name, capability = gpu_identity(device)
    return TuningKey(gpu_name, capability, torch.__version__, triton_version, str(torch.version.cuda), graph,
                     tuning_batch)


def graph_signature(program: Any) -> str:
    """sha256 of a traced graph's operators with their arguments' shapes, strides and dtypes
    (symbolic sizes as ``s``): what inductor tunes for, without the weights' values."""
    def render(value: Any) -> Any:
        meta = getattr(value, "meta", None)
        if meta is not None and hasattr(meta.get("val"), "shape"):
            val = meta["val"]
            return [[d if isinstance(d, int) else "s" for d in val.shape],
                    [d if isinstance(d, int) else "s" for d in val.stride()], str(val.dtype)]
        if isinstance(value, (list, tuple)):
            return [render(v) for v in value]
        return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)

    ops = [[str(node.target), render(list(node.args))] for node in program.graph.nodes if node.op == "call_function"]
    return hashlib.sha256(json.dumps(ops, sort_keys=True).encode()).hexdigest()


def distinct_tunings(program: Any) -> int:
    """How many operators a batch-invariant build tunes: the graph's distinct convolutions and
    matrix products (inductor tunes each shape once)."""
    seen = set()
    for node in program.graph.nodes:
        target = str(node.target)  # "aten.conv2d.default"
        if node.op == "call_function" and target.split(".")[1:2] and target.split(".")[1] in TUNED_OPS:
            seen.add((target, repr([getattr(a, "meta", {}).get("val", a) for a in node.args])))
    return len(seen)


def local_table_path(inductor_dir: Path) -> Path:
    """Inductor's autotuning table for this GPU and software under ``inductor_dir``."""
    from torch._inductor.codecache import CacheBase

    return Path(inductor_dir) / "cache" / CacheBase.get_system()["hash"]


def seed(cache: TuningCache, inductor_dir: Path) -> int:
    """Put ``cache``'s records into ``inductor_dir`` where inductor looks for them (records already
    there stay: they were measured on this machine). Returns how many kernels' settings it wrote."""
    table_path = local_table_path(inductor_dir)
    table = _read_table(table_path)
    _write_text(table_path, json.dumps({"system": _system(), "cache": _merged(table, cache.templates)}))
    written = 0
    for rel, settings in cache.kernels.items():
        target = _inside(inductor_dir, rel)
        if target is not None and not target.exists():
            _write_text(target, json.dumps(settings))
            written += 1
    return written


def collect(inductor_dir: Path, key: TuningKey) -> TuningCache:
    """What ``inductor_dir`` holds of tunings for ``key``'s machine, as a tuning cache."""
    inductor_dir = Path(inductor_dir)
    templates = _read_table(local_table_path(inductor_dir))
    kernels = {}
    for path in sorted(inductor_dir.rglob(f"*{KERNEL_SUFFIX}")):
        try:
            kernels[path.relative_to(inductor_dir).as_posix()] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a record inductor was still writing: it is rebuilt by a later tuning
    tunings = sum(len(shapes) for shapes in templates.values() if isinstance(shapes, dict))
    return TuningCache(key, templates, kernels, tunings, now_iso())


@dataclass
class TuningCount:
    """The tunings inductor reported so far, to say what is left (``tuned``)."""

    expected: int
    per_tuning_s: float
    say: Say
    started: float = field(default_factory=time.perf_counter)
    done: int = 0
    seen: set[str] = field(default_factory=set)
    first_at: float = 0.0  # when the first tuning ended: the pace is measured from there (before it, tracing)

    def __call__(self, timings: Any, name: Any, input_nodes: Any, *rest: Any) -> None:
        with contextlib.suppress(Exception):  # a progress line must never fail the compile
            self._count(name, input_nodes)

    def _count(self, name: Any, input_nodes: Any) -> None:
        sizes = []
        for node in input_nodes or ():
            with contextlib.suppress(Exception):
                sizes.append(str(node.get_size()))
        signature = f"{name}:{sizes}"
        if signature in self.seen:
            return
        self.seen.add(signature)
        self.done += 1
        now = time.perf_counter()
        spent = now - self.started
        if self.done == 1:
            self.first_at = now
        pace = (now - self.first_at) / (self.done - 1) if self.done > 2 else self.per_tuning_s
        left = max(self.expected - self.done, 0) * pace
        self.say(f"tuning kernels: {self.done} of about {self.expected} ({spent:.0f} s; {say_duration(left)} left)")


@dataclass(frozen=True)
class TuningReport:
    """How a build's tuning went, for its manifest and its results row."""

    cache: str  # the tuning cache's path
    tuning_cache: str  # "hit" (read, it fitted) | "none" (no file) | "other" (a file that did not fit)
    tunings: int  # operators inductor reported tuning (a hit reports them too, at no cost)
    tuning_s: float  # the compile's time, tunings included
    candidates_generated: int = 0  # tiled candidates the generators offered (app.builder.narrowed_choices)
    candidates_kept: int = 0  # of those, the ones generated: fewer where the cache held the best ones
    narrowed_by: str = ""  # whose tiles narrowed the candidates: "tuning cache", "compute capability 9.0", or ""


@contextlib.contextmanager
def tuned(program: Any, device: int, cache_path: Path, say: Say, *, tuning_batch: int) -> Iterator[dict[str, Any]]:
    """The compile inside this block (of ``program``, traced at ``tuning_batch``, the size inductor
    tunes for) reads ``cache_path`` where it fits, reports its progress,
    and (when the block succeeds) writes its tunings back to ``cache_path``. Yields a dict that
    holds the ``TuningReport`` (``["report"]``) once the block is done."""
    from torch._inductor import select_algorithm
    from torch._inductor.codecache import CacheBase

    inductor_dir = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])  # set by the build (torch_build._inductor_cache)
    with contextlib.suppress(AttributeError):
        CacheBase.get_local_cache_path.cache_clear()  # it remembers the folder of an earlier build
    key = machine_key(device, tuning_batch=tuning_batch, graph=graph_signature(program))
    expected = distinct_tunings(program)
    try:
        found = read_tuning_cache(cache_path)
    except ArtifactError as exc:
        say(f"tuning cache not read: {exc.message}")
        found = None
    status = "none" if found is None else ("other" if found.key.mismatch(key) else "hit")
    if status == "hit":
        try:
            seed(found, inductor_dir)
            say(f"tuning cache {cache_path}: {found.tunings} tunings of {found.key.gpu_name} read")
        except OSError as exc:  # the build goes on, tuning what it must
            say(f"tuning cache {cache_path} not read: {exc}")
            status = "other"
    elif status == "other":
        say(f"tuning cache {cache_path} not read: " + "; ".join(found.key.mismatch(key)))
    narrow_by, narrowed_by = _narrowing(found, status, key)
    per_tuning = seconds_per_tuning(key.gpu_name, narrowed=bool(narrow_by))
    if status != "hit":
        say(f"tuning about {expected} kernels{_over(narrowed_by)} ({say_duration(per_tuning * expected)}; the tunings "
            f"are saved to {cache_path} for later builds)")
    count = TuningCount(expected, per_tuning, say if status != "hit" else (lambda text: None))
    best = BestTiles()
    holder: dict[str, Any] = {}
    select_algorithm.add_feedback_saver(count)
    select_algorithm.add_feedback_saver(best)
    started = time.perf_counter()
    try:
        with narrowed_candidates(narrow_by) as narrowing:
            yield holder
    finally:
        _remove_saver(select_algorithm, count)
        _remove_saver(select_algorithm, best)
    written = replace(collect(inductor_dir, key), best_tiles=best.tiles)
    if status == "hit":  # keep what was read and not needed this time
        written = replace(written, templates=_merged(written.templates, found.templates),
                          kernels={**found.kernels, **written.kernels},
                          best_tiles=merged_tiles(best.tiles, found.best_tiles))
    try:
        write_tuning_cache(cache_path, written)
    except (OSError, ArtifactError) as exc:  # the package is built: a cache not written costs a later build time
        say(f"tuning cache {cache_path} not written: {exc}")
    holder["report"] = TuningReport(str(cache_path), status, count.done, round(time.perf_counter() - started, 1),
                                    narrowing.generated, narrowing.kept, narrowed_by)


def _narrowing(found: TuningCache | None, status: str, key: TuningKey) -> tuple[dict[str, Any], str]:
    """The tiles the build's candidates are narrowed to, and whose they are: a fitting cache's own;
    else those that won on this compute capability (the package's, and those of a cache from
    another card of it), timed again here; else none (every candidate)."""
    if status == "hit":
        return found.best_tiles, "tuning cache" if found.best_tiles else ""
    kin = found.best_tiles if found is not None and found.key.compute_capability == key.compute_capability else {}
    tiles = merged_tiles(kin, architecture_tiles(key.compute_capability))
    return tiles, f"compute capability {key.compute_capability}" if tiles else ""


def _over(narrowed_by: str) -> str:
    """What a first build's tunings are narrowed to, as its lines say it ("" for every candidate)."""
    return f" over the tile settings that won on {narrowed_by}" if narrowed_by else ""


def _remove_saver(select_algorithm: Any, saver: Any) -> None:
    get_cache = getattr(select_algorithm, "get_algorithm_selector_cache", None)
    cache = get_cache() if get_cache is not None else getattr(select_algorithm, "_ALGORITHM_SELECTOR_CACHE", None)
    savers = getattr(cache, "feedback_saver_fns", None)
    if isinstance(savers, list) and saver in savers:
        savers.remove(saver)
    elif hasattr(select_algorithm, "clear_feedback_savers"):
        select_algorithm.clear_feedback_savers()


def _system() -> Any:
    from torch._inductor.codecache import CacheBase

    return CacheBase.get_system()


def _read_table(path: Path) -> dict[str, Any]:
    try:
        table = json.loads(Path(path).read_text()).get("cache", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return table if isinstance(table, dict) else {}


def _merged(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """``mine`` with what only ``theirs`` has added, nested tables merged the same way."""
    merged = dict(mine)
    for name, value in theirs.items():
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = _merged(merged[name], value)
        elif name not in merged:
            merged[name] = value
    return merged


def _inside(folder: Path, rel: str) -> Path | None:
    """``folder/rel`` for a kernel record's relative path, or None for any other path (a cache is
    a file from elsewhere: it writes nothing outside inductor's folder, and nothing but records)."""
    parts = Path(rel).parts
    if not rel.endswith(KERNEL_SUFFIX) or Path(rel).is_absolute() or ".." in parts or not parts:
        return None
    return Path(folder) / Path(*parts)


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text.encode())


def expected_build_s(cache_path: Path, gpu_name: str, *, batch_invariant: bool, tuning_batch: int,
                     device: int = 0) -> tuple[float, str]:
    """A torch-cuda build's likely time before it starts, and why: no tuning where a tuning
    cache from this GPU and software, tuned at ``tuning_batch``, is at hand (its graph is known
    only once traced)."""
    from app.artifacts.tuning_cache import TYPICAL_TUNINGS, build_estimate_s

    if not batch_invariant:
        return build_estimate_s(gpu_name, tunings=0, batch_invariant=False), "cuDNN's kernels, not tuned"
    try:
        found = read_tuning_cache(cache_path)
    except ArtifactError:
        found = None
    here = machine_key(device, tuning_batch=tuning_batch)
    if found is not None and not replace(found.key, graph="").mismatch(here):
        return build_estimate_s(gpu_name, tunings=0), f"the tunings read from {cache_path}"
    tiles, narrowed_by = _narrowing(None, "none", here)
    return (build_estimate_s(gpu_name, tunings=TYPICAL_TUNINGS, narrowed=bool(tiles)),
            f"a first build tunes about {TYPICAL_TUNINGS} kernels{_over(narrowed_by)}")
