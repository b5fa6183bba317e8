"""The chunk-cache engine: equivalence with full prefill, mode semantics, bad input, safety."""

from __future__ import annotations

import threading

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.errors import ConfigError, ContextWindowError, EmptyInputError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.testing import tiny_runner

CHUNKS = [
    "The heapq module provides an implementation of the heap queue algorithm. " * 2,
    "bisect.insort inserts an item into a sorted list keeping it sorted. " * 2,
    "functools.lru_cache memoizes a function with a bounded cache. " * 2,
    "textwrap.fill wraps a paragraph so every line is at most width characters. " * 2,
]
SYSTEM = "Answer from the excerpts."


@pytest.fixture
def runner():
    return tiny_runner("qwen2", seed=3)


def _engine(runner, **kw):
    cache = kw.pop("cache", {})
    return CachedEngine(runner, config=EngineConfig(cache=CacheConfig(**cache), **kw))


def _logits(engine, chunks, question, mode=None):
    segs = engine.prompts.chat(chunks, question, SYSTEM)
    return engine.prefill_logits(segs, mode=mode)


def test_full_recompute_of_reused_chunks_equals_full_prefill(runner):
    # the recomputed rows in the runner's own precision (the reference; bfloat16 repairs, the default,
    # are close to it: tests/test_engine_scoring.py)
    engine = _engine(runner, early_termination=False, cache={"recompute_ratio": 1.0,
                                                             "precision": {"recompute": "float32", "fresh": "float32"}})
    engine.generate(CHUNKS[:3], "warm up", SYSTEM, max_new_tokens=1)
    reordered = [CHUNKS[2], CHUNKS[0], CHUNKS[1]]  # every chunk cached, none in exact-prefix order
    r = engine.generate(reordered, "which module memoizes?", SYSTEM, max_new_tokens=1)
    assert r.chunks_hit == 3 and r.prefix_hit_tokens < r.prompt_tokens - r.question_tokens
    got = _logits(engine, reordered, "which module memoizes?")
    expected = _logits(engine, reordered, "which module memoizes?", mode="full")
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_exact_prefix_reuse_gives_full_logits(runner):
    engine = _engine(runner, mode="prefix")
    engine.generate(CHUNKS[:3], "first question", SYSTEM, max_new_tokens=1)
    r = engine.generate(CHUNKS[:3], "second question", SYSTEM, max_new_tokens=1)
    assert r.chunks_hit == 3 and r.computed_tokens == r.question_tokens
    torch.testing.assert_close(_logits(engine, CHUNKS[:3], "second question"),
                               _logits(engine, CHUNKS[:3], "second question", mode="full"), atol=1e-5, rtol=0)


def test_modes_read_what_they_should(runner):
    engines = {m: _engine(runner, mode=m, early_termination=False) for m in ("full", "prefix", "naive", "random", "cachedrag")}
    for e in engines.values():
        e.generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)
    order = [CHUNKS[1], CHUNKS[2], CHUNKS[3]]  # two cached chunks in a new context, one new chunk
    r = {m: e.generate(order, "what inserts?", SYSTEM, max_new_tokens=2) for m, e in engines.items()}
    assert r["full"].chunks_hit == 0 and r["full"].computed_fraction == 1.0
    assert r["prefix"].chunks_hit == 0  # order differs right after the system prompt
    assert r["prefix"].prefix_hit_tokens > 0  # ...but the system prompt itself comes from the tree
    assert r["naive"].chunks_hit == 2 and r["naive"].recomputed_tokens == 0
    assert r["cachedrag"].chunks_hit == 2 and r["cachedrag"].recomputed_tokens > 0
    assert r["random"].recomputed_tokens == r["cachedrag"].recomputed_tokens
    assert all(c is not None for c in r["cachedrag"].chunk_cfo[:2]) and r["cachedrag"].chunk_cfo[2] is None
    assert r["cachedrag"].computed_fraction < r["prefix"].computed_fraction


def test_fresh_chunks_record_variant_metadata(runner):
    engine = _engine(runner)
    engine.generate(CHUNKS[:3], "q", SYSTEM, max_new_tokens=1)
    keys = [s.key for s in engine.prompts.chat(CHUNKS[:3], "q", SYSTEM)[1:4]]
    variants = engine.manager.index.variants(keys[2])
    assert len(variants) == 1
    meta = variants[0].meta
    assert meta.prefix_keys == tuple(keys[:2])
    assert meta.n_tokens == len(engine.prompts.chat(CHUNKS[:3], "q", SYSTEM)[3])
    assert all(0.0 <= x <= 1.0 for x in meta.token_inter) and meta.intra > 0
    assert set(meta.inter) == set(keys[:2])


