"""The documentation's code runs as written: every ```python block of README.md and of every user
page under docs/ (the measurement notes under docs/notes/ are history, not run).

Each page's blocks run in order in one namespace (a later block may use what an earlier one
defined, as a reader following the page would), in a fresh working directory per page, with
the embedded default model swapped for the tiny random model (``cachedrag.testing.
tiny_default_model``) so a page runs in seconds. The working directory holds ``my-index``, a
tiny index of ``cachedrag.testing.TINY_DOCS``: the pages build it with the shell command
``cachedrag index build ... --out my-index`` (shell blocks are not executed here; the CLI's
own tests cover that command).

A block preceded by the line ``<!-- doc-test: skip (reason) -->`` (needs a live server, a GPU,
a long benchmark...) is reported as skipped with that reason. When a block fails, the page's
later blocks are skipped (they would fail for the same reason).
"""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pytest

from cachedrag.docblocks import Block, blocks_of, run_block

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "notes" not in p.relative_to(ROOT / "docs").parts)]
CASES = [(b, n) for page in PAGES if page.is_file() for n, b in enumerate(blocks_of(page))]


def test_the_harness_finds_blocks_and_skip_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n\n```python\nx = 1\n```\n\n<!-- doc-test: skip (needs a GPU) -->\n```python\ny = 2\n```\n"
                    "```bash\nls\n```\n- item:\n\n    ```python\n    z = 3\n    ```\n")
    got = blocks_of(page)
    assert [(b.line, b.code, b.skip) for b in got] == [(3, "x = 1", None), (8, "y = 2", "needs a GPU"),
                                                       (16, "z = 3", None)]
    assert len(CASES) >= 10  # the docs do have code


def test_run_page_shares_one_namespace_and_stops_at_a_failure(tmp_path):
    from cachedrag.docblocks import main, run_page

    page = tmp_path / "p.md"
    page.write_text("```python\nx = 2\n```\n<!-- doc-test: skip (slow) -->\n```python\nraise SystemExit\n```\n"
                    "```python\nassert x == 2\n```\n")
    lines: list[str] = []
    assert run_page(page, log=lines.append) == 2 and "skipped (slow)" in lines[1]
    page.write_text("```python\nx = 1\n```\n```python\nassert x == 2, 'wrong'\n```\n")
    with pytest.raises(AssertionError, match="wrong"):
        run_page(page, log=lines.append)
    assert main([]) == 2


@pytest.mark.parametrize("script", ["gen_cli_reference.py", "gen_config_reference.py"])
def test_the_generated_reference_pages_are_current(script):
    """docs/cli.md and docs/config.md are generated from the parsers and the settings models;
    regenerate them with ``python scripts/<script>``."""
    import runpy

    gen = runpy.run_path(str(ROOT / "scripts" / script))
    assert gen["main"](["--check"]) == 0, f"a generated page is stale: run python scripts/{script}"


def test_examples_readme_lists_every_example():
    listed = (ROOT / "examples" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "examples").iterdir())
               if p.suffix in (".py", ".yaml") and f"]({p.name})" not in listed]
    assert not missing, f"examples/README.md does not list {missing}"


def test_user_pages_stay_short_and_link_their_notes():
    """User pages stay readable (measurement logs go to docs/notes/); each note is linked from its page."""
    docs = ROOT / "docs"
    long = [p.name for p in PAGES[1:] if p.name != "cli.md" and len(p.read_text().splitlines()) > 400]
    assert not long, f"user pages over 400 lines: {long}"
    for note in (docs / "notes").glob("*.md"):
        page = docs / note.name
        if page.is_file():
            assert f"notes/{note.name}" in page.read_text(), f"{page.name} does not link its notes"


@pytest.fixture(scope="session")
def docs_env(tmp_path_factory):
    """The tiny default model's directory and a tiny ``my-index`` to copy into each page's cwd."""
    from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index
    from cachedrag.testing import TINY_DOCS, byte_tokenizer, save_tiny_model

    base = tmp_path_factory.mktemp("docs-env")
    model_dir = save_tiny_model(base / "tiny-default")
    index_dir = base / "my-index"
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=96, overlap=8), index=IndexConfig(nlist=2))
    build_index(TINY_DOCS, byte_tokenizer(), Embedder(), config, out=index_dir, progress=False)
    return model_dir, index_dir


class _Page:
    """One page's run: its namespace, its working directory, and whether a block failed."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.namespace: dict = {"__name__": "__docs__"}
        self.failed: str | None = None


_pages: dict[str, _Page] = {}


def _page(name: str, docs_env, tmp_path_factory) -> _Page:
    if name not in _pages:
        cwd = tmp_path_factory.mktemp("page-" + name.replace(".", "-"))
        shutil.copytree(docs_env[1], cwd / "my-index")
        _pages[name] = _Page(cwd)
    return _pages[name]


@pytest.mark.parametrize("block, n", CASES, ids=[f"{b.page}:{b.line}" for b, _ in CASES])
def test_doc_block(block: Block, n: int, docs_env, tmp_path_factory, monkeypatch):
    from cachedrag.testing import tiny_default_model

    if block.skip is not None:
        pytest.skip(block.skip)
    page = _page(block.page, docs_env, tmp_path_factory)
    if page.failed is not None:
        pytest.skip(f"an earlier block of {block.page} failed ({page.failed})")
    monkeypatch.chdir(page.cwd)
    monkeypatch.setenv("CACHEDRAG_HOME", str(page.cwd / ".cachedrag"))
    page.failed = f"line {block.line}"
    with tiny_default_model(docs_env[0]), contextlib.redirect_stdout(io.StringIO()):
        run_block(block, page.namespace)
    page.failed = None
