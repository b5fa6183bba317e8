"""Exception types of cachedrag.

Owns: the error classes every part raises for bad input, so callers can catch one family
(`CachedRAGError`) or a specific problem. Does not own: logging or recovery policy.
"""

from __future__ import annotations


class CachedRAGError(Exception):
    """Base class of every error cachedrag raises on purpose."""


class UnsupportedModelError(CachedRAGError):
    """The model's architecture (or its rotary variant) is not one the runner can drive."""


class ModelNotFoundError(CachedRAGError):
    """A model file or directory is missing; the message says how to install it."""


class ContextWindowError(CachedRAGError):
    """A prompt (plus requested new tokens) does not fit in the model's context window."""


class EmptyInputError(CachedRAGError):
    """An empty question, corpus or chunk list where content is required."""


class IndexMismatchError(CachedRAGError):
    """An index was built with another embedding model or dimension than the one in use."""


class CorruptCacheError(CachedRAGError):
    """A cache file failed its checksum or format check; callers treat it as a miss."""


class ConfigError(CachedRAGError):
    """A configuration value is out of range or inconsistent."""


class InputError(CachedRAGError, ValueError):
    """A user-supplied file or argument is unusable: wrong format, not UTF-8, not an index..."""


class InputNotFoundError(CachedRAGError, FileNotFoundError):
    """A user-supplied path does not exist."""


def describe_validation_error(exc) -> str:
    """One line from a pydantic ``ValidationError``: ``field: message (got value)`` per problem,
    without pydantic's multi-line layout and documentation links."""
    parts = []
    for err in exc.errors():
        field = ".".join(str(x) for x in err.get("loc", ())) or "value"
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        parts.append(f"{field}: {msg}{got}")
    return "; ".join(parts)


class DirectoryInUseError(CachedRAGError):
    """Another process (or another tier object) already owns this cache directory."""
