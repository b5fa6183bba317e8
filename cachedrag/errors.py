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


class DirectoryInUseError(CachedRAGError):
    """Another process (or another tier object) already owns this cache directory."""
