"""The checkout shadows no installed distribution: Python started from the checkout root imports the
installed package of every top-level folder's name (and Hugging Face's ``kernels``, which
transformers imports), while ``cachedrag.kernels`` / ``.integrations`` / ``.pipelines`` still
import from the checkout's folders (docs/contributing.md, "Layout")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every top-level folder a user sees, but ``cachedrag`` (the project's own import name: an editable
# install maps it to this very folder) and what tools create (.venv, build, site ...).
FOLDERS = sorted(p.name for p in ROOT.iterdir()
                 if p.is_dir() and not p.name.startswith(".") and p.name not in {"cachedrag", "build", "site"}
                 and not p.name.endswith(".egg-info"))


def _from_root(code: str, **env) -> subprocess.CompletedProcess:
    """``python -c code`` started in the checkout root as a user would: without -P, so the working
    directory is sys.path[0], ahead of PYTHONPATH and site-packages."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_the_package_folders_are_top_level():
    assert {"integrations", "pipelines", "kernels", "benchmarks", "tests"} <= set(FOLDERS)


@pytest.mark.parametrize("name", FOLDERS)
def test_an_installed_distribution_named_like_a_folder_wins(tmp_path, name):
    standin = tmp_path / name
    standin.mkdir()
    (standin / "__init__.py").write_text("STANDIN = True\n")
    out = _from_root(f"import {name}; print({name}.__file__, getattr({name}, 'STANDIN', False))",
                     PYTHONPATH=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(standin / "__init__.py"), "True"]


def test_hugging_face_kernels_is_the_installed_one():
    code = ("import importlib.metadata as m, kernels, transformers.integrations.hub_kernels; "
            "print(kernels.__file__, m.distribution('kernels').locate_file('kernels/__init__.py'))")
    out = _from_root(code)
    assert out.returncode == 0, out.stderr[-2000:]
    imported, installed = out.stdout.split()
    assert imported == installed and not imported.startswith(str(ROOT / "kernels"))


def test_cachedrag_subpackages_import_from_the_checkout_root():
    code = ("import cachedrag.integrations.langchain, cachedrag.kernels, cachedrag.pipelines; "
            "print(cachedrag.kernels.rerotate.__module__, cachedrag.kernels.__file__)")
    out = _from_root(code)
    assert out.returncode == 0, out.stderr[-2000:]
    module, path = out.stdout.split()
    assert module == "cachedrag.kernels.rerotate"
    assert Path(path) == ROOT / "kernels" / "cachedrag" / "kernels" / "__init__.py"


def test_cli_module_runs_from_the_checkout_root():
    out = subprocess.run([sys.executable, "-m", "cachedrag.cli", "--version"], cwd=ROOT,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("cachedrag ")


def test_the_suite_imports_the_installed_package():
    assert "" not in sys.path and str(ROOT) not in sys.path
    import cachedrag.kernels

    # the editable install maps cachedrag.kernels to its folder one level down
    assert Path(cachedrag.kernels.__file__).parent == ROOT / "kernels" / "cachedrag" / "kernels"


def test_no_test_folder_is_a_regular_package():
    # pytest would import tests/kernels/ as a bare ``kernels`` (and so on) if it were a package
    assert sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("__init__.py")) == []
