"""Lookahead retrieval (TeleRAG): prefetch clusters while the LLM rewrites the query.

Owns: ``LookaheadRetriever`` and its three visible stages —
prepare: ``prefetch(original_query)`` plans whole clusters nearest the original query (centroid
order, up to the byte budget; ``policy.plan_prefetch``) and copies them slow -> fast tier on a
background thread, then hands the best chunks of those clusters to ``on_candidates`` so the
engine can preload their KV;
compute: ``search(transformed_query)`` assigns clusters, searches the prefetched ones in the
fast tier and the missed ones in the slow tier concurrently;
merge: one top-k by score (``ivf.merge_topk``).
Also the profile-guided budget (``measure_bandwidth`` + ``policy.prefetch_budget``) and
staged search over the tiers. Does not own: tier storage (``cluster_store``), the search
kernels (``ivf``) or the chunk KV store the hook feeds (the engine's).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from cachedrag.errors import ConfigError
from cachedrag.executor import TransientThreadExecutor
from cachedrag.retrieval.cluster_store import ClusterStore, MemoryClusterStore, make_tiers
from cachedrag.retrieval.config import LookaheadConfig, SearchConfig
from cachedrag.retrieval.ivf import ClusterBlock, Quantizer, Stage, empty_result, merge_topk, search_blocks, staged_search
from cachedrag.retrieval.policy import hit_fraction, plan_prefetch, prefetch_budget

Query = str | Sequence[str] | torch.Tensor | np.ndarray


@dataclass(frozen=True)
class PrefetchReport:
    """What one prefetch did."""

    clusters: tuple[int, ...]  # planned clusters, nearest first (resident unless cancelled)
    copied: tuple[int, ...]  # clusters moved slow -> fast by this prefetch
    copied_bytes: int
    planned_bytes: int
    budget_bytes: int
    elapsed_ms: float  # from prefetch() to the end of the copy (and of the hook)
    embed_ms: float  # of which: until the query vector was ready (embedding, for text queries)
    cancelled: bool
    candidates: tuple[str, ...]  # chunk ids passed to on_candidates


class PrefetchHandle:
    """A prefetch running in the background."""

    def __init__(self, future: Future, cancel_event: threading.Event):
        self._future = future
        self._cancel = cancel_event

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        """Stop after the cluster being copied now (already resident clusters stay)."""
        self._cancel.set()

    def wait(self, timeout: float | None = None) -> PrefetchReport:
        """The report; re-raises an error of the prefetch thread (or of ``on_candidates``)."""
        return self._future.result(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the prefetch to end without raising its error (``error()`` tells it)."""
        self._future.exception(timeout)

    def error(self) -> BaseException | None:
        """The prefetch thread's error, if it finished with one."""
        return self._future.exception() if self._future.done() else None


@dataclass(frozen=True)
class LookaheadResult:
    """Top-k of a tiered search plus where its clusters came from."""

    scores: torch.Tensor  # [B, k] (CPU)
    ids: torch.Tensor  # [B, k] (CPU), -1 = padding
    probe: torch.Tensor  # [B, nprobe] clusters probed, nearest first
    hit_clusters: tuple[int, ...]  # probed clusters served by the fast tier
    missed_clusters: tuple[int, ...]  # probed clusters read from the slow tier
    hit_rate: float  # mean over queries of the fraction of probed clusters in the fast tier
    fast_ms: float  # fast-tier search
    slow_ms: float  # slow-tier read + search (runs concurrently with the fast tier)
    total_ms: float  # assign + both tiers + merge (query embedding excluded)
    prefetch: PrefetchReport | None  # the last prefetch, when it had finished
    prefetch_error: str | None  # why the last prefetch failed (results are still complete)


@dataclass(frozen=True)
class BandwidthProfile:
    """A measured slow -> fast copy rate."""

    nbytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")


