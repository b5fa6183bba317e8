"""Concurrent ``generate`` through one engine over a TieredStore (small CPU tier + disk): 8 threads
x 50 requests, entries promoted and demoted under the requests' feet, budgets sampled all along.

What is asserted, and why it is meaningful:

- ``prefix`` mode: exact-prefix reuse is full prefill (same K/V, same positions), so every
  concurrent answer must equal the ``full`` answer of the same request, computed alone, to
  float rounding: tokens equal, log-probs within 2e-5 (reuse vs full differ by ~5e-7 here).
  The tiny model's weights are random and its distributions flat, so tokens alone would say
  little; the log-probs do: another chunk in one slot, or the same chunks in another order,
  moves them by 1e-3 to 6e-3 (measured), 50x the tolerance. A torn entry, another key's KV or
  a half-written file cannot pass.
- ``cachedrag`` mode: answers depend on which cached variant is reused and what is recomputed,
  i.e. on cache state. The state is frozen first (one variant per chunk, every chunk already
  cached, budgets that never drop an entry: the planner then decides the same way whatever the
  order), which a single-threaded pass confirms (nothing new is stored); every concurrent answer
  must then equal the single-threaded answer of the same request.
"""

from __future__ import annotations

import random
import threading

import pytest

from cachedrag.engine import CachedEngine
from cachedrag.fingerprint import namespace_for
from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.manager import ChunkCacheManager
from cachedrag.store.config import StoreConfig
from cachedrag.store.tiered import TieredStore
from tests.store.helpers import disk_bytes_on_disk
from tests.store.test_engine_persistence import SYSTEM, engine_config, runner  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(180)

THREADS = 8
PER_THREAD = 50
_rng = random.Random(11)
DOCS = [f"Note {i}: " + " ".join(_rng.choice(["ant", "bee", "cat", "dog", "eel", "fox", "gnu"]) for _ in range(7))
        for i in range(9)]
REQUESTS = [(_rng.sample(DOCS, 3), f"Question {j}?") for j in range(12)]


class BudgetSampler:
    """Samples every tier's usage (and the disk directory's real allocated bytes) in a thread."""

    def __init__(self, store: TieredStore, disk_dir):
        self.store, self.disk_dir = store, disk_dir
        self.samples, self.overruns = 0, []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._sample()
        except BaseException as exc:  # re-raised by __exit__: a dead sampler must fail the test
            self.error = exc

    def _sample(self) -> None:
        while not self._stop.is_set():
            for tier in self.store.tiers:
                if tier.used_bytes > tier.budget_bytes:
                    self.overruns.append(f"{tier.name}: {tier.used_bytes} > {tier.budget_bytes}")
            on_disk = disk_bytes_on_disk(self.disk_dir)[0]
            if on_disk > self.store.tier("disk").budget_bytes:
                self.overruns.append(f"disk directory: {on_disk} bytes")
            self.samples += 1
            self._stop.wait(0.002)

    def __enter__(self) -> BudgetSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error


def build(runner, tmp_path, mode: str, cache: CacheConfig | None = None) -> tuple[CachedEngine, TieredStore]:
    cfg = engine_config(mode)
    if cache is not None:
        cfg = cfg.model_copy(update={"cache": cache})
    ns = namespace_for(runner.model, runner.tokenizer, cfg.tenant_salt).digest
    entry_bytes = 2 * runner.n_layers * runner.n_kv_heads * runner.head_dim * 4 * 60  # ~ one 60-token segment
    store = TieredStore.from_config(StoreConfig(namespace=ns, cpu_bytes=4 * entry_bytes, disk_dir=tmp_path,
                                                disk_bytes=64 << 20, disk_fsync=False))
    manager = ChunkCacheManager(store, cfg.cache, capacity_bytes=None)  # the tiers' budgets govern
    return CachedEngine(runner, config=cfg, manager=manager), store


def ask(engine, i: int):
    chunks, question = REQUESTS[i]
    return engine.generate(chunks, question, SYSTEM, max_new_tokens=4)


