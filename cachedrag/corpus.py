"""Document corpora: loading user corpora and building the embedded stdlib-docs corpus.

Owns: the ``Document`` record, reading a corpus from a directory of UTF-8 ``.txt``/``.md``
files or a JSONL file of ``{"id", "text"}``, reading a question stream, and the demo corpus
made of the Python standard library's own pydoc text. Does not own: chunking (see
``cachedrag.retrieval.chunker``) or embedding.
"""

from __future__ import annotations

import io
import json
import pydoc
import re
import warnings
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

from cachedrag.errors import EmptyInputError

# A few dozen well-documented, side-effect-free stdlib modules for the demo corpus.
STDLIB_MODULES: tuple[str, ...] = (
    "json", "csv", "heapq", "bisect", "itertools", "functools", "collections", "pathlib",
    "shutil", "tempfile", "textwrap", "string", "re", "datetime", "calendar", "random",
    "statistics", "fractions", "decimal", "math", "hashlib", "hmac", "base64", "zlib",
    "gzip", "zipfile", "tarfile", "sqlite3", "argparse", "logging", "threading", "queue",
    "subprocess", "socket", "selectors", "contextlib", "dataclasses", "enum", "typing",
    "abc", "copy", "pprint", "difflib", "unittest", "urllib.parse", "uuid", "weakref",
    "operator", "inspect", "traceback",
)


@dataclass(frozen=True)
class Document:
    """One source document of a corpus."""

    id: str
    text: str


def load_corpus(path: str | Path) -> list[Document]:
    """Read a corpus: a directory of .txt/.md files (one document each) or a JSONL file.

    Raises ``EmptyInputError`` when the path holds no non-empty document, and
    ``FileNotFoundError`` when it does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus path does not exist: {path}")
    docs: list[Document] = []
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.suffix.lower() in (".txt", ".md") and p.is_file()):
            text = file.read_text(encoding="utf-8")
            if text.strip():
                docs.append(Document(id=str(file.relative_to(path)), text=text))
    else:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    doc = Document(id=str(record["id"]), text=str(record["text"]))
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with 'id' and 'text' ({exc})") from exc
                if doc.text.strip():
                    docs.append(doc)
    if not docs:
        raise EmptyInputError(f"corpus at {path} contains no non-empty documents (.txt/.md files or JSONL lines)")
    return docs


def load_questions(path: str | Path) -> list[str]:
    """Read a question stream: one question per non-empty line, in file order (repeats kept)."""
    questions = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not questions:
        raise EmptyInputError(f"question file {path} contains no questions")
    return questions


def _pydoc_text(module_name: str) -> str:
    """Plain pydoc text of one module, with pydoc's overstrike formatting removed."""
    with warnings.catch_warnings(), redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        obj, name = pydoc.resolve(module_name)
        text = pydoc.render_doc(obj, "Help on %s", renderer=pydoc.plaintext)
    text = re.sub(".\b", "", text)  # strip bold overstrike sequences
    # object reprs carry per-process memory addresses; drop them so the corpus (and so chunk
    # token ids and cache keys) is identical in every process
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def stdlib_corpus(modules: tuple[str, ...] = STDLIB_MODULES, max_chars_per_doc: int = 20_000) -> list[Document]:
    """The demo corpus: pydoc text of standard-library modules, one document per module.

    Present on every Python install, so the demo needs no data files or network. Each
    document is cut to ``max_chars_per_doc`` characters (module overviews come first).
    """
    docs = []
    for name in modules:
        try:
            text = _pydoc_text(name)
        except ImportError:  # a stripped-down Python may lack e.g. sqlite3; skip it visibly
            warnings.warn(f"stdlib module {name!r} is not importable here; left out of the demo corpus", stacklevel=2)
            continue
        docs.append(Document(id=f"stdlib/{name}", text=text[:max_chars_per_doc]))
    if not docs:
        raise EmptyInputError("no stdlib module could be rendered for the demo corpus")
    return docs


# Questions whose answers are in the stdlib corpus; used by the demo and the benchmarks.
STDLIB_QUESTIONS: tuple[str, ...] = (
    "How do I pretty-print a JSON document with indentation?",
    "What does heapq.heappush do?",
    "How can I find the insertion point for a value in a sorted list?",
    "What is the difference between itertools.chain and itertools.chain.from_iterable?",
    "How do I cache the results of a function call?",
    "What does collections.Counter.most_common return?",
    "How do I create a temporary directory that is removed automatically?",
    "How do I wrap a long paragraph of text to a fixed width?",
    "How do I compute the median of a list of numbers?",
    "How do I compute a SHA-256 hash of some bytes?",
    "How do I parse command-line options with argparse?",
    "How do I run a shell command and capture its output?",
    "How do I define an enumeration?",
    "How can I compare two sequences and show their differences?",
    "How do I make a deep copy of an object?",
    "How do I read rows from a CSV file?",
    "How do I generate a random UUID?",
    "How do I split a URL into its components?",
)
