"""The shape the code keeps (docs/architecture.md): short modules, no import cycle, and
aiohttp only in the HTTP layer, so the gate and everything below it run without a
socket (`kvgate simulate` drives the same gate in virtual time).

Read from the sources with `ast`, not by importing them: an import made only for type
checking (`if TYPE_CHECKING:`) is left out, as Python leaves it out at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proxy", "policies")
MAX_LINES = 500
MAX_SERVER_LINES = 400
# The HTTP layer: the server, its admin views, the forwarder and the upstream client,
# the wire protocol helpers, and the simulated engine's own HTTP server.
HTTP_LAYER = frozenset({"proxy.server", "proxy.admin", "proxy.forward", "proxy.protocol",
                        "proxy.upstream", "proxy.sim.server"})


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def run_time_imports(path: Path, name: str) -> set[str]:
    """Modules `path` imports when it runs (absolute names, relative ones resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                out.add(base)
                out.update(f"{base}.{alias.name}" for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    visit(inner)
                elif isinstance(inner, list):
                    for handler in inner:
                        if isinstance(handler, ast.ExceptHandler):
                            visit(handler.body)

    visit(tree.body)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {m for m in run_time_imports(path, name) if m in known and m != name}
            for name, path in known.items()}


def test_no_module_over_500_lines_and_the_server_at_most_400() -> None:
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines())
             for name, path in modules().items()}
    assert sizes["proxy.server"] <= MAX_SERVER_LINES, sizes["proxy.server"]
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert over == {}


def test_no_import_cycle() -> None:
    graph = import_graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    assert cycles == []
    assert "proxy.demand" in graph["proxy.gate"]  # the graph reads what it should


def test_aiohttp_only_in_the_http_layer() -> None:
    importers = {name for name, path in modules().items()
                 if any(m == "aiohttp" or m.startswith("aiohttp.")
                        for m in run_time_imports(path, name))}
    assert importers <= HTTP_LAYER, sorted(importers - HTTP_LAYER)
    assert "proxy.server" in importers  # the check reads what it should


def test_the_gate_reaches_no_http_module() -> None:
    """Nothing the gate imports, however indirectly, is in the HTTP layer."""
    graph = import_graph()
    seen: set[str] = set()
    todo = ["proxy.gate", "proxy.replay"]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(graph[node])
    assert "proxy.admission" in seen and "proxy.demand" in seen
    assert seen & HTTP_LAYER == set()
