"""Prometheus metrics of one server (``GET /metrics``), through ``prometheus_client``.

Owns: ``ServerMetrics``, a private ``CollectorRegistry`` (so several apps in one process, as
in tests, never collide) with request counts by endpoint and status, TTFT and per-output-token
latency histograms, decode batch sizes, queue length and running requests, prompt / cached /
completion token counters, chunk hits and misses, requests served as exact tree paths, admissions
(contested, reordered, preempted), exact-repeat promotions (stored, yielded, pending), idle-time heap trims
(count, bytes released), the chunk cache's entries, and bytes, hits and load seconds per store
tier, and a tiered store's demotions and drops (read from the store when scraped) and the standard process metrics (``process_resident_memory_bytes``, CPU seconds).
It is the engine loop's observer (``on_step``, ``on_first_token``, ``on_token``, ``on_finished``).

Does not own: what is measured (the loop and app report it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
_TOKEN = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.12, 0.16, 0.25, 0.5, 1.0, 2.0, 5.0)


class _CacheCollector:
    """Chunk-cache entries; bytes, hits and load time per store tier; a tiered store's demotions
    and drops (read at scrape time)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        manager = self.engine.manager
        stats = manager.stats()
        entries = GaugeMetricFamily("cachedrag_cache_entries", "chunk-cache entries referenced by the manager")
        entries.add_metric([], stats.get("entries", 0))
        yield entries
        tier_bytes = GaugeMetricFamily("cachedrag_cache_bytes", "bytes of chunk KV per store tier", labels=["tier"])
        hits = CounterMetricFamily("cachedrag_tier_hits", "cached entries read from each store tier", labels=["tier"])
        load_s = CounterMetricFamily("cachedrag_tier_load_seconds", "time spent reading and decoding each store "
                                     "tier's hits", labels=["tier"])
        store = manager.store
        for tier in getattr(store, "tiers", None) or [store]:
            name = [str(getattr(tier, "name", None) or type(tier).__name__)]
            used = getattr(tier, "used_bytes", None)
            used = used() if callable(used) else used
            if used is not None:
                tier_bytes.add_metric(name, float(used))
            stats = getattr(tier, "stats", None)
            if stats is not None and hasattr(stats, "hits"):
                hits.add_metric(name, float(stats.hits))
                load_s.add_metric(name, float(stats.load_seconds))
        yield tier_bytes
        yield hits
        yield load_s
        if getattr(store, "tiers", None):  # a tiered store: entries moved down a tier, and out of the last
            stats = store.stats
            for metric, value, help_ in (
                    ("cachedrag_store_demotions", stats.demotions, "entries moved (or handed) to a slower tier"),
                    ("cachedrag_store_drops", stats.drops, "entries deleted for lack of room in every tier")):
                family = CounterMetricFamily(metric, help_)
                family.add_metric([], float(value))
                yield family


class _LoopCollector:
    """What the engine loop did: the admission order (``SchedulerPolicy`` counters), exact-repeat
    promotions, idle-time heap trims, stored conversation steps (read at scrape time)."""

    def __init__(self, loop):
        self.loop = loop

    def collect(self):
        policy = self.loop.policy
        loop = self.loop
        for name, value, help_ in (
            ("cachedrag_admissions", policy.admitted, "requests admitted to prefill"),
            ("cachedrag_contested_admissions", policy.contested,
             "admissions made while more requests waited than were admitted (the order had a choice)"),
            ("cachedrag_reordered_admissions", policy.reordered, "admissions ahead of an older waiting request"),
            ("cachedrag_preempted_prefills", policy.preempted,
             "admissions prefilled between the layers of a running prefill, ahead of it (SchedulerConfig.preempt_ratio)"),
            ("cachedrag_exact_promotions", loop.promotions,
             "exact tree paths of recurring chunk sequences computed and stored (CacheConfig.exact.repeats)"),
            ("cachedrag_exact_promotions_yielded", loop.promotions_yielded,
             "exact-path computations abandoned for an arriving request (started over later)"),
            ("cachedrag_exact_admissions", loop.exact_admissions,
             "faithful requests prefilled exactly: others waited or the answer is sent whole "
             "(SchedulerConfig.exact_when_waiting, exact_whole_answers)"),
            ("cachedrag_heap_trims", loop.heap_trims,
             "idle-time returns of freed heap memory to the OS (SchedulerConfig.trim_heap_idle_s)"),
            ("cachedrag_heap_released_bytes", loop.heap_released_bytes, "resident bytes those returns released"),
            ("cachedrag_conversation_stored_tokens", loop.remembered_tokens,
             "prompt and answer tokens of conversation steps stored as tree paths (the next step's prefix hit)"),
            ("cachedrag_conversation_store_seconds", loop.remember_s,
             "engine-loop seconds spent storing them (between decode steps)"),
        ):
            family = CounterMetricFamily(name, help_)
            family.add_metric([], float(value))
            yield family
        pending = GaugeMetricFamily("cachedrag_exact_promotions_pending", "recurring chunk sequences waiting for "
                                    "their exact tree path")
        pending.add_metric([], float(len(loop._promotions)))
        yield pending


