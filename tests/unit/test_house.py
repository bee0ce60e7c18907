"""The house rules of ``service/`` that a linter does not check (docs/architecture.md, "Layers"):
no import circle among its modules (imports under ``TYPE_CHECKING`` included), no function over
80 lines, one request path to the API server (the generated API classes of ``kubernetes_asyncio``
unused: it loads the configuration only), and the transient failures caught in at most two
places."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[2] / "service"
LONGEST_FUNCTION = 80
KUBERNETES_ASYNCIO_ALLOWED = (
    "kubernetes_asyncio.config",
    "kubernetes_asyncio.client.configuration",
)


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(SERVICE.rglob("*.py")):
        parts = path.relative_to(SERVICE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The absolute names an import statement of module ``name`` refers to (a module, or a name
    in one)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = name.split(".")
        if MODULES[name].name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    for alias in node.names:
        qualified = f"{base}.{alias.name}"
        yield qualified if qualified in MODULES else base


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``service`` modules it imports, at any depth of its body."""
    graph: dict[str, set[str]] = {}
    for name, tree in TREES.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges.update(t for t in _imported(name, node) if t in MODULES and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_service_modules() -> None:
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle_through_type_checking_imports() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from service.b import B\n"
    )
    edges = {t for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for t in _imported("x", n)}
    assert "service.b" in edges
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_in_service_is_longer_than_80_lines() -> None:
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]
    assert long == []


def test_kubernetes_asyncio_is_used_only_to_load_the_configuration() -> None:
    used = {
        f"{name}: {target}"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for target in _imported(name, node)
        if target.startswith("kubernetes_asyncio")
        and not target.startswith(KUBERNETES_ASYNCIO_ALLOWED)
        and target not in ("kubernetes_asyncio", "kubernetes_asyncio.client")
    }
    assert used == set()
    sources = {
        name: MODULES[name].read_text() for name in MODULES if name.startswith("service.kube")
    }
    assert [n for n, text in sources.items() if "_preload_content" in text or "cast(" in text] == []


def test_transient_failures_are_caught_in_at_most_two_places() -> None:
    places = [
        f"{name}:{node.lineno}"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ExceptHandler)
        and node.type is not None
        and "TRANSIENT_ERRORS" in ast.unparse(node.type)
    ]
    assert len(places) <= 2, places
