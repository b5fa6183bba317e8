"""The planning micro-benchmark (cachedrag_bench.planning)."""

from cachedrag_bench.planning import benchmark_planning


def test_benchmark_planning_reports_sane_numbers():
    r = benchmark_planning(n_chunks=10_000, n_requests=300, top_k=5)
    assert r["n_chunks"] == 10_000 and r["n_variants"] == 20_000 and r["n_requests"] == 300
    assert 0 < r["plan_us_p50"] <= r["plan_us_p99"] <= r["plan_us_max"]
    assert r["plan_us_mean"] > 0 and r["release_us_mean"] > 0
    for k in ("under_1ms_fraction", "tree_hit_chunk_fraction", "reused_chunk_fraction", "mean_compute_fraction"):
        assert 0.0 <= r[k] <= 1.0
    assert r["tree_hit_chunk_fraction"] + r["reused_chunk_fraction"] <= 1.0
    assert r["tree_nodes"] > 0