def hammer(engine, check) -> list:
    """THREADS threads x PER_THREAD requests drawn at random; ``check(i, result)`` on each."""
    errors: list[BaseException] = []
    results: list = []
    lock = threading.Lock()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(PER_THREAD):
                i = rng.randrange(len(REQUESTS))
                r = ask(engine, i)
                check(i, r)
                with lock:
                    results.append(r)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(results) == THREADS * PER_THREAD
    return results


def test_prefix_mode_concurrent_answers_equal_full_prefill(tmp_path, runner):
    full = CachedEngine(runner, config=engine_config("full"))
    reference = {i: ask(full, i) for i in range(len(REQUESTS))}
    engine, store = build(runner, tmp_path, "prefix")

    def check(i, r):
        assert r.token_ids == reference[i].token_ids, f"request {i}: {r.notes}"
        assert r.token_logprobs == pytest.approx(reference[i].token_logprobs, abs=2e-5)

    with BudgetSampler(store, tmp_path) as sampler:
        results = hammer(engine, check)
    assert sampler.samples > 10 and sampler.overruns == []
    assert sum(r.prefix_hit_tokens for r in results) > 0
    s = store.stats_dict()["store"]
    assert s["promotions"] > 0 and s["demotions"] > 0  # entries moved between the tiers meanwhile
    assert store.check_invariants() == [] and engine.manager.check() == []
    assert disk_bytes_on_disk(tmp_path)[0] == store.tier("disk").used_bytes
    store.close()


def test_cachedrag_mode_concurrent_answers_equal_single_threaded(tmp_path, runner):
    # exact.repeats=0: a promotion would store exact paths on the second pass (the state must stay frozen)
    engine, store = build(runner, tmp_path, "cachedrag", CacheConfig(max_variants_per_chunk=1, exact={"repeats": 0}))
    for i in range(len(REQUESTS)):  # warm: every chunk gets its (only) variant
        ask(engine, i)
    stored = engine.manager.counters["stored"]
    reference = {i: ask(engine, i) for i in range(len(REQUESTS))}
    assert engine.manager.counters["stored"] == stored  # frozen: the planner will decide the same way
    assert sum(r.recomputed_tokens for r in reference.values()) > 0  # reuse with recompute, not only tree hits

    def check(i, r):
        assert r.token_ids == reference[i].token_ids, f"request {i}: {r.notes}"
        assert r.token_logprobs == pytest.approx(reference[i].token_logprobs, abs=1e-5)
        assert (r.chunks_hit, r.recomputed_tokens) == (reference[i].chunks_hit, reference[i].recomputed_tokens)

    with BudgetSampler(store, tmp_path) as sampler:
        hammer(engine, check)
    assert sampler.overruns == [] and engine.manager.counters["stored"] == stored
    tiers = store.stats_dict()["tiers"]
    assert tiers["cpu"]["hits"] > 0 and tiers["disk"]["hits"] > 0  # served from both tiers
    assert store.check_invariants() == [] and engine.manager.check() == []
    store.close()


def test_cachedrag_mode_concurrent_exact_repeats_label_only_full_prefill_answers_exact(tmp_path, runner):
    """Exact repeats under 8 threads: sequences are promoted to exact tree paths while other threads
    reuse the same chunks' approximate variants under the same keys. Every answer that reports no
    approximation must be full prefill's answer (an approximate entry taken for the exact path
    would move the log-probs by ~1e-3, 50x the tolerance), and the cache stays consistent."""
    full = CachedEngine(runner, config=engine_config("full"))
    reference = {i: ask(full, i) for i in range(len(REQUESTS))}
    engine, store = build(runner, tmp_path, "cachedrag", CacheConfig(exact={"repeats": 1}))

    def check(i, r):
        if not r.approximations:
            assert r.token_ids == reference[i].token_ids, f"request {i} labelled exact: {r.notes}"
            assert r.token_logprobs == pytest.approx(reference[i].token_logprobs, abs=2e-5)

    results = hammer(engine, check)
    assert any(r.exact_repeat == "promoted" for r in results)  # promotions ran under the threads
    assert any(r.approximations for r in results) and any(not r.approximations for r in results)
    for i in range(len(REQUESTS)):
        check(i, ask(engine, i))
    assert store.check_invariants() == [] and engine.manager.check() == []
    store.close()
