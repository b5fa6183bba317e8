"""Who may import the prompt package and what it may import, checked on the source (ast), so a
lazy import inside a function counts as much as one at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cachedrag

PACKAGE = Path(cachedrag.__file__).parent


def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of the modules a module of ``package`` with this ``source`` imports: import
    statements anywhere in it (relative ones resolved against ``package``) and
    ``importlib.import_module("...")`` calls with a literal name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def imports_of(path: Path) -> set[str]:
    return imported_modules(path.read_text(), ".".join(("cachedrag",) + path.relative_to(PACKAGE).parent.parts))


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (PACKAGE / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _sources("server", "cluster"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_server_and_the_cluster_take_prompt_code_from_the_prompt_package(path):
    bad = sorted(m for m in imports_of(path) if _within(m, "cachedrag.integrations"))
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}: import prompt code from cachedrag.prompt"


@pytest.mark.parametrize("path", _sources("prompt"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_prompt_package_depends_on_none_of_its_users(path):
    users = ("cachedrag.integrations", "cachedrag.server", "cachedrag.cluster", "cachedrag.engine",
             "cachedrag.pipelines", "cachedrag.model", "torch")
    bad = sorted(m for m in imports_of(path) if any(_within(m, u) for u in users))
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_the_walk_sees_every_form_of_import():
    source = ("import cachedrag.integrations.chunks\n"
              "from cachedrag import integrations\n"
              "def f():\n    from ..integrations import splitter\n"
              "    importlib.import_module('cachedrag.integrations.template')\n")
    assert {"cachedrag.integrations.chunks", "cachedrag.integrations", "cachedrag.integrations.splitter",
            "cachedrag.integrations.template"} <= imported_modules(source, "cachedrag.server")
