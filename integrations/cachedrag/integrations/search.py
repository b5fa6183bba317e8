"""Index search shared by the LlamaIndex and LangChain retrievers.

Owns: ``IndexSearcher`` over an index directory written by ``cachedrag index build``: one per
directory per process (``shared_searcher``), so every retriever instance over it shares the
loaded index, the embedder and the lookahead tiers. ``search(texts, k)`` embeds one or more
query texts and, when there are several (HyDE's hypothetical document plus the original
query, for example), searches with the **mean of their L2-normalised embeddings**, normalised
again (what LlamaIndex's own vector retriever does with ``embedding_strs``); the top-k chunks'
texts are registered with the chunk registry so the LLM classes find them in prompts.
``prefetch(original_query)`` starts TeleRAG's lookahead: the IVF clusters nearest the
original query move to the fast tier while the LLM transforms the query; searches merge the
fast and slow tiers and equal a plain IVF search whatever was prefetched.

Does not own: the index format, IVF search or the tiers (``cachedrag.retrieval``).
"""

from __future__ import annotations

import atexit
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cachedrag.prompt.registry import ChunkRegistry, chunk_registry

_RECENT_QUERIES = 64  # memoised query embeddings per searcher


@dataclass(frozen=True)
class SearchHit:
    rank: int
    score: float
    chunk_id: str
    doc_id: str
    chunk_index: int
    text: str
    char_start: int
    char_end: int

    def metadata(self) -> dict:
        return {"chunk_id": self.chunk_id, "doc_id": self.doc_id, "chunk_index": self.chunk_index,
                "score": self.score, "rank": self.rank, "char_start": self.char_start, "char_end": self.char_end}


