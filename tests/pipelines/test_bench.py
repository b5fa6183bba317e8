"""``cachedrag bench pipelines`` end to end at tiny size (tiny model, tiny index)."""

from __future__ import annotations

import argparse
import json

from cachedrag_bench import pipelines as bench

from .conftest import QUESTION


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_measures_every_pipeline_and_configuration(tiny_runner, tiny_index, capsys):
    args = _args("--warmup", "1", "--max-new-tokens", "4", "--decompose-tokens", "4", "--top-k", "2", "--quiet")
    questions = [QUESTION, "What does heappush do?", QUESTION]
    results = bench.measure(tiny_runner, tiny_index, questions, args)
    json.dumps(results)
    assert set(results["pipelines"]) == {"hyde", "subquestion", "iter_retgen", "flare"}
    for p in results["pipelines"].values():
        assert set(p) >= {"a", "b", "c", "d", "speedup_d_vs_a", "rouge_l_vs_a", "cluster_overlap"}
        for c in "abcd":
            assert p[c]["latency_median_s"] > 0 and p[c]["llm_s"] > 0 and p[c]["retrieval_s"] > 0
            assert 0 < p[c]["prefill_s"] <= p[c]["llm_s"] + 1e-9 and p[c]["decode_s"] >= 0
            assert 0 < p[c]["search_ms"] <= p[c]["retrieval_s"] * 1e3
        assert p["b"]["rouge_l_vs_a"] == 1.0  # same generator, same search results
        assert p["a"]["chunk_hit_rate"] is None and p["c"]["chunk_hit_rate"] is not None
        assert "draft_tokens" not in p["a"] and 0 <= p["c"]["draft_accepted"] <= p["c"]["draft_tokens"]
        assert p["c"]["generated_tokens"] > 0
        assert p["b"]["prefetch_ms"] > 0 and p["a"].get("prefetch_ms") is None
        assert p["n_requests"] == 2
    assert results["pipelines"]["iter_retgen"]["d"]["chunk_hit_rate"] > 0
    bench.print_table(results)
    assert "speedup d vs a" in capsys.readouterr().out


def test_bench_subset_and_cli_registration(tiny_runner, tiny_index):
    args = _args("--pipelines", "hyde", "--configs", "d", "--warmup", "0", "--max-new-tokens", "2", "--quiet")
    results = bench.measure(tiny_runner, tiny_index, [QUESTION], args)
    assert set(results["pipelines"]["hyde"]) >= {"a", "d"} and "b" not in results["pipelines"]["hyde"]
    from cachedrag.cli import build_parser

    parsed = build_parser().parse_args(["bench", "pipelines", "--requests", "4", "--pipelines", "flare"])
    assert parsed.requests == 4 and parsed._run is bench.run


def test_engine_linear_ablation_runs_the_engines_on_the_reference_layout(tiny_runner, tiny_index):
    from cachedrag.model.linear import reference_linear

    args = _args("--pipelines", "hyde", "--configs", "c", "--warmup", "0", "--max-new-tokens", "2", "--quiet",
                 "--engine-linear", "reference", "--draft-tokens", "0", "--recompute-ratio", "0.3")
    setup = bench._Setup(tiny_runner, tiny_index, ["a", "c"], args)
    try:
        engine_runner = setup.engines["c"].runner
        assert engine_runner.project is reference_linear and engine_runner.model is tiny_runner.model
        assert setup.engines["c"].config.cache.recompute_ratio == 0.3
    finally:
        setup.close()
    results = bench.measure(tiny_runner, tiny_index, [QUESTION], args)
    assert results["config"]["engine_linear"] == "reference" and results["pipelines"]["hyde"]["c"]["llm_s"] > 0
    assert results["config"]["draft_tokens"] == 0 and results["pipelines"]["hyde"]["c"]["draft_tokens"] == 0
