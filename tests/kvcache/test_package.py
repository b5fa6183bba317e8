"""The policy layer is pure Python: stdlib + cachedrag.errors + its own modules, no torch/numpy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cachedrag.kvcache as kvcache

PKG = Path(kvcache.__file__).parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_every_module_imports_only_stdlib_and_own_code():
    allowed_own = ("cachedrag.kvcache", "cachedrag.errors")
    for path in sorted(PKG.glob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "__future__" or top in sys.stdlib_module_names:
                continue
            assert name.startswith(allowed_own), f"{path.name} imports {name}"


def test_import_loads_no_torch_or_numpy():
    code = (
        "import sys, cachedrag.kvcache as k; k.Planner(k.KnowledgeTree(), k.VariantIndex()); "
        "bad = [m for m in ('torch', 'numpy') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_public_api_names_resolve():
    for name in kvcache.__all__:
        assert getattr(kvcache, name) is not None


def test_docstring_examples_run():
    import doctest
    import importlib

    for path in sorted(PKG.glob("*.py")):
        mod = importlib.import_module(f"cachedrag.kvcache.{path.stem}") if path.stem != "__init__" else kvcache
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{path.name}: {result.failed} doctest failure(s)"
