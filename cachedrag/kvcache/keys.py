"""Chunk identity: namespaces and content keys.

Owns: ``Namespace`` (what a cache entry is valid for: model, dtype, tokenizer, optional tenant
salt) and the content keys derived from it: ``chunk_key(token_ids, namespace)`` for one
segment of tokens (a retrieved chunk or the system prefix) and ``path_key(keys)`` for an
ordered sequence of segment keys. Keys are sha256 hex strings, stable across processes,
platforms and Python versions (no ``hash()``, no pickle).

Does not own: tokenization (callers pass token ids), where entries are stored, or eviction.

Contract: a key is derived from the namespace digest, so a cache of one model, dtype,
tokenizer or tenant never serves another: any field that differs gives a different key.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from cachedrag.errors import ConfigError, EmptyInputError

_NAMESPACE_TAG = "cachedrag-namespace-v1"
_CHUNK_TAG = b"cachedrag-chunk-v1\x00"
_PATH_TAG = b"cachedrag-path-v1\x00"


@dataclass(frozen=True)
class Namespace:
    """What a cached chunk is valid for.

    model_fingerprint: identifies the weights (e.g. a hash of the weight file or config + name).
    dtype: the KV dtype, e.g. ``"float32"``; a bf16 cache must not serve an fp32 model.
    tokenizer_fingerprint: identifies the tokenizer (the same ids mean other text elsewhere).
    tenant_salt: optional; isolates tenants that must not share caches (None = shared).

    >>> ns = Namespace("smollm2-135m@abc", "float32", "tok@def")
    >>> len(ns.digest)
    64
    """

    model_fingerprint: str
    dtype: str
    tokenizer_fingerprint: str
    tenant_salt: str | None = None

    def __post_init__(self) -> None:
        for name in ("model_fingerprint", "dtype", "tokenizer_fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"Namespace.{name} must be a non-empty string, got {value!r}")
        if self.tenant_salt is not None and not isinstance(self.tenant_salt, str):
            raise ConfigError(f"Namespace.tenant_salt must be a string or None, got {self.tenant_salt!r}")

    @cached_property
    def digest(self) -> str:
        """sha256 hex of a canonical JSON of the fields (stable across runs and machines)."""
        payload = json.dumps(
            {
                "tag": _NAMESPACE_TAG,
                "model": self.model_fingerprint,
                "dtype": self.dtype,
                "tokenizer": self.tokenizer_fingerprint,
                "tenant": self.tenant_salt,
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def chunk_key(token_ids: Iterable[int], namespace: Namespace) -> str:
    """sha256 hex over (tag, namespace digest, token count, token ids as little-endian int64).

    ``token_ids`` is any sequence of ints (list, tuple, array; numpy/torch integer scalars work
    through ``__index__``; pass ``tensor.tolist()`` for a tensor). Empty input is an error.
    """
    ids = token_ids if isinstance(token_ids, Sequence) else list(token_ids)
    n = len(ids)
    if n == 0:
        raise EmptyInputError("chunk_key: a chunk needs at least one token id")
    try:
        packed = struct.pack(f"<{n}q", *ids)
    except struct.error as exc:
        raise ValueError(f"chunk_key: token ids must be integers in int64 range ({exc})") from None
    h = hashlib.sha256(_CHUNK_TAG)
    h.update(bytes.fromhex(namespace.digest))
    h.update(struct.pack("<Q", n))
    h.update(packed)
    return h.hexdigest()


def path_key(keys: Iterable[str]) -> str:
    """sha256 hex of an ordered sequence of segment keys (order matters; empty path allowed)."""
    h = hashlib.sha256(_PATH_TAG)
    count = 0
    for key in keys:
        raw = key.encode("utf-8")
        h.update(struct.pack("<Q", len(raw)))
        h.update(raw)
        count += 1
    h.update(struct.pack("<Q", count))
    return h.hexdigest()
