"""The package's import graph has no circle and keeps its layers: the routes (proxy/web) and the
app factory sit on top, the composition root (proxy/gateway.py) under them, and nothing below
imports either. Imports under `if TYPE_CHECKING:` count: a circle there is a circle in the design,
and the next change turns it into one at run time."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "proxy"

# Who may import a module of the top layers (by module name prefix).
LAYERS = {
    "proxy.web": ("proxy.web", "proxy.app", "proxy.cli"),
    "proxy.app": ("proxy.cli", "proxy.tools"),
    "proxy.cli": ("proxy.__main__", "proxy.entry"),
    "proxy.gateway": ("proxy.web", "proxy.app"),
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `path` imports, at any depth of its code (TYPE_CHECKING blocks and
    functions too). `from package import module` is an import of the module alone."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            names |= submodules
            if len(submodules) < len(node.names) and node.module in known:
                names.add(node.module)
    return names


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(path, known) - {name} for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> Iterator[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> Iterator[list[str]]:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                yield from visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                yield sorted(group)

    for node in sorted(edges):
        if node not in index:
            yield from visit(node)


def test_the_graph_is_read() -> None:
    edges = graph()
    assert "proxy.pipeline" in edges["proxy.gateway"]
    assert "proxy.context" in edges["proxy.stages.budget"]


def test_no_module_imports_itself_round_a_circle() -> None:
    edges = graph()
    found = list(circles(edges))
    described = [
        " -> ".join(f"{m} (imports {sorted(edges[m] & set(group))})" for m in group)
        for group in found
    ]
    assert found == [], "import circles:\n" + "\n".join(described)


def test_a_circle_would_be_found() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert list(circles(edges)) == [["a", "b", "c"]]


def test_the_top_layers_are_imported_only_from_above() -> None:
    wrong = [
        f"{importer} imports {target}"
        for importer, targets in graph().items()
        for target in targets
        for layer, allowed in LAYERS.items()
        if (target == layer or target.startswith(layer + "."))
        and not (importer == layer or importer.startswith(layer + "."))
        and not any(importer == a or importer.startswith(a + ".") for a in allowed)
    ]
    assert wrong == []
