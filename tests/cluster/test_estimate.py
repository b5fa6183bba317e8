"""The paper estimate over the trace simulator: orderings that must hold, not figures."""

from __future__ import annotations

from cachedrag.cluster.estimate import format_estimate, scale_estimate


def test_affinity_keeps_hit_rate_that_round_robin_loses_and_redis_adds_the_rest():
    rows = scale_estimate(replicas=(1, 4), corpus_docs=(2_000,), n_requests=800, replica_cache_tokens=30_000)
    by = {(r["replicas"], r["routing"]): r for r in rows}
    one1, one4, rr, aff = by[(1, "one")], by[(4, "one")], by[(4, "round_robin")], by[(4, "affinity")]
    assert rr["local_hit_rate"] < aff["local_hit_rate"] <= one4["local_hit_rate"] + 1e-9
    assert one1["local_hit_rate"] < one4["local_hit_rate"]  # 4x the cache in one place
    for r in rows:
        assert r["shared_hit_rate"] >= r["local_hit_rate"]
        assert r["ttft_rel_with_redis"] <= r["ttft_rel_no_sharing"] + 1e-9
        assert 0 < r["ttft_rel_with_redis"] <= 1
    assert aff["ttft_rel_no_sharing"] < rr["ttft_rel_no_sharing"]
    assert "affinity" in format_estimate(rows)


def test_bigger_corpora_lower_the_hit_rate_at_a_fixed_cache():
    rows = scale_estimate(replicas=(2,), corpus_docs=(500, 4_000), n_requests=600)
    aff = [r for r in rows if r["routing"] == "affinity"]
    assert aff[0]["local_hit_rate"] > aff[1]["local_hit_rate"]
