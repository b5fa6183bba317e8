"""The question pre-pass with fixed shapes (``model/question_graph.py``) against the eager pass
(``CachedEngine._question_scores``, the reference): the padded static pass on the CPU, the same pass
captured as a CUDA graph and replayed on a GPU (marked gpu). Same scores over the same loaded
buffer, a NaN-filled buffer's unwritten rows never reach it, the same prefill, and the fallbacks
(too many rows, hidden rows, leading fresh rows shared with the prefill) run the eager pass."""

from __future__ import annotations

import math

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.model import question_graph
from cachedrag.model.question_graph import QuestionPassGraphs
from cachedrag.testing import tiny_runner

CHUNKS = [f"Chunk {i}: the quick brown fox jumps over the lazy dog; {i} pack my box." for i in range(5)]
SYSTEM = "sys"
WARM = [2, 1, 0]  # cached by the warm-up
ORDERS = [[1, 0, 2], [2, 0, 1, 3], [0, 3, 1, 4, 2]]  # all reused / one fresh after reuse / two
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _engine(question_pass: str, device: str = "cpu", dtype: str = "float32", fill=None, fresh: str = "all",
            arch: str = "llama"):
    runner = tiny_runner(arch, seed=5, device=device, dtype=dtype)
    cache = CacheConfig(recompute_ratio=0.27, token_choice="question+inter", question_pass_fresh=fresh,
                        exact={"repeats": 0})  # a repeated sequence would be served exactly: no pre-pass to compare
    engine = CachedEngine(runner, config=EngineConfig(cache=cache))
    engine.question_pass = question_pass
    engine.buffer_fill = fill
    engine.generate([CHUNKS[i] for i in WARM], "warm up", SYSTEM, max_new_tokens=1)
    return engine


def _calls(engine, order, question="which chunk names the fox?"):
    """Prefill ``order``; returns (prefill, [the pre-pass's scores and, where the static pass ran,
    the eager pass's over a copy of the same loaded buffer])."""
    calls = []
    original = engine._question_scores

    def spy(ids, kv, total, fresh_pos, question_pos, plan, deferred, load_layer, lead=None, hidden=()):
        for layer in range(engine.runner.n_layers):
            load_layer(layer)  # idempotent: everything loaded before the copy
        twin = engine.runner.new_kv(kv.capacity)
        twin.k.copy_(kv.k)
        twin.v.copy_(kv.v)
        got = original(ids, kv, total, fresh_pos, question_pos, plan, deferred, load_layer, lead=lead, hidden=hidden)
        chosen = engine.question_pass
        engine.question_pass = "eager"
        try:
            want = original(ids, twin, total, fresh_pos, question_pos, plan, deferred, lambda layer: None,
                            lead=lead, hidden=hidden)
        finally:
            engine.question_pass = chosen
        calls.append(dict(got=got.clone(), want=want, total=total, hidden=list(hidden),
                          deferred=[(plan.segments[i].start, plan.segments[i].end) for i in deferred]))
        return got

    engine._question_scores = spy
    segs = engine.prompts.chat([CHUNKS[i] for i in order], question, SYSTEM)
    return engine.prefill(segs, 2), calls


@pytest.mark.parametrize("order", ORDERS)
def test_static_pass_scores_equal_the_eager_pass(order):
    engine = _engine("static")
    pre, calls = _calls(engine, order)
    assert pre.info["chunks_hit"] == 3
    (call,) = calls
    assert call["got"].shape == (call["total"],) and torch.isfinite(call["got"]).all()
    torch.testing.assert_close(call["got"], call["want"], atol=1e-5, rtol=1e-4)
    assert engine.question_graphs.passes == 1  # the static pass served it (not the eager fallback)
    inside = sum(float(call["got"][start:end].sum()) for start, end in call["deferred"])
    assert inside == pytest.approx(len(engine._question_layers()), rel=1e-4)  # each scoring layer sums to 1 there


@pytest.mark.parametrize("order", ORDERS[:2])
def test_unwritten_rows_never_reach_the_static_pass(order):
    """NaN in every unwritten row (past the prompt, and the fresh rows not yet computed): same scores as zeros."""
    _, nan_calls = _calls(_engine("static", fill=math.nan), order)
    _, zero_calls = _calls(_engine("static", fill=0.0), order)
    assert torch.isfinite(nan_calls[0]["got"]).all()
    torch.testing.assert_close(nan_calls[0]["got"], zero_calls[0]["got"], atol=0, rtol=0)


