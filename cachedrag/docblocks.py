"""The runnable ```python blocks of Markdown documentation: extraction and a page runner.

Owns ``blocks_of`` (a page's python blocks with their markers) and ``run_page`` (a page's blocks
in order in one namespace, as a reader follows it). The line before a block may mark it:

    <!-- doc-test: skip (reason) -->   not run (a GPU, a model download...), the reason reported
    <!-- doc-test: NEED[, NEED...] -->  run where the test harness provides each of ``NEEDS``:
        server  a running ``cachedrag serve`` at ``SERVER_URL`` (its address replaces that one)
        redis   a Redis at ``REDIS_URL`` (a private redis-server's address replaces that one)
        gguf    a GGUF file at the block's ``/models/NAME.gguf`` path (a tiny file's path replaces it)
        model   a model directory in each ``model="..."`` argument (a Hugging Face id or a path;
                a tiny model's directory replaces it)
        ray     starts a local Ray cluster (slow; the harness shuts Ray down after the page)

``run_block(block, namespace, provided)`` replaces each placeholder of ``provided`` (a need's
name -> the real value) in the block's code before running it. The test suite runs every page on
the tiny model (tests/test_docs.py); ``make wheel-check`` runs the integration tutorials with
``python -m cachedrag.docblocks PAGE...`` in a venv holding only the built wheel, on the real
default model (blocks with needs are skipped there). Also ``generated_page``, the
write-or-``--check`` entry point of the scripts that generate reference pages
(scripts/gen_*_reference.py). Does not own the pages or what they need on disk (``my-index``):
the caller prepares the working directory.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SKIP = re.compile(r"^<!--\s*doc-test:\s*skip\s*\((?P<reason>.+)\)\s*-->\s*$")
NEEDS_MARKER = re.compile(r"^<!--\s*doc-test:\s*(?P<needs>[a-z]+(?:\s*,\s*[a-z]+)*)\s*-->\s*$")
SERVER_URL = "http://127.0.0.1:8000"  # `cachedrag serve`'s default address, as the pages write it
REDIS_URL = "redis://localhost:6379"  # a local Redis's default address, as the pages write it
GGUF_PATH = re.compile(r"/models/[\w.-]+\.gguf")  # a user's GGUF file, as the pages write it
MODEL_ARG = re.compile(r'(?<=\bmodel=")[^"]+(?=")')  # a user's model (HF id or path), as the pages pass it
#: what each need's placeholder is in a block's code (a regex)
PLACEHOLDERS: dict[str, str] = {"server": re.escape(SERVER_URL), "redis": re.escape(REDIS_URL),
                                "gguf": GGUF_PATH.pattern, "model": MODEL_ARG.pattern, "ray": ""}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the skip reason, or None
    needs: tuple[str, ...] = ()  # what the harness provides (PLACEHOLDERS' keys)

    @property
    def server(self) -> bool:
        """Talks to a running server at ``SERVER_URL``."""
        return "server" in self.needs


def blocks_of(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown page, with their markers; a marker naming an unknown
    need raises ``ValueError`` (a typo would otherwise run the block without what it needs)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        info, ticks, indent = m["info"].strip(), m["ticks"], len(m["indent"])
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(ticks):
            end += 1
        if info.split(" ")[0].lower() in ("python", "py"):
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            skip = SKIP.match(prev.strip())
            marked = NEEDS_MARKER.match(prev.strip())
            needs = tuple(n.strip() for n in marked["needs"].split(",")) if marked else ()
            unknown = [n for n in needs if n not in PLACEHOLDERS]
            if unknown:
                raise ValueError(f"{Path(path).name}:{i + 1}: unknown doc-test need {unknown} (known: {sorted(PLACEHOLDERS)})")
            code = "\n".join(line[indent:] for line in lines[i + 1:end])
            out.append(Block(Path(path).name, i + 1, code, skip["reason"].strip() if skip else None, needs))
        i = end + 1
    return out


def run_block(block: Block, namespace: dict, provided: dict[str, str] | None = None) -> None:
    """Execute one block in ``namespace`` (the page's), in the current directory; each placeholder
    of a need in ``provided`` (e.g. ``{"server": "http://127.0.0.1:4321"}``) is replaced by its value."""
    source = block.code
    for need, value in (provided or {}).items():
        if need in block.needs and PLACEHOLDERS[need]:
            source = re.sub(PLACEHOLDERS[need], lambda _m, v=value: v, source)
    code = compile(source, f"{block.page}:{block.line}", "exec", dont_inherit=True)
    exec(code, namespace)  # noqa: S102 - executing our own documentation is the point


def run_page(path: Path, log=print) -> int:
    """Run a page's non-skipped blocks in order in one namespace; the number of blocks run. Blocks
    with needs are skipped (nothing provides them here). The first failing block's exception propagates."""
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for block in blocks_of(path):
        if block.skip is not None or block.needs:
            log(f"{block.page}:{block.line}: skipped ({block.skip or 'needs ' + ', '.join(block.needs)})")
            continue
        start = time.perf_counter()
        run_block(block, namespace)
        ran += 1
        log(f"{block.page}:{block.line}: ok ({time.perf_counter() - start:.1f} s)")
    return ran


def generated_page(page: Path, text: str, script: str, argv: list[str] | None = None) -> int:
    """Write ``text`` to ``page``; with ``--check`` in ``argv`` (default: the command line) only say
    whether ``page`` already holds it (exit code 1 and one line naming ``script`` when stale)."""
    if "--check" not in (argv if argv is not None else sys.argv[1:]):
        page.write_text(text)
        return 0
    if page.is_file() and page.read_text() == text:
        return 0
    print(f"{page} is stale: run python scripts/{script}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    pages = sys.argv[1:] if argv is None else argv
    if not pages:
        print("usage: python -m cachedrag.docblocks PAGE.md...", file=sys.stderr)
        return 2
    for page in pages:
        if run_page(Path(page), log=lambda line: print(line, file=sys.stderr)) == 0:
            print(f"{page}: no runnable python blocks", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
