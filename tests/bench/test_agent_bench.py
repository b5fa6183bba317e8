"""``cachedrag bench agent`` on the tiny model and a tiny index: the scripted policy's records per mode,
the prefix hits from step 2 on, agreement with full prefill, and the summary's shape."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("langchain_core")

from cachedrag_bench.agent import add_arguments, measure, summarize  # noqa: E402

from cachedrag.testing import TINY_DOCS, byte_tokenizer, tiny_model  # noqa: E402

QUESTIONS = ["How do I pretty-print JSON?", "What does heappush do?", "How do I pretty-print JSON?"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from cachedrag.model.runner import ModelRunner
    from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index

    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=4096)
    model.generation_config.eos_token_id = tok.eos_token_id
    out = tmp_path_factory.mktemp("agent-bench") / "index"
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=64, overlap=8), index=IndexConfig(nlist=2))
    build_index(TINY_DOCS, tok, Embedder(), config, out=out, progress=False)
    return ModelRunner(model, tok), str(out)


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--chunks", "2", "--max-tokens", "24", "--quiet",
                              *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]])


def test_scripted_agent_steps_per_mode(setup):
    runner, index_dir = setup
    modes = ["full", "prefix", "default"]
    records = measure(runner, index_dir, QUESTIONS, 2, "scripted", modes, _args())
    assert len(records) == len(QUESTIONS) * len(modes)
    by = {(r["question"], r["mode"]): r for r in records}
    for i in range(len(QUESTIONS)):
        full, prefix, default = (by[i, m] for m in modes)
        assert all(len(r["steps"]) == 3 and len(r["calls"]) == 2 for r in (full, prefix, default))
        assert full["passages"] == prefix["passages"] == default["passages"]  # fixed sub-queries
        assert prefix["calls"] == full["calls"] and prefix["answer"] == full["answer"]  # prefix caching is exact
        for later in (1, 2):  # from step 2 on, the previous prompt is a prefix hit
            before = prefix["steps"][later - 1]["prompt_tokens"]
            assert prefix["steps"][later]["prefix_hit_tokens"] >= before
            assert default["steps"][later]["computed_tokens"] < full["steps"][later]["computed_tokens"]
    assert records[-1]["seen_before"] == 1.0  # the repeated question's passages were all seen
    summary = summarize(records, modes, 2)
    assert set(summary["modes"]) == set(modes) and summary["modes"]["prefix"]["calls_equal_full"] == 1.0
    assert summary["modes"]["default"]["steps"]["3"]["n"] == len(QUESTIONS)
    assert summary["prefix_over_default"] is not None and summary["full_over_default"] is not None


def test_auto_policy_stops_when_the_model_does_not_call(setup):
    runner, index_dir = setup
    records = measure(runner, index_dir, QUESTIONS[:1], 3, "auto", ["full"], _args())
    (r,) = records
    assert len(r["calls"]) <= 3 and len(r["steps"]) == len(r["calls"]) + 1  # the calls, then the answer
