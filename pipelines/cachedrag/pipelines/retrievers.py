"""The retrieval seam of the pipelines: lookahead search, the plain Faiss baseline, chunk warming.

Owns: ``SearchResult`` (chunk texts and ids per query, seconds, tier stats), and

- ``LookaheadSearch``: a ``LookaheadRetriever`` + its ``RetrievalIndex``; ``prefetch(original)``
  starts copying the clusters nearest the original question to the fast tier while the LLM
  transforms the query, ``search(transformed)`` merges the fast and slow tiers;
- ``FaissDiskSearch``: **the plain baseline** — Faiss on the CPU over the disk-backed index,
  sequential: per query, Faiss's coarse quantizer picks the ``nprobe`` lists, those lists are
  read from the index files (cold when the page cache was dropped) and Faiss scores them
  (``faiss.knn`` over the read vectors: what ``IndexIVFFlat`` over on-disk inverted lists does,
  with reads we can make cold); ``prefetch`` does nothing;
- ``ChunkWarmer``: the chunk-KV lookahead hook (``on_candidates``): plans the prefetched
  candidate chunks against the engine's chunk cache and asks the store to move their cached
  KV toward its fastest tier (a ``TieredStore`` with a slower tier; a no-op for one RAM tier).

Does not own: IVF search, tiers, prefetch planning (``cachedrag.retrieval``) or the chunk
cache (``cachedrag.kvcache``/``cachedrag.store``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from cachedrag.errors import ConfigError


@dataclass
class SearchResult:
    """Top-k chunks of each query (best first)."""

    chunks: list[list[str]]  # chunk texts
    chunk_ids: list[list[str]]
    seconds: float  # wall time of the search, query embedding included
    info: dict = field(default_factory=dict)


@runtime_checkable
class PipelineRetriever(Protocol):
    def prefetch(self, query: str) -> None: ...

    def search(self, queries: Sequence[str], k: int) -> SearchResult: ...

    def prefetch_report(self) -> dict | None: ...


class LookaheadSearch:
    """Lookahead retrieval for pipelines (TeleRAG): prefetch on the original query, search the rewrite.

    >>> search = LookaheadSearch.from_index(load_index("idx"))   # doctest: +SKIP
    >>> search.prefetch("what does heapq do?")                     # returns at once
    >>> search.search(["heapq is a heap queue ..."], k=4).chunks   # doctest: +SKIP
    """

    def __init__(self, retriever, index, nprobe: int | None = None, warmer: "ChunkWarmer | None" = None):
        self.retriever = retriever
        self.index = index
        self.nprobe = nprobe
        self.warmer = warmer
        self._handle = None

    @classmethod
    def from_index(cls, index, *, device=None, config=None, nprobe: int | None = None, engine=None,
                   system_prompt: str | None = None) -> "LookaheadSearch":
        """Tiers over a saved index (disk -> RAM on CPU). With ``engine``, the candidates of each
        prefetch are warmed in its chunk cache (``ChunkWarmer``)."""
        from cachedrag.retrieval.lookahead import LookaheadRetriever

        warmer = ChunkWarmer(engine, index, system_prompt) if engine is not None else None
        retriever = LookaheadRetriever.from_index(index, device=device, config=config, on_candidates=warmer)
        return cls(retriever, index, nprobe or default_nprobe(index), warmer)

    def prefetch(self, query: str) -> None:
        self._handle = self.retriever.prefetch(query)

    def search(self, queries: Sequence[str], k: int) -> SearchResult:
        start = time.perf_counter()
        result = self.retriever.search(list(queries), k=k, nprobe=self.nprobe)
        hits = self.index.hits(result.scores, result.ids)
        info = {"hit_rate": result.hit_rate, "hit_clusters": len(result.hit_clusters),
                "missed_clusters": len(result.missed_clusters), "fast_ms": result.fast_ms, "slow_ms": result.slow_ms,
                "search_ms": result.total_ms, "probe": result.probe.tolist()}
        if result.prefetch_error:
            info["prefetch_error"] = result.prefetch_error
        return SearchResult([[h.chunk.text for h in row] for row in hits], [[h.chunk.id for h in row] for row in hits],
                            time.perf_counter() - start, info)

    def stage_search(self, queries: Sequence[str], k: int):
        """A ``cachedrag.pipelining.StageSearch`` of ``queries`` (staged search, fast tier first):
        each stage's chunk texts of the first query; the final stage's ``payload`` is the
        ``SearchResult`` of every query (the same top-k as ``search``)."""
        from cachedrag.pipelining import StageTopK

        def run(n_stages: int):
            start = time.perf_counter()
            for stage in self.retriever.search_stages(list(queries), n_stages, k=k, nprobe=self.nprobe):
                hits = self.index.hits(stage.scores, stage.ids)
                texts = [[h.chunk.text for h in row] for row in hits]
                payload = None
                if stage.final:
                    seconds = time.perf_counter() - start
                    payload = SearchResult(texts, [[h.chunk.id for h in row] for row in hits], seconds,
                                           {"search_ms": seconds * 1e3, "stages": stage.index + 1})
                yield StageTopK(stage.index, tuple(texts[0]), stage.final, payload)

        return run

    def prefetch_report(self) -> dict | None:
        """What the last prefetch did (waits for it to end); ``error`` when it failed."""
        handle = self._handle
        if handle is None:
            return None
        handle.join()
        if handle.error() is not None:
            return {"error": f"{type(handle.error()).__name__}: {handle.error()}"}
        r = handle.wait()
        return {"elapsed_ms": r.elapsed_ms, "embed_ms": r.embed_ms, "clusters": list(r.clusters),
                "copied_clusters": len(r.copied), "copied_bytes": r.copied_bytes, "budget_bytes": r.budget_bytes,
                "cancelled": r.cancelled, "candidates": len(r.candidates)}

    def reset(self) -> None:
        """Empty the fast tier (benchmarks: every request starts cold)."""
        self.retriever.clear_fast_tier()
        self._handle = None

    def drop_page_cache(self) -> None:
        self.retriever.slow.drop_page_cache()

    def close(self) -> None:
        self.retriever.close()


class FaissDiskSearch:
    """BASELINE retrieval: plain Faiss CPU search over the disk-backed index, no prefetch.

    ``search`` embeds the queries, assigns ``nprobe`` lists with Faiss's flat quantizer over
    the centroids, reads the probed lists from the index directory and ranks them with
    ``faiss.knn`` (same top-k as ``IndexIVFFlat`` at the same nprobe, up to ties).
    """

    def __init__(self, index, nprobe: int | None = None):
        import faiss

        from cachedrag.retrieval.ivf import check_nprobe

        self.index = index
        self.nprobe = nprobe or default_nprobe(index)
        check_nprobe(self.nprobe, index.ivf.nlist)
        self.disk = index.disk_store()
        centroids = index.ivf.quantizer.centroids.cpu().numpy()  # [nlist, d]
        self._ip = index.manifest.metric == "ip"
        self.quantizer = faiss.IndexFlatIP(centroids.shape[1]) if self._ip else faiss.IndexFlatL2(centroids.shape[1])
        self.quantizer.add(centroids)
        self._metric = faiss.METRIC_INNER_PRODUCT if self._ip else faiss.METRIC_L2

    def prefetch(self, query: str) -> None:
        """The baseline is sequential: nothing is prefetched."""

    def prefetch_report(self) -> dict | None:
        return None

    def search(self, queries: Sequence[str], k: int) -> SearchResult:
        import faiss
        import numpy as np

        start = time.perf_counter()
        q = self.index.embed(list(queries)).numpy()  # [B, d]
        searched = time.perf_counter()
        _, probe = self.quantizer.search(q, self.nprobe)  # [B, nprobe]
        t_read = 0.0
        texts, ids = [], []
        for i, row in enumerate(probe.tolist()):
            t0 = time.perf_counter()
            blocks = self.disk.get([c for c in row if c >= 0])
            t_read += time.perf_counter() - t0
            xb = np.concatenate([b.vectors.numpy() for b in blocks.values()])  # [n, d]
            rows = np.concatenate([b.ids.numpy() for b in blocks.values()])  # [n]
            _, found = faiss.knn(q[i:i + 1], xb, min(k, len(rows)), metric=self._metric)  # [1, k]
            chunks = [self.index.chunks[int(rows[j])] for j in found[0] if j >= 0]
            texts.append([c.text for c in chunks])
            ids.append([c.id for c in chunks])
        info = {"search_ms": (time.perf_counter() - searched) * 1e3, "read_ms": t_read * 1e3, "probe": probe.tolist()}
        return SearchResult(texts, ids, time.perf_counter() - start, info)

    def reset(self) -> None:
        pass

    def drop_page_cache(self) -> None:
        self.disk.drop_page_cache()

    def close(self) -> None:
        pass


class ChunkWarmer:
    """``on_candidates`` hook: warm the engine's chunk caches of the prefetched candidate chunks.

    Plans the candidates as a request (the chunk layout after ``system_prompt``) against the
    engine's chunk-cache manager and calls ``manager.prefetch(plan)``: a ``TieredStore``
    starts moving their cached KV toward its fastest tier; a store without ``prefetch`` (the
    default single RAM tier) makes it a no-op. Chunks that are not cached are not computed
    here: on a CPU that would compete with the LLM's query transformation for the same cores.
    Counts what it did in ``stats``.
    """

    def __init__(self, engine, index, system_prompt: str | None = None):
        from cachedrag.pipelines.prompts import ANSWER

        self.engine = engine
        self.system_prompt = system_prompt if system_prompt is not None else ANSWER.system
        self._text = {c.id: c.text for c in index.chunks}
        self._lock = threading.Lock()
        self.stats = {"calls": 0, "candidates": 0, "cached": 0, "prefetches": 0}

    def __call__(self, chunk_ids: list[str]) -> None:
        from cachedrag.kvcache.planner import Action, PlanRequest
        from cachedrag.kvcache.planner import Segment as PlanSegment

        texts = [self._text[c] for c in chunk_ids if c in self._text]
        if not texts:
            return
        prompts = self.engine.prompts
        before, _ = prompts.template_split(self.system_prompt)
        system = [prompts.segment("text", before)] if before else []
        chunks = [prompts.chunk_segment(t) for t in texts if t.strip()]
        request = PlanRequest(system=tuple(PlanSegment(s.key, len(s)) for s in system),
                              chunks=tuple(PlanSegment(s.key, len(s)) for s in chunks), question_tokens=1)
        manager = self.engine.manager
        plan = manager.plan(request, self.engine.config.mode)
        try:
            handle = manager.prefetch(plan)
        finally:
            manager.release(plan, used=False)
        cached = sum(s.action in (Action.TREE, Action.REUSE) for s in plan.segments if s.role == "chunk")
        with self._lock:
            self.stats["calls"] += 1
            self.stats["candidates"] += len(chunks)
            self.stats["cached"] += cached
            self.stats["prefetches"] += int(handle is not None)


def default_nprobe(index) -> int:
    """``SearchConfig``'s nprobe, at most the index's nlist (small indexes)."""
    from cachedrag.retrieval.config import SearchConfig

    return min(SearchConfig().nprobe, index.ivf.nlist)


def as_retriever(obj) -> PipelineRetriever:
    """A ``RetrievalIndex`` -> ``LookaheadSearch.from_index``; a pipeline retriever as is."""
    if all(callable(getattr(obj, name, None)) for name in ("prefetch", "search", "prefetch_report")):
        return obj
    from cachedrag.retrieval.index import RetrievalIndex

    if isinstance(obj, RetrievalIndex):
        return LookaheadSearch.from_index(obj)
    from cachedrag.retrieval.lookahead import LookaheadRetriever

    if isinstance(obj, LookaheadRetriever):
        raise ConfigError("a LookaheadRetriever returns chunk rows, not texts: pass LookaheadSearch(retriever, index)")
    raise ConfigError(f"expected a RetrievalIndex or a pipeline retriever, got {type(obj).__name__}")
