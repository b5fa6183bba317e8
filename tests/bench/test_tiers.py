"""``cachedrag bench tiers`` end to end on a tiny model and corpus (CPU, disk, Redis, restart)."""

from __future__ import annotations

import json

import pytest

from cachedrag.cli import main

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # 16 s (make test-slow)
def test_bench_tiers_reports_every_tier_and_restart(tiny_model_dir, tiny_corpus, tmp_path, capsys):
    corpus, questions = tiny_corpus
    out = tmp_path / "tiers.json"
    rc = main(["bench", "tiers", "--corpus", corpus, "--questions", questions, "--model", tiny_model_dir,
               "--device", "cpu", "--top-k", "2", "--chunk-tokens", "48", "--max-new-tokens", "2",
               "--tier-bytes", str(64 << 20), "--load-samples", "3", "--threads", "1", "--disk-dir", str(tmp_path / "caches"),
               "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    tiers = data["tiers"]
    assert {"cpu", "disk"} <= set(tiers) and "gpu" in data["skipped"]
    assert "redis" in tiers or "redis" in data["skipped"]
    for name, row in tiers.items():
        for key in ("load_s_per_chunk", "recompute_s_per_chunk", "ttft_median_s"):
            assert row[key] is not None and row[key] > 0, (name, key)
        assert row["chunk_hit_rate"] > 0.5, name  # the replay is served from the tier
        assert row["bytes_per_token_ratio"] >= 1.0
    assert tiers["cpu"]["bytes_per_token_ratio"] == pytest.approx(1.0, abs=0.01)  # K/V + 4 B token_inter
    assert data["bytes_per_token_ratio"] == max(r["bytes_per_token_ratio"] for r in tiers.values())
    assert data["budget_overruns"] == 0 and data["budget_samples"] > 0
    assert "invariant_problems" not in data
    assert data["restart_chunk_hit_rate"] > 0 and data["restart"]["first_request_chunk_hit_rate"] > 0
    assert data["restart"]["problems"] == [] and data["restart"]["rebuild"]["tree_nodes"] > 0
    mixed = data["mixed"]
    assert mixed["store"]["demotions"] + mixed["store"]["drops"] > 0  # the small tiers overflowed
    assert data["recompute"]["chunk_hit_rate"] == 0.0
    assert data["targets"]["budget_overruns_zero"] and data["targets"]["restart_reuses_caches"]
    assert "chunk caches per tier" in capsys.readouterr().out
