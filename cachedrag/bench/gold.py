"""Gold question-answer sets for the fidelity benchmark, and the GNU-info question stream.

Owns: ``STDLIB_GOLD`` (50 questions over the embedded stdlib corpus, each answered by a short
span, a function name, that the module's pydoc text states next to the description the
question paraphrases), ``INFO_QUESTIONS`` (questions over the GNU info manuals corpus,
``cachedrag.corpus.info_corpus``; no gold answers), and ``gold_match`` (task accuracy: the gold
span appears in an answer as a whole word, case-insensitive). Does not own the corpora.

Each gold item names its document so the benchmark can put the chunk holding the answer in the
retrieved set (the task measures reading, not retrieval); ``tests/bench/test_gold.py`` checks
that every answer is in its module's text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GoldItem:
    doc: str  # document id in the corpus (stdlib/<module>)
    question: str
    answer: str  # short span of the document


def _g(module: str, question: str, answer: str) -> GoldItem:
    return GoldItem(f"stdlib/{module}", question, answer)


STDLIB_GOLD: tuple[GoldItem, ...] = (
    _g("heapq", "Which heapq function transforms a list into a heap in place, in linear time?", "heapify"),
    _g("heapq", "Which heapq function pushes an item on the heap and then pops and returns the smallest item?",
       "heappushpop"),
    _g("heapq", "Which heapq function pops and returns the current smallest value and then adds the new item?",
       "heapreplace"),
    _g("heapq", "Which heapq function finds the n largest elements in a dataset?", "nlargest"),
    _g("bisect", "Which bisect function inserts item x in list a and keeps it sorted?", "insort"),
    _g("functools", "Which functools function converts a cmp= function into a key= function?", "cmp_to_key"),
    _g("functools", "Which functools class decorator fills in missing ordering methods?", "total_ordering"),
    _g("functools", "Which functools decorator makes a single-dispatch generic function?", "singledispatch"),
    _g("functools", "Which functools decorator factory applies update_wrapper() to a wrapper function?", "wraps"),
    _g("functools", "Which functools decorator is a least-recently-used cache?", "lru_cache"),
    _g("csv", "Which csv function sets an upper limit on parsed fields?", "field_size_limit"),
    _g("csv", "Which csv function returns a list of all known dialect names?", "list_dialects"),
    _g("csv", "Which csv function creates a mapping from a string name to a dialect class?", "register_dialect"),
    _g("shutil", "Which shutil function copies data and metadata and returns the file's destination?", "copy2"),
    _g("shutil", "Which shutil function recursively copies a directory tree?", "copytree"),
    _g("shutil", "Which shutil function returns disk usage statistics about a given path?", "disk_usage"),
    _g("shutil", "Which shutil function gets the size of the terminal window?", "get_terminal_size"),
    _g("tempfile", "Which tempfile function returns the default prefix for temporary directories as a string?",
       "gettempprefix"),
    _g("textwrap", "Which textwrap function removes any common leading whitespace from every line?", "dedent"),
    _g("textwrap", "Which textwrap function adds a prefix to the beginning of selected lines of text?", "indent"),
    _g("textwrap", "Which textwrap function collapses and truncates text to fit in a given width?", "shorten"),
    _g("statistics", "Which statistics function returns the high median of data?", "median_high"),
    _g("statistics", "Which statistics function converts data to floats and computes the geometric mean?",
       "geometric_mean"),
    _g("statistics", "Which statistics function gives the slope and intercept of a simple linear regression?",
       "linear_regression"),
    _g("statistics", "Which statistics function returns the low median of numeric data?", "median_low"),
    _g("math", "Which math function returns the cube root of x?", "cbrt"),
    _g("math", "Which math function counts the ways to choose k items from n items without repetition and "
               "without order?", "comb"),
    _g("math", "Which math function returns a float with the magnitude of x but the sign of y?", "copysign"),
    _g("hashlib", "Which hashlib function is the password based key derivation function 2 with HMAC?",
       "pbkdf2_hmac"),
    _g("hashlib", "Which hashlib function hashes the contents of a file-like object?", "file_digest"),
    _g("hmac", "Which hmac function compares two digests, returning 'a == b'?", "compare_digest"),
    _g("base64", "Which base64 function encodes a bytes-like object using Ascii85?", "a85encode"),
    _g("base64", "Which base64 function decodes a Base16 encoded bytes-like object or ASCII string?", "b16decode"),
    _g("zlib", "Which zlib function computes an Adler-32 checksum of data?", "adler32"),
    _g("zlib", "Which zlib function computes a CRC-32 checksum of data?", "crc32"),
    _g("subprocess", "Which subprocess function returns (exitcode, output) of executing a command in a shell?",
       "getstatusoutput"),
    _g("subprocess", "Which subprocess function runs a command with arguments and returns its output?",
       "check_output"),
    _g("dataclasses", "Which dataclasses function returns the fields of a dataclass instance as a new dictionary?",
       "asdict"),
    _g("dataclasses", "Which dataclasses function returns a new dynamically created dataclass?", "make_dataclass"),
    _g("dataclasses", "Which dataclasses function tells whether an object is a dataclass or an instance of one?",
       "is_dataclass"),
    _g("abc", "Which abc function recalculates the set of abstract methods of an abstract class?",
       "update_abstractmethods"),
    _g("abc", "Which abc function returns the current ABC cache token?", "get_cache_token"),
    _g("copy", "Which copy function performs a deep copy operation on arbitrary Python objects?", "deepcopy"),
    _g("pprint", "Which pprint function formats a Python object into a pretty-printed representation?", "pformat"),
    _g("uuid", "Which uuid function generates a random UUID?", "uuid4"),
    _g("uuid", "Which uuid function generates a UUID from the SHA-1 hash of a namespace UUID and a name?", "uuid5"),
    _g("uuid", "Which uuid function gets the hardware address as a 48-bit positive integer?", "getnode"),
    _g("traceback", "Which traceback function is like print_exc() but returns a string?", "format_exc"),
    _g("traceback", "Which traceback function clears all references to local variables in the frames of a "
                    "traceback?", "clear_frames"),
    _g("operator", "Which operator function returns the number of items in a which are, or which equal, b?",
       "countOf"),
)

# Questions over the GNU info manuals (grep, sed, gzip, time, bc, ed, diffutils): the second,
# non-Python corpus of the fidelity benchmark. No gold answers; fidelity is measured vs full prefill.
INFO_QUESTIONS: tuple[str, ...] = (
    "How do I make grep ignore case distinctions?",
    "What does grep's -v option do?",
    "How do I count the matching lines with grep?",
    "How do I print only the names of files that contain a match with grep?",
    "How does the s command of sed substitute text?",
    "How do I edit a file in place with sed?",
    "How do I delete lines that match a pattern with sed?",
    "How do I keep the original file when compressing with gzip?",
    "How do I decompress a .gz file?",
    "What does gzip's -9 option do?",
    "How do I change the output format of the time command?",
    "How do I set the number of digits after the decimal point in bc?",
    "How do I print the current line in ed?",
    "How do I produce a unified diff?",
    "How do I make diff ignore changes in the amount of white space?",
    "How do I compare two files side by side with diff?",
    "What does cmp report for two files that differ?",
    "How do I apply a patch made by diff?",
)


def gold_match(answer: str, gold: str) -> bool:
    """True when ``gold`` appears in ``answer`` as a whole word (case-insensitive)."""
    return re.search(r"(?<![\w])" + re.escape(gold.lower()) + r"(?![\w])", answer.lower()) is not None
