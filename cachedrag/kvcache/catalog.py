"""Catalog of stored segments: reading the engine's self-describing entry metadata back.

Owns: ``StoredSegment`` (one stored entry as the policy layer sees it, parsed from the string
metadata the engine writes with every entry: ``segment_key``, ``path``, ``role``, ``exact``,
``n_tokens`` and, for chunk variants, ``variant``), its consistency checks against the entry's
handle, ``variant_metadata`` (``AttentionMetadata`` from the parsed variant plus its
``token_inter`` values) and ``tree_order`` (which scanned exact segments can join the knowledge
tree, parents first). Pure Python: what a restarted or second process needs to rebuild its
tree and variant index from a store's headers (``ChunkCacheManager.refresh``).

Does not own: reading headers or tensors (the store's ``info`` / ``extras``), the tree or the
index themselves, or deciding what to evict.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachedrag.kvcache.keys import path_key
from cachedrag.kvcache.variants import AttentionMetadata

ROLES = ("system", "chunk")


class CatalogError(ValueError):
    """An entry's metadata is missing, malformed or inconsistent with its handle."""


@dataclass(frozen=True)
class StoredSegment:
    """One stored entry: the KV of ``path[-1]`` computed behind ``path[:-1]``.

    handle: the store key (``path_key(path)``). exact: computed on an exact prefix (the KV
    equals full prefill of ``path``), so it may be the knowledge-tree node at ``path``.
    variant: ``{"prefix_keys": [...], "inter": {key: mass}, "intra": x}`` of a chunk variant
    (its ``token_inter`` travels as a tensor), or None.
    """

    handle: str
    segment_key: str
    path: tuple[str, ...]
    role: str
    exact: bool
    n_tokens: int
    nbytes: int
    variant: Mapping[str, Any] | None = None

    @property
    def parent_handle(self) -> str | None:
        """Store key of the tree parent (``path_key(path[:-1])``), None for a first segment."""
        return path_key(self.path[:-1]) if len(self.path) > 1 else None

    @classmethod
    def parse(cls, handle: str, meta: Mapping[str, str], nbytes: int, n_tokens: int | None = None) -> StoredSegment:
        """Parse ``meta`` of the entry stored under ``handle``; raises ``CatalogError``.

        ``n_tokens``: the token count the store measured (tensor shape), checked against meta.
        """
        missing = [k for k in ("segment_key", "path", "role", "exact", "n_tokens") if k not in meta]
        if missing:
            raise CatalogError(f"entry {handle[:12]}: no engine metadata {missing}")
        try:
            path = json.loads(meta["path"])
            tokens = int(meta["n_tokens"])
        except (json.JSONDecodeError, ValueError) as exc:
            raise CatalogError(f"entry {handle[:12]}: bad path or n_tokens ({exc})") from None
        if not isinstance(path, list) or not path or not all(isinstance(k, str) and k for k in path):
            raise CatalogError(f"entry {handle[:12]}: path is not a non-empty list of keys")
        if path_key(path) != handle:
            raise CatalogError(f"entry {handle[:12]}: path does not hash to its handle")
        if path[-1] != meta["segment_key"]:
            raise CatalogError(f"entry {handle[:12]}: segment_key is not the last key of its path")
        if meta["role"] not in ROLES:
            raise CatalogError(f"entry {handle[:12]}: unknown role {meta['role']!r}")
        if tokens < 1 or (n_tokens is not None and n_tokens != tokens):
            raise CatalogError(f"entry {handle[:12]}: n_tokens {tokens} does not match its tensors ({n_tokens})")
        variant = None
        if "variant" in meta:
            variant = _parse_variant(handle, meta["variant"])
        return cls(handle, path[-1], tuple(path), meta["role"], meta["exact"] == "1", tokens, int(nbytes), variant)


def _parse_variant(handle: str, raw: str) -> dict[str, Any]:
    try:
        v = json.loads(raw)
        prefix = tuple(v["prefix_keys"])
        inter = {str(k): float(x) for k, x in dict(v["inter"]).items()}
        intra = float(v["intra"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CatalogError(f"entry {handle[:12]}: bad variant metadata ({exc!r})") from None
    if not all(isinstance(k, str) for k in prefix):
        raise CatalogError(f"entry {handle[:12]}: variant prefix_keys are not keys")
    return {"prefix_keys": prefix, "inter": inter, "intra": intra}


def variant_metadata(segment: StoredSegment, token_inter: Sequence[float]) -> AttentionMetadata:
    """The ``AttentionMetadata`` of a stored chunk variant; raises ``CatalogError``."""
    if segment.variant is None:
        raise CatalogError(f"entry {segment.handle[:12]}: not a variant")
    if len(token_inter) != segment.n_tokens:
        raise CatalogError(
            f"entry {segment.handle[:12]}: token_inter has {len(token_inter)} values for {segment.n_tokens} tokens"
        )
    v = segment.variant
    try:
        return AttentionMetadata(prefix_keys=v["prefix_keys"], inter=v["inter"], intra=v["intra"],
                                 token_inter=token_inter)
    except ValueError as exc:
        raise CatalogError(f"entry {segment.handle[:12]}: {exc}") from None


def tree_order(
    segments: Iterable[StoredSegment], in_tree: Callable[[tuple[str, ...]], bool]
) -> tuple[list[StoredSegment], list[StoredSegment]]:
    """Split exact ``segments`` into (insertable, orphans).

    Insertable, in insertion order (shorter paths first): every segment whose ancestors are all
    in the tree already (``in_tree(path)``) or insertable themselves, i.e. the longest chain of
    present ancestors from the root. Orphans: exact segments with a missing ancestor (their KV
    is only valid behind a prefix that is gone). Non-exact segments are ignored.
    """
    exact = sorted((s for s in segments if s.exact), key=lambda s: (len(s.path), s.path))
    known: set[tuple[str, ...]] = set()
    ok: list[StoredSegment] = []
    orphans: list[StoredSegment] = []
    for seg in exact:
        parent = seg.path[:-1]
        if not parent or parent in known or in_tree(parent):
            ok.append(seg)
            known.add(seg.path)
        else:
            orphans.append(seg)
    return ok, orphans