class IndexSearcher:
    """Search one index directory with lookahead prefetch; registers what it returns."""

    def __init__(self, index_dir: str | Path, registry: ChunkRegistry | None = None):
        from cachedrag.retrieval.cluster_store import make_tiers
        from cachedrag.retrieval.index import load_index
        from cachedrag.retrieval.lookahead import LookaheadRetriever

        self.index = load_index(index_dir)
        self.registry = chunk_registry() if registry is None else registry
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        slow, fast = make_tiers(self.index.ivf, self.index.disk_store() if device.type == "cpu" else None, device)
        # as LookaheadRetriever.from_index, but queries embed through _embed: one embedding at a time
        # (a fast tokenizer must not be used by two threads at once) and recent texts memoised, so a
        # prefetch and the search of the same query embed it once
        self.lookahead = LookaheadRetriever(self.index.ivf.quantizer, slow, fast, self.index.ivf.cluster_nbytes(),
                                            chunk_ids=self.index.chunk_ids, embed=self._embed)
        self._prefetched: str | None = None
        self._lock = threading.Lock()
        self._embed_lock = threading.Lock()
        self._recent: OrderedDict[str, torch.Tensor] = OrderedDict()  # text -> [d]

    @property
    def nlist(self) -> int:
        return self.index.ivf.nlist

    def search(self, texts: str | Sequence[str], k: int, nprobe: int | None = None) -> list[SearchHit]:
        """Top-``k`` chunks for the combined query ``texts`` (see the module docstring)."""
        query, nprobe = self._query(texts, nprobe)  # [1, d]
        result = self.lookahead.search(query, k=k, nprobe=nprobe)
        hits = self._hits(result.scores, result.ids)
        self.registry.register(h.text for h in hits)
        return hits

    def search_stages(self, texts: str | Sequence[str], k: int, n_stages: int, nprobe: int | None = None):
        """``(stage index, hits, final)`` after each stage of a staged search (speculative
        pipelining); the final hits equal ``search``'s and are registered like them."""
        query, nprobe = self._query(texts, nprobe)  # [1, d]
        for stage in self.lookahead.search_stages(query, n_stages, k=k, nprobe=nprobe):
            hits = self._hits(stage.scores, stage.ids)
            if stage.final:
                self.registry.register(h.text for h in hits)
            yield stage.index, hits, stage.final

    def _query(self, texts: str | Sequence[str], nprobe: int | None) -> tuple[torch.Tensor, int]:
        """The query vector ``[1, d]`` of ``texts`` and the nprobe to search with."""
        if isinstance(texts, str):
            texts = [texts]
        texts = [t for t in texts if t and t.strip()]
        if not texts:
            raise ValueError("the query is empty")
        return self.query_vector(texts), min(nprobe or self.lookahead.search_config.nprobe, self.nlist)

    def _hits(self, scores: torch.Tensor, ids: torch.Tensor) -> list[SearchHit]:
        """Hits of the first query of ``scores``/``ids`` ``[B, k]``."""
        return [
            SearchHit(rank=h.rank, score=float(h.score), chunk_id=h.chunk.id, doc_id=h.chunk.doc_id,
                      chunk_index=h.chunk.index, text=h.chunk.text, char_start=h.chunk.char_start,
                      char_end=h.chunk.char_end)
            for h in self.index.hits(scores, ids)[0]
        ]

    def query_vector(self, texts: Sequence[str]) -> torch.Tensor:
        """``[1, d]``: the embedding of one text, or the renormalised mean of several normalised ones."""
        q = self._embed(list(texts))  # [B, d]
        if q.shape[0] == 1:
            return q
        q = torch.nn.functional.normalize(q, dim=-1).mean(0, keepdim=True)  # [1, d]
        return torch.nn.functional.normalize(q, dim=-1)

    def _embed(self, texts: str | Sequence[str]) -> torch.Tensor:
        """``[B, d]`` embeddings of ``texts``, serialised and memoised (the last few texts)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        with self._embed_lock:
            missing = [t for t in dict.fromkeys(texts) if t not in self._recent]
            if missing:
                for text, vec in zip(missing, self.index.embed(missing)):  # [d] each
                    self._recent[text] = vec
            for text in texts:
                self._recent.move_to_end(text)
            out = torch.stack([self._recent[t] for t in texts])  # [B, d]
            while len(self._recent) > _RECENT_QUERIES:
                self._recent.popitem(last=False)
        return out

    @property
    def last_prefetch_query(self) -> str | None:
        """The original query of the latest prefetch started here."""
        return self._prefetched

    def prefetch(self, original_query: str) -> bool:
        """Start the lookahead prefetch for ``original_query`` (once per distinct query); True if started."""
        if not original_query or not original_query.strip():
            return False
        with self._lock:
            if self._prefetched == original_query:
                return False
            self._prefetched = original_query
        self.lookahead.prefetch(original_query)
        return True

    def close(self) -> None:
        """Stop the prefetch threads and close the slow tier's files."""
        self.lookahead.close()
        close_slow = getattr(self.lookahead.slow, "close", None)
        if close_slow is not None:
            close_slow()


_SEARCHERS: dict[tuple[str, int], IndexSearcher] = {}
_SEARCHERS_LOCK = threading.Lock()


def shared_searcher(index_dir: str | Path, registry: ChunkRegistry | None = None) -> IndexSearcher:
    """The process-wide searcher of ``index_dir`` (reloaded if the directory was rebuilt)."""
    path = Path(index_dir).resolve()
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"{path} is not a cachedrag index directory (no manifest.json); "
                                "build one with `cachedrag index build`")
    key = (str(path), manifest.stat().st_mtime_ns)
    with _SEARCHERS_LOCK:
        searcher = _SEARCHERS.get(key)
        if searcher is None or (registry is not None and searcher.registry is not registry):
            searcher = IndexSearcher(path, registry)
            if registry is None:
                _SEARCHERS[key] = searcher
        return searcher


@atexit.register
def _close_shared() -> None:
    """Close shared searchers before interpreter teardown (their file handles and threads)."""
    with _SEARCHERS_LOCK:
        searchers = list(_SEARCHERS.values())
        _SEARCHERS.clear()
    for searcher in searchers:
        searcher.close()
