"""Document corpora: loading user corpora and building the embedded stdlib-docs corpus.

Owns: the ``Document`` record, reading a corpus from a directory of UTF-8 ``.txt``/``.md``
files or a JSONL file of ``{"id", "text"}``, reading a question stream, a deterministic Zipf-skewed
question stream over topics (``zipf_stream``: the demo's and the benchmarks'), the demo corpus
made of the Python standard library's own pydoc text, and a second real-manual corpus made of
the GNU info manuals the system ships (``info_corpus``; offline, no data files to ship). Does not own: chunking (see
``cachedrag.retrieval.chunker``) or embedding.
"""

from __future__ import annotations

import io
import json
import pydoc
import random
import re
import warnings
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

from cachedrag.errors import EmptyInputError, InputError, InputNotFoundError

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


TEXT_SUFFIXES = (".txt", ".md")


def load_corpus(path: str | Path) -> list[Document]:
    """Read a corpus: a directory of .txt/.md files (one document each), a single .txt/.md
    file (one document), or a JSONL file of ``{"id", "text"}`` objects.

    Raises ``InputNotFoundError`` when the path does not exist, ``InputError`` for a file that
    is not UTF-8 or a JSONL line that is not such an object, and ``EmptyInputError`` when the
    path holds no non-empty document.
    """
    path = Path(path)
    if not path.exists():
        raise InputNotFoundError(f"corpus path does not exist: {path}")
    docs: list[Document] = []
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file()):
            text = _read_text(file)
            if text.strip():
                docs.append(Document(id=str(file.relative_to(path)), text=text))
    elif path.suffix.lower() in TEXT_SUFFIXES:
        text = _read_text(path)
        if text.strip():
            docs.append(Document(id=path.name, text=text))
    else:
        for lineno, line in enumerate(_read_text(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                doc = Document(id=str(record["id"]), text=str(record["text"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise InputError(
                    f"{path}:{lineno}: expected a JSONL line with 'id' and 'text' ({exc}); "
                    f"plain-text corpora are .txt/.md files or a directory of them"
                ) from exc
            if doc.text.strip():
                docs.append(doc)
    if not docs:
        raise EmptyInputError(f"corpus at {path} contains no non-empty documents (.txt/.md files or JSONL lines)")
    return docs


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{file} is not UTF-8 text ({exc.reason} at byte {exc.start}); convert it to UTF-8") from exc
    except OSError as exc:
        raise InputError(f"cannot read {file}: {exc.strerror or exc}") from exc


def load_questions(path: str | Path) -> list[str]:
    """Read a question stream: one question per non-empty line, in file order (repeats kept)."""
    questions = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not questions:
        raise EmptyInputError(f"question file {path} contains no questions")
    return questions


def zipf_stream(pool, n: int, s: float = 1.1, seed: int = 0) -> list[str]:
    """``n`` requests with Zipf(s) popularity over a shuffled rank order of ``pool``.

    ``pool`` items are questions, or topics (tuples of phrasings of one question): a topic is
    drawn by popularity, then one of its phrasings uniformly, as users word the same need
    differently.
    """
    rng = random.Random(seed)
    ranked = list(pool)
    rng.shuffle(ranked)
    weights = [1.0 / (r + 1) ** s for r in range(len(ranked))]
    picks = rng.choices(ranked, weights=weights, k=n)
    return [rng.choice(p) if isinstance(p, tuple) else p for p in picks]


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


INFO_MANUALS: tuple[str, ...] = ("grep", "sed", "gzip", "time", "bc", "ed", "diffutils")
INFO_DIR = "/usr/share/info"


def info_corpus(manuals: tuple[str, ...] = INFO_MANUALS, root: str | Path = INFO_DIR,
                max_chars_per_doc: int = 6_000) -> list[Document]:
    """GNU info manuals (plain text, gzip-compressed, in ``root``) as one document per node.

    Info files separate nodes with a 0x1F byte; each node starts with a ``File: ... Node: ...``
    header line, dropped here. Nodes shorter than 200 characters (menus) are skipped; each node
    is cut to ``max_chars_per_doc``. Raises ``EmptyInputError`` naming ``root`` when none of the
    manuals is installed.
    """
    import gzip

    root = Path(root)
    docs: list[Document] = []
    for name in manuals:
        parts = sorted(root.glob(f"{name}.info*.gz")) + sorted(root.glob(f"{name}.info"))
        for part in parts:
            with gzip.open(part, "rt", encoding="utf-8", errors="replace") if part.suffix == ".gz" else \
                    part.open(encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            for node in text.split("\x1f")[1:]:
                lines = node.strip("\n").splitlines()
                header = lines[0] if lines else ""
                if "Node:" not in header or header.startswith("Tag Table"):
                    continue
                node_name = header.split("Node:", 1)[1].split(",", 1)[0].strip()
                body = "\n".join(lines[1:]).strip()
                if len(body) >= 200:
                    docs.append(Document(id=f"info/{name}/{node_name}", text=body[:max_chars_per_doc]))
    if not docs:
        raise EmptyInputError(f"no GNU info manual ({', '.join(manuals)}) found under {root}")
    return docs


# Questions whose answers are in the stdlib corpus, grouped by topic: each group asks one
# thing in different words, as real users do (and so retrieves overlapping chunks in
# different orders). Used by the demo and the benchmarks.
STDLIB_TOPICS: tuple[tuple[str, ...], ...] = (
    ("How do I pretty-print a JSON document with indentation?",
     "How can I make json.dumps output indented and readable?",
     "What argument of json.dumps controls indentation?"),
    ("What does heapq.heappush do?",
     "How do I push an item onto a heap with heapq?",
     "How does heapq keep the smallest item first when adding elements?"),
    ("How can I find the insertion point for a value in a sorted list?",
     "What does bisect.bisect_left return?",
     "How do I insert into a sorted list and keep it sorted?"),
    ("What is the difference between itertools.chain and itertools.chain.from_iterable?",
     "How do I flatten a list of lists with itertools?",
     "How do I iterate over several iterables one after another?"),
    ("How do I cache the results of a function call?",
     "What does functools.lru_cache do?",
     "How do I memoize an expensive function in Python?"),
    ("What does collections.Counter.most_common return?",
     "How do I count how often each item occurs in a list?",
     "How do I get the most frequent elements with Counter?"),
    ("How do I create a temporary directory that is removed automatically?",
     "What does tempfile.TemporaryDirectory do?",
     "How can I make a temporary file that is deleted when closed?"),
    ("How do I wrap a long paragraph of text to a fixed width?",
     "What does textwrap.fill do?",
     "How do I remove common leading whitespace from lines of text?"),
    ("How do I compute the median of a list of numbers?",
     "What functions does the statistics module provide for averages?",
     "How do I compute the standard deviation of some data?"),
    ("How do I compute a SHA-256 hash of some bytes?",
     "How do I use hashlib to get a hex digest?",
     "Which hash algorithms does hashlib support?"),
    ("How do I parse command-line options with argparse?",
     "How do I add an optional flag with argparse?",
     "What does ArgumentParser.add_argument do?"),
    ("How do I run a shell command and capture its output?",
     "What does subprocess.run return?",
     "How do I check the exit code of a child process?"),
    ("How do I define an enumeration?",
     "What is an Enum member and how do I access its value?",
     "How do I create an enum with automatic values?"),
    ("How can I compare two sequences and show their differences?",
     "What does difflib.unified_diff produce?",
     "How do I find close matches to a word in a list?"),
    ("How do I make a deep copy of an object?",
     "What is the difference between copy.copy and copy.deepcopy?",
     "How do I copy a nested list so changes do not affect the original?"),
    ("How do I read rows from a CSV file?",
     "How do I write a list of rows to a CSV file?",
     "What does csv.DictReader do?"),
    ("How do I generate a random UUID?",
     "What is the difference between uuid1 and uuid4?",
     "How do I make a UUID from a string?"),
    ("How do I split a URL into its components?",
     "What does urllib.parse.urlparse return?",
     "How do I encode query parameters for a URL?"),
)

STDLIB_QUESTIONS: tuple[str, ...] = tuple(q for topic in STDLIB_TOPICS for q in topic)

# Questions whose answers are in the GNU info manuals corpus (``info_corpus``), grouped by topic
# the same way: the second, non-Python stream of the benchmarks (``bench ttft --embedded-corpus
# info``; each topic's first phrasing is ``bench fidelity``'s info question).
INFO_TOPICS: tuple[tuple[str, ...], ...] = (
    ("How do I make grep ignore case distinctions?",
     "Which grep option makes the match case-insensitive?",
     "How can grep match both upper and lower case letters?"),
    ("What does grep's -v option do?",
     "How do I print the lines that do not match a pattern with grep?",
     "How do I invert the sense of matching in grep?"),
    ("How do I count the matching lines with grep?",
     "Which grep option prints a count of matching lines instead of the lines?",
     "How can grep tell me how many lines match?"),
    ("How do I print only the names of files that contain a match with grep?",
     "What does grep's -l option do?",
     "How do I list the files that match a pattern with grep?"),
    ("How does the s command of sed substitute text?",
     "How do I replace text with sed?",
     "What flags does the sed s command accept?"),
    ("How do I edit a file in place with sed?",
     "What does sed's -i option do?",
     "How can sed change a file without writing a new one?"),
    ("How do I delete lines that match a pattern with sed?",
     "What does the d command do in sed?",
     "How can sed remove the lines matching a regular expression?"),
    ("How do I keep the original file when compressing with gzip?",
     "What does gzip's -k option do?",
     "How can gzip compress a file without deleting the input?"),
    ("How do I decompress a .gz file?",
     "What does gzip -d do?",
     "How do I uncompress a file made by gzip?"),
    ("What does gzip's -9 option do?",
     "How do I get the best compression from gzip?",
     "How do I choose the compression level in gzip?"),
    ("How do I change the output format of the time command?",
     "What does the -f option of time do?",
     "Which format specifiers does the time command understand?"),
    ("How do I set the number of digits after the decimal point in bc?",
     "What does the scale variable do in bc?",
     "How do I make bc print decimals instead of whole numbers?"),
    ("How do I print the current line in ed?",
     "What does the p command do in ed?",
     "How do I show lines of the buffer in ed?"),
    ("How do I produce a unified diff?",
     "What does diff's -u option do?",
     "How do I make diff show changes with context in unified format?"),
    ("How do I make diff ignore changes in the amount of white space?",
     "What does diff's -b option do?",
     "How can diff treat lines that differ only in spaces as equal?"),
    ("How do I compare two files side by side with diff?",
     "What does diff's -y option do?",
     "How do I get two-column output from diff?"),
    ("What does cmp report for two files that differ?",
     "How do I find the first byte where two files differ?",
     "What is the exit status of cmp?"),
    ("How do I apply a patch made by diff?",
     "How does the patch program use a diff file?",
     "What does patch's -p option do?"),
)

