"""The parts of ``app/`` (each top-level package or module) import one another in one
direction only: no cycle between parts, and each part only imports parts below it in
``LAYERS`` (the README's "Layout" lists them bottom up). Read from the source; lazy imports count.
Beside the package, ``tests/`` and ``bench/`` import nothing from each other (either may run a
script of the other, never import it)."""

from __future__ import annotations

import ast
from pathlib import Path

import app

APP = Path(app.__file__).parent

# Top to bottom; parts on one line are peers and must not import each other in a circle.
LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("service",),
    ("api", "distributed", "benchmark"),
    ("runtime", "predict"),  # predict: the front ends over the core (folder, video, streams)
    ("pipeline",),
    ("builder",),
    ("backends",),
    ("gpu",),
    ("ipc",),  # transport only: below every part that holds a model, a pipeline or a device
    ("weights", "bytecode"),  # bytecode: where the command's imports keep theirs (its cache folder)
    ("artifacts", "boxes", "records"),
    ("contracts", "engine_contracts", "files"),
    ("imaging",),
    ("types", "versions", "source_urls", "heap"),
    ("settings",),  # the service's typed settings (pydantic), over the vocabulary
    ("config",),
    ("errors",),
]
RANK = {part: depth for depth, parts in enumerate(LAYERS) for part in parts}
MODEL_PARTS = ("runtime", "pipeline", "backends", "gpu")  # what opens, runs or holds a model


def part_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "app" and len(parts) > 1 else None


def edges(root: Path = APP) -> dict[str, set[str]]:
    """part → the parts its modules import (at any depth of the code)."""
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        src = part_of(".".join(rel.parts).removesuffix(".__init__"))
        if src is None:
            continue
        found = graph.setdefault(src, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "app" else [])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                dst = part_of(name)
                if dst is not None and dst != src:
                    found.add(dst)
    return graph


def test_every_part_has_a_layer():
    assert sorted(set(edges()) - set(RANK)) == []


def test_imports_only_run_down():
    upward = sorted((src, dst) for src, dsts in edges().items() for dst in dsts if RANK[dst] <= RANK[src])
    assert upward == [], f"imports that run up or sideways (importer, imported): {upward}"


def test_ipc_is_transport_only():
    """The wire format, the rings, the layout and the clients import no part that holds a model:
    ipc ranks below them all, and none of its modules imports one (lazily or not)."""
    assert all(RANK["ipc"] > RANK[part] for part in MODEL_PARTS)
    assert edges()["ipc"].isdisjoint(MODEL_PARTS), edges()["ipc"]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def test_no_cycle_between_parts():
    cycle = find_cycle(edges())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_check_sees_a_cycle(tmp_path):
    """The walk above is not vacuous: two parts importing each other, one lazily, are found."""
    fake = tmp_path / "app"
    (fake / "a").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "a" / "__init__.py").write_text("from app.b import x\n")
    (fake / "b.py").write_text("def f():\n    from app.a import y\n")
    graph = edges(fake)
    assert graph == {"a": {"b"}, "b": {"a"}}
    assert find_cycle(graph) == ["a", "b", "a"]


def top_imports(root: Path) -> set[tuple[str, str]]:
    """(file, top-level module) of every absolute import under ``root``, lazy ones included."""
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((path.relative_to(root.parent).as_posix(), node.module.split(".")[0]))
            elif isinstance(node, ast.Import):
                found.update((path.relative_to(root.parent).as_posix(), a.name.split(".")[0]) for a in node.names)
    return found


def test_tests_and_bench_import_nothing_from_each_other():
    root = APP.parent
    crossing = sorted(f"{path} imports {top}" for one, other in (("tests", "bench"), ("bench", "tests"))
                      for path, top in top_imports(root / one) if top == other)
    assert crossing == []


def test_the_check_sees_a_crossing(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import os\n\ndef f():\n    from bench.tool import y\n")
    assert top_imports(tmp_path / "tests") == {("tests/test_x.py", "os"), ("tests/test_x.py", "bench")}
