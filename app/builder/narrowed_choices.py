"""The candidates a build from a tuning cache generates (build time only): each tuned operator's
fastest, not all of them.

Inductor lowers each convolution and matrix product of a batch-invariant build by generating
every candidate Triton template for it (17 tile settings for a convolution on torch 2.11, more
for a matrix product), rendering and loading each one to key it, and only then looks their
times up in its autotuning table. From a tuning cache that lookup finds every time, so nothing
is compiled or timed, but every candidate is still generated: most of the lowering's 8.6-9.2 s
in the H100 build probe (bench/results/2026-12-06-nvidia-h100-build-probe.json).

So a build records, for each operator it tunes or looks up, the tile settings of its two
fastest templates (``BestTiles``, one of inductor's feedback functions), keyed by what inductor's
candidate generators are given: a convolution's output and input channels
(``InductorChoices.get_conv_configs``), a matrix product's name and input shapes
(``InductorChoices._finalize_template_configs``, inductor's hook for narrowing candidates before
they are generated). A later build from that cache generates, for an operator whose key is
recorded, only the templates with recorded settings, and every candidate that is not a tiled
template (``narrowed_candidates``). Each operator's candidates are then a subset of its full set,
whose times are all in the table (the cache fits only the graph it was made for), and the subset
holds the fastest: inductor picks it as before. Two, not one, so that the operator still takes
inductor's path for several candidates (one candidate skips the table and the epilogue-fusion
benchmark, so its fusions could differ). A key not recorded, no recorded setting generated, or a
torch without the hooks: the full set, as without a record.

A first build, with no cache of its own, is narrowed the same way by the tiles that won on cards
of its compute capability (``architecture_tiles``: the best tiles of the caches committed under
bench/tuning/, merged per compute capability into the package's ``architecture_tiles.json`` by
tools/architecture_tiles.py). It still times its candidates on its own card, but only those:
inductor compiles and times every candidate of every operator otherwise, most of a first build's
minutes (bench/results/2026-12-05-nvidia-h100-build-times.json: 338 of 462 s). Where the card's
winner is not among them, the build takes the fastest of them; a key the caches lack gets every
candidate.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.artifacts.tuning_cache import are_tiles

if TYPE_CHECKING:
    from app.artifacts.tuning_cache import TuningCache

KEPT_PER_OPERATOR = 2  # see the module docstring
TILE_NAMES = ("BLOCK_M", "BLOCK_K", "BLOCK_N")  # the order of inductor's ``tile_shape``
Tiles = dict[str, list[dict[str, int]]]  # an operator's key → tile settings
ARCHITECTURE_TILES = Path(__file__).with_name("architecture_tiles.json")  # written by tools/architecture_tiles.py


def conv_key(out_channels: Any, in_channels: Any) -> str:
    return f"convolution:{int(out_channels)}x{int(in_channels)}"


def product_key(name: str, nodes: Any) -> str:
    """A matrix product's key: its name and its inputs' sizes (a symbolic size as "s")."""
    sizes = [[int(d) if getattr(d, "is_number", True) else "s" for d in node.get_size()] for node in nodes]
    return f"{name}:{json.dumps(sizes, separators=(',', ':'))}"


def operator_key(name: str, input_nodes: Any) -> str:
    if name == "convolution":
        out_channels, in_channels = input_nodes[1].get_size()[:2]  # the weight: [out, in / groups, kh, kw]
        return conv_key(out_channels, in_channels)
    return product_key(name, input_nodes)


def template_tile(choice: Any) -> dict[str, int] | None:
    """A Triton template candidate's tile settings as inductor logs them; None for any other
    candidate (an external kernel)."""
    info = getattr(choice, "log_info", None)
    if not isinstance(info, dict) or "tile_shape" not in info:
        return None
    try:
        tile = ast.literal_eval(str(info["tile_shape"]))
        settings = dict(zip(TILE_NAMES, (int(x) for x in tile), strict=True))
        return {**settings, "num_stages": int(info["num_stages"]), "num_warps": int(info["num_warps"])}
    except (ValueError, TypeError, KeyError, SyntaxError):
        return None


class BestTiles:
    """One of inductor's feedback functions (``select_algorithm.add_feedback_saver``): the tile
    settings of each tuned operator's ``KEPT_PER_OPERATOR`` fastest templates, by its key
    (``tiles``)."""

    def __init__(self) -> None:
        self.tiles: Tiles = {}

    def __call__(self, timings: Any, name: Any, input_nodes: Any, *rest: Any) -> None:
        with contextlib.suppress(Exception):  # a record must never fail the compile
            self._record(timings, str(name), input_nodes)

    def _record(self, timings: dict[Any, float], name: str, input_nodes: Any) -> None:
        timed = sorted(((t, tile) for c, t in timings.items() if not math.isnan(t) and (tile := template_tile(c)) is not None),
                       key=lambda pair: pair[0])
        if not timed:
            return
        known = self.tiles.setdefault(operator_key(name, input_nodes), [])
        for _, tile in timed[:KEPT_PER_OPERATOR]:
            if tile not in known:
                known.append(tile)


def merged_tiles(mine: Tiles, theirs: Tiles) -> Tiles:
    """``mine`` with ``theirs`` added where not already there."""
    merged = {key: list(tiles) for key, tiles in mine.items()}
    for key, tiles in theirs.items():
        known = merged.setdefault(key, [])
        known.extend(tile for tile in tiles if tile not in known)
    return merged


def tiles_by_architecture(caches: Iterable[TuningCache]) -> dict[str, Any]:
    """The best tiles of ``caches`` merged per compute capability, with the cards and software that
    tuned them: the content of ``ARCHITECTURE_TILES``."""
    architectures: dict[str, Any] = {}
    for cache in caches:
        if not cache.best_tiles:
            continue
        entry = architectures.setdefault(cache.key.compute_capability, {"from": [], "tiles": {}})
        entry["from"].append(f"{cache.key.gpu_name}, torch {cache.key.torch_version}, "
                             f"Triton {cache.key.triton_version}")
        entry["tiles"] = merged_tiles(entry["tiles"], cache.best_tiles)
    return {"kind": "yolopipe architecture tiles", "architectures": architectures}


def architecture_tiles(compute_capability: str, path: Path = ARCHITECTURE_TILES) -> Tiles:
    """The tiles that won on cards of ``compute_capability`` (``"9.0"``), as the package ships
    them; {} for a compute capability not measured, or a file that is not one."""
    try:
        tiles = json.loads(Path(path).read_text())["architectures"][compute_capability]["tiles"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return tiles if are_tiles(tiles) else {}


def is_recorded(settings: dict[str, Any], recorded: list[dict[str, int]]) -> bool:
    """Whether a generator's settings (a template's keyword arguments, or a ``triton.Config``'s
    kwargs with its stages and warps) are a recorded tile; a convolution's template caps the
    warps at 4 unless its tile is unrolled (conv.py), and records them capped."""
    tile = {**{name: int(settings[name]) for name in TILE_NAMES},
            "num_stages": int(settings["num_stages"]), "num_warps": int(settings["num_warps"])}
    return tile in recorded or {**tile, "num_warps": min(tile["num_warps"], 4)} in recorded


@dataclass
class Narrowing:
    """What ``narrowed_candidates`` did: tiled candidates generated in all, and those kept."""

    active: bool = False  # False: nothing recorded, or choices customised elsewhere: every candidate generated
    generated: int = 0
    kept: int = 0

    def keep(self, every: list[Any], settings: Any, recorded: list[dict[str, int]] | None) -> list[Any]:
        """``every`` candidate with a recorded tile and every one without a tile; all of them
        when none is recorded. ``settings(candidate)``: its settings, None where it has no tile."""
        pairs = [(c, settings(c)) for c in every]
        tiled = [c for c, s in pairs if s is not None]
        chosen = {id(c) for c, s in pairs if s is not None and recorded and is_recorded(s, recorded)}
        if not chosen:  # nothing recorded for it (another shape), or none generated: all of them
            chosen = {id(c) for c in tiled}
        self.generated += len(tiled)
        self.kept += len(chosen)
        return [c for c, s in pairs if s is None or id(c) in chosen]


def _config_settings(config: Any) -> dict[str, Any]:
    return {**config.kwargs, "num_stages": config.num_stages, "num_warps": config.num_warps}


def _ktc_settings(choice: Any) -> dict[str, Any] | None:
    kwargs = choice.params.to_kwargs()
    return kwargs if all(name in kwargs for name in (*TILE_NAMES, "num_stages", "num_warps")) else None


@contextlib.contextmanager
def narrowed_candidates(tiles: Tiles) -> Iterator[Narrowing]:
    """Inside this block (in this thread, where inductor lowers), an operator whose key is in
    ``tiles`` gets only the recorded tiled templates generated, beside its untiled candidates
    (module docstring). Yields the count of what was generated and kept."""
    narrowing = Narrowing()
    try:
        from torch._inductor.choices import InductorChoices
        from torch._inductor.virtualized import V
    except ImportError:
        yield narrowing
        return
    if not tiles or type(V.choices) is not InductorChoices:
        yield narrowing  # nothing recorded, or choices someone else customised
        return

    class NarrowedChoices(InductorChoices):
        def get_conv_configs(self, *args: Any, **kwargs: Any) -> Any:
            every_config = super().get_conv_configs(*args, **kwargs)

            def configs(m: Any, n: Any, k: Any, *rest: Any, **options: Any) -> Iterator[Any]:
                every = list(every_config(m, n, k, *rest, **options))
                try:
                    return iter(narrowing.keep(every, _config_settings, tiles.get(conv_key(n, k))))
                except (AttributeError, KeyError, TypeError, ValueError):  # settings this module does not know
                    return iter(every)

            return configs

        def _finalize_template_configs(self, template_choices: Any, kernel_inputs: Any, templates: Any,
                                       op_name: str, *args: Any, **kwargs: Any) -> Any:
            every = super()._finalize_template_configs(template_choices, kernel_inputs, templates, op_name,
                                                        *args, **kwargs)
            try:
                recorded = tiles.get(product_key(op_name, kernel_inputs.nodes()))
                return narrowing.keep(list(every), _ktc_settings, recorded)
            except (AttributeError, KeyError, TypeError, ValueError):  # as above: all of them
                return every

    narrowing.active = True
    with V.set_choices_handler(NarrowedChoices()):
        yield narrowing