def test_damaged_cache_entry_is_a_miss_not_a_wrong_answer(runner):
    engine = _engine(runner, mode="prefix")
    engine.generate(CHUNKS[:2], "q", SYSTEM, max_new_tokens=1)
    for key in list(engine.manager.store.keys()):  # entries vanish behind the planner's back
        engine.manager.store.remove(key)
    r = engine.generate(CHUNKS[:2], "q2", SYSTEM, max_new_tokens=3)
    assert r.chunks_hit == 0 and any("missing or damaged" in n for n in r.notes)
    full = engine.generate(CHUNKS[:2], "q2", SYSTEM, max_new_tokens=3, mode="full")
    assert r.token_ids == full.token_ids


def test_tenants_do_not_share_caches(runner):
    a = _engine(runner, mode="prefix", tenant_salt="a")
    b = CachedEngine(runner, config=EngineConfig(mode="prefix", tenant_salt="b"), manager=a.manager)
    a.generate(CHUNKS[:2], "q", SYSTEM, max_new_tokens=1)
    assert b.generate(CHUNKS[:2], "q", SYSTEM, max_new_tokens=1).prefix_hit_tokens == 0
    assert a.generate(CHUNKS[:2], "q", SYSTEM, max_new_tokens=1).chunks_hit == 2


def test_early_termination_computes_less(runner):
    """Two-layer model, decision allowed after layer 0, focus = chunks holding 30% of the
    question's attention: the other chunks' recompute tokens are skipped in layer 1."""
    chunks = [c[:90] for c in CHUNKS]
    on = _engine(runner, early_termination=True, cache={"recompute_ratio": 0.5,
                                "focus": {"min_layers": 1, "window": 1, "mass_threshold": 0.3}})
    off = _engine(runner, early_termination=False, cache={"recompute_ratio": 0.5})
    for e in (on, off):
        e.generate(chunks, "warm", SYSTEM, max_new_tokens=1)
    shuffled = [chunks[3], chunks[1], chunks[0], chunks[2]]
    r_on = on.generate(shuffled, "q", SYSTEM, max_new_tokens=1)
    r_off = off.generate(shuffled, "q", SYSTEM, max_new_tokens=1)
    assert r_off.focus_layer is None and r_on.focus_layer == 0
    # same plan at layer 0; the unfocused chunks' recompute tokens stop at layer 0 and count as checked
    assert r_on.computed_tokens + r_on.checked_tokens == r_off.computed_tokens + r_off.checked_tokens
    assert r_on.computed_tokens < r_off.computed_tokens and r_on.checked_tokens > r_off.checked_tokens
    assert r_on.computed_fraction < r_off.computed_fraction


def _planted(runner, token: int, **cache):
    """Warm, then plant an outlier in the cached V of chunk 1 at layer 1 (the check layer)."""
    cache.setdefault("token_choice", "deviation")
    engine = _engine(runner, early_termination=False, cache={"recompute_ratio": 0.01, **cache})
    engine.generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)
    (variant,) = engine.manager.index.variants(engine.prompts.chat(CHUNKS[:3], "q", SYSTEM)[2].key)
    with torch.inference_mode():
        engine.manager.store.peek(variant.handle).tensors["v"][1, :, token] += 100.0
    return engine.generate([CHUNKS[2], CHUNKS[1], CHUNKS[0]], "q", SYSTEM, max_new_tokens=1)


@pytest.mark.parametrize("token, on", [(7, "v"), (40, "v"), (40, "kv")])
def test_deviation_choice_recomputes_the_planted_outlier(runner, token, on):
    r = _planted(runner, token, deviation_on=on)
    assert r.chunks_hit == 3 and 0 < len(r.chunk_recompute[1]) <= 2  # ceil(0.01 x len)
    assert token in r.chunk_recompute[1]
    assert r.recomputed_tokens == sum(len(c) for c in r.chunk_recompute)
    # layer 0 probed every reused token: those not chosen are "checked", still served from cache
    assert r.checked_tokens == r.prompt_tokens - r.computed_tokens - r.prefix_hit_tokens
    assert r.cached_tokens == r.prompt_tokens - r.computed_tokens > r.checked_tokens > 0


