"""The packages stay layered: an AST scan of every module's imports (lazy ones inside functions
included) against the allowed directions, and no import cycle between packages; inside server/, its
parts import downward only (the table in ``kvroute/server/__init__.py``)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvroute"

# package -> packages it must not import (design: pure layers below, drivers and the CLI above)
FORBIDDEN = {
    "features": {"policies", "routing", "server", "sim", "commands", "emulator", "integrations"},
    "policies": {"features", "routing", "server", "sim", "commands", "emulator", "integrations"},
    "routing": {"server", "sim", "commands", "emulator", "integrations"},
    "engine": {"features", "policies", "routing", "server", "sim", "commands", "emulator"},
    "sim": {"server", "commands", "emulator", "integrations"},
    "server": {"commands", "sim"},
    # what every driver needs of a request and an engine: below the live router and the Ray router
    "prepare": {"server", "sim", "commands", "emulator", "integrations"},
    "integrations": {"server", "commands"},
}


def _package(module: str) -> str:
    """``kvroute.sim.runner`` → ``sim``; a top-level module (``kvroute.views``) is its own node."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = _module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from kvroute import sim`
    return {m for m in out if m == "kvroute" or m.startswith("kvroute.")}


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in SRC.rglob("*.py"):
        src = _package(_module_name(path))
        for mod in _imports(path):
            if mod == "kvroute":
                continue
            dst = _package(mod)
            if dst != src and (SRC / dst).is_dir():  # edges between subpackages
                edges[src].add(dst)
    return edges


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_above_it(package: str) -> None:
    bad = {}
    for path in (SRC / package).rglob("*.py"):
        hits = {m for m in _imports(path) if len(m.split(".")) > 1 and _package(m) in FORBIDDEN[package]}
        if hits:
            bad[str(path.relative_to(SRC))] = sorted(hits)
    assert not bad, bad


@pytest.mark.parametrize("package", ["features", "policies", "routing", "sim", "engine"])
def test_pure_layers_import_no_cli_or_exporter_code(package: str) -> None:
    banned = {"argparse", "prometheus_client", "aiohttp"}
    if package in ("features", "policies", "routing"):
        banned.add("yaml")  # the engine reads profile files, the simulator trace files
    for path in (SRC / package).rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not names & banned, path


def test_no_import_cycle_between_packages() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join([*path[path.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


# ---- inside server/ ----------------------------------------------------------------------------

SERVER = SRC / "server"

# part of server/ -> the parts of server/ it may import (its own part always)
SERVER_ALLOWED: dict[str, set[str]] = {
    "wire": set(),
    "config": set(),
    "state": {"wire", "config"},
    "sync": {"state", "wire", "config"},
    "observe": {"state", "wire", "config"},
    "stages": {"observe", "state", "wire", "config"},
    "pipeline": {"stages", "observe", "state", "wire", "config"},
    "app": {"pipeline", "stages", "observe", "sync", "state", "wire", "config"},
    "pd": {"stages", "observe", "sync", "state", "wire", "config"},
    # a front door over the same stages, fed by Envoy's ext_proc (it runs the router's app and loop)
    "extproc": {"app", "run", "pipeline", "stages", "observe", "sync", "state", "wire", "config", "cluster"},
    "cluster": {"config"},
    "run": {"app", "sync", "state", "wire", "config"},
    "workers": {"run", "app", "sync", "state", "wire", "config"},
}


def _part(module: str) -> str | None:
    """``kvroute.server.sync.fleet`` → ``sync``; ``kvroute.server.app`` → ``app``; None outside."""
    parts = module.split(".")
    if parts[:2] != ["kvroute", "server"] or len(parts) < 3:
        return None
    return parts[2]


def _modules() -> list[Path]:
    return [p for p in SERVER.rglob("*.py") if p != SERVER / "__init__.py"]


def test_every_part_of_server_is_in_its_table() -> None:
    """A new module or subpackage of server/ gets its place in the layering first."""
    parts = {p.relative_to(SERVER).parts[0].removesuffix(".py") for p in _modules()}
    assert parts == set(SERVER_ALLOWED), parts ^ set(SERVER_ALLOWED)


@pytest.mark.parametrize("part", sorted(SERVER_ALLOWED))
def test_server_part_imports_only_downward(part: str) -> None:
    bad = {}
    for path in _modules():
        if path.relative_to(SERVER).parts[0].removesuffix(".py") != part:
            continue
        hits = set()
        for mod in _imports(path):
            dst = _part(mod)
            if (
                dst is None
                or dst == part
                or (not (SERVER / dst).exists() and not (SERVER / f"{dst}.py").exists())
            ):
                continue  # outside server/, its own part, or a name imported from kvroute.server
            if dst not in SERVER_ALLOWED[part]:
                hits.add(mod)
        if hits:
            bad[str(path.relative_to(SRC))] = sorted(hits)
    assert not bad, bad


def test_server_table_has_no_cycle() -> None:
    """Downward means a strict order: no two parts may import each other, directly or not."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(SERVER_ALLOWED[node]):
            assert state.get(nxt) != 1, " -> ".join([*path, nxt])
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(SERVER_ALLOWED):
        if node not in state:
            visit(node, [node])


def test_server_stages_call_no_later_stage() -> None:
    """Within stages/ a later stage may use an earlier one's frozen types, never the reverse."""
    order = ["prepare", "decide", "forward", "settle"]
    for i, name in enumerate(order):
        later = {f"kvroute.server.stages.{n}" for n in order[i + 1 :]}
        hits = {m for m in _imports(SERVER / "stages" / f"{name}.py") if any(m.startswith(x) for x in later)}
        assert not hits, (name, sorted(hits))
