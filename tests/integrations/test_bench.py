"""The integrations bench: its baseline LLM (plain transformers) and a tiny side-by-side run."""

from __future__ import annotations

import pytest
from llama_index.core.llms import ChatMessage

from cachedrag_bench.integrations import TransformersLLM, compare
from cachedrag.cli import build_parser
from cachedrag.engine import CachedEngine
from cachedrag.integrations.llama_index import CachedRAGLLM

from .conftest import tiny_long_runner


@pytest.fixture(scope="module")
def runner():
    return tiny_long_runner()


def test_baseline_matches_cachedrag_greedy_output(runner):
    baseline = TransformersLLM(model=runner.model, tokenizer=runner.tokenizer, max_new_tokens=8)
    msgs = [ChatMessage(role="user", content="hello there")]
    text = baseline.chat(msgs).message.content
    assert "".join(r.delta for r in baseline.stream_chat(msgs)) == text
    assert baseline.last_ttft_s > 0 and baseline.last_prompt_tokens > 0
    # same weights, same template, greedy: the HF generate baseline and cachedrag agree
    assert CachedRAGLLM(engine=CachedEngine(runner), max_new_tokens=8).chat(msgs).message.content == text


def test_compare_side_by_side(runner, tiny_index_dir):
    questions = ["How do I pretty-print JSON?", "What does uuid4 do?", "How do I pretty-print JSON?"]
    res = compare(CachedEngine(runner), runner, tiny_index_dir, questions, top_k=2, max_new_tokens=4, warmup=1)
    assert res["n_requests"] == 2
    for name in ("cachedrag", "baseline"):
        assert res[name]["ttft_median_s"] > 0 and res[name]["prompt_tokens_mean"] > 0
    assert res["cachedrag"]["registered_chunks_per_request"] == 2
    assert res["ttft_speedup"] == pytest.approx(res["baseline"]["ttft_median_s"] / res["cachedrag"]["ttft_median_s"])
    assert res["same_answer_fraction"] == 1.0


def test_cli_registers_the_suite():
    args = build_parser().parse_args(["bench", "integrations", "--requests", "4", "--json", "out.json"])
    assert args.requests == 4 and args.json_out == "out.json" and args.top_k == 5