def test_reuse_accounting_is_truthful(runner):
    """A new question over 3 cached chunks at new positions plus one new chunk: the reused chunks'
    tokens count as cached (not as computed) even though the deviation check probes them at layer 0."""
    chunks = [c[:90] for c in CHUNKS]
    engine = _engine(runner, early_termination=False, cache={"token_choice": "deviation"})
    engine.generate(chunks[:3], "warm", SYSTEM, max_new_tokens=1)
    r = engine.generate([chunks[3], chunks[2], chunks[0], chunks[1]], "a new question", SYSTEM, max_new_tokens=1)
    assert r.chunks_hit == 3 and r.chunks_missed == 1
    assert r.computed_tokens == r.fresh_tokens + r.recomputed_tokens + r.question_tokens
    assert r.cached_tokens + r.computed_tokens == r.prompt_tokens
    assert 0 < r.recomputed_tokens < r.checked_tokens  # probed all, recomputed the deviating few
    # the three reused chunks (all but their recomputed tokens) + the cached system prompt are served from cache
    reused = sum(len(s) for s in engine.prompts.chat(chunks[:3], "q", SYSTEM) if s.kind == "chunk")
    assert r.cached_tokens == r.prefix_hit_tokens + reused - r.recomputed_tokens
    full = engine.generate([chunks[3], chunks[2], chunks[0], chunks[1]], "a new question", SYSTEM, mode="full",
                           max_new_tokens=1)
    assert (full.cached_tokens, full.checked_tokens, full.computed_tokens) == (0, 0, full.prompt_tokens)


def test_a_cache_budget_below_the_working_set_keeps_the_manager_true_to_the_store(runner):
    """The default memory store and the manager share one budget: when it is full, the manager
    evicts by its policy before each put, so the store never drops an entry on its own and every
    entry the manager plans hits on is stored (before: the store dropped its least recently used
    entries, which the manager kept referencing and counting)."""
    import random

    rng = random.Random(0)
    chunks = [c[:60] + f" ({i})" for i, c in enumerate(CHUNKS * 3)]
    probe = _engine(runner)
    probe.generate(chunks[:1], "q", SYSTEM, max_new_tokens=1)
    budget = 5 * probe.manager.used_bytes  # the system prompt and ~4 chunks
    engine = _engine(runner, cache_bytes=budget)
    for i in range(12):
        r = engine.generate(rng.sample(chunks, 3), f"question {i}", SYSTEM, max_new_tokens=1)
        m = engine.manager
        assert all(m.store.contains(h) for h in m.handles()) and m.check() == []
        assert m.used_bytes == m.store.used_bytes <= budget
        assert r.chunks_hit + r.chunks_missed == 3
    assert m.store.stats.evictions == 0 and m.tree.evictions + m.index.evictions > 0


def test_inter_and_leading_choices_ignore_kv_deviation(runner):
    assert 40 not in _planted(runner, 40, token_choice="leading").chunk_recompute[1]
    assert 40 not in _planted(runner, 40, deviation_on="k").chunk_recompute[1]  # the plant is in V only
    r = _planted(runner, 40, check_layer=2)  # the tiny model has 2 layers: nothing to probe
    assert r.chunk_recompute[1] == list(range(len(r.chunk_recompute[1]))) and any("check_layer" in n for n in r.notes)


def test_stream_equals_generate(runner):
    engine = _engine(runner)
    stream = engine.generate(CHUNKS[:2], "q", SYSTEM, max_new_tokens=8, stream=True)
    text = "".join(stream)
    assert stream.result is not None and text == stream.result.text
    again = engine.generate(CHUNKS[:2], "q", SYSTEM, max_new_tokens=8, mode="prefix")
    assert again.text == text


def test_concurrent_requests_equal_sequential_in_exact_mode(runner):
    engine = _engine(runner, mode="prefix")
    requests = [(CHUNKS[i % 4: i % 4 + 2], f"question {i % 3}") for i in range(12)]
    expected = [engine.generate(c, q, SYSTEM, max_new_tokens=4, mode="full").token_ids for c, q in requests]
    got: dict[int, list[int]] = {}

    def work(i):
        c, q = requests[i]
        got[i] = engine.generate(c, q, SYSTEM, max_new_tokens=4).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(requests))] == expected


@pytest.mark.parametrize("kwargs,error", [
    ({"question": "  "}, EmptyInputError),
    ({"question": "q", "mode": "turbo"}, ConfigError),
    ({"question": "q", "chunks": ["x " * 600]}, ContextWindowError),
])
def test_bad_input_is_refused_clearly(runner, kwargs, error):
    engine = _engine(runner)
    kwargs.setdefault("chunks", CHUNKS[:1])
    with pytest.raises(error):
        engine.generate(max_new_tokens=2, **kwargs)