class ServerMetrics:
    def __init__(self, engine=None, loop=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cachedrag_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("cachedrag_time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY,
                              registry=r)
        self.tpot = Histogram("cachedrag_time_per_output_token_seconds", "decode step time per output token",
                              buckets=_TOKEN, registry=r)
        self.batch = Histogram("cachedrag_decode_batch_size", "requests in one batched decode forward",
                               buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.e2e = Histogram("cachedrag_request_seconds", "arrival to last token", buckets=_LATENCY, registry=r)
        self.prefill = Histogram("cachedrag_prefill_seconds", "a finished request's prefill compute (cache loads and "
                                 "decode steps run between its layers excluded)", buckets=_LATENCY, registry=r)
        self.prefill_rows = Counter("cachedrag_prefill_rows", "prompt rows finished requests' prefills computed, "
                                    "in whole-depth equivalents (token-layers / layers)", registry=r)
        self.prompt_tokens = Counter("cachedrag_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("cachedrag_cached_prompt_tokens", "prompt tokens served from the chunk cache",
                                     registry=r)
        self.completion_tokens = Counter("cachedrag_completion_tokens", "generated tokens", registry=r)
        self.chunk_hits = Counter("cachedrag_chunk_hits", "chunk segments served from cache", registry=r)
        self.chunk_misses = Counter("cachedrag_chunk_misses", "chunk segments computed fresh", registry=r)
        self.exact_hits = Counter("cachedrag_exact_hit_requests", "finished requests that reused cached chunks with "
                                  "no approximation (an exact knowledge-tree path)", registry=r)
        self.tie_guarded = Counter("cachedrag_tie_guarded_requests", "finished requests whose approximate prefill "
                                   "ended in a near-tied first token and were prefilled again exactly "
                                   "(CacheConfig.exact.tie_guard)", registry=r)
        self.tie_switched = Counter("cachedrag_tie_guard_switches", "finished requests whose answer met a near tie "
                                    "while decoding on approximate KV and went on from an exact prefill of the prompt "
                                    "and the answer so far (CacheConfig.exact.tie_guard_decode)", registry=r)
        self.disconnects = Counter("cachedrag_client_disconnects", "requests whose client went away", registry=r)
        self.queue = Gauge("cachedrag_queue_length", "requests waiting for prefill", registry=r)
        self.running = Gauge("cachedrag_running_requests", "requests decoding", registry=r)
        if loop is not None:
            self.queue.set_function(lambda: loop.waiting)
            self.running.set_function(lambda: loop.running)
            r.register(_LoopCollector(loop))
        if engine is not None:
            r.register(_CacheCollector(engine))
        ProcessCollector(registry=r)  # process_resident_memory_bytes and the rest of the standard process metrics

    # ------------------------------------------------------------------ loop observer
    def on_step(self, batch_size: int, waiting: int) -> None:
        self.batch.observe(batch_size)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_token(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def on_finished(self, done) -> None:
        self.e2e.observe(done.total_s)
        if "prefill_s" in done.stats:
            self.prefill.observe(done.stats["prefill_s"])
            self.prefill_rows.inc(done.stats.get("computed_fraction", 0.0) * done.prompt_tokens)
        self.prompt_tokens.inc(done.prompt_tokens)
        self.cached_tokens.inc(done.cached_tokens)
        self.completion_tokens.inc(done.completion_tokens)
        self.chunk_hits.inc(done.stats.get("chunks_hit", 0))
        self.chunk_misses.inc(done.stats.get("chunks_missed", 0))
        if done.stats.get("chunks_hit", 0) and not done.stats.get("approximations"):
            self.exact_hits.inc()
        if done.stats.get("tie_guard") is not None:
            self.tie_guarded.inc()
        if done.stats.get("tie_guard_switch") is not None:
            self.tie_switched.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