class LookaheadRetriever:
    """IVF search over a slow and a fast tier with lookahead prefetch.

    One retriever serves one request's lookahead at a time: a new ``prefetch`` cancels the
    previous one and re-plans the fast tier (clusters already there and still planned stay);
    ``search`` cancels a running prefetch (``cancel_prefetch_on_search``). Searches are
    thread-safe and batched; give concurrent pipelines one retriever each.

    >>> retriever = LookaheadRetriever.from_index(load_index("idx"))   # doctest: +SKIP
    >>> handle = retriever.prefetch("what does heapq do?")              # doctest: +SKIP
    >>> rewritten = llm_rewrite("what does heapq do?")                   # doctest: +SKIP
    >>> result = retriever.search(rewritten)                             # doctest: +SKIP
    """

    def __init__(
        self,
        quantizer: Quantizer,
        slow: ClusterStore,
        fast: MemoryClusterStore,
        cluster_nbytes: Sequence[int],
        config: LookaheadConfig | None = None,
        search_config: SearchConfig | None = None,
        chunk_ids: Sequence[str] | None = None,
        embed: Callable[[Query], torch.Tensor] | None = None,
        on_candidates: Callable[[list[str]], None] | None = None,
    ):
        assert len(cluster_nbytes) == quantizer.nlist, (len(cluster_nbytes), quantizer.nlist)
        self.quantizer = quantizer
        self.slow = slow
        self.fast = fast
        self.cluster_nbytes = list(cluster_nbytes)
        self.config = config or LookaheadConfig()
        if search_config is None:  # the default nprobe, clamped to a small index's nlist (an explicit one is checked)
            default = SearchConfig()
            search_config = default.model_copy(update={"nprobe": min(default.nprobe, quantizer.nlist)})
        self.search_config = search_config
        self.chunk_ids = list(chunk_ids) if chunk_ids is not None else None
        self.on_candidates = on_candidates
        self._embed_fn = embed
        # threads that exit when idle: a live thread that ran torch ops halves CPU decode speed (executor.py)
        self._prefetch_pool = TransientThreadExecutor(1, thread_name_prefix="cachedrag-prefetch")
        self._slow_pool = TransientThreadExecutor(1, thread_name_prefix="cachedrag-slow-search")
        self._current: PrefetchHandle | None = None

    @classmethod
    def from_index(
        cls,
        index,
        device: torch.device | str | None = None,
        config: LookaheadConfig | None = None,
        search_config: SearchConfig | None = None,
        on_candidates: Callable[[list[str]], None] | None = None,
    ) -> "LookaheadRetriever":
        """Tiers for ``device`` over a saved ``RetrievalIndex`` (see ``cluster_store.make_tiers``)."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        disk = index.disk_store() if device.type == "cpu" else None
        slow, fast = make_tiers(index.ivf, disk, device)
        return cls(
            index.ivf.quantizer,
            slow,
            fast,
            index.ivf.cluster_nbytes(),
            config=config,
            search_config=search_config,
            chunk_ids=index.chunk_ids,
            embed=index.embed,
            on_candidates=on_candidates,
        )

    # -- prepare -------------------------------------------------------------------------------

    def prefetch(self, original_query: Query) -> PrefetchHandle:
        """Start moving the clusters nearest ``original_query`` to the fast tier; returns at once.

        A prefetch still running from an earlier request is cancelled first.
        """
        if self._current is not None:
            self._current.cancel()
        cancel = threading.Event()
        started = time.perf_counter()
        future = self._prefetch_pool.submit(self._prefetch, original_query, cancel, started)
        self._current = PrefetchHandle(future, cancel)
        return self._current

    def _prefetch(self, query: Query, cancel: threading.Event, started: float) -> PrefetchReport:
        q = self._embed(query)[:1]  # [1, d]
        embed_ms = (time.perf_counter() - started) * 1e3
        order = self.quantizer.order(q)[0].tolist()  # nlist cluster ids, nearest first
        plan = plan_prefetch(order, self.cluster_nbytes, self.config.budget_bytes, self.fast.cluster_ids())
        for cid in plan.to_evict:
            self.fast.remove(cid)
        copied = []
        read = getattr(self.slow, "read", self.slow.get)  # a memory-mapped tier's get() returns views
        for cid in plan.to_copy:
            if cancel.is_set():
                break
            self.fast.put(cid, read([cid])[cid])
            copied.append(cid)
        cancelled = cancel.is_set()
        candidates: tuple[str, ...] = ()
        if not cancelled and self.on_candidates is not None and self.config.candidate_chunks > 0:
            candidates = tuple(self._candidates(q, plan.clusters))
            self.on_candidates(list(candidates))
        return PrefetchReport(
            clusters=plan.clusters,
            copied=tuple(copied),
            copied_bytes=sum(self.cluster_nbytes[c] for c in copied),
            planned_bytes=plan.planned_bytes,
            budget_bytes=plan.budget_bytes,
            elapsed_ms=(time.perf_counter() - started) * 1e3,
            embed_ms=embed_ms,
            cancelled=cancelled,
            candidates=candidates,
        )

    def _candidates(self, q: torch.Tensor, clusters: Sequence[int]) -> list[str]:
        """Top-m chunk ids of the prefetched clusters for the original query ``q [1, d]``."""
        if not clusters:
            return []
        if self.chunk_ids is None:
            raise ConfigError("on_candidates needs the retriever's chunk_ids")
        device = self.fast.device
        probe = torch.tensor([list(clusters)], device=device)  # [1, P]
        _, ids = search_blocks(q.to(device), probe, self.fast.get(clusters), self.config.candidate_chunks, self.quantizer.metric)
        return [self.chunk_ids[i] for i in ids[0].tolist() if i >= 0]

    # -- compute + merge ---------------------------------------------------------------------

    def search(self, transformed_query: Query, k: int | None = None, nprobe: int | None = None) -> LookaheadResult:
        """Top-k over the probed clusters: fast tier and slow tier concurrently, then merged.

        Equal to a plain IVF search whatever was prefetched (only the latency differs).
        """
        k = k or self.search_config.k
        nprobe = nprobe or self.search_config.nprobe
        q = self._embed(transformed_query)  # [B, d]
        if self.config.cancel_prefetch_on_search and self._current is not None:
            self._current.cancel()
        t0 = time.perf_counter()
        probe = self.quantizer.assign(q, nprobe)  # [B, nprobe]
        wanted = torch.unique(probe).tolist()
        fast_blocks = self.fast.get(wanted)  # snapshot: later prefetch copies do not matter
        missed = [c for c in wanted if c not in fast_blocks]
        slow_future = self._slow_pool.submit(self._search_tier, q, probe, self.slow, missed, k) if missed else None
        parts, fast_ms, slow_ms = [], 0.0, 0.0
        if fast_blocks:
            fast_part, fast_ms = self._search_blocks_timed(q, probe, fast_blocks, k)
            parts.append(fast_part)
        if slow_future is not None:
            slow_part, slow_ms = slow_future.result()
            parts.append(slow_part)
        scores, ids = merge_topk(parts, k) if len(parts) > 1 else (parts[0] if parts else empty_result(q.shape[0], k))
        total_ms = (time.perf_counter() - t0) * 1e3
        resident = frozenset(fast_blocks)
        return LookaheadResult(
            scores=scores,
            ids=ids,
            probe=probe,
            hit_clusters=tuple(sorted(resident)),
            missed_clusters=tuple(missed),
            hit_rate=float(np.mean([hit_fraction(row, resident) for row in probe.tolist()])),
            fast_ms=fast_ms,
            slow_ms=slow_ms,
            total_ms=total_ms,
            prefetch=self._finished_report(),
            prefetch_error=self._prefetch_error(),
        )

    def _search_tier(self, q, probe, store: ClusterStore, cluster_ids, k):
        """Read ``cluster_ids`` from ``store`` and search them; wall time includes the read."""
        t0 = time.perf_counter()
        (scores, ids), _ = self._search_blocks_timed(q, probe, store.get(cluster_ids), k)
        return (scores, ids), (time.perf_counter() - t0) * 1e3

    def _search_blocks_timed(self, q, probe, blocks: dict[int, ClusterBlock], k):
        """``search_blocks`` on the blocks' device; result on CPU, with its wall time (ms)."""
        t0 = time.perf_counter()
        device = next(iter(blocks.values())).device
        scores, ids = search_blocks(q.to(device), probe.to(device), blocks, k, self.quantizer.metric)  # [B, k] x2
        return (scores.cpu(), ids.cpu()), (time.perf_counter() - t0) * 1e3

    def search_stages(self, query: Query, n_stages: int, k: int | None = None, nprobe: int | None = None) -> Iterator[Stage]:
        """Running top-k after each group of probed clusters (centroid order), fast tier first choice.

        The last stage equals ``search``; scoring runs on the CPU.
        """
        k = k or self.search_config.k
        nprobe = nprobe or self.search_config.nprobe
        q = self._embed(query)  # [B, d]
        if self.config.cancel_prefetch_on_search and self._current is not None:
            self._current.cancel()
        probe = self.quantizer.assign(q, nprobe)  # [B, nprobe]
        return staged_search(q, probe, k, self.quantizer.metric, self._fetch_cpu, n_stages)

    def _fetch_cpu(self, cluster_ids: list[int]) -> dict[int, ClusterBlock]:
        blocks = self.fast.get(cluster_ids)
        missed = [c for c in cluster_ids if c not in blocks]
        blocks.update(self.slow.get(missed))
        return {c: b.to("cpu") for c, b in blocks.items()}

    # -- budget profile ------------------------------------------------------------------------

    def measure_bandwidth(self, n_clusters: int | None = None, cold: bool = True) -> BandwidthProfile:
        """Time slow -> fast copies of a few clusters (page cache dropped first when ``cold``)."""
        return measure_bandwidth(self.slow, self.fast.device, n_clusters or self.config.bandwidth_sample_clusters, cold)

    def profile_budget(self, llm_times_s: Sequence[float], bandwidth: BandwidthProfile | None = None) -> int:
        """Set the prefetch budget to b_p = bandwidth x mean LLM time; returns it (bytes)."""
        bandwidth = bandwidth or self.measure_bandwidth()
        budget = prefetch_budget(bandwidth.bytes_per_s, llm_times_s)
        self.config = self.config.model_copy(update={"budget_bytes": budget})
        return budget

    # -- housekeeping ----------------------------------------------------------------------------

    def clear_fast_tier(self) -> None:
        """Cancel and wait for any prefetch, then empty the fast tier."""
        if self._current is not None:
            self._current.cancel()
            self._current.join()  # an error stays on the handle and in the next search's result
        self.fast.clear()

    def close(self) -> None:
        if self._current is not None:
            self._current.cancel()
        self._prefetch_pool.shutdown(wait=True)
        self._slow_pool.shutdown(wait=True)

    def __enter__(self) -> "LookaheadRetriever":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _embed(self, query: Query) -> torch.Tensor:
        if isinstance(query, (torch.Tensor, np.ndarray)):
            q = torch.as_tensor(query, dtype=torch.float32).cpu()
            return q[None, :] if q.dim() == 1 else q  # [B, d]
        if self._embed_fn is None:
            raise ConfigError("this retriever has no embedder; pass query vectors or build it with from_index()")
        return self._embed_fn(query)

    def _finished_report(self) -> PrefetchReport | None:
        handle = self._current
        if handle is None or not handle.done() or handle.error() is not None:
            return None
        return handle.wait()

    def _prefetch_error(self) -> str | None:
        handle = self._current
        error = handle.error() if handle is not None else None
        return None if error is None else f"{type(error).__name__}: {error}"


def measure_bandwidth(slow: ClusterStore, fast_device: torch.device | str, n_clusters: int, cold: bool = True) -> BandwidthProfile:
    """Bytes per second of reading ``n_clusters`` non-empty clusters from ``slow`` onto ``fast_device``."""
    fast_device = torch.device(fast_device)
    if cold:
        slow.drop_page_cache()
    nbytes, start = 0, time.perf_counter()
    sampled = 0
    for cid in slow.cluster_ids():
        if sampled == n_clusters:
            break
        block = getattr(slow, "read", slow.get)([cid])[cid]  # a memory-mapped tier's get() would copy nothing
        if block.ids.numel() == 0:
            continue
        nbytes += block.to(fast_device).nbytes
        sampled += 1
    if fast_device.type == "cuda":
        torch.cuda.synchronize(fast_device)
    return BandwidthProfile(nbytes=nbytes, seconds=time.perf_counter() - start)