def _disk_engine(runner, tmp_path, mode="prefix", **cache):
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore

    probe = CachedEngine(runner)
    store = TieredStore.from_config(StoreConfig(namespace=probe.model_namespace.digest, disk_dir=str(tmp_path),
                                                disk_bytes=64 << 20))
    # a tiny model recomputes a segment in well under a millisecond: without a wide break-even
    # margin a disk read may lose the race and the segment is (correctly) recomputed instead,
    # which these tests, about what layer-wise loads deliver, must not depend on
    config = EngineConfig(mode=mode, early_termination=False, cache=CacheConfig(**cache), break_even_factor=1e6)
    return CachedEngine(runner, config=config, store=store)


@pytest.mark.parametrize("choice", ["deviation", "question+inter"])
def test_token_choice_is_the_same_with_layerwise_loading(runner, tmp_path, choice):
    """Layer-wise loads write the check layer (deviation) or the question pre-pass's layers before the
    choice is made: same tokens, same logits."""
    disk = _disk_engine(runner, tmp_path, mode="cachedrag", recompute_ratio=0.2, token_choice=choice)
    memory = _engine(runner, early_termination=False, cache={"recompute_ratio": 0.2, "token_choice": choice})
    reordered = [CHUNKS[2], CHUNKS[0], CHUNKS[1]]
    for e in (disk, memory):
        e.generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)
    r_disk, r_mem = (e.generate(reordered, "q", SYSTEM, max_new_tokens=1) for e in (disk, memory))
    assert r_disk.chunks_hit == r_mem.chunks_hit == 3 and not r_disk.notes
    assert r_disk.chunk_recompute == r_mem.chunk_recompute and r_disk.recomputed_tokens > 0
    torch.testing.assert_close(_logits(disk, reordered, "q"), _logits(memory, reordered, "q"), atol=1e-5, rtol=0)


def test_layerwise_reuse_from_disk_equals_full(runner, tmp_path):
    engine = _disk_engine(runner, tmp_path)
    engine.generate(CHUNKS[:2], "first", SYSTEM, max_new_tokens=1)
    r = engine.generate(CHUNKS[:2], "second", SYSTEM, max_new_tokens=4)
    assert r.chunks_hit == 2 and not r.notes
    full = engine.generate(CHUNKS[:2], "second", SYSTEM, max_new_tokens=4, mode="full")
    assert r.token_ids == full.token_ids
    torch.testing.assert_close(_logits(engine, CHUNKS[:2], "second"),
                               _logits(engine, CHUNKS[:2], "second", mode="full"), atol=1e-5, rtol=0)


def test_bit_flipped_disk_entry_is_recomputed_not_served(runner, tmp_path):
    engine = _disk_engine(runner, tmp_path)
    engine.generate(CHUNKS[:2], "first", SYSTEM, max_new_tokens=1)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert files
    for path in files:  # flip a byte near the end of every entry (inside the last layers' data)
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    r = engine.generate(CHUNKS[:2], "second", SYSTEM, max_new_tokens=4)
    full = engine.generate(CHUNKS[:2], "second", SYSTEM, max_new_tokens=4, mode="full")
    assert r.token_ids == full.token_ids
    assert r.chunks_hit == 0 and any("computed fresh" in n for n in r.notes)


def test_preload_chunks_promotes_candidate_caches_to_the_fastest_tier(runner, tmp_path):
    """Chunk-KV lookahead: candidates' entries move from disk to the CPU tier before the request."""
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore

    probe = CachedEngine(runner)
    cfg = StoreConfig(namespace=probe.model_namespace.digest, cpu_bytes=64 << 20, disk_dir=str(tmp_path),
                      disk_bytes=64 << 20, write_through=True)
    writer = CachedEngine(runner, config=EngineConfig(), store=TieredStore.from_config(cfg))
    writer.generate(CHUNKS[:3], "q", SYSTEM, max_new_tokens=1)
    writer.manager.store.close()  # the writing process ends (one owner per disk directory)
    reader_store = TieredStore.from_config(cfg.model_copy(update={}))  # a restarted process: all on disk
    reader = CachedEngine(runner, config=EngineConfig(), store=reader_store)
    handles = [v.handle for s in reader.prompts.chat(CHUNKS[1:3], "q", SYSTEM)[1:3]
               for v in reader.manager.index.variants(s.key)]
    assert handles and all(reader_store.where(h) == "disk" for h in handles)
    done = reader.preload_chunks(CHUNKS[1:3])
    assert done is not None
    done.wait(30)
    assert all(reader_store.where(h) == "cpu" for h in handles)
    assert reader.preload_chunks(["never seen"]) is None
