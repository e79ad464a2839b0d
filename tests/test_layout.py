"""The package's shape as ARCHITECTURE.md draws it: no import cycle, the pipeline never imports the
developer tools, and no grab-bag module."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: str) -> set[str]:
    """Every module of ``package`` that ``path`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            # `from hetflow.tasks import train` imports the module hetflow.tasks.train
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name == package or name.startswith(f"{package}.")}


def _graph(package: str) -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in (REPO / package).rglob("*.py")}
    return {name: _imports(path, package) & modules.keys() - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a package imports its parent's __init__ implicitly: ignored)."""
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = "open"
        for imported in sorted(graph[node]):
            if state.get(imported) == "open":
                return trail[trail.index(imported) :] + [imported]
            if imported not in state and (found := visit(imported, [*trail, imported])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_pipeline_package_has_no_import_cycle():
    graph = _graph("hetflow")
    assert {
        "hetflow.tasks.train",
        "hetflow.replica.sync",
        "hetflow.cluster.local",
    } <= graph.keys()  # the walk found the tree
    assert _cycle(graph) is None, _cycle(graph)


def test_a_cycle_is_found_where_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_nothing_in_the_pipeline_imports_the_developer_tools():
    for path in [*(REPO / "hetflow").rglob("*.py"), *(REPO / "dags").glob("*.py"), *(REPO / "plugins").glob("*.py")]:
        assert not _imports(path, "devstack"), path


def test_no_module_is_a_grab_bag():
    names = {path.stem for path in [*(REPO / "hetflow").rglob("*.py"), *(REPO / "devstack").rglob("*.py")]}
    assert not names & {"common", "utils", "helpers"}
