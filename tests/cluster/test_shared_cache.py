"""Cross-replica reuse through the shared Redis tier: two engines (two replicas' worth: each its
own CPU tier) share one real Redis; a chunk computed by A is served to B from Redis, and the
answer is the one full recompute gives (prefix mode: exact reuse) or the one A itself gives
from its own cache (cachedrag mode)."""

from __future__ import annotations

import pytest

from cachedrag.cluster.replica import ReplicaSettings, SharedCacheSync, build_replica_engine
from cachedrag.server.config import EngineSettings

pytestmark = pytest.mark.redis

SYSTEM = "You answer from the documents."
DOCS = [f"Document {i}: " + " ".join(["alpha", "beta", "gamma", "delta", "omega"][(i + j) % 5] for j in range(12))
        for i in range(4)]


def replicas(redis_server, prefix, mode):
    engine = EngineSettings(tiny=True, mode=mode, cache_gb=0.01, redis_url=redis_server.url, redis_gb=0.05)
    settings = ReplicaSettings(engine=engine, redis_prefix=prefix, engine_overrides={"break_even_factor": 1e6})
    return build_replica_engine(settings), build_replica_engine(settings)


def ask(engine, chunks, question="Which words?"):
    return engine.generate(chunks, question, SYSTEM, max_new_tokens=6)


@pytest.mark.parametrize("mode", ["prefix", "cachedrag"])
def test_chunks_computed_by_one_replica_are_served_to_another_from_redis(redis_server, redis_prefix, mode):
    a, b = replicas(redis_server, redis_prefix, mode)
    first = ask(a, DOCS[:3])
    assert first.chunks_hit == 0
    sync = SharedCacheSync(b.manager, interval_s=0)
    assert sync.shared
    assert sync.refresh_now() > 0  # B adopts what A wrote
    redis_hits = b.manager.store.tier("redis").stats.hits
    served = ask(b, DOCS[:3])
    assert served.chunks_hit == 3 and served.chunks_missed == 0
    assert b.manager.store.tier("redis").stats.hits > redis_hits  # loaded from Redis, not B's own tier
    again_on_a = ask(a, DOCS[:3])  # A from its own CPU tier: the same reuse
    assert served.token_ids == again_on_a.token_ids
    assert served.token_logprobs == pytest.approx(again_on_a.token_logprobs, abs=2e-5)
    if mode == "prefix":  # exact-prefix reuse: equal to full recompute
        reference = b.generate(DOCS[:3], "Which words?", SYSTEM, max_new_tokens=6, mode="full")
        assert served.token_ids == reference.token_ids
        assert served.token_logprobs == pytest.approx(reference.token_logprobs, abs=2e-4)
    assert b.manager.store.check_invariants() == [] and b.manager.check() == []


def test_sync_is_rate_limited_and_skips_unshared_stores(redis_server, redis_prefix):
    a, b = replicas(redis_server, redis_prefix, "cachedrag")
    sync = SharedCacheSync(b.manager, interval_s=3600)
    assert sync.poke()  # the first one is due
    sync.close()  # waits for it
    assert sync.refreshes == 1 and not sync.poke()  # not again within the interval
    ask(a, DOCS[1:3])
    assert ask(b, DOCS[1:3]).chunks_hit == 0  # B has not looked yet: computes, never a wrong answer
    local = build_replica_engine(ReplicaSettings(engine=EngineSettings(tiny=True, cache_gb=0.01)))
    assert not SharedCacheSync(local.manager).poke()
