"""Gold question-answer sets for the fidelity benchmark, and the GNU-info question stream.

Owns: ``STDLIB_GOLD`` (124 questions over the embedded stdlib corpus, each answered by a short
span, a function or class name, that the module's pydoc text states next to the description the
question paraphrases), ``INFO_QUESTIONS`` (questions over the GNU info manuals corpus,
``cachedrag.corpus.info_corpus``; no gold answers), and ``gold_match`` (task accuracy: the gold
span appears in an answer as a whole word, case-insensitive). Does not own the corpora.

Each gold item names its document so the benchmark can put the chunk holding the answer in the
retrieved set (the task measures reading, not retrieval); ``tests/bench/test_fidelity.py`` checks
that every answer is in its module's text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cachedrag.corpus import INFO_TOPICS


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
    # Added in round 7 (issue 15: a gold set large enough to resolve task accuracy); all 74 written and
    # committed before any measurement on them. Each was checked offline to be stated in the chunk
    # the benchmark puts in the retrieved set (the first 256-token chunk of its module holding the answer).
    _g("heapq", "Which heapq function finds the n smallest elements in a dataset?", "nsmallest"),
    _g("heapq", "Which heapq function pops the smallest item from the heap?", "heappop"),
    _g("functools", "Which functools function updates a wrapper function to look like the wrapped "
                    "function?", "update_wrapper"),
    _g("functools", "Which functools function applies a function of two arguments cumulatively to the items of an "
                    "iterable, from left to right?", "reduce"),
    _g("pprint", "Which pprint function generates a repr()-like value but protects against recursive data "
                 "structures?", "saferepr"),
    _g("pprint", "Which pprint function determines if an object requires a recursive representation?", "isrecursive"),
    _g("pprint", "Which pprint function determines if saferepr(object) is readable by eval()?", "isreadable"),
    _g("tempfile", "Which tempfile function returns tempfile.tempdir as str?", "gettempdir"),
    _g("base64", "Which base64 function encodes bytes using the URL- and filesystem-safe Base64 "
                 "alphabet?", "urlsafe_b64encode"),
    _g("base64", "Which base64 function encodes a bytes-like object using base32hex?", "b32hexencode"),
    _g("base64", "Which base64 function encodes a bytes-like object in base85 format?", "b85encode"),
    _g("base64", "Which base64 function decodes an Ascii85 encoded bytes-like object or ASCII string?", "a85decode"),
    _g("zlib", "Which zlib function returns a compressor object?", "compressobj"),
    _g("zlib", "Which zlib function returns a decompressor object?", "decompressobj"),
    _g("statistics", "Which statistics function is the fast, floating point arithmetic mean?", "fmean"),
    _g("statistics", "Which statistics function returns the harmonic mean of data?", "harmonic_mean"),
    _g("statistics", "Which statistics function returns the median, or 50th percentile, of grouped "
                     "data?", "median_grouped"),
    _g("statistics", "Which statistics function returns a list of the most common values of data?", "multimode"),
    _g("statistics", "Which statistics function divides data into intervals with equal probability?", "quantiles"),
    _g("statistics", "Which statistics function returns the population standard deviation of data?", "pstdev"),
    _g("statistics", "Which statistics function returns the population variance of data?", "pvariance"),
    _g("math", "Which math function returns the integer part of the square root of its input?", "isqrt"),
    _g("math", "Which math function counts the ways to choose k items from n items without repetition and with "
               "order?", "perm"),
    _g("math", "Which math function returns an accurate floating point sum of values in an iterable?", "fsum"),
    _g("math", "Which math function returns the natural logarithm of 1+x, accurate for x near zero?", "log1p"),
    _g("math", "Which math function returns the next floating-point value after x towards y?", "nextafter"),
    _g("math", "Which math function returns the value of the least significant bit of the float x?", "ulp"),
    _g("math", "Which math function returns exp(x)-1 while avoiding the loss of precision for small x?", "expm1"),
    _g("math", "Which math function returns the least common multiple of integers?", "lcm"),
    _g("math", "Which math function returns the mantissa and exponent of x as a pair (m, e)?", "frexp"),
    _g("math", "Which math function determines whether two floating point numbers are close in value?", "isclose"),
    _g("shutil", "Which shutil function copies data from a file-like object fsrc to a file-like object "
                 "fdst?", "copyfileobj"),
    _g("shutil", "Which shutil function returns a list of supported formats for unpacking?", "get_unpack_formats"),
    _g("shutil", "Which shutil function can be used as copytree()'s ignore parameter?", "ignore_patterns"),
    _g("shutil", "Which shutil function changes the owner user and group of the given path?", "chown"),
    _g("subprocess", "Which subprocess function runs a command, waits for it to complete and raises "
                     "CalledProcessError if the return code is not 0?", "check_call"),
    _g("subprocess", "Which subprocess function returns the output (stdout or stderr) of executing a command in a "
                     "shell, without the exit code?", "getoutput"),
    _g("dataclasses", "Which dataclasses function returns the fields of a dataclass instance as a new tuple of field "
                      "values?", "astuple"),
    _g("traceback", "Which traceback function formats only the exception part of a "
                    "traceback?", "format_exception_only"),
    _g("traceback", "Which traceback function walks a traceback yielding the frame and line number for each "
                    "frame?", "walk_tb"),
    _g("traceback", "Which traceback function extracts the raw traceback from the current stack "
                    "frame?", "extract_stack"),
    _g("operator", "Which operator function returns the first index of b in a?", "indexOf"),
    _g("operator", "Which operator function returns an estimate of the number of items in obj?", "length_hint"),
    _g("operator", "Which operator function is the same as a + b, for a and b sequences?", "concat"),
    _g("operator", "Which operator function is the same as b in a (note the reversed operands)?", "contains"),
    _g("operator", "Which operator function is the same as a @ b?", "matmul"),
    _g("csv", "Which csv function returns the dialect instance associated with a name?", "get_dialect"),
    _g("csv", "Which csv function deletes the name/dialect mapping associated with a string "
              "name?", "unregister_dialect"),
    _g("itertools", "Which itertools function splits one iterator into n independent iterators?", "tee"),
    _g("itertools", "Which itertools function returns the elements of a sequence for which the predicate is "
                    "False?", "filterfalse"),
    _g("itertools", "Which itertools function returns the elements of a sequence starting when the predicate "
                    "fails?", "dropwhile"),
    _g("itertools", "Which itertools function returns seq[0], seq[1], ... until the predicate fails?", "takewhile"),
    _g("itertools", "Which itertools function returns overlapping pairs (s[0],s[1]), (s[1],s[2]), ... of its "
                    "input?", "pairwise"),
    _g("itertools", "Which itertools function calls a function with each argument tuple of a sequence, fun(*seq[0]), "
                    "fun(*seq[1]), ...?", "starmap"),
    _g("itertools", "Which itertools function returns (p[0], q[0]), (p[1], q[1]), ... over several iterables until "
                    "the longest is exhausted?", "zip_longest"),
    _g("itertools", "Which itertools function returns series of accumulated sums, p0, p0+p1, p0+p1+p2?", "accumulate"),
    _g("collections", "Which collections container is list-like with fast appends and pops on either end?", "deque"),
    _g("collections", "Which collections class creates a single view of multiple mappings?", "ChainMap"),
    _g("collections", "Which collections dict subclass counts hashable objects?", "Counter"),
    _g("collections", "Which collections dict subclass remembers the order entries were added?", "OrderedDict"),
    _g("collections", "Which collections dict subclass calls a factory function to supply missing "
                      "values?", "defaultdict"),
    _g("collections", "Which collections factory function creates tuple subclasses with named fields?", "namedtuple"),
    _g("inspect", "Which inspect function gets the members of an object that satisfy a given condition?", "getmembers"),
    _g("inspect", "Which inspect function arranges classes so as to represent their hierarchy?", "getclasstree"),
    _g("inspect", "Which inspect function gets the current stack frame?", "currentframe"),
    _g("inspect", "Which inspect function safely computes an object's annotations?", "get_annotations"),
    _g("difflib", "Which difflib function uses SequenceMatcher to return a list of the best good enough "
                  "matches?", "get_close_matches"),
    _g("difflib", "Which difflib function returns one of the two sequences that generated an ndiff delta?", "restore"),
    _g("difflib", "Which difflib function returns a delta in unified diff format for two lists of "
                  "strings?", "unified_diff"),
    _g("difflib", "Which difflib function returns a delta in context diff format for two lists of "
                  "strings?", "context_diff"),
    _g("difflib", "Which difflib class produces an HTML side by side comparison with change highlights?", "HtmlDiff"),
    _g("json", "Which json exception is a subclass of ValueError with msg, doc and pos properties?", "JSONDecodeError"),
    _g("gzip", "Which gzip exception is raised in some cases for invalid gzip files?", "BadGzipFile"),
    _g("traceback", "Which traceback function formats a list of tuples or FrameSummary objects for "
                    "printing?", "format_list"),
)

# Questions over the GNU info manuals (grep, sed, gzip, time, bc, ed, diffutils): the second,
# non-Python corpus of the fidelity benchmark, one per topic of the info stream (its first phrasing).
# No gold answers; fidelity is measured vs full prefill.
INFO_QUESTIONS: tuple[str, ...] = tuple(topic[0] for topic in INFO_TOPICS)


def gold_match(answer: str, gold: str) -> bool:
    """True when ``gold`` appears in ``answer`` as a whole word (case-insensitive)."""
    return re.search(r"(?<![\w])" + re.escape(gold.lower()) + r"(?![\w])", answer.lower()) is not None
