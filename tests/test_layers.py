"""Layers import downward only: no import cycle among `service`'s subpackages.

Every `import service.<sub>...` / `from service.<sub>... import` in `service/<pkg>/`, at the top of a
module or inside a function (a lazy import is a dependency all the same), is an edge pkg → sub;
imports under `if TYPE_CHECKING:` are annotations only and are left out. A cycle is a strongly
connected set of two or more subpackages.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[1] / "service"

# Cycles tolerated for now, each with where it runs; none today (the last two, spec <-> catalog and
# costmodel <-> plans, went when the catalog loaders moved to spec/entries.py and PlanTable to
# spec/plan_table.py). This list only shrinks: a new cycle fails the test, and so does one listed here
# that is gone (then delete its line).
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for n in ast.walk(node))
    return inside


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return []


def import_edges(root: Path = SERVICE) -> dict[tuple[str, str], list[str]]:
    """(importing subpackage, imported subpackage) → the `file:line`s where that happens."""
    subpackages = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    subpackages |= {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        source = parts[0].removesuffix(".py")
        if source == "__init__":  # service/__init__.py re-exports the public API: the top, not a layer
            continue
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            for name in _imported(node):
                parts_of = name.split(".")
                if parts_of[0] == "service" and len(parts_of) > 1 and parts_of[1] in subpackages:
                    target = parts_of[1]
                    if target != source:
                        where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
                        edges.setdefault((source, target), []).append(where)
    return edges


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[frozenset[str]]:
    """Strongly connected sets of two or more subpackages (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(cycle: frozenset[str], edges: dict[tuple[str, str], list[str]]) -> str:
    inside = [f"{a} -> {b} ({', '.join(w[:2])})" for (a, b), w in sorted(edges.items()) if {a, b} <= cycle]
    return "; ".join(inside)


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle() -> None:
    edges = {("a", "b"): ["x"], ("b", "c"): ["y"], ("c", "a"): ["z"], ("c", "d"): ["w"]}
    assert cycles(edges) == [frozenset({"a", "b", "c"})]
    assert cycles({("a", "b"): ["x"], ("b", "c"): ["y"]}) == []


def test_the_edges_are_read_from_the_source() -> None:
    edges = import_edges()
    assert ("design", "search") in edges and ("search", "spec") in edges  # top-level and lazy imports
    assert ("report", "design") not in edges  # the run's result schema lives in report (report/result.py)


def test_subpackages_import_each_other_without_cycles() -> None:
    edges = import_edges()
    found = set(cycles(edges))
    new = [f"{sorted(c)}: {_describe(c, edges)}" for c in found - set(KNOWN_CYCLES)]
    assert not new, "import cycles among service subpackages:\n" + "\n".join(new)
    gone = [sorted(c) for c in set(KNOWN_CYCLES) - found]
    assert not gone, f"these cycles are gone: delete them from KNOWN_CYCLES: {gone}"
