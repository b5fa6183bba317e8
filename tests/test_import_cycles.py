"""No import cycle between the modules of the installed ``cachedrag`` package.

Every module's source (``cachedrag`` and its subpackages, ``cachedrag.integrations`` /
``.pipelines`` / ``.kernels`` included: found through the package's ``__path__`` and
``importlib.util.find_spec``, never by importing them) is parsed with ``ast``; every import counts,
at module level and inside functions alike (a deferred import is still a dependency). An edge
``a -> b`` means ``a`` imports ``b``: ``import x.y.z`` imports the deepest of ``x.y.z``, ``x.y``,
``x`` that is a cachedrag module; ``from x import n`` imports ``x.n`` when that is a module, else
``x``; relative imports are resolved against the importing module. Cycles are the strongly
connected components of more than one module (Tarjan). Torch-free: nothing but ``cachedrag``'s
own ``__init__`` is imported.

``KNOWN_CYCLES`` lists the cycles still being removed; the test fails on any cycle not in it, and on
an entry that no longer exists, so the list only shrinks.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import subprocess
import sys
from pathlib import Path

import cachedrag

ROOT = "cachedrag"

# Each entry: the exact set of modules of one strongly connected component.
KNOWN_CYCLES: list[frozenset[str]] = [
]


def _package_dir(name: str) -> list[str]:
    """The folders of the package ``name``: ``cachedrag``'s ``__path__``; for a subpackage, its
    ``find_spec`` (which imports only its parent: called for ``cachedrag``'s children alone, whose
    parent is the light top-level package)."""
    if name == ROOT:
        return list(cachedrag.__path__)
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations or []) if spec else []


def _walk(name: str, dirs: list[str], files: dict[str, Path]) -> None:
    """Record ``name``'s ``__init__`` and every module under ``dirs`` (recursively)."""
    for folder in dirs:
        init = Path(folder) / "__init__.py"
        if init.exists():
            files[name] = init
        for info in pkgutil.iter_modules([folder]):
            child = f"{name}.{info.name}"
            if info.ispkg:
                _walk(child, [str(Path(folder) / info.name)], files)
            else:
                files[child] = Path(folder) / f"{info.name}.py"


def _subpackage_names(files: dict[str, Path]) -> set[str]:
    """Every ``cachedrag.<name>`` some module imports: children of ``cachedrag`` that live outside its
    folder (``integrations``, ``pipelines``, ``kernels``: mapped by package-dir) are found this way."""
    names = set()
    for module, path in files.items():
        for target in _imports(module, path, lambda n: n.count(".") == 1):
            parts = target.split(".")
            if len(parts) > 1 and parts[0] == ROOT:
                names.add(".".join(parts[:2]))
    return names


def _listed_subpackages() -> set[str]:
    """The ``cachedrag.<name>`` packages pyproject.toml lists (a mapped one that nothing imports
    is still walked)."""
    import tomllib

    listed = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    return {p for p in listed["tool"]["setuptools"]["packages"] if p.count(".") == 1}


def modules() -> dict[str, Path]:
    """Every module of the installed package: name -> source file."""
    files: dict[str, Path] = {}
    _walk(ROOT, _package_dir(ROOT), files)
    seen = set()
    while True:  # children mapped outside cachedrag's folder, found by name, and what they import
        wanted = _subpackage_names(files) | _listed_subpackages()
        todo = {n for n in wanted if n not in files and n not in seen}
        if not todo:
            return files
        for name in sorted(todo):
            seen.add(name)
            if importlib.util.find_spec(name) is not None:
                _walk(name, _package_dir(name), files)


def _imports(module: str, path: Path, is_module) -> list[str]:
    """The names ``module`` imports anywhere in its source, resolved (see the module docstring)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.append(f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
    return found


def graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the cachedrag modules it imports (itself excluded)."""
    def owner(name: str) -> str | None:  # the deepest cachedrag module of a dotted name
        parts = name.split(".")
        while parts:
            if ".".join(parts) in files:
                return ".".join(parts)
            parts.pop()
        return None

    edges: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for target in _imports(module, path, lambda n: n in files):
            dep = owner(target)
            if dep is not None and dep != module:
                edges[module].add(dep)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _describe(component: frozenset[str], edges: dict[str, set[str]]) -> str:
    inner = [f"{a} -> {b}" for a in sorted(component) for b in sorted(edges[a] & component)]
    return "{" + ", ".join(sorted(component)) + "}: " + "; ".join(inner)


def test_the_walk_finds_every_part_of_the_package():
    files = modules()
    for name in ("cachedrag.model.runner", "cachedrag.integrations", "cachedrag.pipelines", "cachedrag.kernels"):
        assert name in files, name
    assert any(n.startswith("cachedrag.kernels.") for n in files)


def test_the_walk_imports_no_torch():
    """Parsing, not importing: a fresh interpreter that walks the package has not loaded torch."""
    code = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('walk', {str(Path(__file__))!r}); "
            "walk = importlib.util.module_from_spec(spec); spec.loader.exec_module(walk); "
            "walk.cycles(walk.graph(walk.modules())); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_tarjan_finds_each_cycle_once():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(map(sorted, cycles(edges))) == [["a", "b", "c"], ["d", "e"]]


def test_no_import_cycle_but_the_known_ones():
    edges = graph(modules())
    found = cycles(edges)
    new = [c for c in found if c not in KNOWN_CYCLES]
    stale = [c for c in KNOWN_CYCLES if c not in found]
    assert not new, "import cycles:\n" + "\n".join(_describe(c, edges) for c in new)
    assert not stale, "KNOWN_CYCLES entries that no longer exist (remove them):\n" + "\n".join(
        "{" + ", ".join(sorted(c)) + "}" for c in stale)