@pytest.mark.parametrize("order", ORDERS)
def test_static_pass_prefills_as_the_eager_pass(order):
    """Same tokens picked (the scores agree to rounding), so the same recompute and answer."""
    want = _engine("eager").generate([CHUNKS[i] for i in order], "which chunk names the fox?", SYSTEM,
                                     max_new_tokens=6)
    got = _engine("static").generate([CHUNKS[i] for i in order], "which chunk names the fox?", SYSTEM,
                                     max_new_tokens=6)
    assert got.computed_tokens == want.computed_tokens
    assert got.token_ids == want.token_ids


def test_rows_past_the_largest_bucket_run_the_eager_pass(monkeypatch):
    engine = _engine("static")
    monkeypatch.setattr(question_graph, "MAX_ROWS", 16)
    _, calls = _calls(engine, ORDERS[0], question="which chunk names the fox, the dog and the box? " * 2)
    torch.testing.assert_close(calls[0]["got"], calls[0]["want"], atol=0, rtol=0)  # the eager pass itself
    assert engine.question_graphs.passes == 0


def test_leading_fresh_rows_run_the_eager_pass():
    """A fresh chunk before every reused one: the prefill takes its pre-pass rows over (``_Lead``)."""
    engine = _engine("static")
    _, calls = _calls(engine, [3, 0, 1])
    torch.testing.assert_close(calls[0]["got"], calls[0]["want"], atol=0, rtol=0)
    assert engine.question_graphs.passes == 0


def test_hidden_rows_run_the_eager_pass():
    """question_pass_fresh="leading" hides fresh chunks after a reused one: the eager pass masks them."""
    engine = _engine("static", fresh="leading")
    _, calls = _calls(engine, ORDERS[1])
    assert calls[0]["hidden"]
    torch.testing.assert_close(calls[0]["got"], calls[0]["want"], atol=0, rtol=0)
    assert engine.question_graphs.passes == 0


def test_question_pass_is_validated():
    engine = _engine("eager")
    engine.question_pass = "graph"
    with pytest.raises(ConfigError, match="question_pass"):
        engine.generate([CHUNKS[i] for i in ORDERS[0]], "q?", SYSTEM, max_new_tokens=1)
    engine.question_pass = "cuda-graph"
    with pytest.raises(ConfigError, match="CUDA"):
        engine.generate([CHUNKS[i] for i in ORDERS[0]], "q?", SYSTEM, max_new_tokens=1)


def test_engines_default_to_the_eager_pass():
    """The captured pass is opt-in until a GPU run proves it (docs/gpu.md)."""
    assert CachedEngine(tiny_runner("llama", seed=5)).question_pass == "eager"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype,atol", [("float32", 1e-4), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_captured_pass_equals_the_eager_pass_on_cuda(dtype, atol, arch):
    engine = _engine("cuda-graph", device="cuda", dtype=dtype, arch=arch)
    for order in ORDERS:
        _, calls = _calls(engine, order)
        torch.testing.assert_close(calls[0]["got"], calls[0]["want"], atol=atol, rtol=0)
    graphs = engine.question_graphs
    assert isinstance(graphs, QuestionPassGraphs) and graphs.capture and graphs.failed is None
    assert graphs.passes == len(ORDERS) and 1 <= graphs.captures <= graphs.passes


def _three_requests_of_one_size(engine) -> None:
    for order, animal in (([1, 0, 2], "fox"), ([0, 2, 1], "dog"), ([1, 2, 0], "box")):  # same sizes, new orders
        r = engine.generate([CHUNKS[i] for i in order], f"which chunk names the {animal}?", SYSTEM, max_new_tokens=4)
        assert r.chunks_hit == 3 and r.approximations


def test_each_reuse_request_takes_one_static_pass():
    engine = _engine("static", fill=math.nan)
    _three_requests_of_one_size(engine)
    assert engine.question_graphs.passes == 3 and engine.question_graphs.captures == 0


@pytest.mark.gpu
@cuda
def test_captured_pass_is_replayed_for_the_next_request_of_its_size():
    engine = _engine("cuda-graph", device="cuda", fill=math.nan)
    _three_requests_of_one_size(engine)
    graphs = engine.question_graphs
    assert graphs.failed is None
    assert graphs.passes == 3 and graphs.captures == 1  # same buffer size, same row bucket


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("order", ORDERS)
def test_captured_pass_prefills_as_the_eager_pass_on_cuda(order):
    question = "which chunk names the fox?"
    want = _engine("eager", device="cuda").generate([CHUNKS[i] for i in order], question, SYSTEM, max_new_tokens=6)
    got = _engine("cuda-graph", device="cuda").generate([CHUNKS[i] for i in order], question, SYSTEM,
                                                        max_new_tokens=6)
    assert got.computed_tokens == want.computed_tokens
    assert got.token_ids == want.token_ids
