"""The shape of the packages: arrows run one way (demo → consumers → deltastream, never back,
and inside each package from a higher folder to a lower one, never up), no import cycle
between modules, no module reaches into another module's private names, no module is over
600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 600
PACKAGES = ("deltastream", "consumers", "demo")
# Which package may import which: the predictor side uses the torch-free shared contract of
# the trainer package (wire, errors, cliargs); the demo sits above both.
MAY_IMPORT = {"deltastream": {"deltastream"}, "consumers": {"consumers", "deltastream"},
              "demo": {"demo", "deltastream", "consumers"}}
# The one arrow up that the layout allows: `deltastream demo` loads the demo on use.
ALLOWED_UP = {("deltastream.cli", "demo.run")}
# Rooms (folders, and the top-level modules of a package), lowest first. A module may import
# modules of its own room or of a room listed before it, never one listed after it (an
# arrow up). A module belongs to the longest room name that is its name or a prefix of it;
# a package name alone (``consumers``) holds its ``__init__`` and any module not listed.
ROOMS = (
    # trainer side and the shared contract
    "deltastream.errors", "deltastream.types", "deltastream.kafka_config",
    "deltastream.kafka_compat", "deltastream.wire_codec", "deltastream.wire",
    "deltastream.cliargs", "deltastream.clilog", "deltastream.sharding",
    "deltastream.kernels", "deltastream.embedding", "deltastream.tracking",
    "deltastream.publishing", "deltastream.broker", "deltastream",
    # predictor side: durable files, then the serving table, then what stores and feeds it
    "consumers.errors", "consumers.cpus", "consumers.sched_policy", "consumers.files",
    "consumers.serving", "consumers.storage", "consumers.sequencing", "consumers.quarantine",
    "consumers.topic", "consumers.applier", "consumers.sync", "consumers.replay", "consumers",
    "demo",
)


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the three packages (packages by __init__.py)."""
    out = {}
    paths = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    for path in sorted(paths):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported project module, names taken from it) for every import statement in the
    module, at module level or inside functions (a lazy import still ties two modules)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base not in known:
                continue
            # `from pkg import submodule` ties to the submodule, not to the package
            subs = [a.name for a in node.names if f"{base}.{a.name}" in known]
            out += [(f"{base}.{s}", []) for s in subs]
            names = [a.name for a in node.names if a.name not in subs]
            if names:
                out.append((base, names))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: {m for m, _ in _imports(n, p, set(mods))} - {n} for n, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_the_imports():
    g = _graph()
    assert "consumers.files" in g["consumers.serving.table"]
    assert "consumers.serving.table" in g["consumers.storage.full_snapshot"]
    assert "consumers.sync.daemon" in g["consumers.sync"]
    assert "deltastream.wire" in g["consumers.applier"]
    assert "deltastream.tracking.recorder" in g["deltastream.tracking.tracker"]


def _room(name: str) -> str:
    """The room of module ``name`` (see ``ROOMS``)."""
    return max((r for r in ROOMS if name == r or name.startswith(r + ".")), key=len)


def test_rooms_see_the_layout():
    assert _room("consumers.serving.table") == "consumers.serving"
    assert _room("consumers") == "consumers"
    assert _room("deltastream.wire_codec") == "deltastream.wire_codec"
    assert ROOMS.index("consumers.storage") > ROOMS.index("consumers.serving")


def test_no_arrow_up_between_rooms():
    rank = {r: i for i, r in enumerate(ROOMS)}
    bad = sorted(f"{n} -> {m}" for n, deps in _graph().items() for m in deps
                 if rank[_room(m)] > rank[_room(n)] and (n, m) not in ALLOWED_UP)
    assert bad == []


def test_no_import_cycle_between_modules():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_arrows_run_one_way(package):
    bad = sorted(f"{n} -> {m}" for n, deps in _graph().items() if n.split(".")[0] == package
                 for m in deps if m.split(".")[0] not in MAY_IMPORT[package]
                 and (n, m) not in ALLOWED_UP)
    assert bad == []


def test_no_private_names_imported_across_modules():
    mods = _modules()
    bad = [f"{n}: from {m} import {x}" for n, p in mods.items()
           for m, names in _imports(n, p, set(mods)) for x in names
           if x.startswith("_") and not x.startswith("__")]
    assert bad == []


def test_no_module_over_600_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in _modules().items()}
    assert {n: k for n, k in long.items() if k > MAX_LINES} == {}
