"""The benchmark suites are the ``cachedrag-bench`` distribution (``benchmarks/``), apart from the runtime
package: same version as cachedrag, no ``__init__.py`` at the top-level folder, no import cycle inside
``cachedrag_bench``, and no runtime module (nor the main wheel's package list) reaching into it."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

import cachedrag
import cachedrag_bench

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
PACKAGE = BENCH / "cachedrag_bench"
# the runtime's code: the package and the folders mapped into it (pyproject's package-dir)
RUNTIME = [ROOT / "cachedrag", ROOT / "integrations", ROOT / "pipelines", ROOT / "kernels"]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (a function-level import counts)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_installed_from_the_benchmarks_folder_with_cachedrags_version():
    assert importlib.metadata.version("cachedrag-bench") == cachedrag.__version__
    assert f"cachedrag=={cachedrag.__version__}" in importlib.metadata.requires("cachedrag-bench")
    assert f'version = "{cachedrag.__version__}"' in (BENCH / "pyproject.toml").read_text()
    assert Path(cachedrag_bench.__file__).parent == PACKAGE
    assert not (BENCH / "__init__.py").exists()  # a namespace candidate at most (tests/test_layout.py)


def test_the_main_package_ships_no_benchmark():
    """Its package list names none (``make wheel-check`` lists the built wheel's files too)."""
    assert "bench" not in (ROOT / "pyproject.toml").read_text().split("packages = [")[1].split("]")[0]
    assert not (ROOT / "cachedrag" / "bench").exists()


def test_runtime_code_never_imports_the_benchmarks():
    offenders = []
    for folder in RUNTIME:
        for path in folder.rglob("*.py"):
            if path == ROOT / "cachedrag" / "cli.py":  # names the suite modules, imported when one runs
                continue
            names = _imports(path)
            if any(n == "cachedrag_bench" or n.startswith(("cachedrag_bench.", "cachedrag.bench")) for n in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def _graph() -> dict[str, set[str]]:
    modules = {f"cachedrag_bench.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules["cachedrag_bench"] = PACKAGE / "__init__.py"
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle_inside_the_benchmarks():
    graph = _graph()
    assert "cachedrag_bench.retrieval" in graph and "cachedrag_bench.rewrite" in graph["cachedrag_bench.retrieval"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
])
def test_the_cycle_finder(graph, cycle):
    assert _cycle(graph) == cycle
