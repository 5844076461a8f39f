"""The product packages import one way: no import circle between any two
modules, and no package imports one on a floor above it. Read from the
source (every import statement, those inside functions and under
TYPE_CHECKING included), so a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Floors, bottom first. A package may import its own modules and those of
# lower floors; the three services share a floor and never import each
# other (they talk over gRPC and HTTP).
FLOORS = [
    {"llmsched"},
    {"llmsched_kernels"},
    {"scheduler_svc", "executor_svc", "gateway_svc"},
    {"bench"},
    {"simulator"},
    {"devtools"},
]
FLOOR = {package: i for i, packages in enumerate(FLOORS) for package in packages}


def _modules() -> dict[str, Path]:
    modules = {}
    for package in FLOOR:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if "v1" in parts:  # the generated gRPC stubs
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the product modules it imports (the nearest known module
    for `from a.b import c`, which may name a module or a name in one)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        edges[name] = found
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


EDGES = _imports(_modules())


def test_the_graph_is_read_from_every_package():
    packages = {name.split(".")[0] for name in EDGES}
    assert packages == set(FLOOR), packages
    assert "scheduler_svc.core.request" in EDGES["scheduler_svc.core.scheduler"]  # a known import is seen


def test_no_import_circle_between_product_modules():
    circles = _circles(EDGES)
    assert not circles, "import circles (move the shared type to its owner):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_no_package_imports_one_above_it_or_beside_it():
    wrong = []
    for module, targets in EDGES.items():
        here = module.split(".")[0]
        for target in targets:
            there = target.split(".")[0]
            if there != here and FLOOR[there] >= FLOOR[here]:
                wrong.append(f"{module} imports {target} (floor {FLOOR[there]} from floor {FLOOR[here]})")
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(sorted(wrong))


def test_a_circle_and_an_upward_import_are_found():
    """The checks themselves, on a made-up graph."""
    assert _circles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}) == [["a.x", "a.y", "a.z"]]
    assert _circles({"a.x": {"a.y"}, "a.y": set()}) == []
